"""Exact token NLL and perplexity over packed rows (V_actl-renormalised for mhf)."""

from __future__ import annotations

import math

import numpy as np
import torch

from mhf_dist.models.base import CausalLM, split_rows


@torch.no_grad()
def evaluate_rows(model: CausalLM, rows: np.ndarray, batch_size: int = 16) -> dict[str, float]:
    """Mean exact NLL (nats per token) and perplexity over non-overlapping rows of seq_len+1 ids."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        inputs, targets = split_rows(torch.from_numpy(rows[start : start + batch_size]))
        nll = model.token_nll(inputs, targets)
        total += float(nll.double().sum())
        count += nll.numel()
    mean = total / count
    return {"val_nll": mean, "val_ppl": math.exp(mean), "val_tokens": count}
