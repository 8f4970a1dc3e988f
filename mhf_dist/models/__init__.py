"""Model families behind one registry: `build_model(cfg, signatures)`."""

from mhf_dist.models.base import CausalLM, LMOutput
from mhf_dist.models.registry import (
    FAMILIES,
    build_model,
    forward_flops_per_token,
    param_count,
    train_flops_per_token,
)

__all__ = [
    "FAMILIES",
    "CausalLM",
    "LMOutput",
    "build_model",
    "forward_flops_per_token",
    "param_count",
    "train_flops_per_token",
]
