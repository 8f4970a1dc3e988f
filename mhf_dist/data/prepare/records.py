"""What prepare writes in its work area to resume from, and the units of work it hands to Ray Data, as
typed records; a damaged or hand-edited one reads as missing (`read_record`), so its unit is redone.

Work area layout (`output.work_directory`):
    progress/key.json                    InputsKey: the inputs and settings that decide the shards
    progress/staged/NAME/*.parquet       a Dataset source's documents, staged once (`staging.py`)
    progress/staged/NAME.json            StagedSnapshot: written after the files, so it marks them complete
    progress/parts/NNNNN.arrow, .json    a tokenized part and its PartRecord (written after it)
    progress/shards/SHARD.json           ShardRecord of a shard written beside them
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import ValidationError

from mhf_dist.data.corpus import CorpusFile
from mhf_dist.data.shards import SPLITS, Record, ShardEntry
from mhf_dist.storage import Location

PROGRESS = "progress"
KEY_FILE = "key.json"
PARTS, SHARDS, STAGED = "parts", "shards", "staged"
PROGRESS_VERSION = 2


R = TypeVar("R", bound=Record)


class Unit(Record):
    """One corpus file, whole, or parquet row groups [first, end) of it."""

    file: CorpusFile
    row_groups: tuple[int, int] | None = None


class Indexed(Record):
    """A unit of work: its index names what it writes and orders what it gives (`execute.run_units`)."""

    index: int


class Part(Indexed):
    """A fixed cut of one source's files, tokenized by one call (`tokenize.TokenizeParts`)."""

    source: int
    bytes: int  # of the corpus it reads
    units: tuple[Unit, ...]


class Piece(Record):
    """Stream positions [first, end) of one record batch of a tokenized part (as its source selects)."""

    part: int
    batch: int
    source: int
    first: int
    end: int


class ShardJob(Indexed):
    """One shard: its split, file name and the pieces of the parts' streams it packs."""

    split: str
    name: str
    pieces: tuple[Piece, ...]

    @property
    def tokens(self) -> int:
        return sum(piece.end - piece.first for piece in self.pieces)


class InputsKey(Record):
    """What decides the parts and shards: every file (redacted) with its size, and the settings."""

    version: int
    part_bytes: int
    files: list[list[tuple[str, int]]]
    staged: list[str | None]  # each source's staged snapshot id (None: files)
    data: dict[str, Any]
    seq_len: int
    model_hash: dict[str, Any]
    vocab_size: int
    tokenizer_sha256: str | None  # None: a BPE learned from the corpus, kept in the work area


class Candidates(Record):
    """A keyed source's training documents of one part: record batch, key, tokens, replaced of each."""

    batch: list[int]
    key: list[int]
    tokens: list[int]
    replaced: list[int]


class PartRecord(Record):
    """A tokenized part's counts per split and a keyed source's candidates; its file's bytes (for resume)."""

    part: int
    bytes: int
    batches: dict[str, list[int]]
    documents: dict[str, int]
    replaced: dict[str, int]
    candidates: Candidates | None
    missing_text: int = 0  # records without text (no field, or null), left out
    empty: int = 0  # records of empty text, left out
    first_missing: str | None = None  # where the first record without text is

    @property
    def tokens(self) -> int:
        return sum(sum(self.batches[split]) for split in SPLITS)


class ShardRecord(Record):
    entry: ShardEntry
    fingerprint: str  # the signature table's the shard was written with


class StagedSnapshot(Record):
    """A Dataset source's staged documents, complete: `files` (name, bytes), in order, under
    `progress/staged/NAME/` hold `documents` documents in column `text_field`. `snapshot`: a new id
    each time it is staged, so the parts of another snapshot are never taken for this one's."""

    source: str
    dataset: str  # the callable's "package.module:function", or "given in Python" (never reused)
    args_salt: str | None  # scrypt of its keyword arguments with this salt (None: given in Python)
    args_digest: str | None
    text_field: str
    snapshot: str
    documents: int
    files: list[tuple[str, int]]


def read_record(path: Location, model: type[R]) -> R | None:
    """The record at `path`, or None when it is missing, damaged or of another shape (it is redone)."""
    if not path.is_file():
        return None
    try:
        return model.model_validate_json(path.read_bytes())
    except ValidationError:
        return None


def write_record(path: Location, record: Record) -> None:
    path.write_text(record.model_dump_json())
