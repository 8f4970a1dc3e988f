"""`WorkerSpec`, what `ray_trainer.train` hands every worker, in a module of its own: Ray Train's
controller unpickles the train_loop_config too, and this module keeps it from importing the model code
(transformers and the models: about 3 s of CPU in every fit's controller)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from mhf_dist.config import Config
from mhf_dist.console import WorkerLines
from mhf_dist.train.callbacks import StepCallback


@dataclass(frozen=True)
class WorkerSpec:
    """What `ray_trainer.train` hands every worker (through Ray Train's train_loop_config)."""

    config: Config  # data.path and topology.storage absolute or URIs: workers run in their own directories
    data_sha256: str  # the content hash of the prepared data the driver checked: the workers train on it
    run_dir: str  # a local path or a URI (`storage.Location`)
    tracking_uri: str
    run_id: str
    init_from: str | None = None  # an exported model whose weights training starts from
    resume_from: str | None = None  # a checkpoint directory (--resume)
    stop_at_step: int | None = None
    peak_tflops: float = 0.0  # per worker; 0: the device's known bf16 peak
    verbose: bool = False
    console: WorkerLines | None = None  # where rank 0's lines go; None: printed here (Ray forwards them)
    callbacks: tuple[StepCallback, ...] = field(default_factory=tuple)  # before the built-in ones
    registrations: dict[str, dict[str, Any]] = field(default_factory=dict)  # plugins.outside_registrations

    def say(self, line: str) -> None:
        (self.console or partial(print, flush=True))(line)
