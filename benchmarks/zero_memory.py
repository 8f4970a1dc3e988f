"""Per-worker memory and step time of DeepSpeed ZeRO stages 0-3 under `mhf train` (2 workers).

Each stage is one real `mhf train` run (Ray Train, DeepSpeed, checkpoints) of a few steps on the same
prepared shards, in bf16 by default (`train.precision`; DeepSpeed's CPU accelerator runs bf16 too), so
the states are what a GPU user gets: bf16 weights and gradients, fp32 master weights, gradients and
Adam moments. Per worker, the largest over the workers:
- model_state_gb: live tensor bytes after the first step (parameters or their shards, gradients,
  optimizer states, DeepSpeed's buffers; activations are freed by then), beside DeepSpeed's own
  estimator for the same model and stage (`mhf plan`'s accounting),
- param_share: the share of the parameters the rank holds (about 1/W under ZeRO-3),
- peak_mem_gb: peak resident set size (CPU) or peak CUDA allocation (GPU), which also counts the
  whole model every rank builds before DeepSpeed partitions it, the libraries and the activations.
Step time is the median after the first step. Ratios are against stage 0 measured in the same run.

    python benchmarks/zero_memory.py                        # the issue's protocol: 100m, 2 CPU workers
    python benchmarks/zero_memory.py --preset tiny --steps 3   # a quick smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import write_results

from mhf_dist.config import Config, load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.models import param_count
from mhf_dist.plan import Cluster, largest_layer_params, model_state_bytes
from mhf_dist.tables import markdown_table
from mhf_dist.train.checkpoints import read_history
from mhf_dist.train.ray_trainer import TrainOptions, train

TARGET_STAGE3_MODEL_STATE = 0.6
RESULTS = Path(__file__).parent / "results" / "zero_memory.json"


def estimate_gb(params: int, largest: int, stage: int, workers: int) -> float:
    """DeepSpeed's estimator for the same model (bf16 weights and grads, fp32 master and Adam), as
    `mhf plan` calls it: one node of `workers` devices."""
    return model_state_bytes(params, largest, stage, Cluster(workers, 1, 1.0)) / 2**30


def measure_stage(cfg, stage: int, workers: int, gpus: int, workdir: Path) -> dict:
    topology = {"workers": workers, "gpus_per_worker": gpus, "zero_stage": stage, "storage": str(workdir)}
    run_cfg = Config.model_validate({**cfg.model_dump(), "topology": topology})
    history = read_history(train(run_cfg, TrainOptions(name=f"zero{stage}")).checkpoint)
    timed = history[1:] or history
    step_s = statistics.median(h["step_time"] for h in timed)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    return {
        "zero_stage": stage,
        "model_state_gb": history[0]["model_state_gb"],
        "param_share": history[0]["param_share"],
        "peak_mem_gb": history[-1]["peak_mem_gb"],
        "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_worker": tokens_per_step / step_s / workers,
        "final_loss": history[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--family", default="mhf")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="global batch (rows)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="zero-memory-") as tmp:
        workdir = Path(tmp)
        overrides = [
            f"model.family={args.family}",
            "data.tokenizer=bytes",  # the shards need no BPE training; mhf's size does not depend on V
            "model.vocab_size=259",
            f"data.path={workdir / 'data'}",
            f"train.steps={args.steps}",
            f"train.seq_len={args.seq_len}",
            f"train.batch_size={args.batch}",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_rows=2",
            f"train.precision={args.precision}",
        ]
        cfg = load_config(args.preset, overrides)
        prepare(cfg, cfg.data.path, log=lambda _: None)
        print(f"{args.preset} {args.family}: {param_count(cfg.model):,} parameters", flush=True)
        results = [
            measure_stage(cfg, stage, args.workers, args.gpus_per_worker, workdir) for stage in args.stages
        ]
    params, largest = param_count(cfg.model), largest_layer_params(cfg.model)
    base = next(r for r in results if r["zero_stage"] == args.stages[0])
    for row in results:
        row["estimate_gb"] = estimate_gb(params, largest, row["zero_stage"], args.workers)
        row["measured_vs_estimate"] = row["model_state_gb"] / row["estimate_gb"]
        row["model_state_vs_first"] = row["model_state_gb"] / base["model_state_gb"]
        row["peak_vs_first"] = row["peak_mem_gb"] / base["peak_mem_gb"]
        row["step_vs_first"] = row["step_s"] / base["step_s"]
    columns = [
        "zero_stage",
        "model_state_gb",
        "model_state_vs_first",
        "estimate_gb",
        "measured_vs_estimate",
        "param_share",
        "peak_mem_gb",
        "peak_vs_first",
        "step_s",
        "step_vs_first",
        "tokens_per_s",
        "tokens_per_s_per_worker",
    ]
    print(markdown_table(results, columns))
    stage3 = next((r for r in results if r["zero_stage"] == 3), None)
    if stage3 is not None and base["zero_stage"] == 0:
        met = stage3["model_state_vs_first"] <= TARGET_STAGE3_MODEL_STATE
        print(
            f"stage-3 model-state memory: {stage3['model_state_vs_first']:.2f}x stage 0 "
            f"(target <= {TARGET_STAGE3_MODEL_STATE}x: {'met' if met else 'missed'})"
        )
    write_results(
        args.out,
        {
            "benchmark": "zero_memory",
            "preset": args.preset,
            "family": args.family,
            "params": params,
            "precision": args.precision,
            "workers": args.workers,
            "gpus_per_worker": args.gpus_per_worker,
            "steps": args.steps,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "target_stage3_model_state": TARGET_STAGE3_MODEL_STATE,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
