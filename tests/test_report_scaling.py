"""Table 6 (`jobs/report.py --tables 6`): the scaling grid's table, gaps and fitted trends come from the
MLflow runs the job made, end to end at a toy grid (two widths, two budgets, one seed)."""

import math
import sqlite3
from pathlib import Path

import pytest
import yaml

JOBS = Path(__file__).resolve().parents[1] / "jobs"
BYTES = {"data.tokenizer": "bytes", "model.vocab_size": 259, "model.hash.spec": "H2B64", "train.seq_len": 32}
FAMILIES = ["mhf", {"group": "mhf_vocab", "family": "mhf", "set": {"model.hash.loss": "vocab"}}, "qwen3",
            "qwen3_matched"]  # fmt: skip


def toy_cell(directory: Path, width: int, steps: int, families: list = FAMILIES) -> str:
    spec = {
        "name": f"toy-w{width}-t{steps}",
        "kind": "matched",
        "config": "tiny",
        "set": {**BYTES, "data.path": "data", "topology.workers": 1, "train.steps": steps,
                "model.backbone.hidden_size": width, "model.backbone.head_dim": width // 4},
        "families": families,
        "seeds": [0],
        "storage": "sweeps",
        "experiment": "report",
        "metric": "eval.ppl.nll",
        "evaluate": [{"task": "ppl", "data": "held_out.txt", "seq_len": 8}],
    }  # fmt: skip
    path = directory / f"{spec['name']}.sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def logged_finals(store: Path) -> dict[tuple[str, str, str], float]:
    """(sweep's run name, group, metric) -> the last logged value, read from MLflow's database itself."""
    with sqlite3.connect(store) as db:
        rows = db.execute(
            "SELECT parent.name, child.name, m.key, m.value FROM latest_metrics m "
            "JOIN runs child ON child.run_uuid = m.run_uuid "
            "JOIN tags t ON t.run_uuid = child.run_uuid AND t.key = 'mlflow.parentRunId' "
            "JOIN runs parent ON parent.run_uuid = t.value"
        ).fetchall()
    return {(parent, child.removesuffix("-seed0"), key): value for parent, child, key, value in rows}


def test_table_6_is_computed_from_the_runs_the_job_made(ray_session, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.syspath_prepend(str(JOBS))
    import report

    from mhf_dist.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "held_out.txt").write_text("A held-out line of text.\n\nAnother one, for the perplexity.\n")
    cells = [toy_cell(tmp_path, 32, 4), toy_cell(tmp_path, 16, 4), toy_cell(tmp_path, 32, 2)]

    # A cell whose mhf is not the one its baseline was matched to (a larger hash) is refused before any run.
    larger = {"group": "mhf", "family": "mhf", "set": {"model.hash.spec": "H2B1K"}}
    (tmp_path / "refused").mkdir()
    unmatched = toy_cell(tmp_path / "refused", 32, 4, [larger, *FAMILIES[1:]])
    with pytest.raises(ConfigError, match=r"qwen3_matched has [\d,]+ parameters, below mhf's [\d,]+; match"):
        report.scaling_result([*cells, unmatched], start_runs=True)
    assert not (tmp_path / "sweeps").exists()

    result = report.scaling_result(cells, start_runs=True)
    store = tmp_path / "sweeps" / "mlflow.db"
    logged = logged_finals(store)
    nll = {(row["cell"], row["group"]): row["nll.mean"] for row in result["cells"]}
    assert len(nll) == 12 and nll == {key: logged[(*key, "eval.ppl.nll")] for key in nll}
    bpb = {(row["cell"], row["group"]): row["bpb.mean"] for row in result["cells"]}
    assert bpb == {key: logged[(*key, "eval.ppl.bits_per_byte")] for key in bpb}
    gaps = {(g["cell"], g["objective"], g["baseline"]): g for g in result["gaps"]}
    for (cell, objective, baseline), gap in gaps.items():
        group = "mhf" if objective == "coordinates" else "mhf_vocab"
        assert gap["gap.mean"] == nll[(cell, group)] - nll[(cell, baseline)]
    params = {row["cell"]: row["params"] for row in result["cells"] if row["group"] == "mhf"}
    assert params["toy-w16-t4"] < params["toy-w32-t4"]
    tokens = {row["cell"]: row["tokens"] for row in result["cells"]}
    assert tokens["toy-w32-t4"] == 2 * tokens["toy-w32-t2"] == 4 * 8 * 32

    def slope(objective: str, baseline: str, axis: str) -> float:
        (trend,) = [t for t in result["trends"] if (t["objective"], t["baseline"], t["axis"]) == (objective,
                    baseline, axis)]  # fmt: skip
        return trend["slope"]

    wide, narrow, short = "toy-w32-t4", "toy-w16-t4", "toy-w32-t2"
    rise = gaps[(wide, "vocab", "qwen3")]["gap.mean"] - gaps[(narrow, "vocab", "qwen3")]["gap.mean"]
    run = math.log10(params[wide]) - math.log10(params[narrow])
    assert slope("vocab", "qwen3", "params") == pytest.approx(rise / run, rel=1e-12)
    rise = gaps[(wide, "vocab", "qwen3")]["gap.mean"] - gaps[(short, "vocab", "qwen3")]["gap.mean"]
    assert slope("vocab", "qwen3", "tokens") == pytest.approx(rise / math.log10(2), rel=1e-12)
    assert len(result["trends"]) == 8  # 2 objectives x 2 baselines x 2 axes

    # The plots and the tables are kept and logged to the table's own MLflow run.
    assert {p.name for p in (tmp_path / "benchmarks/report/scaling").iterdir()} >= {
        "gap-vs-params.png", "gap-vs-tokens.png"
    }  # fmt: skip
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (table_run,) = client.search_runs(
        [client.get_experiment_by_name("report").experiment_id], "tags.report_table = '6'"
    )
    assert {a.path for a in client.list_artifacts(table_run.info.run_id)} == {
        "gap-vs-params.png", "gap-vs-tokens.png", "table-6.md"
    }  # fmt: skip

    # Change one run's logged NLL in MLflow: the table, that cell's gaps and the slopes follow it.
    with sqlite3.connect(store) as db:
        (run_id,) = db.execute(
            "SELECT r.run_uuid FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND "
            "t.key = 'mlflow.parentRunId' JOIN runs p ON p.run_uuid = t.value "
            "WHERE p.name = ? AND r.name = 'mhf_vocab-seed0'",
            (wide,),
        ).fetchone()
        for table in ("metrics", "latest_metrics"):
            db.execute(f"UPDATE {table} SET value = value + 1.5 WHERE run_uuid = ? AND key = 'eval.ppl.nll'",
                       (run_id,))  # fmt: skip
    before, slope_before = result, slope("vocab", "qwen3", "params")
    result = report.scaling_result(cells, start_runs=False)
    changed = {(row["cell"], row["group"]): row["nll.mean"] for row in result["cells"]}
    assert changed == nll | {(wide, "mhf_vocab"): pytest.approx(nll[(wide, "mhf_vocab")] + 1.5)}
    new_gaps = {(g["cell"], g["objective"], g["baseline"]): g["gap.mean"] for g in result["gaps"]}
    for key, gap in gaps.items():
        moved = 1.5 if key[:2] == (wide, "vocab") else 0.0
        assert new_gaps[key] == pytest.approx(gap["gap.mean"] + moved)
    assert slope("vocab", "qwen3", "params") == pytest.approx(slope_before + 1.5 / run)
    assert report.render("6", result) != report.render("6", before)


def gap(params: int, seeds: list[float], tokens: int = 1000) -> dict:
    import statistics

    std = statistics.stdev(seeds) if len(seeds) > 1 else 0.0
    return {"params": params, "tokens": tokens, "gap.mean": statistics.fmean(seeds), "gap.std": std,
            "gap.seeds": seeds}  # fmt: skip


def test_the_fitted_trend_propagates_the_seed_spread_and_says_what_the_line_does(monkeypatch):
    """Made-up gaps with a known answer: the slope per decade, its standard error from the seeds, the
    verdict, and where the fitted gap reaches zero."""
    monkeypatch.syspath_prepend(str(JOBS))
    from scaling import fit_trend

    # 1.0 -> 0.8 -> 0.6 nats over three decades, seeds +-0.01: shrinks at -0.2/decade, zero at 10^(3+5).
    shrinking = [gap(10**3, [1.01, 0.99]), gap(10**4, [0.81, 0.79]), gap(10**5, [0.61, 0.59])]
    off_line = gap(10**6, [9.0, 9.0], tokens=10)  # a cell of a smaller budget: not on this line
    fit = fit_trend([*shrinking, off_line], "params")
    assert fit["cells"] == 3 and fit["slope"] == pytest.approx(-0.2)
    # each cell's mean gap has standard error 0.01 * sqrt(2) / sqrt(2) = 0.01; weights -1/2, 0, 1/2
    assert fit["slope.se"] == pytest.approx(math.sqrt(0.25 * 1e-4 * 2))
    assert fit["verdict"] == "shrinks" and fit["zero_at.log10"] == pytest.approx(8.0)
    noisy = [gap(10**3, [1.5, 0.5]), gap(10**4, [1.4, 0.4]), gap(10**5, [1.3, 0.3])]
    assert fit_trend(noisy, "params")["verdict"] == "flat within the seed spread"
    assert fit_trend(noisy, "params")["zero_at.log10"] is None
    rising = [gap(10**3, [0.21, 0.19]), gap(10**4, [0.41, 0.39])]
    assert fit_trend(rising, "params")["verdict"] == "grows"
    crossing = [gap(10**3, [0.21, 0.19]), gap(10**5, [-0.19, -0.21])]
    fit = fit_trend(crossing, "params")
    assert fit["verdict"] == "crosses zero inside the grid" and fit["zero_at.log10"] == pytest.approx(4.0)
    one_seed = [gap(10**3, [1.0]), gap(10**4, [0.8])]
    assert fit_trend(one_seed, "params")["verdict"] == "one seed: no spread, no verdict"
    nearly_flat = [gap(10**6, [1.11, 1.11]), gap(2 * 10**6, [1.11, 1.1100001])]
    assert fit_trend(nearly_flat, "params")["zero_at.log10"] is None or math.isfinite(
        fit_trend(nearly_flat, "params")["zero_at.log10"]
    )  # a line whose zero is astronomically far is no overflow
    assert fit_trend([gap(10**3, [1.0, 1.0])], "params") is None  # one cell: no line
