"""Training with nothing on a shared disk: shards, checkpoints and the exported model in a bucket of a
real S3-protocol server (moto on 127.0.0.1), a worker killed mid-run, and the run's loss curve
identical to the same run on a local disk."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from faults import KillLastWorker
from test_sources import mixture_cfg, write_corpora

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.storage import Location, StorageError
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint, read_history
from mhf_dist.train.ray_trainer import TrainOptions, train

TRAIN = [
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "train.steps=8",
    "train.log_every=4",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=2",
    "train.eval_rows=8",
]


@pytest.fixture(scope="module")
def mixed_in_bucket(ray_session, s3_server):
    """A .jsonl.gz and a parquet corpus in a bucket, mixed 3:1 by `mhf prepare` into shards in the same
    bucket (tests/test_sources.py checks the mixture itself)."""
    bucket = s3_server.make_bucket("storage-chain")
    write_corpora(Location.of(f"{bucket}/corpora"))
    cfg = mixture_cfg(f"{bucket}/corpora", f"{bucket}/data")
    sources = [source.model_dump(exclude_none=True) for source in cfg.data.sources]
    argv = [
        "prepare",
        "--config",
        "tiny",
        "--out",
        cfg.data.path,
        "--set",
        f"data.sources={json.dumps(sources)}",
    ]
    keys = (
        "data.tokenizer",
        "model.vocab_size",
        "model.hash.spec",
        "data.rows_per_shard",
        "data.val_percent",
    )
    flat = cfg.flat()
    argv += [arg for key in keys for arg in ("--set", f"{key}={flat[key]}")]
    assert main([*argv, "--set", f"train.seq_len={cfg.train.seq_len}"]) == 0
    return bucket, cfg


def test_mixed_corpora_in_a_bucket_train_with_a_killed_worker_to_the_uninterrupted_curve(
    mixed_in_bucket, tmp_path, monkeypatch, capsys
):
    """The issue's chain: shards prepared into the bucket -> a 2-worker run stored only in the bucket,
    one worker killed after step 5 and the run restarted from the bucket's checkpoint, its loss curve the
    uninterrupted run's -> `mhf eval` and `mhf generate` on the exported model in the bucket."""
    from mlflow.tracking import MlflowClient

    bucket, cfg = mixed_in_bucket
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    storage = f"{bucket}/runs"
    remote = load_config(
        "tiny", [*TRAIN, *(f"{k}={v}" for k, v in flat_data(cfg)), f"topology.storage={storage}"]
    )
    fault = KillLastWorker(step=5, marker=tmp_path / "fault-injected")
    result = train(remote, TrainOptions(name="cut", max_failures=1), worker_callbacks=[fault])
    assert fault.marker.is_file()  # the worker did die, after the step-4 checkpoint

    assert result.checkpoint.remote and result.checkpoint.uri == f"{storage}/cut/checkpoint-0000008"
    stored = [path.name for path in Location.of(f"{storage}/cut").children()]
    assert [name for name in stored if name.startswith("checkpoint-")] == [
        "checkpoint-0000006",
        "checkpoint-0000008",
    ]  # train.keep_checkpoints=2 applied in the bucket
    assert {"mlflow-logged.json", "mlflow-run.json"} <= set(stored)
    assert newest_checkpoint(Location.of(f"{storage}/cut")) == result.checkpoint
    assert not list(tmp_path.glob("**/checkpoint-*"))  # nothing of the run on the local disk

    local = remote.model_copy(
        update={"topology": remote.topology.model_copy(update={"storage": str(tmp_path)})}
    )
    whole = read_history(train(local, TrainOptions(name="whole")).checkpoint)
    resumed = read_history(result.checkpoint)
    assert [h["step"] for h in resumed] == list(range(1, 9))
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in whole], abs=1e-6)
    # Tokens per source: every training token of the 8 global batches, counted once across the restart.
    seen = {key: value for key, value in resumed[-1].items() if key.startswith("tokens_seen.")}
    assert set(seen) == {"tokens_seen.web", "tokens_seen.code"} and min(seen.values()) > 0
    assert sum(seen.values()) == 8 * 8 * (cfg.train.seq_len + 1)
    assert seen == {key: whole[-1][key] for key in seen}

    client = MlflowClient(result.tracking_uri)
    artifacts = client.list_artifacts(result.run_id)
    assert sorted(artifact.path for artifact in artifacts) == ["model", "run.json"]
    logged = client.get_metric_history(result.run_id, "tokens_seen.code")
    assert [m.step for m in logged] == [2, 4, 6, 8] and logged[-1].value == seen["tokens_seen.code"]
    record = (Location.of(f"{storage}/cut") / "mlflow-run.json").read_text()
    assert "testing" not in record  # no credentials stored with the run

    model = (result.checkpoint / MODEL_DIR).uri
    capsys.readouterr()
    assert main(["eval", "--model", model, "--task", "ppl", "--data", cfg.data.path]) == 0
    assert "ppl" in capsys.readouterr().out
    assert main(["generate", "--model", model, "--prompt", "abc", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


def flat_data(cfg):
    """The prepared data's settings, as `--set` pairs for a training config."""
    flat = cfg.flat()
    keys = ["data.path", "data.tokenizer", "model.vocab_size", "model.hash.spec", "train.seq_len"]
    return [(key, flat[key]) for key in keys]


@pytest.mark.parametrize(
    ("storage", "says"),
    [
        ("s3://no-such-bucket-here/runs", "the bucket of 's3://no-such-bucket-here/runs' does not exist"),
        ("nosuchscheme://bucket/runs", "pyarrow knows no filesystem for nosuchscheme://"),
        ("s3://bucket//runs/..", "'s3://bucket//runs/..' has an empty, . or .. folder in its path"),
    ],
)
def test_unusable_storage_is_one_line_and_exit_2_within_30_s(mixed_in_bucket, storage, says):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mhf_dist.cli", "train", "--config", "tiny", "--storage", storage]
        + [arg for key, value in flat_data(mixed_in_bucket[1]) for arg in ("--set", f"{key}={value}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], done.stderr


def test_a_closed_port_is_one_line_within_seconds(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"cannot reach the object store at http://127\.0\.0\.1:9"):
        Location.of("s3://some-bucket/x").exists()
    assert time.monotonic() - started < 30


@pytest.fixture
def refusing_gcs(monkeypatch):
    """STORAGE_EMULATOR_HOST at a server on 127.0.0.1 that answers every request 403 Forbidden."""
    import http.server
    import threading

    class Forbidden(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()


CLOSED = "http://127.0.0.1:9"  # discard: nothing listens
NO_BUCKET = "the bucket of '{uri}' does not exist; create it or fix the URI"
UNREACHABLE = "cannot reach the object store at "
GCS_UNREACHABLE = "cannot reach Google Cloud Storage for '{uri}'; check the network or STORAGE_EMULATOR_HOST"
GCS_REFUSED = "the object store refused the credentials for '{uri}'; check GOOGLE_APPLICATION_CREDENTIALS"


@pytest.mark.parametrize(
    ("signal", "uri", "environment", "act", "says"),
    [
        ("AWS Error NO_SUCH_BUCKET during ", "s3://no-such-bucket/x", {}, "write", NO_BUCKET),
        ("To create buckets, enable the allow_bucket_creation option", "s3://no-such-bucket/x", {}, "mkdir",
         NO_BUCKET),
        ("AWS Error NETWORK_CONNECTION during ", "s3://b/x", {"AWS_ENDPOINT_URL": CLOSED}, "read",
         UNREACHABLE),
        ("google::cloud::Status(UNAVAILABLE: ", "gs://b/x", {"STORAGE_EMULATOR_HOST": CLOSED}, "read",
         GCS_UNREACHABLE),
        ("google::cloud::Status(UNAVAILABLE: ", "gcs://b/x", {"STORAGE_EMULATOR_HOST": CLOSED}, "read",
         GCS_UNREACHABLE),
        (PermissionError, "gs://b/x", "refusing_gcs", "read", GCS_REFUSED),
        ("Unrecognized filesystem type", "nosuchscheme://b/x", {}, "open", "pyarrow knows no filesystem for"),
    ],
)  # fmt: skip
def test_each_error_code_a_failure_is_named_by_is_what_a_real_server_sends(
    s3_server, signal, uri, environment, act, says, request, monkeypatch
):
    """What a store's error is taken to mean comes from its type, else the store's code in its text, else
    (no code) pyarrow's words: each from a real server (moto, a closed port, one that answers 403), so
    a library that changes them fails here."""
    import pyarrow.fs as pafs

    from mhf_dist import storage

    if isinstance(environment, str):
        request.getfixturevalue(environment)
        environment = {}
    for variable, value in {"MHF_STORAGE_TIMEOUT_S": "2", **environment}.items():
        monkeypatch.setenv(variable, value)
    storage._gcs.cache_clear()
    if act == "open":
        with pytest.raises(ValueError, match=f"^{signal}"):
            pafs.FileSystem.from_uri(uri)
        with pytest.raises(StorageError, match=f"^'{uri}': {says}"):
            Location.of(uri)
        return
    where = Location.of(uri)
    actions = {
        "write": lambda: where.fs.open_output_stream(where.path).close(),
        "mkdir": lambda: where.fs.create_dir(where.path),
        "read": lambda: where.fs.open_input_stream(where.path).read(),
    }
    with pytest.raises(OSError) as raised:
        actions[act]()
    found = isinstance(raised.value, signal) if isinstance(signal, type) else signal in str(raised.value)
    assert found, repr(raised.value)
    assert storage.describe_failure(uri, raised.value).startswith(says.format(uri=uri))


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("s3://AKID:se/cret@bucket/runs", "s3://bucket/runs"),  # an AWS secret may hold a "/"
        ("s3://AKID:secret@bucket/runs", "s3://bucket/runs"),
        ("s3://bucket/runs?access_key=AKID&secret_key=secret", "s3://bucket/runs"),
        ("postgresql+psycopg2://mlflow:secret@db:5432/mlflow", "postgresql+psycopg2://db:5432/mlflow"),
        ("s3://bucket/user@host/file", "s3://bucket/user@host/file"),  # an "@" in a key is not user info
        ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
    ],
)
def test_locations_are_shown_without_credentials(given, shown):
    from mhf_dist.storage import redact

    assert redact(given) == shown


def test_a_run_refuses_credentials_in_its_locations_before_anything_starts(tmp_path):
    from mhf_dist.errors import TrainingError

    cfg = load_config("tiny", [f"data.path={tmp_path}", "topology.storage=s3://AKID:se/cret@bucket/runs"])
    with pytest.raises(TrainingError, match=r"^'s3://bucket/runs' carries user info") as raised:
        train(cfg, TrainOptions(name="x"))
    assert "cret" not in str(raised.value)


def stopped_by_a_frozen_store(s3_server, command: list, environment: dict, ready: str) -> str:
    """Run `command`, freeze moto (SIGSTOP, not closed) once a stdout line starts with `ready`, and thaw it
    after the command ended: it must end with exit 2 and one `cannot reach the object store` line, no
    traceback, within 120 s of the freeze. Returns its stderr."""
    import os
    import signal

    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        while not (line := process.stdout.readline()).startswith(ready) and line:
            pass
        assert line, process.stderr.read()
        os.kill(s3_server.process.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        _, stderr = process.communicate(timeout=240)
        waited = time.monotonic() - frozen
    finally:
        os.kill(s3_server.process.pid, signal.SIGCONT)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: cannot reach the object store at "), stderr
    assert waited < 120, waited
    return stderr


def test_a_store_that_stops_answering_mid_run_is_one_line_in_bounded_time_and_the_run_goes_on_after(
    ray_session, s3_server, tmp_path
):
    """moto frozen (SIGSTOP, not closed) after step 10 of a 2-worker run stored in it: the run ends within
    a bounded time (requests time out after MHF_STORAGE_TIMEOUT_S, 3 tries) with one line, not Ray Train's
    traceback; once the store answers again, --continue goes on to the end."""
    import os

    from mhf_dist.data.prepare import prepare

    data = tmp_path / "data"
    recall = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32"]
    prepare(load_config("tiny", recall), data, log=lambda _: None)
    bucket = s3_server.make_bucket("frozen-store")
    sets = [*recall, f"data.path={data}", "train.steps=30", "train.checkpoint_every=5", "train.log_every=5",
            "train.eval_rows=8", "train.precision=fp32"]  # fmt: skip
    command = [sys.executable, "-m", "mhf_dist.cli", "train", *(arg for s in sets for arg in ("--set", s)),
               "--storage", f"{bucket}/runs", "--name", "frozen"]  # fmt: skip
    environment = {**os.environ, "MHF_STORAGE_TIMEOUT_S": "3"}
    stderr = stopped_by_a_frozen_store(s3_server, command, environment, "step 10/")
    assert stderr.strip().endswith("rerun with --continue to go on from its last complete checkpoint")
    again = subprocess.run(
        [*command, "--continue"], env=environment, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    history = read_history(newest_checkpoint(Location.of(f"{bucket}/runs/frozen")))
    assert [int(entry["step"]) for entry in history] == list(range(1, 31))
    # Nothing lost or trained twice (no incomplete checkpoint was resumed from): every step once, and the
    # stopped-and-continued curve is an uninterrupted local run's.
    local = load_config("tiny", [*sets, f"topology.storage={tmp_path / 'whole'}"])
    whole = read_history(train(local, TrainOptions(name="whole")).checkpoint)
    assert [entry["loss"] for entry in history] == pytest.approx([entry["loss"] for entry in whole], abs=1e-6)


def a_corpus(tmp_path) -> list[str]:
    """Four text files of 2,000 short paragraphs: `--set`s for a byte-level prepare of them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(4):
        (corpus / f"part{part}.txt").write_text(
            "".join(f"Line {part}.{n} of a corpus.\n\n" for n in range(2000))
        )
    return [f"data.corpus={corpus}", "data.tokenizer=bytes", "model.vocab_size=259", "model.hash.spec=H2B64"]


def prepare_command(sets: list[str], out: Location, *flags: str) -> list[str]:
    return [sys.executable, "-m", "mhf_dist.cli", "prepare", *(arg for s in sets for arg in ("--set", s)),
            "--out", out.uri, *flags]  # fmt: skip


def test_a_store_that_stops_answering_mid_prepare_is_one_line_and_the_rerun_writes_the_undisturbed_shards(
    ray_session, s3_server, tmp_path
):
    """moto frozen (SIGSTOP) once the corpus is tokenized into the bucket and before its shards are
    written: `mhf prepare` ends with one line within a bounded time and publishes no manifest; once the
    store answers, the rerun resumes and its files are byte for byte an undisturbed run's."""
    import os

    from mhf_dist.data.prepare import prepare
    from mhf_dist.data.shards import read_manifest
    from mhf_dist.signatures import load_table

    sets = a_corpus(tmp_path)
    out = Location.of(f"{s3_server.make_bucket('frozen-prepare')}/data")
    command = prepare_command(sets, out)
    environment = {**os.environ, "MHF_STORAGE_TIMEOUT_S": "3"}
    stopped_by_a_frozen_store(s3_server, command, environment, "tokenize parts:")
    assert not (out / "manifest.json").is_file()  # nothing published over incomplete shards

    again = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "resum" in again.stdout  # the tokenized parts were kept, not redone
    undisturbed = prepare(load_config("tiny", sets), tmp_path / "undisturbed", log=lambda _: None)
    published = read_manifest(out)
    assert published.moved_to("") == undisturbed
    version = out / published.folder  # the bucket's files are in the version folder the manifest names
    written = sorted(path for path, _ in version.files())
    local = sorted(path.name for path in (tmp_path / "undisturbed").iterdir())
    assert written == [name for name in local if name != "manifest.json"]
    for name in written:
        if name != "signatures.safetensors":  # safetensors orders its header's metadata per process
            assert (version / name).read_bytes() == (tmp_path / "undisturbed" / name).read_bytes(), name
    table = "signatures.safetensors"
    tables = load_table(version / table), load_table(tmp_path / "undisturbed" / table)
    assert tables[0].fingerprint == tables[1].fingerprint and (tables[0].rows == tables[1].rows).all()


def test_overwrite_in_a_bucket_killed_mid_upload_leaves_the_old_dataset_whole_and_readers_always_find_one(
    ray_session, s3_server, tmp_path
):
    """`mhf prepare --overwrite` into a bucket writes the new version beside the old one and switches by
    its manifest. Killed (SIGKILL, its Ray with it) once some of its shards are uploaded, it leaves the
    old dataset whole: every file byte for byte, `verify-data` reads it, a reader reads its rows. The
    rerun resumes, and a reader polling all along always finds a complete version; at the end only the
    new one is left, equal to a local prepare of the same settings."""
    import os
    import signal

    from mhf_dist.data.prepare import prepare
    from mhf_dist.data.reader import RowReader
    from mhf_dist.data.shards import read_manifest, verify_shards

    sets = [*a_corpus(tmp_path), "data.rows_per_shard=16"]
    new_sets = [*sets, "data.val_percent=30"]
    out = Location.of(f"{s3_server.make_bucket('overwrite')}/data")
    old = prepare(load_config("tiny", sets), out, log=lambda _: None)
    before = {path: (out / path).read_bytes() for path, _ in out.files()}
    rows = RowReader(out.uri, "train").read(np.arange(4))

    process = subprocess.Popen(
        prepare_command(new_sets, out, "--overwrite"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        while not any(".parquet" in path and not path.startswith(old.folder) for path, _ in out.files()):
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert read_manifest(out) == old
    assert {path: (out / path).read_bytes() for path in before} == before
    assert verify_shards(out) == sum(len(info.shards) for info in old.splits.values())
    again = RowReader(out.uri, "train").read(np.arange(4))
    assert all(np.array_equal(again[column], rows[column]) for column in rows)

    rerun = subprocess.Popen(
        prepare_command(new_sets, out, "--overwrite"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = set()
    while rerun.poll() is None:
        manifest = read_manifest(out)  # never missing, never damaged
        missing = [name for name in manifest.file_names() if not (out / name).is_file()]
        assert not missing or read_manifest(out) != manifest, missing  # gone only once switched from
        seen.add(manifest.content_sha256)
    stdout, stderr = rerun.communicate()
    assert rerun.returncode == 0, stderr
    assert "resuming the partial prepare" in stdout
    new = read_manifest(out)
    assert seen <= {old.content_sha256, new.content_sha256} and new != old
    assert sorted(path for path, _ in out.files()) == sorted(["manifest.json", *new.file_names()])
    assert new.moved_to("") == prepare(load_config("tiny", new_sets), tmp_path / "local", log=lambda _: None)
