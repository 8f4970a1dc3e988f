"""Gated Hybrid's explicit key-value memory: exact associative retrieval beside the lossy recurrence.

Every adjacent token pair (e_{j-1}, e_j) of the input embeddings is a memory entry: key W_k e_{j-1},
value W_v e_j. The query at position t is W_q e_t (the current token), so after "... k v ... k" the
key of the pair (k, v) matches and v is read back. Each query keeps its `top_k` most similar keys
among the pairs completed so far (j <= t), weights them by a softmax over those scores, and a learned
gate scales the retrieved vector. A standard model turns it into memory logits through its LM head
(weight detached) added to the recurrent logits (late fusion); under hash I/O it is added to the
final hidden state the hash decoder reads.

The whole search is tensor operations (one score matrix and `topk` per sequence), not a loop over
positions; generation keeps the keys and values in a cache and scores one query against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MemoryCache:
    keys: torch.Tensor  # [B, pairs, m]
    values: torch.Tensor  # [B, pairs, m]
    pending_key: torch.Tensor  # [B, 1, m]: the key of the last token, waiting for its value


class KeyValueMemory(nn.Module):
    def __init__(self, d_model: int, memory_dim: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.q_proj = nn.Linear(d_model, memory_dim, bias=False)
        self.k_proj = nn.Linear(d_model, memory_dim, bias=False)
        self.v_proj = nn.Linear(d_model, memory_dim, bias=False)
        self.out_proj = nn.Linear(memory_dim, d_model, bias=False)
        self.gate = nn.Linear(2 * d_model, 1)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cache: MemoryCache | None = None
    ) -> tuple[torch.Tensor, MemoryCache]:
        """The gated retrieved vector [B, T, d] for `embeds` [B, T, d] read after `cache`, and the new
        cache. Callers pass detached `embeds` and `hidden` (the recurrent stack's output)."""
        keys, values = self.k_proj(embeds), self.v_proj(embeds)
        if cache is None:
            pair_keys, pair_values = keys[:, :-1], values[:, 1:]
        else:
            pair_keys = torch.cat([cache.keys, cache.pending_key, keys[:, :-1]], dim=1)
            pair_values = torch.cat([cache.values, values], dim=1)
        seen = pair_keys.shape[1] - (embeds.shape[1] - 1)  # pairs completed before this call's 2nd token
        retrieved = self._retrieve(self.q_proj(embeds), pair_keys, pair_values, seen)
        out = self.out_proj(retrieved)
        gate = torch.sigmoid(self.gate(torch.cat([hidden, out], dim=-1)))
        new_cache = MemoryCache(pair_keys, pair_values, keys[:, -1:])
        return gate * out, new_cache

    def _retrieve(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int
    ) -> torch.Tensor:
        """Softmax over each query's top-k keys among the first `seen + i` pairs (query i)."""
        batch, length, width = queries.shape
        if keys.shape[1] == 0:
            return queries.new_zeros(batch, length, width)
        scores = queries @ keys.transpose(1, 2) / width**0.5  # [B, T, pairs]
        visible = torch.arange(keys.shape[1], device=keys.device) < seen + torch.arange(
            length, device=keys.device
        ).unsqueeze(1)
        top = min(self.top_k, keys.shape[1])
        best, index = scores.masked_fill(~visible, float("-inf")).topk(top, dim=-1)
        found = best.isfinite()  # fewer than top_k visible pairs (or none, at the first position)
        weights = F.softmax(best.masked_fill(~found, torch.finfo(best.dtype).min), dim=-1) * found
        chosen = values[torch.arange(batch, device=values.device)[:, None, None], index]  # [B, T, k, m]
        return torch.einsum("btk,btkm->btm", weights, chosen)
