"""The triple-latent paper's benchmark protocols (PAPERS.md section 2) as sweeps, beside its numbers.

Each protocol is a data config and sweep files under jobs/triple/ that `mhf prepare` and `mhf sweep` run
as they are; this job runs them in order (preparing data once, resuming a sweep that exists), reads
each sweep's comparison from MLflow and writes benchmarks/results/triple_protocols.json and a Markdown
table (benchmarks/triple_protocols.md) with the paper's numbers beside ours.

    python jobs/triple_benchmarks.py                         # all protocols (~75 min on 2 CPUs)
    python jobs/triple_benchmarks.py --sweeps recall.sweep.yaml   # one of them
    ray job submit --working-dir . -- python jobs/triple_benchmarks.py   # on a Ray cluster

Run it from the repository root: the configs name ../shared/data and runs/ relative to it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.shards import MANIFEST
from mhf_dist.files import write_json_atomic
from mhf_dist.storage import Location
from mhf_dist.sweep.runner import SWEEP_FILE, compare_sweep, run_sweep, sweep_dir
from mhf_dist.sweep.spec import load_sweep
from mhf_dist.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs" / "triple"
RESULTS = REPO / "benchmarks" / "results" / "triple_protocols.json"
REPORT = REPO / "benchmarks" / "triple_protocols.md"

# sweep file -> (data config, what the metric is), in the order the job runs them
SWEEPS = {
    "recall.sweep.yaml": ("recall.yaml", "accuracy at the query positions (higher is better)"),
    "bytes_width.sweep.yaml": ("bytes.yaml", "bits per byte on wiki.test.raw (lower is better)"),
    "minimind.sweep.yaml": ("minimind.yaml", "mean token loss (nats) on wiki.test.raw"),
    "bytes_params.sweep.yaml": ("bytes.yaml", "bits per byte on wiki.test.raw (lower is better)"),
}
# The paper's reported numbers (PAPERS.md section 2), keyed by our sweep name and family.
PAPER = {
    ("triple-bytes-width", "qwen3"): 5.124,
    ("triple-bytes-width", "triple_hybrid"): 4.766,
    ("triple-bytes-params", "triple_hybrid"): 5.067,
    ("triple-minimind", "gated_hybrid"): 6.766,
    ("triple-minimind", "triple_hybrid"): 7.035,
    ("triple-minimind", "transformer_plus_triple"): 7.239,
    ("triple-recall", "qwen3"): 0.250,
    ("triple-recall", "gated_hybrid"): 0.419,
    ("triple-recall", "triple_hybrid"): 0.116,
    ("triple-recall", "triple_latent"): 0.134,
}


def run_protocol(sweep_file: str) -> list[dict[str, Any]]:
    config_file, meaning = SWEEPS[sweep_file]
    cfg = load_config(str(JOBS / config_file))
    if not (Path(cfg.data.path) / MANIFEST).is_file():
        prepare(cfg, cfg.data.path)
    spec = load_sweep(JOBS / sweep_file)
    result = run_sweep(spec, resume=(sweep_dir(spec) / SWEEP_FILE).is_file())
    comparison = compare_sweep(spec, result)
    return [
        {
            "sweep": spec.name,
            "metric": spec.metric,
            "meaning": meaning,
            **row,
            "paper": PAPER.get((spec.name, row["family"])),
        }
        for row in comparison.rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    args = parser.parse_args()
    os.chdir(REPO)
    rows = []
    for sweep_file in args.sweeps:
        rows += run_protocol(sweep_file)
    previous = json.loads(RESULTS.read_text())["results"] if RESULTS.is_file() else []
    kept = [row for row in previous if row["sweep"] not in {new["sweep"] for new in rows}]  # other protocols
    columns = ["sweep", "family", "n_seeds", "mean", "std", "min", "max", "cv", "params", "paper"]
    table = markdown_table(rows, columns)
    print(table)
    write_json_atomic(RESULTS, {"benchmark": "triple_protocols", "results": kept + rows})
    Location.of(REPORT).write_text(_report(kept + rows, columns))
    print(f"wrote {RESULTS} and {REPORT}")


def _report(rows: list[dict[str, Any]], columns: list[str]) -> str:
    parts = ["# Triple-latent benchmark protocols: ours beside the paper's\n"]
    for sweep in dict.fromkeys(row["sweep"] for row in rows):
        members = [row for row in rows if row["sweep"] == sweep]
        parts.append(f"## {sweep}: {members[0]['metric']} ({members[0]['meaning']})\n")
        parts.append(markdown_table(members, columns) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    main()
