"""Training with nothing on a shared disk: shards, checkpoints and the exported model in a bucket of a
real S3-protocol server (moto on 127.0.0.1), a worker killed mid-run, and the run's loss curve
identical to the same run on a local disk."""

import json
import subprocess
import sys
import time

import pytest
from faults import KillLastWorker

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.storage import Location, StorageError
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint, read_history
from mhf_dist.train.ray_trainer import TrainOptions, train

FEW_ROWS = [
    "data.corpus=recall",
    "model.vocab_size=40",
    "train.seq_len=32",
    "data.recall.examples=60",
    "data.rows_per_shard=16",
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "train.steps=8",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=2",
]


@pytest.fixture(scope="module")
def local_shards(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "data"
    prepare(load_config("tiny", [*FEW_ROWS, f"data.path={path}"]), path, log=lambda _: None)
    return path


def test_a_run_stored_only_in_a_bucket_survives_a_killed_worker_with_the_local_loss_curve(
    local_shards, bucket, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    data = Location.of(f"{bucket}/data")
    data.upload(local_shards, last="manifest.json")
    storage = f"{bucket}/runs"
    remote = load_config("tiny", [*FEW_ROWS, f"data.path={data.uri}", f"topology.storage={storage}"])
    fault = KillLastWorker(step=5, marker=tmp_path / "fault-injected")
    result = train(remote, TrainOptions(name="cut", max_failures=1), worker_callbacks=[fault])
    assert fault.marker.is_file()  # the worker did die, after the step-4 checkpoint

    assert result.checkpoint.remote and result.checkpoint.uri == f"{storage}/cut/checkpoint-0000008"
    stored = [path.name for path in Location.of(f"{storage}/cut").children()]
    assert [name for name in stored if name.startswith("checkpoint-")] == [
        "checkpoint-0000006",
        "checkpoint-0000008",
    ]  # train.keep_checkpoints=2 applied in the bucket
    assert {"mlflow-logged.json", "mlflow-run.json"} <= set(stored)
    assert newest_checkpoint(Location.of(f"{storage}/cut")) == result.checkpoint
    assert not list(tmp_path.glob("**/checkpoint-*"))  # nothing of the run on the local disk

    local = load_config("tiny", [*FEW_ROWS, f"data.path={local_shards}", f"topology.storage={tmp_path}"])
    whole = read_history(train(local, TrainOptions(name="whole")).checkpoint)
    resumed = read_history(result.checkpoint)
    assert [h["step"] for h in resumed] == list(range(1, 9))
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in whole], abs=1e-6)

    record = (Location.of(f"{storage}/cut") / "mlflow-run.json").read_text()
    assert "testing" not in record  # no credentials stored with the run
    artifacts = MlflowClient(result.tracking_uri).list_artifacts(result.run_id)
    assert sorted(artifact.path for artifact in artifacts) == ["model", "run.json"]
    exported = result.checkpoint / MODEL_DIR
    assert exported.is_dir() and json.loads((result.checkpoint / "run.json").read_text())["workers"] == 2


@pytest.mark.parametrize(
    ("storage", "says"),
    [
        ("s3://no-such-bucket-here/runs", "the bucket of 's3://no-such-bucket-here/runs' does not exist"),
        ("nosuchscheme://bucket/runs", "pyarrow knows no filesystem for nosuchscheme://"),
    ],
)
def test_unusable_storage_is_one_line_and_exit_2_within_30_s(s3_server, local_shards, storage, says):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mhf_dist.cli", "train", "--config", "tiny", "--storage", storage]
        + [arg for key in FEW_ROWS for arg in ("--set", key)]
        + ["--set", f"data.path={local_shards}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], done.stderr


def test_a_closed_port_is_one_line_within_seconds(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"cannot reach the object store at http://127\.0\.0\.1:9"):
        Location.of("s3://some-bucket/x").exists()
    assert time.monotonic() - started < 30
