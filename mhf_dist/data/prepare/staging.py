"""Any `ray.data.Dataset` as a source: staged once into numbered parquet files in the work area, then
read like any file source, with every guarantee a file source has.

A source names its Dataset by a callable, `dataset: "package.module:function"` with keyword `args`, or
hands it over in Python (`prepare(cfg, datasets={"name": ds})`). Staging writes the `text_field` column
in the Dataset's order (`preserve_order`) through a datasink whose write task i writes
`progress/staged/NAME/{i:06d}.parquet`: write tasks are numbered in the order of their input, so the
files in name order hold the Dataset's order. Their count follows Ray Data's blocks, which moves only
where the parts are cut, never the token stream, so the shards do not depend on it.

The snapshot's record (`StagedSnapshot`) is written after its files: a rerun reuses a complete one
staged from the same callable, args and field. A Dataset given in Python has no identity to check a
snapshot against, so it is staged again on every run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data import Datasink
from ray.data.block import Block, BlockAccessor
from ray.data.datasource.datasink import WriteResult
from ray.exceptions import RayError, RayTaskError

from mhf_dist.console import clock
from mhf_dist.data.corpus import BATCH_BYTES, CorpusFile, TextTypeError, check_text_type
from mhf_dist.data.mixture import GIVEN_IN_PYTHON, DatasetSpec, Source
from mhf_dist.data.prepare.execute import ray_data_settings
from mhf_dist.data.prepare.records import PROGRESS, STAGED, StagedSnapshot, read_record, write_record
from mhf_dist.errors import DataError, MhfError
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.storage import Location, masked, secrets_in, storage_errors

if TYPE_CHECKING:
    from ray.data._internal.execution.interfaces import TaskContext

STAGED_FILE_BYTES = 16 << 20  # (in memory) blocks a staged file gathers at least, where there are more


def stage_sources(
    sources: list[Source],
    files: list[list[CorpusFile]],
    work: Location,
    log: Callable[[str], None],
    num_cpus: int | None,
    verbose: bool,
) -> tuple[list[StagedSnapshot | None], list[list[CorpusFile]]]:
    """Each Dataset source's snapshot in `work` (reused, or staged now; None for a file source), and every
    source's files, a Dataset's staged ones in place of `files`' empty list. A Dataset that cannot be
    used leaves no work area it alone made (complete snapshots of the others stay, for the rerun)."""
    check_functions(sources)  # before Ray starts: in seconds
    ensure_ray(num_cpus, verbose)
    try:
        kept = [_reusable(work, source) if source.dataset else None for source in sources]
        for source, snapshot in zip(sources, kept, strict=True):
            if snapshot is not None:
                log(f"source {source.name!r}: reusing its staged snapshot ({snapshot.documents:,} documents)")
        # Every Dataset is opened (imported, called, checked) before the first one is staged: a mistake
        # in the last source is not found hours later.
        with ray_data_settings(verbose):  # what Ray Data shows while a callable plans its reads, too
            opened = {
                source.name: open_dataset(source.name, source.dataset)
                for source, snapshot in zip(sources, kept, strict=True)
                if source.dataset and snapshot is None
            }
            for source in sources:
                if source.name in opened:  # what Ray Data knows without reading, or from the first block
                    with _reading(source):
                        schema = opened[source.name].schema()
                    if schema is not None:  # None: an empty Dataset, found when it is staged
                        text_column_check(source.name, source.text_field, schema)
        snapshots = [
            stage(source, opened[source.name], work, log, verbose) if source.name in opened else snapshot
            for source, snapshot in zip(sources, kept, strict=True)
        ]
    except MhfError:
        if not work.files():
            work.remove()
        raise
    staged = [staged_files(work, s) if s else found for s, found in zip(snapshots, files, strict=True)]
    return snapshots, staged


def _reusable(work: Location, source: Source) -> StagedSnapshot | None:
    """The source's complete snapshot in `work` if it was staged from the same callable, args and field."""
    assert source.dataset is not None
    if source.dataset.callable is None:
        return None
    kept = read_record(_record_file(work, source.name), StagedSnapshot)
    if kept is None or kept.args_salt is None:
        return None
    if (kept.dataset, kept.args_digest, kept.text_field) != _identity(source, kept.args_salt):
        return None
    present = dict(_folder(work, source.name).files())
    return kept if all(present.get(name) == size for name, size in kept.files) else None


def staged_files(work: Location, snapshot: StagedSnapshot) -> list[CorpusFile]:
    folder = _folder(work, snapshot.source)
    return [CorpusFile((folder / name).uri, size, "parquet") for name, size in snapshot.files]


def stage(
    source: Source, dataset: ray.data.Dataset, work: Location, log: Callable[[str], None], verbose: bool
) -> StagedSnapshot:
    """Write the source's `dataset` into `progress/staged/NAME/`, then its record."""
    folder, record_file = _folder(work, source.name), _record_file(work, source.name)
    record_file.remove()  # an earlier snapshot is no longer complete before any of it changes
    folder.remove()
    folder.make_dirs()
    log(f"source {source.name!r}: staging {source.corpus} into {folder}")
    start = time.monotonic()
    sink = StagedParquet(folder.uri, source.text_field, source.name)
    try:
        with ray_data_settings(verbose, dataset, preserve_order=True), _reading(source):
            dataset.write_datasink(sink)
        if not sink.written:
            raise DataError(
                f"dataset source {source.name!r} ({source.corpus}) is empty; give it at least one document"
            )
    except MhfError:
        folder.remove()  # what this Dataset cannot give, no rerun should find
        raise
    files = sorted(
        ((name, size) for name, size in folder.files() if name in sink.written),
        key=lambda file: int(file[0].split(".")[0]),  # write task order, past 999,999 too
    )
    salt = os.urandom(16).hex() if source.dataset and source.dataset.callable else None
    dataset_name, args_digest, text_field = _identity(source, salt)
    snapshot = StagedSnapshot(
        source=source.name,
        dataset=dataset_name,
        args_salt=salt,
        args_digest=args_digest,
        text_field=text_field,
        snapshot=uuid.uuid4().hex,
        documents=sum(sink.written.values()),
        files=files,
    )
    write_record(record_file, snapshot)
    size = sum(size for _, size in files)
    log(
        f"source {source.name!r}: staged {snapshot.documents:,} documents ({size / 1e6:,.1f} MB in "
        f"{len(files)} files) in {clock(time.monotonic() - start)}"
    )
    return snapshot


@contextmanager
def _reading(source: Source) -> Iterator[None]:
    """What a Dataset raised while Ray Data read or transformed it, as one line."""
    try:
        yield
    except RayTaskError as err:  # a task's own exception, which may be ours
        raise _read_failure(source, err.cause or err) from None
    except (MhfError, RayError):  # ours, or the cluster's (a lost worker, out of memory): not the input
        raise
    except Exception as err:  # the Dataset's planning in this process may raise anything
        raise _read_failure(source, err) from None


def text_column_check(source: str, field: str, schema: Any) -> None:
    """`field` is a column of `schema` (Ray Data's or Arrow's) holding text (or nothing but nulls)."""
    kinds = dict(zip(schema.names, schema.types, strict=True))
    if field not in kinds:
        raise DataError(
            f"dataset source {source!r} has no field {field!r} (fields: {', '.join(kinds)}); set its "
            "text_field"
        )
    if not isinstance(kinds[field], pa.DataType):  # a pandas block's dtype: checked once the block is Arrow
        return
    try:
        check_text_type(field, kinds[field])
    except TextTypeError as err:
        raise DataError(
            f"dataset source {source!r}: field {field!r} holds {err.kind}, not text; set text_field to a "
            "string column or convert it"
        ) from None


def check_functions(sources: list[Source]) -> None:
    """Every Dataset source's function imports and is a function (before Ray starts: in seconds)."""
    for source in sources:
        if source.dataset is not None and source.dataset.callable is not None:
            _import(source.name, source.dataset.callable)


def open_dataset(name: str, spec: DatasetSpec) -> Any:
    """The source's `ray.data.Dataset`: the one given in Python, or what its callable returns."""
    if spec.callable is None:
        dataset = spec.given
    else:
        function = _import(name, spec.callable)
        try:
            dataset = function(**spec.args)
        except (Exception, SystemExit) as err:  # SystemExit: a module that parses sys.argv, say
            raise DataError(
                f"dataset source {name!r}: {spec.callable}(**args) raised {_problem(err, spec)}; fix the "
                "callable or its args"
            ) from None
    if not isinstance(dataset, ray.data.Dataset):
        what = f"{spec.callable} returned" if spec.callable else "prepare(datasets=...) was given"
        raise DataError(
            f"dataset source {name!r}: {what} a {type(dataset).__name__}, not a ray.data.Dataset; return one "
            "(e.g. ray.data.read_parquet(...))"
        )
    return dataset


def _import(name: str, target: str) -> Callable[..., Any]:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # ImportError, or the module's own code failing as it loads
        raise DataError(
            f"dataset source {name!r}: cannot import {module_name!r} ({_problem(err, None)}); check the "
            "name and that the module is on PYTHONPATH"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        what = "has no function" if function is None else f"has {type(function).__name__}, not a function,"
        raise DataError(
            f"dataset source {name!r}: {module_name!r} {what} {attribute!r}; name a function that returns a "
            "ray.data.Dataset"
        )
    return function


class StagedParquet(Datasink):
    """Write task i writes the text column of its blocks to `{i:06d}.parquet`; `written`: file -> rows."""

    def __init__(self, uri: str, text_field: str, source: str) -> None:
        self.uri, self.text_field, self.source = uri, text_field, source
        self.written: dict[str, int] = {}

    def write(self, blocks: Iterable[Block], ctx: TaskContext) -> tuple[str, int]:
        name = f"{ctx.task_idx:06d}.parquet"
        where = Location.of(self.uri) / name
        rows = 0
        with ExitStack() as open_file:
            writer = None
            for block in blocks:  # read outside storage_errors: a Dataset's own OSError is its own
                table = self.texts(BlockAccessor.for_block(block).to_arrow())
                if not len(table):
                    continue
                with storage_errors(where):
                    if writer is None:
                        sink = open_file.enter_context(
                            where.fs.open_output_stream(where.path, compression=None)
                        )
                        writer = open_file.enter_context(pq.ParquetWriter(sink, table.schema))
                    # Row groups of about one reader batch: a large staged file is cut into parts by them.
                    group = max(1, len(table) * BATCH_BYTES // max(1, table.nbytes))
                    writer.write_table(table, row_group_size=group)
                rows += len(table)
        return name, rows

    def texts(self, table: pa.Table) -> pa.Table:
        """The block's text column, as large strings; a missing or non-text one is a one-line error."""
        field = self.text_field
        if not len(table):  # an empty block may have no columns at all
            return pa.table({field: pa.array([], pa.large_string())})
        text_column_check(self.source, field, table.schema)
        return pa.table({field: table.column(field).cast(pa.large_string())})

    def on_write_complete(self, write_result: WriteResult[tuple[str, int]]) -> None:
        self.written = {name: rows for name, rows in write_result.write_returns if rows}

    def get_name(self) -> str:
        return f"Stage({self.source})"

    @property
    def min_bytes_per_write(self) -> int:
        """Ray Data gives a write task consecutive blocks up to this: small blocks share a file."""
        return STAGED_FILE_BYTES


def _identity(source: Source, salt: str | None) -> tuple[str, str | None, str]:
    """What a snapshot must have been staged from to be reused: (callable, args digest, text field). The
    digest is of the args as given, salted and slow (scrypt) as a password verifier is: the work area
    may be a shared bucket, and the args may hold a secret."""
    spec = source.dataset
    assert spec is not None
    if spec.callable is None or salt is None:
        return GIVEN_IN_PYTHON, None, source.text_field
    args = json.dumps(spec.args, sort_keys=True, default=repr).encode()
    digest = hashlib.scrypt(args, salt=bytes.fromhex(salt), n=2**14, r=8, p=1).hex()
    return spec.callable, digest, source.text_field


def _read_failure(source: Source, cause: BaseException) -> MhfError:
    """One line for a Dataset that raised while Ray Data read or transformed it (ours: as it is, less
    the retry advice Ray Data appends)."""
    if isinstance(cause, MhfError):
        return type(cause)(str(cause).splitlines()[0])
    return DataError(
        f"dataset source {source.name!r} ({source.corpus}) failed while being read: "
        f"{_problem(cause, source.dataset)}; fix the dataset or its callable's args"
    )


def _problem(err: BaseException, spec: DatasetSpec | None) -> str:
    """The exception's type and first line, with the secrets of the source's args masked."""
    lines = str(err).strip().splitlines()
    secrets = secrets_in(spec.args) if spec is not None else set()
    return f"{type(err).__name__}: {masked(lines[0], secrets)[:200]}" if lines else type(err).__name__


def _folder(work: Location, name: str) -> Location:
    return work / PROGRESS / STAGED / name


def _record_file(work: Location, name: str) -> Location:
    return work / PROGRESS / STAGED / f"{name}.json"
