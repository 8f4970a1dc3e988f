"""Multi-query associative recall (MQAR conventions): synthetic sequences of key-value pairs, filler, queries.

Token ids: 0 is filler, keys come from [1, V/2), values from [V/2, V): disjoint ranges. A sequence starts
with `num_pairs` (key, value) pairs (distinct keys), then filler in which `num_queries` of those keys
reappear at random positions, each followed by its value. The labelled positions are the values after
query keys: predicting them needs the pair seen earlier in the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhf_dist.errors import ConfigError

FILLER = 0
CORPUS = "recall"  # `data.corpus: recall` prepares these rows instead of text
EVAL_SEED, TRAIN_SEED, VALIDATION_SEED = 0, 1, 2  # `mhf eval --task recall` never sees training rows


def recall_vocabulary(vocab_size: int) -> list[str]:
    """Token strings by id: the filler (also the end-of-text token), keys k1.., values v0..."""
    half = vocab_size // 2
    return ["<|endoftext|>", *(f"k{i}" for i in range(1, half)), *(f"v{i}" for i in range(vocab_size - half))]


@dataclass(frozen=True)
class RecallSet:
    rows: np.ndarray  # [N, seq_len + 1] token ids
    query_mask: np.ndarray  # [N, seq_len] True where the target (rows[:, 1:]) is a queried value


def make_recall(
    examples: int, num_pairs: int, num_queries: int, seq_len: int, vocab_size: int, seed: int = 0
) -> RecallSet:
    half = vocab_size // 2
    if num_pairs > half - 1:
        raise ConfigError(
            f"{num_pairs} pairs need {num_pairs + 1} key ids below V/2={half}; raise the vocabulary"
        )
    free = seq_len + 1 - 2 * num_pairs
    if num_queries > num_pairs or 2 * num_queries > free:
        raise ConfigError(
            f"{num_queries} queries do not fit {num_pairs} pairs in seq_len {seq_len}; use fewer queries"
        )
    rng = np.random.default_rng(seed)
    rows = np.full((examples, seq_len + 1), FILLER, dtype=np.int64)
    mask = np.zeros((examples, seq_len), dtype=bool)
    for row, labels in zip(rows, mask, strict=True):
        keys = rng.choice(np.arange(1, half), size=num_pairs, replace=False)
        values = rng.integers(half, vocab_size, size=num_pairs)
        row[0 : 2 * num_pairs : 2], row[1 : 2 * num_pairs : 2] = keys, values
        # Query slots: non-overlapping (key, value) pairs in the filler region.
        slots = rng.choice(free // 2, size=num_queries, replace=False)
        for slot, pair in zip(slots, rng.choice(num_pairs, size=num_queries, replace=False), strict=True):
            start = 2 * num_pairs + 2 * slot
            row[start], row[start + 1] = keys[pair], values[pair]
            labels[start] = True  # the target at input position `start` is row[start + 1]
    return RecallSet(rows, mask)
