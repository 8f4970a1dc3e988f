"""SIGINT and SIGTERM at any moment of a command: one line `interrupted: ...`, exit 130 or 143."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from faults import train_process

from mhf_dist import cli, local_cluster
from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.errors import Interrupted, Resumable, console_line, stopped
from mhf_dist.interrupts import deferred
from mhf_dist.tracking import tracking_errors

BYTES = ["data.tokenizer=bytes", "model.vocab_size=259", "model.hash.spec=H2B64", "train.seq_len=32"]


def test_a_signal_in_a_deferred_block_stops_the_command_once_the_block_has_ended():
    done = []

    def terminated(signum, frame):
        raise Interrupted("SIGTERM", 143)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with pytest.raises(Interrupted), deferred("while testing"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # time for the signal to arrive
            done.append("the block ran to its end")
        assert done == ["the block ran to its end"]
        assert signal.getsignal(signal.SIGTERM) is terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def mhf_count_running(count: str, preexec_fn=None) -> subprocess.CompletedProcess:
    """`mhf count` through the console script's entry point, with `count(args)` (Python source, which
    may use os, signal, sys, threading, time and `stopped`) as its command."""
    code = f"""
import os, signal, sys, threading, time
from mhf_dist import cli, launch
from mhf_dist.interrupts import stopped
{count}
cli.cmd_count = count
sys.argv = ["mhf", "count"]
sys.exit(launch.mhf())
"""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=preexec_fn
    )


def test_a_command_started_with_sigterm_ignored_keeps_ignoring_it():
    ignoring = lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)  # noqa: E731
    count = "def count(args):\n    os.kill(os.getpid(), signal.SIGTERM)\n    print('went on')\n"
    done = mhf_count_running(count, preexec_fn=ignoring)
    assert (done.returncode, done.stdout, done.stderr) == (0, "went on\n", "")
    # mhf-lm-eval keeps the same rule: its evaluation, sent SIGTERM, goes on
    code = (
        "import os, signal\nfrom mhf_dist.eval import harness\n"
        "def evaluate():\n    os.kill(os.getpid(), signal.SIGTERM)\n    print('went on')\n"
        "harness._evaluate = evaluate\nharness.cli()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=ignoring)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "went on\n", "")


def test_a_signal_the_process_ignores_stays_ignored_in_a_deferred_block():
    """A shell's background job (SIGINT ignored): the held signal must not stop it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred("while testing"):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # a second one neither: it would end the process
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


NESTED_BLOCKS = """
import os, signal, time
from mhf_dist.interrupts import deferred

try:
    with deferred("while importing deepspeed"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        with deferred("while importing torch"):  # deepspeed's import imports torch
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
            print("the inner block ran to its end")
        raise ImportError("a failed import")
except ImportError:
    print("the held signal was lost with the failed import")
"""


@pytest.mark.parametrize("second", [True, False])
def test_a_held_signal_is_delivered_once_and_a_second_ends_the_process_in_a_nested_block(second):
    code = (
        NESTED_BLOCKS
        if second
        else NESTED_BLOCKS.replace("os.kill(os.getpid(), signal.SIGINT)\n            ", "")
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if second:
        assert (done.returncode, done.stdout, done.stderr) == (
            130,
            "",
            "interrupted: SIGINT; stopped while importing deepspeed\n",
        )
    else:  # the block's own exception does not swallow the interrupt: KeyboardInterrupt, from it
        assert done.returncode == -signal.SIGINT and done.stdout == "the inner block ran to its end\n"
        assert "ImportError: a failed import" in done.stderr and done.stderr.rstrip().endswith(
            "KeyboardInterrupt"
        )


IMPORTING_TORCH = """
from mhf_dist import interrupts

def count(args):
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with interrupts.importing():  # as every command imports what loads torch
            import torch
    finally:
        print("torch._native" in sys.modules, file=sys.stderr)  # the last module torch's import imports
"""


def test_a_ctrl_c_while_a_command_imports_torch_comes_once_the_import_has_finished():
    """A Ctrl-C inside torch's import, where its C++ calls back into Python, aborts the process now and
    then (pybind11's `terminate`): a command's imports hold it until they have finished."""
    done = mhf_count_running(IMPORTING_TORCH)
    assert (done.returncode, done.stderr) == (
        130,
        "True\ninterrupted: SIGINT; rerun the command to start again\n",
    )


def test_ctrl_c_in_any_command_is_one_interrupted_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_count", interrupted)
    assert main(["count"]) == 130
    assert capsys.readouterr().err == "interrupted: SIGINT; rerun the command to start again\n"


SWALLOWING_COUNT = """
class Swallowed:  # C code that can only hand an exception to sys.unraisablehook, as a Cython start-up
    def __del__(self):
        raise {interrupt}

def count(args):
    Swallowed()
    time.sleep(10)
    print("the command went on after its interrupt", file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("interrupt", "exit_code", "line"),
    [("KeyboardInterrupt", 130, "SIGINT"), ("stopped(signal.SIGTERM)", 143, "SIGTERM")],
)
def test_an_interrupt_that_c_code_swallowed_still_stops_the_command_in_one_line(interrupt, exit_code, line):
    done = mhf_count_running(SWALLOWING_COUNT.format(interrupt=interrupt))
    assert (done.returncode, done.stderr) == (
        exit_code,
        f"interrupted: {line}; rerun the command to start again\n",
    )


def test_a_clean_up_that_fails_while_an_interrupt_is_handled_is_shown_not_sent_again():
    code = (
        "from mhf_dist import interrupts\n"
        "interrupts.delivered_again_when_swallowed()\n"
        "class Failing:\n"
        "    def __del__(self):\n"
        "        raise OSError('a finalizer failed')\n"
        "try:\n"
        "    raise KeyboardInterrupt\n"
        "except KeyboardInterrupt:\n"
        "    Failing()\n"
        "import time; time.sleep(0.5); print('clean-up done')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "clean-up done\n")
    assert "OSError: a finalizer failed" in done.stderr


def test_a_sigterm_inside_code_that_catches_exception_is_not_taken_for_that_codes_error(tmp_path):
    # tracking_errors turns any Exception of an MLflow request into a one-line TrackingError.
    with pytest.raises(Interrupted, match="SIGTERM"), tracking_errors(f"sqlite:///{tmp_path}/mlflow.db"):
        raise stopped(signal.SIGTERM)


def test_a_resumable_interrupt_names_the_command_that_goes_on_with_its_flag_once():
    stop = Resumable("SIGTERM; trials kept", 143, "--resume")
    assert console_line(stop, ["sweep", "--config", "my sweep.yaml"]) == (
        "SIGTERM; trials kept; go on with: mhf sweep --config 'my sweep.yaml' --resume"
    )
    assert console_line(stop, ["sweep", "--config", "s.yaml", "--resume"]).endswith(
        "mhf sweep --config s.yaml --resume"
    )
    rerun = Resumable("SIGINT; no resume", 130, "", lead="rerun")
    assert console_line(rerun, ["demo", "--workdir", "w"]) == "SIGINT; no resume; rerun: mhf demo --workdir w"


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), Interrupted("SIGTERM; rerun the command", 143)])
def test_an_interrupted_submit_wait_says_the_job_goes_on_and_how_to_follow_or_stop_it(
    stop, monkeypatch, capsys
):
    import mhf_dist.submit as submit

    def follow(client, job_id, write):
        raise stop

    monkeypatch.setattr(submit, "submit_job", lambda *args: (None, "job-7"))
    monkeypatch.setattr(submit, "follow_job", follow)
    code = 130 if isinstance(stop, KeyboardInterrupt) else 143
    assert main(["submit", "jobs/pretrain.job.yaml", "--address", "http://h:8265", "--wait"]) == code
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"interrupted: {signal.Signals(code - 128).name}; job job-7 goes on; follow it with `ray job logs "
        "--address http://h:8265 --follow job-7`, stop it with `ray job stop --address http://h:8265 job-7`"
    )


@pytest.mark.parametrize("moment", ["recording the head", "waiting for the nodes"])
def test_an_interrupted_cluster_start_leaves_no_node_running(moment, tmp_path, monkeypatch):
    started = []
    write_state = local_cluster._write_state

    def start_node(args, log, devices):
        # a stand-in node: a process in a session of its own, as Ray's are, with its arguments (a stop
        # signals only a process whose --temp-dir is the cluster's)
        process = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", *args], start_new_session=True
        )
        started.append(process)
        return process.pid

    def record(cluster):
        if cluster.pids and moment == "recording the head":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between a node's start and its record
            time.sleep(0.1)
        write_state(cluster)

    def wait(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(local_cluster, "auth_token", lambda: "token")
    monkeypatch.setattr(local_cluster, "_ray_start", start_node)
    monkeypatch.setattr(local_cluster, "_write_state", record)
    monkeypatch.setattr(local_cluster, "_wait_for_nodes", wait)
    with pytest.raises(KeyboardInterrupt):
        local_cluster.start_local_cluster(tmp_path / "cluster", dashboard_port=local_cluster.free_port())
    assert len(started) == 1
    started[0].wait(timeout=30)  # the head was stopped
    assert not (tmp_path / "cluster" / local_cluster.STATE_FILE).exists()


def test_a_worker_node_that_exits_during_start_up_is_started_once_more(tmp_path, monkeypatch):
    """Ray gives a node 30 s to register with the GCS, which a loaded host can miss: that worker's `ray start`
    exits, and the cluster starts it again rather than failing."""
    started, logs = [], []

    def start_node(args, log, devices):  # stand-in nodes; the first worker exits at once
        exits = "--address" in args and not any("--address" in process.args for process in started)
        code = "pass" if exits else "import time; time.sleep(60)"
        process = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
        started.append(process)
        logs.append(log.name)
        if exits:
            process.wait()
        return process.pid

    monkeypatch.setattr(local_cluster, "auth_token", lambda: "token")
    monkeypatch.setattr(local_cluster, "_ray_start", start_node)
    monkeypatch.setattr(local_cluster, "alive_nodes", lambda *_: sum(p.poll() is None for p in started))
    directory = tmp_path / "cluster"
    cluster = local_cluster.start_local_cluster(
        directory, workers=1, dashboard_port=local_cluster.free_port()
    )
    head, exited, worker = started
    assert exited.returncode == 0 and cluster.pids == [head.pid, worker.pid]
    assert logs == ["head.log", "worker-0.log", "worker-0.retry.log"]  # the first try's log is kept
    local_cluster.stop_local_cluster(directory)
    head.wait(timeout=30)  # both stopped (the stop reaps them: no exit status is left to check)
    worker.wait(timeout=30)


def _children(pid):
    import psutil

    try:
        return [child.name() for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _one_interrupted_line(process, sig):
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("interrupted")]
    assert stderr.strip().splitlines()[-1] == line and line.startswith(f"interrupted: {sig.name}")
    return line


@pytest.fixture(scope="module")
def byte_shards(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("interrupts") / "data"
    prepare(load_config("tiny", BYTES), path, log=lambda _: None)
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_ray_start_up_stops_train_with_one_line(sig, byte_shards, tmp_path):
    """Sent once Ray's raylet exists, i.e. inside ray.init: before, SIGINT could abort the process
    inside Ray's C++ start-up and SIGTERM ended it through Ray's own handler (exit 15, no line)."""
    process = train_process([*BYTES, f"data.path={byte_shards}", "train.steps=5"], tmp_path, "t")
    deadline = time.monotonic() + 120
    while process.poll() is None and "raylet" not in _children(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "train ended before Ray started" + process.stderr.read()
    process.send_signal(sig)
    _one_interrupted_line(process, sig)


def test_sigterm_mid_sweep_names_the_resume_command_and_keeps_keep_checkpoints(byte_shards, tmp_path):
    """Tune stops the trial gracefully; its directory keeps train.keep_checkpoints (Tune kills a
    trial before Ray Train prunes), and Tune's own restore hint stays off the console."""
    (tmp_path / "s.yaml").write_text(
        "name: cut\nkind: grid\nconfig: tiny\nseeds: [0]\ngrid: {train.lr: [0.003]}\nstorage: sweeps\n"
        f"set: {{{', '.join(item.replace('=', ': ') for item in BYTES)}, data.path: {byte_shards}, "
        "train.steps: 2000, train.checkpoint_every: 1, train.keep_checkpoints: 2, topology.workers: 1}\n"
    )
    command = [sys.executable, "-m", "mhf_dist.cli", "sweep", "--config", "s.yaml"]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    trial = tmp_path / "sweeps" / "cut" / "trials" / "train.lr=0.003-seed0"
    deadline = time.monotonic() + 240
    while process.poll() is None and len(glob.glob(f"{trial}/checkpoint-*/run.json")) < 3:
        assert time.monotonic() < deadline, "the trial wrote no checkpoints"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("interrupted: SIGTERM") and line.endswith(
        "go on with: mhf sweep --config s.yaml --resume"
    )
    assert "Tuner.restore" not in stdout + stderr
    assert 1 <= len(list(trial.glob("checkpoint-*"))) <= 2
    from mhf_dist.tracking import connect, tracking_uri

    client = connect(tracking_uri(tmp_path / "sweeps"))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(run.info.status for run in runs) == ["KILLED", "KILLED"]  # the sweep and its trial
