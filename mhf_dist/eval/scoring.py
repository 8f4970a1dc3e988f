"""Batched scoring for evaluation: many sequences in one forward pass a batch, the same answers as one
at a time.

A batch's sequences are right-padded to its longest and read without an attention mask. That is
exact because every family is causal (attention, the triple-latent scans, the local convolution and
gated_hybrid's memory of completed pairs all run forward in time): a real position reads only the real
positions before it, which count from 0 as they would alone. Padded positions are never scored. (Left
padding would shift each row's positions and need position ids and a mask.)

Requests are sorted longest first (as lm-eval's Hugging Face model orders them), so a batch pads little;
results come back in the order asked. Sums of log-probabilities accumulate in float64.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from mhf_dist.errors import MhfError
from mhf_dist.models.base import CausalLM, split_rows, usable

PAD_ID = 0  # an id of every vocabulary; no real position reads a padded one


class ScoringError(MhfError):
    """A request that cannot be scored as given."""


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ScoringError(f"batch_size={batch_size}; use a positive number of sequences per forward pass")


def length_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices into `lengths`, longest first (equal lengths keep their order), `batch_size` at a time."""
    check_batch_size(batch_size)
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def right_padded(sequences: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[len(sequences), longest] ids, each row padded after its end with PAD_ID."""
    rows = [torch.as_tensor(ids, dtype=torch.long) for ids in sequences]
    return pad_sequence(rows, batch_first=True, padding_value=PAD_ID).to(device)


def model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@torch.no_grad()
def score_continuations(
    model: CausalLM,
    pairs: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    max_length: int | None = None,
) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding reproduces the continuation) for each
    (context ids, continuation ids) pair. `max_length`: the model reads at most this many ids, the
    context losing its oldest ones, as lm-eval's Hugging Face model truncates."""
    sequences = []
    for context, continuation in pairs:
        if not context:
            raise ScoringError("a context is empty; start it with the model's prefix token (BOS or EOS)")
        ids = [*context, *continuation]
        if max_length is not None:
            ids = ids[-(max_length + 1) :]
        if len(continuation) >= len(ids):
            raise ScoringError(
                f"a continuation of {len(continuation)} ids does not fit max_length={max_length}; "
                "raise max_length"
            )
        sequences.append(ids)
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation: log 1, greedy
    device = model_device(model)
    for batch in length_batches([len(ids) for ids in sequences], batch_size):
        counts = [len(pairs[index][1]) for index in batch]
        if not any(counts):
            continue
        inputs, targets = split_rows(right_padded([sequences[index] for index in batch], device))
        ends = torch.tensor([len(sequences[index]) - 1 for index in batch], device=device)[:, None]
        positions = torch.arange(inputs.shape[1], device=device)
        mask = (positions < ends) & (positions >= ends - torch.tensor(counts, device=device)[:, None])
        logprobs, greedy = model.score_targets(inputs, targets, mask)
        logprobs = usable(logprobs, "log-probabilities").double()
        for index, logprob, hit in zip(batch, logprobs.split(counts), greedy.split(counts), strict=True):
            results[index] = (float(logprob.sum()), bool(hit.all()))
    return results


@torch.no_grad()
def score_rows(
    model: CausalLM, rows: np.ndarray, mask: np.ndarray, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of equal length [n, T+1] read as inputs rows[:, :-1] and targets rows[:, 1:]: the log p
    (float64) and greedy flag of the targets `mask` [n, T] selects, row-major."""
    check_batch_size(batch_size)
    device = model_device(model)
    logprobs, greedy = [], []
    for start in range(0, len(rows), batch_size):
        batch = slice(start, start + batch_size)
        inputs, targets = split_rows(torch.from_numpy(rows[batch]).to(device))
        logprob, hit = model.score_targets(inputs, targets, torch.from_numpy(mask[batch]).to(device))
        logprobs.append(usable(logprob, "log-probabilities").double().cpu().numpy())
        greedy.append(hit.cpu().numpy())
    return np.concatenate(logprobs), np.concatenate(greedy)


@torch.no_grad()
def mean_layer_states(
    model: CausalLM, sequences: Sequence[list[int]], layer: int, batch_size: int, skip: int = 0
) -> list[torch.Tensor]:
    """Each sequence's hidden states at `layer` (as `CausalLM.layer_states` indexes them), averaged over
    its own positions from `skip` on: float32 [d] each, in the order given."""
    device = model_device(model)
    vectors: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for batch in length_batches([len(ids) for ids in sequences], batch_size):
        states = model.layer_states(right_padded([sequences[index] for index in batch], device), layer)
        for row, index in enumerate(batch):
            vectors[index] = states[row, skip : len(sequences[index])].float().mean(dim=0).cpu()
    return vectors
