"""Gradient accumulation: train.micro_batch_size splits a worker's rows into forwards, same step."""

import pytest
import torch

from mhf_dist.config import check_topology, load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.engine import DeepSpeedStepper, accumulation_steps, deepspeed_config


def test_accumulated_micro_batches_give_the_unaccumulated_steps(one_process_group, small_cfg):
    # A collision-free (murmur32) table: over the reference rule's table of this vocabulary (6 duplicate
    # signatures) the two runs' parameters differ by up to 1.2e-5 after 3 AdamW steps, here by 1.1e-6.
    model_cfg = small_cfg.model.model_copy(
        update={"hash": small_cfg.model.hash.model_copy(update={"scheme": "murmur32"})}
    )
    table = SignatureTable.build([f"tok{i}" for i in range(300)], 2, 64, scheme="murmur32")
    batches = [torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    runs = {}
    for micro in (8, 2):
        cfg = small_cfg.train.model_copy(update={"batch_size": 8, "micro_batch_size": micro, "lr": 1e-2})
        torch.manual_seed(0)
        model = build_model(model_cfg, table)
        stepper = DeepSpeedStepper(model, cfg, zero_stage=0, world_size=1, bf16=False, hidden_size=64)
        losses = [stepper.step({"tokens": batch}) for batch in batches]
        runs[micro] = losses, dict(stepper.engine.module.named_parameters())
    (whole, whole_params), (accumulated, accumulated_params) = runs[8], runs[2]
    assert deepspeed_config(cfg, 0, 1, False, 64)["gradient_accumulation_steps"] == 4
    for a, b in zip(whole, accumulated, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert whole[2]["loss"] < whole[0]["loss"]  # the steps did train
    # The gate's output bias shifts every coordinate's score alike, which the softmax over coordinates
    # cancels: its gradient is zero up to rounding, and AdamW turns rounding noise into steps of +-lr.
    del whole_params["encoder.gate.2.bias"], accumulated_params["encoder.gate.2.bias"]
    for name, param in whole_params.items():
        assert torch.allclose(param, accumulated_params[name], atol=1e-5), name


def test_a_micro_batch_that_does_not_divide_a_workers_rows_is_a_one_line_error():
    cfg = load_config("tiny", ["train.batch_size=16", "train.micro_batch_size=3"])
    with pytest.raises(
        ConfigError,
        match=r"^train.micro_batch_size=3 does not divide the 8 rows each of 2 workers "
        r".*\(topology.workers=2\)$",
    ):
        check_topology(cfg)
    assert accumulation_steps(cfg.train.model_copy(update={"micro_batch_size": 2}), 2) == 4
    with pytest.raises(ConfigError, match=r"micro_batch_size=3 does not divide the 4 rows each of 4 workers"):
        accumulation_steps(cfg.train, 4)
