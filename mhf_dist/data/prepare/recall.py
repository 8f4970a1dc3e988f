"""`data.corpus: recall`: generated associative-recall rows, written in the work area and published as
every prepare is (`output.publish`; no corpus to read, no Ray)."""

from __future__ import annotations

from collections.abc import Callable

from mhf_dist.config import Config
from mhf_dist.data import recall
from mhf_dist.data.prepare.manifest import build_manifest, log_published, log_tables
from mhf_dist.data.prepare.output import publish, work_directory
from mhf_dist.data.prepare.plan import shard_bounds
from mhf_dist.data.prepare.vocabulary import check_model_documents, signature_table
from mhf_dist.data.shards import (
    SIGNATURES_FILE,
    SPLITS,
    TOKENIZER_FILE,
    Manifest,
    SplitInfo,
    save_tokenizer,
    shard_name,
    write_shard,
)
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.signatures import SignatureTable, save_table
from mhf_dist.storage import Location


def prepare_recall(cfg: Config, out: Location, log: Callable[[str], None]) -> Manifest:
    if cfg.data.document_format == "bos":  # generated rows, not documents: their generator's layout
        raise DataError(
            "data.corpus=recall writes generated rows in the eos layout; drop data.document_format=bos "
            "(or set it to eos)"
        )
    if "tokenizer" in cfg.data.model_fields_set:  # given by a file, a preset or the command line
        log(f"data.tokenizer {cfg.data.tokenizer} is not used: recall rows have ids of their own (k1..)")
    tokenizer = TextTokenizer.recall(cfg.model.vocab_size)
    table = signature_table(cfg, tokenizer)
    check_model_documents(cfg, "eos")
    log_tables(log, tokenizer, table, "eos")
    work = work_directory(out)
    work.remove()  # generated rows: nothing of an earlier run is reused
    try:
        splits = _write_recall_shards(cfg, table, work)
        save_tokenizer(tokenizer, work / TOKENIZER_FILE)
        save_table(table, (work / SIGNATURES_FILE).uri)
    except BaseException:
        work.remove()  # no manifest names it yet
        raise
    manifest = publish(work, out, build_manifest(cfg, tokenizer, table, splits, "eos", []))
    log_published(log, out, manifest)
    return manifest


def _write_recall_shards(cfg: Config, table: SignatureTable, work: Location) -> dict[str, SplitInfo]:
    """Generated associative-recall rows, one example per row, from a different seed for each split."""
    settings, seq_len, vocab_size = cfg.data.recall, cfg.train.seq_len, cfg.model.vocab_size
    count = settings.examples
    examples = {"train": count, "validation": round(count * cfg.data.val_percent / 100)}
    seeds = {"train": recall.TRAIN_SEED, "validation": recall.VALIDATION_SEED}
    splits = {}
    for split in SPLITS:
        rows = recall.make_recall(
            examples[split], settings.num_pairs, settings.num_queries, seq_len, vocab_size, seeds[split]
        ).rows
        shards = [
            write_shard(rows[first:end], table, work, shard_name(split, index))
            for index, (first, end) in enumerate(shard_bounds(len(rows), cfg.data.rows_per_shard))
        ]
        n = len(rows)
        splits[split] = SplitInfo(
            rows=n, target_tokens=n * seq_len, shards=shards, documents=n, replaced=0, dropped_tokens=0
        )
    return splits
