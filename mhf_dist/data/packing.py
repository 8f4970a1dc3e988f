"""Packing documents back to back into rows of seq_len + 1 tokens, without padding.

Consecutive rows overlap by one token: row i is stream[i*seq_len : i*seq_len + seq_len + 1], so every
token after the first is a training target exactly once. Only the tail shorter than a row is dropped.
Because row i depends on nothing but its own token range, any range of rows can be packed on its own
(`mhf prepare` packs each shard in a separate task from `token_range`).
"""

from __future__ import annotations

import numpy as np

from mhf_dist.errors import DataError


def row_count(tokens: int, seq_len: int) -> int:
    """Full rows in a stream of `tokens` tokens."""
    return max(0, (tokens - 1) // seq_len)


def dropped_tokens(tokens: int, seq_len: int) -> int:
    """Tokens never used as a target: the tail after the last full row (the whole stream if no row)."""
    rows = row_count(tokens, seq_len)
    return tokens - rows * seq_len - 1 if rows else tokens


def token_range(first_row: int, end_row: int, seq_len: int) -> tuple[int, int]:
    """The stream positions [start, stop) that rows first_row .. end_row-1 are cut from."""
    return first_row * seq_len, end_row * seq_len + 1


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """The full rows of `stream`, [row_count, seq_len + 1] int64."""
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len}; use seq_len >= 2")
    stream = np.asarray(stream, dtype=np.int64)
    count = row_count(len(stream), seq_len)
    if count == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
    return windows[: count * seq_len : seq_len].copy()
