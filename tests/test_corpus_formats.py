"""Corpus files of every kind and compression, on the local disk and in a bucket of a real S3-protocol
server (moto on 127.0.0.1), read as the same documents; listings, globs, streaming and bad input."""

import bz2
import gzip
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import servers

from mhf_dist.data import corpus
from mhf_dist.data.corpus import corpus_files, read_documents, split_documents
from mhf_dist.errors import DataError
from mhf_dist.storage import Location, StorageError

DOCS = [
    f"Document {i}: {word} café {'naïve ' * (i % 5)}ends here. 世界 {i * 13}"
    for i, word in enumerate(["alpha", "beta", "gamma", "delta"] * 30)
]
TEXT = "\n\n".join(DOCS) + "\n"
JSON_LINES = "".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(DOCS))
TABLE = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
PARQUET_CODECS = ("none", "snappy", "zstd", "gzip", "brotli")
MISSING = "s3://no-such-bucket-here"


def zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def parquet(codec: str) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(TABLE, sink, compression=codec, row_group_size=25)
    return sink.getvalue().to_pybytes()


def arrow(file_format: bool) -> bytes:
    sink = pa.BufferOutputStream()
    with (ipc.new_file if file_format else ipc.new_stream)(sink, TABLE.schema) as writer:
        writer.write_table(TABLE, max_chunksize=17)
    return sink.getvalue().to_pybytes()


# name -> (bytes, the uncompressed local twin it must read as)
FILES = {
    "docs.txt": (TEXT.encode(), None),
    "docs.raw": (TEXT.encode(), "docs.txt"),
    "docs.txt.gz": (gzip.compress(TEXT.encode()), "docs.txt"),
    "docs.txt.zst": (zstd(TEXT.encode()), "docs.txt"),
    "docs.txt.bz2": (bz2.compress(TEXT.encode()), "docs.txt"),
    "docs.jsonl": (JSON_LINES.encode(), None),
    "docs.json": (JSON_LINES.encode(), "docs.jsonl"),
    "docs.jsonl.gz": (gzip.compress(JSON_LINES.encode()), "docs.jsonl"),
    "docs.jsonl.zst": (zstd(JSON_LINES.encode()), "docs.jsonl"),
    "docs.json.gz": (gzip.compress(JSON_LINES.encode()), "docs.jsonl"),
    "docs.json.bz2": (bz2.compress(JSON_LINES.encode()), "docs.jsonl"),
    **{f"docs-{codec}.parquet": (parquet(codec), "docs.jsonl") for codec in PARQUET_CODECS},
    "stream.arrow": (arrow(file_format=False), "docs.jsonl"),
    "file.arrow": (arrow(file_format=True), "docs.jsonl"),
    "stream.arrow.zst": (zstd(arrow(file_format=False)), "docs.jsonl"),
    "file.arrow.zst": (zstd(arrow(file_format=True)), "docs.jsonl"),
}  # fmt: skip


def documents(spec: str, text_field: str = "text") -> list[str]:
    return [text for file in corpus_files(spec) for batch in read_documents(file, text_field) for text in
            batch["text"].to_pylist()]  # fmt: skip


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kinds")
    for name, (data, _) in FILES.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize("batch_bytes", [7, 700, corpus.BATCH_BYTES])
def test_the_uncompressed_local_files_read_in_chunks_of_any_size_hold_the_documents(
    local, monkeypatch, batch_bytes
):
    monkeypatch.setattr(corpus, "BATCH_BYTES", batch_bytes)
    assert documents(str(local / "docs.txt")) == split_documents(TEXT) == DOCS
    assert documents(str(local / "docs.jsonl")) == DOCS


def test_a_text_read_in_chunks_splits_as_the_whole_text_does_whatever_its_whitespace(tmp_path, monkeypatch):
    """Chunks are cut after a blank line; runs of spaces, tabs, CR and newlines of every shape must give
    the documents `split_documents` gives the whole text."""
    rng = random.Random(0)
    text = "".join("".join(rng.choice("ab \n\r\t") for _ in range(rng.randint(0, 40))) for _ in range(3000))
    (tmp_path / "x.txt").write_bytes(text.encode())
    for batch_bytes in (7, 50, 1000):
        monkeypatch.setattr(corpus, "BATCH_BYTES", batch_bytes)
        assert documents(str(tmp_path / "x.txt")) == split_documents(text), batch_bytes


@pytest.mark.parametrize("name", [name for name, (_, twin) in FILES.items() if twin])
def test_every_kind_and_compression_reads_as_its_uncompressed_local_twin_locally_and_in_a_bucket(
    local, bucket, monkeypatch, name
):
    monkeypatch.setattr(corpus, "BATCH_BYTES", 700)  # many batches: documents cut across read chunks
    (Location.of(bucket) / "corpus" / name).write_bytes(FILES[name][0])
    twin = documents(str(local / FILES[name][1]))
    assert documents(str(local / name)) == twin
    assert documents(f"{bucket}/corpus/{name}") == twin


def test_a_file_is_read_in_bounded_batches_never_whole(local, monkeypatch):
    monkeypatch.setattr(corpus, "BATCH_BYTES", 500)
    longest = max(len(doc.encode()) for doc in DOCS)
    for name in ("docs.txt.gz", "docs.jsonl.zst", "docs-zstd.parquet", "stream.arrow.zst"):
        (file,) = corpus_files(str(local / name))
        batches = [batch["text"].to_pylist() for batch in read_documents(file)]
        sizes = [sum(len(text.encode()) for text in batch) for batch in batches]
        assert len(sizes) > 10 and max(sizes) <= 2 * 500 + longest, name  # a text chunk plus its carry


def test_a_directory_or_glob_in_a_bucket_lists_its_corpus_files_sorted(bucket):
    root = Location.of(bucket)
    for name in (
        "c/b.jsonl.gz",
        "c/a.jsonl",
        "c/sub/d.jsonl.gz",
        "c/_SUCCESS",
        "c/notes.md",
        "other/e.jsonl",
    ):
        (root / name).write_bytes(FILES["docs.jsonl.gz"][0] if name.endswith(".gz") else JSON_LINES.encode())
    listed = [file.uri for file in corpus_files(f"{bucket}/c")]
    assert listed == [f"{bucket}/c/a.jsonl", f"{bucket}/c/b.jsonl.gz", f"{bucket}/c/sub/d.jsonl.gz"]
    assert [file.compression for file in corpus_files(f"{bucket}/c")] == [None, "gzip", "gzip"]
    gzipped = [file.uri for file in corpus_files(f"{bucket}/c/*.gz")]  # fnmatch: `*` matches `/` too
    assert gzipped == [f"{bucket}/c/b.jsonl.gz", f"{bucket}/c/sub/d.jsonl.gz"]
    assert [file.uri for file in corpus_files(f"{bucket}/[co]*/[ae].jsonl")] == [
        f"{bucket}/c/a.jsonl", f"{bucket}/other/e.jsonl"]  # fmt: skip
    assert documents(f"{bucket}/c/*.gz") == DOCS * 2
    with pytest.raises(DataError, match=r"corpus 's3://.*/c/\*\.parquet' matches no file"):
        corpus_files(f"{bucket}/c/*.parquet")
    with pytest.raises(DataError, match=r"holds no \.arrow, \.json, .* files"):
        (root / "empty/notes.md").write_text("# not a corpus")
        corpus_files(f"{bucket}/empty")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("docs.jsonl", r"has no field 'body' \(fields: id, text\); set data.text_field"),
        ("docs-snappy.parquet", r"has no field 'body' \(fields: id, text\); set data.text_field"),
        ("file.arrow.zst", r"has no field 'body' \(fields: id, text\); set data.text_field"),
    ],
)
def test_a_missing_text_field_is_a_one_line_error_naming_the_fields(local, name, message):
    with pytest.raises(DataError, match=message):
        documents(str(local / name), text_field="body")


def test_unknown_suffixes_and_damaged_files_are_one_line_errors(tmp_path):
    (tmp_path / "x.parquet.gz").write_bytes(b"x")
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(JSON_LINES.encode())[:-20])
    for name in ("x.parquet.gz", "notes.md"):
        with pytest.raises(DataError, match=rf"corpus file '.*{name}' is not \.arrow, .*; convert it"):
            corpus_files(str(tmp_path / name))
    with pytest.raises(DataError, match=r"cannot read corpus file '.*cut\.jsonl\.gz' as json") as info:
        documents(str(tmp_path / "cut.jsonl.gz"))
    assert "\n" not in str(info.value)


def test_a_missing_bucket_is_a_storage_error_not_an_empty_corpus(s3_server):
    with pytest.raises(StorageError, match=rf"the bucket of '{MISSING}/x\.jsonl' does not exist; create it"):
        corpus_files(f"{MISSING}/x.jsonl")


def test_a_config_and_a_sweep_file_are_read_from_a_bucket_too(s3_server):
    from mhf_dist.config import load_config
    from mhf_dist.errors import ConfigError
    from mhf_dist.sweep.spec import load_sweep

    bucket = Location.of(s3_server.make_bucket("configs"))
    (bucket / "base.yaml").write_text("preset: tiny\ntrain: {steps: 7}\n")
    (bucket / "run.yaml").write_text(f"preset: {bucket.uri}/base.yaml\ntrain: {{lr: 0.002}}\n")
    cfg = load_config(f"{bucket.uri}/run.yaml")
    assert (cfg.preset, cfg.train.steps, cfg.train.lr) == ("tiny", 7, 0.002)
    (bucket / "loop.yaml").write_text(f"preset: {bucket.uri}/loop.yaml\n")
    with pytest.raises(ConfigError, match=r"name each other as `preset:` \(s3://configs/loop.yaml -> s3://"):
        load_config(f"{bucket.uri}/loop.yaml")
    (bucket / "seeds.yaml").write_text("name: s\nkind: seeds\nconfig: tiny\nseeds: [0, 1]\n")
    assert load_sweep(f"{bucket.uri}/seeds.yaml").seeds == [0, 1]
    with pytest.raises(ConfigError, match=r"^sweep file 's3://configs/none.yaml' does not exist"):
        load_sweep(f"{bucket.uri}/none.yaml")


def cli_prepare(*args: str, environment: dict[str, str] | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mhf_dist.cli", "prepare", "--tokenizer", "bytes", "--set",
         "model.vocab_size=259", *args],
        capture_output=True, text=True, timeout=60, env=environment,
    )  # fmt: skip
    return done.returncode, done.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    ("corpus_uri", "out", "endpoint", "message"),
    [
        (f"{MISSING}/docs.jsonl", "{tmp}/o", None, f"the bucket of '{MISSING}/docs.jsonl' does not exist"),
        ("{bucket}/docs.jsonl", f"{MISSING}/out", None, f"the bucket of '{MISSING}/out' does not exist"),
        ("{bucket}/docs.jsonl", "{tmp}/o", "http://127.0.0.1:{closed}", "cannot reach the object store at"),
        ("abc://bucket/docs.jsonl", "{tmp}/o", None, "pyarrow knows no filesystem for abc://; use a local"),
        ("{bucket}/docs.parquet.gz", "{tmp}/o", None, r"corpus file 's3://.*/docs.parquet.gz' is not"),
    ],
)  # fmt: skip
def test_bad_corpus_and_output_locations_are_one_line_from_the_cli_within_30_s(
    bucket, tmp_path, corpus_uri, out, endpoint, message
):
    import os
    import re

    (Location.of(bucket) / "docs.jsonl").write_bytes(JSON_LINES.encode())
    (Location.of(bucket) / "docs.parquet.gz").write_bytes(b"x")
    values = {"tmp": str(tmp_path), "bucket": bucket, "closed": str(servers.free_port())}
    environment = dict(os.environ)
    if endpoint:
        environment["AWS_ENDPOINT_URL"] = endpoint.format(**values)
    where = ("--corpus", corpus_uri.format(**values), "--out", out.format(**values))
    code, stderr, seconds = cli_prepare(*where, environment=environment)
    assert code == 2 and seconds < 30, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), stderr
    assert "testing-secret-never-shown" not in stderr
