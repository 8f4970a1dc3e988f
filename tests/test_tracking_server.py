"""MLflow as a service: a real `mlflow server` on 127.0.0.1 with its runs in PostgreSQL and its artifacts
proxied into a bucket of the S3 server (the set-up of cluster/README.md), a sweep of concurrent trials
logging through it, `mhf compare` reading it back; where the embedded store lives otherwise; and an
unreachable server as one line."""

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import servers
from conftest import RAY_INIT

from mhf_dist.config import load_config
from mhf_dist.storage import Location
from mhf_dist.tracking import tracking_uri

BYTES = {"data.tokenizer": "bytes", "model.vocab_size": 259, "model.hash.spec": "H2B64", "train.seq_len": 32}
STEPS = 4
TRIALS = 4


def test_bucket_storage_keeps_the_embedded_store_in_the_working_directorys_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking_uri("s3://some-bucket/train") == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert tracking_uri("local/train") == f"sqlite:///{tmp_path / 'local' / 'train' / 'mlflow.db'}"
    assert not list(tmp_path.iterdir())  # a URI only: a refused command leaves no folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert tracking_uri("s3://some-bucket/train") == "http://mlflow.internal:5000"


def test_an_embedded_store_is_refused_for_a_ray_cluster_of_several_machines():
    """Rank 0 logs from wherever it runs: a SQLite file on the driver's machine is out of its reach."""
    from mhf_dist.errors import TrainingError
    from mhf_dist.train.ray_trainer import _check_tracking_reaches_workers

    nodes = [{"NodeManagerAddress": host, "Alive": True} for host in ("10.0.0.1", "10.0.0.2")]
    with pytest.raises(
        TrainingError, match=r"spans 2 machines; set MLFLOW_TRACKING_URI to a tracking server"
    ):
        _check_tracking_reaches_workers("sqlite:////tmp/mlflow.db", nodes)
    _check_tracking_reaches_workers("http://127.0.0.1:5000", nodes)  # a server: any machine reaches it
    _check_tracking_reaches_workers("sqlite:////tmp/mlflow.db", [nodes[0], {**nodes[1], "Alive": False}])


def test_a_run_refuses_another_programs_sqlite_file_before_any_work(tmp_path, monkeypatch):
    """MLflow would add its tables to any SQLite file: a run refuses one without them before Ray starts,
    leaving it and --storage as they were. A relative sqlite URI is read from the working directory."""
    import sqlite3

    from mhf_dist.cpt import run_cpt
    from mhf_dist.data.prepare import prepare
    from mhf_dist.tracking import TrackingError, connect, require_store
    from mhf_dist.train.ray_trainer import TrainOptions, train

    monkeypatch.chdir(tmp_path)
    recall = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32"]
    prepare(load_config("tiny", recall), tmp_path / "data", log=lambda _: None)
    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("CREATE TABLE notes (text)")
    cfg = load_config(
        "tiny", [*recall, f"data.path={tmp_path / 'data'}", f"topology.storage={tmp_path / 'runs'}"]
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///other.db")
    with pytest.raises(
        TrackingError,
        match=rf"^'{tmp_path}/other.db' \(MLFLOW_TRACKING_URI\) is not an MLflow store \(it has no MLflow "
        r"tables\); fix MLFLOW_TRACKING_URI",
    ):
        train(cfg, TrainOptions(name="refused"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "other.db"]
    with sqlite3.connect(tmp_path / "other.db") as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "runs").mkdir()
    shutil.copy(tmp_path / "other.db", tmp_path / "runs" / "mlflow.db")  # the embedded store's place
    with pytest.raises(
        TrackingError, match=r"runs/mlflow.db' is not an MLflow store .*; move it away or set"
    ):
        train(cfg, TrainOptions(name="refused"))
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["mlflow.db"]
    with pytest.raises(TrackingError, match="is not an MLflow store"):  # cpt's, before its prepare
        text = load_config("tiny", [f"topology.storage={tmp_path / 'runs'}"])  # cpt continues on text
        run_cpt(text, "no-such-model", lambda tokenizer: tokenizer, TrainOptions(name="cpt"))
    # A relative URI is the working directory's, for the workers too (they run in folders of their own).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///store/mlflow.db")
    assert tracking_uri("anywhere") == f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    connect(tracking_uri("anywhere")).search_experiments()
    require_store("sqlite:///store/mlflow.db")


def test_an_unreachable_tracking_server_is_one_line_and_exit_2_within_30_s(tmp_path):
    closed = f"http://127.0.0.1:{servers.free_port()}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": closed}
    mhf = Path(sys.executable).parent / "mhf"
    start = time.monotonic()
    done = subprocess.run(
        [mhf, "compare", "--experiment", "anything", "--out", tmp_path / "report"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert (done.returncode, done.stderr.splitlines()) == (
        2,
        [
            f"error: cannot use MLflow tracking at '{closed}' (MLFLOW_TRACKING_URI): connection refused; "
            "start the server (cluster/README.md), fix MLFLOW_TRACKING_URI, or unset it for the "
            "embedded store"
        ],
    )
    assert elapsed < 30, elapsed
    assert not (tmp_path / "report").exists()


def test_a_commands_bounded_retries_belong_to_its_client_not_to_the_process(monkeypatch):
    """`connect`'s client gives up on a closed port within seconds; a client made after it in the same
    process (a second run's, rank 0's logger) still has MLflow's own retries, and a user's value wins."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT
    from mlflow.exceptions import MlflowException

    from mhf_dist.tracking import connect

    for variable in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(variable, raising=False)
    defaults = MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()
    closed = f"http://127.0.0.1:{servers.free_port()}"
    start = time.monotonic()
    with pytest.raises(MlflowException):
        connect(closed).get_experiment_by_name("anything")
    assert time.monotonic() - start < 30
    assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == defaults
    assert defaults[0] > 1  # MLflow's own: more than the one retry a command allows itself
    seen = []
    client = connect(closed)
    monkeypatch.setattr(type(client._client), "get_run", lambda self, run_id: seen.append(
        (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())))  # fmt: skip
    client.get_run("any")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    client.get_run("any")
    assert seen == [(1, 10), (3, 10)]
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 3 and MLFLOW_HTTP_REQUEST_TIMEOUT.get() == defaults[1]


@pytest.fixture
def answering(request):
    """A server on 127.0.0.1 that answers each request as `request.param` says: "500" (an error status),
    "silent" (accepts, never answers), "hang-up" (accepts and closes); its URL."""
    import http.server
    import socket
    import threading

    class Errors(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    if request.param == "500":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Errors)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        return
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def hang_up():
        while not stop.is_set():
            connection, _ = listener.accept()
            connection.close()

    if request.param == "hang-up":
        threading.Thread(target=hang_up, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()


@pytest.mark.parametrize(
    ("answering", "reason"),
    [
        ("500", "the server answers with errors (see its log)"),
        ("silent", "no answer in time"),
        ("hang-up", "no connection"),
    ],
    indirect=["answering"],
)
def test_why_a_tracking_server_gives_no_answer_is_named_from_the_errors_types(answering, reason, monkeypatch):
    """MLflow's exception is raised from requests', from urllib3's, from the socket's: their types name
    the reason (a closed port's "connection refused" is the one-line test's above)."""
    from mhf_dist.tracking import TrackingError, find_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    for uri, why in [(answering, reason), ("http://no-such-host.invalid:5000", "unknown host")]:
        with pytest.raises(TrackingError) as raised:
            find_run(uri, "0" * 32)
        assert f": {why}; check the embedded store" in str(raised.value), raised.value


@pytest.fixture
def mlflow_server(postgres_url, bucket, tmp_path):
    """The tracking server of cluster/README.md on 127.0.0.1: runs in a new PostgreSQL database,
    artifacts proxied into `<bucket>/mlflow`."""
    server = servers.MlflowServer(
        servers.new_database(postgres_url), f"{bucket}/mlflow", tmp_path / "mlflow-server.log"
    )
    yield server
    server.stop()


@pytest.fixture
def tracking_server(mlflow_server):
    """The tracking server's URL."""
    return mlflow_server.url


@pytest.fixture
def ray_for_four_trials(ray_session):
    """Four trials at once need 4 x (1 worker + 0.25 for the trial's own process) = 5 logical CPUs; the
    session's instance has 4. A 5-CPU instance for this test, the session's again after."""
    ray_session.shutdown()
    ray_session.init(**{**RAY_INIT, "num_cpus": 5})
    yield
    ray_session.shutdown()
    ray_session.init(**RAY_INIT)


def test_a_sweep_of_four_concurrent_trials_logs_through_the_server_and_compare_reads_it_back(
    ray_for_four_trials, tracking_server, bucket, tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient

    from mhf_dist.cli import main
    from mhf_dist.data.prepare import prepare
    from mhf_dist.sweep.runner import run_sweep
    from mhf_dist.sweep.spec import parse_sweep

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    monkeypatch.chdir(tmp_path)
    prepare(load_config("tiny", BYTES), "data", log=lambda _: None)
    settings = {
        **BYTES,
        "data.path": "data",
        "train.steps": STEPS,
        "train.log_every": 1,
        "train.eval_rows": 8,
    }
    spec = parse_sweep(
        {
            "name": "served",
            "kind": "seeds",
            "seeds": list(range(TRIALS)),
            "set": {**settings, "topology.workers": 1},
            "storage": "sweeps",
            "max_concurrent": TRIALS,
        }
    )
    result = run_sweep(spec, log=lambda _: None)
    assert result.tracking_uri == tracking_server

    client = MlflowClient(tracking_uri=tracking_server)
    experiment = client.get_experiment_by_name(spec.experiment)
    children = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
    )
    assert len(children) == TRIALS and {run.info.status for run in children} == {"FINISHED"}
    # Concurrent: every trial's run started before any of them ended.
    assert max(run.info.start_time for run in children) < min(run.info.end_time for run in children)
    finals = []
    for run in children:
        for key in run.data.metrics:  # no metric at any step twice; the loss at every step
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert len(steps) == len(set(steps)), (key, steps)
        loss = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
        assert [m.step for m in loss] == list(range(1, STEPS + 1))
        finals.append(loss[-1].value)
        assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied: clients hold no keys

    stored = {name for name, _ in Location.of(f"{bucket}/mlflow").files()}
    for run in children:  # each trial's run.json and exported model, in the bucket
        artifacts = f"{experiment.experiment_id}/{run.info.run_id}/artifacts"
        assert f"{artifacts}/run.json" in stored
        assert any(name.startswith(f"{artifacts}/model/") for name in stored)

    report = f"{bucket}/report"
    argv = ["compare", "--experiment", spec.experiment, "--sweep", result.parent_run_id, "--metric", "loss"]
    assert main([*argv, "--out", report]) == 0
    table_row = rf"^\| mhf +\| mhf +\| coordinates +\| {TRIALS} +\|"
    assert re.search(table_row, capsys.readouterr().out, re.MULTILINE)
    header, row = (Location.of(report) / "compare.csv").read_text().splitlines()
    mean = dict(zip(header.split(","), row.split(","), strict=True))["mean"]
    assert float(mean) == pytest.approx(statistics.fmean(finals), rel=1e-9)
    parent = f"{experiment.experiment_id}/{result.parent_run_id}/artifacts"
    stored = {name for name, _ in Location.of(f"{bucket}/mlflow").files()}
    assert {f"{parent}/compare.md", f"{parent}/curves.png"} <= stored  # logged to the sweep's parent
    assert "cv.mhf" in client.get_run(result.parent_run_id).data.tags


def test_a_tracking_server_down_mid_sweep_loses_no_step_and_logs_none_twice(
    ray_session, mlflow_server, tmp_path, monkeypatch, capsys
):
    """The server stopped for 10 s while two trials train, then started again on the same port: rank 0's
    logging waits it out (MLflow's own retries), both trials finish, every step's metrics are in MLflow
    exactly once with the values the trials' histories hold, and `mhf compare` reads the table those give."""
    import threading

    from mlflow.tracking import MlflowClient

    from mhf_dist.cli import main
    from mhf_dist.data.prepare import prepare
    from mhf_dist.sweep.runner import TRIALS_DIR, run_sweep
    from mhf_dist.sweep.spec import parse_sweep
    from mhf_dist.train.checkpoints import newest_checkpoint, read_history

    steps = 40
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.chdir(tmp_path)
    prepare(load_config("tiny", BYTES), "data", log=lambda _: None)
    settings = {
        **BYTES,
        "data.path": "data",
        "train.steps": steps,
        "train.log_every": 1,
        "train.eval_rows": 8,
    }
    spec = parse_sweep(
        {"name": "outage", "kind": "seeds", "seeds": [0, 1], "set": {**settings, "topology.workers": 1},
         "storage": "sweeps", "max_concurrent": 2}
    )  # fmt: skip
    client = MlflowClient(tracking_uri=mlflow_server.url)
    outage: list[float] = []

    def trained_to(step: int) -> bool:
        experiment = client.get_experiment_by_name(spec.experiment)
        runs = (
            []
            if experiment is None
            else client.search_runs([experiment.experiment_id], "tags.family = 'mhf'")
        )
        return len(runs) == 2 and all(
            any(m.step >= step for m in client.get_metric_history(run.info.run_id, "loss")) for run in runs
        )

    def stop_mid_training() -> None:
        """Once both trials have logged step 5, the server goes away for 10 s."""
        while not trained_to(5):
            time.sleep(0.2)
        mlflow_server.stop()
        outage.append(time.time())
        time.sleep(10)
        mlflow_server.start()
        outage.append(time.time())

    saboteur = threading.Thread(target=stop_mid_training, daemon=True)
    saboteur.start()
    result = run_sweep(spec, log=lambda _: None)
    saboteur.join(timeout=300)
    assert len(outage) == 2, "the server was never stopped mid-sweep"

    experiment = client.get_experiment_by_name(spec.experiment)
    children = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
    )
    assert len(children) == 2 and {run.info.status for run in children} == {"FINISHED"}
    assert min(run.info.end_time for run in children) / 1000 > outage[1]  # both trained through it
    finals = []
    for run in children:
        history = read_history(
            newest_checkpoint(tmp_path / "sweeps" / "outage" / TRIALS_DIR / run.info.run_name)
        )
        for key in run.data.metrics:
            steps_logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert len(steps_logged) == len(set(steps_logged)), (key, steps_logged)  # never twice
        loss = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in loss] == [
            (int(h["step"]), h["loss"]) for h in history
        ]  # none lost
        assert len(loss) == steps
        finals.append(history[-1]["loss"])
    argv = ["compare", "--experiment", spec.experiment, "--sweep", result.parent_run_id, "--metric", "loss"]
    assert main([*argv, "--out", str(tmp_path / "report")]) == 0
    header, row = (tmp_path / "report" / "compare.csv").read_text().splitlines()
    assert float(dict(zip(header.split(","), row.split(","), strict=True))["mean"]) == pytest.approx(
        statistics.fmean(finals), rel=1e-9
    )
