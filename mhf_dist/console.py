"""The console of a command that runs Ray: mhf's own lines; everything else in the logs unless --verbose.

Workers' output stays in Ray's log files (`ensure_ray`); the lines mhf wants shown travel through a
`ray.util.queue.Queue` that a driver thread prints, labelled by run in a sweep (`[mhf-seed0] step 20/200`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

POLL_S = 0.5  # how long the driver's thread waits for a line before it looks whether to stop
# The driver's loggers whose lines are not mhf's, and the level they keep unless --verbose.
QUIET_LOGGERS = {
    # Ray's note at every local start that a token in ~/.ray turned token authentication on
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
    # MLflow's "Creating initial MLflow database tables..." when a run's SQLite store is new
    "mlflow.store.db.utils": logging.WARNING,
    # Ray's job client, packing and uploading the working directory ("Ignoring upload ... .gitignore")
    "ray._private.runtime_env.packaging": logging.WARNING,
    "ray.dashboard.modules.dashboard_sdk": logging.WARNING,
}
# "0": Tune's legacy output, which prints nothing at RunConfig(verbose=0); the new one prints its
# experiment box and where the results are whatever the verbosity.
TUNE_OUTPUT_VARIABLE = "RAY_AIR_NEW_OUTPUT"


def clock(seconds: float) -> str:
    """Whole seconds as H:MM:SS (`0:01:10`), as progress lines show an eta or a duration."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def quiet_driver(verbose: bool) -> None:
    """The driver's libraries (Ray, Tune, MLflow) kept to their warnings; with `verbose`, to their levels."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else level)
    os.environ[TUNE_OUTPUT_VARIABLE] = "1" if verbose else "0"


@dataclass(frozen=True)
class WorkerLines:
    """A worker's (or Tune trial's) console line: printed to its Ray log file and queued for the driver."""

    queue: Any  # ray.util.queue.Queue
    label: str = ""  # the run's name in a sweep; empty for a single run

    def labelled(self, label: str) -> WorkerLines:
        return replace(self, label=label)

    def __call__(self, line: str) -> None:
        from ray.exceptions import RayError

        print(line, flush=True)
        with contextlib.suppress(RayError):  # a lost relay costs the console line, never the run
            self.queue.put(f"[{self.label}] {line}" if self.label else line)


def whole_line(line: str) -> None:
    """`print` in one write, so a line the main thread prints meanwhile cannot split text and newline."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


class ConsoleRelay:
    """Console lines from Ray workers (`lines` is their end), printed with `log` while entered and until the
    queue is empty when left. Its actor is not detached: an unused relay ends with the driver."""

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
