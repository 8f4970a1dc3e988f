"""`mhf prepare`: corpus -> tokenize -> pack -> signatures -> parquet shards + manifest, on Ray.

One pass over the corpus, in bounded Ray tasks; the driver handles only counts, offsets and the manifest
(plus, for a source chosen by key, one key and token count per candidate document: `mixture.py`):
1. The corpus files are cut into parts by a fixed rule of their sizes (consecutive small files together
   up to `PART_BYTES`, a large parquet file by ranges of row groups), never by the cluster. One task per
   part reads its documents in bounded batches (`corpus.read_documents`), splits them (`is_validation`),
   tokenizes them and writes them as a tokenized part file (Arrow IPC, a record batch per batch read) to
   the work directory on the output's filesystem, then a small record of its counts per batch and split.
2. From the counts the driver knows where every shard's rows start in each split's token stream
   (`packing.token_range`), and one task per shard reads the record batches of the parts that cover its
   range, packs the rows, looks up the signatures and writes the parquet file.
At most a few tasks per CPU are in flight and none returns more than counts, so Ray's object store holds
O(tasks in flight), never O(corpus); the tokenized parts take about 4 bytes a token (less, compressed)
on the output's storage until the end. A shard's rows depend only on the token stream, never on how the
work was cut or how many CPUs ran it, so the same inputs give byte-identical shards on any cluster. On a
multi-node cluster the output must be storage every node can reach (a bucket, or a shared path).

**Completeness and resuming.** The work directory is `.NAME.partial/` beside a local output (renamed
to NAME at the end), or the output prefix itself in a bucket (no rename there: readers trust only a
manifest). Its `progress/key.json` records the inputs (every file with its size) and the settings that
decide the shards; each part and shard task writes its own record after its file. A rerun with the same
key skips every part and shard whose record and file check out (a shard by its sha256) and does the
rest; with another key it starts over. At the end the tokenized parts and records are removed, the
manifest is written, and only then the key: an interrupted run never leaves a manifest, and a bucket
prefix holding neither a manifest nor our key is not ours to replace. Nor is an output holding anything
prepare does not write (`check_output`): `--overwrite` refuses it, in one line, and touches nothing.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from mhf_dist.config import Config, DataConfig
from mhf_dist.data import mixture, recall
from mhf_dist.data.corpus import CorpusFile, bounded_ranges, corpus_files, read_documents
from mhf_dist.data.mixture import Candidates, Source
from mhf_dist.data.packing import Packing, dropped_tokens, pack_rows, row_count, token_range
from mhf_dist.data.shards import (
    FORMAT,
    MANIFEST,
    ROWS_PER_GROUP,
    SHARD_FILE,
    SIGNATURES_FILE,
    SPLITS,
    TOKENIZER_FILE,
    VERSION,
    Manifest,
    Mixture,
    PreparedWith,
    ShardEntry,
    SourceInfo,
    SplitInfo,
    content_hash,
    file_sha256,
    is_validation,
    save_tokenizer,
    shard_name,
    signatures_info,
    tokenizer_info,
    write_manifest,
    write_shard,
)
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError, MhfError
from mhf_dist.files import publish_directory, staged_directory, staged_file
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.readers import read_json
from mhf_dist.signatures import SignatureTable, build_for_config, load_table, save_table
from mhf_dist.storage import Location, local_copy, redact, storage_errors

PART_BYTES = 16 << 20  # corpus bytes per part (a larger file is a part alone, or cut by row groups)
CHUNK_TOKENS = 1 << 16  # tokens per record batch of a part: what a shard task reads at least
TASKS_PER_CPU = 2  # tasks in flight: enough to keep every CPU busy between one task and the next
PROGRESS = "progress"  # in the work directory: what a rerun resumes from
KEY_FILE = "key.json"
PARTS, SHARDS = "parts", "shards"
PROGRESS_VERSION = 1
PART_COMPRESSION = "zstd"
TRAIN, VALIDATION = 0, 1  # the split codes of a tokenized part's `split` column
# Every file a prepare writes in its output (the progress folder only while a bucket run is unfinished).
WRITTEN_HERE = re.compile(
    "|".join(
        (
            *(re.escape(name) for name in (MANIFEST, TOKENIZER_FILE, SIGNATURES_FILE)),
            SHARD_FILE.pattern,
            rf"{PROGRESS}/{re.escape(KEY_FILE)}",
            rf"{PROGRESS}/{PARTS}/\d{{5,}}\.(arrow|json)",  # a part's tokens, and its record
            rf"{PROGRESS}/{SHARDS}/({SHARD_FILE.pattern})\.json",
        )
    )
)
T = TypeVar("T")


@dataclass(frozen=True)
class Part:
    """A fixed cut of one source's files: whole files, or parquet row groups [first, end) of one file."""

    index: int
    source: int
    units: tuple[tuple[CorpusFile, tuple[int, int] | None], ...]

    @property
    def name(self) -> str:
        return f"{self.index:05d}"


def prepare_if_missing(cfg: Config, log: Callable[[str], None] = print, verbose: bool = False) -> None:
    """Prepare `data.path` from `data.corpus` unless it already holds a complete dataset (jobs rerun)."""
    if (Location.of(cfg.data.path) / MANIFEST).is_file():
        log(f"prepared shards found in {redact(cfg.data.path)}; not preparing again")
        return
    prepare(cfg, cfg.data.path, log=log, verbose=verbose, flag="data.path")


def prepare(
    cfg: Config,
    out: str | Path | Location,
    overwrite: bool = False,
    num_cpus: int | None = None,
    log: Callable[[str], None] = print,
    verbose: bool = False,
    flag: str = "--out",
) -> Manifest:
    """Prepare the config's corpus (or its sources) into shards at `out` (local or a bucket); returns
    the manifest. A partial run of the same inputs and settings is resumed. `verbose`: Ray's own lines
    on the console too (`ensure_ray`). `flag`: what the user gave `out` as (`--out`, `--workdir`), for
    the advice of a refused output."""
    out = Location.of(out)
    if num_cpus is not None and num_cpus < 1:
        raise DataError(f"--num-cpus {num_cpus}: Ray needs at least one CPU")
    check_output(out, overwrite, flag)
    if cfg.data.corpus == recall.CORPUS:
        return _prepare_recall(cfg, out, log)
    data = cfg.data
    sources = mixture.sources(data)
    files = [corpus_files(source.corpus) for source in sources]
    for source, source_files in zip(sources, files, strict=True):
        for _ in read_documents(source_files[0], source.text_field):  # a missing field: before any work
            break
    tokenizer = None if data.tokenizer == "bpe" else _resolve_tokenizer(cfg)
    work = work_directory(out)
    _open_work(work, _inputs_key(cfg, files, tokenizer), log)
    tokenizer = tokenizer or _learned_tokenizer(cfg, work, sources, files)
    with staged_file((work / TOKENIZER_FILE).uri) as staging:  # first: a rerun reuses a learned BPE
        save_tokenizer(tokenizer, staging)
    document_format = tokenizer.resolve_format(data.document_format)
    table = signature_table(cfg, tokenizer)
    _check_model_documents(cfg, document_format)
    _log_tables(log, tokenizer, table, document_format)

    ensure_ray(num_cpus, verbose)
    splits, records = _write_shards(
        cfg, sources, files, tokenizer, table, work, document_format, num_cpus, log
    )
    with staged_file((work / SIGNATURES_FILE).uri) as staging:
        save_table(table, staging)
    manifest = _manifest(cfg, tokenizer, table, splits, document_format, records)
    _publish(work, out, manifest)
    _log_splits(log, cfg, splits)
    log(f"wrote {out} (content sha256 {manifest.content_sha256[:12]})")
    return manifest


def check_output(out: Location, overwrite: bool, flag: str = "--out") -> None:
    """Before any work: `out` (named by the option `flag`) is absent, an empty directory, or shards this
    command wrote, replaced only with `overwrite` (a bucket prefix holding a partial run of ours is
    resumed); anything else is never touched. A local one must be writable."""
    keep_out = f"choose another {flag} or remove it yourself"
    if out.remote:
        out.check_bucket()
    elif out.local.is_symlink():
        raise DataError(f"output {str(out)!r} is a symbolic link, not a directory of shards; {keep_out}")
    if out.is_file():
        raise DataError(f"output {str(out)!r} is a file, not a directory of shards; {keep_out}")
    entries = out.children()
    if entries:
        foreign = _foreign(out, entries)
        if foreign is not None:
            raise DataError(f"output {str(out)!r} is not shards mhf prepare wrote ({foreign}); {keep_out}")
        if (out / MANIFEST).is_file() and not overwrite:
            raise DataError(
                f"output {str(out)!r} holds prepared shards; pass --overwrite or choose another {flag}"
            )
    if not out.remote:
        check_writable(out.local.parent, flag)


def _foreign(out: Location, entries: list[Location]) -> str | None:
    """Why the non-empty directory `out` is not shards of ours (to replace, or in a bucket to resume),
    or None when it is: every file in it one this command writes, under the names and in the folders it
    writes them, and a manifest of ours, or (damaged) one beside a signature table of ours."""
    files = [path for path, _ in out.files()]
    stranger = next((path for path in files if not WRITTEN_HERE.fullmatch(path)), None)
    if stranger is None:  # an empty folder, or a link to one
        holding = {path.split("/", 1)[0] for path in files}
        stranger = next((entry.name for entry in entries if entry.name not in holding), None)
    if stranger is not None:
        return f"it holds {stranger!r}"
    if out.remote and f"{PROGRESS}/{KEY_FILE}" in files:
        return None  # a bucket run of ours that did not finish
    if MANIFEST not in files:
        return f"it has no {MANIFEST}"
    try:
        raw = json.loads((out / MANIFEST).read_bytes())
    except ValueError:
        return None if _our_signature_table(out) else f"its {MANIFEST} is not JSON"
    if isinstance(raw, dict) and raw.get("format") == FORMAT:
        return None
    return f"its {MANIFEST} is not an mhf shard manifest"


def _our_signature_table(out: Location) -> bool:
    try:
        load_table(out / SIGNATURES_FILE)
    except MhfError:
        return False
    return True


def check_writable(directory: Path, flag: str = "--out") -> None:
    """The output's parent must exist or be creatable, and take new files, before any work starts."""
    existing = next(parent for parent in (directory, *directory.parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(
            f"cannot write under {str(existing)!r} (not a writable directory); choose another {flag}"
        )


def work_directory(out: Location) -> Location:
    """Where a prepare of `out` writes: `.NAME.partial` beside a local output, the prefix itself in a
    bucket."""
    return out if out.remote else Location.of(out.local.parent / f".{out.local.name}.partial")


def _open_work(work: Location, key: dict[str, Any], log: Callable[[str], None]) -> None:
    """Resume `work` if its key is `key`, else start it afresh (a remote `work` is ours: check_output)."""
    key_file = work / PROGRESS / KEY_FILE
    if key_file.is_file():
        if read_json(key_file, DataError, f"remove {work}") == key:
            log(f"resuming the partial prepare in {work} (same inputs and settings)")
            return
        log(f"the partial prepare in {work} had other inputs or settings; starting over")
    if (work / MANIFEST).is_file():
        (work / MANIFEST).remove()  # no longer complete before any of it changes
    work.remove()
    for folder in (PARTS, SHARDS):
        (work / PROGRESS / folder).make_dirs()
    key_file.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")


def _inputs_key(
    cfg: Config, files: list[list[CorpusFile]], tokenizer: TextTokenizer | None
) -> dict[str, Any]:
    """What decides the parts and shards: every file (redacted) with its size, and the settings."""
    key = {
        "version": PROGRESS_VERSION,
        "part_bytes": PART_BYTES,
        "files": [[[redact(file.uri), file.size] for file in source_files] for source_files in files],
        "data": recorded_data(cfg.data),
        "seq_len": cfg.train.seq_len,
        "model_hash": cfg.model.hash.model_dump(),
        "vocab_size": cfg.model.vocab_size,
        "tokenizer_sha256": tokenizer.sha256 if tokenizer else None,  # bpe: learned, kept in the work
    }
    return json.loads(json.dumps(key))  # as it reads back


def recorded_data(data: DataConfig) -> dict[str, Any]:
    """The data settings as the manifest and the key record them: no path, corpora redacted."""
    record = data.model_dump(exclude={"path"})
    record["corpus"] = redact(record["corpus"])
    record["sources"] = [{**source, "corpus": redact(source["corpus"])} for source in record["sources"]]
    if record["replay"]["corpus"] is not None:
        record["replay"]["corpus"] = redact(record["replay"]["corpus"])
    return record


def _resolve_tokenizer(cfg: Config) -> TextTokenizer:
    """The tokenizer `data.tokenizer` names when it is not learned from the corpus."""
    return _check_vocab_size(cfg, TextTokenizer.resolve(cfg.data.tokenizer, cfg.model.vocab_size, []))


def _check_vocab_size(cfg: Config, tokenizer: TextTokenizer) -> TextTokenizer:
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"set --set model.vocab_size={tokenizer.vocab_size}"
        )
    return tokenizer


def _learned_tokenizer(
    cfg: Config, work: Location, sources: list[Source], files: list[list[CorpusFile]]
) -> TextTokenizer:
    """The BPE learned from every source's training documents (read in this process, streaming), or the
    one the run this one resumes learned."""
    saved = work / TOKENIZER_FILE
    if saved.is_file():
        return TextTokenizer.load(local_copy(saved))
    val_percent = cfg.data.val_percent
    documents = [0] * len(sources)  # each source's, held out or not
    learned_from = 0

    def training_texts() -> Iterator[str]:
        nonlocal learned_from
        for index, (source, source_files) in enumerate(zip(sources, files, strict=True)):
            for file in source_files:
                for batch in read_documents(file, source.text_field):
                    for text in batch["text"].to_pylist():
                        documents[index] += 1
                        if not is_validation(text, val_percent):
                            learned_from += 1
                            yield text

    learned = TextTokenizer.train_bpe(training_texts(), cfg.model.vocab_size)
    for source, count in zip(sources, documents, strict=True):
        if count == 0:  # a BPE learned from nothing has the bytes alone: not a vocab_size to advise
            raise _discard(work, _no_text(source))
    if learned_from == 0:
        raise _discard(
            work,
            DataError(
                f"all {sum(documents)} documents are held out for validation (data.val_percent="
                f"{val_percent:g}), none is left to learn the BPE from; use more text or a smaller "
                "data.val_percent"
            ),
        )
    return _check_vocab_size(cfg, learned)


def _log_tables(
    log: Callable[[str], None], tokenizer: TextTokenizer, table: SignatureTable, document_format: str
) -> None:
    log(
        f"tokenizer: {tokenizer.vocab_size} tokens (sha256 {tokenizer.sha256[:12]}), {document_format} "
        f"documents ({_describe_format(tokenizer, document_format)}); signatures "
        f"{table.spec} seed {table.seed} ({table.scheme} scheme), fingerprint {table.fingerprint[:12]}"
    )
    if table.duplicate_signatures:  # the authors' rule allows them (H=1, shared prefixes, all-LSH)
        log(
            f"warning: {table.duplicate_signatures} token(s) share an earlier token's signature; exact "
            "scoring gives them equal scores (the authors' redraw rule, as in their tables; "
            "model.hash.scheme=murmur32 is collision-free)"
        )


def _log_splits(log: Callable[[str], None], cfg: Config, splits: dict[str, SplitInfo]) -> None:
    for split in SPLITS:
        info = splits[split]
        log(
            f"{split}: {info.documents:,} documents -> {info.rows:,} rows of {cfg.train.seq_len + 1} "
            f"({info.target_tokens:,} target tokens, {info.dropped_tokens:,} dropped), "
            f"{len(info.shards)} shards"
        )


def _publish(work: Location, out: Location, manifest: Manifest) -> None:
    """Parts, records and anything else the manifest does not name (a write an interrupted run left
    half done) removed, the manifest written, then the key; a local output is renamed into place (what
    it replaces: check_output allowed)."""
    for folder in (PARTS, SHARDS):
        (work / PROGRESS / folder).remove()
    named = {shard.file for info in manifest.splits.values() for shard in info.shards}
    for entry in work.children():
        if entry.name not in named | {TOKENIZER_FILE, SIGNATURES_FILE, PROGRESS}:
            entry.remove()
    write_manifest(work, manifest)
    (work / PROGRESS).remove()
    if not out.remote:
        publish_directory(work.local, out.local, replace=True)


def _discard(work: Location, error: DataError) -> DataError:
    """A run that cannot succeed with these inputs leaves nothing to resume."""
    work.remove()
    return error


# --- the parts: tokenized documents -------------------------------------------------------------------


def plan_parts(files: list[list[CorpusFile]], text_fields: list[str]) -> list[Part]:
    """Each source's files cut into parts of about PART_BYTES, in order (a fixed rule of the files'
    sizes and row groups: the same parts on any cluster)."""
    parts: list[Part] = []
    for source, (source_files, text_field) in enumerate(zip(files, text_fields, strict=True)):
        units = list(_units(source_files, text_field))
        for start, stop in bounded_ranges([size for _, size in units], PART_BYTES):
            parts.append(Part(len(parts), source, tuple(unit for unit, _ in units[start:stop])))
    return parts


def _units(
    files: list[CorpusFile], text_field: str
) -> Iterator[tuple[tuple[CorpusFile, tuple[int, int] | None], int]]:
    """(file, row-group range) units with their sizes: a parquet file past PART_BYTES in ranges of row
    groups of about PART_BYTES of its text column, every other file whole."""
    for file in files:
        if file.kind != "parquet" or file.size <= PART_BYTES:
            yield (file, None), file.size
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
            yield (file, (first, end)), sum(sizes[first:end])


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(tokenizer_json: str) -> Tokenizer:
    """Parsed once per Ray worker process (workers are reused across tasks), not once per batch."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task; Ray runs the tasks in parallel
    return Tokenizer.from_str(tokenizer_json)


PART_SCHEMA = pa.schema([("split", pa.int8()), ("key", pa.int64()), ("ids", pa.list_(pa.int32()))])


def tokenize_documents(
    documents: pa.Table,
    tokenizer: Tokenizer,
    before: list[int],
    after: list[int],
    source: Source,
    val_percent: float,
) -> tuple[pa.RecordBatch, np.ndarray]:
    """One batch of documents -> (split, key, token ids between the boundary tokens) per document, and
    each document's replaced count. A source without validation drops its held-out documents."""
    texts = documents["text"].to_pylist()
    replaced = documents["replaced"].to_numpy()
    validation = np.array([is_validation(text, val_percent) for text in texts], dtype=bool)
    if not source.validation:
        texts = [text for text, held_out in zip(texts, validation, strict=True) if not held_out]
        replaced, validation = replaced[~validation], validation[~validation]
    keys = [mixture.content_key(text, source.seed) for text in texts] if source.keyed else [0] * len(texts)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(encoding.ids) for encoding in encodings), np.int64, len(encodings))
    offsets = np.concatenate([[0], np.cumsum(lengths + len(before) + len(after))]).astype(np.int32)
    tokens = itertools.chain.from_iterable(itertools.chain(before, e.ids, after) for e in encodings)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.fromiter(tokens, np.int32, offsets[-1])))
    columns = [pa.array(validation.astype(np.int8)), pa.array(keys, pa.int64()), ids]
    return pa.RecordBatch.from_arrays(columns, schema=PART_SCHEMA), replaced


def tokenize_part(
    part: Part,
    source: Source,
    tokenizer_json: str,
    before: list[int],
    after: list[int],
    val_percent: float,
    work_uri: str,
) -> tuple[dict[str, Any], bool]:
    """Ray task: one part's documents tokenized into `progress/parts/NAME.arrow`, then its record (counts
    per batch and split; a keyed source's candidates) beside it; returns (record, whether it was already
    there)."""
    folder = Location.of(work_uri) / PROGRESS / PARTS
    target, record_file = folder / f"{part.name}.arrow", folder / f"{part.name}.json"
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if target.is_file() and target.size() == record["bytes"]:
            return _compact(record), True
    tokenizer = _worker_tokenizer(tokenizer_json)
    record: dict[str, Any] = {
        "part": part.index,
        "batches": {split: [] for split in SPLITS},
        **{count: dict.fromkeys(SPLITS, 0) for count in ("documents", "replaced")},
        "candidates": {"batch": [], "key": [], "tokens": [], "replaced": []} if source.keyed else None,
    }
    options = ipc.IpcWriteOptions(compression=PART_COMPRESSION)
    with (
        storage_errors(target),
        target.fs.open_output_stream(target.path, compression=None) as sink,
        ipc.new_file(sink, PART_SCHEMA, options=options) as writer,
    ):
        batches = (
            batch for file, groups in part.units for batch in read_documents(file, source.text_field, groups)
        )
        for documents in batches:
            batch, replaced = tokenize_documents(documents, tokenizer, before, after, source, val_percent)
            lengths = pc.list_value_length(batch.column("ids")).to_numpy().tolist()
            for start, stop in bounded_ranges(lengths, CHUNK_TOKENS):
                writer.write_batch(batch.slice(start, stop - start))
                _count_batch(record, batch.slice(start, stop - start), replaced[start:stop])
    record["bytes"] = target.size()
    record_file.write_text(json.dumps(record))
    return _compact(record), False


def _compact(record: dict[str, Any]) -> dict[str, Any]:
    """The record with a keyed source's candidates as arrays: 8 bytes a number in the driver."""
    if record["candidates"] is None:
        return record
    return {
        **record,
        "candidates": {name: np.asarray(values, np.int64) for name, values in record["candidates"].items()},
    }


def _count_batch(record: dict[str, Any], batch: pa.RecordBatch, replaced: np.ndarray) -> None:
    """Adds one record batch of a part (the next) to the part's record."""
    index = len(record["batches"]["train"])
    tokens = pc.list_value_length(batch.column("ids")).to_numpy().astype(np.int64)
    held_out = batch.column("split").to_numpy() == VALIDATION
    for split, chosen in (("train", ~held_out), ("validation", held_out)):
        record["batches"][split].append(int(tokens[chosen].sum()))
        record["documents"][split] += int(chosen.sum())
        record["replaced"][split] += int(replaced[chosen].sum())
    if record["candidates"] is not None:
        candidates = record["candidates"]
        candidates["batch"] += [index] * int((~held_out).sum())
        candidates["key"] += batch.column("key").to_numpy()[~held_out].tolist()
        candidates["tokens"] += tokens[~held_out].tolist()
        candidates["replaced"] += replaced[~held_out].tolist()


# --- from the counts to the shards --------------------------------------------------------------------


@dataclass
class Taken:
    """What the chosen documents of one part give to each split: tokens per batch, documents, replaced."""

    tokens: dict[str, np.ndarray]
    documents: dict[str, int]
    replaced: dict[str, int]


def taken_from_part(record: dict[str, Any], threshold: int | None) -> Taken:
    """A part's counts with a keyed source's training documents cut at `threshold`."""
    tokens = {split: np.array(record["batches"][split], np.int64) for split in SPLITS}
    documents, replaced = dict(record["documents"]), dict(record["replaced"])
    if threshold is not None:
        pool = record["candidates"]
        chosen = pool["key"] < threshold
        tokens["train"] = np.bincount(
            pool["batch"][chosen], weights=pool["tokens"][chosen], minlength=len(tokens["train"])
        ).astype(np.int64)
        documents["train"] = int(chosen.sum())
        replaced["train"] = int(pool["replaced"][chosen].sum())
    return Taken(tokens, documents, replaced)


def _candidates(records: list[dict[str, Any]]) -> Candidates:
    return Candidates(
        np.concatenate([record["candidates"]["key"] for record in records]),
        np.concatenate([record["candidates"]["tokens"] for record in records]),
    )


@dataclass
class Selection:
    """The documents every part gives once the keyed sources are cut (`mixture.thresholds`)."""

    limits: list[int | None]  # each source's key threshold (None: used whole)
    taken: list[Taken]  # per part
    totals: list[dict[str, int]]  # per source: documents and tokens of each split
    pools: list[Candidates | None]  # per source: a keyed one's candidates


def select(sources: list[Source], parts: list[Part], records: list[dict[str, Any]]) -> Selection:
    of_source = [
        [r for r, p in zip(records, parts, strict=True) if p.source == s] for s in range(len(sources))
    ]
    pools = [
        _candidates(chosen) if source.keyed else None
        for source, chosen in zip(sources, of_source, strict=True)
    ]
    whole = [sum(sum(record["batches"]["train"]) for record in chosen) for chosen in of_source]
    limits = mixture.thresholds(sources, whole, pools)
    taken = [
        taken_from_part(record, limits[part.source]) for record, part in zip(records, parts, strict=True)
    ]
    totals = []
    for index in range(len(sources)):
        mine = [t for t, part in zip(taken, parts, strict=True) if part.source == index]
        totals.append(
            {
                "documents": sum(t.documents["train"] for t in mine),
                "tokens": sum(int(t.tokens["train"].sum()) for t in mine),
                "validation_documents": sum(t.documents["validation"] for t in mine),
                "validation_tokens": sum(int(t.tokens["validation"].sum()) for t in mine),
            }
        )
    return Selection(limits, taken, totals, pools)


def _write_shards(
    cfg: Config,
    sources: list[Source],
    files: list[list[CorpusFile]],
    tokenizer: TextTokenizer,
    table: SignatureTable,
    work: Location,
    document_format: str,
    num_cpus: int | None,
    log: Callable[[str], None],
) -> tuple[dict[str, SplitInfo], list[dict[str, Any]]]:
    import ray

    limit = TASKS_PER_CPU * (num_cpus or max(1, int(ray.cluster_resources().get("CPU", 1))))
    parts = plan_parts(files, [source.text_field for source in sources])
    records = _tokenize_parts(cfg, sources, parts, tokenizer, work, document_format, limit, log)
    _check_text(work, sources, parts, records)
    selection = select(sources, parts, records)
    _check_rows(cfg, work, selection)
    jobs = _shard_jobs(cfg, parts, selection)
    write = ray.remote(write_shard_from_parts)
    table_ref = ray.put(table)
    counted = len(sources) if len(sources) > 1 else 0
    shape = (cfg.train.seq_len, cfg.data.packing)
    written = gather(
        lambda job: write.remote(
            job[2], job[0], *shape, table_ref, work.uri, job[1], selection.limits, counted
        ),
        jobs,
        limit,
    )
    _log_resumed(log, "shards", [skipped for _, skipped in written])
    splits = _split_infos(
        cfg, sources, selection, [(job[0], entry) for job, (entry, _) in zip(jobs, written, strict=True)]
    )
    records_out = mixture.source_records(sources, selection.totals)
    if mixture.replays(cfg.data):
        _log_replay(splits["train"].mixture)
    elif len(sources) > 1:
        log(mixture.describe(sources, records_out, selection.limits))
    replaced = sum(splits[split].replaced for split in SPLITS)
    if replaced:
        corpora = ", ".join(repr(redact(source.corpus)) for source in sources)
        print(
            f"warning: {replaced} invalid UTF-8 sequences in {corpora} were replaced by U+FFFD",
            file=sys.stderr,
        )
    return splits, records_out


def _tokenize_parts(
    cfg: Config,
    sources: list[Source],
    parts: list[Part],
    tokenizer: TextTokenizer,
    work: Location,
    document_format: str,
    limit: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    import ray

    tokenize = ray.remote(tokenize_part)
    tokenizer_ref = ray.put(tokenizer.tokenizer.to_str())
    arguments = (*tokenizer.boundaries(document_format), cfg.data.val_percent, work.uri)
    results = gather(
        lambda part: tokenize.remote(part, sources[part.source], tokenizer_ref, *arguments), parts, limit
    )
    _log_resumed(log, "tokenized parts", [skipped for _, skipped in results])
    return [record for record, _ in results]


def _shard_jobs(cfg: Config, parts: list[Part], selection: Selection) -> list[tuple[str, str, list[Any]]]:
    """(split, shard name, pieces of the parts' streams) of every shard."""
    seq_len, packing = cfg.train.seq_len, cfg.data.packing
    batches = [
        (part.index, batch, part.source)
        for part, taken in zip(parts, selection.taken, strict=True)
        for batch in range(len(taken.tokens["train"]))
    ]
    jobs = []
    for split in SPLITS:
        starts = np.concatenate([[0], np.cumsum([n for t in selection.taken for n in t.tokens[split]])])
        bounds = shard_bounds(row_count(int(starts[-1]), seq_len, packing), cfg.data.rows_per_shard)
        jobs += [
            (
                split,
                shard_name(split, index),
                block_pieces(batches, starts, *token_range(first, end, seq_len, packing)),
            )
            for index, (first, end) in enumerate(bounds)
        ]
    return jobs


def _split_infos(
    cfg: Config, sources: list[Source], selection: Selection, shards: list[tuple[str, ShardEntry]]
) -> dict[str, SplitInfo]:
    seq_len, packing = cfg.train.seq_len, cfg.data.packing
    splits = {}
    for split in SPLITS:
        entries = [entry for of_split, entry in shards if of_split == split]
        rows = sum(entry.rows for entry in entries)
        splits[split] = SplitInfo(
            rows=rows,
            target_tokens=rows * seq_len,
            shards=entries,
            documents=sum(t.documents[split] for t in selection.taken),
            replaced=sum(t.replaced[split] for t in selection.taken),
            dropped_tokens=dropped_tokens(
                sum(int(t.tokens[split].sum()) for t in selection.taken), seq_len, packing
            ),
            mixture=_replay_mixture(cfg.data, sources, selection) if split == "train" else None,
        )
    return splits


def _check_text(
    work: Location, sources: list[Source], parts: list[Part], records: list[dict[str, Any]]
) -> None:
    """Every source holds at least one document."""
    for index, source in enumerate(sources):
        documents = sum(
            sum(record["documents"].values())
            for record, part in zip(records, parts, strict=True)
            if part.source == index
        )
        if documents == 0:
            raise _discard(work, _no_text(source))


def _no_text(source: Source) -> DataError:
    return DataError(
        f"corpus {redact(source.corpus)!r} holds no text; pass a corpus with at least one document"
    )


def _check_rows(cfg: Config, work: Location, selection: Selection) -> None:
    train, seq_len = sum(counts["tokens"] for counts in selection.totals), cfg.train.seq_len
    if row_count(train, seq_len, cfg.data.packing) == 0:
        raise _discard(
            work,
            DataError(
                f"the training split has {train} tokens, fewer than one row of seq_len+1={seq_len + 1}; "
                "use more text or a smaller train.seq_len"
            ),
        )


def _replay_mixture(data: DataConfig, sources: list[Source], selection: Selection) -> Mixture | None:
    if not mixture.replays(data):
        return None
    records = mixture.source_records(sources, selection.totals)
    threshold, pool = selection.limits[1], selection.pools[1]
    assert threshold is not None and pool is not None
    return Mixture.model_validate(mixture.replay_record(data, records, threshold, pool))


def shard_bounds(rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    """[first, end) rows of each shard of a split of `rows` rows."""
    return [(first, min(first + rows_per_shard, rows)) for first in range(0, rows, rows_per_shard)]


def block_pieces(blocks: Sequence[T], starts: np.ndarray, start: int, stop: int) -> list[tuple[T, int, int]]:
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


def write_shard_from_parts(
    pieces: list[tuple[tuple[int, int, int], int, int]],
    split: str,
    seq_len: int,
    packing: Packing,
    table: SignatureTable,
    work_uri: str,
    name: str,
    limits: list[int | None],
    sources: int,
) -> tuple[ShardEntry, bool]:
    """Ray task: one shard's rows packed from its pieces ((part, batch, source), first, end) of the
    tokenized parts' streams, written to the work directory with its record; a keyed source's training
    documents count only below its threshold in `limits`. `sources` > 1: with each row's tokens per
    source. Returns (entry, whether a verified shard was already there)."""
    work = Location.of(work_uri)
    record_file = work / PROGRESS / SHARDS / f"{name}.json"
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        entry = ShardEntry.model_validate(record["entry"])
        fits = record["fingerprint"] == table.fingerprint and (work / name).is_file()
        if fits and file_sha256(work / name) == entry.sha256:
            return entry, True
    code = SPLITS.index(split)
    streams, labels = [], []
    for part, group in itertools.groupby(pieces, key=lambda piece: piece[0][0]):
        path = work / PROGRESS / PARTS / f"{part:05d}.arrow"
        with storage_errors(path), path.fs.open_input_file(path.path) as handle:
            reader = ipc.open_file(handle)
            for (_, batch_index, source), lo, hi in group:
                batch = reader.get_batch(batch_index)
                chosen = pc.equal(batch.column("split"), code)
                if split == "train" and limits[source] is not None:
                    chosen = pc.and_(chosen, pc.less(batch.column("key"), limits[source]))
                ids = batch.filter(chosen).column("ids").flatten().to_numpy()[lo:hi]
                streams.append(ids)
                labels.append(np.full(len(ids), source, np.int8))
    rows = pack_rows(np.concatenate(streams), seq_len, packing)
    per_source = None
    if sources > 1:
        label_rows = pack_rows(np.concatenate(labels), seq_len, packing)
        per_source = np.stack([(label_rows == index).sum(axis=1) for index in range(sources)], axis=1)
    entry = write_shard(rows, table, work, name, per_source)
    record_file.write_text(json.dumps({"entry": entry.model_dump(), "fingerprint": table.fingerprint}))
    return entry, False


def gather(launch: Callable[[T], Any], items: Sequence[T], limit: int) -> list[Any]:
    """`launch(item)` (a Ray task) for every item, at most `limit` in flight; their results in item
    order. A task's one-line error is raised as itself."""
    results: list[Any] = [None] * len(items)
    pending: dict[Any, int] = {}
    for index, item in enumerate(items):
        if len(pending) >= limit:
            _collect(pending, results)
        pending[launch(item)] = index
    while pending:
        _collect(pending, results)
    return results


def _collect(pending: dict[Any, int], results: list[Any]) -> None:
    import ray

    done, _ = ray.wait(list(pending), num_returns=1)
    for ref in done:
        index = pending.pop(ref)
        try:
            results[index] = ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, MhfError):
                raise err.cause from None
            raise


def _log_resumed(log: Callable[[str], None], what: str, skipped: list[bool]) -> None:
    if any(skipped):
        log(f"resumed: {sum(skipped)} of {len(skipped)} {what} were already written and checked")


def _log_replay(mix: Mixture | None) -> None:
    assert mix is not None
    main, replay = mix.sources
    short = mix.realised_fraction < 0.9 * mix.requested_fraction
    print(
        f"{'warning: ' if short else ''}replay: {replay.documents:,} of {replay.candidate_documents:,} "
        f"documents of {replay.corpus!r} ({replay.tokens:,} tokens) join {main.tokens:,} training "
        f"tokens: {mix.realised_fraction:.2%} of them (asked for {mix.requested_fraction:.2%}"
        f"{'; the replay corpus has too little text' if short else ''})",
        file=sys.stderr if short else sys.stdout,
    )


# --- the manifest and the generated recall rows -------------------------------------------------------


def _manifest(
    cfg: Config,
    tokenizer: TextTokenizer,
    table: SignatureTable,
    splits: dict[str, SplitInfo],
    document_format: str,
    sources: list[dict[str, Any]],
) -> Manifest:
    """The manifest of the shards in `splits`, prepared with `tokenizer` and `table`."""
    return Manifest(
        format=FORMAT,
        version=VERSION,
        seq_len=cfg.train.seq_len,
        packing=cfg.data.packing,
        rows_per_group=ROWS_PER_GROUP,
        splits=splits,
        content_sha256=content_hash(splits),
        document_format=document_format,
        tokenizer=tokenizer_info(tokenizer, document_format),
        signatures=signatures_info(table),
        config=PreparedWith(
            data=recorded_data(cfg.data),
            seq_len=cfg.train.seq_len,
            model_hash=cfg.model.hash.model_dump(),
        ),
        sources=[SourceInfo.model_validate(source) for source in sources],
    )


def _check_model_documents(cfg: Config, document_format: str) -> None:
    """Shards for the exported model `data.signatures` names are framed as its training documents."""
    from mhf_dist.export import check_documents_fit  # torch: only here, never in the shard tasks

    if cfg.data.signatures:
        check_documents_fit(
            cfg.data.signatures, document_format, f"corpus {redact(cfg.data.corpus)!r} as prepared"
        )


def _describe_format(tokenizer: TextTokenizer, document_format: str) -> str:
    if document_format == "bos":
        return f"{tokenizer.tokenizer.id_to_token(tokenizer.bos_id)} first, no EOS"
    return f"{tokenizer.tokenizer.id_to_token(tokenizer.eos_id)} after each"


def signature_table(cfg: Config, tokenizer: TextTokenizer) -> SignatureTable:
    """The table `data.signatures` names (checked against the tokenizer and model.hash), else a new one."""
    if cfg.data.signatures is None:
        return build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    path = Location.of(cfg.data.signatures)
    table = load_table(path / SIGNATURES_FILE if path.is_dir() else path)
    if table.tokens != tuple(tokenizer.vocabulary()):
        raise DataError(
            f"data.signatures {str(path)!r} is the table of another vocabulary ({len(table)} tokens, the "
            f"tokenizer has {tokenizer.vocab_size}); set data.tokenizer to that model's tokenizer.json"
        )
    hash_cfg = cfg.model.hash
    if not table.follows(hash_cfg):
        lsh = (f", num_lsh {table.num_lsh}", f", num_lsh {hash_cfg.num_lsh}")
        lsh = lsh if table.num_lsh or hash_cfg.num_lsh else ("", "")
        raise DataError(
            f"data.signatures {str(path)!r} is {table.spec} seed {table.seed} ({table.scheme}{lsh[0]}) but "
            f"model.hash says {hash_cfg.spec} seed {hash_cfg.seed} ({hash_cfg.signature_scheme}{lsh[1]}); "
            "make them agree"
        )
    return table


def _prepare_recall(cfg: Config, out: Location, log: Callable[[str], None]) -> Manifest:
    """Generated associative-recall rows: no corpus to read, no Ray, written in one staged step."""
    if cfg.data.document_format == "bos":  # generated rows, not documents: their generator's layout
        raise DataError(
            "data.corpus=recall writes generated rows in the eos layout; drop data.document_format=bos "
            "(or set it to eos)"
        )
    tokenizer = TextTokenizer.recall(cfg.model.vocab_size)
    table = signature_table(cfg, tokenizer)
    _check_model_documents(cfg, "eos")
    _log_tables(log, tokenizer, table, "eos")
    with staged_directory(out.uri, replace=True, marker=MANIFEST) as staging:  # replaceable: check_output
        splits = _write_recall_shards(cfg, table, staging)
        save_tokenizer(tokenizer, staging / TOKENIZER_FILE)
        save_table(table, staging / SIGNATURES_FILE)
        manifest = _manifest(cfg, tokenizer, table, splits, "eos", [])
        write_manifest(staging, manifest)
    _log_splits(log, cfg, splits)
    log(f"wrote {out} (content sha256 {manifest.content_sha256[:12]})")
    return manifest


def _write_recall_shards(cfg: Config, table: SignatureTable, staging: Path) -> dict[str, SplitInfo]:
    """Generated associative-recall rows, one example per row, from a different seed for each split."""
    settings = cfg.data.recall
    examples = {
        "train": settings.examples,
        "validation": round(settings.examples * cfg.data.val_percent / 100),
    }
    seeds = {"train": recall.TRAIN_SEED, "validation": recall.VALIDATION_SEED}
    splits = {}
    for split in SPLITS:
        rows = recall.make_recall(
            examples[split],
            settings.num_pairs,
            settings.num_queries,
            cfg.train.seq_len,
            cfg.model.vocab_size,
            seeds[split],
        ).rows
        shards = [
            write_shard(rows[first:end], table, staging, shard_name(split, index))
            for index, (first, end) in enumerate(shard_bounds(len(rows), cfg.data.rows_per_shard))
        ]
        splits[split] = SplitInfo(
            rows=len(rows),
            target_tokens=len(rows) * cfg.train.seq_len,
            shards=shards,
            documents=len(rows),
            replaced=0,
            dropped_tokens=0,
        )
    return splits
