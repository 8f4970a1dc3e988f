"""DeepSpeed: the engine config generated from ours, and the stepper the shared loop drives (with the
same AdamW and LR schedule as local training)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from mhf_dist.config import Config, TrainConfig, accumulation_steps, micro_batch_size
from mhf_dist.errors import ConfigError
from mhf_dist.models.base import CausalLM
from mhf_dist.train.optim import build_optimizer


def zero_config(stage: int, hidden_size: int) -> dict[str, Any]:
    """ZeRO buffer sizes scaled to the model's width, as transformers' DeepSpeed integration does.

    DeepSpeed's defaults are sized for billion-parameter models: on a 100M model they allocate more than
    the model and keep every ZeRO-3 parameter gathered between steps. Here buckets hold about one d x d
    matrix and a gathered parameter is released unless needed again within about one layer.
    """
    square, layer = hidden_size * hidden_size, 12 * hidden_size * hidden_size
    return {
        "stage": stage,
        "reduce_bucket_size": square,
        "allgather_bucket_size": square,
        "stage3_prefetch_bucket_size": int(0.9 * square),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 2 * layer,
        "stage3_max_reuse_distance": layer,
    }


def uses_bf16(cfg: TrainConfig, use_gpu: bool) -> bool:
    """train.precision: bf16 (mixed or pure) or fp32 as asked; auto is bf16 on GPUs and fp32 on CPUs."""
    return cfg.precision in ("bf16", "bf16-pure") or (cfg.precision == "auto" and use_gpu)


def precision_config(cfg: TrainConfig, zero_stage: int, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's precision keys for train.precision (resolved to `bf16` by `uses_bf16`).

    bf16-pure keeps no fp32 copy at any stage: at ZeRO-0 the stepper casts the parameters to bf16 and
    DeepSpeed, with no precision section, steps the torch optimizer on them; ZeRO 1-3 take DeepSpeed's
    bf16 master weights and optimizer states, which it refuses at ZeRO-0, hence the two routes.
    """
    if not bf16:
        return {"bf16": {"enabled": False}}
    if cfg.precision != "bf16-pure":
        return {"bf16": {"enabled": True}}
    if zero_stage == 0:
        return {"bf16": {"enabled": False}, "communication_data_type": "bf16"}
    return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def check_precision_supported(cfg: Config) -> None:
    """What the config cannot know: whether this machine's DeepSpeed accelerator has bf16."""
    if cfg.topology.gpus_per_worker == 0 and uses_bf16(cfg.train, use_gpu=False):
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu" and not get_accelerator().is_bf16_supported():
            raise ConfigError(
                f"train.precision={cfg.train.precision}: DeepSpeed's CPU accelerator here has no bf16; "
                "use fp32"
            )


def deepspeed_config(
    cfg: TrainConfig, zero_stage: int, world_size: int, bf16: bool, hidden_size: int
) -> dict[str, Any]:
    return {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size(cfg, world_size),
        "gradient_accumulation_steps": accumulation_steps(cfg, world_size),
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero_config(zero_stage, hidden_size),
        "zero_allow_untested_optimizer": True,  # torch AdamW: the same optimizer as local training
        **precision_config(cfg, zero_stage, bf16),
        "steps_per_print": 2**31 - 1,  # the shared loop prints progress
        "wall_clock_breakdown": False,
    }


def skip_cpu_shm_comm_op() -> None:
    """On CPU, DeepSpeed JIT-builds a shared-memory all-reduce only inference uses; its build's lock file,
    left behind by a killed worker, makes every later run on the machine wait forever. Marking the op
    incompatible, which DeepSpeed reads before building it, skips it."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        builder = accelerator.create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False


class DeepSpeedStepper:
    """One optimizer step through a DeepSpeed engine: forward, backward and engine.step per micro-batch
    (DeepSpeed scales each loss by 1/accumulation and steps the optimizer at the last one)."""

    def __init__(
        self,
        model: CausalLM,
        cfg: TrainConfig,
        zero_stage: int,
        world_size: int,
        bf16: bool,
        hidden_size: int,
    ) -> None:
        import deepspeed

        skip_cpu_shm_comm_op()
        self.zero_stage = zero_stage
        self.micro = micro_batch_size(cfg, world_size)
        if bf16 and cfg.precision == "bf16-pure":
            # The weights themselves in bf16, as the authors build the model; buffers keep their dtype,
            # as DeepSpeed's own bf16 cast leaves them. The decoder's log-softmax upcasts to fp32 itself.
            for param in model.parameters():
                param.data = param.data.to(torch.bfloat16)
        optimizer, scheduler = build_optimizer(model, cfg)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg, zero_stage, world_size, bf16, hidden_size),
        )

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this worker's rows of the global batch (train.batch_size / workers)."""
        self.engine.train()
        lr = self.scheduler.get_last_lr()[0]
        rows = len(batch["tokens"])
        totals: dict[str, float] = {}
        for start in range(0, rows, self.micro):
            micro = {
                key: value[start : start + self.micro].to(self.engine.device) for key, value in batch.items()
            }
            output = self.engine(**micro)
            self.engine.backward(output.loss)
            for name, value in output.metrics.items():
                totals[name] = totals.get(name, 0.0) + value * self.micro / rows
            # DeepSpeed reports the global norm from its ZeRO optimizers only; at stage 0 every rank holds
            # the whole all-reduced gradients after the last backward, so the norm (before clipping, as
            # DeepSpeed's) is taken here.
            last = start + self.micro >= rows
            whole_norm = self._whole_grad_norm() if self.zero_stage == 0 and last else None
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = whole_norm
        # The mean over workers, so every rank logs and checks the same number (a NaN stops all of them).
        values = torch.tensor(list(totals.values()), dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(values)
            values /= torch.distributed.get_world_size()
        return {
            **dict(zip(totals, values.tolist(), strict=True)),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        }

    def _whole_grad_norm(self) -> float | None:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def parameter_share(self) -> float:
        """The share of the model's parameters this rank holds: about 1/W under ZeRO-3, else 1."""
        if self.zero_stage < 3:
            return 1.0
        params = list(self.engine.module.parameters())
        return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)

    def whole_parameters(self) -> AbstractContextManager:
        """Inside this context every rank holds the full parameters (ZeRO-3 gathers its shards)."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)
