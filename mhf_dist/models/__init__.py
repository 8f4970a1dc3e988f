"""Model families behind one registry: `build_model(cfg, signatures)`; `register_family` adds one."""

from mhf_dist.models.base import CausalLM, LMOutput
from mhf_dist.models.registry import (
    FAMILIES,
    Backbone,
    Family,
    build_model,
    forward_flops_per_token,
    param_count,
    register_backbone,
    register_family,
    train_flops_per_token,
)

__all__ = [
    "FAMILIES",
    "Backbone",
    "CausalLM",
    "Family",
    "LMOutput",
    "build_model",
    "forward_flops_per_token",
    "param_count",
    "register_backbone",
    "register_family",
    "train_flops_per_token",
]
