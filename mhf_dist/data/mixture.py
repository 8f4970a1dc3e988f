"""Training text from two sources: `data.corpus` whole, plus a replayed share of `data.replay.corpus`.

Every document carries `source` (0: data.corpus, 1: the replayed corpus) and `key`, a stable content
hash. data.corpus is split into train and validation as always (`shards.is_validation`). The replayed
corpus adds training documents only: those the same split rule puts in validation are never used (they
may be the parent's own held-out text), so the validation split stays data.corpus alone. Of the rest,
documents are taken in the order of `key` = MurmurHash3(text, data.replay.seed) until about
`fraction` of the training tokens (boundary tokens included, counted before packing) come from the
replay: a document is in iff its key is below a threshold the driver computes from the per-document
token counts. Membership depends only on the text, the seed and the counts, never on how Ray cut the
data into blocks, so the shards are the same on any cluster. Replayed documents follow data.corpus's in
the token stream; the reader's shuffle (`data.shuffle`) mixes the rows.

A further weighted source would be one more `source` value with a threshold of its own (no such setting yet).
"""

from __future__ import annotations

from typing import Any

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mhf_dist.config import DataConfig
from mhf_dist.data.shards import is_validation

MAIN, REPLAY = 0, 1
NONE_SELECTED = 0  # a threshold that takes no replayed document


def label_main(batch: pa.Table) -> pa.Table:
    """data.corpus's documents: source 0, key 0 (all of them are used)."""
    return batch.append_column("source", pa.array(np.full(batch.num_rows, MAIN, np.int8))).append_column(
        "key", pa.array(np.zeros(batch.num_rows, np.int64))
    )


def label_replay(batch: pa.Table, val_percent: float, seed: int) -> pa.Table:
    """The replayed corpus's candidates: training documents only, keyed by their content hash."""
    texts = batch["text"].to_pylist()
    keep = pa.array([not is_validation(text, val_percent) for text in texts])
    kept = batch.filter(keep)
    keys = [mmh3.hash(text.encode(), seed, signed=False) for text in kept["text"].to_pylist()]
    return pa.table(
        {
            "text": kept["text"],
            "replaced": kept["replaced"],
            "split": pa.array(["train"] * kept.num_rows, pa.string()),
            "source": pa.array(np.full(kept.num_rows, REPLAY, np.int8)),
            "key": pa.array(keys, pa.int64()),
        }
    )


def replays(data: DataConfig) -> bool:
    return data.replay.corpus is not None and data.replay.fraction > 0


def with_replay(documents: Any, data: DataConfig) -> Any:
    """`documents` (data.corpus, with its split) labelled, followed by the replayed corpus's candidates."""
    from mhf_dist.data.corpus import read_corpus

    main = documents.map_batches(label_main, batch_format="pyarrow")
    if not replays(data):
        return main
    replay = read_corpus(data.replay.corpus, data.text_field).map_batches(
        label_replay,
        batch_format="pyarrow",
        fn_kwargs={"val_percent": data.val_percent, "seed": data.replay.seed},
    )
    return main.union(replay)


def in_split(block: pa.Table, split: str, threshold: int) -> pa.Array:
    """The documents of `block` that `split` holds: data.corpus's, and replayed ones below `threshold`."""
    chosen = pc.or_(pc.equal(block["source"], MAIN), pc.less(block["key"], threshold))
    return pc.and_(pc.equal(block["split"], split), chosen)


def candidates(block: pa.Table) -> dict[str, np.ndarray]:
    """Key, tokens and replaced count of each replayed candidate in a tokenized block."""
    if block.num_rows == 0:
        return {
            "key": np.zeros(0, np.int64),
            "tokens": np.zeros(0, np.int64),
            "replaced": np.zeros(0, np.int64),
        }
    rows = block.filter(pc.equal(block["source"], REPLAY))
    return {
        "key": rows["key"].to_numpy(),
        "tokens": pc.list_value_length(rows["ids"]).to_numpy().astype(np.int64),
        "replaced": rows["replaced"].to_numpy().astype(np.int64),
    }


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


def select(counts: list[dict[str, Any]], data: DataConfig) -> tuple[int, dict[str, Any] | None]:
    """Adds each block's chosen replayed documents to its `train` counts (in place); returns the threshold
    and the manifest's `mixture` record (None without replay)."""
    if not replays(data):
        return NONE_SELECTED, None
    fraction = data.replay.fraction
    main_tokens = sum(block["train"]["tokens"] for block in counts)
    main_documents = sum(block["train"]["documents"] for block in counts)
    keys = np.concatenate([block["candidates"]["key"] for block in counts])
    tokens = np.concatenate([block["candidates"]["tokens"] for block in counts])
    target = fraction / (1 - fraction) * main_tokens
    threshold = choose_threshold(keys, tokens, target)
    replay_tokens = replay_documents = 0
    for block in counts:
        chosen = block["candidates"]["key"] < threshold
        added = int(block["candidates"]["tokens"][chosen].sum())
        block["train"]["tokens"] += added
        block["train"]["documents"] += int(chosen.sum())
        block["train"]["replaced"] += int(block["candidates"]["replaced"][chosen].sum())
        replay_tokens += added
        replay_documents += int(chosen.sum())
    total = main_tokens + replay_tokens
    record = {
        "requested_fraction": fraction,
        "realised_fraction": replay_tokens / total if total else 0.0,
        "threshold": threshold,
        "sources": [
            {"corpus": data.corpus, "documents": main_documents, "tokens": main_tokens},
            {
                "corpus": data.replay.corpus,
                "seed": data.replay.seed,
                "documents": replay_documents,
                "tokens": replay_tokens,
                "candidate_documents": len(keys),
                "candidate_tokens": int(tokens.sum()),
            },
        ],
        "tokens": "train-split document tokens with their boundary tokens, before packing",
    }
    return threshold, record
