"""DeepSpeed: the engine config generated from ours, and the stepper the shared loop drives.

Models know nothing of DeepSpeed; this module wraps a built model in a ZeRO engine whose optimizer and
LR schedule are the same AdamW and warm-up + cosine that local training uses.
"""

from __future__ import annotations

from typing import Any

import torch

from mhf_dist.config import TrainConfig
from mhf_dist.errors import ConfigError
from mhf_dist.models.base import CausalLM
from mhf_dist.train.optim import build_optimizer


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """train.batch_size is the global batch; each worker takes an equal share."""
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size={cfg.batch_size} does not split over {world_size} workers; "
            f"use a multiple of {world_size}"
        )
    return cfg.batch_size // world_size


def deepspeed_config(cfg: TrainConfig, zero_stage: int, world_size: int, bf16: bool) -> dict[str, Any]:
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage {zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    return {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size(cfg, world_size),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # torch AdamW: the same optimizer as local training
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # the shared loop prints progress
        "wall_clock_breakdown": False,
    }


class DeepSpeedStepper:
    """One optimizer step through a DeepSpeed engine: forward, engine.backward, engine.step."""

    def __init__(
        self, model: CausalLM, cfg: TrainConfig, zero_stage: int, world_size: int, bf16: bool
    ) -> None:
        import deepspeed

        optimizer, scheduler = build_optimizer(model, cfg)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg, zero_stage, world_size, bf16),
        )

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        self.engine.train()
        batch = {key: value.to(self.engine.device) for key, value in batch.items()}
        lr = self.scheduler.get_last_lr()[0]
        output = self.engine(**batch)
        self.engine.backward(output.loss)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        # The mean over workers, so every rank logs and checks the same number (a NaN stops all of them).
        metrics = {key: torch.tensor(value, dtype=torch.float64) for key, value in output.metrics.items()}
        if torch.distributed.is_initialized():
            for value in metrics.values():
                torch.distributed.all_reduce(value)
                value /= torch.distributed.get_world_size()
        return {
            **{key: float(value) for key, value in metrics.items()},
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        }
