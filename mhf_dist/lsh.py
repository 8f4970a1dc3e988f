"""The reference scheme's LSH coordinates (`model.hash.num_lsh > 0`), as the authors compute them.

A token string's character trigrams (a string shorter than 3 is its own single trigram) are counted.
First stage, for each LSH coordinate j: trigram t is row `mmh3.hash128(t, seed + j) % 16000` of a
[16000, 512] slice of one [16000, num_lsh, 512] standard-normal matrix (torch.Generator seeded 3407);
the counts times those rows, summed, are binarised to +-512**-0.5 (>= 0 is +). Second stage: the
num_lsh binarised vectors, concatenated, are multiplied by slice j of one [512 * num_lsh, num_lsh, B-1]
standard-normal matrix (seeded 3408, every row L2-normalised over its last dimension); coordinate j is
the arg-max plus one, so bucket 0 stays the padding token's. Similar strings share buckets.

The authors draw both matrices whole and score one token at a time. Here only slice j is kept, drawn
by streaming the generator in chunks of whole 16-value groups (torch's normal sampler fills 16 at a
time, so the values equal one whole draw): peak memory is one slice (134 MB at num_lsh=4, B=16K). The
second stage scores tokens in blocks, which sum in another order than the authors' product: a token
whose two best buckets tie to float32 rounding could take the other one (the tests compare both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import mmh3
import numpy as np
import torch
import torch.nn.functional as F

TRIGRAM_ROWS = 16000
PROJECTION_WIDTH = 512
FIRST_SEED = 3407
SECOND_SEED = 3408
TOKEN_BLOCK = 1024  # tokens scored together in the second stage: a [1024, B-1] block of scores
_CHUNK_VALUES = 1 << 22  # values drawn per generator call while streaming a matrix (16 MB)


def trigram_counts(token: str) -> Counter:
    """Character trigrams of `token` with their counts, in order of first appearance."""
    return Counter(token[i : i + 3] for i in range(max(1, len(token) - 2)))  # a shorter token is one


def normal_slice(seed: int, shape: tuple[int, int, int], index: int, normalize: bool = False) -> torch.Tensor:
    """`torch.randn(shape, generator=Generator().manual_seed(seed))[:, index, :]`, contiguous, without
    the whole matrix in memory; `normalize`: each row L2-normalised over the last dimension first."""
    rows, middle, cols = shape
    per_row = middle * cols
    # whole 16-value groups per chunk, so the stream equals one whole draw (checked in the tests)
    chunk_rows = max(16, (_CHUNK_VALUES // per_row) // 16 * 16)
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, cols)
    for start in range(0, rows, chunk_rows):
        count = min(chunk_rows, rows - start)
        if count < chunk_rows and (count * per_row) % 16:
            raise ValueError(f"a last chunk of {count} rows x {per_row} values is not whole 16-value groups")
        block = torch.randn((count, middle, cols), generator=generator)
        if normalize:
            block = F.normalize(block, dim=-1)
        out[start : start + count] = block[:, index, :]
    return out


def lsh_coordinates(tokens: Sequence[str], num_lsh: int, num_buckets: int, seed: int = 0) -> np.ndarray:
    """[len(tokens), num_lsh] buckets in 1..B-1 (int64): the first num_lsh coordinates of each token."""
    if not tokens:
        return np.zeros((0, num_lsh), np.int64)
    signs = _first_stage(tokens, num_lsh, seed)  # [V, num_lsh * 512] of +-1
    scale = PROJECTION_WIDTH**-0.5
    shape = (PROJECTION_WIDTH * num_lsh, num_lsh, num_buckets - 1)
    out = np.empty((len(tokens), num_lsh), np.int64)
    for j in range(num_lsh):
        projection = normal_slice(SECOND_SEED, shape, j, normalize=True)
        for start in range(0, len(tokens), TOKEN_BLOCK):
            binarised = signs[start : start + TOKEN_BLOCK].float() * scale
            scores = binarised @ projection
            out[start : start + TOKEN_BLOCK, j] = scores.argmax(dim=-1).numpy() + 1
    return out


def _first_stage(tokens: Sequence[str], num_lsh: int, seed: int) -> torch.Tensor:
    """[V, num_lsh * 512] int8 signs: coordinate j's binarised trigram projection in columns j*512.."""
    counted = [trigram_counts(token) for token in tokens]
    frequencies = [torch.tensor([list(counts.values())], dtype=torch.float32) for counts in counted]
    signs = torch.empty(len(tokens), num_lsh * PROJECTION_WIDTH, dtype=torch.int8)
    for j in range(num_lsh):
        projection = normal_slice(FIRST_SEED, (TRIGRAM_ROWS, num_lsh, PROJECTION_WIDTH), j)
        columns = slice(j * PROJECTION_WIDTH, (j + 1) * PROJECTION_WIDTH)
        for index, (counts, frequency) in enumerate(zip(counted, frequencies, strict=True)):
            rows = [mmh3.hash128(trigram, seed + j) % TRIGRAM_ROWS for trigram in counts]
            # one token at a time, the authors' product: the sign of a near-zero sum is theirs too
            projected = frequency @ projection[rows]
            signs[index, columns] = torch.where(projected[0] >= 0, 1, -1).to(torch.int8)
    return signs
