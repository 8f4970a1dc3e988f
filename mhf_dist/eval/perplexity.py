"""Exact token NLL and perplexity over packed rows (V_actl-renormalised for mhf)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from mhf_dist.data.packing import pack_rows
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.models.base import CausalLM, split_rows

MAX_EXP = math.log(sys.float_info.max)


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


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL); inf past float range (math.exp raises there) rather than an OverflowError."""
    return math.exp(mean_nll) if mean_nll < MAX_EXP else math.inf


def nll_summary(total: float, count: int) -> dict[str, float]:
    mean = total / count
    return {"val_nll": mean, "val_ppl": perplexity(mean), "val_tokens": count}


def evaluate_rows(model: CausalLM, rows: np.ndarray, batch_size: int = 16) -> dict[str, float]:
    """Mean exact NLL (nats per token) and perplexity over non-overlapping rows of seq_len+1 ids."""
    return nll_summary(*nll_totals(model, rows, batch_size))


def text_scores(
    model: CausalLM,
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    seq_len: int,
    batch_size: int = 16,
    document_format: str = "eos",
) -> dict[str, float]:
    """Exact NLL per token and bits per UTF-8 byte (a boundary token counts as one) of `texts`, framed
    as the model's documents and packed into windows of seq_len targets with no context across them.
    Every token of the text is a target: the first follows the model's prefix token (BOS, or EOS for an
    `eos` model), as in lm-eval's rolling log-likelihood. The targets past the last full window are
    scored in one shorter window, reported as `last_window` (`window` when it is the only one)."""
    tokens = [token for ids in tokenizer.encode_documents(list(texts), document_format) for token in ids]
    before, _ = tokenizer.boundaries(document_format)  # a bos document starts with its own prefix
    stream = np.asarray([*([] if before else tokenizer.empty_context(document_format)), *tokens])
    if len(stream) < 2:
        raise DataError(f"the text holds {len(tokens)} token(s), none to predict; give more text")
    full, tail = divmod(len(stream) - 1, seq_len)
    total, count = (
        nll_totals(model, pack_rows(stream[: full * seq_len + 1], seq_len), batch_size) if full else (0.0, 0)
    )
    if tail:  # rows overlap by one token: each target scored once
        tail_total, tail_count = nll_totals(model, stream[None, full * seq_len :], batch_size)
        total, count = total + tail_total, count + tail_count
    # one byte per boundary token scored: each document's EOS, or each BOS but the first (the prefix)
    scored_bytes = sum(len(text.encode("utf-8")) for text in texts) + len(texts) - len(before)
    shown = {"window": tail} if tail and not full else {"last_window": tail} if tail else {}
    return {
        **nll_summary(total, count),
        "bits_per_byte": total / math.log(2) / scored_bytes,
        "bytes": scored_bytes,
        **shown,
    }
