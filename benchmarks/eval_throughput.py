"""Batched evaluation scoring: HellaSwag-style log-likelihood requests per second at batch size 1 and
16, for `mhf` and `qwen3` at the 100m preset's shape (random weights, fp32, CPU), in the same run.

Each item is a context of 40-80 random token ids and 4 endings of 10-30 ids, so 4 requests (one per
ending, as lm-eval sends them). Requests go through `mhf_dist.eval.scoring.score_continuations`, which
sorts them longest first and right-pads each batch. The baseline is batch size 1 of the same code in
the same run; beside it stands the path evaluation took before batching (each request alone, its
continuation token by token through the KV cache), on fewer items. `max_abs_diff` is the largest
|log-likelihood at batch 16 - at batch 1| over all requests (target <= 1e-4); the speed target is
batch 16 >= 4x the requests/s of batch 1. Each setting is timed `--rounds` times in turn (so drifts in
machine load hit all), the best kept.

    python benchmarks/eval_throughput.py [--items 16] [--token-by-token-items 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.eval.scoring import score_continuations
from mhf_dist.models import build_model
from mhf_dist.signatures import build_for_config
from mhf_dist.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "eval_throughput.json"
PRESET, FAMILIES, BATCH_SIZES = "100m", ("mhf", "qwen3"), (1, 16)
CONTEXT_TOKENS, ENDING_TOKENS, ENDINGS = (40, 80), (10, 30), 4
SPEED_TARGET, DIFF_TARGET = 4.0, 1e-4
COLUMNS = ["family", "path", "batch_size", "requests", "requests_per_s", "vs_batch_1", "vs_token_by_token",
           "max_abs_diff"]  # fmt: skip


def hellaswag_requests(items: int, vocab_size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(context, ending) id pairs, ENDINGS per item, the item's endings sharing its context."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(items):
        context = rng.integers(0, vocab_size, rng.integers(*CONTEXT_TOKENS, endpoint=True)).tolist()
        for _ in range(ENDINGS):
            ending = rng.integers(0, vocab_size, rng.integers(*ENDING_TOKENS, endpoint=True)).tolist()
            pairs.append((context, ending))
    return pairs


@torch.no_grad()
def token_by_token(model, context: list[int], continuation: list[int]) -> float:
    """The scoring `mhf eval` did before batching: one request, its continuation through the KV cache."""
    logprobs, cache = model.next_token_logprobs(torch.tensor([context]), model.new_cache())
    total = 0.0
    for index, token in enumerate(continuation):
        if index:
            logprobs, cache = model.next_token_logprobs(torch.tensor([[continuation[index - 1]]]), cache)
        total += float(logprobs[0, token])
    return total


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_family(family: str, pairs, old_pairs, rounds: int) -> list[dict]:
    cfg = load_config(PRESET, [f"model.family={family}"])
    vocab_size = cfg.model.vocab_size
    torch.manual_seed(0)
    table = build_for_config(cfg.model.hash, [f"tok{i}" for i in range(vocab_size)])
    model = build_model(cfg.model, table).float().eval()
    score_continuations(model, pairs[:ENDINGS], max(BATCH_SIZES))  # warm-up: allocator, kernels
    seconds = {size: float("inf") for size in BATCH_SIZES} | {"token_by_token": float("inf")}
    scores = {}
    for _ in range(rounds):
        for size in BATCH_SIZES:
            elapsed, scores[size] = timed(lambda s=size: score_continuations(model, pairs, s))
            seconds[size] = min(seconds[size], elapsed)
        elapsed, _ = timed(lambda: [token_by_token(model, *pair) for pair in old_pairs])
        seconds["token_by_token"] = min(seconds["token_by_token"], elapsed)
    baseline = len(pairs) / seconds[1]
    max_diff = max(abs(a - b) for (a, _), (b, _) in zip(scores[max(BATCH_SIZES)], scores[1], strict=True))

    def result(path: str, size: int, requests: int, elapsed: float) -> dict:
        return {"family": family, "path": path, "batch_size": size, "requests": requests,
                "requests_per_s": requests / elapsed}  # fmt: skip

    rows = [result("token by token (before)", 1, len(old_pairs), seconds["token_by_token"])]
    rows += [result("score_continuations", size, len(pairs), seconds[size]) for size in BATCH_SIZES]
    for row in rows:
        row["vs_batch_1"] = row["requests_per_s"] / baseline
        row["vs_token_by_token"] = row["requests_per_s"] / rows[0]["requests_per_s"]
    rows[-1]["max_abs_diff"] = max_diff
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=16, help=f"items of {ENDINGS} requests each")
    parser.add_argument(
        "--token-by-token-items", type=int, default=2, help="items scored the way before batching"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    vocab_size = load_config(PRESET).model.vocab_size
    pairs = hellaswag_requests(args.items, vocab_size, args.seed)
    old_pairs = pairs[: args.token_by_token_items * ENDINGS]
    rows = [row for family in FAMILIES for row in measure_family(family, pairs, old_pairs, args.rounds)]
    print(markdown_table(rows, COLUMNS))
    batched = {row["family"]: row for row in rows if row["batch_size"] == max(BATCH_SIZES)}
    met = all(
        row["vs_batch_1"] >= SPEED_TARGET and row["max_abs_diff"] <= DIFF_TARGET for row in batched.values()
    )
    print(f"target: batch {max(BATCH_SIZES)} >= {SPEED_TARGET}x batch 1, max_abs_diff <= {DIFF_TARGET}: "
          f"{'met' if met else 'not met'}")  # fmt: skip
    write_results(
        args.out,
        {
            "benchmark": "eval_throughput",
            "preset": PRESET,
            "dtype": "float32",
            "device": "cpu",
            "items": args.items,
            "context_tokens": CONTEXT_TOKENS,
            "ending_tokens": ENDING_TOKENS,
            "endings": ENDINGS,
            "rounds": args.rounds,
            "rows": rows,
            "speed_target": SPEED_TARGET,
            "diff_target": DIFF_TARGET,
            "target_met": met,
        },
    )


if __name__ == "__main__":
    main()
