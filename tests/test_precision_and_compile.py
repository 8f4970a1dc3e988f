"""train.precision (bf16 through DeepSpeed, on CPU here) and train.compile, against fp32 eager."""

import pytest
import torch

from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model
from mhf_dist.train.engine import DeepSpeedStepper, check_training_options, uses_bf16

BF16_LOSS_TOLERANCE = 0.05  # nats: bf16 weights and activations, fp32 master weights and log-softmax


def losses(cfg, table, steps=6, compile_model=False, bf16=False):
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    if compile_model:
        model.compile()
    stepper = DeepSpeedStepper(model, cfg.train, zero_stage=0, world_size=1, bf16=bf16, hidden_size=64)
    rows = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))
    return [stepper.step({"tokens": rows})["loss"] for _ in range(steps)]


def test_a_bf16_fit_trains_and_stays_near_fp32(one_process_group, small_cfg, small_table):
    cfg = small_cfg.model_copy(
        update={"train": small_cfg.train.model_copy(update={"lr": 3e-3, "warmup_steps": 1})}
    )
    fp32, bf16 = losses(cfg, small_table), losses(cfg, small_table, bf16=True)
    assert bf16[-1] < bf16[0] - 0.3  # it trains
    assert bf16 != fp32  # it really ran in bf16
    for a, b in zip(fp32, bf16, strict=True):
        assert b == pytest.approx(a, abs=BF16_LOSS_TOLERANCE)


def test_the_compiled_model_gives_the_eager_loss_curve(one_process_group, small_cfg, small_table):
    eager = losses(small_cfg, small_table, steps=2)
    compiled = losses(small_cfg, small_table, steps=2, compile_model=True)
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_precision_resolves_per_device_and_unsupported_combinations_are_one_line():
    train = load_config("tiny").train
    assert uses_bf16(train, use_gpu=True) and not uses_bf16(train, use_gpu=False)  # auto
    assert uses_bf16(train.model_copy(update={"precision": "bf16"}), use_gpu=False)
    assert not uses_bf16(train.model_copy(update={"precision": "fp32"}), use_gpu=True)
    with pytest.raises(ConfigError, match=r"train.compile under ZeRO-3 is not supported; use --zero-stage 2"):
        check_training_options(train.model_copy(update={"compile": True}), zero_stage=3, use_gpu=False)
    check_training_options(train.model_copy(update={"compile": True}), zero_stage=2, use_gpu=False)
