"""The triple-latent layer and the parts the variants add around it (PAPERS.md section 2).

Per head, with x_t the layer input:

    running state   s_t = lambda_t * s_{t-1} + (1 - lambda_t) * a_t
    pair memory     P_t = diag(gamma_t) P_{t-1} + ((1 - gamma_t) * s_{t-1}) b_t^T
    readout         o_t = W_o vec((P_t^T q^l_t) * q^r_t)

a, b, q^l, q^r and the gate logits are linear in x_t. Gates live in log space: log lambda =
logsigmoid(z), floored at LOG_DECAY_FLOOR (a step keeps at least 1.8% of the state, which bounds the
chunked scans' exponents), and 1 - lambda = -expm1(log lambda); long products of decays are sums of
logs. The pair-memory decay gamma has one value per head and per *row* (per
s-coordinate): a per-row decay is a diagonal matrix acting on the key side, which is exactly gated
linear attention with keys (1 - gamma) * s_{t-1} and values b_t, so `pair_scan` computes it in chunks.
(A scalar decay would be less expressive; a per-entry decay on S x S would leave the GLA form and need
a full S x S gate per step.) The left query contracts the row index (the s side), the right query
multiplies the read-out element-wise.

Triple-Slot replaces the dense S x S memory by M learned slots: P_t is stored factored as
L^T Z_t, with learned left factors L (M x S, "slot keys", one set per head) and slot contents Z_t
(M x S, the right factors) written as Z_t = diag(gamma_t) Z_{t-1} + ((1 - gamma_t) * L s_{t-1}) b_t^T
and read with L q^l_t. The memory has rank <= M and costs M x S per head instead of S x S; it is the
same GLA form with M rows, so it uses the same scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.models.scans import LOG_DECAY_FLOOR, diagonal_scan, pair_scan

MixerState = tuple[torch.Tensor, torch.Tensor]  # (s [B, H, S], P [B, H, rows, S])


def _retention_logits(count: int, low: float, high: float) -> torch.Tensor:
    """Gate logits whose sigmoids (retentions) spread evenly over [low, high], so that some
    coordinates remember for ~2 steps and others for ~1 / (1 - high) steps from the start."""
    return torch.logit(torch.linspace(low, high, count))


class TripleLatentMixer(nn.Module):
    """Running state, pair memory (dense or `slots` rows) and the bilinear readout of one layer."""

    def __init__(self, d_model: int, heads: int, state_dim: int, chunk_size: int, slots: int = 0) -> None:
        super().__init__()
        self.heads, self.state_dim, self.chunk_size = heads, state_dim, chunk_size
        self.rows = slots or state_dim
        # a, b, q_left, q_right (S each), then the gate logits z_lambda (S) and z_gamma (one per memory
        # row), per head; the two gates are adjacent so that one set of ops computes both.
        self.in_proj = nn.Linear(d_model, heads * (5 * state_dim + self.rows), bias=False)
        retention = torch.cat(
            [_retention_logits(state_dim, 0.5, 0.97), _retention_logits(self.rows, 0.5, 0.99)]
        )
        self.gate_bias = nn.Parameter(retention.repeat(heads, 1))
        self.slot_keys = (
            nn.Parameter(torch.randn(heads, slots, state_dim) / state_dim**0.5) if slots else None
        )
        self.out_proj = nn.Linear(heads * state_dim, d_model, bias=False)

    def empty_state(self, batch: int, like: torch.Tensor) -> MixerState:
        zeros = like.new_zeros
        return zeros(batch, self.heads, self.state_dim), zeros(batch, self.heads, self.rows, self.state_dim)

    def _project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """[B, T, d] -> the per-head inputs of both recurrences, each [B, H, T, *]."""
        state = self.state_dim
        projected = self.in_proj(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, H, T, 5S + rows]
        a, b, q_left, q_right, gate_logits = projected.split([state] * 4 + [state + self.rows], dim=-1)
        log_decays = F.logsigmoid(gate_logits + self.gate_bias[:, None]).clamp(min=LOG_DECAY_FLOOR)
        gates = -torch.expm1(log_decays)  # 1 - decay
        p = {"b": b, "q_left": q_left, "q_right": q_right}
        p["log_lambda"], p["log_gamma"] = log_decays.split([state, self.rows], dim=-1)
        retain_complement, p["write_gate"] = gates.split([state, self.rows], dim=-1)
        p["state_in"] = retain_complement * a  # (1 - lambda) * a
        if self.slot_keys is not None:  # slot addresses: the learned left factors L
            p["q_left"] = torch.einsum("bhts,hms->bhtm", p["q_left"], self.slot_keys)
        return p

    def _memory_key(self, s_prev: torch.Tensor) -> torch.Tensor:
        if self.slot_keys is None:
            return s_prev
        return torch.einsum("bhts,hms->bhtm", s_prev, self.slot_keys)

    def _readout(self, read: torch.Tensor, q_right: torch.Tensor) -> torch.Tensor:
        return self.out_proj((read * q_right).transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, state: MixerState | None = None) -> tuple[torch.Tensor, MixerState]:
        """Parallel (chunked) form over [B, T, d]; returns the output and the state after step T."""
        s0, p0 = state if state is not None else self.empty_state(x.shape[0], x)
        compute = torch.promote_types(x.dtype, torch.float32)  # scans in >= float32 under bf16 training
        p = {name: value.to(compute) for name, value in self._project(x).items()}
        states, s_last = diagonal_scan(p["log_lambda"], p["state_in"], s0.to(compute), self.chunk_size)
        s_prev = torch.cat([s0[:, :, None].to(compute), states[:, :, :-1]], dim=2)
        key = p["write_gate"] * self._memory_key(s_prev)
        read, p_last = pair_scan(p["q_left"], key, p["b"], p["log_gamma"], p0.to(compute), self.chunk_size)
        return self._readout(read.to(x.dtype), p["q_right"].to(x.dtype)), (s_last, p_last)

    def advance(self, x: torch.Tensor, state: MixerState | None) -> tuple[torch.Tensor, MixerState]:
        """Continue from `state`: one token by `step`, a sequence (training, a prompt) by the scans."""
        if state is not None and x.shape[1] == 1:
            return self.step(x, state)
        return self(x, state)

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One time step [B, 1, d] of the recurrence itself (generation), with explicit state."""
        p = {name: value[:, :, 0] for name, value in self._project(x).items()}
        s_prev, memory = state
        key = p["write_gate"] * self._memory_key(s_prev[:, :, None])[:, :, 0]
        memory = p["log_gamma"].exp()[..., None] * memory + key[..., None] * p["b"][..., None, :]
        s = p["log_lambda"].exp() * s_prev + p["state_in"]
        read = torch.einsum("bhrs,bhr->bhs", memory, p["q_left"])
        return self._readout(read[:, :, None], p["q_right"][:, :, None]), (s, memory)


class CausalConvPath(nn.Module):
    """Triple-Hybrid's local path before the recurrent stack: x + W silu(depthwise causal conv(norm x)).

    Its state is the last kernel-1 normalised inputs, so a step and a whole sequence run the same code.
    """

    def __init__(self, d_model: int, kernel: int, eps: float) -> None:
        super().__init__()
        self.kernel = kernel
        self.norm = nn.RMSNorm(d_model, eps=eps)
        bound = kernel**-0.5  # nn.Conv1d's default initialisation for a depthwise kernel
        self.conv_weight = nn.Parameter(torch.empty(d_model, kernel).uniform_(-bound, bound))
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, history: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(x)
        if history is None:
            history = normed.new_zeros(x.shape[0], self.kernel - 1, x.shape[2])
        window = torch.cat([history, normed], dim=1)
        # The depthwise convolution as kernel shifted products in [B, T, d] layout: on CPU this beats
        # conv1d, which needs [B, d, T] copies in and out.
        length = x.shape[1]
        local = sum(window[:, k : k + length] * self.conv_weight[:, k] for k in range(self.kernel))
        return x + self.proj(F.silu(local)), window[:, window.shape[1] - (self.kernel - 1) :]
