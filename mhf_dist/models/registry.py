"""The model registry: a family name maps to its builder and its analytic counts, a backbone kind (the
stack `mhf` runs between its hash encoder and decoder) to its stack's builder, parts and counts.

The built-in families below register through `register_family` and `register_backbone`, exactly as an
outside package does; `model.family` and `model.backbone.kind` then accept the new names. The names
live in `mhf_dist.plugins` (below the config, which validates against it); see there how an outside
package's module is loaded in the driver and in every Ray worker. The trainer, evaluator and CLI only
call `build_model`, `param_count` and `forward_flops_per_token`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.errors import ConfigError, SignatureError
from mhf_dist.models import counting
from mhf_dist.models.base import CausalLM
from mhf_dist.models.counting import StackParts
from mhf_dist.models.multihashformer import MultiHashFormer
from mhf_dist.models.qwen3 import Qwen3LM, Qwen3Stack
from mhf_dist.models.triple_latent import TransformerPlusTriple, TripleLatentLM, TripleStack
from mhf_dist.plugins import BACKBONES, FAMILIES
from mhf_dist.signatures import SignatureTable


@dataclass(frozen=True)
class Family:
    """A `model.family`: how to build it (with the vocabulary's signature table, None for families
    that take none) and its analytic parameter count and forward FLOPs per token (`seq_len` tokens)."""

    build: Callable[[ModelConfig, SignatureTable | None], CausalLM]
    params: Callable[[ModelConfig], int]
    forward_flops: Callable[[ModelConfig, int], int]
    # The config the family really builds, e.g. with a layer count or MLP width solved for parameter matching.
    resolve: Callable[[ModelConfig], ModelConfig] = lambda cfg: cfg


@dataclass(frozen=True)
class Backbone:
    """A `model.backbone.kind`: a stack of vectors in, hidden states out (`run`, `new_state`,
    `layer_states`), its parameters and its FLOPs over a whole sequence, memory included."""

    build: Callable[[ModelConfig], nn.Module]
    params: Callable[[ModelConfig], int]
    forward_flops: Callable[[ModelConfig, int], int]
    # What the counts and MultiHashFormer read of a triple-latent stack (a memory is read beside it).
    parts: StackParts = field(default_factory=StackParts)


def register_family(name: str, family: Family) -> None:
    """Make `name` a `model.family`; a name already registered is refused."""
    FAMILIES.add(name, family)


def register_backbone(name: str, backbone: Backbone) -> None:
    """Make `name` a `model.backbone.kind`; a name already registered is refused."""
    BACKBONES.add(name, backbone)


def _family(cfg: ModelConfig) -> Family:
    return FAMILIES.entry(cfg.family)


def build_model(cfg: ModelConfig, signatures: SignatureTable | None = None) -> CausalLM:
    """Build the family named by `cfg.family`; `mhf` needs the vocabulary's signature table."""
    return _family(cfg).build(resolved_config(cfg), signatures)


def resolved_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` as its family builds it (parameter matching applied)."""
    return _family(cfg).resolve(cfg)


def param_count(cfg: ModelConfig) -> int:
    return _family(cfg).params(resolved_config(cfg))


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    return _family(cfg).forward_flops(resolved_config(cfg), seq_len)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward plus backward (twice the forward), the numerator of MFU."""
    return 3 * forward_flops_per_token(cfg, seq_len)


def mlp_matched(params: Callable[[ModelConfig], int]) -> Callable[[ModelConfig], ModelConfig]:
    """`model.triple.match_params`: the MLP width whose parameter count is closest to the
    `model.triple.match_to` model's (the qwen3 baseline, or mhf over `model.backbone.kind`)."""

    def resolve(cfg: ModelConfig) -> ModelConfig:
        if not cfg.triple.match_params:
            return cfg
        size, residual = counting.param_matched_intermediate(cfg, params)
        if residual > 3 * cfg.backbone.hidden_size * cfg.backbone.num_layers:  # more than one MLP unit over
            raise ConfigError(
                f"model.triple.match_params: {cfg.family} keeps {residual:,} parameters more than the "
                f"{cfg.triple.match_to} model even with an MLP width of 1 (its vocabulary tables outweigh "
                "it); widen the backbone, shrink the vocabulary or set model.triple.match_params=false"
            )
        return counting.with_intermediate(cfg, size)

    return resolve


def triple_family(parts: StackParts) -> Family:
    """A standard-head triple-latent family with `parts` (`TripleLatentLM`), MLP-matched on request."""
    params = partial(counting.triple_params, parts=parts)
    return Family(
        lambda cfg, _: TripleLatentLM(cfg, slots=parts.slots, conv=parts.conv, memory=parts.memory),
        params,
        partial(counting.triple_forward_flops, parts=parts),
        resolve=mlp_matched(params),
    )


def triple_backbone(parts: StackParts) -> Backbone:
    """A triple-latent stack with `parts` for `mhf` to run between its hash encoder and decoder."""
    return Backbone(
        lambda cfg: TripleStack(cfg, slots=parts.slots, conv=parts.conv),
        partial(counting.triple_body_params, parts=parts),
        partial(counting.triple_body_forward_flops, parts=parts),
        parts,
    )


def _build_mhf(cfg: ModelConfig, signatures: SignatureTable | None) -> CausalLM:
    if signatures is None:
        raise SignatureError("the mhf family needs a signature table; build one with SignatureTable.build")
    signatures.check_follows(cfg.hash, "the signature table")
    if len(signatures) != cfg.vocab_size:
        raise SignatureError(
            f"signature table has {len(signatures)} tokens but model.vocab_size={cfg.vocab_size}; "
            f"set --set model.vocab_size={len(signatures)}"
        )
    return MultiHashFormer(cfg, signatures.as_tensor())  # reserved rows too: exact scoring counts them


# The triple-latent variants, each both a standard-head family and a backbone kind of the same name.
TRIPLE_STACKS: dict[str, StackParts] = {
    "triple_latent": StackParts(),
    "triple_slot": StackParts(slots=True),
    "triple_hybrid": StackParts(conv=True),
    "gated_hybrid": StackParts(memory=True),
}

register_backbone(
    "qwen3",
    Backbone(
        lambda cfg: Qwen3Stack(cfg.backbone), counting.qwen3_stack_params, counting.qwen3_stack_forward_flops
    ),
)
register_family("mhf", Family(_build_mhf, counting.mhf_params, counting.mhf_forward_flops))
register_family(
    "qwen3", Family(lambda cfg, _: Qwen3LM(cfg), counting.qwen3_params, counting.qwen3_forward_flops)
)
register_family(
    "qwen3_matched",
    Family(
        lambda cfg, _: Qwen3LM(cfg),
        counting.qwen3_params,
        counting.qwen3_forward_flops,
        resolve=counting.matched_config,
    ),
)
for _name, _parts in TRIPLE_STACKS.items():
    register_backbone(_name, triple_backbone(_parts))
    register_family(_name, triple_family(_parts))
register_family(
    "transformer_plus_triple",
    Family(
        lambda cfg, _: TransformerPlusTriple(cfg),
        counting.transformer_plus_triple_params,
        counting.transformer_plus_triple_forward_flops,
        resolve=mlp_matched(counting.transformer_plus_triple_params),
    ),
)
