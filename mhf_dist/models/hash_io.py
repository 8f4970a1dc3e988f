"""The hash interface that replaces a language model's embedding matrix and LM head: the compact
variant's modules, the two training objectives, and exact scoring (the reference layout's modules are
in `reference_io`).

`HashEncoder` turns a token's signature into a vector of the backbone's width; `CascadedHashDecoder`
turns a hidden state into H per-coordinate bucket distributions (this project's compact design: one
narrow table shared by the coordinates, a reduced cascade); `vocab_logprobs` / `vocab_logsumexp`
score real tokens exactly, renormalised over the vocabulary V_actl. The scoring functions take
coordinate logits or log-probabilities alike: a per-(position, coordinate) shift moves every token's
score at that position equally and cancels in the renormalisation. Nothing here knows which backbone
sits between encoder and decoder.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

TABLE_INIT_STD = 0.02  # bucket tables, coordinate vectors and heads, as transformers inits embeddings


def init_hash_params(module: nn.Module) -> None:
    """Tables N(0, 0.02); projections N(0, 1/fan_in) so the encoder's output starts at the scale of a
    token embedding (a 0.02-std adapter would shrink it ~50x and the backbone learns context slowly)."""
    for name, param in module.named_parameters():
        if "norm" in name:
            continue
        if isinstance(module.get_submodule(name.rpartition(".")[0]), nn.Linear):
            nn.init.normal_(param, std=param.shape[1] ** -0.5)
        else:
            nn.init.normal_(param, std=TABLE_INIT_STD)


# Positions scored together: a [POSITION_BLOCK, V] block stays small while the [H*B, POSITION_BLOCK]
# table of coordinate log-probabilities stays in cache (measured fastest on CPU among 16..1024).
POSITION_BLOCK = 64


class HashEncoder(nn.Module):
    """Gated compositional embedding of a signature.

    The H bucket vectors come from one table E_in shared by all coordinates, plus a learned vector per
    coordinate so that [a, b] and [b, a] embed differently. A feed-forward bottleneck scores each
    bucket vector, the scores are softmax-normalised over the H coordinates, and a linear adapter
    projects the weighted combination to the backbone's width. The gate lets a token lean on its
    least-shared buckets, since every bucket is shared by many unrelated tokens. `input_coords` (default
    H): the leading coordinates read (`lsh_only_embed`: the LSH ones).
    """

    def __init__(
        self,
        num_hashes: int,
        num_buckets: int,
        d_hash: int,
        gate_hidden: int,
        d_model: int,
        input_coords: int | None = None,
    ) -> None:
        super().__init__()
        self.input_coords = num_hashes if input_coords is None else input_coords
        self.bucket_embed = nn.Embedding(num_buckets, d_hash)
        self.coord_embed = nn.Parameter(torch.empty(num_hashes, d_hash))
        self.gate = nn.Sequential(
            nn.Linear(d_hash, gate_hidden, bias=False), nn.SiLU(), nn.Linear(gate_hidden, 1, bias=False)
        )
        self.adapter = nn.Linear(d_hash, d_model, bias=False)
        init_hash_params(self)

    def forward(self, signatures: torch.Tensor) -> torch.Tensor:
        read = self.input_coords
        buckets = self.bucket_embed(signatures[..., :read]) + self.coord_embed[:read]  # [..., H, d_hash]
        weights = torch.softmax(self.gate(buckets), dim=-2)  # [..., H, 1]
        return self.adapter((weights * buckets).sum(dim=-2))


class CascadeMixer(nn.Module):
    """state' = state + W_up silu(W_down [state; soft]): the recursive step between coordinates."""

    def __init__(self, d_casc: int, hidden: int) -> None:
        super().__init__()
        self.down = nn.Linear(2 * d_casc, hidden, bias=False)
        self.up = nn.Linear(hidden, d_casc, bias=False)

    def forward(self, state: torch.Tensor, soft_bucket: torch.Tensor) -> torch.Tensor:
        return state + self.up(F.silu(self.down(torch.cat([state, soft_bucket], dim=-1))))


class CascadedHashDecoder(nn.Module):
    """Predicts the next token's signature coordinate by coordinate.

    state_0 = W_r h (reduced width d_casc). For coordinate j: B-way logits from a per-coordinate head;
    the soft bucket embedding p_j @ E_out (the expectation of E_out under that distribution, so the
    cascade stays differentiable); and the mixer forms state_{j+1} from [state_j; soft_j]. The last
    coordinate needs no soft embedding, so the mixer runs H-1 times.
    """

    def __init__(
        self, d_model: int, num_hashes: int, num_buckets: int, d_casc: int, mixer_hidden: int
    ) -> None:
        super().__init__()
        self.num_hashes = num_hashes
        self.reduce = nn.Linear(d_model, d_casc, bias=False)
        self.norm = nn.RMSNorm(d_casc, eps=1e-6)
        self.heads = nn.Parameter(torch.empty(num_hashes, num_buckets, d_casc))
        # E_out is a parameter of the decoder itself (not an nn.Embedding read through `.weight`), so
        # ZeRO-3 gathers it with the decoder's own parameters when the decoder runs.
        self.bucket_table = nn.Parameter(torch.empty(num_buckets, d_casc))
        self.mixer = CascadeMixer(d_casc, mixer_hidden)
        init_hash_params(self)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states [..., d_model] -> H tensors of coordinate log-probabilities [..., B].

        A list, not a stacked tensor: training consumes each coordinate as it comes, and stacking H x B
        scores per token costs a full extra copy (measured ~7% of a 100m step on CPU).
        """
        state = self.reduce(hidden)
        coord_logps = []
        for j in range(self.num_hashes):
            logp_j = torch.log_softmax(F.linear(self.norm(state), self.heads[j]).float(), dim=-1)
            coord_logps.append(logp_j)
            if j + 1 < self.num_hashes:
                soft_bucket = logp_j.exp().to(state.dtype) @ self.bucket_table
                state = self.mixer(state, soft_bucket)
        return coord_logps


def signature_loss(
    coord_logps: list[torch.Tensor], target_sigs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss: coordinates`, the paper's: sum over coordinates of the mean B-way cross-entropy, and
    per-coordinate accuracy [H]. Packed rows hold no padding, so no target is ignored."""
    losses = []
    for j, logp_j in enumerate(coord_logps):
        target_j = target_sigs[..., j].reshape(-1)
        losses.append(F.nll_loss(logp_j.reshape(target_j.shape[0], -1), target_j))
    return torch.stack(losses).sum(), coordinate_accuracy(coord_logps, target_sigs)


def vocab_loss(
    coord_logps: list[torch.Tensor], target_sigs: torch.Tensor, vocab_sigs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss: vocab` (the reference's `use_conditional_prob`): the mean exact NLL of the targets over the
    real vocabulary, log sum_w exp(sum_j logp_j(H_j(w))) - sum_j logp_j(target_j), scored in position
    blocks as evaluation is; never a B^H tensor. Returns it and per-coordinate accuracy [H]."""
    num_hashes = len(coord_logps)
    scores = torch.stack(coord_logps, dim=-2).reshape(-1, num_hashes, coord_logps[0].shape[-1])
    targets = target_sigs.reshape(-1, num_hashes)
    nll = vocab_logsumexp(scores, vocab_sigs) - target_scores(scores, targets)
    return nll.mean(), coordinate_accuracy(coord_logps, target_sigs)


@torch.no_grad()
def coordinate_accuracy(coord_logps: list[torch.Tensor], target_sigs: torch.Tensor) -> torch.Tensor:
    """[H]: how often each coordinate's most likely bucket is the target's."""
    return torch.stack(
        [(logp_j.argmax(-1) == target_sigs[..., j]).float().mean() for j, logp_j in enumerate(coord_logps)]
    )


def _score_blocks(coord_scores: torch.Tensor, vocab_sigs: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yields [n, V] blocks of sum_j score_j(H_j(w)) for consecutive blocks of n positions.

    One `embedding_bag` per block: token w sums rows H_j(w) + j*B of the [H*B, n] table of coordinate
    scores (made contiguous: a strided view makes every row read miss the cache, 5x slower). Memory is
    n x V per block; no B^H tensor ever exists.
    """
    num_positions, num_hashes, num_buckets = coord_scores.shape
    offsets = torch.arange(num_hashes, device=vocab_sigs.device) * num_buckets
    bag_indices = vocab_sigs + offsets  # [V, H] rows into the flattened table
    for start in range(0, num_positions, POSITION_BLOCK):
        block = coord_scores[start : start + POSITION_BLOCK]
        table = block.permute(1, 2, 0).reshape(num_hashes * num_buckets, block.shape[0]).contiguous()
        yield F.embedding_bag(bag_indices, table, mode="sum").T


def vocab_logsumexp(coord_scores: torch.Tensor, vocab_sigs: torch.Tensor) -> torch.Tensor:
    """log of the signature-model mass on real tokens, [N]; never builds a B^H tensor."""
    return torch.cat([block.logsumexp(-1) for block in _score_blocks(coord_scores, vocab_sigs)])


def vocab_logprobs(coord_scores: torch.Tensor, vocab_sigs: torch.Tensor) -> torch.Tensor:
    """Exact log p(w) over the real vocabulary, [N, V]: signature scores renormalised over V_actl."""
    return torch.cat(
        [block - block.logsumexp(-1, keepdim=True) for block in _score_blocks(coord_scores, vocab_sigs)]
    )


def vocab_logsumexp_argmax(
    coord_scores: torch.Tensor, vocab_sigs: torch.Tensor, num_ids: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_logsumexp` [N] and the id greedy decoding picks [N]: the best of the first `num_ids` rows
    (the ids; reserved rows only normalise), each block scored once. The argmax is taken after
    normalising, as over `vocab_logprobs`, so that ties break as in `next_token_logprobs`."""
    normalisers, best = [], []
    for block in _score_blocks(coord_scores, vocab_sigs):
        normaliser = block.logsumexp(-1, keepdim=True)
        normalisers.append(normaliser[:, 0])
        best.append((block[:, :num_ids] - normaliser).argmax(-1))
    return torch.cat(normalisers), torch.cat(best)


def target_scores(coord_scores: torch.Tensor, target_sigs: torch.Tensor) -> torch.Tensor:
    """sum_j score_j(target_j) for each position, [N]."""
    return coord_scores.gather(-1, target_sigs.unsqueeze(-1)).squeeze(-1).sum(-1)
