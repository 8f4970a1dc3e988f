"""A real multi-node Ray cluster on one machine: a head and N worker nodes, all on 127.0.0.1.

Each node is its own `ray start --block` process (raylet, object store, agents), so Ray Train, Ray Data
and the Jobs API see separate nodes. Every port is chosen free up front (two nodes on one host would
both take the agents' fixed defaults). Nodes are stopped by signalling those processes (Ray's reaper
then ends their children), never with `ray stop`, which would kill every Ray instance on the machine.
Token authentication is on, so only this user's processes can submit work to the open local ports.
The cluster is described by `<directory>/cluster.json`; node logs go to `<directory>/logs/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict, Field

from mhf_dist.errors import MhfError
from mhf_dist.files import write_json_atomic
from mhf_dist.interrupts import deferred, importing
from mhf_dist.readers import read_record
from mhf_dist.storage import reachable

STATE_FILE = "cluster.json"
HOST = "127.0.0.1"
TEMP_PREFIX = "mhf-ray-"  # the nodes' session directory, made by `start_local_cluster` (and removed by stop)
DEFAULT_DASHBOARD_PORT = 8265
# Nodes run with Ray's token authentication on; clients (mhf submit, ray job submit) need it set too.
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"


class ClusterError(MhfError):
    """The local cluster could not be started, found or stopped."""


class NodeExited(ClusterError):
    """A node's `ray start` process ended during start-up."""


class LocalCluster(BaseModel):
    """A cluster's `cluster.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    directory: str
    address: str  # the GCS address nodes and drivers join: 127.0.0.1:<port>
    dashboard_url: str  # the Jobs API and dashboard: http://127.0.0.1:<port>
    temp_dir: str = Field(pattern=rf"^/(.*/)?{TEMP_PREFIX}[^/]+$")  # the only directory a stop removes
    pids: list[int]  # the `ray start --block` processes, head first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _node_ports() -> list[str]:
    """The per-node ports that have fixed defaults, each set to a free one."""
    flags = (
        "--node-manager-port --object-manager-port --dashboard-agent-listen-port "
        "--dashboard-agent-grpc-port --runtime-env-agent-port --metrics-export-port"
    )
    return [arg for flag in flags.split() for arg in (flag, str(free_port()))]


def _ray_command() -> str:
    beside_python = Path(sys.executable).with_name("ray")
    return str(beside_python) if beside_python.exists() else "ray"


def auth_token() -> str:
    """The token of Ray's token authentication, generated on first use."""
    try:
        generated = subprocess.run(
            [_ray_command(), "get-auth-token", "--generate"], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise ClusterError("the `ray` command is not installed; pip install 'ray[default]'") from None
    if generated.returncode != 0 or not generated.stdout.strip():
        raise ClusterError(f"cannot get a Ray auth token: {generated.stderr.strip()[-200:]}")
    return generated.stdout.strip().splitlines()[-1]


def _ray_start(args: list[str], log: Path, devices: dict[str, str]) -> int:
    command = [_ray_command(), "start", "--block", "--disable-usage-stats", *args]
    env = {
        **os.environ,
        **devices,  # the node's own GPUs
        # Jobs' entrypoints (`mhf ...`) resolve on the nodes' PATH: this Python's environment first.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        AUTH_MODE_VARIABLE: "token",
        # No drain on SIGTERM: it exists for Serve replicas and would hold every stop for 30 s.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # Nodes sharing a few cores: prestarting a Python worker per CPU on every node for each job
        # slowed a tiny pretrain job from ~67 s to ~91 s here.
        "RAY_enable_worker_prestart": "0",
        "RAY_prestart_worker_first_driver": "0",
    }
    with log.open("w") as out:
        stdio = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
        return subprocess.Popen(command, **stdio, env=env, start_new_session=True).pid


def alive_nodes(dashboard_url: str, token: str) -> int:
    request = urllib.request.Request(
        f"{dashboard_url}/nodes?view=summary", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        summary = json.load(response)["data"]["summary"]
    return sum(1 for node in summary if node.get("raylet", {}).get("state") == "ALIVE")


def _wait_for_nodes(cluster: LocalCluster, expected: int, token: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    alive, last_error = 0, ""
    while time.monotonic() < deadline:
        if not all(map(_running, cluster.pids)):
            raise NodeExited(
                f"a Ray node process exited during start-up; see the logs in {cluster.directory}/logs"
            )
        try:
            alive = alive_nodes(cluster.dashboard_url, token)
            if alive >= expected:
                return
        except (OSError, ValueError, KeyError) as err:  # dashboard not up yet
            last_error = str(err)
        time.sleep(1)
    raise ClusterError(
        f"{alive} of {expected} Ray nodes came up in {timeout:.0f} s ({last_error or 'no error'}); "
        f"see the logs in {cluster.directory}/logs"
    )


def start_local_cluster(
    directory: str | Path,
    workers: int = 1,
    cpus_per_node: int = 2,
    gpus_per_node: int = 0,
    dashboard_port: int = DEFAULT_DASHBOARD_PORT,
    timeout: float = 120.0,
) -> LocalCluster:
    """Start a head and `workers` worker nodes; returns once all of them are alive."""
    directory = Path(directory).resolve()
    if (directory / STATE_FILE).exists():
        raise ClusterError(
            f"a local cluster is already recorded in {directory}; "
            f"stop it first (mhf cluster stop --dir {directory})"
        )
    devices = _gpu_slices(workers + 1, gpus_per_node)
    if reachable(f"tcp://{HOST}:{dashboard_port}"):
        raise ClusterError(f"port {dashboard_port} is in use; pass another --dashboard-port")
    token = auth_token()
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Unix socket paths must stay under ~107 bytes, so session files go to a short /tmp path; one per
    # node, or a worker's runtime-env agent garbage-collects the head's job working_dir as unused.
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    gcs_port = free_port()
    node = ["--node-ip-address", HOST, "--num-cpus", str(cpus_per_node), "--num-gpus", str(gpus_per_node)]
    head = ["--head", "--port", str(gcs_port), "--temp-dir", str(Path(temp_dir) / "head"), *node]
    head += ["--dashboard-host", HOST, "--dashboard-port", str(dashboard_port), *_node_ports()]
    address, dashboard_url = f"{HOST}:{gcs_port}", f"http://{HOST}:{dashboard_port}"
    cluster = LocalCluster(
        directory=str(directory), address=address, dashboard_url=dashboard_url, temp_dir=temp_dir, pids=[]
    )
    _write_state(cluster)  # from here on, whatever stops the start-up stops what it started
    try:
        cluster = _add_node(cluster, head, logs / "head.log", devices[0])
        _wait_for_nodes(cluster, 1, token, timeout)
        for index in range(workers):
            worker = ["--address", cluster.address, "--temp-dir", str(Path(temp_dir) / f"worker-{index}")]
            log = logs / f"worker-{index}.log"
            cluster = _add_worker(cluster, [*worker, *node], log, devices[index + 1], token, timeout)
    except BaseException:
        with deferred("while stopping the started nodes"):  # a second Ctrl-C waits for them
            stop_local_cluster(directory)
        raise
    return cluster


def _gpu_slices(nodes: int, per_node: int) -> list[dict[str, str]]:
    """Each node's CUDA_VISIBLE_DEVICES: its own `per_node` of this machine's GPUs (every node would
    otherwise hand out GPUs 0..per_node-1 to its workers, the same ones)."""
    if not per_node:
        return [{}] * nodes
    with importing():
        import torch

    visible, count = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()
    ids = (visible.split(",") if visible else [str(i) for i in range(count)])[:count]
    if nodes * per_node > len(ids):
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        fix = "lower --gpus-per-node or --workers" if ids else "leave --gpus-per-node out"
        raise ClusterError(
            f"--gpus-per-node {per_node} on {nodes} node(s) needs {nodes * per_node} GPUs, but this machine "
            f"has {len(ids)}{shown}; {fix}"
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * per_node : (i + 1) * per_node])} for i in range(nodes)]


def _add_node(cluster: LocalCluster, args: list[str], log: Path, devices: dict[str, str]) -> LocalCluster:
    """Start one node and record it (no interrupt in between, which would leave it unrecorded)."""
    with deferred("while starting a node"):
        cluster = cluster.model_copy(update={"pids": [*cluster.pids, _ray_start(args, log, devices)]})
        _write_state(cluster)
    return cluster


def _add_worker(
    cluster: LocalCluster,
    args: list[str],
    log: Path,
    devices: dict[str, str],
    token: str,
    timeout: float,
    retries: int = 1,
) -> LocalCluster:
    """Start a worker node and wait for it. Ray gives a node 30 s to register with the GCS, which a loaded
    host can miss: a worker that exits during start-up is started once more (its log `*.retry.log`)."""
    started = _add_node(cluster, [*args, *_node_ports()], log, devices)
    try:
        _wait_for_nodes(started, len(started.pids), token, timeout)
    except NodeExited:
        if not retries:
            raise
        with deferred("while removing a node that exited"):
            _signal_group(started.pids[-1], signal.SIGKILL)  # what it started
            _write_state(cluster)
        return _add_worker(cluster, args, log.with_suffix(".retry.log"), devices, token, timeout, retries - 1)
    return started


def _write_state(cluster: LocalCluster) -> None:
    write_json_atomic(Path(cluster.directory) / STATE_FILE, cluster.model_dump())


def _running(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0]:  # reaps it if it is our own exited child
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _node_of(cluster: LocalCluster, pid: int) -> bool:
    """Whether `pid` is still one of the cluster's `ray start` processes: a recorded PID may have been
    reused since (the nodes died, the machine restarted)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # a node of ours that exited: its group may live on
            return process.ppid() == os.getpid()
        return any(arg.startswith(f"{cluster.temp_dir}/") for arg in process.cmdline())  # --temp-dir's
    except psutil.Error:
        return False


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # each node was started in a session of its own: pgid == pid


def stop_local_cluster(directory: str | Path, timeout: float = 30.0) -> None:
    """Stop every node of the cluster in `directory` (workers first) and forget it."""
    path = Path(directory).resolve() / STATE_FILE
    if not path.exists():
        raise ClusterError(f"no local cluster is recorded in {path.parent}; start one with mhf cluster start")
    cluster = read_record(path, LocalCluster, ClusterError, "stop its nodes with `ray stop`, then remove it")
    nodes = [pid for pid in cluster.pids if _node_of(cluster, pid)]
    for pid in reversed(nodes):
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in nodes:  # what ignored SIGTERM, and anything left in the nodes' process groups
        _signal_group(pid, signal.SIGKILL)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    path.unlink()
