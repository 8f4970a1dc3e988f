"""`mhf sweep`: sweep files, trial expansion, and resuming an interrupted sweep on Ray Tune."""

import re
import shutil

import pytest
import yaml
from faults import KillLastWorker

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import ConfigError, DataError, MhfError, console_line
from mhf_dist.eval.tasks import run_task
from mhf_dist.export import export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable
from mhf_dist.sweep.runner import TRIALS_DIR, SweepError, evaluate_trial, run_sweep
from mhf_dist.sweep.spec import expand_trials, load_sweep, parse_sweep, trial_configs
from mhf_dist.tracking import connect, end_run, start_run, tracking_uri
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint

BYTES = {"data.tokenizer": "bytes", "model.vocab_size": 259, "model.hash.spec": "H2B64", "train.seq_len": 32}


def test_a_matched_sweep_expands_to_families_times_seeds():
    spec = parse_sweep({"name": "m", "kind": "matched", "seeds": [0, 1], "set": BYTES})
    trials = expand_trials(spec)
    assert [t.name for t in trials] == [
        "mhf-seed0", "mhf-seed1", "qwen3-seed0", "qwen3-seed1", "qwen3_matched-seed0", "qwen3_matched-seed1",
    ]  # fmt: skip
    assert trials[2].overrides == {**BYTES, "model.family": "qwen3", "train.seed": 0}
    grid = parse_sweep({"name": "g", "kind": "grid", "grid": {"train.lr": [0.001, 0.003]}, "seeds": [5]})
    assert [(t.group, t.seed) for t in expand_trials(grid)] == [("train.lr=0.001", 5), ("train.lr=0.003", 5)]
    seeds = parse_sweep({"name": "s", "kind": "seeds", "seeds": [1, 2, 3]})
    assert {t.group for t in expand_trials(seeds)} == {"mhf"}


def test_a_family_variant_is_its_own_group_with_its_own_overrides():
    vocab = {"group": "mhf_vocab", "family": "mhf", "set": {"model.hash.loss": "vocab"}}
    spec = parse_sweep({"name": "v", "kind": "matched", "families": ["mhf", vocab], "set": BYTES})
    trials = expand_trials(spec)
    assert [(t.name, t.group, t.family) for t in trials] == [
        ("mhf-seed0", "mhf", "mhf"), ("mhf_vocab-seed0", "mhf_vocab", "mhf"),
    ]  # fmt: skip
    losses = {name: cfg.model.hash.loss for name, cfg in trial_configs(spec).items()}
    assert losses == {"mhf-seed0": "coordinates", "mhf_vocab-seed0": "vocab"}
    again = parse_sweep(spec.model_dump())  # a sweep's record reads back as the same sweep
    assert expand_trials(again) == trials
    # a nested `set` merges one key at a time: the variant's train.lr keeps the sweep's train.steps
    variant = {"group": "q", "family": "qwen3", "set": {"train": {"lr": 0.01}}}
    nested = {**BYTES, "train": {"steps": 7, "lr": 0.002}}
    spec = parse_sweep({"name": "v", "kind": "matched", "set": nested, "families": ["mhf", variant]})
    trained = {name: (cfg.train.steps, cfg.train.lr) for name, cfg in trial_configs(spec).items()}
    assert trained == {"mhf-seed0": (7, 0.002), "q-seed0": (7, 0.01)}


def test_a_grid_over_topology_keys_gives_each_trial_its_own_topology():
    grid = {"topology.zero_stage": [0, 2], "topology.workers": [1, 4]}
    spec = parse_sweep({"name": "t", "kind": "grid", "set": {"topology.gpus_per_worker": 1}, "grid": grid})
    topologies = {name: cfg.topology for name, cfg in trial_configs(spec).items()}
    assert {name: (t.zero_stage, t.workers) for name, t in topologies.items()} == {
        "topology.zero_stage=0,topology.workers=1-seed0": (0, 1),
        "topology.zero_stage=0,topology.workers=4-seed0": (0, 4),
        "topology.zero_stage=2,topology.workers=1-seed0": (2, 1),
        "topology.zero_stage=2,topology.workers=4-seed0": (2, 4),
    }
    assert {t.gpus_per_worker for t in topologies.values()} == {1}


def test_a_sweep_whose_evaluate_file_is_missing_fails_before_ray_starts(tmp_path):
    evaluate = [{"task": "ppl", "data": "nowhere.txt"}]
    raw = {"name": "early", "kind": "matched", "set": BYTES, "storage": str(tmp_path), "evaluate": evaluate}
    spec = parse_sweep(raw)
    with pytest.raises(SweepError, match=r"ppl reads 'nowhere.txt', which does not exist"):
        run_sweep(spec)
    assert not list(tmp_path.iterdir())  # no sweep record, no MLflow parent run
    # what the task would refuse after training is refused before: each task reads its file here
    (tmp_path / "text.txt").write_text("Some text.\n")
    (tmp_path / "text.txt.gz").write_bytes(b"")
    (tmp_path / "l.jsonl").write_text('{"text": "one two"}\nnot json\n')
    (tmp_path / "folder").mkdir()
    for entry, line in (
        (
            {"task": "bpb", "data": str(tmp_path)},
            r"^evaluate: data '.*' is a directory; task 'bpb' reads a file",
        ),
        (
            {"task": "ppl", "data": str(tmp_path / "text.txt"), "seq_len": 100000},
            r"^evaluate: ppl's seq_len 100000 is above trial mhf-seed0's model.backbone.max_position_emb",
        ),
        ({"task": "ppl", "data": str(tmp_path / "text.txt.gz")}, r"is text, compressed; ppl and bpb read an"),
        ({"task": "lambada", "data": str(tmp_path / "l.jsonl")}, r"l.jsonl:2: not valid JSON"),
        ({"task": "hellaswag", "data": str(tmp_path / "text.txt")}, r"text.txt:1: not valid JSON"),
        (
            {"task": "card660", "data": str(tmp_path / "l.jsonl")},
            r"l.jsonl:1: expected word1<TAB>word2<TAB>score",
        ),
        ({"task": "ppl", "data": str(tmp_path / "folder")}, r"folder' .*mhf prepare"),
    ):
        with pytest.raises(MhfError, match=line):
            run_sweep(parse_sweep({**raw, "evaluate": [entry]}))
    # `--prepare` prepares nothing before that
    sweep_file = tmp_path / "s.yaml"
    data = str(tmp_path / "data")
    sweep_file.write_text(yaml.safe_dump({**raw, "set": {**BYTES, "data.path": data}, "evaluate": [entry]}))
    assert main(["sweep", "--config", str(sweep_file), "--prepare"]) == 2
    assert not (tmp_path / "data").exists()
    for made in ("text.txt", "text.txt.gz", "l.jsonl", "folder", "s.yaml"):
        shutil.rmtree(tmp_path / made) if made == "folder" else (tmp_path / made).unlink()
    (tmp_path / "mlflow.db").write_text("notes")  # not an MLflow store: MLflow would add its tables
    with pytest.raises(MhfError, match=r"mlflow.db' is not an MLflow store .*; move it away"):
        run_sweep(spec)


def test_a_sweep_whose_shards_do_not_fit_a_trials_model_fails_before_ray_starts(tmp_path, monkeypatch):
    import mhf_dist.sweep.runner as runner

    monkeypatch.setattr(runner, "ensure_ray", lambda **_: pytest.fail("Ray started"))
    recall = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32"]
    prepare(load_config("tiny", recall), tmp_path / "data", log=lambda _: None)
    fits = {"data.path": str(tmp_path / "data"), "model.vocab_size": 40, "train.seq_len": 32}
    raw = {"name": "early", "kind": "grid", "grid": {"model.vocab_size": [40, 41]}, "set": fits}
    with pytest.raises(DataError, match=r"^trial model.vocab_size=41-seed0: shards have vocab_size 40 but"):
        run_sweep(parse_sweep({**raw, "storage": str(tmp_path / "sweeps")}))
    # shards an `evaluate: ppl` scores are checked as `mhf eval` checks them against the trial's model
    # (eval.tasks.check_scored_shards, whose document-format check tests/test_documents.py covers)
    prepare(load_config("tiny", [*recall, "model.vocab_size=41"]), tmp_path / "other", log=lambda _: None)
    prepare(load_config("tiny", [*recall, "train.seq_len=64"]), tmp_path / "long", log=lambda _: None)
    prepare(load_config("tiny", [*recall, "data.val_percent=0"]), tmp_path / "no-val", log=lambda _: None)
    short = {**fits, "model.backbone.max_position_embeddings": 32}
    for data, line in (
        (
            "other",
            r"^trial mhf-seed0: its model has signature fingerprint \w+ but the shards in '.*other' have",
        ),
        (
            "long",
            r"^trial mhf-seed0: shards '.*long' have rows of seq_len 64, above the model's max_position",
        ),
        ("no-val", r"^trial mhf-seed0: prepared data '.*no-val' has no validation rows; prepare them with"),
    ):
        evaluate = [{"task": "ppl", "data": str(tmp_path / data)}]
        raw = {"name": "early", "kind": "seeds", "set": short, "evaluate": evaluate}
        with pytest.raises(DataError, match=line):
            run_sweep(parse_sweep({**raw, "storage": str(tmp_path / "sweeps")}))
    # data.val_percent=0 leaves no validation rows: a sweep compared by val_nll would end with no metric
    raw = {"name": "early", "kind": "seeds", "set": {**fits, "data.path": str(tmp_path / "no-val")}}
    with pytest.raises(
        SweepError, match=r"^trial mhf-seed0: its shards have no validation rows, so no val_nll;"
    ):
        run_sweep(parse_sweep({**raw, "storage": str(tmp_path / "sweeps")}))
    assert not (tmp_path / "sweeps").exists()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"name": "x", "kind": "matched", "families": ["mhf", "gpt2"]}, "families: unknown family 'gpt2'"),
        ({"name": "x", "kind": "matched", "seeds": []}, "seeds: List should have at least 1 item"),
        ({"name": "x", "kind": "seeds", "seeds": [0, 1, 0]}, "seeds: seed 0 comes twice"),
        (
            {"name": "x", "kind": "grid", "grid": {"train.lr": [1e-3, 0.001]}},
            r"trial 'train.lr=0.001-seed0' comes twice",
        ),
        (
            {"name": "x", "kind": "grid", "grid": {"data.corpus": ["a b", "a_b"]}},
            r"trial 'data.corpus=a_b-seed0' comes twice .*name the same directory",
        ),
        ({"name": "x", "kind": "matched", "sedes": [1]}, "sedes: unknown key; allowed: name, kind"),
        ({"kind": "matched"}, r"^sweep: name: missing; add `name: ...` \(README: `mhf sweep`\)$"),
        ({"name": "x", "kind": "seeds", "set": {"train.stpes": 5}}, "unknown key 'train.stpes'"),
        (
            {"name": "x", "kind": "matched", "set": {**BYTES, "topology.workers": 3}},
            r"^sweep: trial mhf-seed0: .*train.batch_size=8 does not split over 3 workers",
        ),
        (
            {"name": "x", "kind": "seeds", "workers": 2},
            r"workers: unknown key; .*set: \{topology.workers: ...\}",
        ),
        (
            {"name": "x", "kind": "seeds", "set": {"topology.storage": "s"}},
            r"^sweep: set: topology.storage is set by the sweep's `storage`, not by `set:` or --set$",
        ),
        # what the sweep sets per trial itself, which a setting would only seem to change
        (
            {"name": "x", "kind": "grid", "grid": {"train.seed": [1, 2]}},
            r"^sweep: grid: train.seed is set by the sweep's `seeds`, not by `grid:`$",
        ),
        (
            {"name": "x", "kind": "grid", "grid": {"train": [{"lr": 0.1}, {"seed": 2}]}},
            r"^sweep: grid: train.seed is set by the sweep's `seeds`, not by `grid:`$",
        ),
        (
            {"name": "x", "kind": "seeds", "set": {"train.seed": 4}},
            r"^sweep: set: train.seed is set by the sweep's",
        ),
        (
            {"name": "x", "kind": "seeds", "set": {"preset": "tiny"}},
            r"^sweep: set: preset is set by the sweep's `config`, not by `set:` or --set$",
        ),
        (
            {"name": "x", "kind": "matched", "set": {"model.family": "qwen3"}},
            r"^sweep: set: model.family is set by its `families`",
        ),
        (
            {"name": "x", "kind": "seeds", "families": ["qwen3"]},
            r"`families` and `matched_to` belong to matched sweeps; a 'seeds' sweep",
        ),
        (
            {"name": "x", "kind": "seeds", "storage": "s3:/bucket/x"},
            r"^sweep: storage: 's3:/bucket/x' is missing a slash of s3://",
        ),
        (
            {"name": "x", "kind": "seeds", "storage": ""},
            r"^sweep: storage: empty; give a value \('.' is the current directory\)$",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "ppl", "data": ""}]},
            r"^sweep: evaluate.0.data: empty; give a value",
        ),
        (
            {"name": "x", "kind": "seeds", "experiment": ""},
            r"^sweep: experiment: String should have at least 1 character",
        ),
        ({"name": "x", "kind": "grid"}, "a grid sweep needs `grid"),
        ({"name": "x y", "kind": "seeds"}, "name: use letters, digits"),
        ({"name": "..", "kind": "seeds"}, r"name: use letters, digits .*starting with a letter or digit\)$"),
        (
            {"name": "x", "kind": "grid", "grid": {"data.path": ["d" * 250]}},
            r"^sweep: trial 'data.path=d+'... is named by 266 characters, over the 200 of a run name; give",
        ),
        (["not", "a", "mapping"], "must be a YAML mapping"),
        ({"name": "x", "kind": "seeds", "evaluate": [{"task": "mmlu"}]}, "unknown task 'mmlu'"),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "ppl", "data": "s3:/b/t.txt"}]},
            r"^sweep: evaluate.0.data: 's3:/b/t.txt' is missing a slash of s3://",
        ),
        (
            {
                "name": "x",
                "kind": "seeds",
                "evaluate": [{"task": "ppl", "data": "a"}, {"task": "ppl", "data": "b"}],
            },
            r"^sweep: evaluate: task 'ppl' comes twice \(both would log eval.ppl.\*\); give each task once",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "recall", "data": "r.txt"}]},
            r"evaluate.0: task 'recall' generates its own examples and reads no file; drop data$",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "ppl"}]},
            r"task 'ppl' reads a file; pass data$",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "ppl", "data": "t", "seq_len": 1}]},
            r"evaluate.0.seq_len: Input should be greater than or equal to 2 \(got 1\); see README: `mhf "
            r"sweep`$",
        ),
        (
            {"name": "x", "kind": "seeds", "seeds": 3},
            r"^sweep: seeds: .* \(got 3\); see README: `mhf sweep`$",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "ppl", "data": "t", "bogus": 1}]},
            r"^sweep: evaluate.0.bogus: unknown key; allowed: task, data, limit, seq_len$",
        ),
        (
            {"name": "x", "kind": "grid", "asha": {"metrc": "loss"}},
            r"asha.metrc: unknown key; allowed: metric,",
        ),
        (
            {"name": "x", "kind": "grid", "asha": "fast"},
            r"asha: Input should be a mapping of its keys \(got 'fast'\)",
        ),
        (
            {"name": "x", "kind": "seeds", "evaluate": [{"task": "lambada", "data": "t", "seq_len": 64}]},
            r"seq_len is read by ppl and bpb only; drop it for task 'lambada'",
        ),
        ({"name": "x", "kind": "matched", "matched_to": "gpt2"}, "matched_to: unknown family 'gpt2'"),
        (
            {"name": "x", "kind": "matched", "families": ["mhf", {"group": "mhf", "family": "mhf"}]},
            "group 'mhf' appears twice",
        ),
        (
            {"name": "x", "kind": "matched", "families": [{"group": "a b", "family": "mhf"}]},
            r"entry 0 \(group\): String should match pattern .*write a variant mapping \{group: NAME",
        ),
        ({"name": "x", "kind": "matched", "families": [{"group": "v", "family": "gpt2"}]}, "unknown family"),
        (
            {
                "name": "x",
                "kind": "matched",
                "families": [{"group": "v", "family": "mhf", "set": {"x.y": 1}}],
            },
            "trial v-seed0: unknown key",
        ),
        ({"name": "x", "kind": "matched", "families": [3]}, "entry 0 is 3; an entry is a family name or"),
        (
            {
                "name": "x",
                "kind": "matched",
                "families": [{"group": "v", "family": "mhf", "set": {"train": {"seed": 1}}}],
            },
            r"entry 0 \(set\): train.seed is set by the sweep's `seeds`, not by a variant's `set`$",
        ),
    ],
)
def test_bad_sweep_files_are_one_line_errors(raw, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_sweep(raw)
    assert "\n" not in str(caught.value)


def test_a_sweeps_set_may_be_what_makes_its_config_file_valid(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text("preset: tiny\ntrain: {seq_len: 8192}\n")  # above the preset's 4096 positions
    for kind, extra in (("seeds", {}), ("grid", {"grid": {"train.lr": [0.01]}})):
        spec = parse_sweep({"name": "x", "kind": kind, "config": str(config),
                            "set": {"model.backbone.max_position_embeddings": 8192}, **extra})  # fmt: skip
        assert [trial.family for trial in expand_trials(spec)] == ["mhf"]  # the tiny preset's


def test_mhf_sweeps_command_line_may_fix_its_file_and_a_mistake_names_who_made_it(tmp_path, capsys):
    """`--storage` and `--set` go on top of the file (and may be what makes it valid); a mistake the file
    makes alone names the file, any other the file with the flags. A setting the sweep makes per trial is
    refused also when nested (`train: {seed: 9}`)."""
    from mhf_dist.cli import main

    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nkind: seeds\n")
    bad_storage = ["--storage", "s3://x/../y"]
    for flags, line in (
        (["--set", "train.lr=abc"], "with --set: trial mhf-seed0: train.lr: Input should be a valid number"),
        (["--set", "preset=100m"], "with --set: set: preset is set by the sweep's `config`, not by `set:`"),
        (["--set", "train={seed: 9}"], "with --set: set: train.seed is set by the sweep's `seeds`, not by"),
        (bad_storage, "with --storage: storage: 's3://x/../y' has an empty, . or .. folder"),
        ([*bad_storage, "--set", "train.lr=abc"], "with --storage and --set: storage: 's3://x/../y' has an"),
    ):
        assert main(["sweep", "--config", str(sweep), *flags]) == 2
        assert capsys.readouterr().err.startswith(f"error: {sweep} {line}")
    # a storage no file can be made in is one line too (its MLflow store is looked at first)
    sweep.write_text(f"name: s\nkind: seeds\nstorage: {tmp_path / ('n' * 300)}\n")
    assert main(["sweep", "--config", str(sweep)]) == 2
    assert re.fullmatch(
        r"error: the name 'n+'\.\.\. is 300 bytes; it may have at most 255 .*\n", capsys.readouterr().err
    )
    # the file's own mistakes, one hidden behind another that --storage fixes
    sweep.write_text("name: s\nkind: seeds\nstorage: s3://x/../y\nset: {topology.workers: 3}\n")
    assert main(["sweep", "--config", str(sweep), "--set", "train.lr=abc"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {sweep}: storage: 's3://x/../y' has an empty")
    fixed = load_sweep(sweep, str(tmp_path / "runs"), {"train.batch_size": 9})  # 9 rows over 3 workers
    assert (fixed.storage, fixed.set) == (
        str(tmp_path / "runs"),
        {"topology.workers": 3, "train.batch_size": 9},
    )
    with pytest.raises(
        ConfigError, match=rf"^{sweep} with --storage: trial mhf-seed0: .*batch_size=8 does not split over 3"
    ):
        load_sweep(sweep, str(tmp_path / "runs"))
    # --set merges one key at a time, as `mhf train` does: a section given whole keeps the file's other keys
    sweep.write_text("name: s\nkind: seeds\nset: {train: {steps: 3}}\n")
    assert load_sweep(sweep, None, {"train": {"lr": 0.002}}).set == {"train.steps": 3, "train.lr": 0.002}
    # a config file that only the sweep's set: makes valid, with a mistake of the set's own
    config = tmp_path / "zero.yaml"
    config.write_text("preset: tiny\ntrain: {steps: 0}\n")
    sweep.write_text(f"name: s\nkind: seeds\nconfig: {config}\nset: {{train.steps: 5}}\n")
    assert load_sweep(sweep).set == {"train.steps": 5}
    with pytest.raises(ConfigError, match=rf"^{sweep} with --set: train.lr: Input should be greater than 0"):
        load_sweep(sweep, None, {"train.lr": -1})


def test_a_spec_read_back_from_its_dump_is_the_same_spec():
    """What a trial and `--resume` read (the spec as sweep.json and Tune hold it) is the spec, for every
    task: ppl and bpb with their default window, the others with none."""
    from mhf_dist.eval.tasks import TASKS
    from mhf_dist.sweep.spec import SweepConfig

    evaluate = [{"task": task} if task == "recall" else {"task": task, "data": "f"} for task in TASKS]
    spec = parse_sweep({"name": "x", "kind": "seeds", "evaluate": evaluate})
    assert [task.seq_len for task in spec.evaluate] == [128 if t in ("ppl", "bpb") else None for t in TASKS]
    assert SweepConfig.model_validate(spec.model_dump(mode="json")) == spec


def test_a_missing_sweep_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_sweep(tmp_path / "nope.yaml")


def test_an_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_session, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # relative paths in the sweep: trials must resolve them from here too
    prepare(load_config("tiny", BYTES), "data", log=lambda _: None)
    (tmp_path / "held_out.txt").write_text("A held-out line of text.\n\nAnother one, for bits per byte.\n")
    (tmp_path / "lambada.jsonl").write_text('{"text": "the cat sat on the mat"}\n')
    # Two trials; the second loses a worker after step 3 (a test callback; no restarts), after its step-2
    # checkpoint.
    spec = parse_sweep(
        {
            "name": "crashy",
            "kind": "grid",
            "set": {
                **BYTES,
                "data.path": "data",
                "train.steps": 4,
                "train.checkpoint_every": 2,
                "topology.workers": 1,
            },
            "grid": {"train.lr": [0.003, 0.002]},
            "storage": "sweeps",
            "evaluate": [
                {"task": "bpb", "data": "held_out.txt", "seq_len": 8},
                {"task": "lambada", "data": "lambada.jsonl"},  # no window: a trial reads it as given
            ],
        }
    )
    trials = tmp_path / "sweeps" / "crashy" / TRIALS_DIR
    fault = KillLastWorker(step=3, marker=tmp_path / "fault-injected", run="train.lr=0.002-seed0")
    lines = []
    with pytest.raises(SweepError, match=r"1 of 2 trials failed \(train.lr=0.002-seed0\)") as failure:
        run_sweep(spec, log=lines.append, worker_callbacks=[fault])
    assert console_line(failure.value, ["sweep", "--config", "s.yaml"]).endswith(
        "; finish the sweep with: mhf sweep --config s.yaml --resume"
    )
    assert fault.marker.is_file()
    (failed,) = [line for line in lines if line.startswith("trial train.lr=0.002-seed0 failed: ")]
    assert "worker process has died" in failed, failed  # the killed worker, not a wrapper's first line
    finished_files = sorted(path.stat().st_mtime_ns for path in (trials / "train.lr=0.003-seed0").rglob("*"))

    result = run_sweep(spec, resume=True, log=lambda _: None)
    assert sorted(t["status"] for t in result.trials) == ["FINISHED", "FINISHED"]
    # The finished trial was not rerun: none of its files changed.
    assert (
        sorted(p.stat().st_mtime_ns for p in (trials / "train.lr=0.003-seed0").rglob("*")) == finished_files
    )
    client = MlflowClient(tracking_uri=result.tracking_uri)
    children = client.search_runs(
        [client.get_experiment_by_name("mhf-sweeps").experiment_id],
        f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    assert len(children) == 2 and all(run.info.status == "FINISHED" for run in children)
    for run in children:  # the crashed trial continued in its own MLflow run: every step once
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]
        # `evaluate`: the trial's exported model's bits per byte on the held-out file, at the last step
        (bpb,) = client.get_metric_history(run.info.run_id, "eval.bpb.bits_per_byte")
        exported = load_exported(newest_checkpoint(trials / run.info.run_name) / MODEL_DIR)
        expected = run_task(exported, "bpb", tmp_path / "held_out.txt", seq_len=8)["bits_per_byte"]
        assert bpb.step == 4 and bpb.value == pytest.approx(expected, rel=1e-9)
        (lambada,) = client.get_metric_history(run.info.run_id, "eval.lambada.ppl")
        expected = run_task(exported, "lambada", tmp_path / "lambada.jsonl")["ppl"]
        assert lambada.step == 4 and lambada.value == pytest.approx(expected, rel=1e-9)
    assert client.get_run(result.parent_run_id).info.status == "FINISHED"
    with pytest.raises(SweepError, match="already exists"):
        run_sweep(spec, log=lambda _: None)


def test_a_trial_whose_evaluation_fails_after_training_ends_its_mlflow_run_failed(tmp_path, monkeypatch):
    """What reading the file before the sweep cannot show (a passage longer than the trial's positions)
    fails the trained trial's evaluation: its run, ended FINISHED by training, is FAILED."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    overrides = {**BYTES, "train.seq_len": 16, "model.backbone.max_position_embeddings": 16}
    cfg = load_config("tiny", [f"{key}={value}" for key, value in overrides.items()])
    tokenizer = TextTokenizer.bytes()
    tokenizer.save(tmp_path / "tokenizer.json")
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    model = build_model(cfg.model, table)
    export_model(model, cfg.model, table, tmp_path / "tokenizer.json", tmp_path / "model")
    (tmp_path / "long.jsonl").write_text('{"text": "a passage longer than sixteen positions ends here"}\n')
    evaluate = [{"task": "lambada", "data": str(tmp_path / "long.jsonl")}]
    spec = parse_sweep({"name": "e", "kind": "matched", "evaluate": evaluate})
    uri = tracking_uri(tmp_path)
    run_id = start_run(uri, "mhf-sweeps", "mhf-seed0", {}, {})
    end_run(uri, run_id, "FINISHED")
    with pytest.raises(MhfError, match=r"long.jsonl:1: the example reads a sequence of length"):
        evaluate_trial(spec, cfg, str(tmp_path / "model"), uri, run_id)
    assert connect(uri).get_run(run_id).info.status == "FAILED"


def test_asha_lets_a_trial_that_reaches_its_last_step_finish_and_ends_the_runs_it_stopped(
    ray_session, tmp_path
):
    """One trial at a time: the better one runs to its last step (a checkpoint with its exported model,
    its MLflow run FINISHED); the worse one ASHA stops at its first rung is STOPPED, its run KILLED."""
    from mlflow.tracking import MlflowClient

    prepare(load_config("tiny", BYTES), tmp_path / "data", log=lambda _: None)
    spec = parse_sweep(
        {
            "name": "halving",
            "kind": "grid",
            "set": {**BYTES, "data.path": str(tmp_path / "data"), "train.steps": 6, "train.log_every": 1,
                    "topology.workers": 1},
            "grid": {"train.lr": [0.01, 0.001]},  # 0.001's loss at step 2 is the higher
            "storage": str(tmp_path / "sweeps"),
            "asha": {"metric": "loss", "grace_period": 2, "reduction_factor": 2},
            "max_concurrent": 1,
        }
    )  # fmt: skip
    result = run_sweep(spec, log=lambda _: None)
    assert {t["name"]: t["status"] for t in result.trials} == {
        "train.lr=0.01-seed0": "FINISHED", "train.lr=0.001-seed0": "STOPPED"
    }  # fmt: skip
    client = MlflowClient(tracking_uri=result.tracking_uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("mhf-sweeps").experiment_id],
        f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    status = {run.info.run_name: run.info.status for run in runs}
    assert status == {"train.lr=0.01-seed0": "FINISHED", "train.lr=0.001-seed0": "KILLED"}
    finished = newest_checkpoint(tmp_path / "sweeps" / "halving" / TRIALS_DIR / "train.lr=0.01-seed0")
    assert finished.name.endswith("0006") and (finished / MODEL_DIR / "config.json").is_file()


def test_an_interrupted_sweep_marks_killed_the_trials_it_stopped_and_keeps_an_earlier_failure(tmp_path):
    """A trial still RUNNING, or one that saw the stop as its fit failing (FAILED since the signal),
    was stopped by the interrupt; a trial that had failed before keeps FAILED."""
    import time

    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    from mhf_dist.tracking import connect, end_stopped_children, tracking_uri

    uri = tracking_uri(tmp_path)
    client = connect(uri)
    experiment = client.create_experiment("sweep")
    parent = client.create_run(experiment).info.run_id

    def child(status=None):
        run_id = client.create_run(experiment, tags={MLFLOW_PARENT_RUN_ID: parent}).info.run_id
        if status:
            client.set_terminated(run_id, status)
        return run_id

    failed_before, finished = child("FAILED"), child("FINISHED")
    time.sleep(0.05)
    stopped_at = time.time()
    failed_by_the_stop, running = child("FAILED"), child()
    end_stopped_children(uri, parent, stopped_at)
    statuses = [
        client.get_run(run).info.status for run in (failed_before, finished, failed_by_the_stop, running)
    ]
    assert statuses == ["FAILED", "FINISHED", "KILLED", "KILLED"]
    assert client.get_run(parent).info.status == "RUNNING"  # the sweep's own run is ended by its caller
