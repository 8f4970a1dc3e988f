"""AdamW with linear warm-up and cosine decay, built from `TrainConfig`."""

from __future__ import annotations

import math

import torch
from torch import nn

from mhf_dist.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after `step` optimizer steps: linear warm-up, cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and tables only; norms' gains and other vectors are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
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
