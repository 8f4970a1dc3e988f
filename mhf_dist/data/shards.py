"""Prepared shards on disk: parquet files of packed rows with their signatures, and the manifest.

A prepared directory holds `manifest.json` (written last: its presence means the directory is
complete), `tokenizer.json` (its sha256 checked by every run), `signatures.safetensors` and
`{split}-{index:05d}.parquet` shards with the columns `input_ids` (fixed-size list of seq_len+1 int32)
and `signatures` ((seq_len+1)*H unsigned ints, row-major [T+1, H], in the table's smallest dtype), one
row per row group (`mhf_dist.data.reader` reads rows by index through it). Shards of more than one
source have a third column, `source_tokens`: per row, the count of its seq_len+1 tokens that came from
each of the manifest's `sources`, in their order.

In a bucket the files sit in a version folder beside the manifest (`VERSION_FOLDER`): an object store
has no rename, so `mhf prepare --overwrite` writes the new version beside the old one and switches by
replacing the manifest, one PUT (`prepare.output.publish`). Readers open files by the manifest's names.
Fields added after version 2 was first written default to what manifests written before them mean.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from tokenizers import Tokenizer

from mhf_dist.config import Config
from mhf_dist.data.packing import Packing
from mhf_dist.data.tokenizer import FORMAT_TEXT, LEGACY_FORMAT, TextTokenizer
from mhf_dist.errors import DataError, SignatureError
from mhf_dist.files import write_json_atomic
from mhf_dist.readers import as_record, read_json
from mhf_dist.signatures import SignatureTable, load_table
from mhf_dist.storage import Location, local_copy, storage_errors

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SIGNATURES_FILE = "signatures.safetensors"
SPLITS = ("train", "validation")
FORMAT = "mhf-shards"
VERSION = 2  # 1: whole-shard row groups, which no row can be read from alone
ROWS_PER_GROUP = 1  # every parquet row group is one row: the unit the training reader reads

Split = Literal["train", "validation"]
VERSION_FOLDER = r"v-[0-9a-f]{12}"  # a dataset's version in a bucket: the folder its manifest names
# A file the manifest names: beside it, or in its version folder; never anywhere else (nor "." or "..").
FileName = Annotated[
    str, StringConstraints(pattern=rf"^({VERSION_FOLDER}/)?[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
]


def is_validation(text: str, val_percent: float) -> bool:
    """Stable split by document content: the same document lands in the same split on any cluster."""
    return mmh3.hash(text.encode(), 0, signed=False) % 10_000 < round(val_percent * 100)


def file_sha256(path: Path | Location) -> str:
    where = Location.of(path)
    with storage_errors(where), where.fs.open_input_stream(where.path, compression=None) as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


class Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ShardEntry(Record):
    file: FileName
    rows: int
    sha256: str


class MixtureSource(Record):
    """One corpus of a replay mixture: the main corpus, then the replayed one (`mhf_dist.data.mixture`)."""

    corpus: str
    documents: int
    tokens: int
    seed: int | None = Field(None, exclude_if=lambda value: value is None)  # the replayed corpus only
    candidate_documents: int | None = Field(None, exclude_if=lambda value: value is None)
    candidate_tokens: int | None = Field(None, exclude_if=lambda value: value is None)


class Mixture(Record):
    requested_fraction: float
    realised_fraction: float
    threshold: int
    sources: list[MixtureSource]
    tokens: str  # what the token counts count


class CorpusFileInfo(Record):
    """A corpus file a source was read from (redacted) and its size."""

    path: str
    bytes: int


class StagedInfo(Record):
    """What a Dataset source was staged from (`mhf_dist.data.prepare.staging`)."""

    dataset: str  # its "package.module:function", or "given in Python"
    args: dict[str, Any]  # the function's keyword arguments, redacted
    documents: int  # documents staged (before the split and the mixture's choice)


class SourceInfo(Record):
    """One source of the text, in the order of `source_tokens`; tokens with their boundary tokens."""

    name: str
    corpus: str  # redacted: no credentials
    weight: float  # the share of the training tokens asked for (the weights sum to 1)
    documents: int  # training documents taken
    tokens: int  # their tokens
    share: float  # the realised share: tokens over every source's training tokens
    validation_documents: int
    validation_tokens: int
    staged: StagedInfo | None = Field(None, exclude_if=lambda value: value is None)  # a Dataset source
    files: list[CorpusFileInfo] = Field(default_factory=list, exclude_if=lambda value: not value)  # read
    missing_text: int = Field(0, exclude_if=lambda value: value == 0)  # records without text, left out
    empty: int = Field(0, exclude_if=lambda value: value == 0)  # records of empty text, left out


class SplitInfo(Record):
    rows: int
    target_tokens: int
    shards: list[ShardEntry]
    documents: int
    replaced: int  # documents with invalid UTF-8 replaced by U+FFFD
    dropped_tokens: int
    mixture: Mixture | None = Field(None, exclude_if=lambda value: value is None)  # train, with replay

    @model_validator(mode="after")
    def _rows_are_the_shards(self) -> SplitInfo:
        if self.rows != sum(shard.rows for shard in self.shards):
            raise ValueError(f"rows {self.rows} is not the sum of its shards' rows")
        return self


class TokenizerInfo(Record):
    file: FileName
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int | None = None  # only for bos-format documents


class SignaturesInfo(Record):
    file: FileName
    spec: str
    num_hashes: int
    num_buckets: int
    seed: int
    scheme: str
    fingerprint: str
    dtype: str
    num_lsh: int = 0
    duplicate_signatures: int = 0


class PreparedWith(Record):
    """The settings the shards were prepared with, as they were then (a record, not a config to run:
    sections stay free-form so that later config changes leave old manifests readable)."""

    data: dict[str, Any]
    seq_len: int
    model_hash: dict[str, Any]


class Manifest(Record):
    format: Literal["mhf-shards"]
    version: Literal[2]
    seq_len: int
    packing: Packing = "overlap"
    rows_per_group: Literal[1]  # ROWS_PER_GROUP
    splits: dict[Split, SplitInfo]
    content_sha256: str
    document_format: Literal["bos", "eos"] = LEGACY_FORMAT
    tokenizer: TokenizerInfo
    signatures: SignaturesInfo
    config: PreparedWith
    # The text's sources (none for generated rows); more than one: the shards have `source_tokens`.
    sources: list[SourceInfo] = Field(default_factory=list, exclude_if=lambda value: not value)

    @model_validator(mode="after")
    def _shards_are_the_ones_prepared(self) -> Manifest:
        missing = [split for split in SPLITS if split not in self.splits]
        if missing:
            raise ValueError(f"no {' or '.join(missing)} split")
        if self.content_sha256 != content_hash(self.splits):
            raise ValueError("content_sha256 is not the hash of the shards' names and digests")
        if len({PurePosixPath(name).parent for name in self.file_names()}) != 1:
            raise ValueError("its files are not all in one folder")
        return self

    def file_names(self) -> list[str]:
        """Every file the manifest names, as it names them (paths from its directory)."""
        shards = [shard.file for split in SPLITS for shard in self.splits[split].shards]
        return [self.tokenizer.file, self.signatures.file, *shards]

    @property
    def folder(self) -> str:
        """The folder beside the manifest that holds its files ("" when they are beside it)."""
        folder = PurePosixPath(self.tokenizer.file).parent
        return "" if folder == PurePosixPath(".") else str(folder)

    def moved_to(self, folder: str) -> Manifest:
        """The same manifest naming its files in `folder` (beside it when ""); the content hash is over
        the shards' base names, so it stays the same."""

        def moved(entry: Any) -> Any:
            name = PurePosixPath(entry.file).name
            return entry.model_copy(update={"file": str(PurePosixPath(folder, name))})

        splits = {
            name: info.model_copy(update={"shards": [moved(shard) for shard in info.shards]})
            for name, info in self.splits.items()
        }
        files = {"tokenizer": moved(self.tokenizer), "signatures": moved(self.signatures)}
        return self.model_copy(update={"splits": splits, **files})


def tokenizer_info(tokenizer: TextTokenizer, document_format: str) -> TokenizerInfo:
    """What the manifest records of the tokenizer its shards were prepared with."""
    same = {name: getattr(tokenizer, name) for name in ("sha256", "vocab_size", "eos_id")}
    bos_id = tokenizer.bos_id if document_format == "bos" else None
    return TokenizerInfo(file=TOKENIZER_FILE, bos_id=bos_id, **same)


def signatures_info(table: SignatureTable) -> SignaturesInfo:
    """What the manifest records of the signature table its shards were looked up in."""
    same = ("spec", "num_hashes", "num_buckets", "seed", "fingerprint", "num_lsh", "duplicate_signatures")
    recorded = {name: getattr(table, name) for name in same}
    return SignaturesInfo(
        file=SIGNATURES_FILE, scheme=table.scheme.name, dtype=str(table.rows.dtype), **recorded
    )


def save_tokenizer(tokenizer: TextTokenizer, path: str | Path | Location) -> None:
    """tokenizer.json as exactly the text `TextTokenizer.sha256` hashes, so that its bytes check against
    the manifest whatever version of `tokenizers` reads them."""
    Location.of(path).write_bytes(tokenizer.tokenizer.to_str().encode())


def write_shard(
    rows: np.ndarray,
    table: SignatureTable,
    directory: Path | Location,
    name: str,
    source_tokens: np.ndarray | None = None,
) -> ShardEntry:
    """Write packed rows [n, T+1], their signatures and tokens per source; returns the manifest entry."""

    def per_row(values: np.ndarray) -> pa.FixedSizeListArray:  # [n, ...] -> n fixed-size lists
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), math.prod(values.shape[1:]))

    # signatures: [n, T+1, H], in the table's own small dtype
    columns = {"input_ids": per_row(rows.astype(np.int32)), "signatures": per_row(table.lookup(rows))}
    if source_tokens is not None:
        columns["source_tokens"] = per_row(source_tokens.astype(np.int32))
    path = Location.of(directory) / name
    sink = pa.BufferOutputStream()  # whole in memory (one shard), then one upload: no partial object
    pq.write_table(
        pa.table(columns),
        sink,
        compression="zstd",
        row_group_size=1,
        use_dictionary=False,  # a dictionary page per one-row group would cost more than it saves
        write_statistics=False,
    )
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return ShardEntry(file=name, rows=len(rows), sha256=hashlib.sha256(data).hexdigest())


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


SHARD_FILE = re.compile(rf"({'|'.join(SPLITS)})-\d{{5,}}\.parquet")  # what shard_name gives


def content_hash(splits: dict[str, SplitInfo]) -> str:
    """sha256 over every shard's name (not its folder) and digest, in split and shard order."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for shard in splits[split].shards:
            digest.update(f"{PurePosixPath(shard.file).name}:{shard.sha256}\n".encode())
    return digest.hexdigest()


def write_manifest(directory: Path | Location, manifest: Manifest) -> None:
    write_json_atomic(Location.of(directory) / MANIFEST, manifest.model_dump(mode="json"))


def read_manifest(path: str | Path | Location) -> Manifest:
    """The manifest of a prepared directory; a missing, foreign, old or damaged one is a one-line error."""
    directory = Location.of(path)
    path = str(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        directory.check_bucket()
        if not directory.is_dir():
            raise DataError(f"prepared data {path!r} does not exist; run `mhf prepare` first")
        raise DataError(f"{path!r} is not a complete prepared dataset (no {MANIFEST}); rerun `mhf prepare`")
    fix = reprepare(path)
    raw = read_json(manifest_path, DataError, fix)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(
            f"{manifest_path} is not an mhf-dist shard manifest; point data.path at `mhf prepare` output"
        )
    if raw.get("version") != VERSION:
        raise DataError(
            f"prepared data {str(path)!r} is manifest version {raw.get('version')}, this mhf-dist reads "
            f"version {VERSION} (one row per row group, so that a row can be read alone); {fix}"
        )
    return as_record(raw, Manifest, manifest_path, DataError, fix)


def check_compatible(manifest: Manifest, cfg: Config) -> None:
    """Refuse shards that do not fit the model: each mismatch names both values."""
    have, want = manifest.document_format, cfg.data.document_format
    if want != "auto" and want != have:
        raise DataError(
            f"shards hold {have}-format documents ({FORMAT_TEXT[have]}) but data.document_format is "
            f"{want}; set --set data.document_format={have} or re-prepare with {want}"
        )
    hashes = manifest.signatures
    pairs = [
        ("seq_len", manifest.seq_len, cfg.train.seq_len, "train.seq_len"),
        ("packing", manifest.packing, cfg.data.packing, "data.packing"),
        ("vocab_size", manifest.tokenizer.vocab_size, cfg.model.vocab_size, "model.vocab_size"),
    ]
    if cfg.model.family == "mhf":
        pairs += [
            ("hash spec", hashes.spec, cfg.model.hash.spec, "model.hash.spec"),
            ("hash seed", hashes.seed, cfg.model.hash.seed, "model.hash.seed"),
            ("signature scheme", hashes.scheme, cfg.model.hash.signature_scheme, "model.hash.scheme"),
            ("LSH coordinate count", hashes.num_lsh, cfg.model.hash.num_lsh, "model.hash.num_lsh"),
        ]
    for name, have, want, key in pairs:
        if have != want:
            raise DataError(
                f"shards have {name} {have} but the model has {want}; set --set {key}={have} or re-prepare"
            )


def no_validation_fix(manifest: Manifest) -> str:
    """What gives shards without validation rows some: none were asked for, or too little text held out."""
    if not manifest.config.data.get("val_percent"):
        return "prepare them with data.val_percent above 0"
    return "prepare more text, a larger data.val_percent or a smaller train.seq_len"


def split_shards(path: str | Path, manifest: Manifest, split: str) -> list[ShardEntry]:
    """The manifest's shard entries of one split; an unknown or empty split is a one-line error."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    shards = manifest.splits[split].shards
    if not shards:
        fix = "prepare more text or a smaller seq_len" if split == "train" else no_validation_fix(manifest)
        raise DataError(f"prepared data {str(path)!r} has no {split} rows; {fix}")
    return shards


def check_shard(directory: Path | Location, shard: ShardEntry) -> pq.FileMetaData:
    """A shard must exist, have a readable parquet footer, the manifest's row count and one row per row
    group; returns the footer. One small read per shard catches what happens to files in practice
    (deleted, truncated, swapped for another run's); `verify_shards` reads every byte, on demand."""
    directory = Location.of(directory)
    path = directory / shard.file
    fix = reprepare(directory)
    if not path.is_file():
        raise DataError(f"shard {path} is missing; {fix}")
    try:
        with storage_errors(path), path.fs.open_input_file(path.path) as handle:
            metadata = pq.read_metadata(handle)
    except (OSError, pa.ArrowException):
        raise DataError(f"shard {path} is truncated or not parquet; {fix}") from None
    if metadata.num_rows != shard.rows:
        raise DataError(
            f"shard {path} holds {metadata.num_rows} rows but the manifest says {shard.rows}; {fix}"
        )
    if metadata.num_row_groups != shard.rows:
        raise DataError(f"shard {path} is not one row per row group as prepared; {fix}")
    return metadata


def check_tokenizer(path: str | Path | Location, manifest: Manifest) -> None:
    """The prepared directory's tokenizer.json is the one its manifest records (every run checks it: a
    model is exported with it). One an earlier mhf-dist saved pretty is compared by what it parses to."""
    directory = Location.of(path)
    where = directory / manifest.tokenizer.file
    mismatch = DataError(f"{where} does not match the manifest's sha256; {reprepare(directory)}")
    if not where.is_file():
        raise DataError(f"{where} is missing; {reprepare(directory)}")
    data = where.read_bytes()
    if hashlib.sha256(data).hexdigest() == manifest.tokenizer.sha256:
        return
    try:
        parsed = Tokenizer.from_str(data.decode())
    except Exception:  # tokenizers raises a bare Exception for text it cannot parse
        raise mismatch from None
    if hashlib.sha256(parsed.to_str().encode()).hexdigest() != manifest.tokenizer.sha256:
        raise mismatch


def load_signatures(directory: str | Path | Location, manifest: Manifest) -> SignatureTable:
    """The shards' signature table, the one their manifest records (a damaged or replaced one is refused)."""
    directory = Location.of(directory)
    table_path = directory / manifest.signatures.file
    try:
        table = load_table(table_path)
    except SignatureError:
        raise DataError(
            f"signature table {table_path} is damaged or not one mhf-dist wrote; {reprepare(directory)}"
        ) from None
    _check_recorded(directory, signatures_info(table), manifest.signatures, {"file"})
    return table


def verify_shards(path: str | Path | Location) -> int:
    """Check every file the manifest lists against it, reading all of them; returns the shard count."""
    directory = Location.of(path)
    manifest = read_manifest(directory)
    check_tokenizer(directory, manifest)
    tokenizer = TextTokenizer.load(local_copy(directory / manifest.tokenizer.file))
    recorded = tokenizer_info(tokenizer, manifest.document_format)
    _check_recorded(directory, recorded, manifest.tokenizer, {"file", "sha256"})  # sha256: checked above
    table = load_signatures(directory, manifest)
    difference = table.vocabulary_difference(tokenizer.vocabulary())
    if difference is not None:
        raise DataError(
            f"signature table {directory / manifest.signatures.file} is of another vocabulary than "
            f"{manifest.tokenizer.file} ({difference}); {reprepare(directory)}"
        )
    folder = directory / manifest.folder if manifest.folder else directory
    shards = [shard for split in SPLITS for shard in manifest.splits[split].shards]
    listed = {PurePosixPath(shard.file).name for shard in shards}
    stray = next(
        (e for e in folder.children() if SHARD_FILE.fullmatch(e.name) and e.name not in listed), None
    )
    if stray is not None:  # a reader of the manifest would never see it: a copy or a leftover
        raise DataError(
            f"{str(folder)!r} holds {stray.name}, a shard its manifest does not list; remove it, or "
            f"{reprepare(directory)}"
        )
    for shard in shards:
        metadata = check_shard(directory, shard)
        if file_sha256(directory / shard.file) != shard.sha256:
            raise DataError(
                f"shard {directory / shard.file} differs from the one prepared (sha256 mismatch); "
                f"{reprepare(directory)}"
            )
        _check_columns(directory, shard.file, metadata.schema.to_arrow_schema(), manifest)
    return len(shards)


def _check_recorded(directory: Location, have: Record, recorded: Any, exclude: set[str]) -> None:
    """What a file of `directory` is (`have`) against what the manifest records of it, field by field."""
    actual, wanted = have.model_dump(exclude=exclude), recorded.model_dump(exclude=exclude)
    for field, value in actual.items():
        if value != wanted[field]:
            raise DataError(
                f"{directory / recorded.file} has {field} {value!r} but the manifest says "
                f"{wanted[field]!r}; {reprepare(directory)}"
            )


def _check_columns(directory: Location, name: str, schema: pa.Schema, manifest: Manifest) -> None:
    """A shard's columns have the widths and types the manifest's seq_len, signatures and sources imply."""
    path = directory / name
    width = manifest.seq_len + 1
    sources = len(manifest.sources)
    wanted = {
        "input_ids": (pa.int32(), width, f"seq_len+1 = {width} tokens"),
        "signatures": (
            pa.from_numpy_dtype(np.dtype(manifest.signatures.dtype)),
            width * manifest.signatures.num_hashes,
            f"(seq_len+1) x num_hashes = {width} x {manifest.signatures.num_hashes} "
            f"{manifest.signatures.dtype} signatures",
        ),
    }
    if sources > 1:
        wanted["source_tokens"] = (pa.int32(), sources, f"a token count for each of the {sources} sources")
    if sorted(schema.names) != sorted(wanted):
        raise DataError(
            f"shard {path} has the columns {', '.join(schema.names)}, not the manifest's "
            f"{', '.join(wanted)}; {reprepare(directory)}"
        )
    for column, (value_type, size, meaning) in wanted.items():
        have = schema.field(column).type
        if not pa.types.is_fixed_size_list(have) or (have.value_type, have.list_size) != (value_type, size):
            raise DataError(
                f"shard {path} column {column} is {have}, but the manifest means {meaning} a row; "
                f"{reprepare(directory)}"
            )


def reprepare(directory: str | Path | Location) -> str:
    """The advice for prepared data that is damaged or of an older mhf-dist."""
    return f"re-run `mhf prepare --overwrite --out {directory}` with the --config and --set that made it"
