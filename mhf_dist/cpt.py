"""`mhf cpt`: continued pretraining with a larger vocabulary.

The tokenizer and the signature table grow by appending (every old id keeps its string and its
signature); the model grows only where its parameters depend on V. MultiHashFormer has no such
parameters: new tokens get signatures in the fixed bucket space, so its parameter count is unchanged.
A Qwen3 baseline's embedding (and untied head) gains dV rows, initialised to the mean of the old rows.
Training then continues through `mhf train` (Ray Train + DeepSpeed) from the expanded weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhf_dist.config import Config, ModelConfig
from mhf_dist.data.shards import read_manifest
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import TrainingError
from mhf_dist.export import ExportedModel, export_model, load_exported
from mhf_dist.models import build_model, param_count
from mhf_dist.models.base import CausalLM
from mhf_dist.models.registry import resolved_config
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint

INIT_DIR = "init"  # the expanded model training starts from, under <storage>/<name>/


@dataclass(frozen=True)
class Expansion:
    model: CausalLM
    config: ModelConfig
    table: SignatureTable
    params_added: int
    old_vocab_size: int
    parent_fingerprint: str


def expand_model(parent: ExportedModel, new_tokens: Sequence[str]) -> Expansion:
    """`parent` with `new_tokens` appended to its vocabulary; old rows and weights are kept as they are."""
    table = parent.table.expand(new_tokens)
    config = resolved_config(parent.config)  # parameter matching pinned: only vocabulary tables grow
    if config.triple.match_params:
        config = config.model_copy(
            update={"triple": config.triple.model_copy(update={"match_params": False})}
        )
    config = config.model_copy(update={"vocab_size": len(table)})
    model = build_model(config, table)
    old_state = parent.model.state_dict()
    new_state = model.state_dict()
    for name, tensor in new_state.items():
        old = old_state[name]
        if tensor.shape != old.shape:  # a vocabulary-sized table: [V, d] -> [V + dV, d]
            added = tensor.shape[0] - old.shape[0]
            new_state[name] = torch.cat([old, old.mean(dim=0, keepdim=True).expand(added, -1)])
        else:
            new_state[name] = old
    model.load_state_dict(new_state, strict=True)
    params_added = param_count(config) - param_count(parent.config)
    if parent.config.family == "mhf" and params_added != 0:
        raise TrainingError(f"expanding an mhf model added {params_added} parameters; it must add none")
    return Expansion(model, config, table, params_added, parent.config.vocab_size, parent.table.fingerprint)


def resolve_parent(source: str) -> Path:
    """An exported model directory, a checkpoint directory (its `model/`) or a run (its newest)."""
    path = Path(source)
    if (path / MODEL_DIR).is_dir():
        return path / MODEL_DIR
    newest = newest_checkpoint(path) if path.is_dir() else None
    return newest / MODEL_DIR if newest is not None else path


def expanded_tokenizer(
    parent: TextTokenizer,
    tokenizer: str | None = None,
    add_tokens: str | None = None,
    train_new_tokens: int = 0,
    texts: Callable[[], Sequence[str]] | None = None,
) -> TextTokenizer:
    """Exactly one way: a new tokenizer.json extending the parent's, a file of tokens, or N learned ones."""
    if sum([tokenizer is not None, add_tokens is not None, train_new_tokens > 0]) != 1:
        raise TrainingError(
            "give exactly one of --tokenizer, --add-tokens or --train-new-tokens N --corpus C"
        )
    if tokenizer is not None:
        new = TextTokenizer.load(tokenizer)
        new.check_extends(parent)
        return new
    if add_tokens is not None:
        path = Path(add_tokens)
        if not path.is_file():
            raise TrainingError(f"--add-tokens file {add_tokens!r} does not exist; check the path")
        tokens = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return parent.with_added_tokens(tokens)
    if texts is None:
        raise TrainingError("--train-new-tokens needs --corpus: the text the new tokens are learned from")
    return parent.with_trained_tokens(texts(), train_new_tokens)


@dataclass(frozen=True)
class CptResult:
    expansion: Expansion
    init_dir: Path
    train_result: Any  # TrainResult


def run_cpt(
    cfg: Config,
    parent_source: str,
    new_tokenizer: Callable[[TextTokenizer], TextTokenizer],
    options: Any,  # TrainOptions
    log: Callable[[str], None] = print,
) -> CptResult:
    """Expand the parent's vocabulary, prepare `cfg.data.corpus` with the new tokenizer, and train.

    `cfg` supplies the training and data settings; the model config comes from the parent.
    """
    from mhf_dist.data.prepare import prepare
    from mhf_dist.train.ray_trainer import train

    parent_dir = resolve_parent(parent_source)
    parent = load_exported(parent_dir)
    tokenizer = new_tokenizer(parent.tokenizer)
    new_tokens = tokenizer.vocabulary()[parent.tokenizer.vocab_size :]
    if not new_tokens:
        raise TrainingError("the new tokenizer adds no tokens; nothing to expand")
    expansion = expand_model(parent, new_tokens)
    log(
        f"vocabulary {expansion.old_vocab_size:,} -> {expansion.config.vocab_size:,} "
        f"(+{len(new_tokens):,} tokens); parameters {param_count(parent.config):,} -> "
        f"{param_count(expansion.config):,} (+{expansion.params_added:,})"
    )
    workdir = Path(options.storage).resolve() / options.name
    init_dir = workdir / INIT_DIR
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer_file = workdir / "tokenizer.json"
    tokenizer.save(tokenizer_file)
    if not init_dir.exists():
        lineage = [
            *parent.lineage,
            {"fingerprint": parent.table.fingerprint, "vocab_size": parent.config.vocab_size},
        ]
        export_model(expansion.model, expansion.config, expansion.table, tokenizer_file, init_dir, lineage)

    # The shards carry the expanded table itself: an imported parent's rows need not follow our rule.
    data = cfg.data.model_copy(
        update={"tokenizer": str(tokenizer_file), "path": str(workdir / "data"), "signatures": str(init_dir)}
    )
    run_cfg = cfg.model_copy(update={"model": expansion.config, "data": data})
    if not (workdir / "data" / "manifest.json").is_file():
        prepare(run_cfg, data.path, log=log)
    prepared = read_manifest(data.path)["signatures"]["fingerprint"]
    if prepared != expansion.table.fingerprint:
        raise TrainingError(
            f"shards in {data.path!r} have signature fingerprint {prepared[:12]}, the expanded model "
            f"{expansion.table.fingerprint[:12]}; remove the directory and run mhf cpt again"
        )
    tags = {
        "cpt_parent_model": str(parent_dir.resolve()),
        "cpt_parent_fingerprint": parent.table.fingerprint,
        "cpt_old_vocab_size": expansion.old_vocab_size,
        "cpt_new_vocab_size": expansion.config.vocab_size,
        "cpt_params_added": expansion.params_added,
    }
    result = train(run_cfg, dataclasses.replace(options, init_from=str(init_dir)), tags=tags)
    return CptResult(expansion, init_dir, result)
