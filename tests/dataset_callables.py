"""Callables that return a ray.data.Dataset of documents, as a user's module would: the tests name them
as `dataset: dataset_callables:NAME` (this folder is on the path of the test process; a subprocess and
its Ray workers get it through PYTHONPATH). Functions of this module that Ray Data runs on its workers
are pickled by value, so the workers of the shared test instance need not import it."""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import ray.data
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def postgres_documents(url: str, table: str) -> ray.data.Dataset:
    """A table's `body` column in `id` order, read by Ray Data's SQL connector."""
    import psycopg2

    return ray.data.read_sql(
        f"SELECT body FROM {table} ORDER BY id", functools.partial(psycopg2.connect, url)
    )


def bucket_table(uri: str) -> ray.data.Dataset:
    """A hive-partitioned parquet directory (`lang=xx/...`), local or in a bucket."""
    from mhf_dist.storage import Location

    return ray.data.read_parquet(uri, filesystem=Location.of(uri).fs)  # hive partitioning: the default


def numbered(count: int) -> ray.data.Dataset:
    """Integers in a column `id`: no `text` field."""
    return ray.data.range(count)


def numbers_as_text(count: int = 5) -> ray.data.Dataset:
    """A `text` field of int64."""
    return ray.data.from_items([{"text": index} for index in range(count)])


def nothing() -> ray.data.Dataset:
    return ray.data.from_items([{"text": "dropped"}]).filter(lambda row: False)


def not_a_dataset() -> list[dict[str, str]]:
    return [{"text": "a list, not a Dataset"}]


def _refuse(batch: dict[str, Any], token: str) -> dict[str, Any]:
    raise ConnectionResetError(f"the warehouse closed the connection (token {token})")


def failing(count: int, token: str = "none") -> ray.data.Dataset:
    """Raises as its blocks are read, naming its secret as careless libraries do."""
    return ray.data.range(count).map_batches(_refuse, fn_kwargs={"token": token})


def refuses_login(password: str) -> ray.data.Dataset:
    raise PermissionError(f"login failed with password {password}")


def _slow_text(batch: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.5)
    return {"text": [f"document {index} " + "slow words " * 40 for index in batch["id"]]}


def slow(count: int, uri: str = "") -> ray.data.Dataset:
    """`count` documents, a block each, half a second a block: a staging that can be stopped half-way.
    `uri` is not read: a change in it must still count as other arguments."""
    return ray.data.range(count, override_num_blocks=count).map_batches(_slow_text)
