"""Training-step time and peak memory of {qwen3, triple_hybrid} x {standard embedding + head, hash I/O}.

All four models have the same width and layers; hash I/O is `mhf` with `model.backbone.kind` set to the
stack. For each vocabulary size and sequence length every model runs forward + backward + AdamW on the
same number of tokens per step (`--tokens`, so batch = tokens / seq_len), each in its own child process
so that its peak resident memory (ru_maxrss above the child's own after imports: weights, optimizer
state, activations) is its alone. Step time is the median over `--rounds` steps after a warm-up step.
Ratios are against the standard qwen3 model at the same V and length, and hash I/O against the same
backbone with a standard head. Prints a table and writes JSON.

    python benchmarks/hash_backbones.py                       # V 32000/151936 x seq 256/2048
    python benchmarks/hash_backbones.py --vocab-sizes 32000 --seq-lens 256 --rounds 1   # a quick run
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.models import build_model, param_count
from mhf_dist.signatures import build_for_config
from mhf_dist.tables import markdown_table
from mhf_dist.train.loop import TorchStepper

RESULTS = Path(__file__).parent / "results" / "hash_backbones.json"
# model name -> its config overrides; the stack is the same for a backbone with either I/O.
MODELS = {
    "qwen3": ["model.family=qwen3"],
    "qwen3+hash": ["model.family=mhf", "model.backbone.kind=qwen3"],
    "triple_hybrid": ["model.family=triple_hybrid"],
    "triple_hybrid+hash": ["model.family=mhf", "model.backbone.kind=triple_hybrid"],
}
# A small model of one width for every run (d=256, 4 layers) with the paper's H4B16K signatures, through
# the compact hash I/O these results were measured with.
SHAPE = [
    "model.backbone.hidden_size=256",
    "model.backbone.num_layers=4",
    "model.backbone.num_heads=4",
    "model.backbone.num_kv_heads=2",
    "model.backbone.head_dim=64",
    "model.backbone.intermediate_size=768",
    "model.hash.spec=H4B16K",
    "model.hash.io=compact",
    "model.hash.d_hash=256",
    "model.hash.gate_hidden=64",
    "model.hash.d_casc=64",
    "model.hash.mixer_hidden=64",
    "model.triple.num_heads=4",
    "model.triple.state_dim=64",
    "train.warmup_steps=0",
]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(
    model_name: str, vocab_size: int, seq_len: int, tokens: int, rounds: int, extra: list[str]
) -> dict:
    """One model in this process: step times and the peak memory the model and its steps added."""
    before = peak_rss_bytes()
    cfg = load_config("tiny", [*SHAPE, *extra, *MODELS[model_name], f"model.vocab_size={vocab_size}"])
    table = None
    if cfg.model.family == "mhf":
        table = build_for_config(cfg.model.hash, [f"tok{i}" for i in range(vocab_size)])
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    stepper = TorchStepper(model, cfg.train)
    batch = max(1, tokens // seq_len)
    rows = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    stepper.step({"tokens": rows})  # warm-up: allocator, optimizer state
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        stepper.step({"tokens": rows})
        times.append(time.perf_counter() - start)
    return {
        "model": model_name,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "batch": batch,
        "params": param_count(cfg.model),
        "step_s": statistics.median(times),
        "step_times": times,
        "peak_gb": (peak_rss_bytes() - before) / 2**30,
    }


def measure_in_child(model_name: str, vocab_size: int, seq_len: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", model_name, str(vocab_size), str(seq_len)]
    command += ["--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    command += [arg for override in args.overrides for arg in ("--set", override)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{model_name} V={vocab_size} seq={seq_len} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def with_ratios(results: list[dict]) -> list[dict]:
    """Each row's step time and peak memory relative to qwen3 and to its own backbone's standard head."""
    by_key = {(row["model"], row["vocab_size"], row["seq_len"]): row for row in results}
    for row in results:
        qwen3 = by_key[("qwen3", row["vocab_size"], row["seq_len"])]
        standard = by_key[(row["model"].removesuffix("+hash"), row["vocab_size"], row["seq_len"])]
        row["step_vs_qwen3"] = row["step_s"] / qwen3["step_s"]
        row["mem_vs_qwen3"] = row["peak_gb"] / qwen3["peak_gb"]
        row["step_vs_standard_io"] = row["step_s"] / standard["step_s"]
        row["mem_vs_standard_io"] = row["peak_gb"] / standard["peak_gb"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch = tokens / seq_len)")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per model after one warm-up")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "V", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        name, vocab, seq = args.child
        print(json.dumps(measure(name, int(vocab), int(seq), args.tokens, args.rounds, args.overrides)))
        return

    results = []
    for vocab_size in args.vocab_sizes:
        for seq_len in args.seq_lens:
            for model_name in MODELS:
                print(f"measuring {model_name} V={vocab_size} seq={seq_len} ...", flush=True)
                results.append(measure_in_child(model_name, vocab_size, seq_len, args))
    columns = ["model", "vocab_size", "seq_len", "params", "step_s", "peak_gb"]
    columns += ["step_vs_qwen3", "mem_vs_qwen3", "step_vs_standard_io", "mem_vs_standard_io"]
    print(markdown_table(with_ratios(results), columns))
    payload = {
        "benchmark": "hash_backbones",
        "shape": SHAPE + args.overrides,
        "tokens_per_step": args.tokens,
        "rounds": args.rounds,
        "results": results,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
