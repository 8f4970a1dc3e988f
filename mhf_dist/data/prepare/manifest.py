"""The manifest of a prepared dataset and the console lines that summarise it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mhf_dist.config import Config, DataConfig
from mhf_dist.data import mixture
from mhf_dist.data.mixture import Source
from mhf_dist.data.packing import dropped_tokens
from mhf_dist.data.prepare.plan import Selection
from mhf_dist.data.shards import (
    FORMAT,
    ROWS_PER_GROUP,
    SPLITS,
    VERSION,
    Manifest,
    Mixture,
    MixtureSource,
    PreparedWith,
    ShardEntry,
    SourceInfo,
    SplitInfo,
    content_hash,
    no_validation_fix,
    signatures_info,
    tokenizer_info,
)
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.signatures import SignatureTable
from mhf_dist.storage import Location, redact, redact_values


def recorded_data(data: DataConfig) -> dict[str, Any]:
    """The data settings as the manifest and the key record them: no path, corpora and args redacted."""
    record = data.model_dump(exclude={"path"})
    record["corpus"] = redact(record["corpus"])
    for source in record["sources"]:
        source["corpus"] = source["corpus"] and redact(source["corpus"])
        source["args"] = redact_values(source["args"])
    if record["replay"]["corpus"] is not None:
        record["replay"]["corpus"] = redact(record["replay"]["corpus"])
    return record


def build_manifest(
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
            data=recorded_data(cfg.data), seq_len=cfg.train.seq_len, model_hash=cfg.model.hash.model_dump()
        ),
        sources=[SourceInfo.model_validate(source) for source in sources],
    )


def split_infos(
    cfg: Config, records: list[dict[str, Any]], selection: Selection, shards: list[tuple[str, ShardEntry]]
) -> dict[str, SplitInfo]:
    """Each split's record: its shards (`shards`: (split, entry) in order) and the counts behind them
    (`records`: the sources', `mixture.source_records`)."""
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
            mixture=_replay_mixture(cfg.data, records, selection) if split == "train" else None,
        )
    return splits


def _replay_mixture(data: DataConfig, records: list[dict[str, Any]], selection: Selection) -> Mixture | None:
    if not mixture.replays(data):
        return None
    main, replay = records
    threshold, pool = selection.limits[1], selection.pools[1]
    assert threshold is not None and pool is not None
    total = main["tokens"] + replay["tokens"]
    return Mixture(
        requested_fraction=data.replay.fraction,
        realised_fraction=replay["tokens"] / total if total else 0.0,
        threshold=threshold,
        sources=[
            MixtureSource(corpus=main["corpus"], documents=main["documents"], tokens=main["tokens"]),
            MixtureSource(
                corpus=replay["corpus"],
                seed=data.replay.seed,
                documents=replay["documents"],
                tokens=replay["tokens"],
                candidate_documents=len(pool.keys),
                candidate_tokens=int(pool.tokens.sum()),
            ),
        ],
        tokens="train-split document tokens with their boundary tokens, before packing",
    )


def log_tables(
    log: Callable[[str], None], tokenizer: TextTokenizer, table: SignatureTable, document_format: str
) -> None:
    token = tokenizer.tokenizer.id_to_token
    if document_format == "bos":
        framing = f"{token(tokenizer.bos_id)} first, no EOS"
    else:
        framing = f"{token(tokenizer.eos_id)} after each"
    log(
        f"tokenizer: {tokenizer.vocab_size} tokens (sha256 {tokenizer.sha256[:12]}), {document_format} "
        f"documents ({framing}); signatures "
        f"{table.spec} seed {table.seed} ({table.scheme} scheme), fingerprint {table.fingerprint[:12]}"
    )
    if table.duplicate_signatures:  # the authors' rule allows them (H=1, shared prefixes, all-LSH)
        log(shared_signatures(table.duplicate_signatures))


def shared_signatures(count: int) -> str:
    """The warning for `count` tokens whose signature an earlier token has (prepare's, cpt's new tokens')."""
    return (
        f"warning: {count} token(s) share an earlier token's signature; exact scoring gives them equal "
        "scores (the authors' redraw rule, as in their tables; model.hash.scheme=murmur32 is collision-free)"
    )


def log_published(log: Callable[[str], None], out: Location, published: Manifest) -> None:
    """Each split's documents, rows and shards, and where the dataset now is."""
    for split in SPLITS:
        info = published.splits[split]
        log(
            f"{split}: {info.documents:,} documents -> {info.rows:,} rows of {published.seq_len + 1} "
            f"({info.target_tokens:,} target tokens, {info.dropped_tokens:,} dropped), "
            f"{len(info.shards)} shards"
        )
    held_out = published.config.data.get("val_percent", 0)
    if held_out and not published.splits["validation"].rows:
        log(
            f"warning: data.val_percent={held_out:g} held out too little text for one row of "
            f"{published.seq_len + 1} tokens, so runs on it report no val_ metrics; "
            + no_validation_fix(published)
        )
    log(f"wrote {out} (content sha256 {published.content_sha256[:12]})")


def log_sources(
    log: Callable[[str], None],
    sources: list[Source],
    records: list[dict[str, Any]],
    selection: Selection,
    splits: dict[str, SplitInfo],
) -> None:
    """How the sources mixed, and the invalid UTF-8 that was replaced."""
    mix = splits["train"].mixture  # a replay's
    if mix is not None:
        main, replay = mix.sources
        short = mix.realised_fraction < 0.9 * mix.requested_fraction
        log(
            f"{'warning: ' if short else ''}replay: {replay.documents:,} of {replay.candidate_documents:,} "
            f"documents of {replay.corpus!r} ({replay.tokens:,} tokens) join {main.tokens:,} training "
            f"tokens: {mix.realised_fraction:.2%} of them (asked for {mix.requested_fraction:.2%}"
            f"{'; the replay corpus has too little text' if short else ''})"
        )
    elif len(sources) > 1:
        log(mixture.describe(sources, records, selection.limits))
    replaced = sum(splits[split].replaced for split in SPLITS)
    if replaced:
        corpora = ", ".join(repr(redact(source.corpus)) for source in sources)
        log(f"warning: {replaced} invalid UTF-8 sequences in {corpora} were replaced by U+FFFD")
