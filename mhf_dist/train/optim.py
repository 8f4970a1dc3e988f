"""AdamW with linear warm-up and cosine decay, built from `TrainConfig`."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from mhf_dist.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after `step` optimizer steps: linear warm-up, cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# The HF Trainer's rule (`Trainer.get_decay_parameter_names`), which the authors' `--weight_decay 0.1`
# goes through: no decay for biases and norms, by the parameter's lower-cased name, nor for anything
# inside an nn.LayerNorm; every other parameter decays.
NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on everything but biases and norms' gains (the HF Trainer's rule); a tied parameter
    counts once, under its first name."""
    in_layer_norm = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = id(param) in in_layer_norm or NO_DECAY_NAME.search(name.lower())
            (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # The fused CUDA kernel on GPUs (one launch for all parameters; DeepSpeed's ZeRO and bf16 optimizers
    # step it on their fp32 partitions, also on the GPU); torch's default on CPU, which the loss curves
    # recorded here use.
    on_gpu = next(model.parameters()).is_cuda
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=True if on_gpu else None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler
