"""Chunked parallel forms of the two linear recurrences of the triple-latent layer.

Both recurrences have a data-dependent decay given in log space (per head and per state coordinate):

    diagonal_scan:  s_t = exp(w_t) * s_{t-1} + u_t                          s_t in R^S
    pair_scan:      P_t = diag(exp(w_t)) P_{t-1} + k_t v_t^T,  o_t = P_t^T q_t   P_t in R^{K x V}

`pair_scan` is gated linear attention (GLA) with the decay on the key (row) side. Time is cut into
chunks of C steps. With cum_t the running sum of w inside a chunk, the decay between steps j <= t is
exp(cum_t - cum_j) = exp(cum_t) * exp(-cum_j), so the intra-chunk terms are a cumulative sum
(diagonal) and a masked C x C matrix product (pair), as in GLA's chunkwise form. exp(-cum_j) grows
inside a chunk (it is never formed as 1 / exp(cum_j), whose gradient would square it); keeping every
w_t >= LOG_DECAY_FLOOR and C <= MAX_CHUNK bounds it by exp(MAX_CHUNK * |LOG_DECAY_FLOOR|) = e^64, far
inside float32's range (the scans run in float32 or float64). The state at each chunk start is carried
by a loop over chunks (T / C steps, never over time steps); every chunk's intra-chunk and
carried-state terms are computed at once.

Inputs are [B, H, T, ...]; both functions take an initial state and return the final one, so the same
code serves training (zero state) and prefill during generation (the cached state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOG_DECAY_FLOOR = -4.0  # a step keeps at least e^-4 = 1.8% of the state; callers clamp to it
MAX_CHUNK = 16


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, N, C, D], zero-padded at the end (padding: no decay, no input)."""
    pad = -x.shape[2] % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:2], -1, chunk, x.shape[-1])


def _unchunk(x: torch.Tensor, length: int) -> torch.Tensor:
    return x.flatten(2, 3)[:, :, :length]


def _chunk_size(chunk: int, length: int) -> int:
    if not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"chunk size {chunk} is outside 1..{MAX_CHUNK}; see LOG_DECAY_FLOOR")
    return min(chunk, length)


def _carry(decay: torch.Tensor, update: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """States at the start of each chunk, [B, H, N+1, ...]: x_{n+1} = decay_n * x_n + update_n."""
    states = [initial]
    for n in range(update.shape[2]):
        states.append(decay[:, :, n] * states[-1] + update[:, :, n])
    return torch.stack(states, dim=2)


def diagonal_scan(
    log_decay: torch.Tensor, inputs: torch.Tensor, initial: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All states s_1..s_T [B, H, T, S] of s_t = exp(log_decay_t) * s_{t-1} + inputs_t, and s_T."""
    length = inputs.shape[2]
    chunk = _chunk_size(chunk, length)
    cum = _chunks(log_decay, chunk).cumsum(-2)
    decay = cum.exp()  # exp(cum_t), in [e^-64, 1]
    gathered = (_chunks(inputs, chunk) * (-cum).exp()).cumsum(-2)  # state_t / exp(cum_t), from a zero start
    starts = _carry(decay[:, :, :, -1], decay[:, :, :, -1] * gathered[:, :, :, -1], initial)
    states = decay * (gathered + starts[:, :, :-1, None])
    return _unchunk(states, length), starts[:, :, -1]


def pair_scan(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Readouts o_t = P_t^T q_t [B, H, T, V] of P_t = diag(exp(log_decay_t)) P_{t-1} + k_t v_t^T, and P_T."""
    length = query.shape[2]
    chunk = _chunk_size(chunk, length)
    q, k, v = _chunks(query, chunk), _chunks(key, chunk), _chunks(value, chunk)
    cum = _chunks(log_decay, chunk).cumsum(-2)
    decay = cum.exp()  # exp(cum_t), in [e^-64, 1]
    decayed_query, grown_key = q * decay, k * (-cum).exp()
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (decayed_query @ grown_key.transpose(-1, -2)).masked_fill(~causal, 0.0)
    last = decay[:, :, :, -1:]
    update = (grown_key * last).transpose(-1, -2) @ v  # each chunk's own writes, decayed to its end
    starts = _carry(last.transpose(-1, -2), update, initial)
    output = scores @ v + decayed_query @ starts[:, :, :-1]
    return _unchunk(output, length), starts[:, :, -1]
