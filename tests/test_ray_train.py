"""`mhf train`: Ray Train V2 workers driving DeepSpeed ZeRO engines on CPU, checkpoints, exact resume."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import servers
from faults import KillLastWorker, train_process

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader
from mhf_dist.errors import ConfigError, MhfError, TrainingError
from mhf_dist.eval.perplexity import evaluate_rows
from mhf_dist.export import load_exported
from mhf_dist.storage import Location
from mhf_dist.tracking import TrackingError
from mhf_dist.train.checkpoints import (
    MODEL_DIR,
    check_resumable,
    is_complete,
    newest_checkpoint,
    prune_checkpoints,
    read_history,
    resolve_resume,
    write_rank_files,
)
from mhf_dist.train.engine import deepspeed_config
from mhf_dist.train.ray_trainer import TrainOptions, train

TINY_BYTES = [
    "data.tokenizer=bytes",
    "model.vocab_size=259",
    "model.hash.spec=H2B64",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.log_every=5",
    "train.lr=3e-3",
    "train.warmup_steps=3",
]


@pytest.fixture(scope="module")
def shards(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "data"
    prepare(load_config("tiny", [*TINY_BYTES, f"data.path={path}"]), path, log=lambda _: None)
    return path


RUN = {"model": {}, "fingerprint": "f" * 64}  # what every run.json holds; a test adds the rest


def run_cfg(shards, *extra):
    return load_config("tiny", [*TINY_BYTES, f"data.path={shards}", *extra])


def test_deepspeed_config_follows_ours():
    cfg = load_config("tiny", ["train.batch_size=8", "train.grad_clip=0.5"]).train
    ds = deepspeed_config(cfg, zero_stage=2, world_size=2, bf16=False, hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    with pytest.raises(ConfigError, match="does not split over 3 workers"):
        deepspeed_config(cfg, zero_stage=0, world_size=3, bf16=False, hidden_size=64)


def check_trained_and_exported(result, cfg, shards, zero_stage):
    """20 steps: the loss fell, validation ran at 10 and 20, memory was measured where the callbacks
    say (how: test_callbacks, test_plan), ZeRO-3 partitioned the parameters, the exported model matches.
    """
    history = read_history(result.checkpoint)
    assert [metrics["step"] for metrics in history] == list(range(1, 21))
    first, last = sum(h["loss"] for h in history[:3]) / 3, sum(h["loss"] for h in history[-3:]) / 3
    assert last < first - 0.5
    assert [h["step"] for h in history if "val_nll" in h] == [10, 20]
    assert [h["step"] for h in history if "model_state_gb" in h] == [1]
    assert [h["step"] for h in history if "peak_mem_gb" in h] == [5, 10, 15, 20]
    # ZeRO-3 partitions the parameters: each of the two ranks holds half of them (plus padding).
    assert (0.5 <= history[0]["param_share"] < 0.52) if zero_stage == 3 else history[0]["param_share"] == 1
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)
    # CPUs have no known peak: MFU exists only because --peak-tflops reached the workers (its arithmetic,
    # and the rates': test_callbacks).
    assert all(h["mfu"] > 0 for h in history)
    # The exported model (ZeRO-3 shards gathered) scores the validation rows exactly as training did:
    # eval_rows=41 cut to 40, 20 per worker.
    exported = load_exported(result.checkpoint / MODEL_DIR)
    assert exported.config == cfg.model
    val_rows = RowReader(shards, "validation").read_range()["tokens"]
    local = evaluate_rows(exported.model, val_rows[:40])
    assert local["val_tokens"] == history[-1]["val_tokens"] == 40 * 32
    assert local["val_nll"] == pytest.approx(history[-1]["val_nll"], rel=1e-5)
    return history


PEAK_TFLOPS = 0.05  # per worker, as --peak-tflops gives it: MFU is measured against it
TRAIN_AND_EVAL = ("train.steps=20", "train.eval_every=10", "train.eval_rows=41", "train.checkpoint_every=10")


def test_ray_trains_controller_is_handed_nothing_that_imports_the_model_code(tmp_path):
    """Ray Train's controller unpickles the trainer's run context (the train function reaches it as an
    object reference it never opens): the spec rides in the function, so no fit's controller spends seconds
    importing transformers and the models."""
    import subprocess
    import sys

    import cloudpickle

    from mhf_dist.train.ray_trainer import _trainer
    from mhf_dist.train.worker import WorkerSpec

    cfg = load_config("tiny")
    spec = WorkerSpec(cfg, "0" * 64, str(tmp_path), f"sqlite:///{tmp_path / 'mlflow.db'}", "run")
    trainer = _trainer(spec, cfg, TrainOptions(), Location.of(tmp_path), None)
    imported = (
        "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
        "print([m for m in ('transformers', 'mhf_dist.models', 'mhf_dist.train.worker') if m in sys.modules])"
    )
    unpickled = subprocess.run(
        [sys.executable, "-c", imported],
        input=cloudpickle.dumps(trainer.train_run_context),
        capture_output=True,
    )
    assert unpickled.returncode == 0 and unpickled.stdout == b"[]\n", unpickled.stderr[-2000:]


# Stages 1 (the MLflow server test) and 0 (resume) train mhf over qwen3; these two train the
# triple-latent family's standard form, and mhf on the exact-V objective under ZeRO-3, where the decoder
# reads the encoder's partitioned table (tied, registered in both modules so both gather it).
@pytest.mark.parametrize(
    ("zero_stage", "model"),
    [(2, ["model.family=gated_hybrid"]), (3, ["model.family=mhf", "model.hash.loss=vocab"])],
    ids=["gated_hybrid", "mhf-vocab-loss"],
)
def test_each_zero_stage_on_two_cpu_workers_lowers_the_loss_and_exports_the_model(
    shards, tmp_path, zero_stage, model
):
    cfg = run_cfg(
        shards, *TRAIN_AND_EVAL, *model, f"topology.zero_stage={zero_stage}", f"topology.storage={tmp_path}"
    )
    options = TrainOptions(name="zero", peak_tflops=PEAK_TFLOPS)
    check_trained_and_exported(train(cfg, options), cfg, shards, zero_stage)
    # DeepSpeed JIT-built nothing: its CPU shared-memory all-reduce is skipped (skip_cpu_shm_comm_op).
    assert list(Path(os.environ["TORCH_EXTENSIONS_DIR"]).iterdir()) == []


@pytest.fixture(scope="module")
def few_rows(ray_session, tmp_path_factory):
    """60 training rows in 4 shards: an epoch is 7 steps of 8, so 10 steps cross into the second."""
    path = tmp_path_factory.mktemp("few") / "data"
    prepare(load_config("tiny", [*FEW_ROWS, f"data.path={path}"]), path, log=lambda _: None)
    return path


FEW_ROWS = [
    "data.corpus=recall",
    "model.vocab_size=40",
    "train.seq_len=32",
    "data.recall.examples=60",
    "data.rows_per_shard=16",
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
]


def test_resumed_and_crashed_runs_reproduce_the_uninterrupted_loss_curve(few_rows, tmp_path):
    """10 shuffled steps over an epoch boundary == 5 + resume + 5, where the 2-worker ZeRO-0 run resumes
    on 1 worker (accumulating 2 micro-batches where each worker took one) and loses it at step 7."""
    from mlflow.tracking import MlflowClient

    stored = [f"data.path={few_rows}", f"topology.storage={tmp_path}"]
    cfg = load_config("tiny", [*FEW_ROWS, *stored, "train.steps=10", "train.checkpoint_every=5"])
    last = train(cfg, TrainOptions(name="whole")).checkpoint
    whole = read_history(last)
    assert whole[-1]["loss"] < whole[0]["loss"]
    # A checkpoint missing one rank's file is incomplete: the fall-back passes over it to the step-5 one.
    assert newest_checkpoint(tmp_path / "whole") == last and last.name == "checkpoint-0000010"
    listed = {rank: json.loads((last / f"rank-{rank}.json").read_text()) for rank in (0, 1)}
    name = next(name for rank in (1, 0) for name in sorted(listed[rank]) if "state" in name)  # rank 1's first
    (last / name).remove()
    assert newest_checkpoint(tmp_path / "whole").name == "checkpoint-0000005"
    with pytest.raises(TrainingError, match="is incomplete"):
        resolve_resume(str(last), tmp_path)
    half = train(cfg, TrainOptions(name="half", stop_at_step=5)).checkpoint
    # The same seed gives the same curve, bit for bit.
    assert [(h["step"], h["loss"]) for h in read_history(half)] == [(h["step"], h["loss"]) for h in whole[:5]]

    # Resumed by run name (its newest checkpoint); the worker dies at step 7, after the step-6 checkpoint.
    faulty = load_config(
        "tiny", [*FEW_ROWS, *stored, "train.steps=10", "train.checkpoint_every=2", "topology.workers=1"]
    )
    fault = KillLastWorker(step=7, marker=tmp_path / "rest" / "fault-injected")
    rest = train(faulty, TrainOptions(name="rest", resume="half", max_failures=1), worker_callbacks=[fault])
    assert fault.marker.is_file()
    resumed = read_history(rest.checkpoint)
    assert [h["step"] for h in resumed] == list(range(1, 11))  # every step once, none repeated
    for expected, got in zip(whole, resumed, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["lr"] == pytest.approx(expected["lr"], rel=1e-9)
    logged = MlflowClient(tracking_uri=rest.tracking_uri).get_metric_history(rest.run_id, "loss")
    assert sorted(metric.step for metric in logged) == list(range(6, 11))  # each once, crash or not

    other = load_config("tiny", [*FEW_ROWS, *stored, "model.backbone.num_layers=3"])
    with pytest.raises(
        TrainingError,
        match=r"different model config \(model.backbone.num_layers 2, the run's 3\); resume with",
    ):
        train(other, TrainOptions(name="bad", resume=str(half)))
    stage1 = load_config("tiny", [*FEW_ROWS, *stored, "topology.zero_stage=1"])
    with pytest.raises(TrainingError, match="saved under ZeRO-0; resume it with --zero-stage 0"):
        train(stage1, TrainOptions(name="bad", resume=str(half)))
    with pytest.raises(TrainingError, match="already holds checkpoints; go on with --continue, or pick"):
        train(cfg, TrainOptions(name="whole"))
    with pytest.raises(TrainingError, match="is neither a checkpoint directory nor a run"):
        train(cfg, TrainOptions(name="bad", resume="nowhere"))
    # Nothing left to train from a checkpoint, and two starting points, are refused before any worker.
    reached = load_config("tiny", [*FEW_ROWS, *stored, "train.steps=5"])
    for settings, options in ((reached, {}), (cfg, {"stop_at_step": 4})):
        with pytest.raises(
            TrainingError, match=r"is at step 5 and the run ends at step [45] .*nothing is left"
        ):
            train(settings, TrainOptions(name="bad", resume=str(half), **options))
    with pytest.raises(TrainingError, match=r"^--resume goes on from .*; give one of them$"):
        TrainOptions(name="bad", resume=str(half), init_from=str(half / "model"))
    # Shards of another hash seed are not the --init-from model's, with a config that matches them or (said
    # before the shards' seed is advised for the config) the model.
    seven = tmp_path / "seed7"
    prepare(load_config("tiny", [*FEW_ROWS, "model.hash.seed=7"]), seven, log=lambda _: None)
    for seed in ("model.hash.seed=7", "model.hash.seed=0"):
        elsewhere = load_config(
            "tiny", [*FEW_ROWS, seed, f"data.path={seven}", f"topology.storage={tmp_path}"]
        )
        with pytest.raises(
            TrainingError,
            match=r"^model .* has signature fingerprint \w{12} but the shards in '.*seed7' have \w{12}; "
            r"prepare the data with the model's tokenizer.json and --set data.signatures=",
        ):
            train(elsewhere, TrainOptions(name="bad", init_from=str(half / "model")))
    assert not (tmp_path / "bad").exists()


def test_a_partitioned_checkpoint_resumes_only_on_its_own_worker_count_and_stage(tmp_path):
    cfg = load_config("tiny", ["topology.workers=2", "topology.zero_stage=2"])
    run = {"fingerprint": "f" * 64, "model": cfg.model.model_dump(mode="json"), "workers": 2, "zero_stage": 2}
    (tmp_path / "run.json").write_text(json.dumps(run))
    check_resumable(tmp_path, cfg, "f" * 64)
    four = load_config("tiny", ["topology.workers=4", "topology.zero_stage=2"])
    with pytest.raises(
        TrainingError, match="ZeRO-2 optimizer shards of 2 workers; resume it with --workers 2"
    ):
        check_resumable(tmp_path, four, "f" * 64)
    with pytest.raises(TrainingError, match="saved under ZeRO-2; resume it with --zero-stage 2"):
        check_resumable(tmp_path, load_config("tiny", ["topology.zero_stage=1"]), "f" * 64)
    with pytest.raises(
        TrainingError,
        match=r"has signature fingerprint ffffffffffff but the shards in '.*' have eeeeeeeeeeee; "
        "resume with the shards the run was trained on",
    ):
        check_resumable(tmp_path, cfg, "e" * 64)
    other = load_config("tiny", ["topology.workers=2", "topology.zero_stage=2", "model.hash.seed=4"])
    with pytest.raises(
        TrainingError,
        match=r"a different model config \(model.hash.seed 0, the run's 4\); resume with the same",
    ):
        check_resumable(tmp_path, other, "f" * 64)
    run |= {"zero_stage": 0}  # ZeRO-0 state is whole on every rank: any worker count resumes it
    (tmp_path / "run.json").write_text(json.dumps(run))
    check_resumable(tmp_path, load_config("tiny", ["topology.workers=4"]), "f" * 64)


def test_a_hand_edited_run_json_is_one_line_naming_the_file_and_an_old_one_still_resumes(tmp_path):
    cfg = load_config("tiny", ["topology.workers=2", "topology.zero_stage=2"])
    run = {"fingerprint": "f" * 64, "model": cfg.model.model_dump(mode="json"), "workers": 2, "zero_stage": 2}
    (tmp_path / "run.json").write_text(json.dumps(run | {"fingerprint": 7}))
    with pytest.raises(TrainingError) as raised:
        check_resumable(tmp_path, cfg, "f" * 64)
    message = str(raised.value)
    assert message.startswith(f"'{tmp_path / 'run.json'}' is damaged or was edited (fingerprint: ")
    assert message.endswith("; resume from another checkpoint (mhf train --resume)") and "\n" not in message
    for edit, field in (({"workers": "2"}, "workers"), ({"zero_stage": 7}, "zero_stage")):
        (tmp_path / "run.json").write_text(json.dumps(run | edit))
        with pytest.raises(TrainingError, match=rf"run\.json' is damaged or was edited \({field}: "):
            check_resumable(tmp_path, cfg, "f" * 64)
    # A checkpoint from before the topology, trainable split and document format were recorded.
    (tmp_path / "run.json").write_text(json.dumps({key: run[key] for key in ("model", "fingerprint")}))
    check_resumable(tmp_path, cfg, "f" * 64)


def test_a_damaged_client_state_is_one_line_and_what_a_worker_saves_reads_back(tmp_path):
    import random

    import numpy as np
    import torch

    from mhf_dist.train.checkpoints import ClientState, read_client_state

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    saved = ClientState(step=7, rng=[rng, rng]).model_dump() | {"ds_version": "0.18"}  # DeepSpeed's own keys
    where = Location.of(tmp_path / "checkpoint-0000007")
    assert read_client_state(saved, where).step == 7
    for damaged, problem in (
        (saved | {"step": "7"}, "step: Input should be a valid integer"),
        ({"rng": [rng]}, "step: Field required"),
        (saved | {"rng": []}, "rng: List should have at least 1 item after validation, not 0"),
        (saved | {"rng": [{"torch": rng["torch"]}]}, "rng.0.numpy: Field required"),
    ):
        with pytest.raises(TrainingError) as raised:
            read_client_state(damaged, where)
        assert str(raised.value) == (
            f"checkpoint {str(where)!r} has a damaged client state ({problem}); resume from another "
            "checkpoint (mhf train --resume)"
        )


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 with a SQLite backend, stopped after the test."""
    server = servers.MlflowServer(
        f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), tmp_path / "mlflow-server.log"
    )
    yield server.url
    server.stop()


def test_training_logs_every_step_once_to_a_real_mlflow_server(shards, tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = run_cfg(shards, *TRAIN_AND_EVAL, "topology.zero_stage=1", f"topology.storage={tmp_path}")
    result = train(cfg, TrainOptions(name="tracked", experiment="served", peak_tflops=PEAK_TFLOPS))
    history = check_trained_and_exported(result, cfg, shards, zero_stage=1)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["family"] == "mhf"
    assert run.data.params["model.hash.spec"] == "H2B64"
    assert (run.data.params["topology.zero_stage"], run.data.params["topology.workers"]) == ("1", "2")
    losses = client.get_metric_history(result.run_id, "loss")
    assert sorted(metric.step for metric in losses) == list(range(1, 21))
    # Live: logged every train.log_every (5) steps as they ran, not at the two checkpoints.
    batches = {}
    for metric in losses:
        batches.setdefault(metric.timestamp, []).append(metric.step)
    assert sorted(sorted(steps) for steps in batches.values()) == [
        list(range(k, k + 5)) for k in (1, 6, 11, 16)
    ]
    assert [m.step for m in client.get_metric_history(result.run_id, "val_nll")] == [10, 20]
    artifacts = {entry.path for entry in client.list_artifacts(result.run_id)}
    assert {"model", "run.json"} <= artifacts
    assert [metric.value for metric in sorted(losses, key=lambda m: m.step)] == pytest.approx(
        [h["loss"] for h in history]
    )


def test_an_unreachable_tracking_server_fails_before_training(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    with pytest.raises(TrackingError, match=r"cannot use MLflow tracking at 'http://127\.0\.0\.1:9'"):
        train(run_cfg(shards, "train.steps=2", f"topology.storage={tmp_path}"), TrainOptions(name="nowhere"))


def test_data_replaced_after_the_driver_checked_it_stops_the_workers_with_one_line(
    shards, tmp_path, monkeypatch
):
    """The workers train on the prepared data the driver checked: one that `prepare --overwrite`
    switched in between (here the driver saw another content hash) stops the run before a step."""
    from mhf_dist.data.shards import read_manifest
    from mhf_dist.train import ray_trainer

    checked = read_manifest(shards).model_copy(update={"content_sha256": "0" * 64})
    monkeypatch.setattr(ray_trainer, "read_manifest", lambda _: checked)
    with pytest.raises(TrainingError) as raised:
        train(run_cfg(shards, "train.steps=2", f"topology.storage={tmp_path}"), TrainOptions(name="switched"))
    assert str(raised.value) == (
        f"the prepared data at {shards} was replaced after the run was checked (content sha256 "
        f"{read_manifest(shards).content_sha256[:12]}, checked 000000000000); start the run again "
        "(--continue goes on with the new data); no checkpoint was written"
    )


def test_a_run_the_cluster_cannot_place_fails_in_seconds_before_any_worker_starts_leaving_nothing(
    shards, tmp_path
):
    import time

    cases = [
        (
            "topology.workers=8",
            r"--workers 8 x 1 CPU asks for 8 CPUs but the Ray cluster has 4; use --workers 4",
        ),
        ("topology.gpus_per_worker=1", r"asks for 2 GPUs but the Ray cluster has 0; .*--gpus-per-worker 0"),
    ]
    for override, message in cases:
        cfg = run_cfg(shards, "train.steps=2", f"topology.storage={tmp_path / 'runs'}", override)
        start = time.monotonic()
        with pytest.raises(MhfError, match=message):
            train(cfg, TrainOptions(name="placed"))
        assert time.monotonic() - start < 10
    assert not (tmp_path / "runs").exists()  # no run folder, no MLflow store
    # What the topology rules out of the rest of the config is refused before Ray is asked for anything.
    with pytest.raises(ConfigError, match=r"topology.workers: Input should be greater than 0"):
        run_cfg(shards, "topology.workers=0")
    with pytest.raises(
        ConfigError, match=r"train.batch_size=8 does not split over 3 workers.*\(topology.workers=3\)$"
    ):
        train(
            run_cfg(shards, f"topology.storage={tmp_path / 'runs'}", "topology.workers=3"),
            TrainOptions(name="placed"),
        )
    assert not (tmp_path / "runs").exists()


def test_sigint_stops_a_two_worker_fit_in_seconds_and_resume_continues_it(ray_session, tmp_path):
    """Ctrl-C: exit 130 with one line naming the last checkpoint, the MLflow run KILLED, no staging left."""
    import json
    import signal
    import time

    from mlflow.tracking import MlflowClient

    recall = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=2000"]
    cfg = load_config("tiny", [*recall, f"data.path={tmp_path / 'data'}", "train.checkpoint_every=20"])
    prepare(cfg, tmp_path / "data", log=lambda _: None)
    settings = [*recall, f"data.path={tmp_path / 'data'}", "train.checkpoint_every=20", "train.steps=5000"]
    process = train_process(settings, tmp_path, "cut")
    deadline = time.monotonic() + 300
    while not list((tmp_path / "cut").glob("checkpoint-*/run.json")) and time.monotonic() < deadline:
        time.sleep(1)
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and time.monotonic() - sent < 30
    (last_line,) = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
    assert "SIGINT after step" in last_line and "rerun with --continue to go on from it" in last_line
    assert not list((tmp_path / "cut").glob(".staging-*"))
    assert len(list((tmp_path / "cut").glob("checkpoint-*"))) <= cfg.train.keep_checkpoints
    run_id = json.loads((tmp_path / "cut" / "mlflow-run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "KILLED"
    stopped_at = int(last_line.split("after step ")[1].split(";")[0])
    more = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": stopped_at + 4})})
    more = more.model_copy(update={"topology": more.topology.model_copy(update={"storage": str(tmp_path)})})
    resumed = train(more, TrainOptions(name="rest", resume="cut"))
    assert [h["step"] for h in read_history(resumed.checkpoint)] == list(range(1, stopped_at + 5))
    logged = client.get_metric_history(resumed.run_id, "loss")  # only the new steps: it did resume
    assert sorted(metric.step for metric in logged) == list(range(stopped_at + 1, stopped_at + 5))


def test_a_checkpoint_is_complete_only_with_every_ranks_files_at_their_sizes(tmp_path):
    for rank, files in enumerate([["run.json", "state/mp_rank_00.pt"], ["state/zero_pp_rank_1.pt"]]):
        part = tmp_path / f"rank{rank}"
        for name in files:
            (part / name).parent.mkdir(parents=True, exist_ok=True)
            (part / name).write_text(json.dumps(RUN | {"workers": 2}) if name == "run.json" else "x" * 100)
        write_rank_files(part, rank)
        shutil.copytree(part, tmp_path / "checkpoint-0000002", dirs_exist_ok=True)  # as Ray Train merges
    checkpoint = tmp_path / "checkpoint-0000002"
    assert is_complete(checkpoint)
    (checkpoint / "state/zero_pp_rank_1.pt").write_text("x" * 60)  # cut short
    assert not is_complete(checkpoint)
    (checkpoint / "state/zero_pp_rank_1.pt").write_text("x" * 100)
    (checkpoint / "rank-1.json").unlink()  # rank 1's part not copied in yet
    assert not is_complete(checkpoint)


def test_on_an_autoscaling_cluster_the_resource_check_waits_a_bounded_time(monkeypatch):
    from mhf_dist.train.ray_trainer import check_resources

    topology = load_config("tiny", ["topology.workers=8"]).topology
    sizes = iter([{"CPU": 4}, {"CPU": 8}])
    with pytest.raises(TrainingError, match="asks for 8 CPUs but the Ray cluster has 4; use --workers 4"):
        check_resources(topology, lambda: {"CPU": 4})  # no autoscaler: at once
    monkeypatch.setenv("MHF_AUTOSCALING_CLUSTER", "1")
    monkeypatch.setenv("MHF_AUTOSCALING_WAIT_S", "0.5")
    said = []
    check_resources(topology, lambda: next(sizes), log=said.append)  # the autoscaler added a node
    assert said == ["waiting up to 0.5 s for the autoscaler to add CPUs"]
    with pytest.raises(TrainingError, match=r"the Ray cluster has 4 after 0\.5 s of autoscaling"):
        check_resources(topology, lambda: {"CPU": 4}, log=said.append)


def test_pruning_keeps_the_newest_complete_checkpoints_and_removes_incomplete_ones(tmp_path):
    def checkpoint(step, complete=True):
        path = tmp_path / f"checkpoint-{step:07d}"
        (path / "state").mkdir(parents=True)
        (path / "run.json").write_text(json.dumps(RUN | {"workers": 1}))
        (path / "state" / "mp_rank_00.pt").write_text("x" * 10)
        if complete:
            write_rank_files(path, 0)
        return path

    paths = [checkpoint(2), checkpoint(4), checkpoint(6), checkpoint(8, complete=False), checkpoint(10)]
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == [paths[2].name, paths[4].name]
    assert newest_checkpoint(tmp_path).local == paths[4]
    # A complete checkpoint whose run.json was edited is that file's one-line error, never passed over
    # as incomplete (which would resume an older one, or prune it).
    (paths[4] / "run.json").write_text(json.dumps(RUN | {"workers": "1"}))
    write_rank_files(paths[4], 0)
    for call in (lambda: newest_checkpoint(tmp_path), lambda: prune_checkpoints(tmp_path, keep=1)):
        with pytest.raises(TrainingError, match=r"run\.json' is damaged or was edited \(workers: "):
            call()
    assert sorted(path.name for path in tmp_path.iterdir()) == [paths[2].name, paths[4].name]


def test_a_worker_out_of_memory_is_one_line_saying_what_to_change():
    """What the fit raises when a worker's allocator fails or Ray's memory monitor kills it; any other
    failure of a worker stays Ray's own error (a defect, with its traceback)."""
    import ray.exceptions
    import torch
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from mhf_dist.train.ray_trainer import _worker_user_error

    killed = ray.exceptions.ActorDiedError()  # as Ray builds it: its message set from the raylet's
    killed.error_msg = "The actor died: 1 worker(s) were killed due to the node running low on memory."
    failures = [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail"),
        ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."),
        killed,
        WorkerHealthCheckFailedError("A worker health check failed.", killed),  # as the fit hands it over
    ]
    for failure in failures:
        error = _worker_user_error(WorkerGroupError("failed", {1: failure}))
        assert isinstance(error, TrainingError) and "\n" not in str(error)
        assert str(error).startswith("worker 1 ran out of memory (")
        assert "health check" not in str(error)
        assert "lower train.micro_batch_size" in str(error)
    assert "Tried to allocate 2.00 GiB)" in str(_worker_user_error(WorkerGroupError("f", {1: failures[0]})))
    assert _worker_user_error(WorkerGroupError("failed", {0: RuntimeError("a bug")})) is None
