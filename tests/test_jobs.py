"""Jobs on a real multi-node Ray cluster on this machine: `mhf submit` through the Jobs API, MLflow after."""

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mhf_dist.cli import main
from mhf_dist.local_cluster import (
    ClusterError,
    alive_nodes,
    auth_token,
    free_port,
    start_local_cluster,
    stop_local_cluster,
)

REPO = Path(__file__).resolve().parents[1]
TINY_JOB = [
    "--set=data.tokenizer=bytes",
    "--set=model.vocab_size=259",
    "--set=model.hash.spec=H2B64",
    "--set=train.seq_len=32",
    "--set=train.batch_size=8",
    "--set=train.steps=6",
    "--set=train.log_every=3",
    "--set=train.eval_every=6",
    "--workers",
    "1",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cluster")
    started = start_local_cluster(directory, workers=1, cpus_per_node=2, dashboard_port=free_port())
    yield started
    stop_local_cluster(directory)
    for pid in started.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def submit(cluster, tmp_path, monkeypatch, capsys):
    """Runs `mhf submit jobs/pretrain.job.yaml --wait ...` from the repository root; (rc, out, err)."""
    from ray._private.authentication_test_utils import reset_auth_token_state  # what Ray's tests use

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    reset_auth_token_state()  # Ray reads the mode once per process, perhaps before this test set it

    def run(
        *extra: str, storage: str = str(tmp_path), env: tuple[str, ...] = (), options: tuple[str, ...] = ()
    ) -> tuple[int, str, str]:
        argv = ["submit", "jobs/pretrain.job.yaml", "--address", cluster.dashboard_url, "--wait", *options]
        environment = [arg for assignment in env for arg in ("--env", assignment)]
        status = main([*argv, "--env", f"MHF_STORAGE={storage}", *environment, "--", *extra])
        out, err = capsys.readouterr()
        return status, out, err

    yield run
    monkeypatch.undo()  # the caller's RAY_AUTH_MODE (the test session's own Ray has no token), read again:
    reset_auth_token_state()


def test_the_cluster_has_a_head_and_a_worker_node_and_refuses_a_second_start(cluster, tmp_path):
    assert alive_nodes(cluster.dashboard_url, auth_token()) == 2
    assert cluster.address.startswith("127.0.0.1:") and cluster.dashboard_url.startswith("http://127.0.0.1:")
    with pytest.raises(ClusterError, match="already recorded"):
        start_local_cluster(cluster.directory)
    import torch

    more = torch.cuda.device_count() + 1
    with pytest.raises(ClusterError, match=rf"^--gpus-per-node {more} on 1 node\(s\) needs {more} GPUs, but"):
        start_local_cluster(tmp_path / "gpus", workers=0, gpus_per_node=more)
    assert not (tmp_path / "gpus").exists()


def test_a_failing_job_surfaces_its_error_and_a_nonzero_exit_and_its_id_stays_taken(submit, cluster):
    named = ("--submission-id", "mhf-failing-job")
    status, out, err = submit("--set", "train.steps=-1", options=named)
    assert status == 1
    assert "error: train.steps" in out  # mhf's own one-line error, streamed from the job's logs
    assert "FAILED" in err and "exit code 2" in err
    status, out, err = submit("--set", "train.steps=-1", options=named)  # nothing is submitted again
    assert (status, out) == (2, "") and err.strip().splitlines()[-1] == (
        f"error: submission id 'mhf-failing-job' is taken on the cluster at {cluster.dashboard_url}; choose "
        "another --submission-id, or leave it out for Ray to pick one"
    )


def test_a_pretrain_job_succeeds_with_its_mlflow_run_and_metrics(submit, tmp_path):
    status, out, err = submit(*TINY_JOB)
    assert status == 0, err[-2000:]
    assert "SUCCEEDED" in err
    assert "step 6/6" in out  # rank 0's progress lines, relayed to the job's driver while the job ran
    for foreign in ("(RayTrainWorker pid=", "(TrainController pid=", "Setting accelerator to CPU"):
        assert foreign not in out  # the workers' own output stays in Ray's logs
    client = MlflowClient(f"sqlite:///{tmp_path / 'train' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pretrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "pretrain"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 7))
    assert {"val_nll", "tokens_per_s", "loss"} <= set(run.data.metrics)
    assert (tmp_path / "train" / "pretrain" / "checkpoint-0000006" / "model" / "model.safetensors").is_file()


def test_a_pretrain_job_with_its_storage_only_in_a_bucket(submit, bucket, tmp_path):
    """Shards, checkpoints and the model in the bucket; MLflow where MLFLOW_TRACKING_URI says (both nodes
    are on this machine, so a SQLite file works; a real cluster points it at a tracking server)."""
    from mhf_dist.storage import Location

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status, _, err = submit(*TINY_JOB, storage=bucket, env=(f"MLFLOW_TRACKING_URI={tracking}",))
    assert status == 0, err[-2000:]
    client = MlflowClient(tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 7))
    assert (Location.of(bucket) / "data/tiny/manifest.json").is_file()
    assert (Location.of(bucket) / "train/pretrain/checkpoint-0000006/model/model.safetensors").is_file()
    assert not list(tmp_path.glob("**/checkpoint-*"))


def test_an_unreachable_cluster_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    address = f"http://127.0.0.1:{free_port()}"
    assert main(["submit", "jobs/pretrain.job.yaml", "--address", address, "--env", "MHF_STORAGE=/s"]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot reach the Ray Jobs API at {address}")
