"""Token-by-token decoding for every family, with or without the backbone's cache.

Hash-input models cannot use transformers' `generate(inputs_embeds=...)` (it would feed the unused
token table), so decoding is one loop over `CausalLM.next_token_logprobs`, which every family implements.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mhf_dist.models.base import CausalLM


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}; use 0 for greedy or a positive value")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}; use 0 to disable or a positive count")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}; use a value in (0, 1]")


def choose_next(
    logprobs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick one id per row of log-probabilities [B, V]."""
    if sampling.temperature == 0:
        return logprobs.argmax(-1)
    scores = logprobs / sampling.temperature
    if sampling.top_k:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        mass_before = sorted_scores.softmax(-1).cumsum(-1) - sorted_scores.softmax(-1)
        sorted_scores = sorted_scores.masked_fill(mass_before >= sampling.top_p, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    use_cache: bool = True,
    stop_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Yield new token ids one at a time (for streaming); stops after `max_new_tokens` or a stop id."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token (e.g. BOS)")
    device = next(model.parameters()).device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    sequence = torch.tensor([list(prompt_ids)], device=device)
    cache = model.new_cache() if use_cache else None
    pending = sequence
    for _ in range(max_new_tokens):
        logprobs, cache = model.next_token_logprobs(pending, cache)
        next_id = choose_next(logprobs, sampling, generator)
        yield int(next_id)
        if int(next_id) in stop_ids:
            return
        sequence = torch.cat([sequence, next_id.view(1, 1)], dim=1)
        pending = next_id.view(1, 1) if use_cache else sequence
