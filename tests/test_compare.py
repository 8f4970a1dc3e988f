"""`mhf compare` on runs logged straight to MLflow's embedded SQLite store, the one `mhf train` writes
by default, with the params the trainer logs (no Ray)."""

import statistics

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from mhf_dist.compare import CompareError, compare_runs
from mhf_dist.config import load_config
from mhf_dist.tracking import tracking_uri

# (zero_stage, seed) -> the run's val_nll at steps 1 and 2
FINALS = {(0, 0): (3.0, 2.0), (0, 1): (3.1, 2.2), (2, 0): (3.2, 2.5), (2, 1): (3.3, 2.9)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store holding four finished mhf runs: ZeRO stages 0 and 2, seeds 0 and 1."""
    uri = tracking_uri(tmp_path_factory.mktemp("mlflow"))
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("stages")
    for (stage, seed), values in FINALS.items():
        cfg = load_config("tiny", {"topology.zero_stage": stage, "train.seed": seed})
        tags = {"family": "mhf", "seed": str(seed), "param_count": "1000", "objective": "coordinates"}
        run_id = client.create_run(experiment, tags=tags).info.run_id
        params = [Param(key, str(value)) for key, value in cfg.flat().items()]  # what the trainer logs
        metrics = [
            Metric(name, value, 0, step)
            for step, value in enumerate(values, start=1)
            for name in ("val_nll", "loss")
        ]
        client.log_batch(run_id, metrics=metrics, params=params)
        client.set_terminated(run_id, "FINISHED")
    return uri


def test_runs_differing_only_in_zero_stage_form_one_group_per_stage(store, tmp_path):
    comparison = compare_runs(store, "stages", tmp_path, group_by=["topology.zero_stage"])
    rows = {row["group"]: row for row in comparison.rows}
    assert set(rows) == {"topology.zero_stage=0", "topology.zero_stage=2"}
    for stage in (0, 2):
        finals = [values[-1] for (s, _), values in FINALS.items() if s == stage]
        row = rows[f"topology.zero_stage={stage}"]
        assert (row["n_seeds"], row["family"]) == (2, "mhf")
        assert row["mean"] == pytest.approx(statistics.fmean(finals), rel=1e-12)
        assert (row["min"], row["max"]) == (min(finals), max(finals))


def test_grouping_by_two_keys_names_both_and_by_default_runs_group_by_family(store, tmp_path):
    two = compare_runs(store, "stages", tmp_path / "two", group_by=["model.family", "topology.zero_stage"])
    assert [row["group"] for row in two.rows] == [
        "model.family=mhf,topology.zero_stage=0",
        "model.family=mhf,topology.zero_stage=2",
    ]
    (default,) = compare_runs(store, "stages", tmp_path / "default").rows
    assert (default["group"], default["n_seeds"]) == ("mhf", 4)


def test_grouping_by_a_key_no_run_has_is_a_one_line_error(store, tmp_path):
    with pytest.raises(CompareError, match=r"has no MLflow param or tag 'topology.zero'; --group-by takes"):
        compare_runs(store, "stages", tmp_path, group_by=["topology.zero"])


def test_the_cli_passes_group_by_through(store, tmp_path, monkeypatch, capsys):
    from mhf_dist.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    argv = ["compare", "--experiment", "stages", "--out", str(tmp_path), "--group-by", "topology.zero_stage"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| topology.zero_stage=0 |" in table and "| topology.zero_stage=2 |" in table


def test_the_report_goes_to_a_bucket_with_out_a_bucket_uri(store, bucket, monkeypatch, capsys):
    from mhf_dist.cli import main
    from mhf_dist.storage import Location

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    out = f"{bucket}/reports/stages"
    assert main(["compare", "--experiment", "stages", "--out", out, "--metric", "val_nll"]) == 0
    written = dict(Location.of(out).files())
    assert set(written) == {"compare.md", "compare.csv", "curves.png", "finals.png", "loss.png"}
    csv_rows = (Location.of(out) / "compare.csv").read_text().splitlines()
    assert csv_rows[0].startswith("group,family,objective,n_seeds,mean")
    assert csv_rows[1].startswith("mhf,mhf,coordinates,4,")
    assert (Location.of(out) / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"written: {out}/compare.md" in capsys.readouterr().out


def test_out_naming_a_file_is_a_one_line_error_before_anything_is_read(tmp_path, monkeypatch, capsys):
    from mhf_dist.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # never asked: the check comes first
    taken = tmp_path / "report.md"
    taken.write_text("mine\n")
    assert main(["compare", "--experiment", "stages", "--out", str(taken)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: the report directory '{taken}' is a file; give --out a directory (it gets compare.md, "
        "compare.csv and the plots)"
    )
    assert taken.read_text() == "mine\n"
