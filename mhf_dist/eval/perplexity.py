"""Exact token NLL and perplexity over packed rows (V_actl-renormalised for mhf)."""

from __future__ import annotations

import math

import numpy as np
import torch

from mhf_dist.models.base import CausalLM, split_rows


@torch.no_grad()
def nll_totals(
    model: CausalLM, rows: np.ndarray, batch_size: int = 16, device: torch.device | None = None
) -> tuple[float, int]:
    """(summed exact NLL in nats, number of predicted tokens) over rows of seq_len+1 ids."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        inputs, targets = split_rows(torch.from_numpy(rows[start : start + batch_size]).to(device))
        nll = model.token_nll(inputs, targets)
        total += float(nll.double().sum())
        count += nll.numel()
    model.train(was_training)
    return total, count


def nll_summary(total: float, count: int) -> dict[str, float]:
    mean = total / count
    return {"val_nll": mean, "val_ppl": math.exp(mean), "val_tokens": count}


def evaluate_rows(model: CausalLM, rows: np.ndarray, batch_size: int = 16) -> dict[str, float]:
    """Mean exact NLL (nats per token) and perplexity over non-overlapping rows of seq_len+1 ids."""
    return nll_summary(*nll_totals(model, rows, batch_size))
