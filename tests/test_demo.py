"""The demo flow end to end at a few steps: corpus -> shards -> matched sweep on Ray Tune -> comparison."""

import collections
import json
import statistics

import numpy as np
import pytest

from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.packing import dropped_tokens, pack_rows, row_count, token_range
from mhf_dist.demo import run_demo
from mhf_dist.errors import DataError


def test_builtin_corpus_needs_no_network_and_is_english_text(monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the built-in corpus opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    documents = builtin_documents()
    assert len(documents) > 50 and sum(map(len, documents)) > 300_000
    assert documents == builtin_documents()
    words = " ".join(documents).lower().split()
    # English running text: its commonest words are the usual function words
    common = {word for word, _ in collections.Counter(words).most_common(10)}
    assert {"the", "a", "of", "is", "to"} <= common


def test_packing_reproduces_the_token_stream_with_every_eos():
    documents = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    stream = [token for doc in documents for token in (*doc, 0)]
    rows = pack_rows(np.array(stream), 3)
    rebuilt = [token for row in rows.tolist() for token in row[:3]] + [rows[-1, -1]]
    assert rebuilt == stream[: len(rebuilt)] and len(rebuilt) + dropped_tokens(len(stream), 3) == len(stream)
    assert rows.shape == (row_count(len(stream), 3), 4) == ((len(stream) - 1) // 3, 4)


def test_any_range_of_rows_packs_alone_from_its_token_range():
    """What lets `mhf prepare` pack each shard in its own task."""
    stream = np.arange(100)
    whole = pack_rows(stream, 7)
    parts = [pack_rows(stream[slice(*token_range(a, b, 7))], 7) for a, b in [(0, 3), (3, 4), (4, 14)]]
    assert np.array_equal(whole, np.concatenate(parts)) and len(whole) == 14
    assert dropped_tokens(100, 7) == (100 - 1) % 7 and dropped_tokens(5, 7) == 5


def test_block_packing_cuts_disjoint_blocks_as_the_authors_group_texts_does():
    stream = np.arange(23)
    rows = pack_rows(stream, 4, "blocks")
    # the authors' rule written out: consecutive blocks of L = seq_len + 1 tokens, the short tail dropped
    blocks = [stream[i : i + 5] for i in range(0, len(stream) - 4, 5)]
    assert np.array_equal(rows, np.stack(blocks)) and row_count(23, 4, "blocks") == 4
    assert dropped_tokens(23, 4, "blocks") == 3 and dropped_tokens(4, 4, "blocks") == 4
    parts = [
        pack_rows(stream[slice(*token_range(a, b, 4, "blocks"))], 4, "blocks") for a, b in [(0, 1), (1, 4)]
    ]
    assert np.array_equal(rows, np.concatenate(parts))


def test_packing_rejects_a_seq_len_below_two():
    with pytest.raises(DataError, match="seq_len >= 2"):
        pack_rows(np.arange(10), 1)


@pytest.fixture
def drawn(monkeypatch):
    """The axes of every figure saved, by title: what each plot shows, read before it becomes pixels."""
    from matplotlib.figure import Figure

    figures = {}
    save = Figure.savefig

    def recorded(figure, *args, **kwargs):
        (axes,) = figure.axes
        figures[axes.get_title()] = axes
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recorded)
    return figures


def pixels_of(png, color) -> int:
    """How many pixels of the PNG file have exactly `color` (a matplotlib colour)."""
    from matplotlib.colors import to_rgb
    from PIL import Image

    with Image.open(png) as image:
        counts = {rgb: count for count, rgb in image.convert("RGB").getcolors(1 << 24)}
    return counts.get(tuple(round(255 * channel) for channel in to_rgb(color)), 0)


def test_demo_runs_a_matched_sweep_and_compares_it_from_mlflow(ray_session, tmp_path, drawn, capfd):
    """The README's first command, small: mhf under both objectives and the two baselines x 2 seeds on
    Ray Tune, compared from MLflow, browsable from the printed address; a quiet console."""
    from mlflow.tracking import MlflowClient

    lines = []
    overrides = [
        "train.steps=8",
        "train.log_every=4",
        "train.eval_rows=16",
        "data.tokenizer=bytes",
        "model.vocab_size=259",
        # One worker per trial keeps six trials' start-up affordable on 2 cores; `mhf train` tests cover 2.
        "topology.workers=1",
    ]
    comparison = run_demo("tiny", overrides, tmp_path, seeds=(0, 1), log=lines.append)
    rows = {row["group"]: row for row in comparison.rows}
    assert set(rows) == {"mhf_coordinates", "mhf_vocab", "qwen3", "qwen3_matched"}
    assert all(r["n_seeds"] == 2 for r in rows.values())
    objectives = {group: row["objective"] for group, row in rows.items()}
    assert objectives == {"mhf_coordinates": "coordinates", "mhf_vocab": "vocab", "qwen3": "softmax",
                          "qwen3_matched": "softmax"}  # fmt: skip

    # The table's numbers are the runs' own metrics, read straight from MLflow.
    uri = f"sqlite:///{next(tmp_path.glob('sweeps/mlflow.db'))}"
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("mhf-demo")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.role = 'sweep'")
    children = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(children) == 8 and parent.info.status == "FINISHED"

    def history(run, metric):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))

    def runs_of(group):
        return [run for run in children if run.data.tags["group"] == group]

    for run in children:  # validation every train.steps / 8 steps (here 1): curves, not single points
        assert [step for step, _ in history(run, "val_nll")] == list(range(1, 9))
    finals = {group: [history(run, "val_nll")[-1][1] for run in runs_of(group)] for group in rows}
    for family, row in rows.items():
        assert row["mean"] == pytest.approx(statistics.fmean(finals[family]), rel=1e-12)
        assert row["std"] == pytest.approx(statistics.stdev(finals[family]), rel=1e-12)
        assert row["min"] == min(finals[family]) and row["max"] == max(finals[family])
    for run in children:
        tags = run.data.tags
        assert tags["sweep"] == parent.data.tags["sweep"] and tags["matched_to"] == "mhf"
        assert int(tags["param_residual"]) == int(tags["param_count"]) - rows["mhf_vocab"]["params"]
        assert {"seed", "param_count", "family"} <= set(tags)
        assert run.data.params["model.hash.loss"] == objectives[tags["group"]] or tags["family"] != "mhf"
        # the prepared shards are each run's dataset input, digest = the manifest's content hash
        (entry,) = run.inputs.dataset_inputs
        assert entry.dataset.digest == manifest["content_sha256"][:12] and entry.dataset.name == "data"
        assert json.loads(entry.dataset.source)["uri"] == str(tmp_path / "data")
    (entry,) = parent.inputs.dataset_inputs  # the sweep's row in the runs table shows it too
    assert entry.dataset.digest == manifest["content_sha256"][:12]
    parent_tags = client.get_run(parent.info.run_id).data.tags
    assert "unstable.mhf_vocab" in parent_tags
    # the comparison table is the parent run's description on its page; the plots are its images
    assert comparison.table in parent_tags["mlflow.note.content"]
    images = {entry.path for entry in client.list_artifacts(parent.info.run_id, "images")}
    for key in ("curves", "finals", "loss"):  # MLflow names them images/<key>+step+0+...png
        assert any(path.startswith(f"images/{key}+step+0") and path.endswith(".png") for path in images)
    seed_curves = [[value for _, value in history(run, "loss")] for run in runs_of("mhf_vocab")]
    assert all(abs(a - b) > 1e-4 for a, b in zip(*seed_curves, strict=True))  # another seed, another curve

    artifacts = {entry.path for entry in client.list_artifacts(parent.info.run_id)}
    assert {"compare.md", "compare.csv", "curves.png", "finals.png", "loss.png"} <= artifacts
    assert [path.name for path in comparison.files[2:]] == ["curves.png", "finals.png", "loss.png"]
    curves_png, finals_png, loss_png = comparison.files[2:]
    # Each curve plot: a line per family, the mean of its seeds' MLflow values at every step, in its
    # own colour on the PNG.
    for png, title, metric in [
        (curves_png, "val_nll: mean over seeds, band = min..max", "val_nll"),
        (loss_png, "training loss (each family's objective): mean over seeds, band = min..max", "loss"),
    ]:
        plotted = drawn[title].get_lines()
        assert sorted(line.get_label() for line in plotted) == [f"{family} (n=2)" for family in sorted(rows)]
        for line in plotted:
            seeds = [dict(history(run, metric)) for run in runs_of(line.get_label().split(" ")[0])]
            steps = sorted(seeds[0])
            assert list(line.get_xdata()) == steps
            assert list(line.get_ydata()) == pytest.approx(
                [statistics.fmean(s[step] for s in seeds) for step in steps]
            )
        assert len({line.get_color() for line in plotted}) == len(plotted)
        assert all(pixels_of(png, line.get_color()) > 50 for line in plotted), png
    # The finals plot: a column per family, a point per seed at that seed's last val_nll.
    axes = drawn["final val_nll per seed"]
    columns = [label.get_text() for label in axes.get_xticklabels()]
    assert columns == sorted(rows) and len(axes.collections) == len(columns)
    for column, (family, points) in enumerate(zip(columns, axes.collections, strict=True)):
        assert set(points.get_offsets()[:, 0]) == {column}
        assert sorted(points.get_offsets()[:, 1]) == pytest.approx(sorted(finals[family]))
        assert pixels_of(finals_png, points.get_facecolor()[0]) > 20
    for group in rows:  # one seeded, sampled continuation per group
        assert sum(line.startswith(f"{group} (seed 0, temperature 0.8) sample:") for line in lines) == 1
    # the printed address opens the experiment's runs in the Model-training view
    page = f"/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    assert f"MLflow UI: mlflow ui --backend-store-uri {uri}  then open http://127.0.0.1:5000{page}" in lines
    stages = [line for line in lines if line.startswith("[") and "] step " not in line]
    assert [line[:5] for line in stages] == ["[1/3]", "[2/3]", "[3/3]"] and all(
        "so far)" in x for x in stages
    )
    # The console: one progress line per trial per log step, named by its trial (through mhf's relay),
    # and nothing of Tune's (its experiment box, its hints) or of Ray's forwarding of worker output.
    progress = sorted(line.split(" | ")[0] for line in lines if "] step " in line)
    trials = [f"{group}-seed{seed}" for group in rows for seed in (0, 1)]
    assert progress == sorted(f"[{trial}] step {step}/8" for trial in trials for step in (4, 8))
    console = capfd.readouterr()
    for foreign in ("Configuration for experiment", "View detailed results", "TensorBoard", " pid="):
        assert foreign not in console.out + console.err


def test_the_demo_trains_both_mhf_objectives_and_qwen3_matched_only_where_it_differs_from_qwen3():
    from mhf_dist.config import load_config
    from mhf_dist.demo import demo_groups

    def names(groups):
        return [entry if isinstance(entry, str) else entry["group"] for entry in groups]

    lines = []
    groups = demo_groups(load_config("tiny"), lines.append)
    assert names(groups) == ["mhf_coordinates", "mhf_vocab", "qwen3", "qwen3_matched"] and lines == []
    assert [entry["set"] for entry in groups[:2]] == [
        {"model.hash.loss": "coordinates"},
        {"model.hash.loss": "vocab"},
    ]
    # At V=2,200 two qwen3 layers already hold mhf's parameters (mhf's do not grow with V).
    groups = demo_groups(load_config("tiny", ["model.vocab_size=2200"]), lines.append)
    assert names(groups) == ["mhf_coordinates", "mhf_vocab", "qwen3"]
    assert lines == ["qwen3_matched skipped: at this size its closest match has qwen3's own 2 layers"]
