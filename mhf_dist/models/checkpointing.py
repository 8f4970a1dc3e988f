"""Activation checkpointing (`train.activation_checkpointing: layers`): keep each layer's input, recompute
its activations in the backward pass.

transformers' Qwen3 models (the baselines' and the hash models' stacks) through their own
`activation_checkpointing_enable`; the triple-latent blocks and the hash decoder's cascade, which are this
project's modules, through `torch.utils.checkpoint`. Both use the non-reentrant form, which works with
ZeRO-3 (the recomputation gathers partitioned parameters again through DeepSpeed's module hooks) and
needs no input that requires grad.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from mhf_dist.models.hash_io import CascadedHashDecoder
from mhf_dist.models.reference_io import ReferenceCascadeDecoder
from mhf_dist.models.triple_latent import TripleBlock

RECOMPUTED = (TripleBlock, CascadedHashDecoder, ReferenceCascadeDecoder)


def checkpoint_layers(model: nn.Module) -> int:
    """Turn activation checkpointing on in place; returns how many modules now recompute."""
    count = 0
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.supports_gradient_checkpointing:
            if not module.is_activation_checkpointing:
                module.activation_checkpointing_enable({"use_reentrant": False})
                count += module.config.num_hidden_layers
        elif isinstance(module, RECOMPUTED):
            _recompute_in_backward(module)
            count += 1
    return count


def _recompute_in_backward(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if module.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    module.forward = checkpointed
