"""`mhf train`: a Ray Train V2 TorchTrainer whose workers each drive a DeepSpeed ZeRO engine.

Each worker builds the model from the registry and runs the shared step loop (`run_training`) with a
`DeepSpeedStepper`. Data: every worker iterates the training rows in the same fixed order (the dataset
is not split; preserve_order is on) and keeps its own micro-batch slice of each global batch, so the
batch of step s is a pure function of s. That is what makes resume exact: a resumed worker skips the
first s global batches and continues with batch s + 1, none repeated, none skipped.

Checkpoints (every `train.checkpoint_every` steps and at the end) hold the DeepSpeed state of every rank
(model, optimizer, LR schedule) plus the step, RNG states and the per-step metrics so far.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhf_dist.config import Config, validate_config
from mhf_dist.data.shards import SIGNATURES_FILE, arrow_to_arrays, load_shards, read_manifest
from mhf_dist.errors import TrainingError
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.tracking import end_run, log_artifact, log_steps, start_run, tracking_uri

HISTORY_FILE = "history.jsonl"
RUN_FILE = "run.json"  # the model config and signature fingerprint the checkpoint belongs to
STATE_TAG = "state"  # DeepSpeed's checkpoint tag inside each Ray Train checkpoint


@dataclass(frozen=True)
class TrainResult:
    checkpoint: Path  # the last checkpoint directory
    run_id: str  # the MLflow run
    tracking_uri: str


@dataclass(frozen=True)
class TrainOptions:
    workers: int = 2
    gpus_per_worker: int = 0
    zero_stage: int = 0
    storage: str = "runs/train"
    name: str = "mhf-train"
    experiment: str = "mhf"  # the MLflow experiment
    resume: str | None = None  # a checkpoint directory written by an earlier run
    stop_at_step: int | None = None  # end this run early (with a checkpoint), e.g. to fit a time slot
    max_failures: int = 0


def global_batches(
    shard: Any, batch_size: int, micro: int, rank: int, seq_len: int, num_hashes: int, skip: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's slice of every global batch, epoch after epoch, after skipping `skip` batches."""
    seen = 0
    while True:
        for table in shard.iter_batches(batch_size=batch_size, batch_format="pyarrow", drop_last=True):
            seen += 1
            if seen <= skip:
                continue
            ids, signatures = arrow_to_arrays(table.slice(rank * micro, micro), seq_len, num_hashes)
            yield {
                "tokens": torch.from_numpy(ids),
                "signatures": torch.from_numpy(signatures.astype(np.int64)),
            }
        if seen == 0:
            raise TrainingError(f"the training split has fewer rows than one batch of {batch_size}")


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (torch.distributed is already initialised by TorchTrainer)."""
    import ray.train

    from mhf_dist.models import build_model, train_flops_per_token
    from mhf_dist.signatures import SignatureTable
    from mhf_dist.train.engine import DeepSpeedStepper, micro_batch_size
    from mhf_dist.train.loop import Throughput, format_progress, is_log_step, run_training

    cfg = validate_config(loop_config["config"])
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    torch.manual_seed(cfg.train.seed)
    table = SignatureTable.load(Path(loop_config["data_path"]) / SIGNATURES_FILE)
    model = build_model(cfg.model, table)
    use_gpu = loop_config["gpus_per_worker"] > 0
    if use_gpu:
        model = model.to(ray.train.torch.get_device())
    stepper = DeepSpeedStepper(model, cfg.train, loop_config["zero_stage"], world_size, bf16=use_gpu)

    start_step, history = 0, []
    # After a worker failure the run continues from its own newest checkpoint, else from --resume.
    checkpoint = ray.train.get_checkpoint()
    newest = newest_checkpoint(Path(loop_config["run_dir"]))
    if checkpoint is None and newest is not None:
        checkpoint = ray.train.Checkpoint.from_directory(str(newest))
    if checkpoint is None and loop_config["resume_from"]:
        checkpoint = ray.train.Checkpoint.from_directory(loop_config["resume_from"])
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            _, client_state = stepper.engine.load_checkpoint(directory, tag=STATE_TAG)
            history = read_history(directory)
        start_step = client_state["step"]
        _set_rng_state(client_state["rng"][rank])
        if rank == 0:
            print(f"resumed from {checkpoint.path} at step {start_step}", flush=True)

    micro = micro_batch_size(cfg.train, world_size)
    batches = global_batches(
        ray.train.get_dataset_shard("train"), cfg.train.batch_size, micro, rank, cfg.train.seq_len,
        table.num_hashes, skip=start_step,
    )  # fmt: skip
    throughput = Throughput(
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
        flops_per_token=train_flops_per_token(cfg.model, cfg.train.seq_len),
    )
    last_step = min(cfg.train.steps, loop_config["stop_at_step"] or cfg.train.steps)

    run_info = {"model": cfg.model.model_dump(mode="json"), "fingerprint": table.fingerprint}
    tracking = {"uri": loop_config["tracking_uri"], "run_id": loop_config["run_id"], "logged": start_step}

    def on_step(metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        _maybe_inject_fault(step, cfg.train.fail_at_step, rank, Path(loop_config["fault_marker"]))
        history.append(metrics)
        if rank == 0 and is_log_step(step, cfg.train):
            print(format_progress(metrics, cfg.train.steps), flush=True)
        every = cfg.train.checkpoint_every
        if step == last_step or (every and step % every == 0):
            if rank == 0:
                log_steps(
                    tracking["uri"],
                    tracking["run_id"],
                    (h for h in history if h["step"] > tracking["logged"]),
                )
                tracking["logged"] = step
            _report_checkpoint(stepper, step, metrics, history, run_info, rank, world_size)
        elif is_log_step(step, cfg.train):
            ray.train.report(metrics)

    run_training(stepper, batches, cfg.train.steps, throughput, start_step, last_step, on_step)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint on storage.

    Ray Train registers a checkpoint only when its controller next polls the workers; a worker that dies
    in between would otherwise restart from scratch although the files were already uploaded.
    """
    complete = [path for path in sorted(run_dir.glob("checkpoint-*")) if (path / RUN_FILE).is_file()]
    return complete[-1] if complete else None


def _maybe_inject_fault(step: int, fail_at_step: int, rank: int, marker: Path) -> None:
    """Kill this worker process once (train.fail_at_step), as a crashed node would; the marker file in
    the run's storage keeps the restarted worker group from failing again."""
    if fail_at_step and step == fail_at_step and rank == 1 and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"worker 1 killed at step {step}\n")
        os._exit(1)


def _report_checkpoint(
    stepper: Any,
    step: int,
    metrics: dict[str, float],
    history: list[dict],
    run_info: dict[str, Any],
    rank: int,
    world_size: int,
) -> None:
    """Every rank saves its DeepSpeed files; Ray Train merges the ranks' folders into one checkpoint."""
    import ray.train

    rng_states = [None] * world_size
    torch.distributed.all_gather_object(rng_states, _rng_state())
    with tempfile.TemporaryDirectory() as directory:
        stepper.engine.save_checkpoint(
            directory, tag=STATE_TAG, client_state={"step": step, "rng": rng_states}
        )
        if rank == 0:
            with open(Path(directory) / HISTORY_FILE, "w") as handle:
                handle.writelines(json.dumps(entry) + "\n" for entry in history)
            (Path(directory) / RUN_FILE).write_text(json.dumps(run_info, indent=2))
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            checkpoint_dir_name=f"checkpoint-{step:07d}",
        )


def _check_resumable(path: Path, cfg: Config, fingerprint: str) -> None:
    if not (path / RUN_FILE).is_file():
        raise TrainingError(
            f"--resume {str(path)!r} is not a checkpoint directory of `mhf train`; check the path"
        )
    run = json.loads((path / RUN_FILE).read_text())
    if run["fingerprint"] != fingerprint:
        raise TrainingError(
            f"checkpoint {str(path)!r} has signature fingerprint {run['fingerprint'][:12]} but the data has "
            f"{fingerprint[:12]}; resume with the shards the run was trained on"
        )
    if run["model"] != cfg.model.model_dump(mode="json"):
        changed = sorted(k for k, v in cfg.model.model_dump(mode="json").items() if run["model"].get(k) != v)
        raise TrainingError(
            f"checkpoint {str(path)!r} was trained with a different model config ({', '.join(changed)}); "
            "resume with the same model settings"
        )


def read_history(checkpoint_path: str | Path) -> list[dict[str, float]]:
    """Per-step metrics of a run up to one of its checkpoints."""
    lines = (Path(checkpoint_path) / HISTORY_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines]


def train(cfg: Config, options: TrainOptions) -> TrainResult:
    """Train `cfg` on the shards at `cfg.data.path`, tracked in MLflow; returns where the results are."""
    ensure_ray()
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    manifest = read_manifest(cfg.data.path)
    run_dir = Path(options.storage).resolve() / options.name
    if newest_checkpoint(run_dir) is not None:
        raise TrainingError(
            f"run directory {str(run_dir)!r} already holds checkpoints; continue it with --resume "
            f"{newest_checkpoint(run_dir)} --name <new name>, or pick another --name"
        )
    resume = None
    if options.resume is not None:
        _check_resumable(Path(options.resume), cfg, manifest["signatures"]["fingerprint"])
        resume = str(Path(options.resume).resolve())
    dataset = load_shards(cfg.data.path, "train", cfg, fingerprint=manifest["signatures"]["fingerprint"])
    uri = tracking_uri(options.storage)
    run_id = start_run(uri, options.experiment, options.name, cfg.flat(), _tags(cfg, options, manifest))
    in_order = ray.data.ExecutionOptions(preserve_order=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.model_dump(mode="json"),
            "data_path": str(Path(cfg.data.path).resolve()),
            "zero_stage": options.zero_stage,
            "gpus_per_worker": options.gpus_per_worker,
            "stop_at_step": options.stop_at_step,
            "resume_from": resume,
            "run_dir": str(run_dir),
            "fault_marker": str(Path(options.storage).resolve() / options.name / "fault-injected"),
            "tracking_uri": uri,
            "run_id": run_id,
        },
        scaling_config=ScalingConfig(
            num_workers=options.workers,
            use_gpu=options.gpus_per_worker > 0,
            resources_per_worker={
                "CPU": 1,
                **({"GPU": options.gpus_per_worker} if options.gpus_per_worker else {}),
            },
        ),
        run_config=RunConfig(
            name=options.name,
            storage_path=str(Path(options.storage).resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            failure_config=FailureConfig(max_failures=options.max_failures),
        ),
        datasets={"train": dataset},
        dataset_config=DataConfig(datasets_to_split=[], execution_options=in_order),
    )
    try:
        result = trainer.fit()
    except BaseException:
        end_run(uri, run_id, "FAILED")
        raise
    if result.checkpoint is None:
        end_run(uri, run_id, "FAILED")
        raise TrainingError(f"run {options.name!r} ended without a checkpoint; see the worker errors above")
    checkpoint = Path(result.checkpoint.path)
    log_artifact(uri, run_id, Path(cfg.data.path) / SIGNATURES_FILE)
    log_artifact(uri, run_id, checkpoint / RUN_FILE)
    end_run(uri, run_id, "FINISHED")
    return TrainResult(checkpoint, run_id, uri)


def _tags(cfg: Config, options: TrainOptions, manifest: dict[str, Any]) -> dict[str, Any]:
    from mhf_dist.models import param_count

    return {
        "family": cfg.model.family,
        "preset": cfg.preset or "custom",
        "seed": cfg.train.seed,
        "param_count": param_count(cfg.model),
        "signature_fingerprint": manifest["signatures"]["fingerprint"],
        "zero_stage": options.zero_stage,
        "workers": options.workers,
    }
