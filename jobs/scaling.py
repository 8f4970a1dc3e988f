"""Table 6: does the MultiHashFormer's gap to Qwen3 close with width and with tokens?

Each cell of the grid (a width and a training-token budget) is one matched sweep (jobs/report/scaling-*):
`mhf` on the paper's coordinates objective, `mhf_vocab` on the exact-vocabulary objective, `qwen3` and
`qwen3_matched`, over seeds. Everything here is read back from MLflow with `mhf compare`'s reader: each
run's exact test NLL and bits/byte, its parameters and the tokens it trained on. The gap of an objective
to a baseline is paired by seed (`mhf` seed s minus the baseline's seed s). Its trend is a least-squares
line of the mean gap against log10 parameters (the widths at the largest budget) and against log10
tokens (the budgets at the largest width), its uncertainty propagated from each cell's seed spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mhf_dist.compare import RunCurve, read_runs
from mhf_dist.errors import ConfigError
from mhf_dist.models.registry import param_count
from mhf_dist.sweep.spec import SweepConfig, expand_trials, trial_configs
from mhf_dist.tables import markdown_table
from mhf_dist.tracking import reading_uri

NLL, BPB = "eval.ppl.nll", "eval.ppl.bits_per_byte"
OBJECTIVES = {"coordinates": "mhf", "vocab": "mhf_vocab"}  # objective -> the group trained on it
BASELINES = ("qwen3", "qwen3_matched")
GROUPS = (*OBJECTIVES.values(), *BASELINES)


def check_cell(spec: SweepConfig) -> None:
    """A cell trains the four groups, and `qwen3_matched` has at least `mhf`'s parameters (the matched
    row is never the smaller model); refused before any run starts."""
    groups = {trial.group for trial in expand_trials(spec)}
    missing = [group for group in GROUPS if group not in groups]
    if missing:
        raise ConfigError(f"sweep {spec.name!r} lacks group(s) {', '.join(missing)}; a cell trains {GROUPS}")
    params: dict[str, int] = {}
    for trial, cfg in zip(expand_trials(spec), trial_configs(spec).values(), strict=True):
        params[trial.group] = param_count(cfg.model)
    if params["qwen3_matched"] < params["mhf"]:
        raise ConfigError(
            f"sweep {spec.name!r}: qwen3_matched has {params['qwen3_matched']:,} parameters, below mhf's "
            f"{params['mhf']:,}; match it to the cell's own mhf config"
        )


def cell_runs(spec: SweepConfig, parent: str) -> dict[str, dict[str, RunCurve]]:
    """metric -> `group/seed` -> the run's curve, for the cell's finished runs."""
    uri = reading_uri(spec.storage)
    return {
        metric: {f"{c.group}/{c.seed}": c for c in read_runs(uri, spec.experiment, metric, parent)}
        for metric in (NLL, BPB)
    }


def _spread(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def cell_rows(cell: str, runs: dict[str, dict[str, RunCurve]]) -> tuple[list[dict], list[dict]]:
    """One row per group (NLL and bits/byte over seeds) and one per objective x baseline (the gap)."""
    nll = runs[NLL]
    any_seed = {key.split("/")[0]: curve for key, curve in nll.items()}  # params and tokens: alike over seeds
    width = int(next(iter(nll.values())).config["model.backbone.hidden_size"])
    rows = []
    for group in GROUPS:
        keys = sorted(key for key in nll if key.split("/")[0] == group)
        if not keys:
            continue
        row = {"cell": cell, "width": width, "group": group, "params": any_seed[group].params}
        row |= {"tokens": any_seed[group].tokens_seen, "seeds": len(keys)}
        for metric, name in ((NLL, "nll"), (BPB, "bpb")):
            row[f"{name}.mean"], row[f"{name}.std"] = _spread([runs[metric][key].final for key in keys])
        rows.append(row)
    gaps = []
    for objective, group in OBJECTIVES.items():
        for baseline in BASELINES:
            seeds = sorted(int(key.split("/")[1]) for key in nll if key.startswith(group + "/"))
            paired = [
                nll[f"{group}/{seed}"].final - nll[f"{baseline}/{seed}"].final
                for seed in seeds
                if f"{baseline}/{seed}" in nll
            ]
            if paired:
                mean, std = _spread(paired)
                gaps.append(
                    {"cell": cell, "width": width, "params": any_seed[group].params,
                     "tokens": any_seed[group].tokens_seen, "objective": objective, "baseline": baseline,
                     "gap.mean": mean, "gap.std": std, "gap.seeds": paired}
                )  # fmt: skip
    return rows, gaps


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope


def fit_trend(gaps: Iterable[dict], axis: str) -> dict[str, Any] | None:
    """The gap's least-squares slope per decade of `axis` (params or tokens) over the cells on one line of
    the grid (the largest value of the other axis). Its standard error propagates each cell's seed spread
    (the standard error of the cell's mean gap) through the least-squares weights, and its 90% interval
    takes Student's t at the seeds' pooled degrees of freedom; a cell of one seed has no spread, so the
    line gets no interval and no verdict. The zero of the fitted line is kept as log10 of the scale."""
    other = "tokens" if axis == "params" else "params"
    gaps = list(gaps)
    line = [gap for gap in gaps if gap[other] == max(g[other] for g in gaps)] if gaps else []
    if len({gap[axis] for gap in line}) < 2:
        return None
    xs = [math.log10(gap[axis]) for gap in line]
    intercept, slope = _least_squares(xs, [gap["gap.mean"] for gap in line])
    mean_x = statistics.fmean(xs)
    weights = [(x - mean_x) / sum((x - mean_x) ** 2 for x in xs) for x in xs]
    seeds = [len(gap["gap.seeds"]) for gap in line]
    freedom = sum(n - 1 for n in seeds)
    zero = -intercept / slope if slope else None  # log10 of the scale where the fitted gap is 0
    ends = [intercept + slope * min(xs), intercept + slope * max(xs)]
    fit = {"axis": axis, "cells": len(line), "at": f"{other} = {line[0][other]:,}", "slope": slope,
           "slope.se": None, "slope.90%": None, "zero_at.log10": None, "seeds": min(seeds)}  # fmt: skip
    if ends[0] * ends[1] < 0:
        return fit | {"verdict": "crosses zero inside the grid", "zero_at.log10": zero}
    if min(seeds) < 2:
        return fit | {"verdict": "one seed: no spread, no verdict"}
    from scipy.stats import t as student

    error = math.sqrt(
        sum(w**2 * gap["gap.std"] ** 2 / n for w, gap, n in zip(weights, line, seeds, strict=True))
    )
    half = student.ppf(0.95, freedom) * error
    fit |= {"slope.se": error, "slope.90%": [slope - half, slope + half]}
    if slope - half <= 0 <= slope + half:
        return fit | {"verdict": "flat within the seed spread"}
    if (ends[1] > 0) == (slope < 0):
        return fit | {"verdict": "shrinks", "zero_at.log10": zero}
    return fit | {"verdict": "grows"}


def trend_rows(gaps: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for objective in OBJECTIVES:
        for baseline in BASELINES:
            chosen = [g for g in gaps if g["objective"] == objective and g["baseline"] == baseline]
            for axis in ("params", "tokens"):
                fit = fit_trend(chosen, axis)
                if fit is not None:
                    rows.append({"objective": objective, "baseline": baseline, **fit})
    return rows


def _pm(mean: float, std: float, sign: str = "") -> str:
    return f"{mean:{sign}.3f} +- {std:.3f}"


def _trend_cells(trend: dict[str, Any]) -> dict[str, str]:
    spread = "" if trend["slope.se"] is None else f" +- {trend['slope.se']:.3f}"
    interval = trend["slope.90%"]
    zero = trend["zero_at.log10"]
    return {
        "objective": trend["objective"],
        "gap to": trend["baseline"],
        "against": f"log10 {trend['axis']}",
        "over": f"{trend['cells']} cells at {trend['at']}",
        "slope (nats/decade)": f"{trend['slope']:+.3f}{spread}",
        "90% interval": "" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]",
        "gap": trend["verdict"],
        "fitted gap zero at": "" if zero is None else f"10^{zero:.1f} {trend['axis']}",
    }


def tables(result: dict[str, list[dict]]) -> str:
    """Markdown: the cells, the gaps, and the fitted trends."""
    models = [
        {"width": r["width"], "tokens": f"{r['tokens']:,}", "model": r["group"], "params": f"{r['params']:,}",
         "seeds": r["seeds"], "test NLL": _pm(r["nll.mean"], r["nll.std"]),
         "bits/byte": _pm(r["bpb.mean"], r["bpb.std"])}
        for r in result["cells"]
    ]  # fmt: skip
    gaps = [
        {"width": g["width"], "tokens": f"{g['tokens']:,}", "objective": g["objective"],
         "gap to": g["baseline"], "NLL gap (mhf - baseline)": _pm(g["gap.mean"], g["gap.std"], "+"),
         "seeds": len(g["gap.seeds"])}
        for g in result["gaps"]
    ]  # fmt: skip
    trends = [_trend_cells(trend) for trend in result["trends"]]
    return "\n\n".join(markdown_table(rows, list(rows[0])) for rows in (models, gaps, trends) if rows)


def plot(gaps: list[dict], out: Path) -> list[Path]:
    """gap-vs-params.png (one line per budget) and gap-vs-tokens.png (one line per width), one panel per
    objective, solid to qwen3 and dashed to qwen3_matched, error bars from the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for axis, line_by, label in (("params", "tokens", "tokens"), ("tokens", "width", "width")):
        figure, panels = plt.subplots(1, len(OBJECTIVES), figsize=(11, 4), sharey=True)
        for panel, objective in zip(panels, OBJECTIVES, strict=True):
            for baseline, style in zip(BASELINES, ("-o", "--s"), strict=True):
                for value in sorted({g[line_by] for g in gaps}):
                    points = sorted(
                        (g[axis], g["gap.mean"], g["gap.std"])
                        for g in gaps
                        if g["objective"] == objective and g["baseline"] == baseline and g[line_by] == value
                    )
                    if points:
                        xs, ys, errors = zip(*points, strict=True)
                        panel.errorbar(xs, ys, yerr=errors, fmt=style, capsize=3,
                                       label=f"vs {baseline}, {label} {value:,}")  # fmt: skip
            panel.axhline(0, color="grey", linewidth=0.8)
            panel.set(xscale="log", xlabel=axis, title=f"mhf ({objective} objective)")
            panel.legend(fontsize=7)
        panels[0].set_ylabel("test NLL gap, mhf - baseline (nats)")
        path = out / f"gap-vs-{axis}.png"
        out.mkdir(parents=True, exist_ok=True)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
