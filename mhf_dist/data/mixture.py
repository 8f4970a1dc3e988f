"""Training text from several sources, each a share of the training tokens.

Three settings name the sources (`sources`):
- `data.corpus`: one source, used whole.
- `data.sources: [{name, corpus | dataset, weight}]`: the weights (normalised to sum 1) are shares of the
  training tokens. Each source's training documents are taken in the order of a stable content key,
  MurmurHash3(text, data.mixture_seed), until its share is reached. Nothing is repeated: the source
  that runs out first is used whole and sets the total, so a heavy weight on a small source shrinks the
  whole mixture rather than replaying that source. Validation: every source's held-out documents.
- `data.replay` (`mhf cpt --replay`): data.corpus whole plus a replayed share `fraction` of the training
  tokens from replay.corpus, keyed by data.replay.seed. Its held-out documents are never used (they may
  be the parent's own held-out text), so the validation split stays data.corpus alone.

A keyed source's training document is in iff its key is below the source's threshold, which the driver
computes from every candidate's key and token count (`choose_threshold`): membership depends only on
the text, the seed and the counts, never on how the work was cut into tasks, so the shards are the
same on any cluster. In the token stream the sources follow one another in their order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mmh3
import numpy as np
from pydantic import ValidationError

from mhf_dist.config import DATASET_PREFIX, DataConfig
from mhf_dist.errors import DataError, problem_line
from mhf_dist.storage import redact, redact_values

NONE_SELECTED = 0  # a threshold that takes no document
GIVEN_IN_PYTHON = "given in Python"  # a Dataset source handed to prepare(datasets=...)
ALL_SELECTED = 2**32  # above every 32-bit key


@dataclass(frozen=True)
class DatasetSpec:
    """A Dataset source's "package.module:function" called with `args`, or (`callable` None) one `given`."""

    callable: str | None
    args: dict[str, Any] = field(default_factory=dict)
    given: Any = None


@dataclass(frozen=True)
class Source:
    """One source of training text. `keyed`: its training documents are chosen by key; `validation`: its
    held-out documents are used; `dataset`: a Dataset source (then `corpus` only describes it)."""

    name: str
    corpus: str
    text_field: str
    weight: float  # its share of the training tokens; the sources' weights sum to 1
    seed: int = 0
    keyed: bool = False
    validation: bool = True
    dataset: DatasetSpec | None = None


@dataclass(frozen=True)
class Candidates:
    """A keyed source's training documents: key and token count of each (any order)."""

    keys: np.ndarray
    tokens: np.ndarray


def with_datasets(data: DataConfig, datasets: Mapping[str, Any]) -> DataConfig:
    """With no `data.sources`, the one Dataset given in Python is the corpus (a source of its name)."""
    if not datasets or data.sources:
        return data
    if len(datasets) > 1 or data.corpus != DataConfig.model_fields["corpus"].default:
        raise DataError(
            f"datasets {', '.join(map(repr, datasets))} and data.corpus={data.corpus!r} cannot be "
            "weighed together; list every source with its weight in data.sources"
        )
    (name,) = datasets
    try:
        return DataConfig.model_validate({**data.model_dump(), "sources": [{"name": name, "weight": 1.0}]})
    except ValidationError as err:
        raise DataError(f"datasets {name!r}: data.{problem_line(err)}") from None


def sources(data: DataConfig, datasets: Mapping[str, Any] | None = None) -> list[Source]:
    """The sources `data` names, in stream order, with Datasets given in Python by source name."""
    datasets = dict(datasets or {})
    unknown = sorted(set(datasets) - {source.name for source in data.sources})
    if unknown:
        raise DataError(
            f"datasets {', '.join(map(repr, unknown))} are no source of data.sources; add an entry "
            "{name, weight} for each"
        )
    if data.sources:
        total = sum(source.weight for source in data.sources)
        keyed = len(data.sources) > 1
        mixed = []
        for source in data.sources:
            described, spec = _origin(source.name, source.corpus, source.dataset, source.args, datasets)
            text_field = source.text_field or data.text_field
            seed = data.mixture_seed if keyed else 0
            mixed.append(
                Source(source.name, described, text_field, source.weight / total, seed, keyed, dataset=spec)
            )
        return mixed
    described, spec = _origin("corpus", data.corpus, None, {}, {})
    if not replays(data):
        return [Source("corpus", described, data.text_field, 1.0, dataset=spec)]
    replay = data.replay
    replayed, replay_spec = _origin("replay", replay.corpus, None, {}, {})
    return [
        Source("corpus", described, data.text_field, 1 - replay.fraction, dataset=spec),
        Source(
            "replay",
            replayed,
            data.text_field,
            replay.fraction,
            replay.seed,
            keyed=True,
            validation=False,  # its held-out documents are never used
            dataset=replay_spec,
        ),
    ]


def _origin(
    name: str, corpus: str | None, dataset: str | None, args: dict[str, Any], given: dict[str, Any]
) -> tuple[str, DatasetSpec | None]:
    """(how the source is described, its Dataset if it is one) of a source named `corpus` (which may
    be `dataset:package.module:function`), `dataset` and `args`, or given in Python."""
    if name in given:
        if corpus is not None or dataset is not None:
            raise DataError(
                f"source {name!r} is given in Python and names {corpus or dataset!r} too; drop one of them"
            )
        return f"{DATASET_PREFIX}{name} ({GIVEN_IN_PYTHON})", DatasetSpec(None, given=given[name])
    if corpus is not None and corpus.startswith(DATASET_PREFIX):
        dataset = corpus.removeprefix(DATASET_PREFIX)
    if dataset is not None:
        return f"{DATASET_PREFIX}{dataset}", DatasetSpec(dataset, dict(args))
    if corpus is None:
        raise DataError(
            f"source {name!r} names no corpus or dataset; give it one (or its Dataset in "
            "prepare(datasets=...))"
        )
    return corpus, None


def replays(data: DataConfig) -> bool:
    return data.replay.corpus is not None and data.replay.fraction > 0


def content_key(text: str, seed: int) -> int:
    return mmh3.hash(text.encode(), seed, signed=False)


def choose_threshold(keys: np.ndarray, tokens: np.ndarray, target: float) -> int:
    """The key threshold whose documents' tokens come closest to `target` (whole documents, key order)."""
    if target <= 0 or len(keys) == 0:
        return NONE_SELECTED
    order = np.argsort(keys, kind="stable")
    sorted_keys, cumulative = keys[order], np.cumsum(tokens[order])
    # Documents with equal keys (duplicates) go in together: only the last of a run of keys can end it.
    ends = np.flatnonzero(np.append(sorted_keys[1:] != sorted_keys[:-1], True))
    taken = np.concatenate([[0], cumulative[ends]])
    best = int(np.argmin(np.abs(taken - target)))
    return NONE_SELECTED if best == 0 else int(sorted_keys[ends[best - 1]]) + 1


def thresholds(
    mixed: list[Source], whole_tokens: list[int], candidates: list[Candidates | None]
) -> list[int | None]:
    """Each keyed source's key threshold (None for a source used whole). The total is set by a source
    used whole, else by the keyed source that runs out first; each keyed target is its weight of it."""
    available = [
        int(pool.tokens.sum()) if pool is not None else tokens
        for pool, tokens in zip(candidates, whole_tokens, strict=True)
    ]
    whole = [index for index, source in enumerate(mixed) if not source.keyed]
    ratios = {index: available[index] / mixed[index].weight for index in whole or range(len(mixed))}
    limiting = min(ratios, key=ratios.__getitem__)
    chosen: list[int | None] = []
    for index, (source, pool) in enumerate(zip(mixed, candidates, strict=True)):
        target = source.weight * ratios[limiting]
        if pool is None:
            chosen.append(None)
        elif index == limiting or available[index] <= target:
            chosen.append(ALL_SELECTED)
        else:
            chosen.append(choose_threshold(pool.keys, pool.tokens, target))
    return chosen


def source_records(
    mixed: list[Source], taken: list[dict[str, int]], staged: list[int | None], skipped: list[Any]
) -> list[dict[str, Any]]:
    """The manifest's `sources`: what each source gave (`taken`), what a Dataset source was staged from
    and how many documents (`staged`), and the records left out (`skipped`)."""
    total = sum(counts["tokens"] for counts in taken)
    records = []
    for source, counts, documents, left_out in zip(mixed, taken, staged, skipped, strict=True):
        record = {
            "name": source.name,
            "corpus": redact(source.corpus),
            "weight": source.weight,
            "documents": counts["documents"],
            "tokens": counts["tokens"],
            "share": counts["tokens"] / total if total else 0.0,
            "validation_documents": counts["validation_documents"],
            "validation_tokens": counts["validation_tokens"],
            "missing_text": left_out.missing,
            "empty": left_out.empty,
        }
        if source.dataset is not None:
            record["staged"] = {
                "dataset": source.dataset.callable or GIVEN_IN_PYTHON,
                "args": redact_values(source.dataset.args),
                "documents": documents,
            }
        records.append(record)
    return records


def describe(mixed: list[Source], records: list[dict[str, Any]], limits: list[int | None]) -> str:
    """One log line: each source's realised share against its weight, and which source ran out first."""
    parts = [
        f"{record['name']} {record['share']:.2%} (asked {record['weight']:.2%}; {record['tokens']:,} tokens, "
        f"{record['documents']:,} documents)"
        for record in records
    ]
    ran_out = [source.name for source, limit in zip(mixed, limits, strict=True) if limit == ALL_SELECTED]
    whole = f"{', '.join(ran_out)} ran out first and is used whole" if ran_out else "none ran out"
    return (
        f"mixture of the training tokens (seed {mixed[0].seed}; no upsampling: {whole}): {', '.join(parts)}"
    )
