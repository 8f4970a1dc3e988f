"""What every model family offers the trainer, the evaluator and the sampler.

A batch row holds seq_len + 1 token ids: the model reads the first seq_len and predicts the last
seq_len. Families differ in how they score a next token; they agree on this interface, so training,
exact evaluation and generation are written once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.errors import ModelOutputError

# Logits that exist at once while scoring (elements of a [rows, V] block): at V = 151,936 a block is
# 883 positions, 512 MiB in float32, however many positions a batch scores.
SCORED_LOGITS_PER_BLOCK = 2**27


def usable(values: torch.Tensor, what: str) -> torch.Tensor:
    """`values` (log-probabilities, scores) as they are when none is nan or +inf; -inf is a probability
    of 0. A diverged or damaged model gives nan, and whatever is built on it (an argmax, a sample, a
    score) would be silently wrong."""
    if torch.isnan(values).any() or torch.isposinf(values).any():
        raise ModelOutputError(
            f"the model's {what} hold nan or inf (a diverged or damaged checkpoint); use a model whose "
            "training loss stayed finite"
        )
    return values


@dataclass
class LMOutput:
    """Training-path result: the loss to minimise and detached metrics to log."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class CausalLM(nn.Module):
    """Base class of the families. Subclasses implement the methods below."""

    vocab_size: int

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        """Training loss on rows of seq_len+1 ids; `signatures` are precomputed [B, T+1, H] (mhf only)."""
        raise NotImplementedError

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Exact negative log-likelihood (nats) of each target given its prefix, [B, T]."""
        raise NotImplementedError

    def score_targets(
        self, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact log p of the targets [B, T] at the positions `mask` [B, T] selects, given their prefixes,
        and whether each is the most likely next id (what greedy decoding picks): ([N], [N] bool) for
        the N selected positions in row-major order, from one forward pass over `inputs` [B, T]."""
        raise NotImplementedError

    def next_token_logprobs(self, new_ids: torch.Tensor, cache: Any | None) -> tuple[torch.Tensor, Any]:
        """Feed `new_ids` [B, t] after whatever `cache` holds; log p over the vocabulary at the last position.

        `cache=None` starts from an empty context and uses no cache at all: the caller passes the whole
        sequence every step. `self.new_cache()` starts an incremental decode.
        """
        raise NotImplementedError

    def new_cache(self) -> Any:
        raise NotImplementedError

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        """Hidden states [B, T, d] of the backbone at `layer`, indexed like transformers'
        `hidden_states` (0 = the input embeddings, -2 = the output of the penultimate layer)."""
        raise NotImplementedError


class LogitsLM(CausalLM):
    """A family with a V-way output layer: loss, exact NLL and next-token scores all follow from `logits`."""

    def logits(self, inputs: torch.Tensor, cache: Any | None = None) -> torch.Tensor:
        """[B, T, V] next-token logits of `inputs` read after `cache` (updated in place; None: no cache)."""
        raise NotImplementedError

    def scored_logit_blocks(self, inputs: torch.Tensor, mask: torch.Tensor) -> Iterator[torch.Tensor]:
        """[n, V] next-token logits of the positions `mask` [B, T] selects, row-major, in blocks of
        consecutive positions. Here one block sliced from `logits`; a `HeadLM` computes no other."""
        yield self.logits(inputs)[mask]

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        inputs, targets = split_rows(tokens)
        logits = self.logits(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == targets).float().mean()
        return LMOutput(loss, {"loss": loss.item(), "token_acc": accuracy.item()})

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logprobs, _ = self.score_targets(inputs, targets, torch.ones_like(targets, dtype=torch.bool))
        return -logprobs.view_as(targets)

    def score_targets(
        self, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = targets[mask]
        logprobs, greedy, start = [], [], 0
        for logits in self.scored_logit_blocks(inputs, mask):
            block_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
            block_targets = chosen[start : start + len(block_logprobs)]
            start += len(block_logprobs)
            logprobs.append(block_logprobs.gather(-1, block_targets[:, None])[:, 0])
            greedy.append(block_logprobs.argmax(-1) == block_targets)
        return torch.cat(logprobs), torch.cat(greedy)

    def next_token_logprobs(self, new_ids: torch.Tensor, cache: Any | None) -> tuple[torch.Tensor, Any]:
        logits = self.logits(new_ids, cache)[:, -1].float()
        return torch.log_softmax(logits, dim=-1), cache


class HeadLM(LogitsLM):
    """A `LogitsLM` whose output layer reads each position's final states alone: scoring applies it
    only at the scored positions, `SCORED_LOGITS_PER_BLOCK` logits at a time, so exact NLL and
    continuation scores never build [B, T, V]."""

    def final_states(self, inputs: torch.Tensor, cache: Any | None = None) -> torch.Tensor:
        """[B, T, ...] what the output layer reads at each position of `inputs` read after `cache`
        (updated in place; None: no cache)."""
        raise NotImplementedError

    def output_layer(self, states: torch.Tensor) -> torch.Tensor:
        """[..., V] logits of final states [..., *the trailing shape of `final_states`]."""
        raise NotImplementedError

    def logits(self, inputs: torch.Tensor, cache: Any | None = None) -> torch.Tensor:
        return self.output_layer(self.final_states(inputs, cache))

    def scored_logit_blocks(self, inputs: torch.Tensor, mask: torch.Tensor) -> Iterator[torch.Tensor]:
        rows = max(1, SCORED_LOGITS_PER_BLOCK // self.vocab_size)
        for states in self.final_states(inputs)[mask].split(rows):
            yield self.output_layer(states)


def split_rows(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of seq_len+1 ids (or signatures, [B, T+1, H]) -> (inputs, targets), each [B, seq_len, ...]."""
    if tokens.dim() < 2 or tokens.shape[1] < 2:
        raise ValueError(f"expected token rows of shape [batch, seq_len + 1], got {tuple(tokens.shape)}")
    return tokens[:, :-1], tokens[:, 1:]
