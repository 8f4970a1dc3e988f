"""`mhf prepare`: corpus -> tokenize -> pack -> signatures -> parquet shards + manifest, on Ray.

Two passes, both in parallel Ray tasks; the driver handles only counts, offsets and the manifest:
1. Ray Data reads the corpus and tokenizes documents (order preserved); the tokenized blocks stay in
   Ray's object store (spilled to local disk past its memory), and a small task per block counts its
   documents and tokens per split.
2. From the counts the driver knows where every shard's rows start in each split's token stream
   (`packing.token_range`), and one task per shard fetches the blocks that cover its range, packs the
   rows, looks up the signatures and writes the parquet file.
A shard's rows depend only on the token stream, never on how Ray cut it into blocks or how many CPUs
ran the tasks, so the same inputs give byte-identical shards on any cluster. On a multi-node cluster the
output must be on storage every node can write (the tasks write the shards where they run).

Everything is written to a staging directory beside the output (`staged_directory`); `manifest.json` is
written last and the directory is published only when complete, so an interrupted run never leaves a
directory that looks prepared.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

from mhf_dist.config import Config
from mhf_dist.data import mixture, recall
from mhf_dist.data.corpus import read_corpus
from mhf_dist.data.packing import Packing, dropped_tokens, pack_rows, row_count, token_range
from mhf_dist.data.shards import (
    FORMAT,
    MANIFEST,
    ROWS_PER_GROUP,
    SIGNATURES_FILE,
    SPLITS,
    TOKENIZER_FILE,
    VERSION,
    Manifest,
    Mixture,
    PreparedWith,
    ShardEntry,
    SignaturesInfo,
    SplitInfo,
    TokenizerInfo,
    content_hash,
    is_validation,
    shard_name,
    write_manifest,
    write_shard,
)
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.files import staged_directory
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.signatures import SignatureTable, build_for_config, load_table, save_table


def assign_split(batch: pa.Table, val_percent: float) -> pa.Table:
    splits = [
        "validation" if is_validation(text, val_percent) else "train" for text in batch["text"].to_pylist()
    ]
    return batch.append_column("split", pa.array(splits, type=pa.string()))


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(tokenizer_json: str) -> Tokenizer:
    """Parsed once per Ray worker process (workers are reused across tasks), not once per batch."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task; Ray runs the tasks in parallel
    return Tokenizer.from_str(tokenizer_json)


def tokenize_batch(batch: pa.Table, tokenizer_json: str, before: list[int], after: list[int]) -> pa.Table:
    """Ray Data task: token ids of each document between its boundary tokens ([BOS] before, or [EOS]
    after: `TextTokenizer.boundaries`)."""
    encodings = _worker_tokenizer(tokenizer_json).encode_batch(
        batch["text"].to_pylist(), add_special_tokens=False
    )
    ids = [[*before, *encoding.ids, *after] for encoding in encodings]
    columns = {name: batch[name] for name in ("split", "replaced", "source", "key")}  # (mixture.py)
    return pa.table({**columns, "ids": pa.array(ids, type=pa.list_(pa.int32()))})


def prepare_if_missing(cfg: Config, log: Callable[[str], None] = print) -> None:
    """Prepare `data.path` from `data.corpus` unless it already holds a complete dataset (jobs rerun)."""
    if (Path(cfg.data.path) / MANIFEST).exists():
        log(f"prepared shards found in {cfg.data.path}; not preparing again")
        return
    prepare(cfg, cfg.data.path, log=log)


def prepare(
    cfg: Config,
    out: str | Path,
    overwrite: bool = False,
    num_cpus: int | None = None,
    log: Callable[[str], None] = print,
) -> Manifest:
    """Prepare `cfg.data.corpus` into shards at `out`; returns the manifest."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise DataError(
            f"output {str(out)!r} exists and is not empty; pass --overwrite or choose another --out"
        )
    if num_cpus is not None and num_cpus < 1:
        raise DataError(f"--num-cpus {num_cpus}: Ray Data needs at least one CPU")
    check_writable(out.parent)
    data = cfg.data
    if data.corpus == recall.CORPUS:  # generated rows: no corpus to read, no Ray needed
        tokenizer = TextTokenizer.recall(cfg.model.vocab_size)
    else:
        ensure_ray(num_cpus)
        import ray.data

        ray.data.DataContext.get_current().execution_options.preserve_order = True
        documents = read_corpus(data.corpus, data.text_field).map_batches(
            assign_split, batch_format="pyarrow", fn_kwargs={"val_percent": data.val_percent}
        )
        tokenizer = _resolve_tokenizer(cfg, documents)
        documents = mixture.with_replay(documents, data)  # after the BPE is learned: from data.corpus only
    if data.corpus == recall.CORPUS:  # generated rows, not documents: their generator's EOS-filler layout
        if data.document_format == "bos":
            raise DataError(
                "data.corpus=recall writes generated rows in the eos layout; drop data.document_format=bos "
                "(or set it to eos)"
            )
        document_format = "eos"
    else:
        document_format = tokenizer.resolve_format(data.document_format)
    table = signature_table(cfg, tokenizer)
    _check_model_documents(cfg, document_format)
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

    with staged_directory(out, replace=True) as staging:  # what may be replaced: checked above
        if data.corpus == recall.CORPUS:
            splits = _write_recall_shards(cfg, table, staging)
        else:
            splits = _write_shards(cfg, tokenizer, table, documents, staging, document_format)
        tokenizer.save(staging / TOKENIZER_FILE)
        save_table(table, staging / SIGNATURES_FILE)
        manifest = _manifest(cfg, tokenizer, table, splits, document_format)
        write_manifest(staging, manifest)
    for split in SPLITS:
        info = splits[split]
        log(
            f"{split}: {info.documents:,} documents -> {info.rows:,} rows of {cfg.train.seq_len + 1} "
            f"({info.target_tokens:,} target tokens, {info.dropped_tokens:,} dropped), "
            f"{len(info.shards)} shards"
        )
    log(f"wrote {out} (content sha256 {manifest.content_sha256[:12]})")
    return manifest


def _manifest(
    cfg: Config,
    tokenizer: TextTokenizer,
    table: SignatureTable,
    splits: dict[str, SplitInfo],
    document_format: str,
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
        tokenizer=TokenizerInfo(
            file=TOKENIZER_FILE,
            sha256=tokenizer.sha256,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            bos_id=tokenizer.bos_id if document_format == "bos" else None,
        ),
        signatures=SignaturesInfo(
            file=SIGNATURES_FILE,
            spec=table.spec,
            num_hashes=table.num_hashes,
            num_buckets=table.num_buckets,
            seed=table.seed,
            scheme=table.scheme.name,
            fingerprint=table.fingerprint,
            dtype=str(table.rows.dtype),
            num_lsh=table.num_lsh,
            duplicate_signatures=table.duplicate_signatures,
        ),
        config=PreparedWith(
            data=cfg.data.model_dump(exclude={"path"}),
            seq_len=cfg.train.seq_len,
            model_hash=cfg.model.hash.model_dump(),
        ),
    )


def _check_model_documents(cfg: Config, document_format: str) -> None:
    """Shards for the exported model `data.signatures` names are framed as its training documents."""
    from mhf_dist.export import check_documents_fit  # torch: only here, never in the shard tasks

    if cfg.data.signatures:
        check_documents_fit(
            Path(cfg.data.signatures), document_format, f"corpus {cfg.data.corpus!r} as prepared"
        )


def _describe_format(tokenizer: TextTokenizer, document_format: str) -> str:
    if document_format == "bos":
        return f"{tokenizer.tokenizer.id_to_token(tokenizer.bos_id)} first, no EOS"
    return f"{tokenizer.tokenizer.id_to_token(tokenizer.eos_id)} after each"


def _resolve_tokenizer(cfg: Config, documents: Any) -> TextTokenizer:
    from ray.data.expressions import col

    training_texts = (row["text"] for row in documents.filter(expr=col("split") == "train").iter_rows())
    tokenizer = TextTokenizer.resolve(cfg.data.tokenizer, cfg.model.vocab_size, training_texts)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"set --set model.vocab_size={tokenizer.vocab_size}"
        )
    return tokenizer


def _write_shards(
    cfg: Config,
    tokenizer: TextTokenizer,
    table: SignatureTable,
    documents: Any,
    staging: Path,
    document_format: str,
) -> dict[str, SplitInfo]:
    import ray

    before, after = tokenizer.boundaries(document_format)
    tokenized = documents.map_batches(
        tokenize_batch,
        fn_kwargs={"tokenizer_json": tokenizer.tokenizer.to_str(), "before": before, "after": after},
        batch_format="pyarrow",
        # One task per block as read (one file, or a read block of a .jsonl/.parquet corpus): a row count
        # here would make Ray Data bundle the files themselves (one row each) into a single task.
        batch_size=None,
    )
    blocks = tokenized.to_arrow_refs()  # in document order (preserve_order)
    counts = ray.get([ray.remote(count_block).remote(block) for block in blocks])
    threshold, mix = mixture.select(counts, cfg.data)  # replayed documents join the train counts
    seq_len, packing = cfg.train.seq_len, cfg.data.packing
    keys = ("documents", "replaced", "tokens")
    totals = {split: {key: sum(block[split][key] for block in counts) for key in keys} for split in SPLITS}
    if sum(totals[split]["documents"] for split in SPLITS) == 0:
        raise DataError(f"corpus {cfg.data.corpus!r} holds no text; pass a corpus with at least one document")
    if row_count(totals["train"]["tokens"], seq_len, packing) == 0:
        raise DataError(
            f"the training split has {totals['train']['tokens']} tokens, fewer than one row of "
            f"seq_len+1={seq_len + 1}; use more text or a smaller train.seq_len"
        )
    write_task = ray.remote(write_shard_from_blocks)
    table_ref = ray.put(table)
    pending: dict[str, list[Any]] = {}
    for split in SPLITS:
        lengths = np.array([block[split]["tokens"] for block in counts], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        bounds = shard_bounds(row_count(totals[split]["tokens"], seq_len, packing), cfg.data.rows_per_shard)
        pending[split] = [
            write_task.remote(
                block_pieces(blocks, starts, *token_range(first, end, seq_len, packing)),
                split,
                seq_len,
                packing,
                table_ref,
                str(staging.resolve()),  # tasks run in working directories of their own
                shard_name(split, index),
                threshold,
            )
            for index, (first, end) in enumerate(bounds)
        ]
    splits = {}
    for split in SPLITS:
        shards = ray.get(pending[split])
        rows = sum(shard.rows for shard in shards)
        splits[split] = SplitInfo(
            rows=rows,
            target_tokens=rows * seq_len,
            shards=shards,
            documents=totals[split]["documents"],
            replaced=totals[split]["replaced"],
            dropped_tokens=dropped_tokens(totals[split]["tokens"], seq_len, packing),
            mixture=None if split != "train" or mix is None else Mixture.model_validate(mix),
        )
    if mix is not None:
        _log_mixture(mix)
    replaced = sum(totals[split]["replaced"] for split in SPLITS)
    if replaced:
        print(
            f"warning: {replaced} invalid UTF-8 sequences in {cfg.data.corpus!r} were replaced by U+FFFD",
            file=sys.stderr,
        )
    return splits


def count_block(block: pa.Table) -> dict[str, Any]:
    """Ray task: documents, replaced documents and tokens of each split in one tokenized block (of
    data.corpus; replayed candidates are listed under `candidates` for `mixture.select`)."""
    counts: dict[str, Any] = {"candidates": mixture.candidates(block)}
    for split in SPLITS:
        if block.num_rows == 0:  # an empty block carries no columns
            counts[split] = {"documents": 0, "replaced": 0, "tokens": 0}
            continue
        selected = block.filter(mixture.in_split(block, split, mixture.NONE_SELECTED))
        counts[split] = {
            "documents": selected.num_rows,
            "replaced": int(pc.sum(selected["replaced"]).as_py() or 0),
            "tokens": int(pc.sum(pc.list_value_length(selected["ids"])).as_py() or 0),
        }
    return counts


def shard_bounds(rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    """[first, end) rows of each shard of a split of `rows` rows."""
    return [(first, min(first + rows_per_shard, rows)) for first in range(0, rows, rows_per_shard)]


def block_pieces(blocks: list[Any], starts: np.ndarray, start: int, stop: int) -> list[tuple[Any, int, int]]:
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


def write_shard_from_blocks(
    pieces: list[tuple[Any, int, int]],
    split: str,
    seq_len: int,
    packing: Packing,
    table: SignatureTable,
    directory: str,
    name: str,
    threshold: int = mixture.NONE_SELECTED,
) -> ShardEntry:
    """Ray task: one shard's rows packed from its pieces of the tokenized blocks, written to `directory`
    (replayed documents with keys below `threshold` are in the train split)."""
    import ray

    blocks = ray.get([block for block, _, _ in pieces])
    stream = np.concatenate(
        [
            block.filter(mixture.in_split(block, split, threshold))["ids"]
            .combine_chunks()
            .flatten()
            .to_numpy()[lo:hi]
            for block, (_, lo, hi) in zip(blocks, pieces, strict=True)
        ]
    )
    return write_shard(pack_rows(stream, seq_len, packing), table, Path(directory), name)


def _log_mixture(mix: dict[str, Any]) -> None:
    main, replay = mix["sources"]
    short = mix["realised_fraction"] < 0.9 * mix["requested_fraction"]
    print(
        f"{'warning: ' if short else ''}replay: {replay['documents']:,} of {replay['candidate_documents']:,} "
        f"documents of {replay['corpus']!r} ({replay['tokens']:,} tokens) join {main['tokens']:,} training "
        f"tokens: {mix['realised_fraction']:.2%} of them (asked for {mix['requested_fraction']:.2%}"
        f"{'; the replay corpus has too little text' if short else ''})",
        file=sys.stderr if short else sys.stdout,
    )


def check_writable(directory: Path) -> None:
    """The output's parent must exist or be creatable, and take new files, before any work starts."""
    existing = next(parent for parent in (directory, *directory.parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(
            f"cannot write under {str(existing)!r} (not a writable directory); choose another --out"
        )


def signature_table(cfg: Config, tokenizer: TextTokenizer) -> SignatureTable:
    """The table `data.signatures` names (checked against the tokenizer and model.hash), else a new one."""
    if cfg.data.signatures is None:
        return build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    path = Path(cfg.data.signatures)
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
