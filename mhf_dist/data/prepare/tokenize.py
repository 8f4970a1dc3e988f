"""The first phase's unit of work: one part's documents read, split, tokenized and written as a
tokenized part (Arrow IPC, zstd) in the work area, then its record (counts per batch and split; a keyed
source's candidates) beside it. `TokenizeParts` is what each Ray Data task calls; the tokenizer is parsed
once per Ray worker process (Ray reuses its workers across tasks and runs), not once per part."""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from tokenizers import Tokenizer

from mhf_dist.data import mixture
from mhf_dist.data.corpus import Skipped, bounded_ranges, read_documents
from mhf_dist.data.mixture import Source
from mhf_dist.data.prepare.execute import Done, UnitWork
from mhf_dist.data.prepare.records import (
    PARTS,
    PROGRESS,
    Candidates,
    Part,
    PartRecord,
    read_record,
    write_record,
)
from mhf_dist.data.shards import SPLITS, is_validation
from mhf_dist.storage import Location, storage_errors

CHUNK_TOKENS = 1 << 16  # tokens per record batch of a part: what a shard job reads at least
PART_COMPRESSION = "zstd"
TRAIN, VALIDATION = 0, 1  # the split codes of a tokenized part's `split` column
PART_SCHEMA = pa.schema([("split", pa.int8()), ("key", pa.int64()), ("ids", pa.list_(pa.int32()))])


def part_file(work: Location, part: int, suffix: str = "arrow") -> Location:
    """A tokenized part's file (`json`: its record)."""
    return work / PROGRESS / PARTS / f"{part:05d}.{suffix}"


@dataclass
class TokenizeParts(UnitWork[Part, PartRecord]):
    """A part in, its record out."""

    tokenizer_json: str
    before: list[int]  # the boundary tokens of each document
    after: list[int]
    val_percent: float
    sources: list[Source]
    work: Location

    unit, output, outputs = Part, PartRecord, "tokenized parts"

    def run(self, part: Part) -> Done[PartRecord]:
        """The part's record (from an earlier run when its record and file check out)."""
        source = self.sources[part.source]
        target = part_file(self.work, part.index)
        record_file = part_file(self.work, part.index, "json")
        done = read_record(record_file, PartRecord)
        if done is not None and target.is_file() and target.size() == done.bytes:
            return Done(done, done.tokens, resumed=True)
        counts = PartCounter(keyed=source.keyed)
        skipped = Skipped()
        options = ipc.IpcWriteOptions(compression=PART_COMPRESSION)
        with (
            storage_errors(target),
            target.fs.open_output_stream(target.path, compression=None) as sink,
            ipc.new_file(sink, PART_SCHEMA, options=options) as writer,
        ):
            for unit in part.units:
                for documents in read_documents(unit.file, source.text_field, unit.row_groups, skipped):
                    batch, replaced = self.tokenize(documents, source)
                    lengths = pc.list_value_length(batch.column("ids")).to_numpy().tolist()
                    for start, stop in bounded_ranges(lengths, CHUNK_TOKENS):
                        writer.write_batch(batch.slice(start, stop - start))
                        counts.add(batch.slice(start, stop - start), replaced[start:stop])
        record = counts.record(part.index, target.size(), skipped)
        write_record(record_file, record)
        return Done(record, record.tokens, resumed=False)

    def tokenize(self, documents: pa.Table, source: Source) -> tuple[pa.RecordBatch, np.ndarray]:
        """One batch of documents -> (split, key, token ids between the boundary tokens) per document, and
        each document's replaced count. A source without validation drops its held-out documents."""
        texts = documents["text"].to_pylist()
        replaced = documents["replaced"].to_numpy()
        validation = np.array([is_validation(text, self.val_percent) for text in texts], dtype=bool)
        if not source.validation:
            texts = [text for text, held_out in zip(texts, validation, strict=True) if not held_out]
            replaced, validation = replaced[~validation], validation[~validation]
        keys = (
            [mixture.content_key(text, source.seed) for text in texts] if source.keyed else [0] * len(texts)
        )
        encodings = parsed_tokenizer(self.tokenizer_json).encode_batch(texts, add_special_tokens=False)
        before, after = self.before, self.after
        lengths = np.fromiter((len(encoding.ids) for encoding in encodings), np.int64, len(encodings))
        offsets = np.concatenate([[0], np.cumsum(lengths + len(before) + len(after))]).astype(np.int32)
        tokens = itertools.chain.from_iterable(itertools.chain(before, e.ids, after) for e in encodings)
        flat = np.fromiter(tokens, np.int32, offsets[-1])
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        columns = [pa.array(validation.astype(np.int8)), pa.array(keys, pa.int64()), ids]
        return pa.RecordBatch.from_arrays(columns, schema=PART_SCHEMA), replaced


@functools.lru_cache(maxsize=2)
def parsed_tokenizer(tokenizer_json: str) -> Tokenizer:
    """Parsed once per worker process."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a task; Ray Data runs them in parallel
    return Tokenizer.from_str(tokenizer_json)


class PartCounter:
    """A part's record, one record batch (the next) at a time."""

    def __init__(self, keyed: bool) -> None:
        self.batches: dict[str, list[int]] = {split: [] for split in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)
        self.replaced = dict.fromkeys(SPLITS, 0)
        self.candidates: dict[str, list[int]] | None = (
            {"batch": [], "key": [], "tokens": [], "replaced": []} if keyed else None
        )

    def add(self, batch: pa.RecordBatch, replaced: np.ndarray) -> None:
        index = len(self.batches["train"])
        tokens = pc.list_value_length(batch.column("ids")).to_numpy().astype(np.int64)
        held_out = batch.column("split").to_numpy() == VALIDATION
        for split, chosen in (("train", ~held_out), ("validation", held_out)):
            self.batches[split].append(int(tokens[chosen].sum()))
            self.documents[split] += int(chosen.sum())
            self.replaced[split] += int(replaced[chosen].sum())
        if self.candidates is not None:
            pool = self.candidates
            pool["batch"] += [index] * int((~held_out).sum())
            pool["key"] += batch.column("key").to_numpy()[~held_out].tolist()
            pool["tokens"] += tokens[~held_out].tolist()
            pool["replaced"] += replaced[~held_out].tolist()

    def record(self, part: int, size: int, skipped: Skipped) -> PartRecord:
        return PartRecord(
            part=part,
            bytes=size,
            batches=self.batches,
            documents=self.documents,
            replaced=self.replaced,
            candidates=None if self.candidates is None else Candidates(**self.candidates),
            missing_text=skipped.missing,
            empty=skipped.empty,
            first_missing=skipped.first_missing,
        )
