"""Training-step time and exact-scoring time of `mhf`'s hash I/O variants vs `qwen3` on the same backbone.

Variants: the reference I/O under both objectives (`mhf`: coordinates, the paper's; `mhf-vocab`: the
exact V likelihood) and the compact I/O (`mhf-compact`, the widths the 100m preset had before the
reference layout). For each vocabulary size: forward + backward + AdamW step on [batch, seq_len] tokens,
every model measured in turn after a warm-up (so drift in machine load hits all), median over rounds;
then the exact log-probabilities over the real vocabulary for every position (mhf: V_actl
renormalised, chunked) vs the baseline's forward + log_softmax. Beside each measured step ratio stands
the analytic ratio of training FLOPs (matrix products only); measured / analytic near 1 means the
variant costs what its arithmetic says. Prints a table of ratios and writes JSON.

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
from mhf_dist.models import build_model, param_count, train_flops_per_token
from mhf_dist.models.hash_io import vocab_logprobs
from mhf_dist.signatures import build_for_config
from mhf_dist.tables import markdown_table
from mhf_dist.train.loop import TorchStepper

TARGETS = {32000: 1.10, 151936: 0.75}
SCORING_TARGET = 1.3
FLOP_TARGET = 1.1  # measured / analytic step ratio
# name -> overrides of the preset; `qwen3` is the baseline every ratio divides by.
VARIANTS = {
    "qwen3": ["model.family=qwen3"],
    "mhf": ["model.hash.io=reference", "model.hash.loss=coordinates"],
    "mhf-vocab": ["model.hash.io=reference", "model.hash.loss=vocab"],
    "mhf-compact": [
        "model.hash.io=compact",
        "model.hash.d_hash=256",
        "model.hash.d_casc=128",
        "model.hash.mixer_hidden=128",
    ],
}
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


def measure_vocab(preset: str, vocab_size: int, batch: int, seq_len: int, rounds: int) -> list[dict]:
    shared = [f"model.vocab_size={vocab_size}", f"train.seq_len={seq_len}", "train.warmup_steps=0"]
    configs = {name: load_config(preset, [*shared, *overrides]) for name, overrides in VARIANTS.items()}
    tokens = [f"tok{i}" for i in range(vocab_size)]
    rows = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    models, steppers = {}, {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        models[name] = build_model(cfg.model, build_for_config(cfg.model.hash, tokens))
        steppers[name] = TorchStepper(models[name], cfg.train)
        steppers[name].step({"tokens": rows})  # warm-up: allocator, optimizer state
    step_times = {name: [] for name in models}
    score_times = {name: [] for name in models}
    for _ in range(rounds):
        for name in models:
            models[name].train()
            step_times[name].append(timed(lambda n=name: steppers[n].step({"tokens": rows})))
        with torch.no_grad():
            for name in models:
                models[name].eval()
                score_times[name].append(timed(lambda n=name: full_logprobs(models[n], rows[:, :-1])))
    step = {name: statistics.median(times) for name, times in step_times.items()}
    score = {name: statistics.median(times) for name, times in score_times.items()}
    base_flops = train_flops_per_token(configs["qwen3"].model, seq_len)
    results = []
    for name, cfg in configs.items():
        if name == "qwen3":
            continue
        analytic = train_flops_per_token(cfg.model, seq_len) / base_flops
        measured = step[name] / step["qwen3"]
        results.append(
            {
                "vocab_size": vocab_size,
                "variant": name,
                "hash": cfg.model.hash.spec,
                "params_mhf": param_count(cfg.model),
                "params_qwen3": param_count(configs["qwen3"].model),
                "step_s_mhf": step[name],
                "step_s_qwen3": step["qwen3"],
                "step_ratio": measured,
                "flop_ratio": analytic,
                "measured_over_analytic": measured / analytic,
                "step_target": TARGETS.get(vocab_size),
                "score_s_mhf": score[name],
                "score_s_qwen3": score["qwen3"],
                "score_ratio": score[name] / score["qwen3"],
                "score_target": SCORING_TARGET,
                "step_times": {name: step_times[name], "qwen3": step_times["qwen3"]},
                "score_times": {name: score_times[name], "qwen3": score_times["qwen3"]},
            }
        )
    return results


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
        results += measure_vocab(args.preset, vocab_size, args.batch, args.seq_len, args.rounds)
    columns = [
        "vocab_size",
        "variant",
        "hash",
        "params_mhf",
        "params_qwen3",
        "step_s_mhf",
        "step_s_qwen3",
        "step_ratio",
        "flop_ratio",
        "measured_over_analytic",
        "score_ratio",
    ]
    print(markdown_table(results, columns))
    payload = {
        "benchmark": "step_time",
        "preset": args.preset,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "targets": {
            "step_ratio": TARGETS,
            "score_ratio": SCORING_TARGET,
            "measured_over_analytic": FLOP_TARGET,
        },
        "results": results,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
