"""Training checkpoints on storage (a local directory or a bucket): one directory per saved step.

`checkpoint-0000100/` holds `state/` (DeepSpeed's shards and a client state with the step and every
rank's RNG states), `history.jsonl`, `run.json` (a `RunRecord`), `model/` (the exported model) and
`rank-N.json` per rank: the files that rank wrote, with their sizes, written last. A checkpoint is
complete when every rank's files are there as listed: Ray Train copies the ranks' folders in one by
one, a node can die in between, and an object store has no rename.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mhf_dist.config import Config, ModelConfig, ZeroStage, flatten
from mhf_dist.data.tokenizer import LEGACY_FORMAT
from mhf_dist.errors import TrainingError, problem_line
from mhf_dist.readers import read_record
from mhf_dist.signatures import check_same_table
from mhf_dist.storage import Location, redact

HISTORY_FILE = "history.jsonl"
RUN_FILE = "run.json"
STATE_TAG = "state"  # DeepSpeed's checkpoint tag
MODEL_DIR = "model"  # the exported model inside each checkpoint
RANK_FILES = "rank-{rank}.json"
_RANK_SHARD = re.compile(r"zero_pp_rank_(\d+)_")  # DeepSpeed's per-rank ZeRO partitions (bf16_ too)


class RunRecord(BaseModel):
    """A checkpoint's `run.json`, checked before a resume; fields after `fingerprint` came later."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    model: dict[str, Any]  # the ModelConfig, as JSON
    fingerprint: str  # the signature table's
    workers: int | None = None  # None: not recorded (such a checkpoint never counts as complete)
    zero_stage: ZeroStage | None = None  # None: not recorded (a resume takes the run's own)
    lineage: list[dict[str, Any]] = Field(default_factory=list)  # vocabularies it grew from (`mhf cpt`)
    # A resume must freeze the same parameters (no optimizer state); not recorded: not checked.
    trainable: list[str] | None = None
    document_format: Literal["bos", "eos"] = LEGACY_FORMAT  # the shards'; exports carry it


def write_run_record(directory: Path, record: RunRecord) -> None:
    (directory / RUN_FILE).write_text(json.dumps(record.model_dump(mode="json"), indent=2))


def read_run_record(checkpoint: Path | Location) -> RunRecord:
    """The checkpoint's `run.json`; a missing, damaged or hand-edited one is a one-line error."""
    fix = "resume from another checkpoint (mhf train --resume)"
    return read_record(Location.of(checkpoint) / RUN_FILE, RunRecord, TrainingError, fix)


class RngStates(BaseModel):
    """One rank's random generators' states, as each library gives them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    torch: Any
    numpy: tuple
    python: tuple


class ClientState(BaseModel):
    """The checkpoint's DeepSpeed client state (DeepSpeed's own keys beside it are ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int = Field(ge=0, strict=True)
    rng: list[RngStates] = Field(min_length=1)  # one per rank that saved; ZeRO-0 may resume on another count


def read_client_state(raw: dict[str, Any], checkpoint: Location) -> ClientState:
    """`raw`, what DeepSpeed loaded from `checkpoint`; a damaged one is a one-line error."""
    try:
        return ClientState.model_validate(raw)
    except ValidationError as err:
        raise TrainingError(
            f"checkpoint {str(checkpoint)!r} has a damaged client state ({problem_line(err)}); resume from "
            "another checkpoint (mhf train --resume)"
        ) from None


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:07d}"


def checkpoint_step(path: Path | Location) -> int:
    """The inverse of `checkpoint_name`."""
    return int(path.name.removeprefix("checkpoint-"))


def _checkpoints(run_dir: Path | Location) -> list[Location]:
    return [path for path in Location.of(run_dir).children() if path.name.startswith("checkpoint-")]


def newest_checkpoint(run_dir: Path | Location) -> Location | None:
    """The run's newest complete checkpoint on storage (looked at newest first)."""
    return next((path for path in reversed(_checkpoints(run_dir)) if is_complete(path)), None)


def prune_checkpoints(run_dir: Path | Location, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; remove older ones and any incomplete one.

    Ray Train deletes old ones only once it has registered the next: a run stopped in between keeps one
    too many."""
    checkpoints = _checkpoints(run_dir)
    kept = [path.uri for path in checkpoints if is_complete(path)][-keep:]
    for path in checkpoints:
        if path.uri not in kept:
            path.remove()


def write_rank_files(directory: Path, rank: int) -> None:
    """List the files this rank put in its part of a checkpoint (call after writing them all)."""
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.name.startswith("rank-")
    }
    (directory / RANK_FILES.format(rank=rank)).write_text(json.dumps(files, indent=1))


def is_complete(path: Path | Location) -> bool:
    """Every rank's listed files are in the checkpoint with their sizes. Rank 0's list names run.json,
    so a damaged record read after it is its one-line error, not an incomplete checkpoint to prune."""
    path = Location.of(path)
    present = dict(path.files())
    if RUN_FILE not in present or not _listed_files_present(path, 0, present):
        return False
    workers = read_run_record(path).workers
    if workers is None:  # from an older layout
        return False
    return all(_listed_files_present(path, rank, present) for rank in range(1, workers))


def _listed_files_present(path: Location, rank: int, present: dict[str, int]) -> bool:
    try:
        listed = json.loads((path / RANK_FILES.format(rank=rank)).read_text())
    except (OSError, ValueError):  # not copied in yet, or half written
        return False
    return isinstance(listed, dict) and all(present.get(name) == size for name, size in listed.items())


def loaded_by_rank(rank: int, name: str) -> bool:
    """Whether rank `rank` loads the checkpoint file `name`: not the other ranks' ZeRO partitions nor the
    exported model (a worker's download does not grow with the worker count)."""
    owner = _RANK_SHARD.search(name)
    return not name.startswith(f"{MODEL_DIR}/") and (owner is None or int(owner.group(1)) == rank)


def read_history(checkpoint: str | Path | Location) -> list[dict[str, float]]:
    """Per-step metrics of a run up to one of its checkpoints."""
    return [json.loads(line) for line in (Location.of(checkpoint) / HISTORY_FILE).read_text().splitlines()]


def write_history(directory: Path, history: list[dict[str, float]]) -> None:
    with open(directory / HISTORY_FILE, "w") as handle:
        handle.writelines(json.dumps(entry) + "\n" for entry in history)


def resolve_resume(target: str, storage: Path | Location) -> Location:
    """`--resume`'s checkpoint directory, or the newest of a run named under the storage path."""
    storage = Location.of(storage)
    path = Location.of(target)
    if (path / RUN_FILE).is_file():
        if not is_complete(path):
            raise TrainingError(
                f"checkpoint {redact(target)!r} is incomplete (a rank's files are missing or cut short); "
                "resume from an earlier checkpoint or the run's name (its newest complete one)"
            )
        return path
    candidates = [path] if path.remote else [path, storage / target]
    for run_dir in candidates:
        if (newest := newest_checkpoint(run_dir)) is not None:
            return newest
    raise TrainingError(
        f"--resume {redact(target)!r} is neither a checkpoint directory nor a run with checkpoints under "
        f"{str(storage)!r}; pass a checkpoint-* directory or a run name"
    )


def check_resumable(path: Path | Location, cfg: Config, fingerprint: str) -> None:
    """The checkpoint must have the run's model, signature table and ZeRO stage; ZeRO 1-3 partition the
    optimizer state per worker, so only a ZeRO-0 checkpoint resumes on another worker count."""
    workers, zero_stage = cfg.topology.workers, cfg.topology.zero_stage
    path = Location.of(path)
    run = read_run_record(path)
    saved_stage = zero_stage if run.zero_stage is None else run.zero_stage
    saved_workers = workers if run.workers is None else run.workers
    if saved_stage != zero_stage:
        raise TrainingError(
            f"checkpoint {str(path)!r} was saved under ZeRO-{saved_stage}; resume it with --zero-stage "
            f"{saved_stage}"
        )
    if saved_workers != workers and zero_stage != 0:
        raise TrainingError(
            f"checkpoint {str(path)!r} holds ZeRO-{zero_stage} optimizer shards of {saved_workers} workers; "
            f"resume it with --workers {saved_workers} (only ZeRO-0 checkpoints resume on another count)"
        )
    fix = "resume with the shards the run was trained on"
    check_same_table(
        f"checkpoint {str(path)!r}", run.fingerprint, cfg.data.path, fingerprint, fix, TrainingError
    )
    saved_trainable = run.trainable if "trainable" in run.model_fields_set else cfg.train.trainable
    if (saved_trainable or None) != (cfg.train.trainable or None):
        saved = json.dumps(run.trainable)
        raise TrainingError(
            f"checkpoint {str(path)!r} was trained with train.trainable={saved} (frozen parameters have "
            f"no optimizer state); resume with --set 'train.trainable={saved}'"
        )
    if changed := _model_difference(run.model, cfg):
        raise TrainingError(
            f"checkpoint {str(path)!r} was trained with a different model config ({changed}); "
            "resume with the same model settings"
        )


def _model_difference(saved: dict[str, Any], cfg: Config) -> str:
    """The model keys whose saved value differs from the run's, each with both values ("" when none). A
    record older than a key has its default (one that no longer validates is compared as it is)."""
    with contextlib.suppress(ValidationError):
        saved = ModelConfig.model_validate(saved).model_dump(mode="json")
    saved, run = dict(flatten(saved)), dict(flatten(cfg.model.model_dump(mode="json")))
    changed = sorted(key for key in saved.keys() | run.keys() if saved.get(key) != run.get(key))
    return "; ".join(f"model.{key} {saved.get(key)!r}, the run's {run.get(key)!r}" for key in changed)


def check_initial_model(path: Path, cfg: Config, fingerprint: str) -> None:
    """An `--init-from` model must have the run's model config and signature table."""
    from mhf_dist.export import read_export_config

    description = read_export_config(path)
    path = redact(str(path))
    fix = f"prepare the data with the model's tokenizer.json and --set data.signatures={path}"
    model = f"model {path!r}"
    check_same_table(model, description.signature_fingerprint, cfg.data.path, fingerprint, fix, TrainingError)
    if changed := _model_difference(description.model, cfg):
        raise TrainingError(
            f"model {path!r} has another model config than the run ({changed}); start from a matching "
            "model or change the run's model settings"
        )
