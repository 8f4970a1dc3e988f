"""The console of a command that runs Ray: mhf's own lines; everything else in the logs unless --verbose.

Unless `--verbose`, Ray does not forward its workers' output to the driver (`ensure_ray`): Ray's
core-worker messages and DeepSpeed's notices stay in Ray's log files, and `quiet_driver` keeps the
driver's libraries (Ray, Tune, MLflow) to their warnings. The lines mhf wants on the console (rank 0's
progress lines) travel instead through a `ray.util.queue.Queue` that a thread of the driver prints from,
each prefixed with its run's label in a sweep (`[mhf-seed0] step 20/200 | ...`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.5  # how long the driver's thread waits for a line before it looks whether to stop
# The driver's loggers whose lines are not mhf's, and the level they keep unless --verbose.
QUIET_LOGGERS = {
    # Ray's note at every local start that a token in ~/.ray turned token authentication on
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
    # MLflow's "Creating initial MLflow database tables..." when a run's SQLite store is new
    "mlflow.store.db.utils": logging.WARNING,
}
# "0": Tune's legacy output, which prints nothing at RunConfig(verbose=0); the new one prints its
# experiment box and where the results are whatever the verbosity.
TUNE_OUTPUT_VARIABLE = "RAY_AIR_NEW_OUTPUT"


def clock(seconds: float) -> str:
    """Whole seconds as H:MM:SS (`0:01:10`), as progress lines show an eta or a duration."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def quiet_driver(verbose: bool) -> None:
    """Keep the driver's libraries to their warnings and errors, or with `verbose` to their own levels."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else level)
    os.environ[TUNE_OUTPUT_VARIABLE] = "1" if verbose else "0"


@dataclass(frozen=True)
class WorkerLines:
    """What a worker (or a Tune trial) says a console line with: printed where it runs, which is its Ray
    log file, and queued for the driver's console."""

    queue: Any  # ray.util.queue.Queue
    label: str = ""  # the run's name in a sweep; empty for a single run

    def labelled(self, label: str) -> WorkerLines:
        return dataclasses.replace(self, label=label)

    def __call__(self, line: str) -> None:
        from ray.exceptions import RayError

        print(line, flush=True)
        with contextlib.suppress(RayError):  # a lost relay costs the console line, never the run
            self.queue.put(f"[{self.label}] {line}" if self.label else line)


def whole_line(line: str) -> None:
    """`print`, in one write: from the relay's thread, a line the main thread prints at the same moment
    cannot land between the text and its newline (print writes them apart)."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


class ConsoleRelay:
    """A queue of console lines from Ray workers (`lines` is their end), printed with `log` on the
    driver while the relay is entered; leaving it prints the lines still queued. The queue's actor is
    not detached: a relay never entered ends with its driver."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})  # no CPU slot taken from the workers
        self.lines = WorkerLines(self.queue)
        self.log = log or whole_line
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._print_lines, name="mhf-console", daemon=True)

    def __enter__(self) -> ConsoleRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        from ray.exceptions import RayError

        self._stopping.set()
        self._thread.join()
        with contextlib.suppress(RayError):  # Ray going down (an interrupt) takes the queue's actor along
            self.queue.shutdown(force=True)  # nothing is left in it: no grace period to wait out

    def _print_lines(self) -> None:
        from ray.exceptions import RayError
        from ray.util.queue import Empty

        while True:
            try:
                line = self.queue.get(timeout=POLL_S)
            except Empty:
                if self._stopping.is_set():
                    return
                continue
            except RayError:
                return
            self.log(line)
