"""`mhf compare`: runs read back from MLflow, grouped across seeds, as tables, plots and tags.

A group is a sweep's variant (tag `group`: the family in a matched sweep, the grid values in a grid
sweep) or, for runs outside a sweep, the family; `--group-by` groups by MLflow params or tags instead
(`topology.zero_stage=2,model.family=mhf`). A group's runs are seeds of one setting: a group whose runs
differ in any other param (not `IDENTITY_PARAMS`) or in the metric's last logged step is split by those
(`mhf,train.steps=50`). Per group: the final value of the metric over the seeds (`STATISTICS`); a group is
`unstable` when its coefficient of variation passes the threshold.
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mhf_dist.errors import MhfError
from mhf_dist.storage import Location, redact
from mhf_dist.tables import markdown_table
from mhf_dist.tracking import (
    connect,
    every_run,
    find_run,
    log_files,
    require_store,
    set_tags,
    show_report,
    tracking_errors,
)

if TYPE_CHECKING:
    from mlflow.entities import Experiment

STATISTICS = ("mean", "std", "min", "max", "spread", "cv", "unstable")  # of a group's final values
COLUMNS = ("group", "family", "objective", "n_seeds", *STATISTICS, "params", "param_residual", "tokens_seen")
COMPARE_DIR = "compare"  # `mhf compare`'s files: <storage>/compare/<sweep or experiment>, <sweep>/compare
SWEEPS_LISTED = 5  # an unknown --sweep's error line lists the experiment's newest sweeps


class CompareError(MhfError):
    """Nothing to compare, or the runs lack the metric."""


# Params that say which run this is or where it is stored, not what it trains: runs differing in them
# compare as seeds of one setting.
IDENTITY_PARAMS = frozenset(
    {
        "train.seed",
        "preset",
        "topology.storage",
        "data.path",  # where the shards are (a cpt run prepares its own); their digest is the dataset input
        "train.log_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
    }
)
FINAL_STEP = "final_step"  # the pseudo-key of a group split by the metric's last logged step
NOT_LOGGED = "(not logged)"


@dataclass(frozen=True)
class RunCurve:
    run_id: str
    group: str
    family: str
    objective: str  # the training objective (tag `objective`; empty for runs logged before it existed)
    seed: int
    params: int
    param_residual: int | None
    tokens_seen: int
    curve: list[tuple[int, float]]  # (step, value) of the metric
    config: Mapping[str, str] = field(default_factory=dict)  # the run's params but IDENTITY_PARAMS
    split_from: str = ""  # the group before `separate` added the keys its runs differ in
    split_by: tuple[str, ...] = ()  # those keys

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def read_runs(
    uri: str, experiment: str, metric: str, sweep_run_id: str | None = None, group_by: Sequence[str] = ()
) -> list[RunCurve]:
    """Finished training runs of `experiment` (or of the sweep `sweep_run_id`), grouped as the module says."""
    with tracking_errors(uri):
        require_store(uri)
        client = connect(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise CompareError(
                f"no MLflow experiment {experiment!r} at {redact(uri)!r}; check --experiment and the URI"
            )
        query = "attributes.status = 'FINISHED'"
        if sweep_run_id:
            check_sweep(uri, found, sweep_run_id)
            query += f" and tags.mlflow.parentRunId = '{sweep_run_id}'"
        runs = [run for run in every_run(client, found.experiment_id, query) if "family" in run.data.tags]
        histories = [client.get_metric_history(run.info.run_id, metric) for run in runs]
    curves = []
    for run, unsorted in zip(runs, histories, strict=True):
        history = sorted(unsorted, key=lambda m: m.step)
        if not history:
            continue
        tags, params = run.data.tags, run.data.params
        tokens_per_step = int(params["train.batch_size"]) * int(params["train.seq_len"])
        curves.append(
            RunCurve(
                run_id=run.info.run_id,
                group=run_group(run.info.run_id, params, tags, group_by),
                family=tags["family"],
                objective=tags.get("objective", ""),
                seed=int(params.get("train.seed", tags["seed"])),
                params=int(tags["param_count"]),
                param_residual=int(tags["param_residual"]) if "param_residual" in tags else None,
                tokens_seen=tokens_per_step * history[-1].step,
                curve=[(m.step, m.value) for m in history],
                config={key: value for key, value in params.items() if key not in IDENTITY_PARAMS},
            )
        )
    if not curves:
        where = f"sweep run {sweep_run_id}" if sweep_run_id else f"experiment {experiment!r}"
        raise CompareError(
            f"no finished runs with metric {metric!r} in {where}; pick another --metric (e.g. loss)"
        )
    by_config = separate(curves, lambda curve: curve.config)
    by_length = separate(by_config, lambda curve: {FINAL_STEP: str(curve.curve[-1][0])})
    check_distinct_seeds(by_length)
    return sorted(by_length, key=lambda c: (c.group, c.seed))


def check_sweep(uri: str, experiment: Experiment, sweep_run_id: str) -> None:
    """`--sweep` names a sweep's parent run of `experiment`, or the line lists the newest ones."""
    run = find_run(uri, sweep_run_id)
    ours = run is not None and run.info.experiment_id == experiment.experiment_id
    if ours and "family" not in run.data.tags:  # a training run has a family, a sweep's parent none
        return
    sweeps = connect(uri).search_runs(
        [experiment.experiment_id],
        filter_string="tags.role = 'sweep'",
        max_results=SWEEPS_LISTED,
        order_by=["attributes.start_time DESC"],
    )
    listed = ", ".join(f"{sweep.info.run_id} ({sweep.info.run_name})" for sweep in sweeps)
    newest = f"newest here: {listed}" if listed else "the experiment has no sweep runs: check --experiment"
    raise CompareError(
        f"--sweep {sweep_run_id!r} is not a sweep run of experiment {experiment.name!r} at {redact(uri)!r}; "
        f"give the parent run id `mhf sweep` printed ({newest})"
    )


def run_group(
    run_id: str, params: Mapping[str, str], tags: Mapping[str, str], group_by: Sequence[str]
) -> str:
    """`group_by`'s keys and the run's values (a param, else a tag), e.g. `topology.zero_stage=2`."""
    if not group_by:
        return tags.get("group", tags["family"])
    missing = [key for key in group_by if key not in params and key not in tags]
    if missing:
        raise CompareError(
            f"run {run_id} has no MLflow param or tag {missing[0]!r}; --group-by takes a config key "
            "(e.g. topology.zero_stage, model.family) or a tag (e.g. family, group)"
        )
    return ",".join(f"{key}={params.get(key, tags.get(key))}" for key in group_by)


def separate(curves: list[RunCurve], values: Callable[[RunCurve], Mapping[str, str]]) -> list[RunCurve]:
    """Each group's runs split by the keys of `values` they differ in: `mhf` becomes `mhf,train.steps=50`
    and `mhf,train.steps=6`, so no mean is taken over runs of different settings."""
    split = []
    for group, members in by_group(curves).items():
        keys = sorted(
            key
            for key in set().union(*(values(member) for member in members))
            if len({values(member).get(key, NOT_LOGGED) for member in members}) > 1
        )
        if not keys:
            split += members
            continue
        for member in members:
            label = ",".join([group, *(f"{key}={values(member).get(key, NOT_LOGGED)}" for key in keys)])
            split_from, split_by = member.split_from or group, (*member.split_by, *keys)
            split.append(replace(member, group=label, split_from=split_from, split_by=split_by))
    return split


def check_distinct_seeds(curves: list[RunCurve]) -> None:
    """Refuse two runs of one seed in a group (a repeated run, two sweeps of one experiment)."""
    for group, members in by_group(curves).items():
        runs_of: dict[int, list[str]] = defaultdict(list)
        for member in members:
            runs_of[member.seed].append(member.run_id)
        repeated = {seed: ids for seed, ids in runs_of.items() if len(ids) > 1}
        if repeated:
            seed, ids = min(repeated.items())
            raise CompareError(
                f"group {group!r} has {len(ids)} runs of seed {seed} ({', '.join(sorted(ids))}); a group's "
                "runs must be distinct seeds: compare one sweep with --sweep PARENT_RUN_ID, tell the runs "
                "apart with --group-by KEY, or delete the extra ones (mlflow runs delete --run-id ID)"
            )


def grouping_notes(curves: list[RunCurve]) -> list[str]:
    """A line per group that `separate` split, naming the keys its runs differ in."""
    keys_of: dict[str, dict[str, None]] = defaultdict(dict)  # ordered sets
    for curve in curves:
        if curve.split_by:
            keys_of[curve.split_from].update(dict.fromkeys(curve.split_by))
    notes = []
    for group, keys in sorted(keys_of.items()):
        pronoun = "them" if len(keys) > 1 else "it"
        notes.append(f"grouped also by {', '.join(keys)}: the runs of {group!r} differ in {pronoun}")
    return notes


def by_group(curves: list[RunCurve]) -> dict[str, list[RunCurve]]:
    groups: dict[str, list[RunCurve]] = defaultdict(list)
    for curve in curves:
        groups[curve.group].append(curve)
    return dict(sorted(groups.items()))


def summarize(curves: list[RunCurve], unstable_cv: float) -> list[dict[str, Any]]:
    rows = []
    for group, members in by_group(curves).items():
        finals = [member.final for member in members]
        mean = statistics.fmean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        cv = std / abs(mean) if mean else math.inf
        rows.append(
            {
                "group": group,
                "family": ",".join(sorted({member.family for member in members})),
                "objective": ",".join(sorted({member.objective for member in members})),
                "n_seeds": len({member.seed for member in members}),
                "mean": mean,
                "std": std,
                "min": min(finals),
                "max": max(finals),
                "spread": max(finals) - min(finals),
                "cv": cv,
                "unstable": cv > unstable_cv,
                "params": members[0].params,
                "param_residual": members[0].param_residual if members[0].param_residual is not None else "",
                "tokens_seen": members[0].tokens_seen,
            }
        )
    return rows


def csv_text(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def curves_png(curves: list[RunCurve], metric: str) -> bytes:
    """The metric over steps per group: the mean line with a min-max band over seeds."""
    figure, axes = _new_figure()
    for group, members in by_group(curves).items():
        steps = sorted(set.intersection(*(set(step for step, _ in m.curve) for m in members)))
        values = [[dict(m.curve)[step] for m in members] for step in steps]
        line = axes.plot(steps, [statistics.fmean(v) for v in values], label=f"{group} (n={len(members)})")
        axes.fill_between(
            steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=line[0].get_color()
        )
    axes.set(xlabel="step", ylabel=metric, title=f"{metric}: mean over seeds, band = min..max")
    axes.legend()
    return _png(figure)


def finals_png(curves: list[RunCurve], metric: str) -> bytes:
    """The final metric of every seed as a point, one column per group."""
    figure, axes = _new_figure()
    groups = by_group(curves)
    for index, members in enumerate(groups.values()):
        axes.scatter([index] * len(members), [m.final for m in members], zorder=3)
        for member in members:
            axes.annotate(
                f"seed {member.seed}", (index, member.final), textcoords="offset points", xytext=(6, 0)
            )
    axes.set_xticks(range(len(groups)), list(groups), rotation=20)
    axes.set(ylabel=f"final {metric}", title=f"final {metric} per seed")
    return _png(figure)


def _new_figure() -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # not pyplot's: files only, no display, nothing to close

    figure = Figure(figsize=(7, 4.5))
    return figure, figure.subplots()


def _png(figure: Any) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


@dataclass(frozen=True)
class Comparison:
    rows: list[dict[str, Any]]
    table: str
    notes: list[str]  # `grouping_notes`: groups split because their runs differ in more than the seed
    # compare.md, compare.csv, curves.png, finals.png (and loss.png): Paths, Locations in a bucket
    files: list[Path | Location]

    @property
    def report(self) -> str:
        """The table, then why any group was split: what the console shows."""
        return "\n".join([self.table, *self.notes])


def compare_runs(
    uri: str,
    experiment: str,
    out_dir: str | Path | Location,
    metric: str = "val_nll",
    sweep_run_id: str | None = None,
    unstable_cv: float = 0.05,
    group_by: Sequence[str] = (),
) -> Comparison:
    """Read, summarize, write the report to `out_dir`; with a sweep, log it to its parent run too."""
    out = report_directory(out_dir)
    curves = read_runs(uri, experiment, metric, sweep_run_id, group_by)
    rows = summarize(curves, unstable_cv)
    table = markdown_table(rows, COLUMNS)
    notes = grouping_notes(curves)
    heading = f"# {metric} by group ({experiment}{f', sweep {sweep_run_id}' if sweep_run_id else ''})\n\n"
    report = {
        "compare.md": (heading + table + "\n" + "".join(f"\n{note}\n" for note in notes)).encode(),
        "compare.csv": csv_text(rows).encode(),
        "curves.png": curves_png(curves, metric),
        "finals.png": finals_png(curves, metric),
    }
    if metric != "loss":  # the training loss beside it, logged every train.log_every steps
        # Each family's own objective: mhf's coordinates loss is not a per-token NLL over V.
        loss = read_runs(uri, experiment, "loss", sweep_run_id, group_by)
        report["loss.png"] = curves_png(loss, "training loss (each family's objective)")
    for name, data in report.items():
        (out / name).write_bytes(data)  # each whole, in one step
    if sweep_run_id:
        log_files(uri, sweep_run_id, report)
        images = {name.removesuffix(".png"): data for name, data in report.items() if name.endswith(".png")}
        show_report(uri, sweep_run_id, report["compare.md"].decode(), images)
        set_tags(uri, sweep_run_id, stability_tags(rows))
    return Comparison(rows, table, notes, [(out / name).as_given() for name in report])


def report_directory(out_dir: str | Path | Location) -> Location:
    """`out_dir`, refused before anything is read when it or a local directory above it is a file."""
    out = Location.of(out_dir)
    if out.is_file():
        raise CompareError(
            f"the report directory {str(out)!r} is a file; give --out a directory (it gets compare.md, "
            "compare.csv and the plots)"
        )
    blocking = out.file_above()
    if blocking is not None:
        raise CompareError(
            f"the report directory {str(out)!r} cannot be created: {str(blocking)!r} is a file; give --out "
            "a directory that is not under a file"
        )
    return out


def stability_tags(rows: list[dict[str, Any]]) -> dict[str, str]:
    """`cv.<group>` and `unstable.<group>` for the sweep's parent run."""
    tags = {}
    for row in rows:
        group = re.sub(r"[^A-Za-z0-9_.\- /]", "_", row["group"])  # MLflow's allowed key characters
        tags |= {f"cv.{group}": f"{row['cv']:.4g}", f"unstable.{group}": str(row["unstable"]).lower()}
    return tags
