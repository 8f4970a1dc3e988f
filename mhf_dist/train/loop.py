"""The training loop, written once: `run_training` drives any `Stepper` (`TorchStepper` locally, a
DeepSpeed one in Ray Train workers), so every way of training measures throughput the same way."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mhf_dist.config import TrainConfig
from mhf_dist.errors import TrainingError
from mhf_dist.models.base import CausalLM
from mhf_dist.train.callbacks import ProgressLines, StepCallback
from mhf_dist.train.optim import build_optimizer
from mhf_dist.train.trainable import apply_trainable

Batch = dict[str, torch.Tensor]


class Stepper(Protocol):
    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; returns its metrics (loss, lr, grad_norm, ...)."""


class TorchStepper:
    """forward, backward, clip, AdamW step and LR schedule on one process."""

    def __init__(self, model: CausalLM, cfg: TrainConfig) -> None:
        self.model = model
        self.grad_clip = cfg.grad_clip
        self.optimizer, self.scheduler = build_optimizer(model, cfg)

    def step(self, batch: Batch) -> dict[str, float]:
        self.model.train()
        output = self.model(**batch)
        self.optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return {**output.metrics, "lr": lr, "grad_norm": float(grad_norm)}


@dataclass(frozen=True)
class Throughput:
    """What one step processes, for tokens/s and the MFU estimate."""

    tokens_per_step: int  # over all workers
    flops_per_token: int = 0  # analytic training FLOPs (forward + backward)
    workers: int = 1
    peak_flops: float = 0.0  # per worker; 0 leaves MFU out (needs flops_per_token)


def run_training(
    stepper: Stepper,
    batches: Iterable[Batch],
    steps: int,
    throughput: Throughput,
    start_step: int = 0,
    stop_step: int | None = None,
    callbacks: Sequence[StepCallback] = (),
) -> list[dict[str, float]]:
    """Run steps start_step+1 .. stop_step (default: steps) of a `steps`-step run; one metrics dict per
    step, which `callbacks` see in order. tokens/s counts both `step_time` and `data_wait_s`."""
    history: list[dict[str, float]] = []
    batch_iter: Iterator[Batch] = iter(batches)
    started = time.perf_counter()
    last = steps if stop_step is None else min(stop_step, steps)
    for step in range(start_step + 1, last + 1):
        wait_start = time.perf_counter()
        try:
            batch = next(batch_iter)
        except StopIteration:
            raise TrainingError(
                f"the data ran out at step {step} of {steps}; give more data or fewer steps"
            ) from None
        step_start = time.perf_counter()
        metrics = stepper.step(batch)
        seconds = time.perf_counter() - step_start
        data_wait = step_start - wait_start
        if not math.isfinite(metrics["loss"]):
            raise TrainingError(
                f"loss is {metrics['loss']} at step {step}; lower train.lr or raise train.warmup_steps"
            )
        tokens_per_s = throughput.tokens_per_step / (seconds + data_wait)
        metrics.update(
            step=step,
            step_time=seconds,
            data_wait_s=data_wait,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_worker=tokens_per_s / throughput.workers,
        )
        if throughput.flops_per_token:
            metrics["flops_per_s"] = tokens_per_s * throughput.flops_per_token
            if throughput.peak_flops:
                metrics["mfu"] = metrics["flops_per_s"] / (throughput.peak_flops * throughput.workers)
        metrics["eta_s"] = (time.perf_counter() - started) / (step - start_step) * (steps - step)
        history.append(metrics)
        for callback in callbacks:
            callback.on_step_end(metrics)
    return history


def train_local(
    model: CausalLM,
    batches: Iterable[Batch],
    cfg: TrainConfig,
    flops_per_token: int = 0,
    log: Callable[[str], None] | None = print,
) -> list[dict[str, float]]:
    """Train `model` in this process for `cfg.steps` steps: the code path every runner shares."""
    apply_trainable(model, cfg.trainable)  # None: every parameter trains
    throughput = Throughput(tokens_per_step=cfg.batch_size * cfg.seq_len, flops_per_token=flops_per_token)
    callbacks = [ProgressLines(cfg, log)] if log is not None else []
    return run_training(TorchStepper(model, cfg), batches, cfg.steps, throughput, callbacks=callbacks)
