"""Packing documents back to back into rows of seq_len + 1 tokens, without padding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mhf_dist.errors import DataError


def pack_documents(documents: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> tuple[np.ndarray, int]:
    """Concatenate documents, each followed by EOS, and cut into rows of seq_len + 1 tokens.

    Returns (rows [N, seq_len+1] int64, dropped): the remainder shorter than a row is dropped and
    counted. Row i covers stream[i*(seq_len+1) : (i+1)*(seq_len+1)]; input and target are the row
    shifted by one.
    """
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len}; use seq_len >= 2")
    stream = np.fromiter((token for doc in documents for token in (*doc, eos_id)), dtype=np.int64)
    width = seq_len + 1
    num_rows = len(stream) // width
    if num_rows == 0:
        raise DataError(
            f"the corpus has {len(stream)} tokens, fewer than one row of seq_len+1={width}; "
            "use more text or a smaller seq_len"
        )
    return stream[: num_rows * width].reshape(num_rows, width), len(stream) - num_rows * width


def shuffled_batches(rows: np.ndarray, batch_size: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of rows, reshuffled every epoch by a seeded generator (same seed, same order)."""
    if len(rows) < batch_size:
        raise DataError(f"{len(rows)} rows cannot fill a batch of {batch_size}; lower train.batch_size")
    generator = np.random.default_rng(seed)
    while True:
        order = generator.permutation(len(rows))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield {"tokens": torch.from_numpy(rows[order[start : start + batch_size]])}
