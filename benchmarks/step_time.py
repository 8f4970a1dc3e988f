"""Training-step time and exact-scoring time of `mhf` vs `qwen3` on the same backbone.

For each vocabulary size: forward + backward + AdamW step on [batch, seq_len] tokens, the two families
measured alternately after a warm-up (so drift in machine load hits both), median over rounds; then
the exact log-probabilities over the real vocabulary for every position (mhf: V_actl renormalised,
chunked) vs the baseline's forward + log_softmax. Prints a table of ratios and writes JSON.

    python benchmarks/step_time.py                      # the issue's protocol: 100m, seq 256, batch 4
    python benchmarks/step_time.py --preset tiny --rounds 2   # a quick smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.models import build_model, param_count
from mhf_dist.models.hash_io import vocab_logprobs
from mhf_dist.signatures import SignatureTable
from mhf_dist.tables import markdown_table
from mhf_dist.train.loop import TorchStepper

TARGETS = {32000: 1.10, 151936: 0.75}
SCORING_TARGET = 1.3
RESULTS = Path(__file__).parent / "results" / "step_time.json"


def full_logprobs(model, inputs: torch.Tensor) -> torch.Tensor:
    """log p(w | prefix) over the whole vocabulary at every position, [N, V]."""
    if hasattr(model, "coord_logprobs"):
        return vocab_logprobs(model.coord_logprobs(inputs).flatten(0, 1), model.vocab_signatures)
    return torch.log_softmax(model.logits(inputs).float().flatten(0, 1), dim=-1)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_vocab(preset: str, vocab_size: int, batch: int, seq_len: int, rounds: int) -> dict:
    cfg = load_config(
        preset, [f"model.vocab_size={vocab_size}", f"train.seq_len={seq_len}", "train.warmup_steps=0"]
    )
    table = SignatureTable.build(
        [f"tok{i}" for i in range(vocab_size)], cfg.model.hash.num_hashes, cfg.model.hash.num_buckets
    )
    rows = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    models, steppers = {}, {}
    for family in ("mhf", "qwen3"):
        torch.manual_seed(0)
        models[family] = build_model(cfg.model.model_copy(update={"family": family}), table)
        steppers[family] = TorchStepper(models[family], cfg.train)
        steppers[family].step({"tokens": rows})  # warm-up: allocator, optimizer state
    step_times = {family: [] for family in models}
    score_times = {family: [] for family in models}
    for _ in range(rounds):
        for family in models:
            step_times[family].append(timed(lambda f=family: steppers[f].step({"tokens": rows})))
        with torch.no_grad():
            for family in models:
                models[family].eval()
                score_times[family].append(timed(lambda f=family: full_logprobs(models[f], rows[:, :-1])))
    step = {family: statistics.median(times) for family, times in step_times.items()}
    score = {family: statistics.median(times) for family, times in score_times.items()}
    return {
        "vocab_size": vocab_size,
        "hash": cfg.model.hash.spec,
        "params_mhf": param_count(cfg.model.model_copy(update={"family": "mhf"})),
        "params_qwen3": param_count(cfg.model.model_copy(update={"family": "qwen3"})),
        "step_s_mhf": step["mhf"],
        "step_s_qwen3": step["qwen3"],
        "step_ratio": step["mhf"] / step["qwen3"],
        "step_target": TARGETS.get(vocab_size),
        "score_s_mhf": score["mhf"],
        "score_s_qwen3": score["qwen3"],
        "score_ratio": score["mhf"] / score["qwen3"],
        "score_target": SCORING_TARGET,
        "step_times": step_times,
        "score_times": score_times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    results = []
    for vocab_size in args.vocab_sizes:
        print(
            f"measuring V={vocab_size} ({args.preset}, batch {args.batch}, seq {args.seq_len}) ...",
            flush=True,
        )
        results.append(measure_vocab(args.preset, vocab_size, args.batch, args.seq_len, args.rounds))
    columns = [
        "vocab_size",
        "hash",
        "params_mhf",
        "params_qwen3",
        "step_s_mhf",
        "step_s_qwen3",
        "step_ratio",
        "step_target",
        "score_ratio",
        "score_target",
    ]
    print(markdown_table(results, columns))
    payload = {
        "benchmark": "step_time",
        "preset": args.preset,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "results": results,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
