"""Exported model directories: round trip, tied weights, and one-line errors for bad directories."""

import json
import re

import pytest
import torch

from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import MhfError
from mhf_dist.export import CONFIG_FILE, ExportError, export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable


@pytest.fixture
def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    TextTokenizer.bytes().save(path)
    return path


@pytest.mark.parametrize("family", ["mhf", "qwen3", "triple_slot", "gated_hybrid", "transformer_plus_triple"])
def test_an_exported_model_scores_exactly_like_the_original(small_cfg, tokenizer_file, tmp_path, family):
    cfg = small_cfg.model.model_copy(update={"family": family, "vocab_size": 259})
    table = SignatureTable.build(TextTokenizer.bytes().vocabulary(), 2, 64)
    torch.manual_seed(0)
    model = build_model(cfg, table)
    export_model(model, cfg, table, tokenizer_file, tmp_path / "model")
    loaded = load_exported(tmp_path / "model")
    assert loaded.config == cfg and loaded.table.fingerprint == table.fingerprint
    rows = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(1))
    model.eval()
    assert torch.equal(
        loaded.model.token_nll(rows[:, :-1], rows[:, 1:]), model.token_nll(rows[:, :-1], rows[:, 1:])
    )
    with pytest.raises(ExportError, match="already exists"):
        export_model(model, cfg, table, tokenizer_file, tmp_path / "model")
    probe = tmp_path / "new-file"
    probe.touch()  # the mode a new file gets under this process's umask
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "model").iterdir()}
    assert modes == dict.fromkeys(modes, probe.stat().st_mode & 0o777)  # safetensors writes 0600 itself


def test_bad_export_directories_are_one_line_errors(small_cfg, tokenizer_file, tmp_path):
    with pytest.raises(ExportError, match="nowhere' does not exist; pass an exported model's directory"):
        load_exported(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"empty' is not an exported model \(no config.json\)"):
        load_exported(tmp_path / "empty")
    cfg = small_cfg.model.model_copy(update={"vocab_size": 259})
    table = SignatureTable.build(TextTokenizer.bytes().vocabulary(), 2, 64)
    export_model(build_model(cfg, table), cfg, table, tokenizer_file, tmp_path / "model")
    description = json.loads((tmp_path / "model" / CONFIG_FILE).read_text())
    description["signature_fingerprint"] = "0" * 64
    (tmp_path / "model" / CONFIG_FILE).write_text(json.dumps(description))
    with pytest.raises(MhfError, match="differs from the one the model was trained with"):
        load_exported(tmp_path / "model")
    description["signature_fingerprint"] = table.fingerprint
    (tmp_path / "model" / CONFIG_FILE).write_text(json.dumps(description))
    tokenizer = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    renamed = next(token for token, token_id in vocab.items() if token_id == 70)
    original = json.dumps(tokenizer)
    vocab["zzz"] = vocab.pop(
        renamed
    )  # one token of the vocabulary edited: the ids would decode as other text
    (tmp_path / "model" / "tokenizer.json").write_text(json.dumps(tokenizer))
    found = rf"id 70 is 'zzz' there, {re.escape(repr(renamed))} in the signature table"
    with pytest.raises(ExportError, match=rf"not the tokenizer the model was exported with \({found}"):
        load_exported(tmp_path / "model")
    tokenizer = json.loads(original)
    tokenizer["normalizer"] = {"type": "Lowercase"}  # the same tokens, read from other text
    (tmp_path / "model" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(
        ExportError, match=r"not the tokenizer the model was exported with \(its sha256 \w+, "
    ):
        load_exported(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text(original)
    assert load_exported(tmp_path / "model").tokenizer.vocab_size == 259


def test_damaged_export_files_are_one_line_errors_naming_the_file(small_cfg, tokenizer_file, tmp_path):
    cfg = small_cfg.model.model_copy(update={"vocab_size": 259})
    table = SignatureTable.build(TextTokenizer.bytes().vocabulary(), 2, 64)
    export_model(build_model(cfg, table), cfg, table, tokenizer_file, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(
        ExportError, match=r"model.safetensors' is damaged or not of the model config.json describes"
    ):
        load_exported(tmp_path / "model")
    weights.unlink()
    with pytest.raises(ExportError, match=r"has no model\.safetensors"):
        load_exported(tmp_path / "model")
    config = tmp_path / "model" / CONFIG_FILE
    recorded = json.loads(config.read_text())
    for edit, problem in (
        ({"lineage": "none"}, r"lineage: Input should be a valid list"),
        ({"document_format": "BOS"}, r"document_format: Input should be 'bos' or 'eos'"),
        ({"signature_fingerprint": None}, r"signature_fingerprint: Input should be a valid string"),
        ({"notes": "mine"}, r"notes: Extra inputs are not permitted"),
    ):
        config.write_text(json.dumps(recorded | edit))
        with pytest.raises(ExportError) as raised:
            load_exported(tmp_path / "model")
        assert re.fullmatch(
            rf"'.*config\.json' is damaged or was edited \({problem}\); re-export the model",
            str(raised.value),
        ), str(raised.value)
    config.write_text('{"format": "mhf-model", "model": ')
    with pytest.raises(ExportError, match=r"config.json' is damaged \(invalid JSON at line 1\)"):
        load_exported(tmp_path / "model")


def test_an_export_where_nothing_can_be_written_is_a_one_line_error(small_cfg, tokenizer_file, tmp_path):
    """/proc refuses new entries even to root, whom os.access tells it may write there. A name is staged
    beside itself under a longer one, which must fit the file system's 255 bytes."""
    cfg = small_cfg.model.model_copy(update={"vocab_size": 259})
    table = SignatureTable.build(TextTokenizer.bytes().vocabulary(), 2, 64)
    with pytest.raises(ExportError, match=r"cannot write in '/proc' \(.*\); pick another directory"):
        export_model(build_model(cfg, table), cfg, table, tokenizer_file, "/proc/mhf-model")
    (tmp_path / "models").mkdir()
    for where, length, limit in [(("m" * 242,), 242, 241), (("é" * 128, "m"), 256, 255)]:  # 2 bytes an é
        with pytest.raises(
            ExportError, match=rf"is {length} bytes; it may have at most {limit} \(.*\); pick"
        ):
            export_model(
                build_model(cfg, table), cfg, table, tokenizer_file, tmp_path.joinpath("models", *where)
            )
    assert not any((tmp_path / "models").iterdir())
    export_model(build_model(cfg, table), cfg, table, tokenizer_file, tmp_path / "models" / ("m" * 241))


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_an_export_never_replaces_a_folder_or_a_file_that_is_there(
    small_cfg, tokenizer_file, tmp_path, request, where
):
    from mhf_dist.storage import Location

    root = Location.of(tmp_path / "root" if where == "local" else request.getfixturevalue("bucket"))
    (root / "thesis" / "chapter.txt").write_text("three years of work")
    (root / "notes.txt").write_text("a plain file")
    before = {name: (root / name).read_bytes() for name, _ in root.files()}
    cfg = small_cfg.model.model_copy(update={"vocab_size": 259})
    table = SignatureTable.build(TextTokenizer.bytes().vocabulary(), 2, 64)
    model = build_model(cfg, table)
    for taken in ("thesis", "notes.txt"):
        with pytest.raises(ExportError, match=rf"output '.*{taken}' already exists; remove it or pick"):
            export_model(model, cfg, table, tokenizer_file, root / taken)
    assert {name: (root / name).read_bytes() for name, _ in root.files()} == before
