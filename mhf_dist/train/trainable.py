"""`train.trainable`: the parameters that train; every other one is frozen (`requires_grad=False`).

Patterns are `fnmatch` globs over `named_parameters()` names (`*` also crosses dots); a numeric segment
may count from the end of its module list (`backbone.layers.-1.*`), and tied parameters answer to every
name they have. None or [] trains everything; a pattern that matches nothing is an error.

`AUTHORS_VE` is HUIYINXUE/MHF's vocabulary-expansion recipe (`vocab_expansion/src/main_ve.py`), which
`mhf cpt` applies by default.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.errors import ConfigError

AUTHORS_VE = "authors-ve"  # the recipe's name, as cpt's console and MLflow tags show it
_EDGE_LAYERS = ("0", "1", "-2", "-1")  # main_ve.py: `for layer_idx in [0, 1, -1, -2]`


def authors_ve_trainable(model: ModelConfig) -> list[str] | None:
    """The authors' trainable list for `model` in our names (None: every parameter trains): decoder layers
    0, 1, -2 and -1, the final norm, the token tables and head, and mhf's `encoder` and `decoder` (their
    bucket tables, combiner and hash head); a triple-latent stack's edge blocks by analogy."""
    # A one-layer stack has no layer 1 or -2: a pattern that matches nothing would be an error.
    edges = _EDGE_LAYERS if model.backbone.num_layers > 1 else ("0", "-1")
    if model.family == "mhf":
        stack = "backbone.layers" if model.backbone.kind == "qwen3" else "backbone.blocks"
        return [*(f"{stack}.{i}.*" for i in edges), "backbone.norm.*", "encoder.*", "decoder.*"]
    if model.family in ("qwen3", "qwen3_matched"):
        return [
            *(f"model.model.layers.{i}.*" for i in edges),
            "model.model.norm.*",
            "model.model.embed_tokens.*",
            "model.lm_head.*",
        ]
    return None


@dataclass(frozen=True)
class TrainableSplit:
    trainable_params: int  # elements, each tied tensor once
    total_params: int
    frozen: tuple[str, ...]  # names of the frozen parameters

    def summary(self) -> str:
        share = self.trainable_params / self.total_params if self.total_params else 1.0
        return (
            f"trainable parameters {self.trainable_params:,} of {self.total_params:,} ({share:.1%}); "
            f"{len(self.frozen)} tensors frozen"
        )


def _aliases(name: str, lengths: dict[str, int]) -> list[str]:
    """`name` and its spellings with numeric segments counted from the end of their module list."""
    parts = name.split(".")
    choices = []
    for index, part in enumerate(parts):
        length = lengths.get(".".join(parts[:index]))
        choices.append((part, str(int(part) - length)) if part.isdigit() and length is not None else (part,))
    return [".".join(combo) for combo in itertools.product(*choices)]


def select_trainable(model: nn.Module, patterns: Sequence[str] | None) -> set[int]:
    """ids of the parameters `patterns` keep trainable (all of them for None or [])."""
    named = list(model.named_parameters(remove_duplicate=False))
    if not patterns:
        return {id(param) for _, param in named}
    lengths = {
        name: len(module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList | nn.Sequential)
    }
    spellings = [(_aliases(name, lengths), param) for name, param in named]
    selected: set[int] = set()
    for pattern in patterns:
        hits = [param for names, param in spellings if any(fnmatch.fnmatchcase(n, pattern) for n in names)]
        if not hits:
            examples = ", ".join(name for name, _ in named[:3])
            raise ConfigError(
                f"train.trainable pattern {pattern!r} matches no parameter of the "
                f"{type(model).__name__} model ({len(named)} names, e.g. {examples}); fix the pattern"
            )
        selected.update(id(param) for param in hits)
    return selected


def trainable_split(model: nn.Module, patterns: Sequence[str] | None) -> TrainableSplit:
    """What `apply_trainable` would freeze, without changing the model."""
    selected = select_trainable(model, patterns)
    params = list(model.named_parameters())  # each tied tensor once
    return TrainableSplit(
        trainable_params=sum(p.numel() for _, p in params if id(p) in selected),
        total_params=sum(p.numel() for _, p in params),
        frozen=tuple(name for name, p in params if id(p) not in selected),
    )


def apply_trainable(model: nn.Module, patterns: Sequence[str] | None) -> TrainableSplit:
    """Freeze every parameter `patterns` do not match (None or []: none is touched)."""
    split = trainable_split(model, patterns)
    if patterns:
        frozen = {id(model.get_parameter(name)) for name in split.frozen}
        for param in model.parameters():
            param.requires_grad_(id(param) not in frozen)
    return split


def config_split(
    model: ModelConfig, signatures: object | None, patterns: Sequence[str] | None
) -> TrainableSplit:
    """The split of the model `model` builds, on the meta device (no memory, milliseconds)."""
    from mhf_dist.models import build_model

    with torch.device("meta"):
        built = build_model(model, signatures)  # type: ignore[arg-type]
    return trainable_split(built, patterns)
