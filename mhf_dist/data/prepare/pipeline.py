"""`prepare`: the stages in order, from the corpus to a published, manifest-last dataset."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mhf_dist.config import Config
from mhf_dist.data import mixture, recall, shards
from mhf_dist.data.corpus import CorpusFile, Skipped, corpus_files, read_documents
from mhf_dist.data.mixture import Source
from mhf_dist.data.packing import row_count
from mhf_dist.data.prepare import manifest, output, plan, vocabulary
from mhf_dist.data.prepare.execute import run_units
from mhf_dist.data.prepare.plan import PartCounts
from mhf_dist.data.prepare.recall import prepare_recall
from mhf_dist.data.prepare.records import PROGRESS_VERSION, InputsKey, StagedSnapshot
from mhf_dist.data.prepare.shard import WriteShards
from mhf_dist.data.prepare.tokenize import TokenizeParts
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.signatures import SignatureTable, save_table, scheme_for_config
from mhf_dist.storage import Location, redact

if TYPE_CHECKING:
    import ray.data


def prepare_if_missing(cfg: Config, log: Callable[[str], None] = print, verbose: bool = False) -> None:
    """Prepare `data.path` from `data.corpus` unless it already holds a complete dataset (jobs rerun)."""
    if (Location.of(cfg.data.path) / shards.MANIFEST).is_file():
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
    datasets: Mapping[str, ray.data.Dataset] | None = None,
) -> shards.Manifest:
    """Prepare the config's sources into shards at `out`, resuming a partial run of the same inputs;
    returns the manifest. `datasets`: ray.data.Dataset sources by name. `flag`: what the user gave `out`
    as (`--out`, `--workdir`), for the advice of a refused output."""
    out = Location.of(out)
    if num_cpus is not None and num_cpus < 1:
        raise DataError(f"--num-cpus {num_cpus}: Ray needs at least one CPU")
    output.check_output(out, overwrite, flag)
    if cfg.data.signatures is None:  # a vocabulary no table can hold: refused before a BPE is learned
        scheme_for_config(cfg.model.hash).room_for(cfg.model.vocab_size)
    if cfg.data.corpus == recall.CORPUS:
        if datasets:
            raise DataError("data.corpus=recall generates its rows and takes no datasets; drop one of them")
        return prepare_recall(cfg, out, log)
    cfg = cfg.model_copy(update={"data": mixture.with_datasets(cfg.data, datasets or {})})  # as recorded
    sources = mixture.sources(cfg.data, datasets)
    files = [[] if source.dataset else corpus_files(source.corpus, log) for source in sources]
    for source, source_files in zip(sources, files, strict=True):
        if source_files:  # a missing field is an error before any work
            next(read_documents(source_files[0], source.text_field), None)
    tokenizer = None if cfg.data.tokenizer == "bpe" else vocabulary.named_tokenizer(cfg)
    if cfg.data.signatures and tokenizer is None:
        raise DataError(
            "data.signatures fixes the vocabulary to its table's tokens, which a BPE learned here "
            "(data.tokenizer=bpe) would not have; set data.tokenizer to the tokenizer.json it was made from"
        )
    given = vocabulary.given_table(cfg) if cfg.data.signatures else None
    checked = _vocabulary(cfg, tokenizer, given) if tokenizer else None  # before any staging, too
    work = output.work_directory(out)
    snapshots: list[StagedSnapshot | None] = [None] * len(sources)
    if any(source.dataset for source in sources):
        from mhf_dist.data.prepare import staging  # imports Ray Data: 1 s

        snapshots, files = staging.stage_sources(sources, files, work, log, num_cpus, verbose)
    output.open_work(work, _inputs_key(cfg, files, snapshots, tokenizer), log)
    try:  # a learned BPE these settings refuse is no start to resume
        tokenizer = tokenizer or vocabulary.learned_tokenizer(cfg, work, sources, files)
        shards.save_tokenizer(tokenizer, work / shards.TOKENIZER_FILE)  # first: a rerun reuses it
        document_format, table = checked or _vocabulary(cfg, tokenizer, given)
    except DataError as error:
        raise output.discard(work, error) from None
    manifest.log_tables(log, tokenizer, table, document_format)

    ensure_ray(num_cpus, verbose)
    splits, records = _write_shards(
        cfg, sources, files, snapshots, tokenizer, table, work, document_format, num_cpus, log, verbose
    )
    save_table(table, (work / shards.SIGNATURES_FILE).uri)
    built = manifest.build_manifest(cfg, tokenizer, table, splits, document_format, records)
    published = output.publish(work, out, built)
    manifest.log_published(log, out, published)
    return published


def _inputs_key(
    cfg: Config,
    files: list[list[CorpusFile]],
    snapshots: list[StagedSnapshot | None],
    tokenizer: TextTokenizer | None,
) -> InputsKey:
    """What a partial run must match to be resumed."""
    return InputsKey(
        version=PROGRESS_VERSION,
        part_bytes=plan.PART_BYTES,
        files=[[(redact(file.uri), file.size) for file in source_files] for source_files in files],
        staged=[snapshot.snapshot if snapshot else None for snapshot in snapshots],
        # missing_text decides no shard (records without text are never tokenized): a rerun with `skip`
        # after a refusal goes on from the tokenized parts
        data={key: value for key, value in manifest.recorded_data(cfg.data).items() if key != "missing_text"},
        seq_len=cfg.train.seq_len,
        model_hash=cfg.model.hash.model_dump(),
        vocab_size=cfg.model.vocab_size,
        tokenizer_sha256=tokenizer.sha256 if tokenizer else None,
    )


def _vocabulary(
    cfg: Config, tokenizer: TextTokenizer, given: SignatureTable | None
) -> tuple[str, SignatureTable]:
    """The document format and the signature table, checked against `data.signatures`' model."""
    document_format = tokenizer.resolve_format(cfg.data.document_format)
    table = vocabulary.signature_table(cfg, tokenizer, given)
    vocabulary.check_model_documents(cfg, document_format)
    return document_format, table


def _write_shards(
    cfg: Config,
    sources: list[Source],
    files: list[list[CorpusFile]],
    snapshots: list[StagedSnapshot | None],
    tokenizer: TextTokenizer,
    table: SignatureTable,
    work: Location,
    document_format: str,
    num_cpus: int | None,
    log: Callable[[str], None],
    verbose: bool,
) -> tuple[dict[str, shards.SplitInfo], list[dict[str, Any]]]:
    """Both phases on Ray Data (tokenize the parts; pack, sign and write the shards); their records."""
    import ray

    cpus = num_cpus or max(1, int(ray.cluster_resources().get("CPU", 1)))
    parts = plan.plan_parts(files, [source.text_field for source in sources])
    tokenize = TokenizeParts(
        tokenizer.tokenizer.to_str(),
        *tokenizer.boundaries(document_format),
        cfg.data.val_percent,
        [dataclasses.replace(source, dataset=None) for source in sources],  # a Dataset stays here
        work,
    )
    sizes = [part.bytes for part in parts]
    counts = run_units(
        "tokenize parts", parts, tokenize, cpus, log, verbose, sizes, plan.PART_BYTES, PartCounts.of
    )
    selection = plan.select(sources, parts, counts)
    _check_records(cfg, sources, selection.skipped, log)
    with_text = {p.source for p, c in zip(parts, counts, strict=True) if any(c.documents.values())}
    for index, source in enumerate(sources):
        if index not in with_text:
            raise output.discard(work, vocabulary.no_text(source))
    train, seq_len = sum(totals["tokens"] for totals in selection.totals), cfg.train.seq_len
    if row_count(train, seq_len, cfg.data.packing) == 0:
        raise output.discard(
            work,
            DataError(
                f"the training split has {train} tokens, fewer than one row of seq_len+1={seq_len + 1}; "
                "use more text or a smaller train.seq_len"
            ),
        )
    jobs = plan.shard_jobs(cfg, parts, selection)
    write = WriteShards(table, cfg.train.seq_len, cfg.data.packing, selection.limits, len(sources), work)
    sizes = [job.tokens for job in jobs]
    written = run_units(
        "pack, sign and write shards", jobs, write, cpus, log, verbose, sizes, plan.SHARD_TASK_TOKENS
    )
    entries = [(job.split, entry) for job, entry in zip(jobs, written, strict=True)]
    staged = [snapshot.documents if snapshot else None for snapshot in snapshots]
    records = mixture.source_records(sources, selection.totals, staged, selection.skipped)
    splits = manifest.split_infos(cfg, records, selection, entries)
    for record, source, source_files in zip(records, sources, files, strict=True):
        if source.dataset is None:  # the files read, each once (a staged Dataset's are its own)
            record["files"] = [{"path": redact(file.uri), "bytes": file.size} for file in source_files]
    manifest.log_sources(log, sources, records, selection, splits)
    return splits, records


def _check_records(
    cfg: Config, sources: list[Source], skipped: list[Skipped], log: Callable[[str], None]
) -> None:
    """Records without text stop the run (`data.missing_text: error`; the tokenized parts stay, so a rerun
    with `skip` goes on from them) or are left out with a warning; empty ones are left out, and said."""
    for source, tally in zip(sources, skipped, strict=True):
        corpus = redact(source.corpus)
        if tally.missing and cfg.data.missing_text == "error":
            raise DataError(
                f"{tally.missing:,} records of corpus {corpus!r} have no text in {source.text_field!r} (the "
                f"first: {tally.first_missing}); fix them, or pass --set data.missing_text=skip to leave "
                "them out"
            )
        if tally.missing:
            log(
                f"warning: {tally.missing:,} records of corpus {corpus!r} without text in "
                f"{source.text_field!r} were left out (data.missing_text=skip; the first: "
                f"{tally.first_missing})"
            )
        if tally.empty:
            log(f"{tally.empty:,} records of corpus {corpus!r} with empty text were left out")
