"""`mhf train` on the driver: a Ray Train V2 TorchTrainer whose workers each drive a DeepSpeed engine
(`worker.train_loop_per_worker`). Checkpoints go through the storage's own pyarrow filesystem, so a
cluster needs no shared disk.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from mhf_dist.config import Config, TopologyConfig, check_topology
from mhf_dist.console import ConsoleRelay, WorkerLines
from mhf_dist.data.reader import RowReader, training_plan
from mhf_dist.data.shards import Manifest, check_compatible, check_tokenizer, load_signatures, read_manifest
from mhf_dist.errors import Interrupted, MhfError, TrainingError
from mhf_dist.files import write_json_atomic
from mhf_dist.interrupts import sigterm_as_sigint
from mhf_dist.plugins import outside_registrations
from mhf_dist.ray_utils import ensure_ray, workers_print_to_console
from mhf_dist.readers import read_json
from mhf_dist.storage import UNREACHABLE, Location, StorageError, describe_failure, local_copy, redact
from mhf_dist.tracking import (
    check_writable_store,
    end_run,
    log_artifact,
    log_dataset,
    reopen_run,
    start_run,
    tracking_uri,
)
from mhf_dist.train.callbacks import StepCallback
from mhf_dist.train.checkpoints import (
    MODEL_DIR,
    RUN_FILE,
    check_initial_model,
    check_resumable,
    checkpoint_step,
    newest_checkpoint,
    prune_checkpoints,
    read_history,
    resolve_resume,
)
from mhf_dist.train.engine import check_precision_supported
from mhf_dist.train.trainable import TrainableSplit, config_split
from mhf_dist.train.worker import STAGING_PREFIX, WorkerSpec, train_loop_per_worker

if TYPE_CHECKING:
    from ray.train import Result
    from ray.train.torch import TorchTrainer

TRACKING_FILE = "mlflow-run.json"  # in the run directory: the MLflow run a continued run logs to


@dataclass(frozen=True)
class TrainResult:
    checkpoint: Location  # the last checkpoint directory; its exported model is checkpoint / "model"
    run_id: str  # the MLflow run
    tracking_uri: str


# Set on a cluster whose autoscaler adds nodes on demand: the resource check waits (a bounded time).
AUTOSCALING_ENV = "MHF_AUTOSCALING_CLUSTER"
AUTOSCALING_WAIT_ENV = "MHF_AUTOSCALING_WAIT_S"
# What Ray says of a worker its memory monitor killed (an actor's death, not an OutOfMemoryError).
OOM_KILLED = "running low on memory"
PRINT_PATCH_VARIABLE = "RAY_TRAIN_ENABLE_PRINT_PATCH"  # Ray Train propagates it to the workers


@dataclass(frozen=True)
class TrainOptions:
    """How this one run is started and named; what it trains on is the config's `topology`."""

    name: str = "mhf-train"
    experiment: str = "mhf"  # the MLflow experiment
    resume: str | None = None  # a checkpoint directory, or a run name under storage (its newest)
    stop_at_step: int | None = None  # end this run early (with a checkpoint), e.g. to fit a time slot
    max_failures: int = 0
    peak_tflops: float = 0.0  # per worker, for MFU; 0: known GPUs' bf16 peak, none on CPU
    continue_run: bool = False  # continue the run `name` from its newest checkpoint, in its MLflow run
    init_from: str | None = None  # an exported model whose weights training starts from (fresh optimizer)
    verbose: bool = False  # what Ray, Ray Train and the workers print on the console too (else in logs)
    console: WorkerLines | None = None  # rank 0's console lines: a sweep's labelled queue; None: ours

    def __post_init__(self) -> None:
        if self.init_from is not None and self.resume is not None:
            raise TrainingError(
                "--resume goes on from a checkpoint's weights and optimizer, --init-from starts afresh from "
                "a model's weights; give one of them"
            )


def check_resources(
    topology: TopologyConfig, cluster: Callable[[], dict[str, float]], log: Callable[[str], None] = print
) -> None:
    """Refuse a run the Ray cluster cannot place (with an autoscaler, after waiting a bounded time)."""
    wanted = {"CPU": topology.workers, "GPU": topology.workers * topology.gpus_per_worker}
    autoscaling = bool(os.environ.get(AUTOSCALING_ENV))
    wait_s = float(os.environ.get(AUTOSCALING_WAIT_ENV, 900)) if autoscaling else 0.0
    deadline, said = time.monotonic() + wait_s, False
    while True:
        have = cluster()
        missing = [name for name, amount in wanted.items() if amount > int(have.get(name, 0))]
        if not missing:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if not said:
            log(f"waiting up to {wait_s:g} s for the autoscaler to add {' and '.join(missing)}s")
            said = True
        time.sleep(min(5.0, remaining))
    resource = missing[0]
    count = int(have.get(resource, 0))
    per_worker = 1 if resource == "CPU" else topology.gpus_per_worker
    hint = " (--gpus-per-worker 0 trains on CPUs)" if resource == "GPU" else ""
    waited = f" after {wait_s:g} s of autoscaling" if autoscaling else ""
    fitting = count // per_worker  # below the workers asked for: they are what does not fit
    fewer = f"use --workers {fitting} or a larger cluster" if fitting else "use a larger cluster"
    raise TrainingError(
        f"--workers {topology.workers} x {per_worker} {resource} asks for {wanted[resource]} {resource}s but "
        f"the Ray cluster has {count}{waited}; {fewer}{hint}"
    )


def train(
    cfg: Config,
    options: TrainOptions,
    tags: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
    worker_callbacks: Sequence[StepCallback] = (),
) -> TrainResult:
    """Train `cfg` on `cfg.topology`, tracked in MLflow; returns where the results are.

    What can be checked is before Ray starts, and the MLflow run is opened before any worker starts (an
    unreachable server fails fast). `callbacks` are Ray Train's (a sweep passes Tune's report callback);
    `worker_callbacks` run on every worker before the built-in ones (tests inject faults with them).
    """
    inputs = _checked_inputs(cfg, options)
    ensure_ray(verbose=options.verbose)
    import ray

    check_resources(cfg.topology, ray.cluster_resources, options.console or print)
    uri = tracking_uri(inputs.storage.uri)
    _check_tracking_reaches_workers(uri, ray.nodes())
    inputs.storage.make_dirs()  # after every check: a refused run leaves no folder behind
    run_id = _tracking_run(uri, inputs.run_dir, cfg, options, _run_tags(cfg, inputs, tags), inputs.manifest)
    relay = None if options.console or workers_print_to_console() else ConsoleRelay()
    spec = WorkerSpec(
        config=inputs.worker_cfg,
        data_sha256=inputs.manifest.content_sha256,
        run_dir=inputs.run_dir.uri,
        tracking_uri=uri,
        run_id=run_id,
        init_from=inputs.init_from,
        resume_from=inputs.resume.uri if inputs.resume else None,
        stop_at_step=options.stop_at_step,
        peak_tflops=options.peak_tflops,
        verbose=options.verbose,
        console=options.console or (relay.lines if relay else None),
        callbacks=tuple(worker_callbacks),
        registrations=outside_registrations(),
    )
    trainer = _trainer(spec, cfg, options, inputs.storage, callbacks)
    return _fit(trainer, relay, spec, inputs, options.name)


def _check_tracking_reaches_workers(uri: str, nodes: list[dict[str, Any]]) -> None:
    """MLflow's embedded SQLite store (or a SQLite URI given) is a file on this machine; rank 0 logs from
    wherever it runs."""
    hosts = {node["NodeManagerAddress"] for node in nodes if node.get("Alive")}
    if uri.startswith("sqlite:") and len(hosts) > 1:
        raise TrainingError(
            f"MLflow's embedded SQLite store is on this machine, but the Ray cluster spans {len(hosts)} "
            "machines; set MLFLOW_TRACKING_URI to a tracking server (cluster/README.md)"
        )


def _run_tags(cfg: Config, inputs: _Inputs, tags: dict[str, Any] | None) -> dict[str, Any]:
    """The MLflow run's tags: what a comparison groups and matches runs by, then the caller's `tags`."""
    from mhf_dist.models import param_count

    return {
        "family": cfg.model.family,
        "backbone": cfg.model.backbone.kind,
        "preset": cfg.preset or "custom",
        "seed": cfg.train.seed,
        "param_count": param_count(cfg.model),
        "objective": cfg.model.hash.loss if cfg.model.family == "mhf" else "softmax",
        "signature_fingerprint": inputs.manifest.signatures.fingerprint,
        "trainable_params": inputs.split.trainable_params,
        "total_params": inputs.split.total_params,
        **(tags or {}),
    }


def _trainer(
    spec: WorkerSpec, cfg: Config, options: TrainOptions, storage: Location, callbacks: list[Any] | None
) -> Any:
    """Ray Train's TorchTrainer running `train_loop_per_worker(spec)` on `cfg.topology`'s workers."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    gpus = cfg.topology.gpus_per_worker
    return TorchTrainer(
        partial(train_loop_per_worker, spec),
        scaling_config=ScalingConfig(
            num_workers=cfg.topology.workers,
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": 1, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=options.name,
            **storage.ray_storage(),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            failure_config=FailureConfig(max_failures=options.max_failures),
            callbacks=callbacks,
            # Ray Train's own INFO lines (each report, each checkpoint) stay in its log files.
            logging_config=LoggingConfig(log_level="INFO" if options.verbose else "WARNING"),
        ),
    )


@dataclass(frozen=True)
class _Inputs:
    manifest: Manifest
    storage: Location
    run_dir: Location  # storage / the run's name
    worker_cfg: Config  # the config with absolute locations (workers run in their own directories)
    init_from: str | None  # the --init-from model's URI
    resume: Location | None  # the checkpoint --resume names
    split: TrainableSplit  # train.trainable's, for MLflow


def check_run(cfg: Config, options: TrainOptions) -> None:
    """What needs neither shards nor Ray (`mhf train --prepare` checks it before preparing): the batch
    over the workers, the precision, the step to stop at."""
    check_topology(cfg)
    check_precision_supported(cfg)
    if options.stop_at_step is not None and options.stop_at_step >= cfg.train.steps:
        raise TrainingError(
            f"--stop-at-step {options.stop_at_step} is not before the run's last step (train.steps="
            f"{cfg.train.steps}); give a step before it, or drop --stop-at-step"
        )


def _checked_inputs(cfg: Config, options: TrainOptions) -> _Inputs:
    """Everything that can be checked without Ray is, before its seconds of start-up."""
    check_run(cfg, options)
    for given in (cfg.topology.storage, cfg.data.path, options.init_from, options.resume):
        if given is not None and redact(given) != given:  # workers receive the locations as written
            raise TrainingError(
                f"{redact(given)!r} carries user info or query options; give credentials and the "
                "endpoint through the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) instead"
            )
    manifest = read_manifest(cfg.data.path)
    check_tokenizer(cfg.data.path, manifest)  # the exported model carries it
    storage = Location.of(cfg.topology.storage)
    storage.check_writable(TrainingError, "choose another --storage")  # in one line, before any work
    check_writable_store(tracking_uri(storage.uri))
    run_dir = storage / options.name
    if newest_checkpoint(run_dir) is not None and not options.continue_run:
        raise TrainingError(
            f"run directory {str(run_dir)!r} already holds checkpoints; go on with --continue, or pick "
            f"another --name (`mhf train --resume {options.name} --name NEW` starts a new run from it)"
        )
    # A model to go on from fixes the model: whether the shards are its own is said before the config's fit.
    init_from, resume = _checked_start(cfg, options, storage, manifest)
    check_compatible(manifest, cfg)
    # Workers run in their own working directories: hand them absolute paths (or URIs).
    data = cfg.data.model_copy(update={"path": Location.of(cfg.data.path).uri})
    topology = cfg.topology.model_copy(update={"storage": storage.uri})
    worker_cfg = cfg.model_copy(update={"data": data, "topology": topology})
    reader = RowReader(data.path, "train")
    reader.check_all()  # every shard's footer, once, here rather than in every worker
    training_plan(reader, cfg)  # enough rows for one batch
    # train.trainable: a bad pattern fails here, before any worker starts; the counts go to MLflow.
    table = load_signatures(data.path, manifest)
    split = config_split(cfg.model, table, cfg.train.trainable)
    return _Inputs(manifest, storage, run_dir, worker_cfg, init_from, resume, split)


def _checked_start(
    cfg: Config, options: TrainOptions, storage: Location, manifest: Manifest
) -> tuple[str | None, Location | None]:
    """--init-from's model (its URI) and --resume's checkpoint, each checked against the run's model and
    data. A model continued (`--init-from`, `mhf cpt`, a resume) trains only on documents framed as its own.
    """
    from mhf_dist.export import check_documents_fit

    fingerprint, data_name = manifest.signatures.fingerprint, f"shards {redact(cfg.data.path)!r}"
    init_from = Location.of(options.init_from).uri if options.init_from is not None else None
    if init_from is not None:
        check_initial_model(init_from, cfg, fingerprint)
        check_documents_fit(init_from, manifest.document_format, data_name, TrainingError)
    resume = resolve_resume(options.resume, storage) if options.resume is not None else None
    if resume is not None:
        check_resumable(resume, cfg, fingerprint)
        last = min(cfg.train.steps, options.stop_at_step or cfg.train.steps)
        if (step := int(read_history(resume)[-1]["step"])) >= last:  # the worker reads it anyway
            raise TrainingError(
                f"checkpoint {str(resume)!r} is at step {step} and the run ends at step {last} (train.steps, "
                "--stop-at-step): nothing is left to train; raise train.steps to go on from it"
            )
        check_documents_fit((resume / MODEL_DIR).uri, manifest.document_format, data_name, TrainingError)
    return init_from, resume


def _fit(
    trainer: TorchTrainer, relay: ConsoleRelay | None, spec: WorkerSpec, inputs: _Inputs, name: str
) -> TrainResult:
    """The trainer's fit, then `_finish`; a stopped run is `Interrupted`, a failed one a one-line error
    where it can be."""
    uri, run_id, keep = spec.tracking_uri, spec.run_id, spec.config.train.keep_checkpoints
    # Ray Train routes the workers' print() through logging and, with stdout redirected as Ray's workers
    # have it, also prints it: every progress line twice. Off, each line reaches the console once.
    os.environ[PRINT_PATCH_VARIABLE] = "1" if spec.verbose else "0"
    with sigterm_as_sigint() as stop:  # SIGTERM takes Ray Train's graceful SIGINT path
        try:
            with relay or nullcontext():
                result = trainer.fit()
        except (KeyboardInterrupt, SystemExit):
            # Ray Train's own SIGINT handler aborts the run and exits (before it is installed, Ctrl-C is a
            # KeyboardInterrupt): the run is stopped on purpose, not failed.
            end_run(uri, run_id, "KILLED")
            raise _interrupted(stop.signal or signal.SIGINT, inputs.run_dir, keep) from None
        except BaseException as err:
            end_run(uri, run_id, "FAILED")
            unreachable = _storage_failure(err, inputs.storage)
            if unreachable is not None:  # the store may not answer a listing now either: name none
                raise TrainingError(
                    f"{unreachable}; the run stopped: once the store answers, rerun with --continue to go on "
                    "from its last complete checkpoint"
                ) from None
            user_error = _worker_user_error(err)
            if user_error is None:
                raise
            last_good = newest_checkpoint(inputs.run_dir)
            kept = f"; last good checkpoint: {last_good}" if last_good else "; no checkpoint was written"
            raise TrainingError(f"{user_error}{kept}") from None
    return _finish(result, uri, run_id, inputs.run_dir, name, keep)


def _finish(result: Result, uri: str, run_id: str, run_dir: Location, name: str, keep: int) -> TrainResult:
    """The finished run's checkpoints pruned, its last one's run.json and model logged to MLflow, and the
    MLflow run ended."""
    if result.checkpoint is None:
        end_run(uri, run_id, "FAILED")
        raise TrainingError(
            f"run {name!r} ended without a checkpoint; the workers' errors are in Ray's logs "
            "(the last line says where)"
        )
    # A checkpoint a restart resumed from before Ray Train registered it is not Ray's to delete.
    prune_checkpoints(run_dir, keep)
    checkpoint = run_dir / PurePosixPath(result.checkpoint.path).name
    log_artifact(uri, run_id, local_copy(checkpoint / RUN_FILE))
    log_artifact(uri, run_id, local_copy(checkpoint / MODEL_DIR))
    end_run(uri, run_id, "FINISHED")
    return TrainResult(checkpoint, run_id, uri)


def tidy_stopped_run(run_dir: Location, keep: int) -> None:
    """Clear what a stopped run leaves: staging directories, incomplete and surplus checkpoints."""
    run_dir.clear_staging(STAGING_PREFIX)
    prune_checkpoints(run_dir, keep)


def _interrupted(sig: int, run_dir: Location, keep: int) -> Interrupted:
    tidy_stopped_run(run_dir, keep)
    last = newest_checkpoint(run_dir)
    name_of = signal.Signals(sig).name
    if last is None:
        return Interrupted(f"{name_of} before the first checkpoint; nothing to resume from", 128 + sig)
    step = checkpoint_step(last)
    return Interrupted(
        f"{name_of} after step {step}; last checkpoint: {last}; rerun with --continue to go on from it",
        128 + sig,
    )


def _tracking_run(
    uri: str, run_dir: Location, cfg: Config, options: TrainOptions, tags: dict[str, Any], manifest: Manifest
) -> str:
    """A new MLflow run with its shards as dataset input, or with `continue_run` the run's own."""
    record = run_dir / TRACKING_FILE
    if options.continue_run and record.is_file():
        run_id = read_json(record, TrainingError, "start a new run with another --name")["run_id"]
        reopen_run(uri, run_id)
        return run_id
    left_out = {  # what prepare did not make documents of (data.missing_text), beside the settings
        "data.records_without_text": sum(source.missing_text for source in manifest.sources),
        "data.empty_records": sum(source.empty for source in manifest.sources),
    }
    run_id = start_run(uri, options.experiment, options.name, {**cfg.flat(), **left_out}, tags)
    log_dataset(uri, run_id, cfg.data.path, manifest.content_sha256)
    run_dir.make_dirs()
    write_json_atomic(record, {"run_id": run_id, "tracking_uri": redact(uri)})  # no password on disk
    return run_id


def _storage_failure(err: BaseException, storage: Location) -> StorageError | None:
    """A run's storage that stopped answering, out of Ray Train's controller or worker wrappers."""
    from ray.train import ControllerError

    causes = [err.controller_failure] if isinstance(err, ControllerError) else _worker_failures(err).values()
    for cause in causes:
        if isinstance(cause, StorageError) and cause.problem == UNREACHABLE:
            return cause  # any other (a file gone, refused credentials) is a worker's one-line error
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            return StorageError(describe_failure(str(storage), cause))
    return None


def _worker_failures(err: BaseException) -> dict[int, BaseException]:
    """Each failed worker's exception by rank: Ray Train wraps user exceptions with their traceback text
    (UserExceptionWithTraceback)."""
    from ray.train import WorkerGroupError

    if not isinstance(err, WorkerGroupError):
        return {}
    return {rank: getattr(failure, "_base_exc", failure) for rank, failure in err.worker_failures.items()}


def _worker_user_error(err: BaseException) -> MhfError | None:
    """The one-line error a worker raised, out of Ray Train's wrappers; out of memory as what to change."""
    import torch
    from ray.exceptions import OutOfMemoryError

    for rank, failure in sorted(_worker_failures(err).items()):
        # A worker that died (Ray's memory monitor killed it) is in a failed health check.
        cause = getattr(failure, "health_check_failure", failure)
        if isinstance(cause, MhfError):
            return cause
        if isinstance(cause, torch.OutOfMemoryError | OutOfMemoryError) or OOM_KILLED in str(cause):
            first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "out of memory")
            return TrainingError(
                f"worker {rank} ran out of memory ({first[:160]}); lower train.micro_batch_size (gradient "
                "accumulation keeps the batch) or train.seq_len, raise --zero-stage, or add workers; "
                "`mhf plan` shows what fits"
            )
    return None
