"""One-shot check of the 1B-scale training path on one GPU: bf16 DeepSpeed steps, memory against
`mhf plan`, activation checkpointing, compile, exact scoring, KV-cache generation, triple_hybrid.

Every training number comes from the code `mhf train` runs on each worker: the registry's model,
`checkpoint_layers` / `Module.compile` as the config asks, and a `DeepSpeedStepper` (ZeRO-0, one
process). For `mhf` (reference I/O) and `qwen3` on the 1b preset at seq 2048 and the largest micro-batch
that `mhf plan` finds to fit this GPU: median step time, tokens/s and MFU (analytic training FLOPs against
the GPU's bf16 peak), peak memory beside the plan's estimate; each without and with activation
checkpointing, and compiled with it. Then exact-NLL scoring and KV-cache generation tokens/s of each
trained model, and triple_hybrid against qwen3 forward + backward (bf16 autocast) at T = 1024 and 4096 on
the 100m width. On one H200 the whole run takes about 6 minutes.

    python benchmarks/gpu_check.py                 # on a GPU machine, once; writes results/gpu_check.json
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check.json   # the tiny preset on CPU, fp32
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import write_results

from mhf_dist.config import Config, load_config
from mhf_dist.eval.perplexity import nll_totals
from mhf_dist.models import build_model, param_count, train_flops_per_token
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.models.generation import generate
from mhf_dist.plan import Cluster, activation_bytes, model_state_bytes, plan
from mhf_dist.signatures import build_for_config
from mhf_dist.tables import markdown_table
from mhf_dist.train.engine import DeepSpeedStepper
from mhf_dist.train.hardware import default_peak_flops

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"
GIB = 2**30


def one_process_group(device: torch.device) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def reset_peak(device: torch.device) -> None:
    gc.collect()  # the previous setting's engine and optimizer states
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_steps(cfg: Config, family: str, settings: dict, micro: int, args, device) -> tuple[dict, object]:
    """bf16 (GPU) or fp32 (smoke) steps of one setting; returns its row and the trained module."""
    model_cfg = cfg.model.model_copy(update={"family": family})
    table = build_for_config(model_cfg.hash, [f"t{i}" for i in range(model_cfg.vocab_size)])
    torch.manual_seed(0)
    model = build_model(model_cfg, table).to(device)
    if settings["checkpointing"]:
        checkpoint_layers(model)
    if settings["compile"]:
        model.compile()
    train_cfg = cfg.train.model_copy(
        update={"batch_size": micro, "micro_batch_size": micro, "warmup_steps": 1}
    )
    reset_peak(device)
    stepper = DeepSpeedStepper(model, train_cfg, 0, 1, device.type == "cuda", model_cfg.backbone.hidden_size)
    rows = torch.randint(
        0, model_cfg.vocab_size, (micro, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = {"tokens": rows.to(device)}
    times = []
    for step in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        stepper.step(batch)
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = micro * cfg.train.seq_len / step_s
    flops = train_flops_per_token(model_cfg, cfg.train.seq_len) * tokens_per_s
    peak_flops = default_peak_flops(device)
    estimate = model_state_bytes(param_count(model_cfg), 0, 0, Cluster(1, 1, 1, 1)) + activation_bytes(
        model_cfg, cfg.train.seq_len, micro, checkpointing=settings["checkpointing"]
    )
    row = {
        "family": family,
        "setting": settings["name"],
        "micro_batch": micro,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": flops / peak_flops if peak_flops else None,
        "peak_gb": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        "plan_gb": estimate / GIB,
    }
    return row, stepper.engine.module


def serving_rates(family: str, module, cfg: Config, micro: int, device) -> dict:
    """Exact-NLL scoring tokens/s over micro rows, and KV-cache generation tokens/s (one sequence)."""
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (micro, cfg.train.seq_len + 1))
    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        _, scored = nll_totals(module, rows, batch_size=micro, device=device)
        synchronize(device)
        scoring = scored / (time.perf_counter() - start)
        module.eval()
        start = time.perf_counter()
        generated = len(list(generate(module, list(range(1, 17)), max_new_tokens=64)))
        synchronize(device)
        generation = generated / (time.perf_counter() - start)
    return {"family": family, "exact_scoring_tok_s": scoring, "generation_tok_s": generation}


def triple_rows(preset: str, seq_lens: list[int], device, dtype) -> list[dict]:
    """triple_hybrid vs qwen3 forward + backward, one sequence, median of 3 after a warm-up."""
    cfg = load_config(preset)
    rows = []
    for seq_len in seq_lens:
        tokens = torch.randint(0, cfg.model.vocab_size, (1, seq_len + 1), device=device)
        seconds = {}
        for family in ("qwen3", "triple_hybrid"):
            torch.manual_seed(0)
            model = build_model(cfg.model.model_copy(update={"family": family})).to(device)
            times = []
            for _ in range(4):
                synchronize(device)
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = model(tokens).loss
                loss.backward()
                synchronize(device)
                times.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            seconds[family] = statistics.median(times[1:])
            del model
        rows.append(
            {
                "seq_len": seq_len,
                "qwen3_s": seconds["qwen3"],
                "triple_hybrid_s": seconds["triple_hybrid"],
                "ratio": seconds["triple_hybrid"] / seconds["qwen3"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on CPU (a test runs this)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="skip the compiled settings"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; run on a GPU machine, or pass --smoke for the CPU check")
    preset, triple_preset, triple_lens = (
        ("tiny", "tiny", [64, 128]) if args.smoke else ("1b", "100m", [1024, 4096])
    )
    cfg = load_config(preset)
    one_process_group(device)
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else 1.0
    settings = [
        {"name": "bf16" if device.type == "cuda" else "fp32", "checkpointing": False, "compile": False},
        {"name": "+ activation checkpointing", "checkpointing": True, "compile": False},
    ]
    if args.compile:
        settings.append({"name": "+ checkpointing + compile", "checkpointing": True, "compile": True})
    training, serving = [], []
    started = time.perf_counter()
    for family in ("mhf", "qwen3"):
        for setting in settings:
            checkpointing = "layers" if setting["checkpointing"] else "none"
            recommended = {"activation_checkpointing": checkpointing, "micro_batch_size": None}
            setting_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update=recommended)})
            # the largest micro-batch that fits this GPU's memory (the peak only sets plan's days)
            micro = plan(
                setting_cfg, family, cfg.model.vocab_size, Cluster(1, 1, gpu_gb), 1e9, 0.4
            ).micro_batch
            micro = min(micro, 2) if args.smoke else micro  # the smoke run: seconds of CPU
            row, module = training_steps(cfg, family, setting, micro, args, device)
            training.append(row)
            print(
                f"{family}, {setting['name']}: {row['step_s']} s/step, {row['tokens_per_s']:,} tokens/s",
                flush=True,
            )
        serving.append(serving_rates(family, module, cfg, micro, device))
        del module
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    triple = triple_rows(triple_preset, triple_lens, device, dtype)
    print(markdown_table(training, list(training[0])))
    print(markdown_table(serving, list(serving[0])))
    print(markdown_table(triple, list(triple[0])))
    write_results(
        args.out,
        {
            "benchmark": "gpu_check",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
            "preset": preset,
            "seq_len": cfg.train.seq_len,
            "training": training,
            "serving": serving,
            "triple_vs_qwen3": triple,
            "seconds": round(time.perf_counter() - started, 1),
        },
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
