"""The driver's plan: the corpus cut into parts, then (from the parts' counts) which documents each
source gives and which pieces of the token streams each shard packs.

Every cut is a fixed rule of the inputs (file sizes, row groups, token counts), never of the cluster,
Ray Data's blocks or the number of CPUs, so the same inputs give the same parts and shards anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow.parquet as pq

from mhf_dist.config import Config
from mhf_dist.data import mixture
from mhf_dist.data.corpus import CorpusFile, Skipped, bounded_ranges
from mhf_dist.data.mixture import Candidates, Source
from mhf_dist.data.packing import row_count, token_range
from mhf_dist.data.prepare.records import Part, PartRecord, Piece, ShardJob, Unit
from mhf_dist.data.shards import SPLITS, shard_name
from mhf_dist.storage import Location, storage_errors

T = TypeVar("T")
PART_BYTES = 16 << 20  # corpus bytes per part (a larger file is a part alone, or cut by row groups)
SHARD_TASK_TOKENS = 1 << 20  # shard jobs smaller than this share a Ray Data task (`execute.run_units`)


def plan_parts(files: list[list[CorpusFile]], text_fields: list[str]) -> list[Part]:
    """Each source's files cut into parts of about PART_BYTES, in order."""
    parts: list[Part] = []
    for source, (source_files, text_field) in enumerate(zip(files, text_fields, strict=True)):
        units = list(_units(source_files, text_field))
        for start, stop in bounded_ranges([size for _, size in units], PART_BYTES):
            chosen = units[start:stop]
            size = sum(size for _, size in chosen)
            parts.append(Part(index=len(parts), source=source, bytes=size, units=tuple(u for u, _ in chosen)))
    return parts


def _units(files: list[CorpusFile], text_field: str) -> Iterator[tuple[Unit, int]]:
    """Units with their sizes: a large parquet file in ranges of row groups, every other file whole."""
    for file in files:
        if file.kind != "parquet" or file.size <= PART_BYTES:
            yield Unit(file=file), file.size
            continue
        where = Location.of(file.uri)
        with storage_errors(where), where.fs.open_input_file(where.path) as handle:
            metadata = pq.read_metadata(handle)
        column = metadata.schema.to_arrow_schema().get_field_index(text_field)
        sizes = [
            metadata.row_group(group).column(column).total_compressed_size if column >= 0 else 0
            for group in range(metadata.num_row_groups)
        ]
        for first, end in bounded_ranges(sizes, PART_BYTES):
            yield Unit(file=file, row_groups=(first, end)), sum(sizes[first:end])


@dataclass
class PartCounts:
    """A tokenized part's record as the driver holds it: counts per split, a keyed source's candidates
    as arrays (8 bytes a number, not a Python int's 28)."""

    tokens: dict[str, np.ndarray]  # per record batch
    documents: dict[str, int]
    replaced: dict[str, int]
    candidates: dict[str, np.ndarray] | None
    skipped: Skipped  # records that are no documents

    @classmethod
    def of(cls, record: PartRecord) -> PartCounts:
        pool = record.candidates
        return cls(
            {split: np.array(record.batches[split], np.int64) for split in SPLITS},
            dict(record.documents),
            dict(record.replaced),
            None if pool is None else {k: np.asarray(v, np.int64) for k, v in pool.model_dump().items()},
            Skipped(record.missing_text, record.empty, record.first_missing),
        )

    def taken(self, threshold: int | None) -> PartCounts:
        """What the part gives with a keyed source's training documents cut at `threshold`."""
        if threshold is None:
            return self
        pool = self.candidates
        assert pool is not None
        chosen = pool["key"] < threshold
        train = np.bincount(
            pool["batch"][chosen], weights=pool["tokens"][chosen], minlength=len(self.tokens["train"])
        )
        return PartCounts(
            {**self.tokens, "train": train.astype(np.int64)},
            {**self.documents, "train": int(chosen.sum())},
            {**self.replaced, "train": int(pool["replaced"][chosen].sum())},
            None,
            self.skipped,
        )


@dataclass
class Selection:
    """The documents every part gives once the keyed sources are cut (`mixture.thresholds`)."""

    limits: list[int | None]  # each source's key threshold (None: used whole)
    taken: list[PartCounts]  # per part
    totals: list[dict[str, int]]  # per source: documents and tokens of each split
    pools: list[Candidates | None]  # per source: a keyed one's candidates
    skipped: list[Skipped]  # per source: its records that are no documents


def select(sources: list[Source], parts: list[Part], counts: list[PartCounts]) -> Selection:
    """The keyed sources' thresholds, from their candidates; then what each part and source gives."""

    def by_source(items: list[PartCounts]) -> list[list[PartCounts]]:
        return [[c for c, p in zip(items, parts, strict=True) if p.source == s] for s in range(len(sources))]

    of_source = by_source(counts)
    pools = [_candidates(mine) if s.keyed else None for s, mine in zip(sources, of_source, strict=True)]
    whole = [sum(int(c.tokens["train"].sum()) for c in mine) for mine in of_source]
    limits = mixture.thresholds(sources, whole, pools)
    taken = [c.taken(limits[part.source]) for c, part in zip(counts, parts, strict=True)]
    totals, skipped = [], []
    for mine in by_source(taken):
        skipped.append(Skipped())
        for counted in mine:
            skipped[-1].add(counted.skipped)
        totals.append(
            {
                "documents": sum(t.documents["train"] for t in mine),
                "tokens": sum(int(t.tokens["train"].sum()) for t in mine),
                "validation_documents": sum(t.documents["validation"] for t in mine),
                "validation_tokens": sum(int(t.tokens["validation"].sum()) for t in mine),
            }
        )
    return Selection(limits, taken, totals, pools, skipped)


def _candidates(counts: list[PartCounts]) -> Candidates:
    pools = [c.candidates for c in counts if c.candidates is not None]
    return Candidates(
        np.concatenate([pool["key"] for pool in pools]), np.concatenate([pool["tokens"] for pool in pools])
    )


def shard_jobs(cfg: Config, parts: list[Part], selection: Selection) -> list[ShardJob]:
    """Every shard of both splits, in order: the pieces of the parts' record batches it packs."""
    seq_len, packing = cfg.train.seq_len, cfg.data.packing
    batches = [
        (part.index, batch, part.source)
        for part, taken in zip(parts, selection.taken, strict=True)
        for batch in range(len(taken.tokens["train"]))
    ]
    jobs: list[ShardJob] = []
    for split in SPLITS:
        starts = np.concatenate([[0], np.cumsum([n for t in selection.taken for n in t.tokens[split]])])
        bounds = shard_bounds(row_count(int(starts[-1]), seq_len, packing), cfg.data.rows_per_shard)
        for index, (first, end) in enumerate(bounds):
            start, stop = token_range(first, end, seq_len, packing)
            pieces = tuple(
                Piece(part=part, batch=batch, source=source, first=lo, end=hi)
                for (part, batch, source), lo, hi in block_pieces(batches, starts, start, stop)
            )
            jobs.append(ShardJob(index=len(jobs), split=split, name=shard_name(split, index), pieces=pieces))
    return jobs


def shard_bounds(rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    """[first, end) rows of each shard of a split of `rows` rows."""
    return [(first, min(first + rows_per_shard, rows)) for first in range(0, rows, rows_per_shard)]


def block_pieces(blocks: list[T], starts: np.ndarray, start: int, stop: int) -> list[tuple[T, int, int]]:
    """(block, first, end) slices of the blocks' token streams that make up stream positions [start, stop)."""
    first = int(np.searchsorted(starts, start, side="right")) - 1
    pieces = []
    for index in range(first, len(blocks)):
        if starts[index] >= stop:
            break
        lo, hi = max(start, starts[index]), min(stop, starts[index + 1])
        if hi > lo:
            pieces.append((blocks[index], int(lo - starts[index]), int(hi - starts[index])))
    return pieces
