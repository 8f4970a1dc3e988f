"""Ray Data runs the driver's units: `ray.data.from_items(tasks)` mapped by a callable on Ray Data tasks,
at most one a CPU; a task takes one unit, or several consecutive small ones (`run_units`). A unit's
output has a fixed name of its own (its index), so nothing depends on which task ran it, on Ray Data's
blocks or on the number of CPUs.

Tasks, not an actor pool: an actor is a new process (0.7-2.2 s to start), paid again by every phase of
every prepare, where tasks run in Ray's workers that stay warm across phases and runs (0.03 s). What an
actor would hold, the callable caches per worker process (a parsed tokenizer) or receives from the
object store without a copy (a signature table).

The console shows one progress line of ours per phase; Ray Data's progress bars and log lines go to
Ray's session log unless `verbose`. A unit that fails stops the run with its one-line error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from mhf_dist.console import clock
from mhf_dist.data.corpus import bounded_ranges
from mhf_dist.data.prepare.records import Indexed
from mhf_dist.errors import MhfError

U = TypeVar("U", bound=Indexed)  # a unit of work
Out = TypeVar("Out", bound=BaseModel)  # what it gives
PROGRESS_EVERY_S = 10.0
RAY_DATA_LOGGER = "ray.data"


@dataclass(frozen=True)
class Done(Generic[Out]):
    """What one unit gave: its output, the tokens it handled, whether an earlier run had done it."""

    output: Out
    tokens: int
    resumed: bool


class UnitWork(Generic[U, Out]):
    """The work of one phase, as Ray Data's tasks call it: a row {"units": [unit as JSON, ...]} in, a row
    {"index", "output" (JSON), "tokens", "resumed"} per unit out. A subclass implements `run`."""

    unit: type[U]
    output: type[Out]
    outputs: str  # what its outputs are, for the line that says how many an earlier run had written

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows: dict[str, list[Any]] = {"index": [], "output": [], "tokens": [], "resumed": []}
        for text in (text for units in batch["units"] for text in units):
            unit = self.unit.model_validate_json(text)
            done = self.run(unit)  # each unit writes its own files and record: a stop loses only this one
            rows["index"].append(unit.index)
            rows["output"].append(done.output.model_dump_json())
            rows["tokens"].append(done.tokens)
            rows["resumed"].append(done.resumed)
        return rows

    def run(self, unit: U) -> Done[Out]:
        raise NotImplementedError


def run_units(
    phase: str,
    units: Sequence[U],
    work: UnitWork[U, Out],
    cpus: int,
    log: Callable[[str], None],
    verbose: bool,
    sizes: Sequence[int],
    task_size: int,
    keep: Callable[[Out], Any] = lambda output: output,
) -> list[Any]:
    """`work` on every unit, at most `cpus` tasks at a time; the outputs (`keep` of each, as it arrives),
    in unit order. A task takes consecutive units up to `task_size` of their `sizes` (a Ray
    Data task costs about 13 ms beyond its work here: 2,000 no-op units took 26 s one a task, 0.7 s 32
    a task), so only units smaller than that share one. `phase` names the work in the progress line."""
    import ray.data
    from ray.exceptions import RayTaskError

    if not units:
        return []
    results: list[Done[Any] | None] = [None] * len(units)
    tasks = [
        {"units": [unit.model_dump_json() for unit in units[first:end]]}
        for first, end in bounded_ranges(sizes, task_size)
    ]
    dataset = ray.data.from_items(tasks, override_num_blocks=len(tasks))
    pool = ray.data.TaskPoolStrategy(size=min(cpus, len(tasks)))
    dataset = dataset.map_batches(work, batch_size=1, compute=pool, num_cpus=1)
    progress = Progress(phase, len(units), log)
    try:
        with ray_data_settings(verbose, dataset):
            for row in dataset.iter_rows():
                output = keep(work.output.model_validate_json(row["output"]))
                done = Done(output, int(row["tokens"]), bool(row["resumed"]))
                results[int(row["index"])] = done
                progress.advance(done.tokens, done.resumed)
    except RayTaskError as err:  # ours (a bad corpus file, a store out of reach): as itself, in one line
        if isinstance(err.cause, MhfError):  # (Ray Data appends its retry advice to the message)
            raise type(err.cause)(str(err.cause).splitlines()[0]) from None
        raise
    log(progress.line())
    missing = [index for index, done in enumerate(results) if done is None]
    if missing:  # Ray Data lost a unit's output: never seen; a rerun resumes
        raise RuntimeError(f"{phase}: no output for unit {missing[0]} (of {len(missing)} missing)")
    if progress.resumed:
        log(f"resumed: {progress.resumed} of {len(units)} {work.outputs} were already written and checked")
    return [done.output for done in results if done is not None]


class Progress:
    """`tokenize parts: 12/40 | 1,234,567 tok/s | eta 0:00:21`, every PROGRESS_EVERY_S and at the end;
    units found done by an earlier run count as done but not in tok/s."""

    def __init__(self, phase: str, total: int, log: Callable[[str], None]) -> None:
        self.phase, self.total, self.log = phase, total, log
        self.done = self.resumed = self.tokens = 0
        self.start = self.last = time.monotonic()

    def advance(self, tokens: int, resumed: bool) -> None:
        self.done += 1
        self.resumed += resumed
        self.tokens += 0 if resumed else tokens
        if time.monotonic() - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self.last = time.monotonic()
            self.log(self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        worked = self.done - self.resumed
        left = self.total - self.done
        eta = elapsed / worked * left if worked else 0.0
        timing = f"eta {clock(eta)}" if left else f"took {clock(elapsed)}"
        return f"{self.phase}: {self.done}/{self.total} | {self.tokens / elapsed:,.0f} tok/s | {timing}"


SETTINGS = {
    "enable_progress_bars": lambda verbose: verbose,
    "raise_original_map_exception": lambda verbose: True,  # our one-line errors arrive as themselves
    "max_errored_blocks": lambda verbose: 0,
    # Reserving resources per operator is for pipelines of several operators; for one map it held 8
    # one-second units on 2 CPUs to 5.5-8 s where 4.1-4.6 s is the work (measured in a 2-CPU instance).
    "op_resource_reservation_enabled": lambda verbose: False,
}


_CONSOLE_LEVELS: dict[logging.Handler, int] = {}  # Ray Data's console handlers' own levels


@contextmanager
def ray_data_settings(verbose: bool, *datasets: Any, preserve_order: bool = False) -> Iterator[None]:
    """The process's DataContext and the `datasets`' own (often the same) set for mhf, then restored.
    Unless `verbose`, Ray Data's console log handler is silenced, and stays so after the block (its log
    file keeps everything): an executor that an interrupt stopped may log from its thread later."""
    from ray.data import DataContext
    from ray.data._internal.logging import SessionFileHandler

    contexts = list({id(c): c for c in (DataContext.get_current(), *(d.context for d in datasets))}.values())
    saved = [
        ({name: getattr(c, name) for name in SETTINGS}, c.execution_options.preserve_order) for c in contexts
    ]
    for handler in logging.getLogger(RAY_DATA_LOGGER).handlers:
        if not isinstance(handler, SessionFileHandler):
            level = _CONSOLE_LEVELS.setdefault(handler, handler.level)  # before mhf first silenced it
            handler.setLevel(level if verbose else logging.CRITICAL + 1)
    try:
        for context, (_, order) in zip(contexts, saved, strict=True):
            for name, value in SETTINGS.items():
                setattr(context, name, value(verbose))
            context.execution_options.preserve_order = preserve_order or order
        yield
    finally:
        for context, (values, order) in zip(contexts, saved, strict=True):
            for name, value in values.items():
                setattr(context, name, value)
            context.execution_options.preserve_order = order
