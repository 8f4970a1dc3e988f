"""The reproduction report's runs: the papers' claims at CPU scale, through mhf-dist's own commands.

Tables 1, 3 and 4 are sweep files (jobs/report/, jobs/triple/) that `mhf sweep --prepare` runs as they
are (a sweep that exists is resumed: finished trials are not rerun); this job runs them in order, reads
every trial's final metrics back from MLflow (`mhf compare`'s reader) and draws `mhf compare`'s plots
into benchmarks/report/. Table 2 is jobs/cpt_multilingual.py over three seeds. The numbers go to
benchmarks/report/results.json, from which benchmarks/REPORT.md quotes its tables. Table 6 (jobs/scaling.py)
is a grid of matched sweeps over width and training tokens, with the gap's fitted trend and two plots
(benchmarks/report/scaling/, also logged to an MLflow run `report-table-6`).

    python jobs/report.py                  # every table
    python jobs/report.py --tables 1 4     # tables 1 and 4 only (33 trials, ~1 h on 2 CPUs)
    python jobs/report.py --no-runs        # the tables from the finished trials only; starts no run

Run it from the repository root: the configs name ../shared/data and runs/ relative to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import scaling
from triple_benchmarks import PAPER  # the triple-latent paper's numbers, keyed by (sweep, family)

from mhf_dist.compare import read_runs
from mhf_dist.config import load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.shards import is_validation
from mhf_dist.files import write_json_atomic
from mhf_dist.storage import Location
from mhf_dist.sweep.runner import SWEEP_FILE, sweep_dir
from mhf_dist.sweep.spec import SweepConfig, load_sweep
from mhf_dist.tables import markdown_table
from mhf_dist.tracking import connect, end_run, log_files, reading_uri, start_run, tracking_errors

REPO = Path(__file__).resolve().parents[1]
JOBS = Path("jobs")
OUT = Path("benchmarks/report")
RESULTS = OUT / "results.json"
REPORT = Path("benchmarks/REPORT.md")
BENCHMARKS = Path("benchmarks/results")
# Table 1r's sweeps per source: the reference I/O under both objectives, with the baselines. Table 1's
# `mhf` rows are the compact I/O at the same budget (its configs pin `io: compact`).
REFERENCE_SWEEPS = ["", "-vocab"]
# table -> its row sources: a name and the sweep files (under jobs/) whose trials it aggregates by group
TABLES = {
    "1": {
        "builtin": ["report/mhf-vs-qwen3-builtin.sweep.yaml"],
        "wikitext-8k": ["report/mhf-vs-qwen3-wikitext-8k.sweep.yaml"],
        "wikitext-16k": ["report/mhf-vs-qwen3-wikitext-16k.sweep.yaml"],
    },
    "1r": {
        source: [f"report/reference-{source}{suffix}.sweep.yaml" for suffix in REFERENCE_SWEEPS]
        for source in ("builtin", "wikitext-8k")
    },
    "3": {
        "bytes-width": ["triple/bytes_width.sweep.yaml"],
        "bytes-params": ["triple/bytes_params.sweep.yaml"],
        "minimind": ["triple/minimind.sweep.yaml"],
        "recall": ["triple/recall.sweep.yaml", "report/triple-recall-seeds34.sweep.yaml"],  # 5 seeds
    },
    "4": {"hash-triple": ["report/hash-triple.sweep.yaml"]},
}
# metric logged by the trials -> what it is; a source reports its sweep's metric (with its siblings from
# the same `mhf eval` task) and training throughput
METRICS = {
    "eval.ppl.nll": "NLL (nats/token)",
    "eval.ppl.ppl": "perplexity",
    "eval.ppl.bits_per_byte": "bits/byte",
    "eval.bpb.bits_per_byte": "bits/byte",
    "eval.recall.acc": "recall accuracy",
    "tokens_per_s": "tokens/s",
}
# Table 6's cells (width, steps of 8 x 128 tokens): three widths at the largest budget and three budgets at
# the largest width, the largest cell first (the 2-core machine's time did not fit the full 3 x 3 grid)
SCALING_SWEEPS = [f"report/scaling-w{w}-t{t}.sweep.yaml" for w, t in ((128, 400), (64, 400), (32, 400),
                                                                      (128, 100), (128, 25))]  # fmt: skip
BUILTIN_VALIDATION = Path("runs/report/builtin-validation.txt")
CPT_SEEDS = ("0", "1", "2")
# (train split, replay fraction) of each table-2 recipe: the authors' split, without and with 25% English
CPT_SETTINGS = (("authors", "0"), ("authors", "0.25"))
CPT_RESULTS = Path("runs/jobs/cpt-multilingual/results.json")


def mhf(*args: str) -> None:
    """One `mhf` command, echoed as the report quotes it, run in this process (one Ray instance for the
    whole job); a failure stops the job."""
    from mhf_dist.cli import main as mhf_main

    print("$ mhf " + " ".join(args), flush=True)
    code = mhf_main(list(args))
    if code:
        raise subprocess.CalledProcessError(code, ["mhf", *args])


def write_builtin_validation() -> None:
    """The built-in corpus's documents that `mhf prepare` holds out, one per paragraph, for `mhf eval`."""
    val_percent = load_config(str(JOBS / "report" / "builtin.yaml")).data.val_percent
    held_out = [doc for doc in builtin_documents() if is_validation(doc, val_percent)]
    # `mhf eval` splits a text file at blank lines: a document keeps its lines but not its blank ones.
    paragraphs = [re.sub(r"\n\s*\n", "\n", doc.strip()) for doc in held_out]
    BUILTIN_VALIDATION.parent.mkdir(parents=True, exist_ok=True)
    Location.of(BUILTIN_VALIDATION).write_text("\n\n".join(paragraphs) + "\n")


def run_sweep_file(sweep_file: str, start_runs: bool) -> tuple[SweepConfig, str] | None:
    """`mhf sweep` (resumed where it exists) and `mhf compare`'s plots; returns the spec and parent run.
    Without `start_runs`, a sweep with no finished trial is left out (None); one with some is compared as
    it stands."""
    spec = load_sweep(JOBS / sweep_file)
    started = (sweep_dir(spec) / SWEEP_FILE).is_file()
    if start_runs:
        mhf("sweep", "--config", str(JOBS / sweep_file), "--prepare", *(["--resume"] if started else []))
    elif not started:
        print(f"{sweep_file}: not run yet, left out", flush=True)
        return None
    parent = json.loads((sweep_dir(spec) / SWEEP_FILE).read_text())["parent_run_id"]
    try:
        mhf("compare", "--experiment", spec.experiment, "--sweep", parent, "--metric", spec.metric,
            "--storage", spec.storage, "--out", str(OUT / spec.name))  # fmt: skip
    except subprocess.CalledProcessError:
        if start_runs:
            raise
        print(f"{sweep_file}: no trial has finished yet, left out", flush=True)
        return None
    return spec, parent


def source_rows(source: str, sweep_files: list[str], start_runs: bool) -> list[dict[str, Any]]:
    """One row per group over every sweep of the source: each metric's mean and std over the seeds."""
    runs = [run for sweep_file in sweep_files if (run := run_sweep_file(sweep_file, start_runs))]
    if not runs:
        return []
    spec = runs[0][0]
    task = spec.metric.rpartition(".")[0]
    siblings = [metric for metric in METRICS if metric.startswith(task + ".")]
    metrics = list(dict.fromkeys([spec.metric, *siblings, "tokens_per_s"]))
    values: dict[str, dict[str, list[float]]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for sweep, parent in runs:
        for metric in metrics:
            for curve in read_runs(reading_uri(sweep.storage), sweep.experiment, metric, parent):
                row = {"source": source, "group": curve.group, "params": curve.params}
                rows.setdefault(curve.group, row | {"param_residual": curve.param_residual})
                values.setdefault(curve.group, {}).setdefault(metric, []).append(curve.final)
    for group, row in rows.items():
        row["n_seeds"] = len(values[group][spec.metric])
        for metric in metrics:
            found = values[group].get(metric, [])
            row[f"{metric}.mean"] = statistics.fmean(found)
            row[f"{metric}.std"] = statistics.stdev(found) if len(found) > 1 else 0.0
        cv = row[f"{spec.metric}.std"] / abs(row[f"{spec.metric}.mean"])
        row |= {"metric": spec.metric, "cv": cv, "unstable": cv > spec.unstable_cv}
        row["paper"] = PAPER.get((spec.name, group))
    return list(rows.values())


def cpt_rows(start_runs: bool) -> list[dict[str, Any]]:
    """Table 2: the vocabulary-expansion job over three seeds, per recipe, family and language."""
    for trainable, replay in CPT_SETTINGS:
        command = [sys.executable, str(JOBS / "cpt_multilingual.py"), "--seeds", *CPT_SEEDS]
        command += ["--trainable", trainable, "--replay-fraction", replay]
        if start_runs:
            print("$ python " + " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True)
    if not CPT_RESULTS.is_file():
        return []
    found: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in json.loads(CPT_RESULTS.read_text())["results"]:
        found.setdefault((row["setting"], row["family"], row["language"]), []).append(row)
    rows = []
    for (setting, family, language), runs in found.items():
        row = {"setting": setting, "family": family, "language": language, "n_seeds": len(runs)}
        row |= {key: runs[0][key] for key in ("vocab", "params_added", "trainable_params")}
        row["replay_realised"] = statistics.fmean(run["replay_realised"] for run in runs)
        for key in ("nll_before", "nll_after", "bpb_before", "bpb_after"):
            values = [run[key] for run in runs]
            row[f"{key}.mean"] = statistics.fmean(values)
            row[f"{key}.std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def scaling_result(sweep_files: list[str], start_runs: bool) -> dict[str, list[dict[str, Any]]]:
    """Table 6 from the cells' MLflow runs; every cell is checked to be matched before any run starts."""
    specs = [load_sweep(JOBS / sweep_file) for sweep_file in sweep_files]
    for spec in specs:
        scaling.check_cell(spec)
    result: dict[str, list[dict[str, Any]]] = {"cells": [], "gaps": []}
    for sweep_file in sweep_files:
        if found := run_sweep_file(sweep_file, start_runs):
            rows, gaps = scaling.cell_rows(found[0].name, scaling.cell_runs(*found))
            result["cells"] += rows
            result["gaps"] += gaps
    if not result["gaps"]:
        return {}
    result["trends"] = scaling.trend_rows(result["gaps"])
    plots = scaling.plot(result["gaps"], OUT / "scaling")
    log_table_run(specs[0], "6", {path.name: path.read_bytes() for path in plots}, scaling.tables(result))
    return result


def log_table_run(spec: SweepConfig, table: str, files: dict[str, bytes], markdown: str) -> None:
    """The table's own MLflow run in the sweeps' experiment (tag report_table; a rerun reuses it): its
    Markdown and plots as artifacts."""
    uri = reading_uri(spec.storage)
    with tracking_errors(uri):
        experiment = connect(uri).get_experiment_by_name(spec.experiment)
        found = connect(uri).search_runs([experiment.experiment_id], f"tags.report_table = '{table}'")
    run_id = found[0].info.run_id if found else start_run(
        uri, spec.experiment, f"report-table-{table}", {}, {"report_table": table}
    )  # fmt: skip
    log_files(uri, run_id, {**files, f"table-{table}.md": markdown.encode()})
    end_run(uri, run_id, "FINISHED")


def mean_std(mean: float, std: float) -> str:
    return f"{mean:,.0f} +- {std:,.0f}" if abs(mean) >= 1000 else f"{mean:.4g} +- {std:.2g}"


def table(rows: list[dict[str, Any]]) -> str:
    shown = []
    for row in rows:
        residual = row["param_residual"]
        cells = {
            "source": row["source"],
            "model": row["group"],
            "params": row["params"],
            "vs reference": "" if residual is None else f"{residual:+,}",
            "seeds": row["n_seeds"],
        }
        for key in row:
            if key.endswith(".mean"):
                metric = key.removesuffix(".mean")
                cells[METRICS.get(metric, metric)] = mean_std(row[key], row[f"{metric}.std"])
        paper = "" if row["paper"] is None else row["paper"]
        shown.append(cells | {"cv": f"{row['cv']:.3f}", "unstable": row["unstable"], "paper": paper})
    return markdown_table(shown, list(dict.fromkeys(key for cells in shown for key in cells)))


def benchmark_row(what: str, value: float, target: float | None, higher_is_better: bool = False) -> dict:
    met = None if target is None else (value >= target if higher_is_better else value <= target)
    bound = "" if target is None else f"{'>=' if higher_is_better else '<='} {target:g}"
    return {"measurement": what, "value": value, "target": bound, "met": met}


def benchmark_rows() -> list[dict[str, Any]]:
    """Table 5: the latest result of every benchmark in benchmarks/results/, with its target."""
    results = {path.stem: json.loads(path.read_text()) for path in BENCHMARKS.glob("*.json")}
    rows = []

    def add(benchmark: str, *args: Any, **kwargs: Any) -> None:
        rows.append({"benchmark": benchmark, **benchmark_row(*args, **kwargs)})

    flop_target = results["step_time"]["targets"]["measured_over_analytic"]
    for row in results["step_time"]["results"]:
        v = f"{row['variant']}, V={row['vocab_size']:,}, {results['step_time']['preset']}"
        add("step_time", f"train step mhf / qwen3 ({v})", row["step_ratio"], row["step_target"])
        add("step_time", f"train step measured / analytic ({v})", row["measured_over_analytic"], flop_target)
        add("step_time", f"exact scoring mhf / qwen3 ({v})", row["score_ratio"], row["score_target"])
    prepared = results["prepare_throughput"]
    throughput = prepared["throughput"]
    for row in throughput["results"]:
        what = f"mhf prepare per CPU / one-process baseline ({row['setting']})"
        add("prepare_throughput", what, row["per_cpu_ratio"], row["target"], True)
    add(
        "prepare_throughput",
        "signature lookup, tokens/s",
        throughput["lookup_tok_s"],
        throughput["lookup_target"],
        True,
    )
    add(
        "prepare_throughput", "peak object store / tokenized corpus", prepared["peak_store_over_corpus"], 0.25
    )
    zero = results["zero_memory"]
    for row in zero["results"][1:]:
        target = zero["target_stage3_model_state"] if row["zero_stage"] == 3 else None
        add("zero_memory", f"ZeRO-{row['zero_stage']} model state / ZeRO-0 (100m, 2 workers)",
            row["model_state_vs_first"], target)  # fmt: skip
    for row in results["triple_throughput"]["results"]:
        if row["target"] is not None:
            what = f"{row['family']} / qwen3 fwd+bwd time, seq {row['seq_len']}"
            add("triple_throughput", what, row["time_ratio"], row["target"])
    for row in results["hash_backbones"]["results"]:
        if row["model"].endswith("+hash"):
            what = f"{row['model']} / standard head, step time, V={row['vocab_size']:,}, seq {row['seq_len']}"
            add("hash_backbones", what, row["step_vs_standard_io"], None)
            add("hash_backbones", what.replace("step time", "peak memory"), row["mem_vs_standard_io"], None)
    return rows


def benchmark_table(rows: list[dict[str, Any]]) -> str:
    verdict = {True: "met", False: "**missed**", None: "no target"}
    shown = [row | {"value": f"{row['value']:.3g}", "met": verdict[row["met"]]} for row in rows]
    return markdown_table(
        shown, ["benchmark", "measurement", "value", "target", "met"]
    )  # results.json sorts keys


def cpt_table(rows: list[dict[str, Any]]) -> str:
    shown = [
        {
            "recipe": row["setting"],
            "replay": f"{row['replay_realised']:.1%}",
            "model": row["family"],
            "language": row["language"],
            "trainable": f"{row['trainable_params']:,}",
            "vocabulary": row["vocab"],
            "params added": row["params_added"],
            "seeds": row["n_seeds"],
            **{
                label: mean_std(row[f"{key}.mean"], row[f"{key}.std"])
                for key, label in [
                    ("nll_before", "NLL before"),
                    ("nll_after", "NLL after"),
                    ("bpb_before", "bits/byte before"),
                    ("bpb_after", "bits/byte after"),
                ]
            },
        }
        for row in rows
    ]
    return markdown_table(shown, list(shown[0]))


def render(name: str, rows: Any) -> str:
    if not rows:
        return "(not run yet)"
    return {"2": cpt_table, "5": benchmark_table, "6": scaling.tables}.get(name, table)(rows)


def fill_report(results: dict[str, list[dict[str, Any]]]) -> None:
    """Put each table between its `<!-- table N -->` and `<!-- /table N -->` markers in REPORT.md."""
    text = REPORT.read_text(encoding="utf-8")
    for name, rows in results.items():
        rendered = render(name, rows)
        pattern = re.compile(rf"(<!-- table {name} -->\n).*?(<!-- /table {name} -->)", re.DOTALL)
        text = pattern.sub(lambda match, r=rendered: match[1] + r + "\n" + match[2], text)
    Location.of(REPORT).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = sorted([*TABLES, "2", "5", "6"])
    parser.add_argument("--tables", nargs="+", choices=choices, default=choices)
    parser.add_argument(
        "--no-runs", action="store_true", help="tables from the trials that finished; start no training run"
    )
    args = parser.parse_args()
    os.chdir(REPO)
    write_builtin_validation()
    results = json.loads(RESULTS.read_text())["tables"] if RESULTS.is_file() else {}
    for name in args.tables:
        if name == "2":
            results[name] = cpt_rows(not args.no_runs)
        elif name == "5":
            results[name] = benchmark_rows()
        elif name == "6":
            results[name] = scaling_result(SCALING_SWEEPS, not args.no_runs)
        else:
            sources = TABLES[name].items()
            rows = [source_rows(source, files, not args.no_runs) for source, files in sources]
            results[name] = [row for source in rows for row in source]
        print(f"table {name}:\n{render(name, results[name])}", flush=True)
        write_json_atomic(RESULTS, {"benchmark": "report", "tables": results})
    if REPORT.is_file():
        fill_report(results)
    print(f"wrote {RESULTS}" + (f" and the tables of {REPORT}" if REPORT.is_file() else ""))


if __name__ == "__main__":
    main()
