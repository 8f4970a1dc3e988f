"""Forward + backward time of the triple-latent variants vs a Qwen3 transformer of the same width.

At each sequence length every model runs forward + backward on the same [batch, seq_len] tokens
(`--tokens` per step, so batch = tokens / seq_len); models take turns within a round, so drift in
machine load hits all of them; the median over rounds is reported as a ratio to the transformer,
beside the analytic FLOP ratio (`forward_flops_per_token`, matrix products as torch's flop counter
counts them). Prints a table and writes JSON.

    python benchmarks/triple_throughput.py                    # seq 64, 256, 1024, 4096 on the tiny width
    python benchmarks/triple_throughput.py --seq-lens 64 --rounds 2   # a quick run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.models import build_model, forward_flops_per_token, param_count
from mhf_dist.tables import markdown_table

FAMILIES = (
    "qwen3",
    "triple_latent",
    "triple_slot",
    "triple_hybrid",
    "transformer_plus_triple",
    "gated_hybrid",
)
# (family, seq_len) -> the most time it may take relative to the transformer (issue 8); the paper's
# Python-loop reference measured 32.7x (triple_hybrid) and 106.5x (gated_hybrid) at seq 64.
TARGETS = {("triple_hybrid", 64): 1.5, ("gated_hybrid", 64): 3.0, ("triple_hybrid", 1024): 1.0}
TARGETS[("triple_hybrid", 4096)] = 1.0
PAPER = {("triple_hybrid", 64): 32.7, ("gated_hybrid", 64): 106.5}
RESULTS = Path(__file__).parent / "results" / "triple_throughput.json"


def forward_backward_seconds(model: torch.nn.Module, rows: torch.Tensor) -> float:
    start = time.perf_counter()
    model(rows).loss.backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def measure(config: str, overrides: list[str], seq_len: int, tokens: int, rounds: int) -> list[dict]:
    cfg = load_config(config, overrides)
    batch = max(1, tokens // seq_len)
    rows = torch.randint(
        0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    models = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        models[family] = build_model(cfg.model.model_copy(update={"family": family}))
        forward_backward_seconds(models[family], rows)  # warm-up
    times: dict[str, list[float]] = {family: [] for family in FAMILIES}
    for _ in range(rounds):
        for family, model in models.items():
            times[family].append(forward_backward_seconds(model, rows))
    median = {family: statistics.median(values) for family, values in times.items()}
    flops = {
        family: forward_flops_per_token(cfg.model.model_copy(update={"family": family}), seq_len)
        for family in FAMILIES
    }
    return [
        {
            "seq_len": seq_len,
            "batch": batch,
            "family": family,
            "params": param_count(cfg.model.model_copy(update={"family": family})),
            "fwd_bwd_s": median[family],
            "tokens_per_s": batch * seq_len / median[family],
            "time_ratio": median[family] / median["qwen3"],
            "flop_ratio": flops[family] / flops["qwen3"],
            "target": TARGETS.get((family, seq_len)),
            "met": None
            if (family, seq_len) not in TARGETS
            else median[family] / median["qwen3"] <= TARGETS[(family, seq_len)],
            "paper_ratio": PAPER.get((family, seq_len)),
            "times": times[family],
        }
        for family in FAMILIES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="preset or YAML (the width of every model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch = tokens / seq_len)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    overrides = ["model.vocab_size=259", *args.overrides]  # the byte-level benchmarks' vocabulary

    results = []
    for seq_len in args.seq_lens:
        print(
            f"measuring seq_len {seq_len} ({args.tokens} tokens per step, {args.rounds} rounds) ...",
            flush=True,
        )
        results += measure(args.config, overrides, seq_len, args.tokens, args.rounds)
    columns = [
        "seq_len",
        "batch",
        "family",
        "params",
        "fwd_bwd_s",
        "time_ratio",
        "flop_ratio",
        "target",
        "met",
    ]
    print(markdown_table(results, columns))
    payload = {
        "benchmark": "triple_throughput",
        "config": args.config,
        "overrides": overrides,
        "tokens_per_step": args.tokens,
        "rounds": args.rounds,
        "results": results,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
