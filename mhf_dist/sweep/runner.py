"""`mhf sweep`: one Ray Tune trial per (variant, seed); each trial drives one `mhf train` TorchTrainer.

The sweep is one MLflow parent run; every trial's training run is its child (tag `mlflow.parentRunId`)
with tags `sweep`, `group`, `family`, `seed`, `param_count` and, in matched sweeps, `matched_to` and
`param_residual`. Workers' reports reach Tune through Ray Train's `TuneReportCallback`, which is what
ASHA stops trials on. Everything lives under `<storage>/<name>/` (a local directory or a bucket URI):
`sweep.json` (the spec and the parent run), `tune/` (Tune's experiment state, for `--resume`) and
`trials/<trial>/` (each run's checkpoints).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mhf_dist.config import Config, load_config
from mhf_dist.console import ConsoleRelay, WorkerLines
from mhf_dist.data.shards import Manifest, check_compatible, no_validation_fix, read_manifest
from mhf_dist.errors import DataError, MhfError, Resumable, first_line
from mhf_dist.files import write_json_atomic
from mhf_dist.interrupts import importing, tune_stops_gracefully
from mhf_dist.ray_utils import ensure_ray, logs_dir, workers_print_to_console
from mhf_dist.readers import read_json
from mhf_dist.storage import Location
from mhf_dist.sweep.spec import STORAGE_KEY, SweepConfig, Trial, expand_trials, trial_configs
from mhf_dist.tracking import (
    check_writable_store,
    end_run,
    end_stopped_children,
    log_dataset,
    log_steps,
    reopen_run,
    start_run,
    tracking_uri,
)
from mhf_dist.train.callbacks import StepCallback

if TYPE_CHECKING:
    from mhf_dist.compare import Comparison

SWEEP_FILE = "sweep.json"
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
TRIAL_DRIVER_CPUS = 0.25  # a trial's own process only waits on its TorchTrainer
TUNE_DRIVER_LOGGER = "ray.tune"
TUNE_DRIVER_LOG = "mhf-sweep-tune.log"  # in Ray's session logs
SCORED_FIX = "prepare them with the trial's tokenizer and signature table"  # an evaluate: entry's shards


class SweepError(MhfError):
    """A sweep cannot start or resume, or some of its trials failed."""


class TrialsFailed(SweepError):
    """Some trials failed: the same command with `--resume` runs them again, the finished ones kept."""

    flag, lead = "--resume", "finish the sweep with"


@dataclass(frozen=True)
class SweepResult:
    name: str
    experiment: str
    parent_run_id: str
    tracking_uri: str
    directory: Location
    trials: list[dict[str, Any]]  # name, group, family, seed, status (FINISHED, STOPPED by ASHA, ERROR)


def compare_sweep(spec: SweepConfig, result: SweepResult) -> Comparison:
    """`mhf compare` on a finished sweep with its own metric and threshold; files in <sweep>/compare."""
    from mhf_dist.compare import COMPARE_DIR, compare_runs

    return compare_runs(
        result.tracking_uri,
        spec.experiment,
        result.directory / COMPARE_DIR,
        spec.metric,
        result.parent_run_id,
        spec.unstable_cv,
    )


def sweep_dir(spec: SweepConfig) -> Location:
    return Location.of(spec.storage) / spec.name


def check_before_start(spec: SweepConfig, configs: dict[str, Config]) -> None:
    """What would otherwise fail inside Tune's trials, checked before anything starts: `check_before_data`,
    and every trial's shards exist, fit its model and hold the validation rows a val_ metric needs (each
    trial's config, its batch split over its workers included, was validated when the sweep was parsed)."""
    with importing():  # torch
        from mhf_dist.eval.tasks import check_scored_shards

    scored = check_before_data(spec, configs)
    metrics = [spec.metric, *([spec.asha.metric] if spec.asha else [])]
    for name, cfg in configs.items():
        manifest = read_manifest(cfg.data.path)
        try:
            check_compatible(manifest, cfg)
            # `evaluate: ppl`'s shards, as `mhf eval` checks them against the model the trial trains
            fingerprint, own_format = manifest.signatures.fingerprint, manifest.document_format
            positions = cfg.model.backbone.max_position_embeddings
            for data, shards in scored.items():
                check_scored_shards(
                    "its model",
                    fingerprint,
                    own_format,
                    positions,
                    Location.of(data),
                    shards,
                    SCORED_FIX,
                    DataError,
                )
        except DataError as err:
            raise DataError(f"trial {name}: {err}") from None
        if not manifest.splits["validation"].shards and (
            val := next((m for m in metrics if m.startswith("val_")), None)
        ):
            raise SweepError(
                f"trial {name}: its shards have no validation rows, so no {val}; "
                f"{no_validation_fix(manifest)}, or compare by another metric"
            )


def check_before_data(spec: SweepConfig, configs: dict[str, Config]) -> dict[str, Manifest]:
    """What needs no shards (`mhf sweep --prepare` checks it before preparing): the MLflow store can be
    written, and every `evaluate` entry can be run on the trials' models. Returns the manifests of the
    prepared shards an entry scores (`check_before_start` checks them against each trial)."""
    with importing():  # torch
        from mhf_dist.eval.tasks import check_file_or_shards, read_examples

    check_writable_store(tracking_uri(Location.of(spec.storage).uri))
    scored: dict[str, Manifest] = {}
    for task in spec.evaluate:
        if task.data is not None:  # what the task would refuse after training (recall reads no file)
            data = Location.of(task.data)
            if not data.exists():
                raise SweepError(
                    f"evaluate: {task.task} reads {task.data!r}, which does not exist; fix the path"
                )
            check_file_or_shards(task.task, data, "evaluate: data")
            if data.is_dir():  # prepared shards, scored in their own rows' length
                scored[task.data] = read_manifest(data)
                continue
            read_examples(task.task, data, task.limit)
        for name, cfg in configs.items():
            positions = cfg.model.backbone.max_position_embeddings
            if task.seq_len is not None and task.seq_len > positions:
                raise SweepError(
                    f"evaluate: {task.task}'s seq_len {task.seq_len} is above trial {name}'s "
                    f"model.backbone.max_position_embeddings {positions}; give a smaller seq_len"
                )
    return scored


def run_sweep(
    spec: SweepConfig,
    resume: bool = False,
    log: Callable[[str], None] = print,
    verbose: bool = False,
    worker_callbacks: Sequence[StepCallback] = (),
) -> SweepResult:
    """Run (or with `resume`, finish) every trial of `spec`; finished trials are never rerun.

    The console (`log`) shows each trial's progress lines, `[trial] step 20/200 | ...`; Tune's boxes
    and status tables, Ray Train's internals and the workers' own output go to the Ray session's logs
    unless `verbose`. `worker_callbacks` reach every trial's workers (see `ray_trainer.train`)."""
    trials = expand_trials(spec)
    configs = trial_configs(spec)
    check_before_start(spec, configs)
    ensure_ray(verbose=verbose)
    from ray import tune

    directory = sweep_dir(spec)
    record = directory / SWEEP_FILE
    uri = tracking_uri(Location.of(spec.storage).uri)
    tune_storage = directory.ray_storage()
    relay = None if workers_print_to_console() else ConsoleRelay(log)
    console = relay.lines if relay else None
    if resume:
        parent_run_id = _check_resume(spec, directory)
        reopen_run(uri, parent_run_id)
        log(f"resuming sweep {spec.name!r}: finished trials are kept, the others continue")
        tuner = tune.Tuner.restore(
            (directory / TUNE_DIR).path,
            storage_filesystem=tune_storage["storage_filesystem"],
            trainable=_trainable(spec, parent_run_id, uri, verbose, console, worker_callbacks),
            resume_unfinished=True,
            resume_errored=True,
        )
    else:
        if record.exists():
            raise SweepError(
                f"sweep {spec.name!r} already exists in {str(directory)!r}; finish it with --resume "
                "or give the sweep another name"
            )
        parent_run_id = start_run(
            uri,
            spec.experiment,
            spec.name,
            _flat_spec(spec),
            {"sweep": spec.name, "sweep_kind": spec.kind, "trials": len(trials), "role": "sweep"},
        )
        for data_path in dict.fromkeys(cfg.data.path for cfg in configs.values()):  # the trials' datasets
            log_dataset(uri, parent_run_id, data_path, read_manifest(data_path).content_sha256)
        directory.make_dirs()
        write_json_atomic(record, {"spec": spec.model_dump(mode="json"), "parent_run_id": parent_run_id})
        log(f"sweep {spec.name!r}: {len(trials)} trials ({spec.kind}); MLflow parent run {parent_run_id}")
        tuner = tune.Tuner(
            _trainable(spec, parent_run_id, uri, verbose, console, worker_callbacks),
            param_space={"trial": tune.grid_search([dataclasses.asdict(trial) for trial in trials])},
            tune_config=tune.TuneConfig(
                max_concurrent_trials=spec.max_concurrent or _concurrency(configs.values()),
                trial_name_creator=_trial_name,
                trial_dirname_creator=_trial_name,
                # A trial's process imports torch, DeepSpeed and MLflow: the next trial reuses it. Not under
                # ASHA: a trial it stops goes on in its fit's thread, and Tune fails the trial handed over.
                reuse_actors=spec.asha is None,
                **_scheduler(spec, configs.values()),
            ),
            run_config=tune.RunConfig(name=TUNE_DIR, verbose=int(verbose), **tune_storage),
        )
    with tune_stops_gracefully() as stop, relay or nullcontext(), _tune_driver_lines_logged(verbose):
        try:
            grid = tuner.fit()
        except KeyboardInterrupt:  # before Tune could stop gracefully, or a second signal
            grid = None
    if grid is None or stop.signal is not None:
        stopped_at = stop.at or time.time()
        raise _stopped(stop.signal or signal.SIGINT, stopped_at, directory, configs, uri, parent_run_id)
    outcomes = []
    for result in grid:
        trial = result.config["trial"]
        last = configs[trial["name"]].train.steps
        reached = (result.metrics or {}).get("step") == last
        status = "ERROR" if result.error else "FINISHED" if reached else "STOPPED"
        if result.error:
            log(f"trial {trial['name']} failed: {_reason(result.error)}")
        outcomes.append({key: trial[key] for key in ("name", "group", "family", "seed")} | {"status": status})
    if spec.asha is not None:  # the trials ASHA stopped early: Tune skipped their clean-up
        stopped = [outcome["name"] for outcome in outcomes if outcome["status"] == "STOPPED"]
        end_stopped_children(uri, parent_run_id, time.time(), stopped)
    failed = [outcome["name"] for outcome in outcomes if outcome["status"] == "ERROR"]
    end_run(uri, parent_run_id, "FAILED" if failed else "FINISHED")
    if failed:
        raise TrialsFailed(
            f"{len(failed)} of {len(outcomes)} trials failed ({', '.join(sorted(failed))}); see why above "
            "or in Ray's logs (the last line says where)"
        )
    return SweepResult(spec.name, spec.experiment, parent_run_id, uri, directory, outcomes)


def _reason(error: BaseException) -> str:
    """A failed trial's reason in one line: the trial's own error, which Tune wraps (`cause`), or else the
    last line of the wrapper's text (a dead actor's reason, the exception that ends a traceback)."""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, MhfError):
        return first_line(cause)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(cause).__name__


def _stopped(
    sig: int, stopped_at: float, directory: Location, configs: dict[str, Config], uri: str, parent_run_id: str
) -> Resumable:
    """The one line of an interrupted sweep, once its parent run and unfinished trials are marked KILLED
    and every trial's directory holds at most its train.keep_checkpoints (Tune stops a trial without its
    clean-up)."""
    from mhf_dist.train.ray_trainer import tidy_stopped_run

    end_stopped_children(uri, parent_run_id, stopped_at)
    end_run(uri, parent_run_id, "KILLED")
    for name, cfg in configs.items():  # a finished trial keeps what it has
        tidy_stopped_run(directory / TRIALS_DIR / name, cfg.train.keep_checkpoints)
    return Resumable(
        f"{signal.Signals(sig).name}; the finished trials and the others' newest checkpoints are kept in "
        f"{str(directory / TRIALS_DIR)!r}",
        128 + sig,
        "--resume",
    )


@contextmanager
def _tune_driver_lines_logged(verbose: bool) -> Iterator[None]:
    """Unless `verbose`, what Tune's driver logs (on an interrupt: that it stops, and a
    `Tuner.restore(...)` hint where `--resume` is mhf's way) goes to Ray's session logs, not the console."""
    if verbose or (logs := logs_dir()) is None:
        yield
        return
    tune_logger = logging.getLogger(TUNE_DRIVER_LOGGER)
    handler = logging.FileHandler(os.path.join(logs, TUNE_DRIVER_LOG))
    propagates = tune_logger.propagate
    tune_logger.addHandler(handler)
    tune_logger.propagate = False
    try:
        yield
    finally:
        tune_logger.propagate = propagates
        tune_logger.removeHandler(handler)
        handler.close()


def run_trial(
    params: dict[str, Any],
    sweep: dict[str, Any],
    parent_run_id: str,
    uri: str,
    workdir: str,
    verbose: bool,
    console: WorkerLines | None,
    worker_callbacks: Sequence[StepCallback],
) -> None:
    """One Tune trial: one `mhf train` run, a child of the sweep's MLflow run, stored under the sweep's
    trials directory; its console lines go to the sweep's `console` labelled with the trial's name.

    A trial that errored before continues from its own newest checkpoint in the same MLflow run.
    """
    os.chdir(workdir)  # Tune starts trials in their own directories; paths in configs are relative to ours
    from ray.tune.integration.ray_train import TuneReportCallback

    from mhf_dist.train.checkpoints import MODEL_DIR
    from mhf_dist.train.ray_trainer import TrainOptions, train

    spec = SweepConfig.model_validate(sweep)
    trial = Trial(**params["trial"])
    cfg = load_config(spec.config, {**trial.overrides, STORAGE_KEY: (sweep_dir(spec) / TRIALS_DIR).uri})
    os.environ["MLFLOW_TRACKING_URI"] = uri  # every trial logs beside the parent run
    options = TrainOptions(
        name=trial.name,
        experiment=spec.experiment,
        continue_run=True,
        verbose=verbose,
        console=console.labelled(trial.name) if console else None,
    )
    result = train(
        cfg,
        options,
        tags=_trial_tags(spec, trial, cfg, parent_run_id),
        callbacks=[TuneReportCallback()],
        worker_callbacks=worker_callbacks,
    )
    if spec.evaluate:
        evaluate_trial(spec, cfg, (result.checkpoint / MODEL_DIR).uri, uri, result.run_id)


def evaluate_trial(spec: SweepConfig, cfg: Config, model_dir: str, uri: str, run_id: str) -> None:
    """The sweep's `evaluate` tasks on the trial's exported model, logged at the trial's last step; a
    task that fails marks the trial's (trained, so FINISHED) MLflow run FAILED.

    `recall` is scored on rows generated like the trial's `data.recall` rows, from another seed."""
    from mhf_dist.eval.tasks import run_task
    from mhf_dist.export import load_exported

    metrics: dict[str, float] = {}
    try:
        exported = load_exported(model_dir)
        for task in spec.evaluate:
            recall = (cfg.data.recall, cfg.train.seq_len)
            window = {"seq_len": task.seq_len} if task.seq_len is not None else {}  # ppl's and bpb's
            results = run_task(exported, task.task, task.data, limit=task.limit, recall=recall, **window)
            metrics |= {f"eval.{task.task}.{name}": value for name, value in results.items()}
    except Exception:
        with suppress(MhfError):  # a tracking store that fails too: the evaluation's error is the reason
            end_run(uri, run_id, "FAILED")
        raise
    log_steps(uri, run_id, [{"step": cfg.train.steps, **metrics}])


def _trial_tags(spec: SweepConfig, trial: Trial, cfg: Any, parent_run_id: str) -> dict[str, Any]:
    from mhf_dist.models import param_count

    tags = {
        "mlflow.parentRunId": parent_run_id,
        "sweep": spec.name,
        "group": trial.group,
        "trial": trial.name,
    }
    if spec.kind == "matched":
        reference = param_count(cfg.model.model_copy(update={"family": spec.matched_to}))
        tags |= {"matched_to": spec.matched_to, "param_residual": param_count(cfg.model) - reference}
    return tags


def _trainable(
    spec: SweepConfig,
    parent_run_id: str,
    uri: str,
    verbose: bool,
    console: WorkerLines | None,
    worker_callbacks: Sequence[StepCallback],
) -> Any:
    from ray import tune

    trainable = tune.with_parameters(
        run_trial,
        sweep=spec.model_dump(mode="json"),
        parent_run_id=parent_run_id,
        uri=uri,
        workdir=os.getcwd(),
        verbose=verbose,
        console=console,
        worker_callbacks=tuple(worker_callbacks),
    )
    return tune.with_resources(trainable, {"CPU": TRIAL_DRIVER_CPUS})


def _trial_name(tune_trial: Any) -> str:
    return tune_trial.config["trial"]["name"]


def _concurrency(configs: Iterable[Config]) -> int:
    """Trials whose workers (the most any trial asks for) fit in the cluster's CPUs, leaving one CPU
    for the work beside the trials (Tune's driver and Ray's own processes)."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 1)
    workers = max(cfg.topology.workers for cfg in configs)
    return max(1, int((cpus - 1) // (workers + TRIAL_DRIVER_CPUS)))


def _scheduler(spec: SweepConfig, configs: Iterable[Config]) -> dict[str, Any]:
    if spec.asha is None:
        return {}
    from ray.tune.schedulers import ASHAScheduler

    steps = max(cfg.train.steps for cfg in configs)
    scheduler = ASHAScheduler(
        time_attr="step",
        # One past the last step: a trial ASHA stops at max_t loses its last checkpoint, export and MLflow
        # end to the stop, so none is stopped for having finished.
        max_t=steps + 1,
        grace_period=spec.asha.grace_period,
        reduction_factor=spec.asha.reduction_factor,
    )
    return {"scheduler": scheduler, "metric": spec.asha.metric, "mode": spec.asha.mode}


def _check_resume(spec: SweepConfig, directory: Location) -> str:
    from ray import tune

    record = directory / SWEEP_FILE
    storage = directory.ray_storage()
    tune_dir = (directory / TUNE_DIR).path
    if not record.is_file() or not tune.Tuner.can_restore(tune_dir, storage["storage_filesystem"]):
        raise SweepError(
            f"there is no sweep {spec.name!r} to resume in {str(directory)!r}; start it without --resume"
        )
    saved = read_json(record, SweepError, "start the sweep again without --resume, under another name")
    if saved["spec"] != spec.model_dump(mode="json"):
        raise SweepError(
            f"the sweep file differs from the one sweep {spec.name!r} started with; resume with the same "
            "file, or start a new sweep under another name"
        )
    return saved["parent_run_id"]


def _flat_spec(spec: SweepConfig) -> dict[str, Any]:
    flat = spec.model_dump(mode="json", exclude={"set", "grid"})
    flat |= {f"set.{key}": value for key, value in spec.set.items()}
    flat |= {f"grid.{key}": value for key, value in spec.grid.items()}
    return flat
