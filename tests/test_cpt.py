"""`mhf cpt`: vocabulary expansion keeps old ids, signatures and rankings; mhf adds no parameters; a
baseline's new rows start as the mean of their old pieces' rows (HUIYINXUE/MHF `instantiate_model_by_mean`);
training keeps the authors' frozen split and can replay the parent's corpus."""

import itertools
import json

import pytest
import torch

from mhf_dist.config import PRESET_DIR, load_config
from mhf_dist.cpt import _new_rows, expand_model, expanded_tokenizer, run_cpt
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError, TrainingError
from mhf_dist.export import export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.models.generation import generate
from mhf_dist.models.registry import TRIPLE_STACKS
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.checkpoints import read_history
from mhf_dist.train.loop import train_local

NEW_TOKENS = ["你好", "世界", "مرحبا", "नमस्ते"]


@pytest.fixture(scope="module")
def english_tokenizer():
    return TextTokenizer.train_bpe(builtin_documents()[:20], 300)


def exported_parent(tmp_path, tokenizer, family, *overrides, buckets=64):
    cfg = load_config(
        "tiny",
        [
            f"model.vocab_size={tokenizer.vocab_size}",
            f"model.hash.spec=H2B{buckets}",
            f"model.family={family}",
            *overrides,
        ],
    )
    table = SignatureTable.build(tokenizer.vocabulary(), 2, buckets)
    tokenizer.save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    export_model(model, cfg.model, table, tmp_path / "tokenizer.json", tmp_path / family)
    return load_exported(tmp_path / family), cfg


def real_params(model):
    """Parameters the built model holds (a tied table once), not the analytic count."""
    return sum(param.numel() for param in model.parameters())


def old_token_logprobs(model, context, vocab_size):
    with torch.no_grad():
        logprobs, _ = model.eval().next_token_logprobs(torch.tensor([context]), None)
    return logprobs[0, :vocab_size].double()


@pytest.mark.parametrize(
    ("family", "overrides", "heads"),
    [
        ("mhf", [], 0),
        *[("mhf", [f"model.backbone.kind={kind}"], 0) for kind in TRIPLE_STACKS],  # hash I/O: none either
        ("qwen3", [], 1),
        ("qwen3", ["model.backbone.tie_word_embeddings=false"], 2),
        ("gated_hybrid", ["model.triple.match_params=true"], 1),  # the MLP width stays as it was
    ],
)
def test_expansion_keeps_old_ids_signatures_and_rankings(
    english_tokenizer, tmp_path, family, overrides, heads
):
    parent, cfg = exported_parent(tmp_path, english_tokenizer, family, *overrides)
    tokenizer = english_tokenizer.with_added_tokens(NEW_TOKENS)
    assert tokenizer.vocabulary()[: english_tokenizer.vocab_size] == english_tokenizer.vocabulary()
    expansion = expand_model(
        parent, tokenizer.vocabulary()[english_tokenizer.vocab_size :], tokenizer=tokenizer
    )

    # mhf: zero new parameters; a baseline: dV x d per vocabulary table (embedding, and an untied head).
    assert expansion.params_added == heads * len(NEW_TOKENS) * cfg.model.backbone.hidden_size
    assert real_params(expansion.model) - real_params(parent.model) == expansion.params_added
    old = len(parent.table)
    assert (expansion.table.rows[:old] == parent.table.rows).all()
    assert expansion.table.tokens[:old] == parent.table.tokens

    # Before any training, old tokens keep their order: only the normaliser over V_actl grows.
    context = english_tokenizer.encode_batch(["The for statement is used"])[0]
    before = old_token_logprobs(parent.model, context, old)
    after = old_token_logprobs(expansion.model, context, old)
    shift = after - before
    assert torch.allclose(shift, shift[0].expand_as(shift), atol=1e-5) and float(shift[0]) < 0
    assert torch.equal(torch.argsort(before, stable=True), torch.argsort(after, stable=True))


NEW_WORDS = "continued pretraining expands vocabularies; signatures hash tokens into buckets. " * 30


@pytest.mark.parametrize("tied", [True, False])
def test_a_baselines_new_rows_are_the_mean_of_their_old_pieces_rows(english_tokenizer, tmp_path, tied):
    overrides = [] if tied else ["model.backbone.tie_word_embeddings=false"]
    parent, _ = exported_parent(tmp_path, english_tokenizer, "qwen3", *overrides)
    tokenizer = english_tokenizer.with_trained_tokens([NEW_WORDS], 60).with_added_tokens(["你好"])
    old = english_tokenizer.vocab_size
    new_tokens = tokenizer.vocabulary()[old:]
    expansion = expand_model(parent, new_tokens, tokenizer=tokenizer)
    assert expansion.init_new_rows == "subword" and expansion.fallback_rows == 0
    before, after = parent.model.state_dict(), expansion.model.state_dict()
    tables = ["model.model.embed_tokens.weight", *([] if tied else ["model.lm_head.weight"])]
    for offset, token in enumerate(new_tokens):
        # The token's text under the old tokenizer: the old pieces of "Ġexpands" are those of " expands".
        pieces = english_tokenizer.encode_batch([tokenizer.decode([old + offset])])[0]
        assert len(pieces) >= 2, token
        for name in tables:
            expected = before[name][pieces].mean(dim=0)
            assert torch.allclose(after[name][old + offset], expected, atol=1e-6), (token, name)
    assert any(token.startswith("Ġ") for token in new_tokens) and new_tokens[-1] == "你好"
    if not tied:  # the head's rows average the head's own rows, not the embedding's
        assert not torch.allclose(after[tables[0]][old:], after[tables[1]][old:])

    # --init-new-rows mean: every new row is the mean of all old rows (the earlier rule).
    mean = expand_model(parent, new_tokens, init_new_rows="mean").model.state_dict()
    for name in tables:
        assert torch.allclose(mean[name][old:], before[name].mean(dim=0).expand(len(new_tokens), -1))
        assert not torch.allclose(mean[name][old:], after[name][old:])


def test_a_new_token_without_old_pieces_starts_at_the_mean_of_all_rows():
    table = torch.arange(12.0).reshape(4, 3)
    rows = _new_rows(table, 2, [[1, 3], []])
    assert torch.equal(rows, torch.stack([table[[1, 3]].mean(dim=0), table.mean(dim=0)]))


def test_a_new_token_can_be_generated_after_short_training(english_tokenizer, tmp_path):
    parent, cfg = exported_parent(tmp_path, english_tokenizer, "mhf")
    tokenizer = english_tokenizer.with_added_tokens(NEW_TOKENS)
    expansion = expand_model(parent, tokenizer.vocabulary()[english_tokenizer.vocab_size :])
    new_id = tokenizer.vocabulary().index("你好")
    pattern = [*english_tokenizer.encode_batch([" the loop"])[0], new_id]
    stream = list(itertools.islice(itertools.cycle(pattern), 8 * 33))
    rows = torch.tensor(stream).reshape(8, 33)
    batch = {"tokens": rows, "signatures": expansion.table.lookup(rows)}
    train_cfg = cfg.train.model_copy(update={"steps": 60, "warmup_steps": 5, "seq_len": 32})
    train_local(expansion.model, itertools.repeat(batch), train_cfg, log=None)
    generated = list(generate(expansion.model.eval(), pattern * 2, max_new_tokens=len(pattern)))
    assert new_id in generated


def test_bad_expansions_are_one_line_errors(english_tokenizer, tmp_path):
    existing = english_tokenizer.vocabulary()[100]
    with pytest.raises(DataError, match=f"token {existing!r} is already in the vocabulary"):
        english_tokenizer.with_added_tokens([existing])
    (tmp_path / "new.txt").write_text("zebrafish\n\nzebrafish\n")
    with pytest.raises(
        DataError, match=r"new.txt: token 'zebrafish' is listed twice; list each new token once$"
    ):
        expanded_tokenizer(english_tokenizer, add_tokens=str(tmp_path / "new.txt"))
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(DataError, match=r"blank.txt: no token in it; give one new token per line$"):
        expanded_tokenizer(english_tokenizer, add_tokens=str(tmp_path / "blank.txt"))
    other = TextTokenizer.train_bpe(builtin_documents()[40:60], 320)
    other.save(tmp_path / "other.json")
    with pytest.raises(DataError, match=r"renumbers old token .* append new tokens after"):
        expanded_tokenizer(english_tokenizer, tokenizer=str(tmp_path / "other.json"))
    with pytest.raises(TrainingError, match="exactly one of"):
        expanded_tokenizer(english_tokenizer, add_tokens="a.txt", train_new_tokens=5)
    with pytest.raises(TrainingError, match=r"^--corpus is the text --train-new-tokens N learns from; leave"):
        expanded_tokenizer(english_tokenizer, add_tokens="a.txt", texts=lambda: ["never read"])


def test_learned_tokens_are_appended_and_shorten_the_new_text(english_tokenizer):
    text = "数据并行训练把批次分给多个工作进程。" * 20
    extended = english_tokenizer.with_trained_tokens([text], 30)
    assert extended.vocab_size == english_tokenizer.vocab_size + 30
    assert extended.vocabulary()[: english_tokenizer.vocab_size] == english_tokenizer.vocabulary()
    ids = extended.encode_batch([text])[0]
    assert len(ids) < len(english_tokenizer.encode_batch([text])[0]) / 2
    assert extended.decode(ids) == text


def cpt_corpora(tmp_path):
    """(a corpus with the new tokens in it, an English corpus to replay)."""
    corpus, replay = tmp_path / "mixed.txt", tmp_path / "english.txt"
    corpus.write_text("\n\n".join(f"{doc[:2000]} 你好 世界 مرحبا" for doc in builtin_documents()[:30]))
    replay.write_text("\n\n".join(doc[:3000] for doc in builtin_documents()[30:80]))
    return corpus, replay


def cpt_adding_new_tokens(cfg, parent):
    from mhf_dist.train.ray_trainer import TrainOptions  # the Ray driver: only the tests that train

    return run_cpt(
        cfg, str(parent.path), lambda old: old.with_added_tokens(NEW_TOKENS), TrainOptions(name="zh")
    )


def test_cpt_prepares_the_new_corpus_and_hands_mhf_train_the_expanded_model_lineage_and_tags(
    ray_session, english_tokenizer, tmp_path, monkeypatch
):
    """Everything `mhf cpt` decides before training, read from what it hands `mhf train` (a stand-in
    here; the fit below trains for real): the expanded model with its lineage, shards of the new corpus
    with the replayed share, the authors' frozen split and the run's cpt tags."""
    import mhf_dist.train.ray_trainer as ray_trainer
    from mhf_dist.data.shards import read_manifest
    from mhf_dist.train.trainable import apply_trainable

    handed = []
    monkeypatch.setattr(ray_trainer, "train", lambda *args, **kwargs: handed.append((args, kwargs)) or "run")
    parent, _ = exported_parent(tmp_path, english_tokenizer, "mhf", "model.backbone.num_layers=5")
    corpus, replay = cpt_corpora(tmp_path)
    overrides = [f"data.replay.corpus={replay}", "data.replay.fraction=0.3", "train.seq_len=32"]
    cfg = load_config("tiny", [f"data.corpus={corpus}", *overrides, f"topology.storage={tmp_path / 'cpt'}"])
    result = cpt_adding_new_tokens(cfg, parent)
    ((run_cfg, options), kwargs) = handed[0]
    assert len(handed) == 1 and result.train_result == "run"

    # Training starts from init/: the parent's model, its vocabulary grown, its lineage one step longer.
    assert options.init_from == str(result.init_dir) and options.name == "zh"
    init = load_exported(result.init_dir)
    assert init.config.vocab_size == parent.config.vocab_size + len(NEW_TOKENS) == run_cfg.model.vocab_size
    assert real_params(init.model) == real_params(parent.model)
    assert init.lineage == [{"fingerprint": parent.table.fingerprint, "vocab_size": parent.config.vocab_size}]
    # on shards of the new corpus, tokenized and signed as init/ is, with the asked share replayed
    manifest = read_manifest(run_cfg.data.path)
    assert manifest.signatures.fingerprint == init.table.fingerprint != parent.table.fingerprint
    mixture = manifest.splits["train"].mixture
    assert mixture.sources[1].documents > 0 and 0.15 < mixture.realised_fraction < 0.45
    # under the authors' split: of 5 layers only layer 2 is frozen
    layer_2 = {name for name, _ in init.model.named_parameters() if name.startswith("backbone.layers.2.")}
    assert layer_2 and set(apply_trainable(init.model, run_cfg.train.trainable).frozen) == layer_2
    assert kwargs["tags"] == {
        "cpt_parent_model": str(parent.path.resolve()),
        "cpt_parent_fingerprint": parent.table.fingerprint,
        "cpt_old_vocab_size": parent.config.vocab_size,
        "cpt_new_vocab_size": init.config.vocab_size,
        "cpt_params_added": 0,
        "cpt_init_new_rows": "none",  # mhf has no vocabulary-sized table to grow
        "cpt_init_fallback_rows": 0,
        "cpt_trainable": "authors-ve",
        "cpt_replay_fraction": mixture.realised_fraction,
    }

    # A rerun of the name goes on from what the first one left only when it was made from the same inputs.
    from mhf_dist.train.ray_trainer import TrainOptions

    fewer = lambda old: old.with_added_tokens(NEW_TOKENS[:2])  # noqa: E731
    with pytest.raises(
        TrainingError,
        match=r"/init' was made from another parent, tokenizer or row initialisation "
        r"\(tokenizer_sha256 \w{12} -> \w{12}\); pick",
    ):
        run_cpt(cfg, str(parent.path), fewer, TrainOptions(name="zh"))
    # another checkpoint of the same run: the same vocabulary and signature table, other weights
    with torch.no_grad():
        next(parent.model.parameters()).add_(1.0)
    export_model(parent.model, parent.config, parent.table, tmp_path / "tokenizer.json", tmp_path / "later")
    with pytest.raises(TrainingError, match=r"\(parent_weights_sha256 \w{12} -> \w{12}\); pick"):
        cpt_adding_new_tokens(cfg, load_exported(tmp_path / "later"))
    less_replay = cfg.data.replay.model_copy(update={"fraction": 0.2})
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"replay": less_replay})})
    with pytest.raises(TrainingError, match=r"were prepared with data\.replay \{.*'fraction': 0\.3"):
        cpt_adding_new_tokens(other, parent)
    record = tmp_path / "cpt" / "zh" / "init.json"
    record.unlink()  # as a run stopped before init/ was complete leaves it: made again
    cpt_adding_new_tokens(cfg, parent)
    assert len(handed) == 2 and json.loads(record.read_text())["tokenizer_sha256"] == init.tokenizer.sha256


def test_cpt_trains_from_the_expanded_weights_and_the_trained_model_keeps_the_lineage(
    ray_session, english_tokenizer, tmp_path
):
    """The one fit: what only training shows. Two ZeRO-2 workers start from init/ (the authors' frozen
    layer comes out bit-identical to the parent's, everything else moves), the trained export keeps the
    lineage, and MLflow holds the cpt tags beside train's parameter counts."""
    from mlflow.tracking import MlflowClient

    parent, _ = exported_parent(tmp_path, english_tokenizer, "mhf", "model.backbone.num_layers=5")
    corpus, _ = cpt_corpora(tmp_path)
    storage = f"topology.storage={tmp_path / 'cpt'}"
    train = ["train.steps=4", "train.seq_len=32", "train.eval_rows=8"]
    cfg = load_config("tiny", [f"data.corpus={corpus}", *train, "topology.zero_stage=2", storage])
    result = cpt_adding_new_tokens(cfg, parent)
    exported = load_exported(result.train_result.checkpoint / "model")
    assert exported.config.vocab_size == parent.config.vocab_size + len(NEW_TOKENS)
    assert exported.lineage == [
        {"fingerprint": parent.table.fingerprint, "vocab_size": parent.config.vocab_size}
    ]
    before, after = parent.model.state_dict(), exported.model.state_dict()
    frozen = [name for name in before if name.startswith("backbone.layers.2.")]
    assert frozen and all(torch.equal(before[name], after[name]) for name in frozen)
    for name in ("backbone.layers.0.mlp.up_proj.weight", "backbone.layers.4.mlp.up_proj.weight"):
        assert not torch.equal(before[name], after[name])
    assert not torch.equal(before["encoder.table.weight"], after["encoder.table.weight"])

    tags = MlflowClient(result.train_result.tracking_uri).get_run(result.train_result.run_id).data.tags
    assert tags["cpt_parent_fingerprint"] == parent.table.fingerprint
    # `mhf cpt --continue` goes on from the run's checkpoint (not from init/ again), in its MLflow run.
    from mhf_dist.train.ray_trainer import TrainOptions

    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 6})})
    grow = lambda old: old.with_added_tokens(NEW_TOKENS)  # noqa: E731
    first = read_history(result.train_result.checkpoint)
    more = run_cpt(longer, str(parent.path), grow, TrainOptions(name="zh", continue_run=True)).train_result
    history = read_history(more.checkpoint)
    assert [entry["step"] for entry in history] == list(range(1, 7))
    assert history[:4] == first  # steps 1-4 carried over (their timings too), not trained again
    assert more.run_id == result.train_result.run_id
    assert tags["signature_fingerprint"] == exported.table.fingerprint
    frozen_params = sum(before[name].numel() for name in frozen)
    assert (tags["total_params"], tags["trainable_params"]) == (
        str(real_params(parent.model)),
        str(real_params(parent.model) - frozen_params),
    )


@pytest.mark.parametrize("buckets", [64, 18])
def test_mhf_cpt_refuses_an_unknown_trainable_pattern_before_preparing(tmp_path, capsys, buckets):
    """... having said, as `mhf prepare` does, when new tokens share an earlier token's signature: a
    parent of 290 tokens fills H2B18's 290 signatures, so the one new token must (H2B64 has room)."""
    from mhf_dist.cli import main
    from mhf_dist.data.prepare.manifest import shared_signatures

    tokenizer = TextTokenizer.train_bpe(builtin_documents()[:20], 290)
    parent, _ = exported_parent(tmp_path, tokenizer, "mhf", buckets=buckets)
    (tmp_path / "new.txt").write_text("你好\n")
    args = ["cpt", "--from", str(parent.path), "--data", "builtin", "--add-tokens", str(tmp_path / "new.txt")]
    storage = tmp_path / "cpt"
    code = main([*args, "--set", "train.trainable=[backbone.layers.9.*]", "--storage", str(storage)])
    assert code == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "'backbone.layers.9.*' matches no parameter" in err
    assert err.count("\n") == 1 and not (storage / "mhf-cpt" / "data").exists()
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert warnings == ([] if buckets == 64 else [shared_signatures(1)])


def test_mhf_cpt_refuses_what_it_cannot_use_before_reading_the_parent(tmp_path, capsys):
    """Flags it would ignore, model settings (the parent's are kept) and recall data (its rows have ids
    of their own) are refused first: the parent here is no model, which would be the line if it were
    read."""
    from mhf_dist.cli import main

    (tmp_path / "nothing").mkdir()
    (tmp_path / "new.txt").write_text("new\n")
    grow = ["--add-tokens", str(tmp_path / "new.txt")]
    recall = (
        "error: recall rows have token ids of their own (k1.., v0..), not the parent's vocabulary grown; "
    )
    for argv, line in (
        (
            [*grow, "--corpus", "builtin"],
            "error: --corpus is the text --train-new-tokens N learns from; leave",
        ),
        (["--train-new-tokens", "5"], "error: --train-new-tokens needs --corpus: the text"),
        ([*grow, "--data", "recall"], recall),
        ([*grow, "--replay", "recall", "--replay-fraction", "0.5"], recall),
        (
            [*grow, "--set", "model.hash.scheme=murmur32"],
            "error: --set model.hash.scheme: mhf cpt trains the parent's model as it is; drop it",
        ),
        ([*grow, "--set", "model={vocab_size: 9}"], "error: --set model: mhf cpt trains the parent's model"),
        ([*grow, "--set", "train.micro_batch_size=3"], "error: train.micro_batch_size=3 does not divide the"),
        ([*grow, "--workers", "3"], "error: train.batch_size=8 does not split over 3 workers"),
    ):
        data = [] if "--data" in argv else ["--data", "builtin"]
        code = main(
            ["cpt", "--from", str(tmp_path / "nothing"), *data, *argv, "--storage", str(tmp_path / "s")]
        )
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert not (tmp_path / "s").exists()


def test_mhf_cpt_refuses_a_config_files_model_key_only_where_it_is_not_the_parents(
    tmp_path, capsys, english_tokenizer
):
    """The file that trained the parent may be given again; a model key it sets to another value (here
    through a `preset:` chain of files) is refused, before any work. A preset, even by path, sets none."""
    from mhf_dist.cli import main

    parent, _ = exported_parent(tmp_path, english_tokenizer, "mhf")  # H2B64, V=300
    # its child by `mhf cpt` (one more token): the file that trained its parent passes for it too
    grown = english_tokenizer.with_added_tokens(["zebrafish"])
    grown.save(tmp_path / "grown.json")
    expansion = expand_model(parent, ["zebrafish"])
    lineage = [{"fingerprint": parent.table.fingerprint, "vocab_size": 300}]
    export_model(
        expansion.model, expansion.config, expansion.table, tmp_path / "grown.json", tmp_path / "c", lineage
    )
    (tmp_path / "known.txt").write_text("e\n")  # already in the vocabulary: the error after the check
    base, own = tmp_path / "base.yaml", tmp_path / "own.yaml"
    own.write_text(f"preset: {base}\ntrain:\n  steps: 5\n")
    for spec, source, model, line in (
        (
            "H2B32",
            own,
            parent.path,
            f"error: {base}: model.hash.spec gives model.hash.spec 'H2B32', not the parent's 'H2B64'",
        ),
        ("H2B64", own, parent.path, "error: "),
        ("H2B64", own, tmp_path / "c", "error: "),
        ("H2B32", PRESET_DIR / "tiny.yaml", parent.path, "error: "),
    ):
        base.write_text(f"preset: tiny\nmodel:\n  vocab_size: 300\n  hash:\n    spec: {spec}\n")
        argv = ["cpt", "--from", str(model), "--data", "builtin", "--config", str(source)]
        assert (
            main([*argv, "--add-tokens", str(tmp_path / "known.txt"), "--storage", str(tmp_path / "s")]) == 2
        )
        (err,) = capsys.readouterr().err.splitlines()
        assert err.startswith(line) and ("'e' is already in the vocabulary" in err) == (line == "error: "), (
            err
        )
    assert not (tmp_path / "s" / "mhf-cpt").exists()


def test_mhf_cpt_reports_a_parent_that_is_no_model_in_one_line(tmp_path, capsys):
    from mhf_dist.cli import main

    (tmp_path / "nothing").mkdir()
    (tmp_path / "x.txt").write_text("new\n")
    argv = [
        "cpt",
        "--from",
        str(tmp_path / "nothing"),
        "--data",
        "builtin",
        "--add-tokens",
        str(tmp_path / "x.txt"),
    ]
    code = main(argv)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is not an exported model" in err and err.count("\n") == 1
