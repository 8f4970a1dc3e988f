"""Table 6: does the MultiHashFormer's gap to Qwen3 close with width and with tokens?

Each cell of the grid (a width and a training-token budget) is one matched sweep (jobs/report/scaling-*):
`mhf` on the paper's coordinates objective, `mhf_vocab` on the exact-vocabulary objective, `qwen3` and
`qwen3_matched`, over seeds. Everything here is read back from MLflow with `mhf compare`'s reader: each
run's exact test NLL and bits/byte, its parameters and the tokens it trained on. The gap of an objective
to a baseline is paired by seed (`mhf` seed s minus the baseline's seed s). Its trend is a least-squares
line of the mean gap against log10 parameters (the widths at the largest budget) and against log10
tokens (the budgets at the largest width), with a bootstrap over each cell's seeds for the spread.
"""

from __future__ import annotations

import math
import random
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
BOOTSTRAP_DRAWS = 2000


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
    first = {key.split("/")[0]: curve for key, curve in nll.items()}
    width = int(next(iter(nll.values())).config["model.backbone.hidden_size"])
    rows = []
    for group in GROUPS:
        keys = sorted(key for key in nll if key.split("/")[0] == group)
        if not keys:
            continue
        row = {"cell": cell, "width": width, "group": group, "params": first[group].params}
        row |= {"tokens": first[group].tokens_seen, "seeds": len(keys)}
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
                    {"cell": cell, "width": width, "params": first[group].params,
                     "tokens": first[group].tokens_seen, "objective": objective, "baseline": baseline,
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


def fit_trend(gaps: Iterable[dict], axis: str, seed: int = 0) -> dict[str, Any] | None:
    """The gap's slope per decade of `axis` (params or tokens) over the cells on one line of the grid (the
    largest value of the other axis), with a bootstrap over each cell's seeds, and the scale where the
    fitted gap would reach zero if the trend held (None if it does not shrink toward zero)."""
    other = "tokens" if axis == "params" else "params"
    gaps = list(gaps)
    if not gaps:
        return None
    line = [gap for gap in gaps if gap[other] == max(g[other] for g in gaps)]
    if len({gap[axis] for gap in line}) < 2:
        return None
    xs = [math.log10(gap[axis]) for gap in line]
    intercept, slope = _least_squares(xs, [gap["gap.mean"] for gap in line])
    draws = random.Random(seed)
    slopes = sorted(
        _least_squares(xs, [statistics.fmean(draws.choices(gap["gap.seeds"], k=len(gap["gap.seeds"])))
                            for gap in line])[1]
        for _ in range(BOOTSTRAP_DRAWS)
    )  # fmt: skip
    low, high = slopes[int(0.05 * BOOTSTRAP_DRAWS)], slopes[int(0.95 * BOOTSTRAP_DRAWS) - 1]
    gap_now = intercept + slope * max(xs)
    shrinks = slope != 0 and (gap_now > 0) == (slope < 0)
    trend = "shrinks" if shrinks else "grows"
    verdict = "flat within the seed spread" if low <= 0 <= high else trend
    return {
        "verdict": verdict,
        "axis": axis,
        "cells": len(line),
        "at": f"{other} = {line[0][other]:,}",
        "slope": slope,
        "slope.std": statistics.stdev(slopes),
        "slope.90%": [low, high],
        "zero_at": 10 ** (-intercept / slope) if shrinks else None,
    }


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
    trends = [
        {"objective": t["objective"], "gap to": t["baseline"], "against": f"log10 {t['axis']}",
         "over": f"{t['cells']} cells at {t['at']}",
         "slope (nats/decade)": _pm(t["slope"], t["slope.std"], "+"),
         "90% bootstrap": "[{:+.3f}, {:+.3f}]".format(*t["slope.90%"]), "gap": t["verdict"],
         "gap zero at": "does not shrink" if t["zero_at"] is None else f"{t['zero_at']:.3g} {t['axis']}"}
        for t in result["trends"]
    ]  # fmt: skip
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
