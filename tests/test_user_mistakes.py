"""Mistakes a user makes that once went through without a word, or as a traceback: each one line and
exit 2, or said on the console (issue 43's classes; `test_contract.py` holds every argument to its kind)."""

import json
import re
import subprocess

import pytest

from mhf_dist.arguments import DIRECTORY
from mhf_dist.cli import main
from mhf_dist.storage import Location, matches


def test_continue_without_a_checkpoint_is_refused_with_the_fix_not_started_afresh(tmp_path, capsys):
    argv = ["train", "--continue", "--name", "never-ran", "--storage", str(tmp_path / "runs")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --continue: run 'never-ran' has no checkpoint in {tmp_path / 'runs'} to go on from; leave "
        "--continue out to start it"
    )
    assert list(tmp_path.iterdir()) == []


def test_count_and_plan_say_when_a_hash_spec_has_fewer_signatures_than_tokens(capsys):
    short = ["count", "--set", "model.hash.spec=H1B64", "--set", "model.vocab_size=300"]
    assert main(short) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "warning: vocabulary of 300 tokens exceeds the 64 signatures of H=1, B=64 (reference scheme): 236 "
        "tokens at least share another's signature and score alike; use more hashes or buckets"
    )
    assert main([*short, "--set", "model.hash.scheme=murmur32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: vocabulary of 300 tokens exceeds the 64 signatures of H=1, B=64 (murmur32 scheme, "
        "collision-free); use more hashes or buckets"
    )
    assert main(["count", "--set", "model.hash.spec=H11B2", "--set", "model.vocab_size=300"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: vocabulary of 300 tokens exceeds the 2 signatures of H=11, B=2 (reference scheme): at B=2 "
        "every token but the padding one has one signature; use more buckets"
    )
    assert main(["count", "--set", "model.hash.spec=H2B64", "--set", "model.vocab_size=300"]) == 0
    assert "warning" not in capsys.readouterr().out
    # `mhf plan` applies the same rule to each vocabulary it plans the mhf family at, and to none other
    plan = ["plan", "--gpus", "8", "--gpu-mem-gb", "80", "--vocab", "300", "--vocab", "50"]
    assert main([*plan, "--set", "model.hash.spec=H1B64"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if "warning" in line] == [
        "warning: vocabulary of 300 tokens exceeds the 64 signatures of H=1, B=64 (reference scheme): 236 "
        "tokens at least share another's signature and score alike; use more hashes or buckets"
    ]
    for spec in ("H1B64", "H11B2"):
        assert main([*plan, "--set", f"model.hash.spec={spec}", "--family", "qwen3"]) == 0
        assert "warning" not in capsys.readouterr().out
    assert main([*plan, "--set", "model.hash.spec=H11B2"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("every token but the padding one has one signature; use more buckets")
    )


def test_a_service_that_is_not_there_is_one_line_within_seconds_not_half_a_minute_of_retries(
    tmp_path, capsys, monkeypatch
):
    import subprocess
    import sys
    import time

    from servers import free_port

    from mhf_dist.data.corpus import corpus_files
    from mhf_dist.errors import DataError

    closed = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", f"http://{closed}")  # the hub, unreachable; the name never cached
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://{closed}")  # read at its import
    for variable in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    start = time.monotonic()
    with pytest.raises(
        DataError, match=r"cannot load Hugging Face dataset 'org/never-cached' \(.* does not answer"
    ):
        corpus_files("hf:org/never-cached")
    assert time.monotonic() - start < 5

    start = time.monotonic()
    argv = ["submit", "jobs/pretrain.job.yaml", "--address", f"ray://{closed}", "--env", "MHF_STORAGE=/s"]
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot reach the Ray Jobs API at ray://{closed} (nothing answers there); start a cluster "
        "(mhf cluster start) or pass --address"
    )
    monkeypatch.setenv("RAY_ADDRESS", f"ray://{closed}")  # `--address auto` goes where RAY_ADDRESS says
    assert main(["submit", "jobs/pretrain.job.yaml", "--address", "auto", "--env", "MHF_STORAGE=/s"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot reach the Ray Jobs API at RAY_ADDRESS=ray://{closed} (nothing answers there); start "
        "a cluster (mhf cluster start) or pass --address"
    )
    monkeypatch.delenv("RAY_ADDRESS")
    assert time.monotonic() - start < 5

    start = time.monotonic()
    prepare = [
        "prepare",
        "--tokenizer",
        "bytes",
        "--set",
        "model.vocab_size=259",
        "--out",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mhf_dist.cli", *prepare],
        env={**__import__("os").environ, "RAY_ADDRESS": f"ray://{closed}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"error: cannot reach the Ray cluster at RAY_ADDRESS=ray://{closed} (nothing answers there); start "
        "it, or unset RAY_ADDRESS to run on a local Ray"
    )
    assert time.monotonic() - start < 15  # the interpreter and mhf's imports included


@pytest.fixture
def byte_model(tmp_path):
    """A tiny exported byte-level mhf model of 64 positions, its tokenizer and signature table."""
    import torch

    from mhf_dist.config import load_config
    from mhf_dist.data.tokenizer import TextTokenizer
    from mhf_dist.export import export_model
    from mhf_dist.models import build_model
    from mhf_dist.signatures import SignatureTable

    tokenizer = TextTokenizer.bytes()
    tokenizer.save(tmp_path / "tokenizer.json")
    overrides = ["model.vocab_size=259", "model.hash.spec=H2B64", "model.backbone.max_position_embeddings=64"]
    cfg = load_config("tiny", overrides).model
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    model = build_model(cfg, table).eval()
    export_model(model, cfg, table, tmp_path / "tokenizer.json", tmp_path / "model")
    return model, tokenizer, tmp_path / "model"


def test_a_text_shorter_than_one_window_is_scored_in_one_shorter_window_and_said(
    byte_model, tmp_path, capsys
):
    import math

    import numpy as np

    from mhf_dist.eval.perplexity import nll_totals, text_scores

    model, tokenizer, exported = byte_model
    text = "a short note"  # the prefix EOS, 12 bytes and EOS: 13 targets, under a window of 64
    short = text_scores(model, tokenizer, [text], 64)
    exact = text_scores(model, tokenizer, [text], 13)  # the same window asked for
    assert short["window"] == 13 and "window" not in exact
    assert (short["val_nll"], short["val_tokens"], short["bits_per_byte"]) == (
        exact["val_nll"], exact["val_tokens"], exact["bits_per_byte"]
    )  # fmt: skip
    (tmp_path / "note.txt").write_text(text)
    argv = ["eval", "--model", str(exported), "--task", "ppl", "--data", str(tmp_path / "note.txt")]
    assert main([*argv, "--seq-len", "64"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "scored in one window of 13 tokens: the text is shorter than 64"
    )
    # Past whole windows, the rest is scored in one shorter window too: no target left out.
    longer = "b" * 99  # EOS, 99 bytes and EOS: 100 targets = one window of 64 and one of 36
    whole = text_scores(model, tokenizer, [longer], 64)
    assert whole["val_tokens"] == 100 and whole["last_window"] == 36 and "window" not in whole
    ids = np.asarray([tokenizer.eos_id, *tokenizer.encode_documents([longer], "eos")[0]])
    windows = [nll_totals(model, ids[None, :65])[0], nll_totals(model, ids[None, 64:])[0]]
    assert whole["val_nll"] * 100 == pytest.approx(sum(windows), rel=1e-9)
    assert whole["bytes"] == 100 and whole["bits_per_byte"] == pytest.approx(sum(windows) / math.log(2) / 100)
    (tmp_path / "longer.txt").write_text(longer)
    assert main([*argv[:-1], str(tmp_path / "longer.txt"), "--seq-len", "64"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "scored in windows of 64 tokens, the last of 36, no context carried across windows"
    )


def test_lm_eval_never_reads_past_the_models_positions(byte_model):
    """lm-eval's default max_length (1024) is lowered to a model of 64 positions; asking past them is
    refused, not scored with positions the model never learned."""
    from mhf_dist.eval.harness import MhfHarnessLM
    from mhf_dist.eval.tasks import EvalDataError

    _, _, exported = byte_model
    assert MhfHarnessLM(str(exported)).max_length == 64
    assert MhfHarnessLM(str(exported), max_length="32").max_length == 32
    with pytest.raises(EvalDataError) as refused:
        MhfHarnessLM(str(exported), max_length="128")
    assert str(refused.value) == (
        "max_length is 128, above the model's max_position_embeddings 64; pass max_length=64 or less"
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "s3:/bucket/runs",
            r"'s3:/bucket/runs' is missing a slash of s3://: write s3://bucket/runs, or \./s3:",
        ),
        (
            "GS:bucket",
            r"'GS:bucket' is missing a slash of gs://: write gs://bucket, or \./GS:bucket if it is",
        ),
        (
            "file://otherhost/runs",
            "'file://otherhost/runs' is no absolute path on this machine; write file:///",
        ),
        ("file:runs", "'file:runs' is no absolute path on this machine"),
        ("file://me:s3cret@localhost/x", r"'file://localhost/x': a file: URI takes no user; write file:///"),
        ("file:///x/run#1", r"a file: URI keeps no \? or #; write them as %3F and %23"),
        ("file:///x/%00", r"'file:///x/%00' holds a NUL byte \(%00\), which no path may; remove it"),
        ("az:/container/x", r"'az:/container/x' is missing a slash of az://: write az://container/x, or"),
    ],
)
def test_a_mistyped_uri_is_one_line_not_a_local_folder(text, says, tmp_path, monkeypatch, capsys):
    """As a storage flag and as a config key alike; the local folder the advice names is then taken."""
    monkeypatch.chdir(tmp_path)
    for argv in (["compare", "--storage", text], ["train", "--set", f"topology.storage={text}"]):
        assert main(argv) == 2
        assert re.search(says, capsys.readouterr().err.strip().splitlines()[-1])
    assert list(tmp_path.iterdir()) == []
    assert Location.of("file://LOCALHOST/x/a%20b").path == Location.of("file:/x/a b").path == "/x/a b"
    (tmp_path / "t.txt").write_text("a glob in a file: URI matches as the plain path's\n")
    assert [where.path for where, _ in matches(f"file://{tmp_path}/*.txt")] == [str(tmp_path / "t.txt")]
    (tmp_path / "t.txt").unlink()
    (tmp_path / "s3:" / "bucket").mkdir(parents=True)  # the advice's ./s3:/bucket, read back as it is
    assert Location.of(DIRECTORY("./s3:/bucket")).path == str(tmp_path / "s3:" / "bucket")


def test_a_cluster_stop_signals_and_removes_only_what_its_start_made(tmp_path, capsys):
    """A recorded PID may belong to another process by now (the nodes died, the machine restarted), and a
    moved or hand-edited cluster.json may name anything: neither is signalled or removed."""
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    state = {"directory": "/nowhere", "address": "127.0.0.1:1", "dashboard_url": "http://127.0.0.1:2"}
    try:
        for record, problem in [
            ({}, "directory: Field required"),
            ([], "Input should be a mapping of its keys"),
            ({**state, "temp_dir": str(victim), "pids": [bystander.pid]}, "temp_dir: String should match"),
        ]:
            (cluster / "cluster.json").write_text(json.dumps(record))
            assert main(["cluster", "stop", "--dir", str(cluster)]) == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"error: '{cluster / 'cluster.json'}' is damaged or was edited ({problem}")
            assert bystander.poll() is None and (victim / "data").is_dir()
        sessions = tmp_path / "mhf-ray-stale"
        (sessions / "head").mkdir(parents=True)
        (cluster / "cluster.json").write_text(
            json.dumps({**state, "temp_dir": str(sessions), "pids": [bystander.pid]})
        )
        assert main(["cluster", "stop", "--dir", str(cluster)]) == 0
        assert bystander.poll() is None and (victim / "data").is_dir()
        assert not sessions.exists() and not (cluster / "cluster.json").exists()
    finally:
        bystander.kill()
        bystander.wait()
