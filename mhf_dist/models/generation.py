"""Token-by-token decoding for every family, with or without the backbone's cache, one prompt or many.

Hash-input models cannot use transformers' `generate(inputs_embeds=...)` (it would feed the unused
token table), so decoding is one loop over `CausalLM.next_token_logprobs`, which every family implements:
`stream_batch`, which `generate` (one prompt, streamed) and `generate_batch` (many) both run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from mhf_dist.models.base import CausalLM, usable


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
    # From the row's best, so a tiny temperature sends the rest to -inf, never the best to +inf (nan).
    scores = (logprobs - logprobs.amax(-1, keepdim=True)) / sampling.temperature
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
def stream_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    should_stop: Callable[[int, list[int]], bool] | None = None,
    use_cache: bool = True,
) -> Iterator[dict[int, int]]:
    """Decode prompts of different lengths together; yield per step {row: new id} of the rows that chose one.

    Aligned ragged decode, which needs no padding or attention mask and so suits a KV cache and a
    recurrent state alike: every row is prefilled with the shortest prompt's length of its own tokens,
    then all rows advance one position per step, a row still inside its prompt fed its next prompt
    token (its prediction unused), a row past it fed its last new id. All rows share one cache length
    and read natural positions. A row stops after a stop id, `max_new_tokens` ids, or when
    `should_stop(row, its new ids)` is true; stopped rows are still fed, their choices unused.
    """
    if any(not prompt for prompt in prompts):
        raise ValueError("a prompt is empty; give at least one token (e.g. BOS)")
    device = next(model.parameters()).device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    rows = [list(prompt) for prompt in prompts]  # each prompt, then its new ids
    new_ids: list[list[int]] = [[] for _ in prompts]
    running = set(range(len(prompts))) if max_new_tokens > 0 else set()
    fed = min(map(len, rows), default=0)
    cache = model.new_cache() if use_cache else None
    pending = torch.tensor([row[:fed] for row in rows], device=device)
    while running:
        logprobs, cache = model.next_token_logprobs(pending, cache)
        chosen = choose_next(usable(logprobs, "next-token log-probabilities"), sampling, generator).tolist()
        step = {}
        for row, prompt in enumerate(prompts):
            if fed < len(prompt):
                continue
            rows[row].append(chosen[row])
            if row in running:
                step[row] = chosen[row]
                new_ids[row].append(chosen[row])
                if (
                    chosen[row] in stop_ids
                    or len(new_ids[row]) == max_new_tokens
                    or (should_stop is not None and should_stop(row, new_ids[row]))
                ):
                    running.discard(row)
        if step:
            yield step
        fed += 1
        columns = [row[fed - 1 : fed] for row in rows] if use_cache else [row[:fed] for row in rows]
        pending = torch.tensor(columns, device=device)


def generate_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    should_stop: Callable[[int, list[int]], bool] | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Each prompt's new ids, decoded together by `stream_batch` (a stop id ends its row's ids)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in stream_batch(model, prompts, max_new_tokens, sampling, stop_ids, should_stop, use_cache):
        for row, next_id in step.items():
            outputs[row].append(next_id)
    return outputs


def generate(
    model: CausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    use_cache: bool = True,
    stop_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Yield new token ids one at a time (for streaming); stops after `max_new_tokens` or a stop id."""
    for step in stream_batch(model, [prompt_ids], max_new_tokens, sampling, stop_ids, use_cache=use_cache):
        yield step[0]
