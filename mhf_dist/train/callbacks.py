"""Step callbacks: what happens around the optimizer steps, one small class per concern.

`run_training` calls every callback's `on_step_end(metrics)` after each step, in list order; a callback
may add to `metrics` for the ones after it. What needs the workers (an all-reduce, a checkpoint save) is
handed in as a function, so each class can be tested alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from mhf_dist.config import TrainConfig
from mhf_dist.console import clock
from mhf_dist.files import write_json_atomic
from mhf_dist.storage import Location
from mhf_dist.tracking import log_steps

Metrics = dict[str, float]
LOGGED_FILE = "mlflow-logged.json"  # in the run directory: the last step logged to its MLflow run


class StepCallback:
    """What `run_training` calls after every step."""

    def on_step_end(self, metrics: Metrics) -> None:
        """After step `metrics["step"]`; may add entries to `metrics`."""


def due(step: int, last_step: int, *every: int) -> bool:
    """Whether a callback acts at `step`: at this run's last step and every `every` steps, for each
    interval given (0: never). The one place the cadence lives: validation every `train.eval_every`,
    logging every `train.log_every`, checkpoints every `train.checkpoint_every`, each also at the last step.
    """
    return step == last_step or any(n and step % n == 0 for n in every)


def format_progress(metrics: Metrics, steps: int) -> str:
    """`step 20/200 | loss 3.2100 | lr 2.90e-03 | 12,345 tok/s | MFU 41.0% | val ppl 35.2 | eta 0:01:10`."""
    parts = [
        f"step {int(metrics['step'])}/{steps}",
        f"loss {metrics['loss']:.4f}",
        f"lr {metrics['lr']:.2e}",
        f"{metrics['tokens_per_s']:,.0f} tok/s",
    ]
    if "mfu" in metrics:
        parts.append(f"MFU {metrics['mfu']:.1%}")
    if "val_ppl" in metrics:
        parts.append(f"val ppl {metrics['val_ppl']:.2f}")
    parts.append(f"eta {clock(metrics.get('eta_s', 0))}")
    return " | ".join(parts)


@dataclass
class Validation(StepCallback):
    """`validate()`'s metrics (exact validation NLL) every `every` steps and at the last step."""

    validate: Callable[[], Metrics]
    every: int
    last_step: int

    def on_step_end(self, metrics: Metrics) -> None:
        if due(int(metrics["step"]), self.last_step, self.every):
            metrics.update(self.validate())


@dataclass
class MemoryMetrics(StepCallback):
    """`model_state()` once, after the run's first step (the optimizer states exist from then on), and
    `peak_memory()` at every log step and the last."""

    model_state: Callable[[], Metrics]
    peak_memory: Callable[[], Metrics]
    first_step: int
    last_step: int
    cfg: TrainConfig

    def on_step_end(self, metrics: Metrics) -> None:
        step = int(metrics["step"])
        if step == self.first_step:
            metrics.update(self.model_state())
        if due(step, self.last_step, self.cfg.log_every):
            metrics.update(self.peak_memory())


@dataclass
class History(StepCallback):
    """Every step's metrics of the whole run: a resumed run's history continued (`entries[i]` is step
    i + 1); what checkpoints store and MLflow is fed from."""

    entries: list[Metrics] = field(default_factory=list)

    def on_step_end(self, metrics: Metrics) -> None:
        self.entries.append(metrics)


@dataclass
class SourceTokens(StepCallback):
    """Training tokens seen from each source of a mixture, cumulative: `tokens_seen.<name>` at every log
    and checkpoint step. `pending()` is this worker's counts since the last call, `total(counts)` their
    sum over the workers (an all-reduce: every rank runs this); a resumed run continues its history's."""

    names: list[str]
    pending: Callable[[], list[int]]
    total: Callable[[list[int]], list[int]]
    history: list[Metrics]
    last_step: int
    cfg: TrainConfig

    def __post_init__(self) -> None:
        self.keys = [f"tokens_seen.{name}" for name in self.names]
        counted = [entry for entry in self.history if self.keys[0] in entry]
        self.seen = [int(counted[-1][key]) for key in self.keys] if counted else [0] * len(self.keys)

    def on_step_end(self, metrics: Metrics) -> None:
        if due(int(metrics["step"]), self.last_step, self.cfg.log_every, self.cfg.checkpoint_every):
            self.seen = [a + b for a, b in zip(self.seen, self.total(self.pending()), strict=True)]
            metrics.update(zip(self.keys, map(float, self.seen), strict=True))


@dataclass
class ProgressLines(StepCallback):
    """One `format_progress` line every `train.log_every` steps and at the last of `train.steps`."""

    cfg: TrainConfig
    log: Callable[[str], None] = print

    def on_step_end(self, metrics: Metrics) -> None:
        if due(int(metrics["step"]), self.cfg.steps, self.cfg.log_every):
            self.log(format_progress(metrics, self.cfg.steps))


@dataclass
class MLflowSteps(StepCallback):
    """The run's metrics to MLflow at every log step and checkpoint, each step exactly once.

    Training is deterministic, so the steps a restarted run recomputes were logged with the same values
    before: the last step logged is kept in the run directory (`LOGGED_FILE`) and not logged again.
    """

    uri: str
    run_id: str
    run_dir: Location | str
    history: History
    start_step: int
    last_step: int
    cfg: TrainConfig

    def __post_init__(self) -> None:
        self.record = Location.of(self.run_dir) / LOGGED_FILE
        logged = json.loads(self.record.read_text()) if self.record.exists() else {}
        same_run = logged.get("run_id") == self.run_id
        self.logged = max(self.start_step, logged.get("step", 0) if same_run else 0)
        self.seen = self.start_step  # history.entries[:seen] were looked at before

    def on_step_end(self, metrics: Metrics) -> None:
        if not due(int(metrics["step"]), self.last_step, self.cfg.log_every, self.cfg.checkpoint_every):
            return
        entries = self.history.entries
        new = [entry for entry in entries[self.seen :] if entry["step"] > self.logged]
        self.seen = len(entries)
        if not new:
            return
        log_steps(self.uri, self.run_id, new)
        self.logged = int(new[-1]["step"])
        write_json_atomic(self.record, {"run_id": self.run_id, "step": self.logged})


@dataclass
class Checkpoints(StepCallback):
    """`save(step, metrics)` every `train.checkpoint_every` steps and at the last step;
    `report(metrics)` at the other log steps (Ray Train's report, which Tune's schedulers read)."""

    save: Callable[[int, Metrics], None]
    report: Callable[[Metrics], None]
    last_step: int
    cfg: TrainConfig

    def on_step_end(self, metrics: Metrics) -> None:
        step = int(metrics["step"])
        if due(step, self.last_step, self.cfg.checkpoint_every):
            self.save(step, metrics)
        elif due(step, self.last_step, self.cfg.log_every):
            self.report(metrics)
