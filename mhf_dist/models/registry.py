"""The model registry: a family name maps to its builder and its analytic counts.

New families plug in with `register(...)`; the trainer, evaluator and CLI only call `build_model`,
`param_count` and `forward_flops_per_token`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mhf_dist.config import ModelConfig
from mhf_dist.errors import ConfigError, SignatureError
from mhf_dist.models import counting
from mhf_dist.models.base import CausalLM
from mhf_dist.models.multihashformer import MultiHashFormer
from mhf_dist.models.qwen3 import Qwen3LM
from mhf_dist.models.triple_latent import TransformerPlusTriple, TripleLatentLM
from mhf_dist.signatures import SignatureTable


@dataclass(frozen=True)
class Family:
    build: Callable[[ModelConfig, SignatureTable | None], CausalLM]
    params: Callable[[ModelConfig], int]
    forward_flops: Callable[[ModelConfig, int], int]
    uses_signatures: bool = False
    # The config the family really builds, e.g. with a layer count or MLP width solved for parameter matching.
    resolve: Callable[[ModelConfig], ModelConfig] = lambda cfg: cfg


FAMILIES: dict[str, Family] = {}


def register(name: str, family: Family) -> None:
    FAMILIES[name] = family


def _family(cfg: ModelConfig) -> Family:
    if cfg.family not in FAMILIES:
        raise ConfigError(f"unknown model family {cfg.family!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family]


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


def _build_mhf(cfg: ModelConfig, signatures: SignatureTable | None) -> CausalLM:
    if signatures is None:
        raise SignatureError("the mhf family needs a signature table; build one with SignatureTable.build")
    if not signatures.follows(cfg.hash):
        raise SignatureError(
            f"signature table is {signatures.spec} seed {signatures.seed} ({signatures.scheme} scheme, "
            f"num_lsh {signatures.num_lsh}) but the model config says {cfg.hash.spec} seed {cfg.hash.seed} "
            f"({cfg.hash.signature_scheme} scheme, num_lsh {cfg.hash.num_lsh}); rebuild the table or "
            "change model.hash"
        )
    if len(signatures) != cfg.vocab_size:
        raise SignatureError(
            f"signature table has {len(signatures)} tokens but model.vocab_size={cfg.vocab_size}; "
            f"set --set model.vocab_size={len(signatures)}"
        )
    return MultiHashFormer(cfg, signatures.as_tensor())  # reserved rows too: exact scoring counts them


register("mhf", Family(_build_mhf, counting.mhf_params, counting.mhf_forward_flops, uses_signatures=True))
register("qwen3", Family(lambda cfg, _: Qwen3LM(cfg), counting.qwen3_params, counting.qwen3_forward_flops))
register(
    "qwen3_matched",
    Family(
        lambda cfg, _: Qwen3LM(cfg),
        counting.qwen3_params,
        counting.qwen3_forward_flops,
        resolve=counting.matched_config,
    ),
)


def _mlp_matched(params: Callable[[ModelConfig], int]) -> Callable[[ModelConfig], ModelConfig]:
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


for _name, _parts in counting.TRIPLE_STACKS.items():
    register(
        _name,
        Family(
            lambda cfg, _, parts=_parts: TripleLatentLM(cfg, **parts),
            counting.triple_params,
            counting.triple_forward_flops,
            resolve=_mlp_matched(counting.triple_params),
        ),
    )
register(
    "transformer_plus_triple",
    Family(
        lambda cfg, _: TransformerPlusTriple(cfg),
        counting.transformer_plus_triple_params,
        counting.transformer_plus_triple_forward_flops,
        resolve=_mlp_matched(counting.transformer_plus_triple_params),
    ),
)
