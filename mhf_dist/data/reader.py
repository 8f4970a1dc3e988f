"""Reading prepared rows by index: each worker reads only its own rows, and a resume costs nothing.

**Layout.** Every parquet row group is exactly one row (`shards.write_shard`), so reading row i decodes
row i and nothing else, while the shards stay ordinary parquet files (Ray Data, pyarrow and DuckDB read
them as they are). The footer grows by about 200 bytes per row, 1% of a 1b-preset row; a memory-mapped
array beside the parquet would read faster but store every token twice.

**Order.** The global batch of step s is a pure function of (seed, epoch, s), never of the worker
count: `BatchPlan` cuts each epoch's order of the rows into batches; rank r of W takes the r-th 1/W of
each. The order is a seeded two-level permutation, as MosaicML Streaming's block shuffles: the shards
in a random order, cut into windows of `data.shuffle_window` shards, the rows of each window permuted.
A worker then keeps at most one window of shards open, and any batch is computed directly from the
step (O(1) resume). The last `rows % batch_size` rows of an epoch's order are left for that epoch.

**From a bucket.** A remote `data.path` is not read row by row over the network (a request per row,
tens of milliseconds each): each shard is downloaded whole into a bounded local cache
(`shard_cache.ShardCache`: by default 2 windows of `data.shuffle_window` shards), and `step_batches`
downloads the shards of the coming steps before they are read (`ShardPrefetch`: the plan is a pure
function of the step), so a step's read makes no request. The cost is bandwidth: a rank's rows of a
window are spread over all its shards, so each rank downloads about every shard once an epoch. Local
paths are read in place.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mhf_dist.config import Config, DataConfig
from mhf_dist.data.shard_cache import ShardCache
from mhf_dist.data.shards import check_shard, read_manifest, reprepare, split_shards
from mhf_dist.errors import DataError, first_line
from mhf_dist.storage import Location, storage_errors

CACHE_SHARDS = 2 * DataConfig.model_fields["shuffle_window"].default  # the window read and the next
OPEN_FILES = 64  # local shards kept open (their footers parsed once)


class RowReader:
    """Rows of one split by global index: `read(rows)` decodes exactly those rows, in the order given.
    Each shard is checked against the manifest when it is first opened (`check_all`: every one now);
    from a bucket, rows are read from whole shards downloaded into `cache`."""

    def __init__(
        self,
        path: str | Path | Location,
        split: str,
        signatures: bool = True,
        source_tokens: bool = False,
        cache_shards: int = CACHE_SHARDS,
    ) -> None:
        self.directory = Location.of(path)
        manifest = read_manifest(self.directory)
        self.sources = [source.name for source in manifest.sources]
        self.shards = split_shards(path, manifest, split)
        rows = [shard.rows for shard in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.width = manifest.seq_len + 1
        self.num_hashes = manifest.signatures.num_hashes
        self.signature_dtype = np.dtype(manifest.signatures.dtype)
        self.columns = ["input_ids", "signatures"] if signatures else ["input_ids"]
        if source_tokens and len(self.sources) > 1:  # shards of several sources carry the column
            self.columns.append("source_tokens")
        self._handles: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self.rows_decoded = 0
        self.cache = ShardCache(self.directory, self.shards, cache_shards) if self.directory.remote else None

    @property
    def files(self) -> list[Location]:
        return [self.directory / shard.file for shard in self.shards]

    def check_all(self) -> None:
        """Every shard's footer, 16 requests at a time (a bucket answers each in tens of milliseconds)."""
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="check-shards") as pool:
            list(pool.map(functools.partial(check_shard, self.directory), self.shards))

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    @property
    def shard_rows(self) -> np.ndarray:
        return np.diff(self.offsets)

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """`tokens` [n, T+1] and, if asked for, `signatures` [n, T+1, H] and `source_tokens` [n, sources]."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(f"row index out of range 0..{self.num_rows - 1}")
        batch = {"tokens": np.empty((len(rows), self.width), dtype=np.int64)}
        if "signatures" in self.columns:
            batch["signatures"] = np.empty((len(rows), self.width, self.num_hashes), self.signature_dtype)
        if "source_tokens" in self.columns:
            batch["source_tokens"] = np.empty((len(rows), len(self.sources)), dtype=np.int32)
        shards = self.shard_of(rows)
        needed = np.unique(shards)
        if self.cache is not None:  # a read of several shards downloads them a few at once
            self.cache.fetch(needed[: self.cache.capacity].tolist())
        for shard in needed:
            at = np.flatnonzero(shards == shard)
            local = rows[at] - self.offsets[shard]
            groups = np.unique(local)
            table = self._row_groups(int(shard), groups.tolist())
            self.rows_decoded += len(groups)
            where = np.searchsorted(groups, local)
            for column, key in zip(self.columns, batch, strict=True):
                values = table.column(column).combine_chunks().flatten().to_numpy()
                batch[key][at] = values.reshape(len(groups), *batch[key].shape[1:])[where]
        return batch

    def read_range(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Rows start .. stop-1 in prepared order (default: the whole split)."""
        return self.read(np.arange(start, self.num_rows if stop is None else stop))

    def shard_of(self, rows: np.ndarray) -> np.ndarray:
        """The index of the shard holding each row."""
        return np.searchsorted(self.offsets, rows, side="right") - 1

    def close(self) -> None:
        """Close the open files and delete the cached shards."""
        while self._handles:
            self._handles.popitem()[1].close()
        if self.cache is not None:
            self.cache.close()

    def _row_groups(self, shard: int, groups: list[int]) -> pa.Table:
        """The shard's row groups (its rows); a damaged data page is one line naming the shard (its footer
        was checked on opening, its pages are decoded only now)."""
        handle = self._handle(shard)
        try:
            return handle.read_row_groups(groups, columns=self.columns)
        except (OSError, pa.ArrowException) as err:
            raise DataError(
                f"shard {self.directory / self.shards[shard].file} is damaged ({first_line(err)}); "
                f"{reprepare(self.directory)}"
            ) from None

    def _handle(self, shard: int) -> pq.ParquetFile:
        """A bucket's shard: the cache's copy. A local one: open files are kept, the least recently used
        closed past OPEN_FILES."""
        if self.cache is not None:
            return self.cache.local(shard)
        if shard in self._handles:
            self._handles.move_to_end(shard)
            return self._handles[shard]
        entry = self.shards[shard]
        metadata = check_shard(self.directory, entry)
        where = self.directory / entry.file
        with storage_errors(where):
            handle = pq.ParquetFile(where.fs.open_input_file(where.path), metadata=metadata, pre_buffer=True)
        self._handles[shard] = handle
        if len(self._handles) > OPEN_FILES:
            self._handles.popitem(last=False)[1].close()
        return handle


class BatchPlan:
    """Which rows make the global batch of each step (1-based), epoch after epoch."""

    def __init__(
        self, shard_rows: np.ndarray, batch_size: int, seed: int, shuffle: bool = True, window: int = 64
    ) -> None:
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_rows)])
        self.batch_size, self.seed, self.shuffle, self.window = batch_size, seed, shuffle, window
        self.steps_per_epoch = int(self.offsets[-1]) // batch_size
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training split has {int(self.offsets[-1])} rows, fewer than one batch of {batch_size}; "
                "use more data or a smaller train.batch_size"
            )

    def epoch_of(self, step: int) -> int:
        return (step - 1) // self.steps_per_epoch

    def global_rows(self, step: int) -> np.ndarray:
        """The batch_size row indices of step `step`."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        start = index * self.batch_size
        return self._positions(epoch, start, start + self.batch_size)

    def rank_rows(self, step: int, rank: int, world_size: int) -> np.ndarray:
        """Rank `rank`'s equal share of the global batch of `step`."""
        share = self.batch_size // world_size
        return self.global_rows(step)[rank * share : (rank + 1) * share]

    def _positions(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions start .. stop-1 of the epoch's order: the slices of the windows they fall in."""
        _, window_starts = self._epoch_windows(epoch)
        first = int(np.searchsorted(window_starts, start, side="right")) - 1
        last = int(np.searchsorted(window_starts, stop, side="left"))
        parts = []
        for window in range(first, last):
            base = int(window_starts[window])
            parts.append(self._window_rows(epoch, window)[max(0, start - base) : stop - base])
        return np.concatenate(parts)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one plan per worker, alive for the whole run
    def _epoch_windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and where each window of it starts, in rows."""
        count = len(self.shard_rows)
        order = self._rng(epoch).permutation(count) if self.shuffle else np.arange(count)
        sizes = [self.shard_rows[order[i : i + self.window]].sum() for i in range(0, count, self.window)]
        return order, np.concatenate([[0], np.cumsum(sizes)])

    @functools.lru_cache(maxsize=4)  # noqa: B019
    def _window_rows(self, epoch: int, window: int) -> np.ndarray:
        order, _ = self._epoch_windows(epoch)
        members = order[window * self.window : (window + 1) * self.window]
        rows = np.concatenate([np.arange(self.offsets[s], self.offsets[s + 1]) for s in members])
        return self._rng(epoch, window + 1).permutation(rows) if self.shuffle else rows

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])


def training_plan(reader: RowReader, cfg: Config) -> BatchPlan:
    """The run's plan over the reader's training rows: train.batch_size, train.seed, data.shuffle*."""
    return BatchPlan(
        reader.shard_rows, cfg.train.batch_size, cfg.train.seed, cfg.data.shuffle, cfg.data.shuffle_window
    )


class ShardPrefetch:
    """Downloads ahead the shards of the steps after the one a rank is reading from a bucket: as many
    coming steps (at most an epoch of them) as the cache can hold the shards of, in the order the steps
    need them, none dropped before its steps are read. With the cache 2 windows large, the step at a
    window boundary finds the whole next window on disk."""

    def __init__(self, reader: RowReader, plan: BatchPlan, rank: int, world_size: int) -> None:
        if reader.cache is None:
            raise ValueError("only a reader of a bucket prefetches")
        self.cache, self.shard_of = reader.cache, reader.shard_of
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.coming: deque[tuple[int, list[int]]] = deque()  # (step, its shards), the one being read first
        self.needed: dict[int, int] = {}  # shard -> how many coming steps read it

    def reading(self, step: int) -> list[Future[pq.ParquetFile]]:
        """The rank reads `step` next: forget the steps before it, and start the downloads ahead."""
        while self.coming and self.coming[0][0] < step:
            for shard in self.coming.popleft()[1]:
                self.needed[shard] -= 1
                if not self.needed[shard]:
                    del self.needed[shard]
        after = self.coming[-1][0] + 1 if self.coming else step
        new: list[int] = []
        for ahead in itertools.count(after):
            if len(self.coming) >= self.plan.steps_per_epoch:
                break
            shards = np.unique(self.shard_of(self.plan.rank_rows(ahead, self.rank, self.world_size))).tolist()
            unseen = [shard for shard in shards if shard not in self.needed]
            if self.coming and len(self.needed) + len(unseen) > self.cache.capacity:
                break
            self.coming.append((ahead, shards))
            for shard in shards:
                self.needed[shard] = self.needed.get(shard, 0) + 1
            new += unseen
        self.cache.keep(self.needed)
        return self.cache.fetch(new)


def step_batches(
    reader: RowReader, plan: BatchPlan, start_step: int, rank: int, world_size: int
) -> Iterator[dict[str, Any]]:
    """This rank's rows of every step after `start_step`, read one step ahead in a thread."""
    prefetch = ShardPrefetch(reader, plan, rank, world_size) if reader.cache is not None else None

    def rows_of_steps() -> Iterator[dict[str, Any]]:
        for step in itertools.count(start_step + 1):
            if prefetch is not None:
                prefetch.reading(step)
            yield reader.read(plan.rank_rows(step, rank, world_size))

    try:
        yield from read_ahead(rows_of_steps())
    finally:
        if reader.cache is not None:
            reader.cache.cancel()  # a stream closed stops its downloads ahead


T = TypeVar("T")
_END = object()


def read_ahead(items: Iterator[T]) -> Iterator[T]:
    """`items`, with the next one produced in a background thread while the caller uses this one
    (parquet decoding releases the GIL, so reading overlaps the training step)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
        pending = pool.submit(next, items, _END)
        while (item := pending.result()) is not _END:
            pending = pool.submit(next, items, _END)
            yield item
