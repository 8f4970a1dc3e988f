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


def test_the_cluster_has_a_head_and_a_worker_node_and_refuses_a_second_start(cluster):
    assert alive_nodes(cluster.dashboard_url, auth_token()) == 2
    assert cluster.address.startswith("127.0.0.1:") and cluster.dashboard_url.startswith("http://127.0.0.1:")
    with pytest.raises(ClusterError, match="already recorded"):
        start_local_cluster(cluster.directory)


def test_each_local_node_gets_gpus_of_its_own_and_more_than_the_machine_has_are_refused(
    tmp_path, monkeypatch
):
    """Nodes on one machine would each hand out GPUs 0..n-1: each `ray start` sees its own slice."""
    import subprocess
    import sys

    import torch

    from mhf_dist import local_cluster

    given, nodes = [], []

    def start_node(args, log, devices):  # stand-in nodes (`stop` knows a node by its arguments)
        given.append(devices)
        sleep = [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", *args]
        nodes.append(subprocess.Popen(sleep, stdout=subprocess.PIPE, start_new_session=True))
        nodes[-1].stdout.readline()  # up, as a real node is before the start goes on
        return nodes[-1].pid

    monkeypatch.setattr(local_cluster, "auth_token", lambda: "token")
    monkeypatch.setattr(local_cluster, "_ray_start", start_node)
    monkeypatch.setattr(local_cluster, "alive_nodes", lambda *_: len(nodes))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(
        ClusterError, match=r"^--gpus-per-node 3 on 2 node\(s\) needs 6 GPUs, but this machine has 4; "
    ):
        start_local_cluster(tmp_path / "refused", workers=1, gpus_per_node=3)
    assert not (tmp_path / "refused").exists() and not given
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(
        ClusterError, match=r"needs 2 GPUs, but this machine has 0; leave --gpus-per-node out$"
    ):
        start_local_cluster(tmp_path / "refused", workers=1, gpus_per_node=1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for visible, per_node in ((None, 2), ("5,7,9", 1)):
        if visible:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        start_local_cluster(
            tmp_path / str(per_node), workers=1, gpus_per_node=per_node, dashboard_port=free_port()
        )
        stop_local_cluster(tmp_path / str(per_node))
    assert [devices["CUDA_VISIBLE_DEVICES"] for devices in given] == ["0,1", "2,3", "5", "7"]
    for node in nodes:
        node.wait(timeout=30)
        node.stdout.close()


def test_a_failing_job_surfaces_its_error_and_a_nonzero_exit_and_its_id_stays_taken(submit, cluster):
    named = ("--submission-id", "mhf-failing-job")
    status, out, err = submit("--set", "train.steps=-1", options=named)
    assert status == 1
    assert "error: train.steps" in out  # mhf's own one-line error, streamed from the job's logs
    assert "FAILED" in err and "exit code 2" in err
    status, out, err = submit("--set", "train.steps=-1", options=named)  # nothing is submitted again
    assert (status, out) == (2, "") and err == (  # one line: refused before Ray's client uploads anything
        f"error: submission id 'mhf-failing-job' is taken on the cluster at {cluster.dashboard_url}; choose "
        "another --submission-id, or leave it out for Ray to pick one\n"
    )


def test_a_pretrain_job_succeeds_with_its_mlflow_run_and_metrics(submit, tmp_path, caplog):
    status, out, err = submit(*TINY_JOB)
    assert status == 0, err[-2000:]
    # Ray's job client packs and uploads the working directory without a word ("Uploading package ...")
    quiet = ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging")
    client_lines = [record for record in caplog.records if record.name in quiet]
    assert not client_lines, [record.getMessage() for record in client_lines]
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
