"""Document formats: `bos` (`<s> text`, no EOS: the authors' Mistral data) and `eos` (`text EOS`), recorded
in the manifest and the exported model and checked wherever data meets a model."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import processors

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.packing import pack_rows
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader
from mhf_dist.data.shards import check_compatible, is_validation, read_manifest
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.eval.perplexity import evaluate_rows, nll_totals
from mhf_dist.eval.scoring import score_continuations
from mhf_dist.eval.tasks import run_task
from mhf_dist.export import export_model, load_exported
from mhf_dist.hf_layout import export_hf, import_hf
from mhf_dist.models import build_model
from mhf_dist.signatures import load_table

DOCS = [f"Document {i} is about {topic}, and {topic} only." for i, topic in enumerate(["rain", "sun"] * 20)]
BOS, EOS = 256, 257  # the byte vocabulary's <bos> and <eos>
SETTINGS = ["data.tokenizer=bytes", "model.vocab_size=259", "model.hash.spec=H2B64", "train.seq_len=32",
            "data.val_percent=20", "train.batch_size=2"]  # fmt: skip


def byte_cfg(*extra):
    return load_config("tiny", [*SETTINGS, *extra])


@pytest.fixture(scope="module")
def shards(ray_session, tmp_path_factory):
    """The same corpus prepared twice with the byte vocabulary: as `eos` (its auto format) and `bos`."""
    root = tmp_path_factory.mktemp("documents")
    (root / "docs.txt").write_text("\n\n".join(DOCS) + "\n")
    paths = {}
    for document_format in ("eos", "bos"):
        paths[document_format] = root / document_format
        extra = [] if document_format == "eos" else ["data.document_format=bos"]
        cfg = byte_cfg(f"data.corpus={root / 'docs.txt'}", *extra)
        prepare(cfg, paths[document_format], num_cpus=2, log=lambda line: None)
    return paths


def exported_model(directory, shards_dir, document_format):
    cfg = byte_cfg()
    table = load_table(shards_dir / "signatures.safetensors")
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    tokenizer = shards_dir / "tokenizer.json"
    export_model(model, cfg.model, table, tokenizer, directory, document_format=document_format)
    return load_exported(directory)


def stream(path, split):
    rows = RowReader(path, split).read_range()["tokens"]
    return np.concatenate([rows[0], *(row[1:] for row in rows[1:])]).tolist()  # rows overlap by one


@pytest.mark.parametrize("split", ["train", "validation"])
def test_bos_shards_lead_every_document_with_bos_and_eos_shards_end_it_with_eos(shards, split):
    tokenizer = TextTokenizer.bytes()
    docs = [doc for doc in DOCS if (split == "validation") == is_validation(doc, 20)]
    ids = tokenizer.encode_batch(docs)
    bos, eos = stream(shards["bos"], split), stream(shards["eos"], split)
    assert bos == [t for doc in ids for t in (BOS, *doc)][: len(bos)] and EOS not in bos
    assert eos == [t for doc in ids for t in (*doc, EOS)][: len(eos)] and BOS not in eos
    assert read_manifest(shards["bos"]).document_format == "bos"
    assert read_manifest(shards["bos"]).tokenizer.bos_id == BOS
    # auto: the byte vocabulary has no BOS template, so it stays EOS-terminated
    assert read_manifest(shards["eos"]).document_format == "eos"


def test_a_run_whose_config_names_another_format_than_the_shards_is_refused(shards):
    check_compatible(read_manifest(shards["eos"]), byte_cfg())  # auto takes the shards' format
    with pytest.raises(DataError, match=r"shards hold eos-format .* data\.document_format is bos"):
        check_compatible(read_manifest(shards["eos"]), byte_cfg("data.document_format=bos"))


def test_continuing_a_model_on_shards_of_the_other_format_is_one_line(shards, tmp_path, capsys):
    model = exported_model(tmp_path / "bos-model", shards["bos"], "bos")
    sets = [f"--set={s}" for s in [*SETTINGS, f"data.path={shards['eos']}"]]
    args = ["train", "--config", "tiny", *sets, "--init-from", str(model.path), "--storage",
            str(tmp_path / "runs"), "--workers", "1"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: shards") and len(err.splitlines()) == 1
    assert "eos-format documents" in err and "bos-format documents" in err
    assert "--set data.document_format=bos" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("checkpoint*"))


def test_evaluating_a_model_on_shards_of_the_other_format_is_one_line(shards, tmp_path, capsys):
    model = exported_model(tmp_path / "eos-model", shards["eos"], "eos")
    assert main(["eval", "--model", str(model.path), "--task", "ppl", "--data", str(shards["bos"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bos-format documents" in err and "eos-format documents" in err
    assert "--set data.document_format=eos" in err
    rows = RowReader(shards["eos"], "validation").read_range()["tokens"]
    assert run_task(model, "ppl", shards["eos"])["ppl"] == pytest.approx(
        evaluate_rows(model.model, rows)["val_ppl"]
    )


def test_a_model_exported_before_formats_were_recorded_is_eos(shards, tmp_path):
    model = exported_model(tmp_path / "old", shards["eos"], "eos")
    config = json.loads((model.path / "config.json").read_text())
    del config["document_format"]
    (model.path / "config.json").write_text(json.dumps(config))
    assert load_exported(model.path).document_format == "eos"
    bos = exported_model(tmp_path / "new", shards["bos"], "bos")
    assert json.loads((bos.path / "config.json").read_text())["document_format"] == "bos"


def test_text_scoring_frames_each_document_as_the_model_read_its_training_data(shards, tmp_path):
    texts = ["One short text.", "And a second one, a little longer than the first."]
    (tmp_path / "texts.txt").write_text("\n\n".join(texts))
    for document_format, framed in (("bos", lambda ids: [BOS, *ids]), ("eos", lambda ids: [*ids, EOS])):
        model = exported_model(tmp_path / document_format, shards[document_format], document_format)
        prefix = [] if document_format == "bos" else [EOS]  # the eos model's first token follows an EOS
        ids = [*prefix, *(t for doc in model.tokenizer.encode_batch(texts) for t in framed(doc))]
        whole = len(ids) - 1 - (len(ids) - 1) % 8  # targets in whole windows of 8; the rest in one shorter
        windows = [nll_totals(model.model, pack_rows(np.asarray(ids[: whole + 1]), 8)),
                   nll_totals(model.model, np.asarray([ids[whole:]]))]  # fmt: skip
        total = sum(total for total, _ in windows)
        scores = run_task(model, "ppl", tmp_path / "texts.txt", seq_len=8)
        assert scores["nll"] == pytest.approx(total / (len(ids) - 1))
        # one byte per boundary token scored: both EOS, or the second BOS only (the first is the prefix)
        scored_bytes = sum(len(text.encode()) for text in texts) + (1 if document_format == "bos" else 2)
        assert scores["bits_per_byte"] == pytest.approx(total / math.log(2) / scored_bytes)
    # lambada and hellaswag contexts start with BOS for a bos model
    bos_model = load_exported(tmp_path / "bos")
    (tmp_path / "l.jsonl").write_text(json.dumps({"text": "the rain falls"}) + "\n")
    encode = bos_model.tokenizer.encode_batch
    [(logprob, _)] = score_continuations(
        bos_model.model, [([BOS, *encode(["the rain"])[0]], encode([" falls"])[0])], 1
    )
    assert run_task(bos_model, "lambada", tmp_path / "l.jsonl")["ppl"] == pytest.approx(np.exp(-logprob))


def test_the_harness_uses_bos_as_the_empty_context_and_context_prefix_of_a_bos_model(shards, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval.harness import MhfHarnessLM

    for document_format, prefix in (("bos", [BOS]), ("eos", [])):
        model = exported_model(tmp_path / document_format, shards[document_format], document_format)
        lm = MhfHarnessLM(str(model.path))
        empty = BOS if document_format == "bos" else EOS
        assert lm.prefix_token_id == empty
        encode = model.tokenizer.encode_batch
        requests = [SimpleNamespace(args=("", "rain")), SimpleNamespace(args=("the", " rain"))]
        expected = score_continuations(
            model.model,
            [([empty], encode(["rain"])[0]), ([*prefix, *encode(["the"])[0]], encode([" rain"])[0])],
            1,
        )
        scores = [score for score, _ in lm.loglikelihood(requests)]
        assert scores == pytest.approx([score for score, _ in expected])


def test_import_hf_takes_the_checkpoints_tokenizer_default_format(shards, tmp_path):
    model = exported_model(tmp_path / "ours", shards["bos"], "bos")
    export_hf(model.path, tmp_path / "hf")
    assert import_hf(tmp_path / "hf", tmp_path / "plain").document_format == "eos"  # bytes: no BOS template
    tokenizer = TextTokenizer.load(tmp_path / "hf" / "tokenizer.json")
    tokenizer.tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )  # as the released checkpoints' Mistral tokenizer: `<s> $A`
    tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    assert import_hf(tmp_path / "hf", tmp_path / "led").document_format == "bos"


def test_block_packing_prepares_disjoint_blocks_and_train_refuses_shards_of_the_other_packing(
    shards, tmp_path
):
    out = tmp_path / "blocks"
    corpus = shards["eos"].parent / "docs.txt"
    prepare(byte_cfg(f"data.corpus={corpus}", "data.packing=blocks"), out, num_cpus=2, log=lambda line: None)
    rows = RowReader(out, "train").read_range()["tokens"]
    overlapping = RowReader(shards["eos"], "train").read_range()["tokens"]
    # the same token stream, cut into disjoint blocks of seq_len + 1 = 33 tokens instead of overlapping rows
    # (the overlapping rows end before the stream's tail, which can hold one more block)
    expected = pack_rows(np.asarray(stream(shards["eos"], "train")), 32, "blocks")
    assert np.array_equal(rows[: len(expected)], expected) and len(rows) - len(expected) in (0, 1)
    assert len(rows) < len(overlapping) and rows.shape[1] == 33
    manifest = read_manifest(out)
    assert manifest.packing == "blocks" and read_manifest(shards["eos"]).packing == "overlap"
    check_compatible(manifest, byte_cfg("data.packing=blocks"))
    with pytest.raises(DataError, match=r"shards have packing blocks but the model has overlap"):
        check_compatible(manifest, byte_cfg())


def test_recall_rows_refuse_a_bos_document_format_and_say_that_the_tokenizer_is_not_used(tmp_path):
    with pytest.raises(DataError, match=r"data\.corpus=recall writes generated rows in the eos layout"):
        prepare(byte_cfg("data.corpus=recall", "data.document_format=bos"), tmp_path / "r", log=print)
    lines = []
    prepare(byte_cfg("data.corpus=recall", "data.recall.examples=20"), tmp_path / "r", log=lines.append)
    assert "data.tokenizer bytes is not used: recall rows have ids of their own (k1..)" in lines
    # also when it names the default's value; a config that leaves it out gets no such line
    for given, said in ((["data.tokenizer=bpe"], True), ([], False)):
        lines = []
        cfg = load_config("tiny", ["data.corpus=recall", "data.recall.examples=20", *given])
        prepare(cfg, tmp_path / "r", log=lines.append, overwrite=True)
        assert ("data.tokenizer bpe is not used: recall rows have ids of their own (k1..)" in lines) == said
