"""What every Ray Train worker runs: a DeepSpeed ZeRO engine driven by the shared step loop.

The rows of step s's global batch are a pure function of (seed, s) (`data.reader.BatchPlan`), and each
worker reads only its own share: a resumed worker reads the rows of step s + 1, nothing before.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from mhf_dist.config import Config, micro_batch_size
from mhf_dist.console import WorkerLines
from mhf_dist.data.reader import RowReader, step_batches, training_plan
from mhf_dist.data.shards import no_validation_fix, read_manifest
from mhf_dist.errors import TrainingError
from mhf_dist.eval.perplexity import nll_summary, nll_totals
from mhf_dist.export import export_model, load_exported
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.plugins import register_missing
from mhf_dist.signatures import SignatureTable, load_table
from mhf_dist.storage import Location, local_copy
from mhf_dist.train.callbacks import (
    Checkpoints,
    History,
    MemoryMetrics,
    MLflowSteps,
    ProgressLines,
    SourceTokens,
    StepCallback,
    Validation,
)
from mhf_dist.train.checkpoints import (
    MODEL_DIR,
    STATE_TAG,
    ClientState,
    RunRecord,
    checkpoint_name,
    checkpoint_step,
    loaded_by_rank,
    newest_checkpoint,
    read_client_state,
    read_history,
    write_history,
    write_rank_files,
    write_run_record,
)
from mhf_dist.train.engine import DeepSpeedStepper, uses_bf16
from mhf_dist.train.hardware import default_peak_flops, live_tensor_bytes, peak_memory_bytes
from mhf_dist.train.loop import Throughput, run_training
from mhf_dist.train.trainable import apply_trainable

STAGING_PREFIX = ".staging-"  # each rank's checkpoint files before Ray Train copies them into place

GIB = 2**30


class SourceCounter:
    """Tokens per source (`data.sources`, by `names`) of the batches handed to training since the last
    `take()`."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.counts = names, np.zeros(len(names), dtype=np.int64)

    def add(self, source_tokens: np.ndarray) -> None:
        self.counts += source_tokens.sum(axis=0)

    def take(self) -> list[int]:
        counts, self.counts = self.counts.tolist(), np.zeros_like(self.counts)
        return counts


def training_batches(
    cfg: Config,
    rank: int,
    world_size: int,
    start_step: int,
    signatures: bool,
    counter: SourceCounter | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's rows of every global batch after `start_step`, as tensors; with `counter`, each
    batch's tokens per source are counted as training takes it."""
    reader = RowReader(
        cfg.data.path,
        "train",
        signatures=signatures,
        source_tokens=counter is not None,
        cache_shards=2 * cfg.data.shuffle_window,  # a bucket's shards: the window read and the next
    )
    for batch in step_batches(reader, training_plan(reader, cfg), start_step, rank, world_size):
        if counter is not None:
            counter.add(batch.pop("source_tokens"))
        yield {key: torch.from_numpy(value.astype(np.int64, copy=False)) for key, value in batch.items()}


class Validator:
    """Exact NLL on the first `train.eval_rows` validation rows (0: all), an equal share per rank.

    Equal shares keep ZeRO-3's collective gathers in step: the last len(rows) % world_size rows are left
    out (`val_tokens` says how many tokens were scored)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, batch_size: int) -> None:
        self.rows, self.batch_size = [], batch_size
        if not read_manifest(cfg.data.path).splits["validation"].shards:  # data.val_percent=0
            return
        reader = RowReader(cfg.data.path, "validation", signatures=False)
        scored = min(cfg.train.eval_rows or reader.num_rows, reader.num_rows)
        share = scored // world_size
        self.rows = reader.read_range(rank * share, (rank + 1) * share)["tokens"]

    def __bool__(self) -> bool:
        return len(self.rows) > 0

    def __call__(self, stepper: DeepSpeedStepper) -> dict[str, float]:
        with stepper.whole_parameters():
            total, count = nll_totals(
                stepper.engine.module, self.rows, self.batch_size, stepper.engine.device
            )
        total, count = sum_over_workers([total, count], torch.float64)
        return nll_summary(total, int(count))


def sum_over_workers(values: list, dtype: torch.dtype = torch.int64) -> list:
    tensor = torch.tensor(values, dtype=dtype)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def max_over_workers(values: dict[str, float]) -> dict[str, float]:
    tensor = torch.tensor(list(values.values()), dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(values, tensor.tolist(), strict=True))


@dataclass(frozen=True)
class WorkerSpec:
    """What `ray_trainer.train` hands every worker, bound into the train function: Ray Train's controller
    unpickles the train_loop_config but not the function, so it never imports this module's model code."""

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


def train_loop_per_worker(spec: WorkerSpec) -> None:
    """Runs on every Ray Train worker (torch.distributed is already initialised by TorchTrainer)."""
    import ray.train

    from mhf_dist.models import train_flops_per_token

    register_missing(spec.registrations)  # families the driver's own code registered
    cfg = spec.config
    if not spec.verbose:
        # Ray Train's worker-side INFO lines (one per report) log under module-path names that its
        # LoggingConfig does not reach; the root level does. Progress lines are plain prints.
        logging.getLogger().setLevel(logging.WARNING)
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    torch.manual_seed(cfg.train.seed)
    data, manifest = Location.of(cfg.data.path), read_manifest(cfg.data.path)
    if manifest.content_sha256 != spec.data_sha256:  # `prepare --overwrite` switched the data since
        raise TrainingError(
            f"the prepared data at {data} was replaced after the run was checked (content sha256 "
            f"{manifest.content_sha256[:12]}, checked {spec.data_sha256[:12]}); start the run again "
            "(--continue goes on with the new data)"
        )
    table = load_table(data / manifest.signatures.file)  # checked against the manifest by the driver
    stepper, lineage = _build_stepper(spec, table, world_size)
    start_step, history = _restore(stepper, spec, rank)
    last_step = min(cfg.train.steps, spec.stop_at_step or cfg.train.steps)
    names = [source.name for source in manifest.sources]
    counter = SourceCounter(names) if len(names) > 1 else None
    run_record = RunRecord(
        model=cfg.model.model_dump(mode="json"),
        fingerprint=table.fingerprint,
        workers=world_size,
        zero_stage=cfg.topology.zero_stage,
        lineage=lineage,
        trainable=cfg.train.trainable,  # a resume must freeze the same parameters (no optimizer state)
        document_format=manifest.document_format,  # exports carry the shards'
    )
    tokenizer_file = local_copy(data / manifest.tokenizer.file)
    saver = CheckpointSaver(
        stepper, cfg, table, tokenizer_file, run_record, Location.of(spec.run_dir), rank, world_size, history
    )
    callbacks = [*spec.callbacks, *_built_in_callbacks(spec, saver, start_step, last_step, counter)]
    throughput = Throughput(
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
        flops_per_token=train_flops_per_token(cfg.model, cfg.train.seq_len),
        workers=world_size,
        peak_flops=spec.peak_tflops * 1e12 or default_peak_flops(stepper.engine.device),
    )
    batches = training_batches(cfg, rank, world_size, start_step, cfg.model.family == "mhf", counter)
    run_training(stepper, batches, cfg.train.steps, throughput, start_step, last_step, callbacks)


def _built_in_callbacks(
    spec: WorkerSpec, saver: CheckpointSaver, start_step: int, last_step: int, counter: SourceCounter | None
) -> list[StepCallback]:
    """The step callbacks every worker runs after the spec's own."""
    import ray.train

    train, stepper, rank, world_size = spec.config.train, saver.stepper, saver.rank, saver.world_size
    # Validation, memory and tokens per source on all ranks (they all-reduce), then the history, rank
    # 0's progress lines and MLflow steps, then checkpoints (all ranks save their shards). Validation
    # comes first so that the history, MLflow and the checkpoint each see this step's validation loss.
    callbacks: list[StepCallback] = []
    validator = Validator(spec.config, rank, world_size, micro_batch_size(train, world_size))
    if rank == 0 and not validator:
        fix = no_validation_fix(read_manifest(spec.config.data.path))
        spec.say(f"no validation rows: val_nll is not computed ({fix})")
    if validator:
        callbacks.append(Validation(partial(validator, stepper), train.eval_every, last_step))
    memory = partial(_model_state, stepper), partial(_peak_memory, stepper.engine.device)
    callbacks.append(MemoryMetrics(*memory, start_step + 1, last_step, train))
    if counter is not None:
        callbacks.append(
            SourceTokens(counter.names, counter.take, sum_over_workers, saver.history, last_step, train)
        )
    history = History(saver.history)  # the list the checkpoints store
    callbacks.append(history)
    if rank == 0:
        mlflow = MLflowSteps(
            spec.tracking_uri, spec.run_id, saver.run_dir, history, start_step, last_step, train
        )
        callbacks += [ProgressLines(train, spec.say), mlflow]
    callbacks.append(Checkpoints(saver.save, ray.train.report, last_step, train))
    return callbacks


def _build_stepper(
    spec: WorkerSpec, table: SignatureTable, world_size: int
) -> tuple[DeepSpeedStepper, list[dict]]:
    """The model (built, or the exported one of --init-from) in a DeepSpeed engine; and its lineage."""
    import ray.train

    from mhf_dist.models import build_model

    cfg, lineage = spec.config, []
    if spec.init_from:
        initial = load_exported(spec.init_from)
        model, lineage = initial.model.train(), initial.lineage
    else:
        model = build_model(cfg.model, table)
    apply_trainable(model, cfg.train.trainable)  # before the optimizer sees requires_grad
    use_gpu = cfg.topology.gpus_per_worker > 0
    if use_gpu:
        model = model.to(ray.train.torch.get_device())
    if cfg.train.activation_checkpointing == "layers":
        checkpoint_layers(model)
    if cfg.train.compile:
        model.compile()  # in place: parameter names and the exported model stay as they are
    bf16 = uses_bf16(cfg.train, use_gpu)
    zero_stage, hidden_size = cfg.topology.zero_stage, cfg.model.backbone.hidden_size
    return DeepSpeedStepper(model, cfg.train, zero_stage, world_size, bf16, hidden_size), lineage


def _restore(stepper: DeepSpeedStepper, spec: WorkerSpec, rank: int) -> tuple[int, list[dict[str, float]]]:
    """The step to continue after and the history so far (0 and none for a fresh run): after a worker
    failure, the newer of the run's newest stored checkpoint and the one Ray Train registered (it
    registers only when its controller next polls the workers), else --resume's."""
    import ray.train

    run_dir = Location.of(spec.run_dir)
    registered = ray.train.get_checkpoint()
    candidates = [newest_checkpoint(run_dir)]
    if registered is not None:
        candidates.append(run_dir / PurePosixPath(registered.path).name)
    checkpoint = max(filter(None, candidates), key=checkpoint_step, default=None)
    if checkpoint is None and spec.resume_from:
        checkpoint = Location.of(spec.resume_from)
    if checkpoint is None:
        return 0, []
    with checkpoint.on_disk(partial(loaded_by_rank, rank)) as directory:
        _, saved = stepper.engine.load_checkpoint(str(directory), tag=STATE_TAG)
        history = read_history(directory)
    client_state = read_client_state(saved, checkpoint)
    rng = client_state.rng[rank % len(client_state.rng)]
    torch.set_rng_state(rng.torch)
    np.random.set_state(rng.numpy)
    random.setstate(rng.python)
    if rank == 0:
        spec.say(f"resumed from {checkpoint} at step {client_state.step}")
    return client_state.step, history


def _model_state(stepper: DeepSpeedStepper) -> dict[str, float]:
    model_state_gb = live_tensor_bytes(stepper.engine.device.type) / GIB
    return max_over_workers({"model_state_gb": model_state_gb, "param_share": stepper.parameter_share()})


def _peak_memory(device: torch.device) -> dict[str, float]:
    return max_over_workers({"peak_mem_gb": peak_memory_bytes(device) / GIB})


@dataclass
class CheckpointSaver:
    """Every rank saves its DeepSpeed files, rank 0 the exported model and the history too (the list the
    `History` callback fills); Ray Train merges the ranks' folders into one checkpoint."""

    stepper: DeepSpeedStepper
    cfg: Config
    table: SignatureTable
    tokenizer_file: Path  # the dataset's, copied at the start (a bucket's may be replaced)
    run_record: RunRecord
    run_dir: Location
    rank: int
    world_size: int
    history: list[dict[str, float]]

    def save(self, step: int, metrics: dict[str, float]) -> None:
        import ray.train

        rng_states = [None] * self.world_size
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        torch.distributed.all_gather_object(rng_states, rng)
        # Staged inside the run's own directory (on a local disk), where an interrupted run's driver can
        # remove what is left; for a run in a bucket, in a local temporary directory Ray Train uploads.
        with self.run_dir.staging(STAGING_PREFIX) as tmp:
            directory = Path(tmp)
            client_state = ClientState(step=step, rng=rng_states).model_dump()
            self.stepper.engine.save_checkpoint(tmp, tag=STATE_TAG, client_state=client_state)
            with self.stepper.whole_parameters():  # every rank takes part in ZeRO-3's gather
                if self.rank == 0:
                    export_model(
                        self.stepper.engine.module,
                        self.cfg.model,
                        self.table,
                        self.tokenizer_file,
                        directory / MODEL_DIR,
                        self.run_record.lineage,
                        document_format=self.run_record.document_format,
                    )
                    write_history(directory, self.history)
                    write_run_record(directory, self.run_record)
            write_rank_files(directory, self.rank)  # last: what makes this rank's part count as complete
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=checkpoint_name(step),
            )
