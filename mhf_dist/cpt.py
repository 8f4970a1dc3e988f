"""`mhf cpt`: continued pretraining with a larger vocabulary.

The tokenizer and the signature table grow by appending (every old id keeps its string and its
signature); the model grows only where its parameters depend on V: not at all for MultiHashFormer (new
tokens get signatures in the fixed bucket space); a Qwen3 baseline's embedding (and untied head) gains
dV rows, each the mean of the rows of the new token's old pieces, as the authors' (HUIYINXUE/MHF)
`instantiate_model_by_mean` does. Training then continues through `mhf train` from the expanded weights,
by default with the authors' frozen split (`train.trainable`) and optionally with replay (`data.replay`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from mhf_dist.config import INIT_NEW_ROWS, Config, ModelConfig, file_settings, flatten, setting_file
from mhf_dist.data import recall
from mhf_dist.data.shards import MANIFEST, file_sha256, read_manifest
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import ConfigError, DataError, TrainingError
from mhf_dist.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportedModel,
    ExportRecord,
    export_model,
    load_exported,
    read_export_config,
)
from mhf_dist.files import write_json_atomic
from mhf_dist.models import build_model, param_count
from mhf_dist.models.base import CausalLM
from mhf_dist.models.registry import resolved_config
from mhf_dist.readers import read_json, read_text
from mhf_dist.signatures import SignatureTable, check_same_table
from mhf_dist.storage import Location, local_copy, redact
from mhf_dist.tracking import check_writable_store, tracking_uri
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint
from mhf_dist.train.trainable import AUTHORS_VE, authors_ve_trainable, trainable_split

INIT_DIR = "init"  # the expanded model training starts from, under <storage>/<name>/


@dataclass(frozen=True)
class Expansion:
    model: CausalLM
    config: ModelConfig
    table: SignatureTable
    params_added: int
    old_vocab_size: int
    init_new_rows: str = "none"  # subword | mean | none (no vocabulary-sized table: mhf)
    fallback_rows: int = 0  # subword: new tokens the old tokenizer gives no piece, set to the mean


def old_pieces(old: TextTokenizer, new: TextTokenizer, token_id: int) -> list[int]:
    """The old tokenizer's ids for new token `token_id`: what its sub-word mean averages. The authors
    re-tokenise the new token's string; here a learned BPE token (in its byte-level `Ġ` or Metaspace `▁`
    alphabet) is split by the old BPE model itself, so its prefix is one old piece and not text to
    pre-tokenise again; an added token's text is encoded by the old tokenizer."""
    added = new.tokenizer.get_added_tokens_decoder()
    if token_id in added:
        return old.encode_batch([added[token_id].content])[0]
    token = new.tokenizer.id_to_token(token_id)
    try:
        return [piece.id for piece in old.tokenizer.model.tokenize(token)]
    except Exception:  # tokenizers raises a bare Exception for a character without an id (no unk token)
        return []


def _new_rows(old: torch.Tensor, added: int, pieces: list[list[int]] | None) -> torch.Tensor:
    """[added, d] rows after the [V, d] table `old`: each the mean of its pieces' rows, or of all rows.
    A token with no piece gets the mean of all rows (the authors' numpy mean over no rows is NaN)."""
    mean = old.mean(dim=0, keepdim=True)
    if pieces is None:
        return mean.expand(added, -1)
    return torch.cat([old[ids].mean(dim=0, keepdim=True) if ids else mean for ids in pieces])


def expand_model(
    parent: ExportedModel,
    new_tokens: Sequence[str],
    init_new_rows: str = "subword",
    tokenizer: TextTokenizer | None = None,
) -> Expansion:
    """`parent` with `new_tokens` appended to its vocabulary; old rows and weights are kept as they are.
    New rows of a vocabulary-sized table start as `init_new_rows` says (`subword` needs `tokenizer`)."""
    if init_new_rows not in INIT_NEW_ROWS:
        raise TrainingError(f"--init-new-rows {init_new_rows!r}: use one of {', '.join(INIT_NEW_ROWS)}")
    table = parent.table.expand(new_tokens)
    config = resolved_config(parent.config)  # parameter matching pinned: only vocabulary tables grow
    triple = config.triple.model_copy(update={"match_params": False})
    config = config.model_copy(update={"triple": triple, "vocab_size": len(table)})
    model = build_model(config, table)
    old_state, new_state = parent.model.state_dict(), model.state_dict()
    grows = [name for name, tensor in new_state.items() if tensor.shape != old_state[name].shape]
    pieces = None
    if grows and init_new_rows == "subword":
        if tokenizer is None:
            raise TrainingError("--init-new-rows subword needs the new tokenizer; pass tokenizer=")
        old_size = parent.config.vocab_size
        pieces = [old_pieces(parent.tokenizer, tokenizer, i) for i in range(old_size, len(table))]
    state = {name: old_state[name] for name in new_state}
    for name in grows:  # a vocabulary-sized table: [V, d] -> [V + dV, d]
        old = old_state[name]
        state[name] = torch.cat([old, _new_rows(old, new_state[name].shape[0] - old.shape[0], pieces)])
    model.load_state_dict(state, strict=True)
    params_added = param_count(config) - param_count(parent.config)
    if parent.config.family == "mhf" and params_added != 0:
        raise TrainingError(f"expanding an mhf model added {params_added} parameters; it must add none")
    fallback_rows = sum(not ids for ids in pieces) if pieces is not None else 0
    init = init_new_rows if grows else "none"
    return Expansion(model, config, table, params_added, parent.config.vocab_size, init, fallback_rows)


def resolve_parent(source: str) -> Location:
    """An exported model directory, a checkpoint directory (its `model/`) or a run (its newest)."""
    where = Location.of(source)
    if (where / MODEL_DIR).is_dir():
        return where / MODEL_DIR
    newest = newest_checkpoint(where) if where.is_dir() else None
    return newest / MODEL_DIR if newest is not None else where


def expanded_tokenizer(
    parent: TextTokenizer,
    tokenizer: str | None = None,
    add_tokens: str | None = None,
    train_new_tokens: int = 0,
    texts: Callable[[], Sequence[str]] | None = None,
) -> TextTokenizer:
    """Exactly one way: a new tokenizer.json extending the parent's, a file of tokens, or N learned ones."""
    check_expansion(tokenizer, add_tokens, train_new_tokens, texts is not None)
    if tokenizer is not None:
        new = TextTokenizer.load(tokenizer)
        new.check_extends(parent)
        return new
    if add_tokens is not None:
        text = read_text(add_tokens, TrainingError, "give --add-tokens a UTF-8 file, one new token per line")
        try:
            if not (tokens := [line for line in text.splitlines() if line.strip()]):
                raise DataError("no token in it; give one new token per line")
            return parent.with_added_tokens(tokens)
        except DataError as err:
            raise DataError(f"{redact(add_tokens)}: {err}") from None
    return parent.with_trained_tokens(texts(), train_new_tokens)


def check_expansion(
    tokenizer: str | None, add_tokens: str | None, train_new_tokens: int, corpus: bool
) -> None:
    """The flags of one way to grow the vocabulary (before the parent is loaded)."""
    if sum([tokenizer is not None, add_tokens is not None, train_new_tokens > 0]) != 1:
        raise TrainingError(
            "give exactly one of --tokenizer, --add-tokens or --train-new-tokens N --corpus C"
        )
    if train_new_tokens and not corpus:
        raise TrainingError("--train-new-tokens needs --corpus: the text the new tokens are learned from")
    if corpus and not train_new_tokens:
        raise TrainingError(
            "--corpus is the text --train-new-tokens N learns from; "
            "leave it out with --tokenizer or --add-tokens"
        )


@dataclass(frozen=True)
class CptResult:
    expansion: Expansion
    init_dir: Location
    train_result: Any  # TrainResult


def cpt_trainable(cfg: Config, model: ModelConfig) -> tuple[list[str] | None, str]:
    """(train.trainable, its name): unset (null) means the authors' recipe for the parent's family."""
    if cfg.train.trainable is not None:
        return cfg.train.trainable, "custom" if cfg.train.trainable else "all"
    recipe = authors_ve_trainable(model)
    return recipe, AUTHORS_VE if recipe is not None else "all"


def check_model_kept(model: ModelConfig, parent: ExportRecord, source: str) -> None:
    """A config file (not a preset) that sets a model key to other than the parent's value is refused:
    mhf cpt trains the parent's model as it is. The file that trained the parent, or its ancestor, passes:
    both are compared as `expand_model` leaves a model (resolved at the first vocabulary, matching pinned),
    and a vocabulary size of the lineage is the parent's."""
    try:
        own = ModelConfig.model_validate(parent.model)
    except ValidationError:  # a damaged config.json: loading the parent names it, in one line
        return
    vocabs = [entry.get("vocab_size") for entry in parent.lineage] + [own.vocab_size]

    def expanded(config: ModelConfig) -> dict[str, Any]:
        resolved = resolved_config(config.model_copy(update={"vocab_size": vocabs[0]}))
        pinned = resolved.triple.model_copy(update={"match_params": False})
        return dict(flatten(resolved.model_copy(update={"triple": pinned}).model_dump(mode="json")))

    theirs = expanded(own) | {"vocab_size": own.vocab_size}
    ours, settings = expanded(model) | {"vocab_size": model.vocab_size}, file_settings(source)
    for key, value in ours.items():
        kept = value in vocabs if key == "vocab_size" else value == theirs[key]
        if not kept and (found := setting_file(settings, f"model.{key}")):
            raise ConfigError(
                f"{found[0]}: {found[1]} gives model.{key} {value!r}, not the parent's {theirs[key]!r}: mhf "
                "cpt trains the parent's model as it is; drop the key or give the parent's value"
            )


def run_cpt(
    cfg: Config,
    parent_source: str,
    new_tokenizer: Callable[[TextTokenizer], TextTokenizer],
    options: Any,  # TrainOptions
    log: Callable[[str], None] = print,
    init_new_rows: str = "subword",
    config_source: str | None = None,
) -> CptResult:
    """Expand the parent's vocabulary, prepare `cfg.data` with the new tokenizer, and train the result.
    `cfg` gives the training and data settings; the model's config is the parent's (the config file
    `config_source` may set model keys only to the parent's values)."""
    from mhf_dist.data.prepare import prepare, recorded_data
    from mhf_dist.data.prepare.manifest import shared_signatures
    from mhf_dist.train.ray_trainer import check_run, train

    if recall.CORPUS in (cfg.data.corpus, cfg.data.replay.corpus):
        raise TrainingError(
            "recall rows have token ids of their own (k1.., v0..), not the parent's vocabulary grown; "
            "give --data and --replay text corpora"
        )
    check_run(cfg, options)  # the batch over the workers, ...: before minutes of expanding and preparing
    check_writable_store(tracking_uri(cfg.topology.storage))  # before the prepare that starts Ray
    parent_dir = resolve_parent(parent_source)
    if config_source is not None:  # before the weights are copied and loaded
        check_model_kept(cfg.model, read_export_config(parent_dir), config_source)
    parent = load_exported(parent_dir)
    tokenizer = new_tokenizer(parent.tokenizer)
    new_tokens = tokenizer.vocabulary()[parent.tokenizer.vocab_size :]
    if not new_tokens:
        raise TrainingError("the new tokenizer adds no tokens; nothing to expand")
    expansion = expand_model(parent, new_tokens, init_new_rows, tokenizer)
    log(
        f"vocabulary {expansion.old_vocab_size:,} -> {expansion.config.vocab_size:,} "
        f"(+{len(new_tokens):,} tokens); parameters {param_count(parent.config):,} -> "
        f"{param_count(expansion.config):,} (+{expansion.params_added:,})"
    )
    shared = expansion.table.duplicate_signatures - parent.table.duplicate_signatures  # the new tokens'
    if expansion.config.family == "mhf" and shared:
        log(shared_signatures(shared))
    if expansion.init_new_rows != "none":
        rows = expansion.fallback_rows
        fallback = f", {rows} without old pieces: mean of all" if rows else ""
        log(f"new embedding rows: {expansion.init_new_rows} initialisation{fallback}")
    trainable, recipe = cpt_trainable(cfg, expansion.config)
    split = trainable_split(expansion.model, trainable)  # a bad pattern fails here, before prepare
    log(f"train.trainable ({recipe}): {trainable if trainable else 'every parameter'}; {split.summary()}")
    workdir = Location.of(cfg.topology.storage) / options.name  # a local directory or a bucket
    init_dir, init_record = workdir / INIT_DIR, workdir / "init.json"
    tokenizer_file = workdir / "tokenizer.json"
    # What init/ is made from; its record is written after it, so a run stopped half-way makes it again,
    # and a rerun with another parent, tokenizer or --init-new-rows is refused rather than given old rows.
    made_from = {
        "parent_fingerprint": parent.table.fingerprint,
        # the weights, not only the vocabulary: two checkpoints of one run share a signature table
        "parent_weights_sha256": file_sha256(local_copy(parent.path, marker=CONFIG_FILE) / WEIGHTS_FILE),
        "tokenizer_sha256": tokenizer.sha256,
        "init_new_rows": expansion.init_new_rows,
    }
    made = read_json(init_record, TrainingError, "remove it") if init_record.is_file() else {}
    made = made if isinstance(made, dict) else {}
    if made.keys() == made_from.keys() and made != made_from:
        changed = "; ".join(
            f"{key} {str(made[key])[:12]} -> {str(made_from[key])[:12]}"
            for key in made_from
            if made[key] != made_from[key]
        )
        raise TrainingError(
            f"{str(init_dir)!r} was made from another parent, tokenizer or row initialisation ({changed}); "
            "pick another --name, or remove the run directory to start it again"
        )
    if made != made_from:  # none yet, a half-made one, or one recorded by an older mhf-dist: made again
        init_record.remove()
        init_dir.remove()  # a half-made one, or none
        with Location.of(tokenizer_file).staged_file() as staging:
            tokenizer.save(staging)
        grew_from = {"fingerprint": parent.table.fingerprint, "vocab_size": parent.config.vocab_size}
        lineage = [*parent.lineage, grew_from]
        export_model(
            expansion.model,
            expansion.config,
            expansion.table,
            local_copy(tokenizer_file),
            init_dir.uri,
            lineage,
            document_format=parent.document_format,  # the new data is framed as the parent's was
        )
        write_json_atomic(init_record, made_from)

    # The shards carry the expanded table itself: an imported parent's rows need not follow our rule.
    data = cfg.data.model_copy(
        update={
            "tokenizer": str(local_copy(tokenizer_file)),
            "path": (workdir / "data").uri,
            "signatures": init_dir.uri,
            "document_format": parent.document_format,
        }
    )
    train_cfg = cfg.train.model_copy(update={"trainable": trainable})
    run_cfg = cfg.model_copy(update={"model": expansion.config, "data": data, "train": train_cfg})
    if not (workdir / "data" / MANIFEST).is_file():
        prepare(run_cfg, data.path, log=log, verbose=options.verbose, flag="--name")
    manifest = read_manifest(data.path)
    # Shards an earlier run of this name prepared from other data are refused (the tokenizer and table:
    # by the fingerprint below; a key older manifests lack had its default then).
    wanted = recorded_data(data)
    del wanted["tokenizer"], wanted["signatures"]
    earlier = manifest.config.data
    other = next((key for key in wanted if key in earlier and earlier[key] != wanted[key]), None)
    if other is not None:
        raise TrainingError(
            f"shards in {data.path!r} were prepared with data.{other} {earlier[other]!r}, not "
            f"{wanted[other]!r}; remove the directory or pick another --name"
        )
    mixture = manifest.splits["train"].mixture
    if mixture is not None:
        log(
            f"replay: {mixture.realised_fraction:.1%} of the training tokens from "
            f"{mixture.sources[1].corpus} (asked for {mixture.requested_fraction:.1%})"
        )
    fix = "remove them and run mhf cpt again"
    expanded = expansion.table.fingerprint
    check_same_table(
        "the expanded model", expanded, data.path, manifest.signatures.fingerprint, fix, TrainingError
    )
    tags = {
        "cpt_parent_model": str(parent_dir),  # redacted
        "cpt_parent_fingerprint": parent.table.fingerprint,
        "cpt_old_vocab_size": expansion.old_vocab_size,
        "cpt_new_vocab_size": expansion.config.vocab_size,
        "cpt_params_added": expansion.params_added,
        "cpt_init_new_rows": expansion.init_new_rows,
        "cpt_init_fallback_rows": expansion.fallback_rows,
        "cpt_trainable": recipe,
        "cpt_replay_fraction": mixture.realised_fraction if mixture else 0.0,
    }
    result = train(run_cfg, dataclasses.replace(options, init_from=init_dir.uri), tags=tags)
    return CptResult(expansion, init_dir, result)
