"""The `mhf` command line: every sub-command parses, flags set config keys, mistakes are one line."""

import argparse
import subprocess
import sys

import pytest

from mhf_dist.cli import build_parser, config_overrides, main
from mhf_dist.config import load_config
from mhf_dist.errors import Interrupted

SUB_COMMANDS = next(
    action.choices for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
)


@pytest.mark.parametrize("command", sorted(SUB_COMMANDS))
def test_every_sub_command_prints_its_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: mhf {command}")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train"], {}),  # no flag: the config's own topology holds
        (
            ["train", "--workers", "4", "--gpus-per-worker", "1", "--zero-stage", "2", "--storage", "s"],
            {
                "topology.workers": 4,
                "topology.gpus_per_worker": 1,
                "topology.zero_stage": 2,
                "topology.storage": "s",
            },
        ),
        # a flag given wins over a --set of its key
        (["train", "--set", "topology.workers=4", "--workers", "1"], {"topology.workers": 1}),
        (["train", "--set", "topology.workers=4"], {"topology.workers": 4}),
        (
            [
                *("cpt", "--from", ".", "--data", "builtin", "--zero-stage", "3"),
                *("--replay", "hf:wikitext", "--replay-fraction", "0.5"),
            ],
            {
                "data.corpus": "builtin",
                "topology.zero_stage": 3,
                "data.replay.corpus": "hf:wikitext",
                "data.replay.fraction": 0.5,
            },
        ),
        (["demo", "--workers", "1", "--set", "train.steps=8"], {"train.steps": 8, "topology.workers": 1}),
        (["prepare", "--out", "o", "--set", "data.path=x"], {"data.path": "o"}),
        (
            ["plan", "--gpus", "1", "--gpu-mem-gb", "1", "--seq-len", "64", "--micro-batch", "2"],
            {"train.seq_len": 64, "train.micro_batch_size": 2},
        ),
        (
            ["sweep", "--config", "jobs/matched.sweep.yaml", "--set", "topology.zero_stage=1"],
            {"topology.zero_stage": 1},
        ),
    ],
)
def test_flags_become_overrides_of_the_config_keys_they_name(argv, expected):
    assert config_overrides(build_parser().parse_args(argv)) == expected


def test_train_options_take_only_what_is_not_topology():
    from mhf_dist.cli import _train_options
    from mhf_dist.train.ray_trainer import TrainOptions

    argv = ["train", "--workers", "3", "--storage", "s", "--name", "n", "--stop-at-step", "4"]
    args = build_parser().parse_args(argv)
    assert _train_options(args, load_config("tiny")) == TrainOptions(name="n", stop_at_step=4)


def test_a_topology_flag_reaches_the_config_validation_before_anything_starts(capsys):
    """tiny's batch of 8 rows does not split over 3 workers: refused in one line, from the flag."""
    assert main(["train", "--set", "topology.workers=2", "--workers", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not split over 3 workers" in err and err.count("\n") == 1


def test_plan_reads_its_config_and_defaults_to_its_vocabulary_and_qwen3s(capsys, tmp_path):
    plan = ["plan", "--config", "1b", "--gpus", "8", "--gpu-mem-gb", "80"]
    assert main(plan) == 0
    lines = capsys.readouterr().out.splitlines()  # DeepSpeed's import may print a line first
    head = next(i for i, line in enumerate(lines) if line.startswith("preset 1b, H4B16K, seq_len 2048;"))
    rows = [line.split("|")[1:3] for line in lines[head + 3 : head + 7]]
    assert [(family.strip(), vocab.strip()) for family, vocab in rows] == [
        ("mhf", "32,768"),  # 1b's model.vocab_size
        ("qwen3", "32,768"),
        ("mhf", "151,936"),
        ("qwen3", "151,936"),
    ]
    assert main([*plan, "--set", "model.vocab_size=151936"]) == 0
    assert "32,768" not in capsys.readouterr().out  # one vocabulary when the config's is Qwen3's

    # a file that starts from a preset is named as the file, not as the preset it changes
    derived = tmp_path / "my1b.yaml"
    derived.write_text("preset: 1b\ntrain: {steps: 10}\n")
    for command in ("plan", "count"):
        argv = [command, "--config", str(derived), *(plan[3:] if command == "plan" else [])]
        assert main(argv) == 0
        assert f"config {derived} (preset 1b), " in capsys.readouterr().out


def test_a_stop_past_the_last_step_is_refused_before_anything_starts(capsys, tmp_path):
    data = f"data.path={tmp_path / 'data'}"
    for stop in ("10", "11"):  # --prepare too: nothing is prepared first
        argv = ["train", "--set", "train.steps=10", "--set", data, "--stop-at-step", stop, "--prepare"]
        assert main([*argv, "--storage", str(tmp_path)]) == 2
        assert capsys.readouterr().err == (
            f"error: --stop-at-step {stop} is not before the run's last step (train.steps=10); give a step "
            "before it, or drop --stop-at-step\n"
        )
    assert not list(tmp_path.iterdir())


def test_an_unknown_init_new_rows_is_refused_while_parsing(capsys):
    assert main(["cpt", "--from", ".", "--data", "builtin", "--init-new-rows", "zeros"]) == 2
    err = capsys.readouterr().err
    assert "--init-new-rows: invalid choice: 'zeros' (choose from 'subword', 'mean')" in err


def test_submit_env_must_name_a_variable_of_the_spec_before_any_connection(capsys):
    """`--env NAME=...` fills `${NAME}` in the spec's env_vars; a name it lacks would be dropped unseen."""
    address = ["--address", "http://127.0.0.1:1"]  # nothing listens: the check comes first
    assert main(["submit", "jobs/pretrain.job.yaml", *address, "--env", "MHF_STORAGEE=/s"]) == 2
    assert capsys.readouterr().err == (
        "error: --env MHF_STORAGEE: the job spec has no ${MHF_STORAGEE} (it names MHF_STORAGE, "
        "MLFLOW_TRACKING_URI); drop it\n"
    )


def test_submit_env_must_be_key_value(capsys):
    assert main(["submit", "jobs/pretrain.job.yaml", "--env", "MHF_STORAGE"]) == 2
    assert capsys.readouterr().err == (
        "error: mhf submit: argument --env: 'MHF_STORAGE': write NAME=VALUE, NAME of letters, digits and _, "
        "e.g. MHF_STORAGE=/shared/mhf; see `mhf submit --help`\n"
    )


def test_output_into_a_closed_pipe_ends_quietly():
    """`mhf count | head -1`: the reader leaves before mhf writes; no BrokenPipeError traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mhf_dist.cli", "count"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait() == 141, err  # 128 + SIGPIPE, as a shell reports a writer whose reader left
    assert "BrokenPipeError" not in err and "Traceback" not in err


def test_an_error_raised_while_an_interrupt_unwinds_still_ends_as_the_interrupt(monkeypatch, capsys):
    """A library's clean-up that fails during the unwinding (a traceback otherwise) is still a stop."""
    import mhf_dist.cli as cli

    def interrupted_then_clean_up_fails(args):
        try:
            raise Interrupted("SIGTERM; rerun the command to start again", 143)
        finally:
            raise ConnectionError("Found multiple active Ray instances")

    monkeypatch.setattr(cli, "cmd_count", interrupted_then_clean_up_fails)
    assert main(["count"]) == 143
    assert capsys.readouterr().err == "interrupted: SIGTERM; rerun the command to start again\n"

    def plain_failure(args):
        raise ConnectionError("not an interrupt")

    monkeypatch.setattr(cli, "cmd_count", plain_failure)
    with pytest.raises(ConnectionError):
        main(["count"])
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval import harness  # mhf-lm-eval reports the same way

    monkeypatch.setattr(harness, "_evaluate", lambda: interrupted_then_clean_up_fails(None))
    with pytest.raises(SystemExit) as stop:
        harness.cli()
    assert stop.value.code == 143
    assert capsys.readouterr().err == "interrupted: SIGTERM; rerun the command to start again\n"
