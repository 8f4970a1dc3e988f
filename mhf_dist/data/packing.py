"""Packing documents back to back into rows of seq_len + 1 tokens, without padding.

Consecutive rows overlap by one token: row i is stream[i*seq_len : i*seq_len + seq_len + 1], so every
token after the first is a training target exactly once. Only the tail shorter than a row is dropped.
"""

from __future__ import annotations

import numpy as np

from mhf_dist.errors import DataError


class Packer:
    """Streaming packer: feed token arrays in order, take full rows as they form."""

    def __init__(self, seq_len: int) -> None:
        if seq_len < 2:
            raise DataError(f"seq_len={seq_len}; use seq_len >= 2")
        self.seq_len = seq_len
        self._carry = np.zeros(0, dtype=np.int64)
        self.rows_emitted = 0

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """Append `tokens` to the stream; return the rows completed by them, [n, seq_len + 1]."""
        buffer = np.concatenate([self._carry, np.asarray(tokens, dtype=np.int64)])
        count = max(0, (len(buffer) - 1) // self.seq_len)
        rows = np.zeros((0, self.seq_len + 1), dtype=np.int64)
        if count:
            windows = np.lib.stride_tricks.sliding_window_view(buffer, self.seq_len + 1)
            rows = windows[: count * self.seq_len : self.seq_len].copy()
        self._carry = buffer[count * self.seq_len :]
        self.rows_emitted += count
        return rows

    @property
    def dropped_tokens(self) -> int:
        """Tokens never used as a target: the tail after the last full row (the whole stream if no row)."""
        if self.rows_emitted == 0:
            return len(self._carry)
        return max(0, len(self._carry) - 1)
