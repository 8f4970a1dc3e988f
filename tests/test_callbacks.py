"""The step callbacks, each alone around `run_training` with a fake `Stepper` (no Ray, no DeepSpeed)."""

import time

import pytest

from mhf_dist.config import load_config
from mhf_dist.errors import TrainingError
from mhf_dist.tracking import start_run
from mhf_dist.train.callbacks import (
    Checkpoints,
    History,
    MemoryMetrics,
    MLflowSteps,
    ProgressLines,
    SourceTokens,
    Validation,
)
from mhf_dist.train.loop import Throughput, run_training


class FakeStepper:
    """Loss 1/step, as a trained model's would fall; `seconds` of compute per step."""

    def __init__(self, seconds: float = 0.0, losses: dict[int, float] | None = None) -> None:
        self.steps, self.seconds, self.losses = 0, seconds, losses or {}

    def step(self, batch):
        self.steps += 1
        time.sleep(self.seconds)
        return {"loss": self.losses.get(self.steps, 1.0 / self.steps), "lr": 1e-3}


def batches(wait_s: float = 0.0):
    while True:
        time.sleep(wait_s)
        yield {}


def train_cfg(*overrides):
    return load_config("tiny", ["train.steps=10", "train.log_every=4", *overrides]).train


def run(callbacks, steps=10, start_step=0, stop_step=None, stepper=None, wait_s=0.0):
    stepper = stepper or FakeStepper()
    throughput = Throughput(tokens_per_step=64)
    return run_training(stepper, batches(wait_s), steps, throughput, start_step, stop_step, callbacks)


class Counter:
    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, *args):
        self.calls.append(args)
        return {self.name: float(len(self.calls))}


def steps_with(history, key):
    return [int(h["step"]) for h in history if key in h]


@pytest.mark.parametrize(
    ("every", "stop_step", "expected"),
    [(3, None, [3, 6, 9, 10]), (0, None, [10]), (3, 7, [3, 6, 7]), (5, None, [5, 10])],
)
def test_validation_runs_every_n_steps_and_at_the_last_step_of_the_run(every, stop_step, expected):
    validate = Counter("val_nll")
    history = run([Validation(validate, every, stop_step or 10)], stop_step=stop_step)
    assert steps_with(history, "val_nll") == expected
    assert [h["val_nll"] for h in history if "val_nll" in h] == list(range(1, len(expected) + 1))


def test_later_callbacks_see_what_earlier_ones_added_in_list_order():
    cfg = train_cfg("train.checkpoint_every=5")
    lines, saved = [], {}
    validation = Validation(lambda: {"val_nll": 2.0, "val_ppl": 7.389}, 4, 10)
    history = History()
    save = Checkpoints(lambda step, m: saved.update({step: dict(m)}), lambda m: None, 10, cfg)
    run([validation, history, ProgressLines(cfg, lines.append), save])
    assert [line.split(" | ")[0] for line in lines] == ["step 4/10", "step 8/10", "step 10/10"]
    assert all("val ppl 7.39" in line for line in lines)  # validation ran before the progress line
    assert "val_nll" in saved[10] and "val_nll" not in saved[5]
    assert [int(h["step"]) for h in history.entries] == list(range(1, 11))


def test_memory_is_measured_once_after_the_first_step_and_its_peak_at_log_steps():
    cfg = train_cfg()
    state, peak = Counter("model_state_gb"), Counter("peak_mem_gb")
    history = run([MemoryMetrics(state, peak, 7, 9, cfg)], start_step=6, stop_step=9)  # a resumed run
    assert steps_with(history, "model_state_gb") == [7] and len(state.calls) == 1
    assert steps_with(history, "peak_mem_gb") == [8, 9]


def test_checkpoints_are_saved_every_n_steps_and_last_and_other_log_steps_only_report():
    cfg = train_cfg("train.checkpoint_every=3")
    save, report = Counter("saved"), Counter("reported")
    run([Checkpoints(save, report, 10, cfg)])
    assert [args[0] for args in save.calls] == [3, 6, 9, 10]
    assert [int(args[0]["step"]) for args in report.calls] == [4, 8]  # 12 would be a saved one too


def test_each_step_reaches_mlflow_exactly_once_across_a_restart_from_a_checkpoint(tmp_path):
    """Steps 1-6 run and log, the run dies after 6; it restarts from its step-4 checkpoint, recomputes 5
    and 6 and runs on to 10: MLflow holds every step once."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = start_run(uri, "callbacks", "restart", {}, {})
    cfg = train_cfg("train.log_every=2", "train.checkpoint_every=4")
    first = History()
    run([first, MLflowSteps(uri, run_id, tmp_path, first, 0, 10, cfg)], stop_step=6)
    resumed = History(first.entries[:4])  # what the step-4 checkpoint's history holds
    logger = MLflowSteps(uri, run_id, tmp_path, resumed, 4, 10, cfg)
    run([resumed, logger], start_step=4)
    logged = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss")
    assert sorted(metric.step for metric in logged) == list(range(1, 11))
    # Another MLflow run in the same directory (a new run name's) logs from its own start.
    other = start_run(uri, "callbacks", "other", {}, {})
    again = History(first.entries[:4])
    run([again, MLflowSteps(uri, other, tmp_path, again, 4, 10, cfg)], start_step=4)
    logged = MlflowClient(tracking_uri=uri).get_metric_history(other, "loss")
    assert sorted(metric.step for metric in logged) == list(range(5, 11))


def test_step_time_data_wait_and_tokens_per_second_measure_the_step():
    throughput = Throughput(tokens_per_step=64, flops_per_token=1000, workers=2, peak_flops=1e6)
    history = run_training(FakeStepper(seconds=0.05), batches(wait_s=0.03), 3, throughput)
    for h in history:
        # lower bounds: what the sleeps take; upper bounds generous for a loaded machine
        assert 0.05 <= h["step_time"] < 1 and 0.03 <= h["data_wait_s"] < 1
        assert h["tokens_per_s"] == pytest.approx(64 / (h["step_time"] + h["data_wait_s"]))
        assert h["tokens_per_s"] <= 64 / 0.08 and h["tokens_per_s_per_worker"] == h["tokens_per_s"] / 2
        # MFU: 1000 FLOPs per token against two workers of 1 MFLOP/s each
        assert h["mfu"] == pytest.approx(h["tokens_per_s"] * 1000 / 2e6)
    assert history[-1]["eta_s"] == 0 and history[0]["eta_s"] > history[1]["eta_s"] > 0


def test_a_non_finite_loss_stops_training_before_any_callback_sees_the_step():
    seen = History()
    with pytest.raises(TrainingError, match="loss is nan at step 3"):
        run([seen], stepper=FakeStepper(losses={3: float("nan")}))
    assert [int(h["step"]) for h in seen.entries] == [1, 2]


def test_tokens_per_source_are_summed_over_workers_cumulatively_and_continue_after_a_resume():
    """Each step a worker takes 3 tokens of `web` and 1 of `code`; `total` stands for an all-reduce over
    2 workers. Counts are added up at log steps (4, 8), checkpoint steps (3, 6, 9) and the last (10), and
    a run resumed from the step-3 checkpoint starts from the history's counts there, not from zero."""
    cfg = train_cfg("train.checkpoint_every=3")
    taken = []  # what each pending() call handed over (the steps since the last call)

    def pending():
        steps = len(history.entries) + 1 - sum(taken)
        taken.append(steps)
        return [3 * steps, 1 * steps]

    history = History()
    tokens = SourceTokens(["web", "code"], pending, lambda counts: [2 * c for c in counts], [], 10, cfg)
    run([tokens, history])
    assert steps_with(history.entries, "tokens_seen.web") == [3, 4, 6, 8, 9, 10]
    assert [h["tokens_seen.web"] for h in history.entries if "tokens_seen.web" in h] == [
        18,
        24,
        36,
        48,
        54,
        60,
    ]
    assert history.entries[-1]["tokens_seen.code"] == 20  # 10 steps x 1 token x 2 workers

    resumed = History(history.entries[:3])
    taken.clear()
    taken.append(3)  # the batches of steps 1-3 were counted before the checkpoint
    again = SourceTokens(
        ["web", "code"], pending, lambda counts: [2 * c for c in counts], resumed.entries, 10, cfg
    )
    history = resumed
    run([again, resumed], start_step=3)
    assert resumed.entries[-1]["tokens_seen.web"] == 60 and resumed.entries[-1]["tokens_seen.code"] == 20
