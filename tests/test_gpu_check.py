"""benchmarks/gpu_check.py --smoke: the one-shot GPU script runs end to end at the tiny size on CPU."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_gpu_check_runs_every_measurement_at_the_tiny_size_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, "gpu_check.py", "--smoke", "--no-compile", "--steps", "2", "--out", str(out)]
    done = subprocess.run(command, cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    settings = [(row["family"], row["setting"]) for row in results["training"]]
    assert settings == [
        (family, setting) for family in ("mhf", "qwen3") for setting in ("fp32", "+ activation checkpointing")
    ]
    for row in results["training"]:
        assert row["plan_gb"] > 0 and row["mfu"] is None  # no peak FLOP/s for a CPU
    assert [row["family"] for row in results["serving"]] == ["mhf", "qwen3"]
    assert all(row["exact_scoring_tok_s"] > 0 and row["generation_tok_s"] > 0 for row in results["serving"])
    assert [row["seq_len"] for row in results["triple_vs_qwen3"]] == [64, 128]
