"""`mhf train`: Ray Train V2 workers driving DeepSpeed ZeRO engines on CPU, checkpoints, exact resume."""

import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.errors import ConfigError, TrainingError
from mhf_dist.tracking import TrackingError
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
    result = train(cfg, TrainOptions(workers=2, zero_stage=zero_stage, storage=str(tmp_path), name="zero"))
    history = read_history(result.checkpoint)
    assert [metrics["step"] for metrics in history] == list(range(1, 21))
    first, last = sum(h["loss"] for h in history[:3]) / 3, sum(h["loss"] for h in history[-3:]) / 3
    assert last < first - 0.5


def test_resumed_and_crashed_runs_reproduce_the_uninterrupted_loss_curve(shards, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = run_cfg(shards, "train.steps=10", "train.checkpoint_every=5")
    whole = read_history(
        train(cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="whole")).checkpoint
    )
    half = train(
        cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="half", stop_at_step=5)
    ).checkpoint
    assert [h["step"] for h in read_history(half)] == [1, 2, 3, 4, 5]
    resumed = read_history(
        train(
            cfg, TrainOptions(zero_stage=1, storage=str(tmp_path), name="rest", resume=str(half))
        ).checkpoint
    )
    assert [h["step"] for h in resumed] == list(range(1, 11))
    assert whole[-1]["loss"] < whole[0]["loss"]  # ZeRO-1 learns too
    for expected, got in zip(whole, resumed, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["lr"] == pytest.approx(expected["lr"], rel=1e-9)

    faulty = run_cfg(shards, "train.steps=10", "train.checkpoint_every=5", "train.fail_at_step=7")
    survived = train(faulty, TrainOptions(zero_stage=1, storage=str(tmp_path), name="faulty", max_failures=1))
    logged = MlflowClient(tracking_uri=survived.tracking_uri).get_metric_history(survived.run_id, "loss")
    assert sorted(metric.step for metric in logged) == list(range(1, 11))  # each step once, crash or not
    assert (tmp_path / "faulty" / "fault-injected").is_file()
    recovered = read_history(survived.checkpoint)
    assert [h["step"] for h in recovered] == list(range(1, 11))  # every step once, none repeated
    assert recovered[-1]["loss"] == pytest.approx(whole[-1]["loss"], abs=1e-5)

    other = run_cfg(shards, "train.steps=10", "model.backbone.num_layers=3")
    with pytest.raises(TrainingError, match=r"different model config \(backbone\)"):
        train(other, TrainOptions(storage=str(tmp_path), name="bad", resume=str(half)))
    with pytest.raises(TrainingError, match="already holds checkpoints; continue it with --resume"):
        train(cfg, TrainOptions(storage=str(tmp_path), name="whole"))
    with pytest.raises(TrainingError, match="is not a checkpoint directory"):
        train(cfg, TrainOptions(storage=str(tmp_path), name="bad", resume=str(tmp_path / "nowhere")))


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 with a SQLite backend, stopped after the test."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'server.db'}",
        "--default-artifact-root",
        str(tmp_path / "artifacts"),
        "--workers",
        "1",
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not start within 60 s")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_training_logs_every_step_once_to_a_real_mlflow_server(shards, tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = run_cfg(shards, "train.steps=6", "train.checkpoint_every=3")
    result = train(
        cfg, TrainOptions(zero_stage=0, storage=str(tmp_path), name="tracked", experiment="served")
    )
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["family"] == "mhf"
    assert run.data.params["model.hash.spec"] == "H2B64"
    losses = client.get_metric_history(result.run_id, "loss")
    assert sorted(metric.step for metric in losses) == [1, 2, 3, 4, 5, 6]
    history = read_history(result.checkpoint)
    assert [metric.value for metric in sorted(losses, key=lambda m: m.step)] == pytest.approx(
        [h["loss"] for h in history]
    )


def test_an_unreachable_tracking_server_fails_before_training(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    with pytest.raises(TrackingError, match=r"cannot use MLflow tracking at 'http://127\.0\.0\.1:9'"):
        train(run_cfg(shards, "train.steps=2"), TrainOptions(storage=str(tmp_path), name="nowhere"))
