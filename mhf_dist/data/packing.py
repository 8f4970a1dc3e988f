"""Packing documents back to back into rows of seq_len + 1 tokens, without padding.

Two rules (`data.packing`), both pure functions of the token stream:
- `overlap` (this project's): consecutive rows overlap by one token, row i is
  stream[i*seq_len : i*seq_len + seq_len + 1], so every token after the first is a training target once.
- `blocks` (the authors' `group_texts`): the stream is cut into disjoint blocks of seq_len + 1 tokens, row
  i is stream[i*(seq_len+1) : (i+1)*(seq_len+1)]; the first token of each block is only ever an input.
  (Their HF model sees a block of L = seq_len + 1 tokens and scores its L - 1 shifted targets: the same.)
In both only the tail shorter than a row is dropped. Because row i depends on nothing but its own token
range, any range of rows can be packed on its own (`mhf prepare` packs each shard in a separate task from
`token_range`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from mhf_dist.errors import DataError

Packing = Literal["overlap", "blocks"]


def stride(seq_len: int, packing: Packing = "overlap") -> int:
    """Stream positions between the starts of consecutive rows."""
    return seq_len if packing == "overlap" else seq_len + 1


def row_count(tokens: int, seq_len: int, packing: Packing = "overlap") -> int:
    """Full rows in a stream of `tokens` tokens."""
    if tokens < seq_len + 1:
        return 0
    return (tokens - seq_len - 1) // stride(seq_len, packing) + 1


def dropped_tokens(tokens: int, seq_len: int, packing: Packing = "overlap") -> int:
    """Tokens in no row: the tail after the last full row (the whole stream if no row)."""
    rows = row_count(tokens, seq_len, packing)
    return tokens - (token_range(0, rows, seq_len, packing)[1] if rows else 0)


def token_range(first_row: int, end_row: int, seq_len: int, packing: Packing = "overlap") -> tuple[int, int]:
    """The stream positions [start, stop) that rows first_row .. end_row-1 are cut from."""
    step = stride(seq_len, packing)
    return first_row * step, (end_row - 1) * step + seq_len + 1


def pack_rows(stream: np.ndarray, seq_len: int, packing: Packing = "overlap") -> np.ndarray:
    """The full rows of `stream`, [row_count, seq_len + 1] int64."""
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len}; use seq_len >= 2")
    stream = np.asarray(stream, dtype=np.int64)
    count = row_count(len(stream), seq_len, packing)
    if count == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
    step = stride(seq_len, packing)
    return windows[: count * step : step].copy()
