"""An independent statement of the authors' `Qwen3Model.initialize_hash_map` (HUIYINXUE/MHF) for tests.

Written from their loop, one token at a time as they run it, and never through mhf-dist's code: both LSH
projections drawn whole (torch.Generator seeds 3407 and 3408), the per-token first-stage product on the
trigram rows, the per-token second-stage product, and their `external_dict` that keeps ONE token per
H-1 prefix, so a new last coordinate is compared only with that prefix's most recent token.
"""

from collections import Counter

import mmh3
import torch
import torch.nn.functional as F


def _trigrams(token):
    if len(token) < 3:
        return Counter([token])
    return Counter([token[i : i + 3] for i in range(len(token) - 2)])


def _binarize(counts, seed, projection):
    frequency = torch.tensor([list(counts.values())], dtype=projection.dtype)
    rows = [mmh3.hash128(trigram, seed=seed) % 16000 for trigram in counts]
    out = frequency @ projection[rows]
    out[out >= 0] = 512**-0.5
    out[out < 0] = -(512**-0.5)
    return out


def lsh_projections(num_lsh, num_buckets):
    first = torch.randn((16000, num_lsh, 512), generator=torch.Generator().manual_seed(3407))
    second = torch.randn(
        (512 * num_lsh, num_lsh, num_buckets - 1), generator=torch.Generator().manual_seed(3408)
    )
    return first, F.normalize(second, dim=-1)


def authors_hash_map(tokens, num_hashes, num_buckets, num_lsh=0, pad_id=None, rows=None, seed=0):
    """[rows or len(tokens), H] long: `tokens` are the hashed (base) vocabulary in id order; rows past
    them stay zero, as added tokens and the rounding to a multiple of 128 do in their checkpoints."""
    hash_map = torch.zeros((rows or len(tokens), num_hashes), dtype=torch.long)
    latest = {}  # prefix -> {token: last coordinate}, one entry per prefix as theirs
    projections = lsh_projections(num_lsh, num_buckets) if num_lsh else None
    for token_id, token in enumerate(tokens):
        prefix = ()
        if num_lsh:
            if token_id == pad_id:
                prefix = (0,) * num_lsh
            else:
                counts = _trigrams(token)
                first = torch.cat(
                    [_binarize(counts, seed + j, projections[0][:, j, :]) for j in range(num_lsh)], dim=-1
                )
                for j in range(num_lsh):
                    prefix += ((first @ projections[1][:, j, :]).argmax(dim=-1).item() + 1,)
        for j in range(num_lsh, num_hashes - 1):
            prefix += (
                0 if token_id == pad_id else mmh3.hash128(token, seed=seed + j) % (num_buckets - 1) + 1,
            )
        if num_hashes != num_lsh:
            last_seed = seed + num_hashes - 1
            if token_id == pad_id:
                last = 0
            else:
                last = mmh3.hash128(token, seed=last_seed) % (num_buckets - 1) + 1
                if prefix in latest:
                    redraw = 0
                    while last in latest[prefix].values():
                        redraw += 1
                        if redraw > 10_000:  # theirs would loop for ever (B=2: one value to draw)
                            raise RuntimeError(f"the authors' loop never ends for {token!r}")
                        last = mmh3.hash128(token, seed=last_seed + redraw) % (num_buckets - 1) + 1
            latest[prefix] = {token: last}
            prefix += (last,)
        hash_map[token_id] = torch.tensor(prefix)
    return hash_map
