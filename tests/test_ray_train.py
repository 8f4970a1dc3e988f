"""`mhf train`: Ray Train V2 workers driving DeepSpeed ZeRO engines on CPU, checkpoints, exact resume."""

import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.errors import ConfigError, TrainingError
from mhf_dist.train.engine import deepspeed_config
from mhf_dist.train.ray_trainer import TrainOptions, read_history, train

TINY_BYTES = [
    "data.tokenizer=bytes",
    "model.vocab_size=259",
    "model.hash.spec=H2B64",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.log_every=5",
    "train.lr=3e-3",
    "train.warmup_steps=3",
]


@pytest.fixture(scope="module")
def shards(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "data"
    prepare(load_config("tiny", [*TINY_BYTES, f"data.path={path}"]), path, log=lambda _: None)
    return path


def run_cfg(shards, *extra):
    return load_config("tiny", [*TINY_BYTES, f"data.path={shards}", *extra])


def test_deepspeed_config_follows_ours():
    cfg = load_config("tiny", ["train.batch_size=8", "train.grad_clip=0.5"]).train
    ds = deepspeed_config(cfg, zero_stage=2, world_size=2, bf16=False)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    with pytest.raises(ConfigError, match="does not split over 3 workers"):
        deepspeed_config(cfg, zero_stage=0, world_size=3, bf16=False)
    with pytest.raises(ConfigError, match="not a ZeRO stage"):
        deepspeed_config(cfg, zero_stage=4, world_size=2, bf16=False)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_each_zero_stage_on_two_cpu_workers_lowers_the_loss(shards, tmp_path, zero_stage):
    cfg = run_cfg(shards, "train.steps=20")
    checkpoint = train(
        cfg, TrainOptions(workers=2, zero_stage=zero_stage, storage=str(tmp_path), name="zero")
    )
    history = read_history(checkpoint)
    assert [metrics["step"] for metrics in history] == list(range(1, 21))
    first, last = sum(h["loss"] for h in history[:3]) / 3, sum(h["loss"] for h in history[-3:]) / 3
    assert last < first - 0.5


def test_resumed_and_crashed_runs_reproduce_the_uninterrupted_loss_curve(shards, tmp_path):
    cfg = run_cfg(shards, "train.steps=10", "train.checkpoint_every=5")
    whole = read_history(train(cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="whole")))
    half = train(cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="half", stop_at_step=5))
    assert [h["step"] for h in read_history(half)] == [1, 2, 3, 4, 5]
    resumed = read_history(
        train(cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="rest", resume=str(half)))
    )
    assert [h["step"] for h in resumed] == list(range(1, 11))
    assert whole[-1]["loss"] < whole[0]["loss"]  # ZeRO-1 learns too
    for expected, got in zip(whole, resumed, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["lr"] == pytest.approx(expected["lr"], rel=1e-9)

    faulty = run_cfg(shards, "train.steps=10", "train.checkpoint_every=5", "train.fail_at_step=7")
    survived = train(faulty, TrainOptions(zero_stage=1, storage=str(tmp_path), name="faulty", max_failures=1))
    assert (tmp_path / "faulty" / "fault-injected").is_file()
    recovered = read_history(survived)
    assert [h["step"] for h in recovered] == list(range(1, 11))  # every step once, none repeated
    assert recovered[-1]["loss"] == pytest.approx(whole[-1]["loss"], abs=1e-5)

    other = run_cfg(shards, "train.steps=10", "model.backbone.num_layers=3")
    with pytest.raises(TrainingError, match=r"different model config \(backbone\)"):
        train(other, TrainOptions(storage=str(tmp_path), name="bad", resume=str(half)))
    with pytest.raises(TrainingError, match="is not a checkpoint directory"):
        train(cfg, TrainOptions(storage=str(tmp_path), name="bad", resume=str(tmp_path / "nowhere")))
