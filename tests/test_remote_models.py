"""Exported models in a bucket (the S3 server on 127.0.0.1): `mhf eval`, `generate`, `export-hf`,
`import-hf` and `cpt --from` read them as they read local ones, models are written to buckets with their
config.json last, and a bad location is one line within seconds."""

import os
import subprocess
import sys
import time

import pytest
import servers
import torch

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.cpt import resolve_parent
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.export import CONFIG_FILE, ExportError, check_documents_fit, export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable
from mhf_dist.storage import Location

TEXTS = "The for statement iterates over items.\n\nA class defines new objects and their methods.\n"
SECRET = servers.S3_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Remote models are copied here, not into the user's ~/.cache."""
    monkeypatch.setenv("MHF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, config, table, tokenizer file) of a random tiny mhf model over the bytes tokenizer."""
    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = TextTokenizer.bytes()
    tokenizer.save(directory / "tokenizer.json")
    cfg = load_config("tiny", ["model.vocab_size=259", "model.hash.spec=H2B64"]).model
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    return build_model(cfg, table).eval(), cfg, table, directory / "tokenizer.json"


def export_to(tiny, where, document_format="eos"):
    model, cfg, table, tokenizer_file = tiny
    return export_model(model, cfg, table, tokenizer_file, where, document_format=document_format)


def remote_files(uri):
    return {name for name, _ in Location.of(uri).files()}


def printed(capsys, argv):
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_eval_and_generate_on_a_model_in_a_bucket_print_exactly_the_local_results(
    tiny, bucket, tmp_path, cache, capsys
):
    local = export_to(tiny, tmp_path / "model")
    assert export_to(tiny, f"{bucket}/model") == Location.of(f"{bucket}/model")
    assert remote_files(f"{bucket}/model") == {path.name for path in local.iterdir()}
    (tmp_path / "texts.txt").write_text(TEXTS)
    Location.of(f"{bucket}/texts.txt").write_text(TEXTS)
    generate = ["--prompt", "The", "--max-new-tokens", "12", "--temperature", "1.0", "--seed", "3"]

    def outputs(model, texts):
        ppl = ["eval", "--model", model, "--task", "ppl", "--data", texts, "--seq-len", "8"]
        return printed(capsys, ppl), printed(capsys, ["generate", "--model", model, *generate])

    expected = outputs(str(local), str(tmp_path / "texts.txt"))
    assert not cache.exists()  # a local model is read in place, never copied
    assert outputs(f"{bucket}/model", f"{bucket}/texts.txt") == expected
    assert "| ppl " in expected[0] and expected[1].startswith("The")
    assert load_exported(f"{bucket}/model").path == Location.of(f"{bucket}/model")


def test_eval_of_a_bucket_model_whose_weights_were_replaced_scores_the_new_weights(
    tiny, bucket, tmp_path, capsys
):
    """Another model's weights of the same size put in place of the bucket's, at once: the cached copy
    is of the old object, and the next eval fetches the new one."""
    _, cfg, table, tokenizer_file = tiny
    export_to(tiny, f"{bucket}/model")
    torch.manual_seed(1)
    other = export_model(build_model(cfg, table).eval(), cfg, table, tokenizer_file, tmp_path / "other")
    (tmp_path / "texts.txt").write_text(TEXTS)
    ppl = ["eval", "--task", "ppl", "--data", str(tmp_path / "texts.txt"), "--seq-len", "8"]
    before = printed(capsys, [*ppl, "--model", f"{bucket}/model"])
    weights = Location.of(f"{bucket}/model/model.safetensors")
    replacement = (other / "model.safetensors").read_bytes()
    assert len(replacement) == weights.size()
    weights.write_bytes(replacement)
    after = printed(capsys, [*ppl, "--model", f"{bucket}/model"])
    assert after != before and after == printed(capsys, [*ppl, "--model", str(other)])


def test_export_hf_to_a_bucket_imports_back_from_it_to_the_same_model(tiny, bucket, tmp_path, capsys):
    export_to(tiny, f"{bucket}/ours")
    assert main(["export-hf", f"{bucket}/ours", "--out", f"{bucket}/hf"]) == 0
    assert capsys.readouterr().out == f"wrote {bucket}/hf\n"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= remote_files(f"{bucket}/hf")
    assert main(["import-hf", f"{bucket}/hf", "--out", f"{bucket}/back"]) == 0
    assert capsys.readouterr().out.endswith(f"from {bucket}/hf to {bucket}/back\n")
    back, model = load_exported(f"{bucket}/back"), tiny[0]
    for (key, a), b in zip(model.state_dict().items(), back.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    inputs, targets = torch.randint(0, 259, (2, 2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back.model.token_nll(inputs, targets), model.token_nll(inputs, targets))
    assert main(["export-hf", f"{bucket}/ours", "--out", f"{bucket}/hf"]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err


def test_cpt_from_a_bucket_finds_the_model_of_a_checkpoint_or_the_model_itself(tiny, bucket):
    export_to(tiny, f"{bucket}/run/checkpoint-0000010/model")
    model = f"{bucket}/run/checkpoint-0000010/model"
    assert resolve_parent(f"{bucket}/run/checkpoint-0000010").uri == model
    assert resolve_parent(model).uri == model
    assert load_exported(resolve_parent(model)).table.fingerprint == tiny[2].fingerprint


def test_data_for_a_model_in_a_bucket_must_frame_documents_as_its_training_data(tiny, bucket):
    export_to(tiny, f"{bucket}/bos-model", document_format="bos")
    check_documents_fit(f"{bucket}/bos-model", "bos", "shards x")
    with pytest.raises(DataError, match="bos-format documents"):
        check_documents_fit(f"{bucket}/bos-model", "eos", "shards x")


def test_an_export_whose_upload_did_not_finish_is_refused_in_one_line(tiny, bucket, tmp_path):
    local = export_to(tiny, tmp_path / "model")
    (local / CONFIG_FILE).unlink()  # the marker is uploaded last: an interrupted upload lacks it
    Location.of(f"{bucket}/partial").upload(local)
    unfinished = r"is not an exported model \(no config.json, which an export writes last\)"
    with pytest.raises(ExportError, match=unfinished):
        load_exported(f"{bucket}/partial")
    result = mhf(["generate", "--model", f"{bucket}/partial", "--prompt", "x"])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "writes last" in result.stderr


def mhf(argv, **env):
    return subprocess.run(
        [sys.executable, "-m", "mhf_dist.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


CLOSED_PORT = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{servers.free_port()}"}
BAD_LOCATIONS = {
    "missing-bucket": ("s3://no-such-bucket-mhf/m", {}, "the bucket of 's3://no-such-bucket-mhf/m' does not"),
    "closed-port": ("{bucket}/model", CLOSED_PORT, "cannot reach the object store"),
    "unknown-scheme": ("nosuch://bucket/model", {}, "pyarrow knows no filesystem for nosuch://"),
    "prefix-without-a-model": ("{bucket}/nothing", {}, "nothing' does not exist; pass an exported model's"),
}  # fmt: skip
THIS = __file__  # an existing file for --add-tokens: the rows fail at --from first
COMMANDS = {
    "eval": lambda uri, model, out: ["eval", "--model", uri, "--task", "recall"],
    "generate": lambda uri, model, out: ["generate", "--model", uri, "--prompt", "x"],
    "cpt --from": lambda uri, model, out: ["cpt", "--from", uri, "--data", "builtin", "--add-tokens", THIS],
    "export-hf (reading)": lambda uri, model, out: ["export-hf", uri, "--out", out],
    "import-hf (reading)": lambda uri, model, out: ["import-hf", uri, "--out", out],
    "export-hf --out": lambda uri, model, out: ["export-hf", model, "--out", uri],  # refused before any work
    "import-hf --out": lambda uri, model, out: ["import-hf", model, "--out", uri],
}  # fmt: skip
CASES = [
    *[("eval", case) for case in BAD_LOCATIONS],
    ("generate", "missing-bucket"),
    ("cpt --from", "closed-port"),
    ("cpt --from", "prefix-without-a-model"),
    ("export-hf (reading)", "unknown-scheme"),
    ("import-hf (reading)", "missing-bucket"),
    ("export-hf --out", "closed-port"),
    ("export-hf --out", "missing-bucket"),
    ("import-hf --out", "unknown-scheme"),
]


@pytest.mark.parametrize(("command", "case"), CASES)
def test_a_bad_model_location_is_one_line_and_exit_2_within_30_s(tiny, bucket, tmp_path, command, case):
    uri, env, message = BAD_LOCATIONS[case]
    model = str(export_to(tiny, tmp_path / "model"))  # import-hf --out refuses it as a checkpoint, later
    argv = COMMANDS[command](uri.format(bucket=bucket), model, str(tmp_path / "out"))
    if (command, case) == ("import-hf (reading)", "prefix-without-a-model"):
        message = "is not a Hugging Face checkpoint directory"
    start = time.monotonic()
    result = mhf(argv, **env)
    assert time.monotonic() - start < 30
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and SECRET not in result.stderr + result.stdout
    assert not (tmp_path / "out").exists()
