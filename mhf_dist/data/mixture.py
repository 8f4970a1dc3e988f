"""Training text from several sources, each a share of the training tokens.

Three settings name the sources (`sources`):
- `data.corpus`: one source, used whole.
- `data.sources: [{name, corpus, weight}]`: the weights (normalised to sum 1) are shares of the
  training tokens. Each source's training documents are taken in the order of a stable content key,
  MurmurHash3(text, data.mixture_seed), until its share is reached. Nothing is repeated (no
  upsampling): the source that runs out first is used whole and sets the total, so a heavy weight on a
  small source shrinks the whole mixture rather than replaying that source. Validation: every source's
  held-out documents (`shards.is_validation`), all of them.
- `data.replay` (`mhf cpt --replay`): data.corpus whole (train and validation, as always) plus a
  replayed share `fraction` of the training tokens from replay.corpus, keyed by data.replay.seed. The
  replayed corpus adds training documents only: those the split rule holds out are never used (they may
  be the parent's own held-out text), so the validation split stays data.corpus alone. A replay corpus
  with too little text is used whole (a warning says so).

A keyed source's training document is in iff its key is below the source's threshold, which the driver
computes from every candidate's key and token count (`choose_threshold`: whole documents in key order,
the cut closest to the target). Tokens are those of the documents with their boundary tokens, before
packing. Membership depends only on the text, the seed and the counts, never on how the work was cut
into tasks, so the shards are the same on any cluster. In the token stream the sources follow one
another in their order, each in corpus order; the reader's shuffle (`data.shuffle`) mixes the rows, and
each row's `source_tokens` (shards.py) says how many of its tokens came from each source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mmh3
import numpy as np

from mhf_dist.config import DataConfig
from mhf_dist.storage import redact

NONE_SELECTED = 0  # a threshold that takes no document
ALL_SELECTED = 2**32  # above every 32-bit key


@dataclass(frozen=True)
class Source:
    """One source of training text. `keyed`: its training documents are chosen by key (else all are
    used); `validation`: its held-out documents are part of the validation split."""

    name: str
    corpus: str
    text_field: str
    weight: float  # its share of the training tokens; the sources' weights sum to 1
    seed: int = 0
    keyed: bool = False
    validation: bool = True


@dataclass(frozen=True)
class Candidates:
    """A keyed source's training documents: key and token count of each (any order)."""

    keys: np.ndarray
    tokens: np.ndarray


def sources(data: DataConfig) -> list[Source]:
    """The sources `data` names, in stream order."""
    if len(data.sources) > 1:
        total = sum(source.weight for source in data.sources)
        return [
            Source(
                source.name,
                source.corpus,
                source.text_field or data.text_field,
                source.weight / total,
                data.mixture_seed,
                keyed=True,
            )
            for source in data.sources
        ]
    if data.sources:
        (only,) = data.sources
        return [Source(only.name, only.corpus, only.text_field or data.text_field, 1.0)]
    if replays(data):
        fraction = data.replay.fraction
        return [
            Source("corpus", data.corpus, data.text_field, 1 - fraction),
            Source(
                "replay",
                str(data.replay.corpus),
                data.text_field,
                fraction,
                data.replay.seed,
                keyed=True,
                validation=False,
            ),
        ]
    return [Source("corpus", data.corpus, data.text_field, 1.0)]


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
    """Each keyed source's key threshold (None for a source used whole).

    The total is set by a source used whole (data.corpus beside a replay), else by the keyed source that
    runs out first (its available tokens over its weight); each keyed source's target is its weight of
    that total.
    """
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


def source_records(mixed: list[Source], taken: list[dict[str, int]]) -> list[dict[str, Any]]:
    """The manifest's `sources`: what each source gave (`taken`: documents, tokens and validation
    counts per source)."""
    total = sum(counts["tokens"] for counts in taken)
    return [
        {
            "name": source.name,
            "corpus": redact(source.corpus),
            "weight": source.weight,
            "documents": counts["documents"],
            "tokens": counts["tokens"],
            "share": counts["tokens"] / total if total else 0.0,
            "validation_documents": counts["validation_documents"],
            "validation_tokens": counts["validation_tokens"],
        }
        for source, counts in zip(mixed, taken, strict=True)
    ]


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


def replay_record(
    data: DataConfig, records: list[dict[str, Any]], threshold: int, candidates: Candidates
) -> dict[str, Any]:
    """The manifest's train-split `mixture` record of a replay (`shards.Mixture`)."""
    main, replay = records
    total = main["tokens"] + replay["tokens"]
    return {
        "requested_fraction": data.replay.fraction,
        "realised_fraction": replay["tokens"] / total if total else 0.0,
        "threshold": threshold,
        "sources": [
            {"corpus": main["corpus"], "documents": main["documents"], "tokens": main["tokens"]},
            {
                "corpus": replay["corpus"],
                "seed": data.replay.seed,
                "documents": replay["documents"],
                "tokens": replay["tokens"],
                "candidate_documents": len(candidates.keys),
                "candidate_tokens": int(candidates.tokens.sum()),
            },
        ],
        "tokens": "train-split document tokens with their boundary tokens, before packing",
    }
