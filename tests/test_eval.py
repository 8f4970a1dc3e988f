"""`mhf eval` tasks and `mhf generate` on small exported models, checked against independent computations."""

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from mhf_dist.cli import main
from mhf_dist.config import RecallDataConfig, load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.recall import EVAL_SEED, make_recall
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.eval.tasks import RECALL_SEQ_LEN, EvalDataError, continuation_logprob, run_task, word_vector
from mhf_dist.export import export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.models.generation import generate
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


def test_ppl_and_bpb_equal_the_models_own_nll_computed_per_window(exported, tmp_path):
    texts = ["The for statement iterates over items.", "A class defines new objects and their methods."]
    path = tmp_path / "texts.txt"
    path.write_text("\n\n".join(texts))
    results = run_task(exported, "ppl", path, seq_len=8)
    tokenizer = exported.tokenizer
    stream = [t for ids in tokenizer.encode_batch(texts) for t in (*ids, tokenizer.eos_id)]
    windows = [stream[start : start + 9] for start in range(0, len(stream) - 8, 8)]
    nll = -torch.cat([sequence_logprob(exported.model, window) for window in windows])
    assert results["tokens"] == nll.numel() == 8 * len(windows)
    assert results["ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    scored_bytes = sum(len(text.encode()) + 1 for text in texts) * nll.numel() / (len(stream) - 1)
    assert results["bits_per_byte"] == pytest.approx(float(nll.sum()) / math.log(2) / scored_bytes, rel=1e-5)


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
                word_vector(exported, a, -2), word_vector(exported, b, -2), dim=0
            )
        )
        for a, b, _ in pairs
    ]
    assert results["spearman"] == pytest.approx(spearmanr(cosines, [s for *_, s in pairs]).statistic)
    assert results["coverage"] == 1.0


@pytest.mark.parametrize(
    ("task", "content", "message"),
    [
        ("lambada", '{"txt": "a b"}\n', r"l.data:1: missing field 'text'"),
        ("hellaswag", '{"ctx": "a", "endings": ["b", "c"], "label": 2}\n', "has label 2 for 2 endings"),
        ("card660", "one\ttwo\n", r"l.data:1: expected word1<TAB>word2<TAB>score"),
        ("lambada", "not json\n", r"l.data:1: not valid JSON"),
    ],
)
def test_malformed_files_are_one_line_errors_naming_file_and_line(exported, tmp_path, task, content, message):
    path = tmp_path / "l.data"
    path.write_text(content)
    with pytest.raises(EvalDataError, match=message):
        run_task(exported, task, path)


def test_mhf_generate_streams_reproducible_samples(exported, capsys):
    args = ["generate", "--model", str(exported.path), "--prompt", "The", "--max-new-tokens", "8"]
    sampled = [*args, "--temperature", "1.0", "--top-k", "20", "--seed", "7"]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == first and first.startswith("The")
    assert main([*args, "--top-p", "1.5"]) == 2
    assert "top_p=1.5" in capsys.readouterr().err


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
    ours = [continuation_logprob(exported.model, ctx, encode([" " + e])[0])[0] for e in records[0]["endings"]]
    assert harness_scores == pytest.approx(ours, abs=1e-6)


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

    def next_token_logprobs(self, tokens, cache):
        row = tokens[0].tolist()
        key = row[-1]
        answer = row[row.index(key) + 1] if self.knows(key) else key
        logits = torch.zeros(1, self.vocab_size)
        logits[0, answer] = 20.0
        return logits.log_softmax(-1), cache


def test_recall_accuracy_is_the_share_of_queries_whose_value_scores_highest():
    vocab_size, defaults = 300, RecallDataConfig()
    data = make_recall(4, defaults.num_pairs, defaults.num_queries, RECALL_SEQ_LEN, vocab_size, EVAL_SEED)
    queried = np.concatenate([row[:-1][mask] for row, mask in zip(data.rows, data.query_mask, strict=True)])
    even = float(np.mean(queried % 2 == 0))  # the share of queries an oracle of even keys answers
    assert 0 < even < 1

    def scored_by(knows):
        exported = SimpleNamespace(
            model=RecallOracle(vocab_size, knows), config=SimpleNamespace(vocab_size=vocab_size)
        )
        return run_task(exported, "recall", None, limit=4)

    assert scored_by(lambda key: True) == {"acc": 1.0, "queries": 16, "examples": 4}
    assert scored_by(lambda key: key % 2 == 0)["acc"] == pytest.approx(even)
    assert scored_by(lambda key: False)["acc"] == 0.0


def test_text_files_split_into_documents_like_mhf_prepare(tmp_path):
    from mhf_dist.eval.tasks import read_texts

    path = tmp_path / "wiki.raw"
    path.write_text(
        " = Heading = \n \n First paragraph .\r\n\t\nSecond one .\n"
    )  # WikiText's " " blank lines
    assert read_texts(path) == ["= Heading =", "First paragraph .", "Second one ."]
