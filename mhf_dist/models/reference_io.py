"""The paper's hash encoder and cascaded decoder, laid out as the authors built them (HUIYINXUE/MHF).

One table E of [H*B, d_model] serves both ends: coordinate j owns rows j*B .. j*B + B-1.
- Encoder: a token's H rows E[j*B + s_j] are scored by a gate (Linear(d, k) + SiLU + Linear(k, 1)),
  softmax-normalised over the H coordinates, summed, and projected by Linear(d, d). Under
  `lsh_only_embed` it reads only the first num_lsh coordinates (the LSH ones), as the authors' forward.
- Decoder: from the backbone's final-norm output h_0, coordinate j scores its B buckets with its own
  block E_j (tied: the same parameter as the encoder's table, or a separate `lm_head` when untied); the
  expected bucket vector under those probabilities, soft_j = p_j E_j (always the input table), feeds a
  mixer of its own: h_{j+1} = h_j + M_j([h_j; soft_j]), M_j = Linear(2d, k) + SiLU + Linear(k, d).
Every linear layer has a bias, as in the reference; nothing is narrower than the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # the reference's `initializer_range` for every table and linear weight; biases zero


def init_reference(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(param)
        else:
            nn.init.normal_(param, std=INIT_STD)


def _bottleneck(d_in: int, k: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, k), nn.SiLU(), nn.Linear(k, d_out))


class ReferenceHashEncoder(nn.Module):
    """Signatures [..., H] -> vectors [..., d_model] through the shared [H*B, d] table.

    `input_coords` (default H): the leading coordinates read; the table keeps all H blocks (the decoder's).
    """

    def __init__(
        self,
        num_hashes: int,
        num_buckets: int,
        d_model: int,
        bottleneck: int,
        input_coords: int | None = None,
    ) -> None:
        super().__init__()
        self.input_coords = num_hashes if input_coords is None else input_coords
        self.table = nn.Embedding(num_hashes * num_buckets, d_model)
        self.gate = _bottleneck(d_model, bottleneck, 1)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("offsets", torch.arange(self.input_coords) * num_buckets, persistent=False)
        init_reference(self)

    def forward(self, signatures: torch.Tensor) -> torch.Tensor:
        rows = self.table(signatures[..., : self.input_coords] + self.offsets)  # [..., H, d]
        weights = torch.softmax(self.gate(rows), dim=-2)  # [..., H, 1]
        return self.proj((weights * rows).sum(dim=-2))


class ReferenceCascadeDecoder(nn.Module):
    """Hidden states [..., d] -> H tensors of fp32 coordinate log-probabilities [..., B].

    `table` is the encoder's parameter itself, registered here too (as transformers ties an LM head):
    under ZeRO-3 the decoder's forward then gathers it like any parameter of its own.
    """

    def __init__(
        self, table: nn.Parameter, num_hashes: int, num_buckets: int, bottleneck: int, tied: bool
    ) -> None:
        super().__init__()
        self.num_hashes, self.num_buckets = num_hashes, num_buckets
        d_model = table.shape[1]
        self.table = table
        self.lm_head = None if tied else nn.Parameter(torch.empty_like(table))
        self.mixers = nn.ModuleList(
            _bottleneck(2 * d_model, bottleneck, d_model) for _ in range(num_hashes - 1)
        )
        init_reference(self.mixers)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head, std=INIT_STD)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        output_table = self.table if self.lm_head is None else self.lm_head
        state, coord_logps = hidden, []
        for j in range(self.num_hashes):
            rows = slice(j * self.num_buckets, (j + 1) * self.num_buckets)
            logp_j = torch.log_softmax(F.linear(state, output_table[rows]).float(), dim=-1)
            coord_logps.append(logp_j)
            if j + 1 < self.num_hashes:
                soft_bucket = logp_j.exp().to(state.dtype) @ self.table[rows]
                state = state + self.mixers[j](torch.cat([state, soft_bucket], dim=-1))
        return coord_logps
