"""Fault injection for the crash tests: a step callback that tests hand to the workers through
`train(..., worker_callbacks=[...])` (or `run_sweep`); production workers never look for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle

from mhf_dist.train.callbacks import StepCallback

# Ray's workers cannot import this test module: send the class itself with the callback.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class KillLastWorker(StepCallback):
    """Kill the last worker's process after `step`, once, as a crashed node would. `marker`, a file in
    the run's storage, records that it happened and keeps the restarted worker group from failing
    again; with `run`, only that run (a sweep's trial) is hit."""

    step: int
    marker: Path
    run: str | None = None

    def on_step_end(self, metrics: dict[str, float]) -> None:
        import ray.train

        context = ray.train.get_context()
        if int(metrics["step"]) != self.step or context.get_world_rank() != context.get_world_size() - 1:
            return
        if (self.run is not None and context.get_experiment_name() != self.run) or self.marker.exists():
            return
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"the last worker was killed after step {self.step}\n")
        os._exit(1)


def train_process(settings: list[str], storage: Path, name: str) -> subprocess.Popen:
    """`mhf train --set S ... --storage STORAGE --name NAME` in a process of its own, to be signalled."""
    sets = [arg for item in settings for arg in ("--set", item)]
    command = [sys.executable, "-m", "mhf_dist.cli", "train", *sets, "--storage", str(storage)]
    command += ["--name", name]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def terminate_when(process: subprocess.Popen, ready: Callable[[], bool], seconds: float = 240) -> None:
    """SIGTERM `process` once `ready()` (polled), as a scheduler stopping it would; it must then end with
    143 and one last line `interrupted: SIGTERM...` on its stderr (a pipe)."""
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert process.poll() is None, "the command ended before it could be stopped: give it more work"
    assert ready(), f"the command did not reach the point to stop it at within {seconds} s"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted: SIGTERM"), stderr
