"""`mhf eval` tasks on an exported model, every family through the `CausalLM` interface.

- `ppl`, `bpb`: exact NLL per token / bits per UTF-8 byte of a text set (`read_texts`), in windows of
  seq_len targets; `ppl` also scores the validation rows of a prepared directory of the model's.
- `lambada`: jsonl `{"text"}`; the last word given the rest: greedy accuracy and perplexity.
- `hellaswag`: jsonl `{"ctx", "endings", "label"}`; accuracy of the most likely ending, and `acc_norm`
  with the log-likelihood divided by the ending's UTF-8 length.
- `card660`: `word1<TAB>word2<TAB>score`; Pearson and Spearman between the scores and word vectors'
  cosines (`word_vectors`; underscores become spaces).
- `recall`: generated associative recall (`mhf_dist.data.recall`): greedy accuracy of each queried value.
Every task scores exactly over the full vocabulary (V_actl for mhf), in the model's document format;
`--data` (and `--model`) may be local or in a bucket (`s3://`, `gs://`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from mhf_dist.config import RecallDataConfig
from mhf_dist.data.corpus import file_kind, split_documents
from mhf_dist.data.recall import EVAL_SEED, make_recall
from mhf_dist.data.tokenizer import check_document_format
from mhf_dist.errors import DataError, MhfError
from mhf_dist.eval import LAYER, TASKS, WINDOW, WINDOWED
from mhf_dist.eval.perplexity import evaluate_rows, perplexity, text_scores
from mhf_dist.eval.scoring import mean_layer_states, score_continuations, score_rows
from mhf_dist.export import ExportedModel
from mhf_dist.readers import read_jsonl, read_jsonl_located, read_text
from mhf_dist.signatures import check_same_table
from mhf_dist.storage import Location

if TYPE_CHECKING:
    from mhf_dist.data.shards import Manifest

JSONL_FIX = "write UTF-8 JSON, one object per line"
TEXT_FORM = 'text (documents separated by blank lines), or .jsonl {"text": ...} lines'
CARD660_FORM = "word1<TAB>word2<TAB>score"
RECALL_SEQ_LEN = 64  # `mhf eval --task recall`: rows of the generator's default settings and this length
T = TypeVar("T")


class EvalDataError(MhfError):
    """An evaluation file is missing or malformed."""


def _existing(path: str | Path | Location) -> Location:
    where = Location.of(path)
    if not where.is_file():
        raise EvalDataError(f"evaluation file {str(where)!r} does not exist; pass --data with a file")
    return where


def _lines(path: str | Path | Location) -> list[str]:
    return read_text(_existing(path), EvalDataError, "save it as UTF-8 text").splitlines()


def _numbered_records(path: Location, fields: dict[str, type]) -> list[tuple[str, dict[str, Any]]]:
    """The file's JSON lines holding `fields` of their types, as (`file:line`, record) pairs."""
    return read_jsonl_located(_existing(path), EvalDataError, JSONL_FIX, fields)


def read_texts(path: str | Path | Location) -> list[str]:
    """The documents of a text file (separated by blank lines) or a JSON-lines one (`text` fields), told
    apart and split as `mhf prepare` does (`.json`/`.jsonl` in any case; another name is text); an empty
    text is no document, as prepare leaves it out."""
    where = Location.of(path)
    kind = file_kind(where.name) or ("text", None)
    if kind[0] not in ("text", "json") or kind[1] is not None:
        raise EvalDataError(
            f"{where} is {kind[0]}{', compressed' if kind[1] else ''}; ppl and bpb read an uncompressed "
            f"{TEXT_FORM} file: convert it"
        )
    if kind[0] == "json":
        records = read_jsonl(_existing(path), EvalDataError, JSONL_FIX, {"text": str})
        return [record["text"] for record in records if record["text"]]
    return split_documents(read_text(_existing(path), EvalDataError, "save it as UTF-8 text"))


def _examples(path: Location, examples: list[T], limit: int, form: str) -> list[T]:
    """The first `limit` examples (0: all); a file with none is an error saying what one looks like."""
    if not examples:
        raise EvalDataError(f"{path} has no examples; give it {form}")
    return examples[: limit or None]


def check_positions(exported: ExportedModel, length: int, what: str, fix: str) -> None:
    """Refuse more positions than max_position_embeddings: the model was never trained past them."""
    most = exported.config.backbone.max_position_embeddings
    if length > most:
        raise EvalDataError(f"{what} {length}, above the model's max_position_embeddings {most}; {fix}")


def read_examples(task: str, path: Location, limit: int = 0) -> list[Any]:
    """The first `limit` examples (0: all) of a task's file, each checked as the task reads it (no model
    needed: `mhf sweep` reads them before it trains)."""
    if task in WINDOWED:
        return _examples(path, read_texts(path), limit, TEXT_FORM)
    if task == "card660":
        lines = enumerate(_lines(path), start=1)
        pairs = [_card660_pair(f"{path}:{number}", line) for number, line in lines if line.strip()]
        return _examples(path, pairs, limit, f"{CARD660_FORM} lines")
    if task == "lambada":
        records = _examples(path, _numbered_records(path, {"text": str}), limit, '{"text": ...} lines')
        for at, record in records:
            if not record["text"].strip().rpartition(" ")[0]:
                raise EvalDataError(
                    f"{at}: no context before the last word; give each text a context before the word to "
                    "predict"
                )
        return records
    fields = {"ctx": str, "endings": list, "label": int}  # hellaswag
    records = _examples(path, _numbered_records(path, fields), limit, '{"ctx", "endings", "label"} lines')
    for at, record in records:
        _check_hellaswag(at, record)
    return records


def eval_text(
    exported: ExportedModel, path: Location, limit: int, seq_len: int, batch_size: int
) -> dict[str, float]:
    if path.is_dir():
        return eval_prepared(exported, path, limit, batch_size)
    check_positions(exported, seq_len, "--seq-len is", "pass a smaller --seq-len")
    texts = read_examples("ppl", path, limit)
    scores = text_scores(
        exported.model, exported.tokenizer, texts, seq_len, batch_size, exported.document_format
    )
    return {"nll": scores["val_nll"], "ppl": scores["val_ppl"], "bits_per_byte": scores["bits_per_byte"],
            "tokens": scores["val_tokens"], "documents": len(texts),
            **({"short_window": scores["window"]} if "window" in scores else {}),
            **({"last_window": scores["last_window"]} if "last_window" in scores else {})}  # fmt: skip


def eval_prepared(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    """`ppl` over the validation rows of a prepared directory (its rows as they are: seq_len + 1 ids)."""
    from mhf_dist.data.reader import RowReader
    from mhf_dist.data.shards import read_manifest

    manifest = read_manifest(path)
    fix = f"prepare the data with the model's tokenizer.json and --set data.signatures={exported.path}"
    model, positions = f"model {str(exported.path)!r}", exported.config.backbone.max_position_embeddings
    check_scored_shards(
        model, exported.table.fingerprint, exported.document_format, positions, path, manifest, fix
    )
    reader = RowReader(path, "validation", signatures=False)
    rows = reader.read_range(0, min(reader.num_rows, limit) if limit else None)["tokens"]
    scores = evaluate_rows(exported.model, rows, batch_size)
    return {"nll": scores["val_nll"], "ppl": scores["val_ppl"], "tokens": scores["val_tokens"],
            "rows": len(rows)}  # fmt: skip


def check_scored_shards(
    model: str,
    fingerprint: str,
    document_format: str,
    positions: int,
    path: Location,
    manifest: Manifest,
    fix: str,
    error: type[MhfError] = EvalDataError,
) -> None:
    """What `ppl` on prepared shards needs of the model (`model`, in words) that scores them: its signature
    table, document format and positions, and validation rows (`mhf eval`; a sweep before trials train)."""
    from mhf_dist.data.shards import split_shards

    shards = f"shards {str(path)!r}"
    check_same_table(model, fingerprint, path, manifest.signatures.fingerprint, fix, error)
    check_document_format(manifest.document_format, document_format, shards, model, error)
    if manifest.seq_len > positions:
        raise error(
            f"{shards} have rows of seq_len {manifest.seq_len}, above the model's max_position_embeddings "
            f"{positions}; prepare them with a smaller one"
        )
    try:
        split_shards(path, manifest, "validation")
    except DataError as err:
        raise error(str(err)) from None


def _framed_pair(
    exported: ExportedModel, at: str, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """Context ids (after the model's context prefix) and continuation ids of the example at `at`."""
    context_ids, continuation_ids = exported.tokenizer.encode_pair(context, continuation)
    framed = exported.tokenizer.context_prefix(exported.document_format) + context_ids
    inputs = len(framed) + len(continuation_ids) - 1  # the last id is only predicted
    check_positions(exported, inputs, f"{at}: the example reads a sequence of length", "shorten it")
    return framed, continuation_ids


def eval_lambada(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    records = read_examples("lambada", path, limit)
    pairs = []
    for at, record in records:
        context, _, word = record["text"].strip().rpartition(" ")
        pairs.append(_framed_pair(exported, at, context, " " + word))
    scores = score_continuations(exported.model, pairs, batch_size)
    return {
        "acc": sum(greedy for _, greedy in scores) / len(records),
        "ppl": perplexity(-math.fsum(logprob for logprob, _ in scores) / len(records)),
        "examples": len(records),
    }


def _check_hellaswag(at: str, record: dict[str, Any]) -> None:
    endings, label = record["endings"], record["label"]
    if not record["ctx"].strip():
        raise EvalDataError(f"{at}: field 'ctx' is empty; give each example the context its endings follow")
    if len(endings) < 2 or not 0 <= label < len(endings):
        raise EvalDataError(
            f"{at}: label {label} for {len(endings)} endings; give two endings or more and a label that "
            "indexes one (0 first)"
        )
    for number, ending in enumerate(endings, start=1):
        if not isinstance(ending, str):
            raise EvalDataError(
                f"{at}: field 'endings' must be a list of strings, but ending {number} is "
                f"{json.dumps(ending)}"
            )
        if not ending.strip():
            raise EvalDataError(f"{at}: ending {number} is empty; give every ending its text")


def eval_hellaswag(exported: ExportedModel, path: Location, limit: int, batch_size: int) -> dict[str, float]:
    """Accuracy of the ending with the highest summed (and per-byte) log-likelihood."""
    records = read_examples("hellaswag", path, limit)
    pairs, indistinct = [], []
    for at, record in records:
        framed = [_framed_pair(exported, at, record["ctx"], " " + ending) for ending in record["endings"]]
        # A gold ending of the same tokens as another counts wrong (lm-eval's argmax would count it by
        # its place in the list); their number is reported.
        gold = framed[record["label"]][1]
        indistinct.append(any(ids == gold for i, (_, ids) in enumerate(framed) if i != record["label"]))
        pairs += framed
    logprobs = iter(score_continuations(exported.model, pairs, batch_size))
    correct = correct_norm = 0
    for (_, record), tied in zip(records, indistinct, strict=True):
        endings, label = record["endings"], record["label"]
        scores = [next(logprobs)[0] for _ in endings]
        normed = [score / len((" " + e).encode("utf-8")) for score, e in zip(scores, endings, strict=True)]
        correct += not tied and max(range(len(scores)), key=scores.__getitem__) == label
        correct_norm += not tied and max(range(len(normed)), key=normed.__getitem__) == label
    return {
        "acc": correct / len(records),
        "acc_norm": correct_norm / len(records),
        "examples": len(records),
        "indistinct": sum(indistinct),
    }


def word_vectors(
    exported: ExportedModel, words: list[str], layer: int, batch_size: int
) -> dict[str, torch.Tensor]:
    """The vector of each word that has tokens: `layer`'s hidden states over its tokens, read alone
    after the model's context prefix, averaged (a word a word-level vocabulary lacks is left out)."""
    texts = {word: word.replace("_", " ") for word in words}
    words = [word for word in words if not exported.tokenizer.outside_vocabulary(texts[word])]
    tokenized = exported.tokenizer.encode_batch([texts[word] for word in words])
    ids = {word: word_ids for word, word_ids in zip(words, tokenized, strict=True) if word_ids}
    prefix = exported.tokenizer.context_prefix(exported.document_format)
    sequences = [prefix + word_ids for word_ids in ids.values()]
    if sequences:
        longest = max(ids, key=lambda word: len(ids[word]))
        what = f"the word {longest!r} reads a sequence of length"
        check_positions(exported, len(prefix) + len(ids[longest]), what, "leave it out")
    vectors = mean_layer_states(exported.model, sequences, layer, batch_size, skip=len(prefix))
    return dict(zip(ids, vectors, strict=True))


def eval_card660(
    exported: ExportedModel, path: Location, limit: int, layer: int, batch_size: int
) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr

    pairs = read_examples("card660", path, limit)
    words = sorted({word for first, second, _ in pairs for word in (first, second)})
    vectors = word_vectors(exported, words, layer, batch_size)
    scorable = [(first, second, score) for first, second, score in pairs if {first, second} <= vectors.keys()]
    cosine = torch.nn.functional.cosine_similarity
    cosines = [float(cosine(vectors[first], vectors[second], dim=0)) for first, second, _ in scorable]
    gold = [score for _, _, score in scorable]
    if len(gold) < 2:
        raise EvalDataError(f"{path}: fewer than two scorable pairs; check the file")
    _check_correlatable(path, cosines, gold)
    return {
        "pearson": float(pearsonr(cosines, gold).statistic),
        "spearman": float(spearmanr(cosines, gold).statistic),
        "coverage": len(gold) / len(pairs),
        "pairs": len(pairs),
    }


def _card660_pair(at: str, line: str) -> tuple[str, str, float]:
    columns = line.split("\t")
    if len(columns) != 3:
        raise EvalDataError(f"{at}: expected {CARD660_FORM}, not {len(columns)} tab-separated columns")
    first, second, score = columns
    if not first.strip() or not second.strip():
        raise EvalDataError(f"{at}: a word is empty; expected {CARD660_FORM}")
    try:
        value = float(score.replace("_", "x"))  # Python's `1_0` (10) is not a number a data file writes
    except ValueError:
        raise EvalDataError(
            f"{at}: score {score.strip()!r} is not a number; expected {CARD660_FORM}"
        ) from None
    if not math.isfinite(value):
        raise EvalDataError(f"{at}: score {score.strip()!r} is not a finite number")
    return first, second, value


def _check_correlatable(path: Location, cosines: list[float], gold: list[float]) -> None:
    """Refuse what makes Pearson and Spearman nan: a constant side, or a nan cosine (a diverged model)."""
    if not all(math.isfinite(cosine) for cosine in cosines):
        raise EvalDataError(
            f"the model's word-vector cosines on {path} hold nan or inf (a diverged or damaged model); "
            "evaluate a model whose training loss stayed finite"
        )
    if len(set(cosines)) == 1:
        raise EvalDataError(
            f"the model gives all {len(cosines)} scorable pairs of {path} the same cosine "
            f"({cosines[0]:.4g}), so no correlation is defined; try another --layer"
        )
    if len(set(gold)) == 1:
        raise EvalDataError(
            f"all {len(gold)} scorable pairs of {path} have the score {gold[0]:g}, so no correlation is "
            "defined; give pairs of varied scores"
        )


def eval_recall(
    exported: ExportedModel, limit: int, settings: RecallDataConfig, seq_len: int, batch_size: int
) -> dict[str, float]:
    check_positions(
        exported, seq_len, "recall rows have a seq_len of", "recall needs a model of that many positions"
    )
    data = make_recall(
        limit or 32, settings.num_pairs, settings.num_queries, seq_len, exported.config.vocab_size, EVAL_SEED
    )
    _, greedy = score_rows(exported.model, data.rows, data.query_mask, batch_size)
    return {"acc": float(np.mean(greedy)), "queries": len(greedy), "examples": len(data.rows)}


def check_task_data(task: str, given: bool, option: str = "--data") -> None:
    """Every task but recall reads a file (named by `option`); recall generates its own examples."""
    if not given and task != "recall":
        raise EvalDataError(f"task {task!r} reads a file; pass {option}")
    if given and task == "recall":
        raise EvalDataError(f"task 'recall' generates its own examples and reads no file; drop {option}")


def check_file_or_shards(task: str, data: Location, option: str = "--data") -> None:
    """ppl alone reads a directory (prepared shards); every other task reads a file."""
    if task != "ppl" and data.is_dir():
        raise EvalDataError(
            f"{option} {str(data)!r} is a directory; task {task!r} reads a file (ppl alone scores prepared "
            "shards)"
        )


def run_task(
    exported: ExportedModel,
    task: str,
    data: str | Path | Location | None,
    limit: int = 0,
    seq_len: int = WINDOW,
    layer: int = LAYER,
    recall: tuple[RecallDataConfig, int] = (RecallDataConfig(), RECALL_SEQ_LEN),
    batch_size: int = 16,
) -> dict[str, float]:
    """Run `task` on `data` (its file, or for ppl a prepared directory; local or in a bucket). `recall`:
    the generator settings and row length (a model trained on `data.corpus: recall` is scored
    on rows like its training rows, from another seed). `batch_size` changes only float rounding."""
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
    check_task_data(task, data is not None)
    if task == "card660":
        states = exported.config.backbone.num_layers + 1  # the input embeddings and each layer's output
        if not -states <= layer < states:
            raise EvalDataError(
                f"--layer {layer}: the model has {states} hidden states (layers {-states}..{states - 1}); "
                "pick one of them"
            )
    if data is not None:
        check_file_or_shards(task, data)
    exported.model.eval()
    results = runners[task]()
    broken = [f"{name}={value}" for name, value in results.items() if not math.isfinite(value)]
    if broken:
        raise EvalDataError(
            f"task {task!r} gives {', '.join(broken)}: the model's scores are nan or overflow (a diverged or "
            "damaged model, or text it gives almost no probability); evaluate a model whose training loss "
            "stayed finite"
        )
    return results
