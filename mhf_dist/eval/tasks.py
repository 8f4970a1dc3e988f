"""`mhf eval` tasks on an exported model, every family through the `CausalLM` interface.

- `ppl`, `bpb`: exact NLL per token / bits per UTF-8 byte of a text set (`.txt`: documents separated by
  blank lines; `.jsonl`: field `text`), in windows of seq_len targets with no context carried across.
  `ppl` also scores the validation rows of a prepared directory (`mhf prepare` output) whose
  signatures and document format are the model's.
- `lambada`: jsonl `{"text"}`; the last word given the rest: accuracy (greedy decoding reproduces every
  token of the word) and the word's perplexity, exp(-mean log-likelihood per example).
- `hellaswag`: jsonl `{"ctx", "endings", "label"}`; accuracy of the ending with the highest summed
  log-likelihood, and `acc_norm` with it divided by the ending's UTF-8 length.
- `card660`: `word1<TAB>word2<TAB>score`; Pearson and Spearman between the scores and the cosine of word
  vectors (the word alone, hidden states of `layer`, mean over its tokens; underscores become spaces).
- `recall`: generated multi-query associative recall (`mhf_dist.data.recall`, no file): accuracy of the
  greedy prediction of each queried value.
Every task scores `batch_size` sequences a forward pass (`mhf_dist.eval.scoring`: right-padded, the
same answers as one at a time), exactly over the full vocabulary (V_actl for mhf).
`--data` (and `--model`) may be local or in a bucket (`s3://`, `gs://`).
Texts follow the model's document format: `bos` models read `<s>` before each document and context
(lambada, hellaswag, card660 words), `eos` models an EOS after each document.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhf_dist.config import RecallDataConfig
from mhf_dist.data.corpus import split_documents
from mhf_dist.data.recall import EVAL_SEED, make_recall
from mhf_dist.errors import MhfError
from mhf_dist.eval.perplexity import text_scores
from mhf_dist.eval.scoring import mean_layer_states, score_continuations, score_rows
from mhf_dist.export import ExportedModel
from mhf_dist.storage import Location

TASKS = ("ppl", "bpb", "lambada", "hellaswag", "card660", "recall")
RECALL_SEQ_LEN = 64  # `mhf eval --task recall`: rows of the generator's default settings and this length


class EvalDataError(MhfError):
    """An evaluation file is missing or malformed."""


def _lines(path: str | Path | Location) -> list[str]:
    where = Location.of(path)
    if not where.is_file():
        raise EvalDataError(f"evaluation file {str(where)!r} does not exist; pass --data with a file")
    return where.read_text().splitlines()


def read_jsonl(path: Location, fields: dict[str, type]) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalDataError(
                f"{path}:{number}: not valid JSON ({err.msg}); write one object per line"
            ) from None
        for name, kind in fields.items():
            if not isinstance(record, dict) or name not in record:
                raise EvalDataError(
                    f"{path}:{number}: missing field {name!r}; each line needs {', '.join(fields)}"
                )
            if not isinstance(record[name], kind):
                raise EvalDataError(f"{path}:{number}: field {name!r} must be a {kind.__name__}")
        records.append(record)
    return records


def read_texts(path: str | Path | Location) -> list[str]:
    if str(path).endswith(".jsonl"):
        return [record["text"] for record in read_jsonl(path, {"text": str})]
    return split_documents("\n".join(_lines(path)))


def eval_text(
    exported: ExportedModel, path: Location, limit: int, seq_len: int, batch_size: int
) -> dict[str, float]:
    if path.is_dir():
        return eval_prepared(exported, path, limit, batch_size)
    texts = read_texts(path)[: limit or None]
    scores = text_scores(
        exported.model, exported.tokenizer, texts, seq_len, batch_size, exported.document_format
    )
    return {"nll": scores["val_nll"], "ppl": scores["val_ppl"], "bits_per_byte": scores["bits_per_byte"],
            "tokens": scores["val_tokens"], "documents": len(texts)}  # fmt: skip


def eval_prepared(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    """`ppl` over the validation rows of a prepared directory (its rows as they are: seq_len + 1 ids)."""
    from mhf_dist.data.reader import RowReader
    from mhf_dist.data.shards import read_manifest
    from mhf_dist.data.tokenizer import check_document_format
    from mhf_dist.eval.perplexity import evaluate_rows

    manifest = read_manifest(path)
    fingerprint = manifest.signatures.fingerprint
    if fingerprint != exported.table.fingerprint:
        raise EvalDataError(
            f"shards {str(path)!r} have signature fingerprint {fingerprint[:12]} but model "
            f"{str(exported.path)!r} has {exported.table.fingerprint[:12]}; prepare the data with the "
            f"model's tokenizer.json and --set data.signatures={exported.path}"
        )
    check_document_format(
        manifest.document_format,
        exported.document_format,
        f"shards {str(path)!r}",
        f"model {str(exported.path)!r}",
        EvalDataError,
    )
    reader = RowReader(path, "validation", signatures=False)
    rows = reader.read_range(0, min(reader.num_rows, limit) if limit else None)["tokens"]
    scores = evaluate_rows(exported.model, rows, batch_size)
    return {"nll": scores["val_nll"], "ppl": scores["val_ppl"], "tokens": scores["val_tokens"],
            "rows": len(rows)}  # fmt: skip


def _framed_pair(exported: ExportedModel, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context ids (after the model's context prefix: BOS for `bos` models) and continuation ids."""
    context_ids, continuation_ids = exported.tokenizer.encode_pair(context, continuation)
    return exported.tokenizer.context_prefix(exported.document_format) + context_ids, continuation_ids


def eval_lambada(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    records = read_jsonl(path, {"text": str})[: limit or None]
    pairs = []
    for number, record in enumerate(records, start=1):
        context, _, word = record["text"].strip().rpartition(" ")
        if not context:
            raise EvalDataError(f"{path}: example {number} has no context before its last word")
        pairs.append(_framed_pair(exported, context, " " + word))
    scores = score_continuations(exported.model, pairs, batch_size)
    return {
        "acc": sum(greedy for _, greedy in scores) / len(records),
        "ppl": math.exp(-math.fsum(logprob for logprob, _ in scores) / len(records)),
        "examples": len(records),
    }


def eval_hellaswag(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    records = read_jsonl(path, {"ctx": str, "endings": list, "label": int})[: limit or None]
    for number, record in enumerate(records, start=1):
        endings, label = record["endings"], record["label"]
        if len(endings) < 2 or not 0 <= label < len(endings):
            raise EvalDataError(f"{path}: example {number} has label {label} for {len(endings)} endings")
    pairs = [_framed_pair(exported, r["ctx"], " " + e) for r in records for e in r["endings"]]
    logprobs = iter(score_continuations(exported.model, pairs, batch_size))
    correct = correct_norm = 0
    for record in records:
        endings, label = record["endings"], record["label"]
        scores = [next(logprobs)[0] for _ in endings]
        normed = [
            score / max(1, len((" " + e).encode("utf-8"))) for score, e in zip(scores, endings, strict=True)
        ]
        correct += max(range(len(scores)), key=scores.__getitem__) == label
        correct_norm += max(range(len(normed)), key=normed.__getitem__) == label
    return {"acc": correct / len(records), "acc_norm": correct_norm / len(records), "examples": len(records)}


def word_vectors(
    exported: ExportedModel, words: list[str], layer: int, batch_size: int
) -> dict[str, torch.Tensor]:
    """The vector of each word that has tokens: hidden states of `layer` over its tokens, read alone
    after the model's context prefix (BOS for `bos` models), averaged."""
    tokenized = exported.tokenizer.encode_batch([word.replace("_", " ") for word in words])
    ids = {word: word_ids for word, word_ids in zip(words, tokenized, strict=True) if word_ids}
    prefix = exported.tokenizer.context_prefix(exported.document_format)
    sequences = [prefix + word_ids for word_ids in ids.values()]
    vectors = mean_layer_states(exported.model, sequences, layer, batch_size, skip=len(prefix))
    return dict(zip(ids, vectors, strict=True))


def eval_card660(
    exported: ExportedModel, path: Location, limit: int, layer: int, batch_size: int
) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr

    pairs = []
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        columns = line.split("\t")
        try:
            pairs.append((columns[0], columns[1], float(columns[2])))
        except (IndexError, ValueError):
            raise EvalDataError(f"{path}:{number}: expected word1<TAB>word2<TAB>score") from None
    pairs = pairs[: limit or None]
    words = sorted({word for first, second, _ in pairs for word in (first, second)})
    vectors = word_vectors(exported, words, layer, batch_size)
    cosines, gold = [], []
    for first, second, score in pairs:
        if first in vectors and second in vectors:
            cosine = torch.nn.functional.cosine_similarity(vectors[first], vectors[second], dim=0)
            cosines.append(float(cosine))
            gold.append(score)
    if len(gold) < 2:
        raise EvalDataError(f"{path}: fewer than two scorable pairs; check the file")
    return {
        "pearson": float(pearsonr(cosines, gold).statistic),
        "spearman": float(spearmanr(cosines, gold).statistic),
        "coverage": len(gold) / len(pairs),
        "pairs": len(pairs),
    }


def eval_recall(
    exported: ExportedModel,
    limit: int,
    settings: RecallDataConfig,
    seq_len: int,
    batch_size: int,
    seed: int = EVAL_SEED,
) -> dict[str, float]:
    data = make_recall(
        limit or 32, settings.num_pairs, settings.num_queries, seq_len, exported.config.vocab_size, seed
    )
    _, greedy = score_rows(exported.model, data.rows, data.query_mask, batch_size)
    return {"acc": float(np.mean(greedy)), "queries": len(greedy), "examples": len(data.rows)}


def run_task(
    exported: ExportedModel,
    task: str,
    data: str | Path | Location | None,
    limit: int = 0,
    seq_len: int = 128,
    layer: int = -2,
    recall: tuple[RecallDataConfig, int] = (RecallDataConfig(), RECALL_SEQ_LEN),
    batch_size: int = 16,
) -> dict[str, float]:
    """`data`: the task's file (ppl: or a prepared directory), local or in a bucket. `recall`: the
    generator settings and row length (a model trained on `data.corpus: recall` is scored on rows like
    its training rows, from another seed). `batch_size`: sequences per forward pass; the results do
    not depend on it beyond float rounding."""
    data = Location.of(data) if data is not None else None
    runners: dict[str, Callable[[], dict[str, float]]] = {
        "ppl": lambda: eval_text(exported, data, limit, seq_len, batch_size),
        "bpb": lambda: eval_text(exported, data, limit, seq_len, batch_size),
        "lambada": lambda: eval_lambada(exported, data, limit, batch_size),
        "hellaswag": lambda: eval_hellaswag(exported, data, limit, batch_size),
        "card660": lambda: eval_card660(exported, data, limit, layer, batch_size),
        "recall": lambda: eval_recall(exported, limit, *recall, batch_size),
    }
    if task not in runners:
        raise EvalDataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if data is None and task != "recall":
        raise EvalDataError(f"task {task!r} reads a file; pass --data")
    if data is not None and data.is_dir() and task != "ppl":
        raise EvalDataError(
            f"--data {str(data)!r} is a directory; task {task!r} reads a file (ppl alone scores prepared "
            "shards)"
        )
    exported.model.eval()
    return runners[task]()
