"""Corpus readers: a corpus is a sorted list of files, each read as a stream of bounded batches of
documents {"text", "replaced"}, in a fixed order.

Where (`data.corpus`): `builtin`; a file, a directory or a glob, local or in a bucket (a glob lists the
prefix before its first wildcard and keeps what `fnmatch` matches: `*` also matches `/`; `?` would start
the URI's query); or `hf:NAME`, a Hugging Face dataset read from the `.arrow` files of its local cache.
What, by suffix (`KINDS`): text (documents between blank lines), JSON lines, parquet or Arrow IPC (stream
or file format); all but parquet optionally compressed as a whole (`COMPRESSIONS`).
Every reader streams batches of about `BATCH_BYTES` of text, so no file is loaded whole. `replaced`
counts invalid UTF-8 sequences replaced by U+FFFD (text files only: the other kinds hold UTF-8 strings).
"""

from __future__ import annotations

import io
import itertools
import json
import pydoc_data.topics
import re
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from mhf_dist.config import DATASET_PREFIX
from mhf_dist.errors import DataError
from mhf_dist.storage import (
    WILDCARD,
    Location,
    StorageError,
    describe_failure,
    matches,
    reachable,
    redact,
    store_problem,
)

BUILTIN_NAME = "builtin"
KINDS = {
    ".txt": "text",
    ".raw": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}  # pyarrow codec names
SUFFIXES_TEXT = (
    f"{', '.join(sorted(KINDS))} (.txt/.raw/.json/.jsonl/.arrow optionally {', '.join(COMPRESSIONS)})"
)
BATCH_BYTES = 4 << 20  # text per batch of documents
JSON_BLOCK_BYTES = 32 << 20  # pyarrow's JSON reader needs every line inside one block
REPLACEMENT = "\ufffd"
_BLANK_LINES = re.compile(r"\n[ \t\r]*\n")
_BLANK_LINE_BYTES = re.compile(rb"\n[ \t\r]*\n")
_ARROW_FILE_MAGIC = b"ARROW1\0\0"  # the file format: this, then the stream format, then a footer


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus: its URI (or local absolute path), size, kind and whole-file compression."""

    uri: str
    size: int
    kind: str
    compression: str | None = None


def builtin_documents() -> list[str]:
    """The Python documentation topics of the standard library: ~80 English documents, sorted by topic."""
    topics = pydoc_data.topics.topics
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def file_kind(name: str) -> tuple[str, str | None] | None:
    """(kind, compression) that a file's name says, or None for a name that is no corpus file."""
    suffix = Path(name).suffix.lower()
    compression = COMPRESSIONS.get(suffix)
    if compression is not None:
        suffix = Path(name[: -len(suffix)]).suffix.lower()
    kind = KINDS.get(suffix)
    if kind is None or (kind == "parquet" and compression is not None):  # parquet compresses inside
        return None
    return kind, compression


def corpus_files(spec: str, log: Callable[[str], None] | None = None) -> list[CorpusFile]:
    """The sorted files that `spec` names, each once (`log` says how many a link reached again); a
    one-line error for none or an unknown kind, a `StorageError` for a bucket missing or out of reach."""
    if spec == BUILTIN_NAME:
        return [CorpusFile(BUILTIN_NAME, sum(map(len, builtin_documents())), "builtin")]  # size: for the key
    if spec.startswith("hf:"):
        return _huggingface_files(spec[3:])
    if spec.startswith(DATASET_PREFIX):
        raise DataError(
            f"corpus {spec!r} is a ray.data.Dataset, which mhf prepare stages and reads; here give a file, "
            "directory or glob"
        )
    where = Location.of(spec)
    if where.is_dir():
        listed = where.files(links=True)
        found = [(where / name, size) for name, size in listed if file_kind(name)]
        if not found:
            raise DataError(f"corpus directory {str(where)!r} holds no {SUFFIXES_TEXT} files")
        if (others := [name for name, _ in listed if not file_kind(name)]) and log is not None:
            log(
                f"corpus {redact(spec)!r}: skipping {len(others)} file(s) of no corpus kind, e.g. "
                f"{others[0]!r}"
            )
    elif where.is_file():
        found = [(where, where.size())]
    else:
        found = matches(spec) if WILDCARD.search(where.path) else []
        if not found:
            where.check_bucket()  # a missing bucket is a StorageError
            raise DataError(
                f"corpus {str(where)!r} matches no file; pass 'builtin', a directory, a file or a glob"
            )
    files, reached = [], set()
    for location, size in found:
        kind = file_kind(location.name)
        if kind is None:
            raise DataError(f"corpus file {str(location)!r} is not {SUFFIXES_TEXT}; convert it")
        if location.real not in reached:
            reached.add(location.real)
            files.append(CorpusFile(location.uri, size, *kind))
    if len(files) < len(found) and log is not None:
        log(
            f"corpus {redact(spec)!r} reaches {len(found) - len(files)} of its files a second time (through "
            "links); each is read once"
        )
    return files


@dataclass
class Skipped:
    """Records that are no documents: `missing` their text (no field, or null), or `empty`."""

    missing: int = 0
    empty: int = 0
    first_missing: str | None = None

    def add(self, other: Skipped) -> None:
        self.missing += other.missing
        self.empty += other.empty
        self.first_missing = self.first_missing or other.first_missing


def read_documents(
    file: CorpusFile,
    text_field: str = "text",
    row_groups: tuple[int, int] | None = None,
    skipped: Skipped | None = None,
) -> Iterator[pa.Table]:
    """The documents of one corpus file as tables {"text": string, "replaced": int64} of at most about
    BATCH_BYTES of text each, in file order (`row_groups`: only parquet row groups [first, end)).
    Records without text or with empty text are no documents: left out, and counted in `skipped`."""
    records = Records(file, skipped if skipped is not None else Skipped())
    if file.kind == "builtin":
        yield _documents(pa.array(builtin_documents(), pa.string()), records)
        return
    where = Location.of(file.uri)
    try:
        if file.kind == "parquet":
            yield from _parquet_documents(where, text_field, row_groups, records)
        else:
            readers = {"text": _text_documents, "json": _json_documents, "arrow": _arrow_documents}
            yield from readers[file.kind](where, file.compression, text_field, records)
    except TextTypeError as err:
        raise DataError(err.line(where)) from None
    except (OSError, pa.ArrowInvalid) as err:
        # A store that cannot be reached (refuses, has no such bucket) says so; anything else is the content.
        if isinstance(err, OSError) and store_problem(str(where), err) is not None:
            raise StorageError(describe_failure(str(where), err)) from None
        problem = str(err).strip().splitlines()[0][:200]
        raise DataError(
            f"cannot read corpus file {str(where)!r} as {file.kind} ({problem}); fix or remove it"
        ) from None


def corpus_texts(spec: str, text_field: str = "text") -> list[str]:
    """Every document of a (small) corpus, read in this process, e.g. to learn new tokens from."""
    return [
        text
        for file in corpus_files(spec)
        for batch in read_documents(file, text_field)
        for text in batch["text"].to_pylist()
    ]


def split_text_file(raw: bytes) -> tuple[list[str], list[int]]:
    """Raw text -> its documents (blank-line separated) and the invalid UTF-8 sequences replaced in each
    (in text that is not valid UTF-8, every U+FFFD counts: one written on purpose looks the same)."""
    try:
        text, invalid = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        text, invalid = raw.decode("utf-8", errors="replace"), True
    documents = split_documents(text)
    return documents, [doc.count(REPLACEMENT) if invalid else 0 for doc in documents]


def split_documents(text: str) -> list[str]:
    """The documents of a plain text: separated by blank (or whitespace-only) lines."""
    documents = (doc.strip() for doc in _BLANK_LINES.split(text.replace("\r\n", "\n")))
    return [doc for doc in documents if doc]


@dataclass
class Records:
    """Where a reader is in one file: records read so far, and the tally of those that are no documents."""

    file: CorpusFile
    skipped: Skipped
    read: int = 0


def _documents(texts: pa.Array, records: Records, replaced: list[int] | None = None) -> pa.Table:
    """The next records of the file as documents, less those without text (counted in `records.skipped`)."""
    texts = pc.cast(texts, pa.string())
    counts = pa.array(replaced if replaced is not None else [0] * len(texts), pa.int64())
    present = pc.is_valid(texts)
    missing = len(texts) - present.true_count
    if missing and records.skipped.first_missing is None:
        records.skipped.first_missing = record_place(
            records.file, records.read + present.index(False).as_py()
        )
    empty = pc.and_(present, pc.equal(pc.binary_length(texts), 0))
    records.skipped.missing += missing
    records.skipped.empty += empty.true_count
    records.read += len(texts)
    keep = pc.and_(present, pc.invert(empty))
    return pa.table({"text": texts.filter(keep), "replaced": counts.filter(keep)})


def record_place(file: CorpusFile, index: int) -> str:
    """Where record `index` of a file is: `path:line` in a JSON lines file, `path: row N` elsewhere."""
    where = Location.of(file.uri)
    if file.kind != "json":
        return f"{where}: row {index + 1}"
    with _input_stream(where, file.compression) as stream:
        lines = io.BufferedReader(stream, 1 << 20)  # pyarrow's streams cannot read lines themselves
        records = (number for number, line in enumerate(lines, start=1) if line.strip())
        return f"{where}:{next(itertools.islice(records, index, None), '?')}"


def bounded_ranges(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges of items whose sizes sum to at most `limit` (or one larger item)."""
    ranges, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if total and total + size > limit:
            ranges.append((start, index))
            start, total = index, 0
        total += size
    return [*ranges, (start, len(sizes))] if len(sizes) else []


def _bounded(texts: pa.Array, records: Records) -> Iterator[pa.Table]:
    """`texts` cut into batches of at most about BATCH_BYTES (a longer document is a batch alone)."""
    sizes = pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False).tolist()
    for start, stop in bounded_ranges(sizes, BATCH_BYTES):
        yield _documents(texts[start:stop], records)


def _input_stream(where: Location, compression: str | None) -> Any:
    """The file's bytes, decompressed by the codec its name says (pyarrow's "detect" knows fewer names)."""
    return where.fs.open_input_stream(where.path, compression=compression)


def _text_documents(
    where: Location, compression: str | None, _field: str, records: Records
) -> Iterator[pa.Table]:
    """Read in chunks cut after a blank line: every document lies whole in one chunk, and the chunks'
    documents are the file's (a cut inside the whitespace between documents moves none of them).
    A chunk is decoded alone, so `replaced` follows `split_text_file`'s rule per chunk."""
    with _input_stream(where, compression) as stream:
        carry = b""
        while True:
            chunk = stream.read(BATCH_BYTES)
            data = carry + chunk
            # The end of the last blank line; one that begins in `carry` begins at its last newline.
            blank_lines = _BLANK_LINE_BYTES.finditer(data, max(0, carry.rfind(b"\n")))
            cut = max((match.end() for match in blank_lines), default=0) if chunk else len(data)
            if cut:
                documents, replaced = split_text_file(data[:cut])
                if documents:
                    yield _documents(pa.array(documents, pa.string()), records, replaced)
            carry = data[cut:]
            if not chunk:
                return


def _json_documents(
    where: Location, compression: str | None, field: str, records: Records
) -> Iterator[pa.Table]:
    options = pajson.ParseOptions(
        explicit_schema=pa.schema([pa.field(field, pa.string())]), unexpected_field_behavior="ignore"
    )
    blocks = pajson.ReadOptions(block_size=JSON_BLOCK_BYTES)
    with _input_stream(where, compression) as stream:
        reader = None
        for index in itertools.count():
            try:  # pyarrow parses the first block as it opens the file, every other one as it reads it
                reader = reader or pajson.open_json(stream, read_options=blocks, parse_options=options)
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as err:  # a value of another JSON type where the text belongs
                if (kind := _JSON_TYPE_CHANGE.search(str(err))) is None:
                    raise
                place = record_place(records.file, records.read + int(kind.group(2)))
                raise TextTypeError(field, f"a JSON {kind.group(1)}", place) from None
            column = batch.column(field)
            if index == 0 and len(column) and column.null_count == len(column):
                raise DataError(_no_field(where, field, _json_fields(where, compression)))
            yield from _bounded(column, records)


def _json_fields(where: Location, compression: str | None) -> list[str]:
    """The fields of the file's first JSON line (for the error message)."""
    with _input_stream(where, compression) as stream:
        first = stream.read(1 << 20).split(b"\n", 1)[0]
    try:
        record = json.loads(first)
    except ValueError:
        return []
    return sorted(record) if isinstance(record, dict) else []


def _parquet_documents(
    where: Location, field: str, row_groups: tuple[int, int] | None, records: Records
) -> Iterator[pa.Table]:
    with where.fs.open_input_file(where.path) as handle:
        parquet = pq.ParquetFile(handle)
        names = parquet.schema_arrow.names
        if field not in names:
            raise DataError(_no_field(where, field, names))
        check_text_type(field, parquet.schema_arrow.field(field).type)
        groups = range(*row_groups) if row_groups else range(parquet.num_row_groups)
        records.read = sum(parquet.metadata.row_group(group).num_rows for group in range(groups.start))
        for group in groups:
            for batch in parquet.iter_batches(batch_size=4096, row_groups=[group], columns=[field]):
                yield from _bounded(batch.column(0), records)


def _arrow_documents(
    where: Location, compression: str | None, field: str, records: Records
) -> Iterator[pa.Table]:
    with _arrow_stream(where, compression) as stream, ipc.open_stream(stream) as reader:
        if field not in reader.schema.names:
            raise DataError(_no_field(where, field, reader.schema.names))
        check_text_type(field, reader.schema.field(field).type)
        for batch in reader:
            yield from _bounded(batch.column(field), records)


def _arrow_stream(where: Location, compression: str | None) -> Any:
    """An IPC stream: the stream format from its first byte, or the file format after its 8-byte magic
    (the stream it holds; so a compressed file, which cannot seek to its footer, streams too)."""
    stream = _input_stream(where, compression)
    if stream.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
        return stream
    stream.close()
    return _input_stream(where, compression)


_JSON_TYPE_CHANGE = re.compile(r"changed from string to (\w+) in row (\d+)")


@dataclass(eq=False)
class TextTypeError(Exception):
    """The text field holds something else than text: what, and where (`place`) when one record shows it."""

    field: str
    kind: str
    place: str | None = None

    def __post_init__(self) -> None:  # the exception's args, as pickling (a Ray task's error) rebuilds it
        super().__init__(self.field, self.kind, self.place)

    def line(self, where: Location | str) -> str:
        at = self.place or f"corpus {str(where)!r}"
        return (
            f"{at}: field {self.field!r} holds {self.kind}, not text; set data.text_field to a text field "
            "or convert it"
        )


def check_text_type(field: str, kind: pa.DataType) -> None:
    """A column of text (strings, dictionary-encoded strings, or nothing but nulls), else TextTypeError."""
    if isinstance(kind, pa.DictionaryType):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise TextTypeError(field, str(kind))


def _no_field(where: Location, field: str, names: list[str]) -> str:
    return f"corpus {str(where)!r} has no field {field!r} (fields: {', '.join(names)}); set data.text_field"


@contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """The Hugging Face libraries' offline switch, which they read at each call, set for the block."""
    import datasets.config
    from huggingface_hub import constants

    saved = (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = offline or saved[1]
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _huggingface_files(name: str) -> list[CorpusFile]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"hf:{name} needs the `datasets` package; pip install 'mhf-dist[hf]' or pass a local path"
        ) from None
    from huggingface_hub import constants

    # Through a proxy the hub is not ours to probe: the libraries' own retries decide.
    online = bool(urllib.request.getproxies().get("https")) or reachable(constants.ENDPOINT)
    try:
        with _hub_offline(not online):  # offline: the local cache at once, not half a minute of retries
            dataset = datasets.load_dataset(name, split="train")
    except Exception as err:  # offline, unknown name, gated: all surface as different exception types
        why = type(err).__name__ if online else f"{constants.ENDPOINT} does not answer, nor is it cached"
        raise DataError(
            f"cannot load Hugging Face dataset {name!r} ({why}); offline? pass a local path"
        ) from None
    files = [Path(entry["filename"]) for entry in dataset.cache_files]
    if not files:
        raise DataError(f"hf:{name} has no cache files to read; save it with save_to_disk and pass the path")
    return [CorpusFile(str(path), path.stat().st_size, "arrow") for path in files]
