"""What every Ray Train worker runs: a DeepSpeed ZeRO engine driven by the shared step loop.

Each worker builds the model from the registry and runs `run_training` with a `DeepSpeedStepper`.
Data: the rows of step s's global batch are a pure function of (seed, s) (`data.reader.BatchPlan`), and
each worker reads only its own share of them from the shards, one step ahead. That is what makes resume
exact and immediate: a resumed worker computes the rows of step s + 1 and reads them, nothing before.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhf_dist.config import Config, validate_config
from mhf_dist.data.reader import RowReader, step_batches, training_plan
from mhf_dist.data.shards import SIGNATURES_FILE, TOKENIZER_FILE, document_format, read_manifest
from mhf_dist.eval.perplexity import nll_summary, nll_totals
from mhf_dist.export import export_model, load_exported
from mhf_dist.files import write_json_atomic
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.signatures import SignatureTable
from mhf_dist.tracking import log_steps
from mhf_dist.train.checkpoints import (
    MODEL_DIR,
    STATE_TAG,
    checkpoint_name,
    newest_checkpoint,
    read_history,
    write_history,
    write_rank_files,
)
from mhf_dist.train.engine import DeepSpeedStepper, uses_bf16
from mhf_dist.train.hardware import default_peak_flops, live_tensor_bytes, peak_memory_bytes
from mhf_dist.train.trainable import apply_trainable

# Test hooks in a run's storage directory: the step the last worker is to die at, and the proof it did.
FAULT_PLAN = "fail-at-step"
FAULT_INJECTED = "fault-injected"
LOGGED_FILE = "mlflow-logged.json"  # in the run directory: the last step logged to its MLflow run
STAGING_PREFIX = ".staging-"  # each rank's checkpoint files before Ray Train copies them into place

GIB = 2**30


def training_batches(
    cfg: Config, rank: int, world_size: int, start_step: int, signatures: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's rows of every global batch after `start_step`, as tensors."""
    reader = RowReader(cfg.data.path, "train", signatures=signatures)
    for batch in step_batches(reader, training_plan(reader, cfg), start_step, rank, world_size):
        yield {key: torch.from_numpy(value.astype(np.int64, copy=False)) for key, value in batch.items()}


class Validator:
    """Exact NLL on the validation split; each rank scores an equal share of the rows, then all-reduce.

    Only the rows scored are read: the first `train.eval_rows` (all with 0), each rank its contiguous
    share. Equal shares keep ZeRO-3's collective parameter gathers in step: the last len(rows) %
    world_size rows are left out, and `val_tokens` says how many tokens were scored.
    """

    def __init__(self, cfg: Config, rank: int, world_size: int, batch_size: int) -> None:
        reader = RowReader(cfg.data.path, "validation", signatures=False)
        scored = min(cfg.train.eval_rows or reader.num_rows, reader.num_rows)
        share = scored // world_size
        self.rows = reader.read_range(rank * share, (rank + 1) * share)["tokens"]
        self.batch_size = batch_size

    def __bool__(self) -> bool:
        return len(self.rows) > 0

    def __call__(self, stepper: DeepSpeedStepper) -> dict[str, float]:
        with stepper.whole_parameters():
            total, count = nll_totals(
                stepper.engine.module, self.rows, self.batch_size, stepper.engine.device
            )
        totals = torch.tensor([total, count], dtype=torch.float64)
        torch.distributed.all_reduce(totals)
        return nll_summary(float(totals[0]), int(totals[1]))


def max_over_workers(values: dict[str, float]) -> dict[str, float]:
    tensor = torch.tensor(list(values.values()), dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(values, tensor.tolist(), strict=True))


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
    from mhf_dist.train.engine import micro_batch_size
    from mhf_dist.train.loop import Throughput, format_progress, is_log_step, run_training

    cfg = validate_config(loop_config["config"])
    if not loop_config["verbose"]:
        # Ray Train's worker-side INFO lines (one per report) log under module-path names that its
        # LoggingConfig does not reach; the root level does. Progress lines are plain prints.
        logging.getLogger().setLevel(logging.WARNING)
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    torch.manual_seed(cfg.train.seed)
    data_path = Path(cfg.data.path)
    table = SignatureTable.load(data_path / SIGNATURES_FILE)
    lineage: list[dict] = []
    if loop_config["init_from"]:
        initial = load_exported(loop_config["init_from"])
        model, lineage = initial.model.train(), initial.lineage
    else:
        model = build_model(cfg.model, table)
    apply_trainable(model, cfg.train.trainable)  # before the optimizer sees requires_grad
    use_gpu = loop_config["gpus_per_worker"] > 0
    if use_gpu:
        model = model.to(ray.train.torch.get_device())
    if cfg.train.activation_checkpointing == "layers":
        checkpoint_layers(model)
    if cfg.train.compile:
        model.compile()  # in place: parameter names and the exported model stay as they are
    stepper = DeepSpeedStepper(
        model,
        cfg.train,
        loop_config["zero_stage"],
        world_size,
        uses_bf16(cfg.train, use_gpu),
        cfg.model.backbone.hidden_size,
    )
    device = stepper.engine.device

    start_step, history = 0, []
    # After a worker failure the run continues from its own newest checkpoint, else from --resume.
    # Ray Train registers a checkpoint only when its controller next polls the workers; one that dies
    # in between would otherwise restart from scratch although the files were already stored.
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
        saved_rng = client_state["rng"]  # one per rank of the saving run (a ZeRO-0 run may resize)
        _set_rng_state(saved_rng[rank % len(saved_rng)])
        if rank == 0:
            print(f"resumed from {checkpoint.path} at step {start_step}", flush=True)

    micro = micro_batch_size(cfg.train, world_size)
    batches = training_batches(cfg, rank, world_size, start_step, signatures=cfg.model.family == "mhf")
    peak_flops = loop_config["peak_tflops"] * 1e12 or default_peak_flops(device)
    throughput = Throughput(
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
        flops_per_token=train_flops_per_token(cfg.model, cfg.train.seq_len),
        workers=world_size,
        peak_flops=peak_flops,
    )
    last_step = min(cfg.train.steps, loop_config["stop_at_step"] or cfg.train.steps)
    validate = Validator(cfg, rank, world_size, micro)
    if rank == 0 and not validate:
        print("no validation rows: val_nll is not computed (prepare with data.val_percent > 0)", flush=True)

    run_info = {
        "model": cfg.model.model_dump(mode="json"),
        "workers": world_size,
        "zero_stage": loop_config["zero_stage"],
        "fingerprint": table.fingerprint,
        "lineage": lineage,
        "trainable": cfg.train.trainable,  # a resume must freeze the same parameters (no optimizer state)
        "document_format": document_format(read_manifest(cfg.data.path)),  # exports carry the shards'
    }
    run_dir = Path(loop_config["run_dir"])
    tracking = StepLogger(loop_config["tracking_uri"], loop_config["run_id"], run_dir, start_step)
    fail_at_step = planned_fault(run_dir)

    def on_step(metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        _maybe_inject_fault(step, fail_at_step, rank == world_size - 1, run_dir / FAULT_INJECTED)
        if validate and _due(step, cfg.train.eval_every, last_step):
            metrics.update(validate(stepper))
        if step == start_step + 1:  # optimizer states exist from the first step on
            state = {
                "model_state_gb": live_tensor_bytes(device.type) / GIB,
                "param_share": stepper.parameter_share(),
            }
            metrics.update(max_over_workers(state))
        if is_log_step(step, cfg.train) or step == last_step:
            metrics.update(max_over_workers({"peak_mem_gb": peak_memory_bytes(device) / GIB}))
        history.append(metrics)
        if rank == 0 and is_log_step(step, cfg.train):
            print(format_progress(metrics, cfg.train.steps), flush=True)
        checkpoint_due = _due(step, cfg.train.checkpoint_every, last_step)
        if rank == 0 and (checkpoint_due or is_log_step(step, cfg.train)):
            tracking.log(history)
        if checkpoint_due:
            _report_checkpoint(
                stepper, cfg, table, step, metrics, history, run_info, rank, world_size, run_dir
            )
        elif is_log_step(step, cfg.train):
            ray.train.report(metrics)

    run_training(stepper, batches, cfg.train.steps, throughput, start_step, last_step, on_step)


class StepLogger:
    """Rank 0's metrics to MLflow every log step, each step once even across restarts.

    Training is deterministic, so the steps a restarted run recomputes after its checkpoint were logged
    with the same values before the failure: the last step logged to this MLflow run is kept in the run
    directory (`LOGGED_FILE`) and nothing up to it is logged again.
    """

    def __init__(self, uri: str, run_id: str, run_dir: Path, start_step: int) -> None:
        self.uri, self.run_id, self.record = uri, run_id, run_dir / LOGGED_FILE
        logged = json.loads(self.record.read_text()) if self.record.is_file() else {}
        self.logged = max(start_step, logged.get("step", 0) if logged.get("run_id") == run_id else 0)
        self.seen = start_step  # history[:seen] was looked at before (history[i] is step i + 1)

    def log(self, history: list[dict[str, float]]) -> None:
        """Log the steps of `history` not logged yet; looks only at the entries added since last time."""
        new = [entry for entry in history[self.seen :] if entry["step"] > self.logged]
        self.seen = len(history)
        if not new:
            return
        log_steps(self.uri, self.run_id, new)
        self.logged = int(new[-1]["step"])
        write_json_atomic(self.record, {"run_id": self.run_id, "step": self.logged})


def _due(step: int, every: int, last_step: int) -> bool:
    """Every `every` steps (0: never) and at this run's last step."""
    return step == last_step or bool(every and step % every == 0)


def planned_fault(run_dir: Path) -> int:
    """The step a test asked the last worker to die at (0: none): the number in `<run>/fail-at-step`.

    A test hook, not a setting: tests write the file before the run; users never see it in a config."""
    plan = run_dir / FAULT_PLAN
    return int(plan.read_text()) if plan.is_file() else 0


def _maybe_inject_fault(step: int, fail_at_step: int, last_rank: bool, marker: Path) -> None:
    """Kill the last worker's process once, as a crashed node would; the marker file in the run's
    storage keeps the restarted worker group from failing again."""
    if fail_at_step and step == fail_at_step and last_rank and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"the last worker was killed at step {step}\n")
        os._exit(1)


def _report_checkpoint(
    stepper: DeepSpeedStepper,
    cfg: Config,
    table: SignatureTable,
    step: int,
    metrics: dict[str, float],
    history: list[dict],
    run_info: dict[str, Any],
    rank: int,
    world_size: int,
    run_dir: Path,
) -> None:
    """Every rank saves its DeepSpeed files; Ray Train merges the ranks' folders into one checkpoint."""
    import ray.train

    rng_states = [None] * world_size
    torch.distributed.all_gather_object(rng_states, _rng_state())
    # Staged inside the run's own directory, where an interrupted run's driver can remove what is left.
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=STAGING_PREFIX) as tmp:
        directory = Path(tmp)
        stepper.engine.save_checkpoint(tmp, tag=STATE_TAG, client_state={"step": step, "rng": rng_states})
        with stepper.whole_parameters():
            if rank == 0:
                tokenizer = Path(cfg.data.path) / TOKENIZER_FILE
                export_model(
                    stepper.engine.module,
                    cfg.model,
                    table,
                    tokenizer,
                    directory / MODEL_DIR,
                    run_info["lineage"],
                    document_format=run_info["document_format"],
                )
        if rank == 0:
            write_history(directory, history, run_info)
        write_rank_files(directory, rank)  # last: what makes this rank's part count as complete
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=checkpoint_name(step),
        )
