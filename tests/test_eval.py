"""`mhf eval` tasks and `mhf generate` on small exported models, checked against independent computations."""

import copy
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from mhf_dist.cli import main
from mhf_dist.config import RecallDataConfig, load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.prepare import prepare
from mhf_dist.data.recall import EVAL_SEED, make_recall
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import MhfError
from mhf_dist.eval.scoring import ScoringError, score_continuations
from mhf_dist.eval.tasks import RECALL_SEQ_LEN, EvalDataError, run_task
from mhf_dist.export import export_model, load_exported
from mhf_dist.models import base, build_model
from mhf_dist.models.generation import generate
from mhf_dist.plugins import BUILTIN_FAMILIES
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.loop import train_local

MODELS = {
    "mhf": ["model.family=mhf"],
    "qwen3": ["model.family=qwen3"],
    "gated_hybrid": ["model.family=gated_hybrid"],
    "mhf-over-triple_hybrid": ["model.family=mhf", "model.backbone.kind=triple_hybrid"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    tokenizer = TextTokenizer.train_bpe(builtin_documents()[:20], 300)
    tokenizer.save(directory / "tokenizer.json")
    cfg = load_config("tiny", ["model.vocab_size=300", "model.hash.spec=H2B64", *MODELS[request.param]])
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    export_model(
        build_model(cfg.model, table), cfg.model, table, directory / "tokenizer.json", directory / "model"
    )
    return load_exported(directory / "model")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def sequence_logprob(model, ids):
    """log p of ids[1:] given their prefixes, from one teacher-forced pass (not the KV-cache path)."""
    with torch.no_grad():
        nll = model.token_nll(torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]))
    return -nll[0].double()


@torch.no_grad()
def cached_continuation_logprob(model, context, continuation):
    """One request alone, token by token through the KV cache: (log p(continuation | context), whether
    greedy decoding reproduces it) -- the reference the batched scoring must equal."""
    logprobs, cache = model.next_token_logprobs(torch.tensor([context]), model.new_cache())
    total, greedy = 0.0, True
    for index, token in enumerate(continuation):
        if index:
            logprobs, cache = model.next_token_logprobs(torch.tensor([[continuation[index - 1]]]), cache)
        total += float(logprobs[0, token])
        greedy = greedy and int(logprobs[0].argmax()) == token
    return total, greedy


def mean_word_state(exported, word, layer):
    """A word's vector computed alone: hidden states of `layer` over its tokens, averaged."""
    prefix = exported.tokenizer.context_prefix(exported.document_format)
    ids = exported.tokenizer.encode_batch([word.replace("_", " ")])[0]
    with torch.no_grad():
        return exported.model.layer_states(torch.tensor([prefix + ids]), layer)[0, len(prefix) :].mean(dim=0)


def test_ppl_and_bpb_equal_the_models_own_nll_computed_per_window(exported, tmp_path):
    texts = ["The for statement iterates over items.", "A class defines new objects and their methods."]
    path = tmp_path / "texts.txt"
    path.write_text("\n\n".join(texts))
    results = run_task(exported, "ppl", path, seq_len=8)
    tokenizer = exported.tokenizer
    # EOS first, the eos model's prefix token: every token of the text is a target (lm-eval's rolling way)
    stream = [
        tokenizer.eos_id,
        *(t for ids in tokenizer.encode_batch(texts) for t in (*ids, tokenizer.eos_id)),
    ]
    # windows of 8 targets, each window's last token the next one's first; the rest in one shorter window
    windows = [stream[start : start + 9] for start in range(0, len(stream) - 1, 8)]
    assert len(windows[-1]) < 9 and results["last_window"] == len(windows[-1]) - 1
    nll = -torch.cat([sequence_logprob(exported.model, window) for window in windows])
    assert results["tokens"] == nll.numel() == len(stream) - 1  # every target, once
    assert results["ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    text_bytes = sum(len(text.encode()) + 1 for text in texts)
    assert results["bits_per_byte"] == pytest.approx(float(nll.sum()) / math.log(2) / text_bytes, rel=1e-5)


def test_lambada_ppl_is_the_likelihood_of_the_last_word(exported, tmp_path):
    texts = ["He opened the door and saw the garden", "The function returns a new list"]
    results = run_task(exported, "lambada", write_jsonl(tmp_path / "l.jsonl", [{"text": t} for t in texts]))
    encode = exported.tokenizer.encode_batch
    logprobs = []
    for text in texts:
        context, _, word = text.rpartition(" ")
        ctx, target = encode([context])[0], encode([" " + word])[0]
        logprobs.append(float(sequence_logprob(exported.model, ctx + target)[-len(target) :].sum()))
    assert results["ppl"] == pytest.approx(math.exp(-sum(logprobs) / len(texts)), rel=1e-4)


MEMORISED = "He opened the door and saw the garden"


@pytest.fixture(scope="module", params=["mhf", "qwen3"])
def memorised(request, tmp_path_factory):
    """A tiny model trained until greedy decoding reproduces MEMORISED (60 steps, under a second)."""
    directory = tmp_path_factory.mktemp(f"memorised-{request.param}")
    tokenizer = TextTokenizer.train_bpe(builtin_documents()[:20], 300)
    tokenizer.save(directory / "tokenizer.json")
    overrides = ["model.vocab_size=300", "model.hash.spec=H2B64", f"model.family={request.param}"]
    cfg = load_config("tiny", [*overrides, "train.steps=60", "train.warmup_steps=5", "train.seq_len=32"])
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    document = [*tokenizer.encode_batch([MEMORISED])[0], tokenizer.eos_id]
    rows = torch.tensor(list(itertools.islice(itertools.cycle(document), 8 * 33))).reshape(8, 33)
    train_local(model, itertools.repeat({"tokens": rows}), cfg.train, log=None)
    export_model(model, cfg.model, table, directory / "tokenizer.json", directory / "model")
    return load_exported(directory / "model")


def test_lambada_accuracy_counts_the_words_greedy_decoding_reproduces_whole(memorised, tmp_path):
    """Of three words only the memorised one is reproduced: the second text's context is the memorised
    one, so greedy decoding gets its word's first token right and the rest wrong."""
    texts = [MEMORISED, MEMORISED.rpartition(" ")[0] + " list", "The function returns a new list"]
    encode = memorised.tokenizer.encode_batch
    context, _, _ = MEMORISED.rpartition(" ")
    garden, swapped = encode([" garden"])[0], encode([" list"])[0]
    assert garden[0] == swapped[0] and len(swapped) > 1  # one shared first piece, then other pieces
    assert list(generate(memorised.model.eval(), encode([context])[0], len(garden))) == garden
    results = run_task(memorised, "lambada", write_jsonl(tmp_path / "l.jsonl", [{"text": t} for t in texts]))
    assert results["acc"] == pytest.approx(1 / 3) and results["examples"] == 3


def test_hellaswag_picks_the_ending_with_the_highest_summed_loglikelihood(exported, tmp_path):
    record = {
        "ctx": "To define a function you",
        "endings": ["use def", "open a file", "write class", "x"],
        "label": 0,
    }
    encode = exported.tokenizer.encode_batch
    ctx = encode([record["ctx"]])[0]
    sums = []
    for ending in record["endings"]:
        target = encode([" " + ending])[0]
        sums.append(float(sequence_logprob(exported.model, ctx + target)[-len(target) :].sum()))
    best = int(np.argmax(sums))
    results = run_task(exported, "hellaswag", write_jsonl(tmp_path / "h.jsonl", [{**record, "label": best}]))
    assert results["acc"] == 1.0
    wrong = (best + 1) % 4
    assert (
        run_task(exported, "hellaswag", write_jsonl(tmp_path / "w.jsonl", [{**record, "label": wrong}]))[
            "acc"
        ]
        == 0
    )


def test_card660_correlates_scores_with_word_vector_cosines(exported, tmp_path):
    pairs = [
        ("new_york", "city", 3.5),
        ("def", "function", 2.0),
        ("loop", "for", 1.0),
        ("class", "object", 4.0),
    ]
    path = tmp_path / "card.tsv"
    path.write_text("".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs))
    results = run_task(exported, "card660", path)
    cosines = [
        float(
            torch.nn.functional.cosine_similarity(
                mean_word_state(exported, a, -2), mean_word_state(exported, b, -2), dim=0
            )
        )
        for a, b, _ in pairs
    ]
    assert results["spearman"] == pytest.approx(spearmanr(cosines, [s for *_, s in pairs]).statistic)
    assert results["coverage"] == 1.0


def test_card660_reads_every_layer_the_model_has_and_refuses_any_other(exported, tmp_path):
    path = tmp_path / "card.tsv"
    path.write_text("loop\tfor\t1.0\nclass\tobject\t4.0\ndef\tfunction\t2.0\n")
    states = exported.config.backbone.num_layers + 1
    for layer in (-states, states - 1):
        assert run_task(exported, "card660", path, layer=layer)["coverage"] == 1.0
    for layer in (-states - 1, states, 50):
        message = (
            rf"^--layer {layer}: the model has {states} hidden states \(layers -{states}\.\.{states - 1}\)"
        )
        with pytest.raises(EvalDataError, match=message):
            run_task(exported, "card660", path, layer=layer)


@pytest.mark.parametrize(
    ("task", "content", "message"),
    [
        ("lambada", '{"txt": "a b"}\n', r"l.data:1: missing field 'text'"),
        (
            "hellaswag",
            '{"ctx": "a", "endings": ["b", "c"], "label": 2}\n',
            r"l.data:1: label 2 for 2 endings",
        ),
        ("card660", "one\ttwo\n", r"l.data:1: expected word1<TAB>word2<TAB>score"),
        ("lambada", "not json\n", r"l.data:1: not valid JSON"),
        ("lambada", '\n{"text": "a b"}\n{"text": "word"}\n', r"l.data:3: no context before the last word"),
        ("card660", "a\tb\t1\none\ttwo\t0.5\tx\n", r"l.data:2: expected word1<TAB>word2<TAB>score, not 4"),
        ("card660", "\tdog\t0.5\n", r"l.data:1: a word is empty; expected word1<TAB>word2<TAB>score"),
        ("card660", "cat\tdog\thigh\n", r"l.data:1: score 'high' is not a number"),
        ("card660", "cat\tdog\t1_0\n", r"l.data:1: score '1_0' is not a number"),
    ],
)
def test_malformed_files_are_one_line_errors_naming_file_and_line(exported, tmp_path, task, content, message):
    path = tmp_path / "l.data"
    path.write_text(content)
    with pytest.raises(EvalDataError, match=message):
        run_task(exported, task, path)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
@pytest.mark.parametrize(
    ("example", "message"),
    [
        ({"endings": ["runs", 5]}, r"field 'endings' must be a list of strings, but ending 2 is 5$"),
        ({"endings": ["runs", None]}, r"field 'endings' must be a list of strings, but ending 2 is null$"),
        ({"endings": ["", "", "", ""]}, r"ending 1 is empty; give every ending its text$"),
        ({"endings": ["runs", " "]}, r"ending 2 is empty; give every ending its text$"),
        ({"ctx": " "}, r"field 'ctx' is empty; give each example the context its endings follow$"),
        ({"label": 2}, r"label 2 for 2 endings; give two endings or more and a label that indexes one"),
    ],
)
def test_hellaswag_refuses_an_example_whose_endings_cannot_be_told_apart(
    exported, tmp_path, example, message
):
    """An empty ending would score by construction: all-empty endings gave acc 1.0."""
    good = {"ctx": "a man", "endings": ["runs", "sits"], "label": 0}
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, **example}) + "\n")
    with pytest.raises(EvalDataError, match=rf"^{path}:3: {message}"):
        run_task(exported, "hellaswag", path)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_a_hellaswag_example_whose_gold_ending_is_the_same_tokens_as_another_counts_wrong(exported, tmp_path):
    """Equal endings score equally, so the first of them would win by its place: of the first two
    examples exactly one would count right, whichever of "runs" and "sits" the model prefers. Each
    counts wrong, and is reported."""
    examples = [
        {"ctx": "a man", "endings": ["runs", "sits", "runs"], "label": 0},
        {"ctx": "a man", "endings": ["sits", "runs", "sits"], "label": 0},
        {"ctx": "a man", "endings": ["sits", "runs"], "label": 0},  # the gold is distinct
    ]
    results = run_task(exported, "hellaswag", write_jsonl(tmp_path / "h.jsonl", examples))
    sits_wins = run_task(exported, "hellaswag", write_jsonl(tmp_path / "one.jsonl", examples[2:]))["acc"]
    assert results["indistinct"] == 2 and results["examples"] == 3
    assert results["acc"] == pytest.approx(sits_wins / 3) and results["acc_norm"] == pytest.approx(
        sits_wins / 3
    )


def test_mhf_generate_streams_reproducible_samples(exported, capsys):
    args = ["generate", "--model", str(exported.path), "--prompt", "The", "--max-new-tokens", "8"]
    sampled = [*args, "--temperature", "1.0", "--top-k", "20", "--seed", "7"]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == first and first.startswith("The")
    assert main([*args, "--top-p", "1.5"]) == 2
    assert "--top-p: '1.5': use a number above 0 and at most 1" in capsys.readouterr().err
    for flags, named in (
        (["--top-k", "20", "--seed", "7"], "--top-k, --seed"),
        (["--top-p", "0.9", "--temperature", "0"], "--top-p"),
    ):
        assert main([*args, *flags]) == 2  # greedy: they would change nothing
        assert capsys.readouterr().err == (
            f"error: {named} only apply when sampling and --temperature 0 is greedy; give --temperature "
            "above 0 or leave them out\n"
        )


TINY_TASK = """task: mhf_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


# The adapter calls the same scoring for every family: one standard and one hash model (over a recurrent
# stack) keep its ~15 s per model of lm-eval set-up affordable.
@pytest.mark.parametrize("exported", ["qwen3", "mhf-over-triple_hybrid"], indirect=True)
def test_the_lm_eval_model_agrees_with_mhf_eval_offline(exported, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from lm_eval.tasks import TaskManager

    import mhf_dist.eval.harness  # noqa: F401  registers the model "mhf"

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    records = [
        {"ctx": "A loop repeats", "endings": ["its body", "the file", "a class"], "label": 0},
        {"ctx": "The function returns", "endings": ["a value", "the door", "blue"], "label": 1},
        {"ctx": "Import a module with", "endings": ["import", "tea", "def", "for"], "label": 0},
    ]
    data = write_jsonl(tmp_path / "choice.jsonl", records)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TINY_TASK.format(data=data))
    output = lm_eval.simple_evaluate(
        model="mhf",
        model_args=f"path={exported.path}",
        tasks=["mhf_tiny_choice"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        log_samples=True,
    )
    assert output["results"]["mhf_tiny_choice"]["acc,none"] == pytest.approx(
        run_task(exported, "hellaswag", data)["acc"]
    )
    encode = exported.tokenizer.encode_batch
    sample = min(output["samples"]["mhf_tiny_choice"], key=lambda s: s["doc_id"])
    harness_scores = [resp[0][0] for resp in sample["resps"]]
    ctx = encode([records[0]["ctx"]])[0]
    endings = [encode([" " + ending])[0] for ending in records[0]["endings"]]
    ours = [cached_continuation_logprob(exported.model, ctx, ending)[0] for ending in endings]
    assert harness_scores == pytest.approx(ours, rel=1e-6)


def test_recall_labels_are_correct_by_construction():
    data = make_recall(20, num_pairs=6, num_queries=3, seq_len=40, vocab_size=100, seed=3)
    for row, mask in zip(data.rows, data.query_mask, strict=True):
        pairs = dict(zip(row[0:12:2].tolist(), row[1:12:2].tolist(), strict=True))
        assert (
            len(pairs) == 6 and all(1 <= k < 50 for k in pairs) and all(50 <= v < 100 for v in pairs.values())
        )
        queried = np.flatnonzero(mask)
        assert len(queried) == 3 and all(position >= 12 for position in queried)
        for position in queried:  # the value after a query key is the one paired with it earlier
            assert pairs[int(row[position])] == int(row[position + 1])
        others = np.setdiff1d(np.arange(12, 41), np.concatenate([queried, queried + 1]))
        assert (row[others] == 0).all()


class RecallOracle:
    """A hand-built scorer for associative recall: after a key, the value paired with that key at the
    start of the row (for the keys `knows` accepts; else the key itself, never a value) gets almost all
    of the probability."""

    def __init__(self, vocab_size, knows):
        self.vocab_size, self.knows = vocab_size, knows

    def eval(self):
        return self

    def parameters(self):
        return iter(())

    def score_targets(self, inputs, targets, mask):
        hits = []
        for row, position in mask.nonzero().tolist():
            prefix = inputs[row, : position + 1].tolist()
            key = prefix[-1]
            answer = prefix[prefix.index(key) + 1] if self.knows(key) else key
            hits.append(answer == int(targets[row, position]))
        return torch.zeros(len(hits)), torch.tensor(hits)


def test_recall_accuracy_is_the_share_of_queries_whose_value_scores_highest():
    vocab_size, defaults = 300, RecallDataConfig()
    data = make_recall(4, defaults.num_pairs, defaults.num_queries, RECALL_SEQ_LEN, vocab_size, EVAL_SEED)
    queried = np.concatenate([row[:-1][mask] for row, mask in zip(data.rows, data.query_mask, strict=True)])
    even = float(np.mean(queried % 2 == 0))  # the share of queries an oracle of even keys answers
    assert 0 < even < 1

    def scored_by(knows):
        exported = SimpleNamespace(
            model=RecallOracle(vocab_size, knows),
            config=SimpleNamespace(
                vocab_size=vocab_size, backbone=SimpleNamespace(max_position_embeddings=RECALL_SEQ_LEN)
            ),
        )
        return run_task(exported, "recall", None, limit=4)

    assert scored_by(lambda key: True) == {"acc": 1.0, "queries": 16, "examples": 4}
    assert scored_by(lambda key: key % 2 == 0)["acc"] == pytest.approx(even)
    assert scored_by(lambda key: False)["acc"] == 0.0


def test_text_files_split_into_documents_like_mhf_prepare(tmp_path):
    from mhf_dist.data.corpus import split_text_file
    from mhf_dist.eval.tasks import EvalDataError, read_texts

    path = tmp_path / "wiki.raw"
    path.write_text(
        " = Heading = \n \n First paragraph .\r\n\t\nSecond one .\n"
    )  # WikiText's " " blank lines
    assert read_texts(path) == ["= Heading =", "First paragraph .", "Second one ."]
    for name in ("lines.jsonl", "LINES.JSONL", "lines.json"):  # JSON lines by prepare's suffix rules
        lines = tmp_path / name  # an empty text is no document there either
        lines.write_text('{"text": "One ."}\n{"text": ""}\n{"text": "Two ."}\n')
        assert read_texts(lines) == ["One .", "Two ."]
    odd = tmp_path / "odd.txt"  # a form feed, a lone CR, U+2028: no line breaks to prepare either
    odd.write_bytes("para one\x0c\x0cpara two\r\rthree\u2028\u2028four\n\nfive".encode())
    assert (
        read_texts(odd)
        == split_text_file(odd.read_bytes())[0]
        == ["para one\x0c\x0cpara two\r\rthree\u2028\u2028four", "five"]
    )
    for name, kind in (("t.txt.gz", "text, compressed"), ("t.parquet", "parquet")):
        (tmp_path / name).write_bytes(b"\x1f\x8b")
        with pytest.raises(EvalDataError, match=rf"{name} is {kind}; ppl and bpb read an uncompressed text"):
            read_texts(tmp_path / name)


# Batched scoring: right-padded batches of mixed lengths must score as one request at a time does.
# gated_hybrid's memory keeps each query's top-k keys, and a repeated token repeats a key: torch.topk
# breaks such ties differently at another row length (its KV-cache path already differs from its
# full pass), so on text it is not exact at any batch size; it is checked on rows without repeated ids.
EXACTLY_BATCHED = ["mhf", "qwen3", "mhf-over-triple_hybrid"]
MIXED_TEXTS = [
    "He opened the door and saw the garden",
    "A loop",
    "The function returns a new list of every item that the iterator yields before it stops",
    "Classes define objects",
    "Import the module first and then call its main function with the arguments it expects",
    "for x",
]


def mixed_pairs(exported):
    """(context, continuation) ids of many lengths; every other continuation is the model's own greedy
    decoding, so both values of the greedy flag occur."""
    model, encode = exported.model.eval(), exported.tokenizer.encode_batch
    pairs = []
    for number, text in enumerate(MIXED_TEXTS * 3):
        words = text.split()
        cut = 1 + number % len(words) if len(words) > 1 else 1
        context = encode([" ".join(words[:cut])])[0]
        continuation = encode([" " + " ".join(words[cut:] or ["end"])])[0][: 1 + number % 7]
        if number % 2:
            continuation = list(generate(model, context, len(continuation)))
        pairs.append((context, continuation))
    return pairs


def assert_scores_equal_one_at_a_time(model, pairs):
    expected = [cached_continuation_logprob(model, *pair) for pair in pairs]
    for batch_size in (1, 4, 16):
        scores = score_continuations(model, pairs, batch_size)
        assert [greedy for _, greedy in scores] == [greedy for _, greedy in expected]
        assert [logprob for logprob, _ in scores] == pytest.approx([lp for lp, _ in expected], rel=1e-5)
    return expected


@pytest.mark.parametrize("exported", EXACTLY_BATCHED, indirect=True)
def test_batched_continuation_scores_equal_one_request_at_a_time_through_the_kv_cache(exported):
    expected = assert_scores_equal_one_at_a_time(exported.model, mixed_pairs(exported))
    assert {greedy for _, greedy in expected} == {True, False}


@pytest.mark.parametrize("exported", ["gated_hybrid"], indirect=True)
def test_gated_hybrid_scores_alike_at_every_batch_size_where_no_memory_keys_tie(exported):
    ids = torch.randperm(exported.config.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    lengths = [(1 + n % 13, 1 + n % 5) for n in range(18)]  # up to 17 ids: more pairs than top_k
    pairs = [(ids[n : n + c], ids[n + c : n + c + t]) for n, (c, t) in enumerate(lengths)]
    assert_scores_equal_one_at_a_time(exported.model, pairs)


def test_scoring_rejects_an_empty_context_and_a_continuation_longer_than_max_length(exported):
    with pytest.raises(ScoringError, match="context is empty"):
        score_continuations(exported.model, [([], [5, 6])], 4)
    with pytest.raises(ScoringError, match="does not fit max_length=2; raise max_length"):
        score_continuations(exported.model, [([1, 2], [5, 6, 7])], 4, max_length=2)
    with pytest.raises(ScoringError, match="batch_size=0"):
        score_continuations(exported.model, [([1, 2], [5])], 0)


def mixed_task_data(tmp_path):
    """Each task's file, with examples of many lengths so that a batch holds padding."""
    texts = tmp_path / "texts.txt"
    texts.write_text("\n\n".join(MIXED_TEXTS))
    records = [
        {"ctx": text.rpartition(" ")[0], "endings": [text.rpartition(" ")[2], *endings], "label": 0}
        for text, endings in zip(
            MIXED_TEXTS[::-1],
            itertools.cycle([["a class", "the door and then the garden"], ["x", "y z"], ["open a file"]]),
            strict=False,
        )
    ]
    words = ["new_york", "city", "def", "function_definition", "loop", "for", "class", "iterator_protocol"]
    card = tmp_path / "card.tsv"
    scored = enumerate(itertools.pairwise(words))
    card.write_text("".join(f"{a}\t{b}\t{number % 5 + 0.5}\n" for number, (a, b) in scored))
    return {
        "ppl": texts,
        "bpb": texts,
        "lambada": write_jsonl(tmp_path / "l.jsonl", [{"text": text} for text in MIXED_TEXTS * 3]),
        "hellaswag": write_jsonl(tmp_path / "h.jsonl", records),
        "card660": card,
        "recall": None,
    }


@pytest.mark.parametrize("exported", EXACTLY_BATCHED, indirect=True)
@pytest.mark.parametrize("task", ["ppl", "bpb", "lambada", "hellaswag", "card660", "recall"])
def test_every_task_gives_the_same_metrics_at_batch_size_16_as_one_at_a_time(exported, tmp_path, task):
    data = mixed_task_data(tmp_path)[task]
    one, batched = (
        run_task(exported, task, data, limit=20 if task == "recall" else 0, seq_len=8, batch_size=size)
        for size in (1, 16)
    )
    assert batched.keys() == one.keys()
    for name, value in one.items():
        if name.startswith("acc") or isinstance(value, int):
            assert batched[name] == value, name
        else:
            assert batched[name] == pytest.approx(value, rel=1e-5), name


def tiny_model(family):
    cfg = load_config("tiny", ["model.vocab_size=300", "model.hash.spec=H2B64", f"model.family={family}"])
    torch.manual_seed(0)
    return build_model(cfg.model, SignatureTable.build([f"t{i}" for i in range(300)], 2, 64)).eval()


def scoring_batch():
    """inputs, targets and a mask of the positions to score, [2, 13] each."""
    inputs = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:26].view(2, 13)
    targets = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.rand(2, 13, generator=torch.Generator().manual_seed(2)) < 0.6
    return inputs, targets, mask


@pytest.mark.parametrize("family", BUILTIN_FAMILIES)
def test_every_family_scores_selected_targets_as_its_next_token_logprobs_do(family):
    model = tiny_model(family)
    inputs, targets, mask = scoring_batch()
    with torch.no_grad():
        alone = [model.next_token_logprobs(inputs[b : b + 1, : t + 1], None)[0][0] for b, t in mask.nonzero()]
        targets[mask] = torch.stack([lp.argmax() if n % 2 else lp.argmin() for n, lp in enumerate(alone)])
        logprob, greedy = model.score_targets(inputs, targets, mask)
    assert greedy.tolist() == [n % 2 == 1 for n in range(len(alone))]
    expected = [float(lp[target]) for lp, target in zip(alone, targets[mask], strict=True)]
    assert logprob.tolist() == pytest.approx(expected, rel=1e-5)


# Each V-way family's output layer and how often it runs per block of positions (gated_hybrid's
# memory read goes through it too).
OUTPUT_LAYERS = {
    "qwen3": ("model.lm_head", 1),
    "triple_latent": ("head", 1),
    "gated_hybrid": ("head", 2),
    "transformer_plus_triple": ("transformer.lm_head", 1),
}


def rows_reaching(model, family):
    """The list, filled as the model runs, of how many positions each call of its output layer reads."""
    rows = []
    layer = model.get_submodule(OUTPUT_LAYERS[family][0])
    layer.register_forward_hook(lambda _layer, args, _output: rows.append(args[0].shape[:-1].numel()))
    return rows


@pytest.mark.parametrize("family", list(OUTPUT_LAYERS))
def test_score_targets_applies_the_output_layer_only_at_the_scored_positions(family):
    model = tiny_model(family)
    inputs, targets, mask = scoring_batch()
    with torch.no_grad():
        every_position = torch.log_softmax(model.logits(inputs).float(), dim=-1)[mask]
        rows = rows_reaching(model, family)
        logprob, greedy = model.score_targets(inputs, targets, mask)
    assert rows == [int(mask.sum())] * OUTPUT_LAYERS[family][1]
    chosen = targets[mask]
    assert torch.allclose(logprob, every_position.gather(-1, chosen[:, None])[:, 0], rtol=1e-5, atol=1e-6)
    assert torch.equal(greedy, every_position.argmax(-1) == chosen)


@pytest.mark.parametrize("family", ["qwen3", "gated_hybrid"])
def test_scoring_in_blocks_of_positions_gives_the_scores_of_one_block(family, monkeypatch):
    model = tiny_model(family)
    inputs, targets, mask = scoring_batch()
    with torch.no_grad():
        (logprob, greedy), nll = model.score_targets(inputs, targets, mask), model.token_nll(inputs, targets)
        monkeypatch.setattr(base, "SCORED_LOGITS_PER_BLOCK", 4 * model.vocab_size + 3)  # 4 positions
        rows = rows_reaching(model, family)
        blocked_logprob, blocked_greedy = model.score_targets(inputs, targets, mask)
        blocked_nll = model.token_nll(inputs, targets)
    scored = (int(mask.sum()), mask.numel())  # score_targets', then token_nll's positions
    blocks = [len(block) for count in scored for block in torch.arange(count).split(4)]
    assert rows == [size for size in blocks for _ in range(OUTPUT_LAYERS[family][1])]
    assert torch.allclose(blocked_logprob, logprob, rtol=1e-5, atol=1e-6)
    assert torch.equal(blocked_greedy, greedy)
    assert torch.allclose(blocked_nll, nll, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exported", ["mhf"], indirect=True)
def test_mhf_greedy_flags_skip_reserved_rows_as_next_token_logprobs_does(exported):
    """A reserved row (normaliser only) given the most likely signature at every position would win an
    argmax over all rows; greedy decoding never picks it, and neither may the batched greedy flag."""
    model = copy.deepcopy(exported.model).eval()
    ids = torch.tensor([exported.tokenizer.encode_batch([MIXED_TEXTS[2]])[0]])
    with torch.no_grad():
        best_signatures = model.coord_logprobs(ids).argmax(-1)[0]  # [T, H]: per-coordinate best buckets
        model.vocab_signatures = torch.cat([model.vocab_signatures, best_signatures])
        expected = [model.next_token_logprobs(ids[:, : t + 1], None)[0][0] for t in range(ids.shape[1])]
        targets = torch.stack([logprobs.argmax() for logprobs in expected])[None]
        logprob, greedy = model.score_targets(ids, targets, torch.ones_like(ids, dtype=torch.bool))
    assert greedy.all()
    assert logprob.tolist() == pytest.approx([float(e.max()) for e in expected], rel=1e-5)
    assert all(e.logsumexp(-1) < -1e-3 for e in expected)  # the reserved rows hold real mass


@pytest.mark.parametrize("exported", EXACTLY_BATCHED, indirect=True)
def test_the_harness_scores_alike_at_every_batch_size(exported):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval.harness import MhfHarnessLM

    requests = [SimpleNamespace(args=(t.rpartition(" ")[0], " " + t.rpartition(" ")[2])) for t in MIXED_TEXTS]
    requests.append(SimpleNamespace(args=("", "A loop")))
    texts = [SimpleNamespace(args=(text,)) for text in ["", *MIXED_TEXTS]]
    results = {}
    for batch_size in (1, "16", "auto:4"):
        lm = MhfHarnessLM(str(exported.path), max_length=8, batch_size=batch_size)
        results[batch_size] = (lm.loglikelihood(requests), lm.loglikelihood_rolling(texts))
    (likelihoods, rolling), *others = results.values()
    for other_likelihoods, other_rolling in others:
        assert [greedy for _, greedy in other_likelihoods] == [greedy for _, greedy in likelihoods]
        assert [lp for lp, _ in other_likelihoods] == pytest.approx([lp for lp, _ in likelihoods], rel=1e-5)
        assert other_rolling == pytest.approx(rolling, rel=1e-5)
    # A context longer than max_length loses its oldest ids. A rolling text is scored in windows of
    # 8 targets, each read with as much context as fits in 8 inputs (lm-eval's disjoint windows).
    context, continuation = exported.tokenizer.encode_pair(*requests[2].args)
    kept = (context + continuation)[-9 : -len(continuation)]
    expected_likelihood = cached_continuation_logprob(exported.model, kept, continuation)[0]
    assert likelihoods[2][0] == pytest.approx(expected_likelihood, rel=1e-5)
    ids = [exported.tokenizer.eos_id, *exported.tokenizer.encode_batch([MIXED_TEXTS[2]])[0]]
    ends = [min(start + 8, len(ids)) for start in range(1, len(ids), 8)]
    expected_rolling = sum(
        float(sequence_logprob(exported.model, ids[max(0, end - 9) : end])[-(end - start) :].sum())
        for start, end in zip(range(1, len(ids), 8), ends, strict=True)
    )
    assert len(ends) > 2 and rolling[3] == pytest.approx(expected_rolling, rel=1e-5) and rolling[0] == 0.0


def test_harness_batch_sizes_follow_lm_eval():
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval.harness import AUTO_BATCH_SIZE, harness_batch_size

    sizes = [harness_batch_size(value) for value in (3, "16", "auto", "auto:4")]
    assert sizes == [3, 16, AUTO_BATCH_SIZE, AUTO_BATCH_SIZE]
    for bad in ("0", "x", -2, "autofoo", "auto:0"):
        with pytest.raises(ScoringError, match="use a positive integer, 'auto' or 'auto:N'"):
            harness_batch_size(bad)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_a_batch_size_in_the_model_args_wins_over_the_command_lines_default(exported):
    """lm-eval's CLI always passes its --batch_size (default 1) beside the model args."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval.harness import MhfHarnessLM

    cli_default = {"batch_size": 1, "max_batch_size": None, "device": None}
    lm = MhfHarnessLM.create_from_arg_string(f"path={exported.path},batch_size=4", cli_default)
    assert lm.batch_size == 4
    assert MhfHarnessLM.create_from_arg_string(f"path={exported.path}", {"batch_size": 8}).batch_size == 8


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_mhf_eval_passes_a_batch_size_of_at_least_one_to_the_task(exported, tmp_path, capsys, monkeypatch):
    import mhf_dist.eval.tasks

    calls = []

    def recording_run_task(*args, **kwargs):
        calls.append(kwargs["batch_size"])
        return run_task(*args, **kwargs)

    monkeypatch.setattr(mhf_dist.eval.tasks, "run_task", recording_run_task)
    path = write_jsonl(tmp_path / "l.jsonl", [{"text": text} for text in MIXED_TEXTS])
    args = ["eval", "--model", str(exported.path), "--task", "lambada", "--data", str(path)]
    assert main([*args, "--batch-size", "0"]) == 2
    assert "--batch-size: '0': use a whole number of at least 1" in capsys.readouterr().err
    assert main([*args, "--batch-size", "3"]) == main(args) == 0
    assert calls == [3, 16]


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_mhf_eval_refuses_what_its_task_would_ignore_and_a_limit_of_zero(exported, tmp_path, capsys):
    """recall generates its examples, so a file would be ignored, as --seq-len would be outside ppl and bpb
    of a text file and --layer outside card660; --limit 0 would mean every example."""
    data = write_jsonl(tmp_path / "l.jsonl", [{"text": text} for text in MIXED_TEXTS])
    args = ["eval", "--model", str(exported.path), "--task", "recall"]
    assert main([*args, "--data", str(data)]) == 2
    assert capsys.readouterr().err == (
        "error: task 'recall' generates its own examples and reads no file; drop --data\n"
    )
    lambada = ["eval", "--model", str(exported.path), "--task", "lambada", "--data", str(data)]
    assert main([*lambada, "--seq-len", "64"]) == 2
    assert capsys.readouterr().err == (
        "error: --seq-len is read by ppl and bpb of a text file (prepared shards keep their rows) only; "
        "drop it for --task lambada\n"
    )
    assert main([*lambada[:-3], "ppl", "--data", str(data), "--layer", "1"]) == 2
    assert capsys.readouterr().err == "error: --layer is read by card660 only; drop it for --task ppl\n"
    assert main([*args, "--limit", "0"]) == 2
    assert "--limit: '0': use a whole number of at least 1" in capsys.readouterr().err
    assert main([*args, "--limit", "2"]) == 0


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_no_task_reads_past_the_models_max_position_embeddings(exported, tmp_path, capsys):
    """Scores past the positions a model was built for would be quietly off: windows, examples and
    recall rows longer than max_position_embeddings are refused."""
    data = mixed_task_data(tmp_path)
    most = exported.config.backbone.max_position_embeddings
    args = ["eval", "--model", str(exported.path), "--task", "ppl", "--data", str(data["ppl"])]
    assert main([*args, "--seq-len", str(most + 1)]) == 2
    assert capsys.readouterr().err == (
        f"error: --seq-len is {most + 1}, above the model's max_position_embeddings {most}; "
        "pass a smaller --seq-len\n"
    )
    backbone = exported.config.backbone.model_copy(update={"max_position_embeddings": 8})
    short = dataclasses.replace(exported, config=exported.config.model_copy(update={"backbone": backbone}))
    assert run_task(short, "ppl", data["ppl"], seq_len=8)["tokens"] > 0
    with pytest.raises(EvalDataError, match=r"^--seq-len is 9, above the model's max_position_embeddings 8"):
        run_task(short, "ppl", data["ppl"], seq_len=9)
    for task in ("lambada", "hellaswag"):
        with pytest.raises(
            EvalDataError, match=r"\.jsonl:1: the example reads a sequence of length \d+, above"
        ):
            run_task(short, task, data[task])
    with pytest.raises(EvalDataError, match=r"^recall rows have a seq_len of 64, above the model's max_pos"):
        run_task(short, "recall", None, limit=2)
    (tmp_path / "long.tsv").write_text("cat\tdog\t0.1\nsupercalifragilisticexpialidocious\tdog\t0.5\n")
    with pytest.raises(EvalDataError, match=r"^the word 'supercalifragilisticexpialidocious' reads a seq"):
        run_task(short, "card660", tmp_path / "long.tsv")


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_mhf_eval_refuses_shards_of_another_signature_table(exported, tmp_path, capsys):
    """Their ids would name other tokens: one line naming model, shards and the fix."""
    other = prepare(load_config("tiny", ["data.corpus=recall", "model.vocab_size=40"]), tmp_path / "other")
    capsys.readouterr()
    args = ["eval", "--model", str(exported.path), "--task", "ppl", "--data", str(tmp_path / "other")]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"error: model {str(exported.path)!r} has signature fingerprint {exported.table.fingerprint[:12]} "
        f"but the shards in {str(tmp_path / 'other')!r} have {other.signatures.fingerprint[:12]}; "
        f"prepare the data with the model's tokenizer.json and --set data.signatures={exported.path}\n"
    )


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_generate_ends_its_text_line_before_an_error_and_reads_no_more_than_max_positions(
    exported, tmp_path, capsys
):
    model = copy.deepcopy(exported.model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    export_model(model, exported.config, exported.table, exported.path / "tokenizer.json", tmp_path / "nan")
    assert main(["generate", "--model", str(tmp_path / "nan"), "--prompt", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "hi\n" and err.startswith("error: ") and err.count("\n") == 1, (out, err)
    most = exported.config.backbone.max_position_embeddings
    too_many = ["--prompt", "hi", "--max-new-tokens", str(most + 1)]
    assert main(["generate", "--model", str(exported.path), *too_many]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: the prompt and --max-new-tokens read a sequence of length")
    assert f"above the model's max_position_embeddings {most}; shorten the prompt" in err


@pytest.mark.parametrize("exported", ["mhf", "mhf-over-triple_hybrid"], indirect=True)
def test_harness_generation_is_alike_at_every_batch_size_and_cut_at_until(exported):
    """Each continuation equals its prompt's greedy decoding alone, to max_gen_toks, cut at the first
    `until` string; a prompt keeps its newest max_length - max_gen_toks ids (30 - 10 here)."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    from mhf_dist.eval.harness import MhfHarnessLM

    tokenizer = exported.tokenizer
    words = MIXED_TEXTS[2].split()
    contexts = [" ".join(words[:count]) for count in (1, 2, 3, 4, 6, len(words))]  # 2 to 62 ids

    def decoded_alone(context, max_gen_toks):
        framed = tokenizer.context_prefix(exported.document_format) + tokenizer.encode_batch([context])[0]
        prompt = framed[-(30 - max_gen_toks) :]
        ids = list(generate(exported.model, prompt, max_gen_toks, stop_ids=[tokenizer.eos_id]))
        return tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]

    full = [decoded_alone(context, 10) for context in contexts]
    # until: two printable characters of one continuation, after its start (a "�" is half a character)
    pieces = [full[3][start : start + 2] for start in range(2, len(full[3]) - 1)]
    piece = next(piece for piece in pieces if piece.isprintable() and "\ufffd" not in piece)
    long_kwargs = {"until": [piece], "max_gen_toks": 10}
    short_kwargs = {"until": "\n", "max_gen_toks": 4}
    requests = [SimpleNamespace(args=(context, long_kwargs)) for context in contexts]
    requests += [SimpleNamespace(args=(context, short_kwargs)) for context in contexts[::5]]
    expected = [text.split(long_kwargs["until"][0])[0] for text in full]
    expected += [decoded_alone(context, 4).split("\n")[0] for context in contexts[::5]]
    assert len(expected[3]) < len(full[3])
    for batch_size in (1, 4):
        lm = MhfHarnessLM(str(exported.path), max_length=30, batch_size=batch_size)
        assert lm.generate_until(requests) == expected


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
@pytest.mark.parametrize(
    ("task", "name", "content"),
    [
        ("ppl", "t.txt", ""),
        ("bpb", "t.txt", "\n  \n\n"),
        ("ppl", "t.jsonl", ""),
        ("lambada", "l.jsonl", "\n\n"),
        ("hellaswag", "h.jsonl", ""),
        ("card660", "c.tsv", "\n"),
    ],
)
def test_a_file_without_examples_is_one_line_not_a_division_by_zero(exported, tmp_path, task, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(EvalDataError, match=rf"^{path} has no examples; give it ") as err:
        run_task(exported, task, path, limit=3)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
@pytest.mark.parametrize("task", ["ppl", "lambada", "hellaswag", "card660"])
def test_an_eval_file_that_is_not_utf8_names_the_byte_offset(exported, tmp_path, task):
    path = tmp_path / ("t.txt" if task in ("ppl", "card660") else "t.jsonl")
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(EvalDataError, match=r"is not UTF-8: byte 0xe9 at byte offset 28 \(line 2\)"):
        run_task(exported, task, path)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
def test_card660_refuses_scores_that_give_no_correlation(exported, tmp_path):
    path = tmp_path / "card.tsv"
    path.write_text("loop\tfor\t2.0\nclass\tdef\t2.0\nfile\topen\t2.0\n")
    with pytest.raises(EvalDataError, match=r"all 3 scorable pairs of .*card.tsv have the score 2, so no"):
        run_task(exported, "card660", path)
    path.write_text("loop\tfor\t2.0\nclass\tdef\tnan\n")
    with pytest.raises(EvalDataError, match=r"card.tsv:2: score 'nan' is not a finite number"):
        run_task(exported, "card660", path)
    flat = copy.deepcopy(exported)
    for parameter in flat.model.parameters():
        parameter.data.zero_()  # every word's hidden states alike: every cosine the same
    path.write_text("loop\tfor\t2.0\nclass\tdef\t1.0\nfile\topen\t3.0\n")
    with pytest.raises(EvalDataError, match=r"gives all 3 scorable pairs of .*card.tsv the same cosine"):
        run_task(flat, "card660", path)


@pytest.mark.parametrize("exported", ["qwen3"], indirect=True)
@pytest.mark.parametrize("task", ["ppl", "bpb", "lambada", "hellaswag", "card660", "recall"])
def test_a_model_with_nan_weights_is_an_error_not_a_metric(exported, tmp_path, task):
    broken = copy.deepcopy(exported)
    with torch.no_grad():
        next(broken.model.parameters()).fill_(float("nan"))
    data = mixed_task_data(tmp_path)[task]
    with pytest.raises(MhfError, match=r"nan or (inf|overflow) \(a diverged or damaged") as err:
        run_task(broken, task, data, limit=20 if task == "recall" else 0, seq_len=8)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def recall_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recall-model")
    TextTokenizer.recall(40).save(directory / "tokenizer.json")
    cfg = load_config("tiny", ["model.vocab_size=40", "model.hash.spec=H2B64", "model.family=qwen3"])
    table = SignatureTable.build(TextTokenizer.recall(40).vocabulary(), 2, 64)
    export_model(
        build_model(cfg.model, table), cfg.model, table, directory / "tokenizer.json", directory / "model"
    )
    return directory / "model"


def test_a_word_outside_a_word_level_vocabulary_is_an_error_in_text_and_uncovered_in_card660(
    recall_model, tmp_path, capsys
):
    args = ["generate", "--model", str(recall_model), "--max-new-tokens", "2"]
    assert main([*args, "--prompt", "k1 v0 k1"]) == 0
    capsys.readouterr()
    assert main([*args, "--prompt", "k1 hello v0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: unknown word(s) 'hello': the tokenizer is word-level with a fixed vocabulary of 40 words and "
        "no <unk> token; use only its words"
    )
    data = write_jsonl(tmp_path / "l.jsonl", [{"text": "k1 v0 k1 v0"}, {"text": "k2 v1 k2 sunshine"}])
    assert main(["eval", "--model", str(recall_model), "--task", "lambada", "--data", str(data)]) == 2
    assert "error: unknown word(s) 'sunshine'" in capsys.readouterr().err
    pairs = tmp_path / "card.tsv"  # a word the vocabulary lacks is not covered, as card660 counts it
    pairs.write_text("k1\tv0\t0.5\nk2\tsunshine\t0.3\nk1\tk2\t0.9\nv0\tv1\t0.1\n")
    results = run_task(load_exported(recall_model), "card660", pairs)
    assert (results["coverage"], results["pairs"]) == (0.75, 4)


@pytest.mark.parametrize(
    ("model_args", "tasks", "message"),
    [
        ("path={missing}", "hellaswag", r"'.*nowhere' does not exist; pass an exported model's directory"),
        ("path={model}", "no_such_task", r"Tasks not found: no_such_task; list them with `mhf-lm-eval ls"),
        ("path={model}", None, r"no task given, or none found where --tasks points; pass --tasks NAME"),
        ("path={model},max_lenght=64", "hellaswag", r"unknown model argument\(s\) 'max_lenght' of model mhf"),
        ("pth={model}", "hellaswag", r"unknown model argument\(s\) 'pth' of model mhf; its --model_args"),
    ],
)
def test_mhf_lm_eval_reports_a_bad_model_task_or_argument_in_one_line(
    recall_model, tmp_path, model_args, tasks, message
):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    args = model_args.format(missing=tmp_path / "nowhere", model=recall_model)
    command = [str(Path(sys.executable).parent / "mhf-lm-eval"), "--model", "mhf", "--model_args", args]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command += ["--tasks", tasks] if tasks else []
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()  # lm-eval's INFO lines only with LMEVAL_LOG_LEVEL=INFO
    assert len(lines) == 1 and re.match(rf"error: {message}", lines[0]), lines


@pytest.mark.parametrize("exported", ["mhf", "qwen3"], indirect=True)
def test_a_nan_model_is_refused_by_every_scorer_and_by_the_sampler(exported):
    """What the harness, `mhf eval` and `mhf generate` score or decode with: a diverged model's nan
    would give acc 1 (greedy flags over nan) or a sampler's traceback."""
    from mhf_dist.errors import ModelOutputError
    from mhf_dist.eval.scoring import score_rows
    from mhf_dist.models.generation import Sampling

    model = copy.deepcopy(exported.model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    rows = np.array([[1, 5, 6, 7]])
    scorers = {
        "continuations": lambda: score_continuations(model, [([1, 5], [6, 7])], batch_size=1),
        "rows": lambda: score_rows(model, rows, np.ones((1, 3), dtype=bool), batch_size=1),
        "greedy": lambda: list(generate(model, [1, 5], 3)),
        "sampling": lambda: list(generate(model, [1, 5], 3, Sampling(temperature=0.8, seed=0))),
    }
    for name, score in scorers.items():
        with pytest.raises(ModelOutputError, match="hold nan or inf"):
            score()
            pytest.fail(f"{name} scored a nan model")


def test_mhf_lm_eval_reports_a_bad_flag_in_one_line_not_a_usage_block():
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra mhf-dist[eval]")
    command = [str(Path(sys.executable).parent / "mhf-lm-eval"), "--tasks", "hellaswag", "--bogus"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: mhf-lm-eval: unrecognized arguments: --bogus; see `mhf-lm-eval --help`"
    ]
