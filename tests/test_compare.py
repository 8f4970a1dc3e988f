"""`mhf compare` on runs logged straight to MLflow's embedded SQLite store, the one `mhf train` writes
by default, with the params the trainer logs (no Ray): groups are seeds of one setting; and the
look-ups of the commands that read MLflow (`mhf compare --sweep`, `mhf eval --run-id`), which create
no store and check an id before any work."""

import sqlite3
import statistics
from contextlib import closing

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from mhf_dist.cli import main
from mhf_dist.compare import CompareError, compare_runs, read_runs
from mhf_dist.config import load_config
from mhf_dist.tracking import TrackingError, check_run, tracking_uri

# (zero_stage, seed) -> the run's val_nll at steps 1 and 2
FINALS = {(0, 0): (3.0, 2.0), (0, 1): (3.1, 2.2), (2, 0): (3.2, 2.5), (2, 1): (3.3, 2.9)}
# The issue's seven runs: (train.steps, seed), every one seed 0
REPEATS = [(4, 0), (4, 0), (6, 0), (6, 0), (50, 0), (50, 0), (50, 0)]
LENGTHS = [(4, 0), (4, 1), (50, 0), (50, 1)]


def log_run(client, experiment, overrides, values, tags=()):
    """A finished run as `mhf train` logs it: every config key a param, val_nll and loss at steps 1.."""
    cfg = load_config("tiny", overrides)
    seed = cfg.train.seed
    run_tags = {"family": "mhf", "seed": str(seed), "param_count": "1000", "objective": "coordinates"}
    run_id = client.create_run(experiment, tags={**run_tags, **dict(tags)}).info.run_id
    params = [Param(key, str(value)) for key, value in cfg.flat().items()]  # what the trainer logs
    metrics = [
        Metric(name, value, 0, step)
        for step, value in enumerate(values, start=1)
        for name in ("val_nll", "loss")
    ]
    client.log_batch(run_id, metrics=metrics, params=params)
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store holding four finished mhf runs (experiment `stages`: ZeRO stages 0 and 2, seeds 0 and 1),
    the issue's seven runs of one seed (`repeats`), runs of two lengths (`lengths`), two seeds whose
    curves stop at different steps (`stopped`) and a sweep of two trials (`sweeps`)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = tracking_uri(root)
    client = MlflowClient(tracking_uri=uri)

    def create_experiment(name: str) -> str:  # artifacts in the test's folder, not the working directory's
        return client.create_experiment(name, artifact_location=str(root / "artifacts" / name))

    experiment = create_experiment("stages")
    for (stage, seed), values in FINALS.items():
        log_run(client, experiment, {"topology.zero_stage": stage, "train.seed": seed}, values)
    repeats = create_experiment("repeats")
    for steps, seed in REPEATS:
        log_run(client, repeats, {"train.steps": steps, "train.seed": seed}, [3.0, 2.0 + steps / 100])
    lengths = create_experiment("lengths")
    for steps, seed in LENGTHS:
        log_run(client, lengths, {"train.steps": steps, "train.seed": seed}, [3.0, 2.0 + steps / 100 + seed])
    stopped = create_experiment("stopped")
    log_run(client, stopped, {"train.seed": 0}, [3.0, 2.5, 2.0])
    log_run(client, stopped, {"train.seed": 1}, [3.0, 2.6])
    sweeps = create_experiment("sweeps")
    parent = client.create_run(sweeps, run_name="seeds-a", tags={"role": "sweep"}).info.run_id
    client.set_terminated(parent, "FINISHED")
    for seed in (0, 1):
        log_run(client, sweeps, {"train.seed": seed}, [3.0, 2.0 + seed], {"mlflow.parentRunId": parent})
    log_run(client, sweeps, {"train.seed": 0}, [3.0, 9.0])  # outside the sweep: a second seed 0
    return uri


@pytest.fixture(scope="module")
def sweep(store):
    """(the sweep's parent run id, one of its trials' run id) in experiment `sweeps`."""
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    parent = next(run.info.run_id for run in runs if run.data.tags.get("role") == "sweep")
    trial = next(run.info.run_id for run in runs if run.data.tags.get("mlflow.parentRunId") == parent)
    return parent, trial


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
    # By default the runs group by family, and the family's runs differ in their ZeRO stage: split by it.
    default = compare_runs(store, "stages", tmp_path / "default")
    assert [(row["group"], row["n_seeds"]) for row in default.rows] == [
        ("mhf,topology.zero_stage=0", 2),
        ("mhf,topology.zero_stage=2", 2),
    ]
    assert default.notes == ["grouped also by topology.zero_stage: the runs of 'mhf' differ in it"]


def test_grouping_by_a_key_no_run_has_is_a_one_line_error(store, tmp_path):
    with pytest.raises(CompareError, match=r"has no MLflow param or tag 'topology.zero'; --group-by takes"):
        compare_runs(store, "stages", tmp_path, group_by=["topology.zero"])


def test_the_cli_passes_group_by_through(store, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    argv = ["compare", "--experiment", "stages", "--out", str(tmp_path), "--group-by", "topology.zero_stage"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| topology.zero_stage=0 |" in table and "| topology.zero_stage=2 |" in table


def test_the_report_goes_to_a_bucket_with_out_a_bucket_uri(store, bucket, monkeypatch, capsys):
    from mhf_dist.storage import Location

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    out = f"{bucket}/reports/stages"
    assert main(["compare", "--experiment", "stages", "--out", out, "--metric", "val_nll"]) == 0
    written = dict(Location.of(out).files())
    assert set(written) == {"compare.md", "compare.csv", "curves.png", "finals.png", "loss.png"}
    csv_rows = (Location.of(out) / "compare.csv").read_text().splitlines()
    assert csv_rows[0].startswith("group,family,objective,n_seeds,mean")
    assert csv_rows[1].startswith('"mhf,topology.zero_stage=0",mhf,coordinates,2,')
    assert (Location.of(out) / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"written: {out}/compare.md" in capsys.readouterr().out


def test_out_naming_a_file_is_a_one_line_error_before_anything_is_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # never asked: the check comes first
    taken = tmp_path / "report.md"
    taken.write_text("mine\n")
    assert main(["compare", "--experiment", "stages", "--out", str(taken)]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # the argument's own check
    assert line.startswith("error: ") and f"'{taken}' is a file" in line
    with pytest.raises(CompareError) as raised:  # the library's, for callers from Python
        compare_runs("http://127.0.0.1:9", "stages", taken)
    assert str(raised.value) == (
        f"the report directory '{taken}' is a file; give --out a directory (it gets compare.md, "
        "compare.csv and the plots)"
    )
    assert taken.read_text() == "mine\n"


def test_the_issues_seven_runs_of_one_seed_are_one_error_line_not_seven_seeds(
    store, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert main(["compare", "--experiment", "repeats", "--out", str(tmp_path / "report")]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    # Split by length first (4, 50 and 6 steps sort as text): the 4-step group has seed 0 twice.
    assert line.startswith("error: group 'mhf,train.steps=4' has 2 runs of seed 0 (")
    assert line.endswith(
        "a group's runs must be distinct seeds: compare one sweep with --sweep PARENT_RUN_ID, tell the runs "
        "apart with --group-by KEY, or delete the extra ones (mlflow runs delete --run-id ID)"
    )
    client = MlflowClient(tracking_uri=store)
    four_steps = client.search_runs(
        [client.get_experiment_by_name("repeats").experiment_id], "params.`train.steps` = '4'"
    )
    assert all(run.info.run_id in line for run in four_steps) and len(four_steps) == 2
    assert "n_seeds" not in captured.out and not (tmp_path / "report").exists()


def test_runs_of_two_lengths_are_two_groups_and_the_report_says_why(store, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert main(["compare", "--experiment", "lengths", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    note = "grouped also by train.steps: the runs of 'mhf' differ in it"
    assert note in out.splitlines() and note in (tmp_path / "compare.md").read_text()
    rows = {row.split("|")[1].strip(): row.split("|") for row in out.splitlines() if row.startswith("| mhf")}
    assert set(rows) == {"mhf,train.steps=4", "mhf,train.steps=50"}
    for steps in (4, 50):
        finals = [2.0 + steps / 100 + seed for s, seed in LENGTHS if s == steps]
        row = rows[f"mhf,train.steps={steps}"]
        assert row[4].strip() == "2"  # n_seeds: seeds 0 and 1
        assert float(row[5]) == pytest.approx(statistics.fmean(finals), rel=1e-4)


def test_runs_whose_curves_end_at_different_steps_are_split_by_the_final_step(store):
    curves = read_runs(store, "stopped", "val_nll")
    assert [(curve.group, curve.seed, curve.final) for curve in curves] == [
        ("mhf,final_step=2", 1, 2.6),
        ("mhf,final_step=3", 0, 2.0),
    ]


def test_seeds_are_counted_from_the_train_seed_param_within_a_sweep(store, sweep, tmp_path):
    parent, _ = sweep
    (row,) = compare_runs(store, "sweeps", tmp_path, sweep_run_id=parent).rows
    assert (row["group"], row["n_seeds"], row["mean"]) == ("mhf", 2, pytest.approx(2.5))
    with pytest.raises(CompareError, match=r"^group 'mhf' has 2 runs of seed 0 \("):
        read_runs(store, "sweeps", "val_nll")  # the whole experiment: the run outside the sweep too


@pytest.mark.parametrize("given", ["0123456789abcdef0123456789abcdef", "not-an-id'", "trial"])
def test_an_unknown_sweep_id_names_the_experiments_sweeps_before_any_work(store, sweep, given, tmp_path):
    parent, trial = sweep
    given = trial if given == "trial" else given  # a trial is a run, but not a sweep's parent
    with pytest.raises(CompareError) as raised:
        compare_runs(store, "sweeps", tmp_path / "report", sweep_run_id=given)
    assert str(raised.value) == (
        f"--sweep {given!r} is not a sweep run of experiment 'sweeps' at {store!r}; give the parent run id "
        f"`mhf sweep` printed (newest here: {parent} (seeds-a))"
    )
    assert not (tmp_path / "report").exists()
    with pytest.raises(CompareError, match=r"\(the experiment has no sweep runs: check --experiment\)$"):
        compare_runs(store, "stages", tmp_path / "report", sweep_run_id=parent)


def test_reading_commands_create_no_store_where_there_is_none(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    nowhere = tmp_path / "nowhere"
    model = tmp_path / "model"
    model.mkdir()  # never opened: the store is checked first
    commands = [
        ["compare", "--experiment", "stages", "--storage", str(nowhere)],
        ["eval", "--model", str(model), "--task", "ppl", "--run-id", "abc", "--storage", str(nowhere)],
    ]
    for argv in commands:
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: no MLflow store at '{nowhere / 'mlflow.db'}'; give the --storage a run wrote to, or set "
            "MLFLOW_TRACKING_URI"
        ]
        assert not nowhere.exists()
    with pytest.raises(TrackingError, match=r"^no MLflow store at "):  # from Python too
        read_runs(f"sqlite:///{nowhere / 'mlflow.db'}", "stages", "val_nll")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{nowhere / 'mlflow.db'}")
    assert main(commands[0]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: no MLflow store at '{nowhere / 'mlflow.db'}' (MLFLOW_TRACKING_URI); fix MLFLOW_TRACKING_URI "
        "to the store a run wrote to, or unset it to read --storage's"
    ]
    assert not nowhere.exists()


@pytest.mark.parametrize("content", [b"", b"not a database at all, but text", "another program's"])
def test_reading_commands_write_nothing_into_a_file_that_is_not_an_mlflow_store(
    content, tmp_path, monkeypatch, capsys
):
    """MLflow given a SQLite file without its tables would create them in it: an empty file grew to 1 MB."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = tmp_path / "mlflow.db"
    if isinstance(content, bytes):
        store.write_bytes(content)
    else:
        with closing(sqlite3.connect(store)) as db:
            db.execute("CREATE TABLE notes (text)")
            db.commit()
    before = store.read_bytes()
    assert (
        main(["compare", "--experiment", "stages", "--storage", str(tmp_path), "--out", str(tmp_path / "r")])
        == 2
    )
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {str(store)!r} is not an MLflow store (")
    assert store.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_eval_looks_its_run_up_before_scoring(store, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    model = tmp_path / "model"
    model.mkdir()  # not a model: loading it would fail with another line, so nothing is scored first
    assert main(["eval", "--model", str(model), "--task", "ppl", "--run-id", "0" * 32]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error: no MLflow run '{'0' * 32}' at {store!r}; give --run-id the id `mhf train` printed "
        '("MLflow run ID at ..."), with the --storage or MLFLOW_TRACKING_URI that run wrote to'
    ]
    assert captured.out == ""


def test_check_run_passes_a_live_run_and_refuses_a_deleted_one(store, sweep):
    client = MlflowClient(tracking_uri=store)
    check_run(store, sweep[1])
    doomed = client.create_run(client.get_experiment_by_name("stages").experiment_id).info.run_id
    client.delete_run(doomed)
    with pytest.raises(TrackingError, match=rf"^no MLflow run '{doomed}' at "):
        check_run(store, doomed)


def test_a_report_directory_under_a_file_is_a_one_line_error_before_anything_is_read(tmp_path, capsys):
    storage = tmp_path / "storage"
    storage.mkdir()
    (storage / "compare").write_text("mine\n")  # the default --out is <storage>/compare/<experiment>
    with pytest.raises(CompareError) as raised:
        compare_runs("http://127.0.0.1:9", "stages", storage / "compare" / "stages")
    assert str(raised.value) == (
        f"the report directory '{storage / 'compare' / 'stages'}' cannot be created: "
        f"'{storage / 'compare'}' is a file; give --out a directory that is not under a file"
    )
    assert (storage / "compare").read_text() == "mine\n"
