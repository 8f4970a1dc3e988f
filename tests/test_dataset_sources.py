"""Any ray.data.Dataset as a source (`mhf_dist.data.prepare.staging`): staged once into the work area,
then prepared with every guarantee of a file source. Each check compares against the same documents
written as a file and prepared by mhf-dist's own readers: equal shards mean the same documents, in the
same order, with the same tokens."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from faults import terminate_when

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.shards import read_manifest
from mhf_dist.errors import ConfigError, DataError
from mhf_dist.storage import Location

TESTS = Path(__file__).parent
SETTINGS = [
    "data.tokenizer=bytes",
    "model.vocab_size=259",
    "model.hash.spec=H2B64",
    "train.seq_len=32",
    "data.rows_per_shard=16",
    "data.val_percent=10",
]
DOCUMENTS = [f"record {index}: the {word} crossed the river {index % 7} times" for index, word in
             enumerate(["ferry", "heron", "barge", "otter", "canoe", "swan"] * 20)]  # fmt: skip
WEB = [f"page {index} links to page {index * 3 % 11} about tides" for index in range(90)]


def cfg_for(*extra: str):
    return load_config("tiny", [*SETTINGS, *extra])


def sources_setting(*sources: dict) -> str:
    return f"data.sources={json.dumps(list(sources))}"


def shard_bytes(out: Path | Location) -> dict[str, bytes]:
    where = Location.of(out)
    manifest = read_manifest(where)
    return {s.file: (where / s.file).read_bytes() for info in manifest.splits.values() for s in info.shards}


def write_jsonl(path: Path, texts: list[str], gz: bool = False) -> Path:
    data = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.fixture
def postgres_table(postgres_url):
    """A table `docs_<pid>` holding DOCUMENTS in `body` by `id`, dropped after the test; its URL carries a
    password (the trust-auth server ignores it) that must never reach the manifest."""
    import psycopg2

    table = f"docs_{os.getpid()}"
    with psycopg2.connect(postgres_url) as connection, connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {table}")
        cursor.execute(f"CREATE TABLE {table} (id integer PRIMARY KEY, body text)")
        cursor.executemany(
            f"INSERT INTO {table} VALUES (%s, %s)", list(enumerate(reversed(DOCUMENTS)))[::-1]
        )  # inserted out of order: the query's ORDER BY decides
    with_password = postgres_url.replace("://mhf@", "://mhf:table-s3cret@")
    yield with_password, table
    with psycopg2.connect(postgres_url) as connection, connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {table}")


def test_a_postgres_table_mixed_with_a_gzipped_file_gives_the_shards_of_the_same_documents_as_files(
    ray_session, tmp_path, postgres_table
):
    url, table = postgres_table
    web = write_jsonl(tmp_path / "web.jsonl.gz", WEB, gz=True)
    in_order = list(reversed(DOCUMENTS))  # the table's rows by id
    db_file = write_jsonl(tmp_path / "db.jsonl", in_order)
    from_table = {"name": "db", "dataset": "dataset_callables:postgres_documents",
                  "args": {"url": url, "table": table}, "text_field": "body", "weight": 1}  # fmt: skip
    lines: list[str] = []
    staged = prepare(
        cfg_for(sources_setting(from_table, {"name": "web", "corpus": str(web), "weight": 1})),
        tmp_path / "staged",
        log=lines.append,
    )
    from_file = {"name": "db", "corpus": str(db_file), "weight": 1}
    files = prepare(
        cfg_for(sources_setting(from_file, {"name": "web", "corpus": str(web), "weight": 1})),
        tmp_path / "files",
        log=lambda _: None,
    )
    assert staged.content_sha256 == files.content_sha256
    assert shard_bytes(tmp_path / "staged") == shard_bytes(tmp_path / "files")
    db, web_info = staged.sources
    assert (db.documents, db.tokens, web_info.tokens) == (files.sources[0].documents, files.sources[0].tokens,
                                                          files.sources[1].tokens)  # fmt: skip
    assert db.corpus == "dataset:dataset_callables:postgres_documents" and web_info.staged is None
    assert db.staged is not None and db.staged.documents == len(DOCUMENTS)
    assert db.staged.dataset == "dataset_callables:postgres_documents" and db.staged.args["table"] == table
    manifest_text = (tmp_path / "staged" / "manifest.json").read_text()
    assert "table-s3cret" not in manifest_text and "postgresql://127.0.0.1:" in manifest_text
    assert any(line.startswith("source 'db': staging") for line in lines)
    assert not [line for line in lines if "table-s3cret" in line]
    assert any(line.startswith("mixture of the training tokens") for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db.jsonl", "files", "staged", "web.jsonl.gz"]


def test_a_hugging_face_dataset_given_in_python_is_the_corpus_its_documents_make_as_a_file(
    ray_session, tmp_path, capfd, monkeypatch
):
    """...in any number of blocks; the console holds none of Ray Data's lines and its settings are the
    process's own again afterwards."""
    import datasets
    import ray.data

    context = ray.data.DataContext.get_current()
    before = (
        context.enable_progress_bars,
        context.max_errored_blocks,
        context.execution_options.preserve_order,
    )
    capfd.readouterr()

    hf = datasets.Dataset.from_dict({"text": DOCUMENTS, "score": list(range(len(DOCUMENTS)))})
    given = prepare(cfg_for(), tmp_path / "given", log=lambda _: None,
                    datasets={"wiki": ray.data.from_huggingface(hf)})  # fmt: skip
    corpus = write_jsonl(tmp_path / "d.jsonl", DOCUMENTS)
    as_file = prepare(cfg_for(f"data.corpus={corpus}"), tmp_path / "file", log=lambda _: None)
    assert given.content_sha256 == as_file.content_sha256
    (source,) = given.sources
    assert (source.name, source.corpus) == ("wiki", "dataset:wiki (given in Python)")
    assert source.staged is not None and (source.staged.dataset, source.staged.documents) == (
        "given in Python",
        len(DOCUMENTS),
    )
    # In 17 blocks, staged by 17 write tasks (each block a file of its own) on 4 CPUs: the files keep the
    # Dataset's order.
    import mhf_dist.data.prepare.staging as staging

    monkeypatch.setattr(staging, "STAGED_FILE_BYTES", 1)
    blocks = ray.data.from_items([{"text": text} for text in DOCUMENTS], override_num_blocks=17)
    lines: list[str] = []
    again = prepare(cfg_for(), tmp_path / "blocks", log=lines.append, datasets={"wiki": blocks})
    assert again.content_sha256 == as_file.content_sha256
    assert any(
        line.startswith("source 'wiki': staged 120 documents (") and " in 17 files)" in line for line in lines
    )
    out, err = capfd.readouterr()
    assert "Dataset" not in out + err and "ray.data" not in out + err, out + err
    after = (
        context.enable_progress_bars,
        context.max_errored_blocks,
        context.execution_options.preserve_order,
    )
    assert after == before


def test_a_hive_partitioned_parquet_table_in_the_bucket_gives_what_the_file_reader_gives(
    ray_session, tmp_path, bucket
):
    table = Location.of(f"{bucket}/table")
    for lang, chunk in (("de", DOCUMENTS[:50]), ("en", DOCUMENTS[50:])):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": chunk, "length": [len(t) for t in chunk]}), sink, row_group_size=16)
        (table / f"lang={lang}" / "part-0.parquet").write_bytes(sink.getvalue().to_pybytes())
    source = {"name": "lake", "dataset": "dataset_callables:bucket_table", "args": {"uri": table.uri},
              "weight": 1}  # fmt: skip
    staged = prepare(cfg_for(sources_setting(source)), f"{bucket}/staged", log=lambda _: None)
    read = prepare(cfg_for(f"data.corpus={table.uri}"), f"{bucket}/read", log=lambda _: None)
    assert staged.content_sha256 == read.content_sha256
    assert staged.splits["train"].documents + staged.splits["validation"].documents == len(DOCUMENTS)
    stored = sorted(name for name, _ in Location.of(f"{bucket}/staged").files())  # no staged Dataset left
    assert stored == sorted(["manifest.json", *staged.file_names()])


def test_a_staging_stopped_half_way_is_staged_again_and_gives_the_uninterrupted_shards(ray_session, tmp_path):
    """SIGTERM while the slow Dataset is being staged (its folder made, no record yet): exit 143,
    no manifest; the rerun stages it again (not 'reusing') and writes what an uninterrupted run writes."""
    out, work = tmp_path / "out", tmp_path / ".out.partial"
    slow = {"name": "slow", "dataset": "dataset_callables:slow", "args": {"count": 8}, "weight": 1}
    flags = [arg for setting in [*SETTINGS, sources_setting(slow)] for arg in ("--set", setting)]

    def command(to: Path) -> list[str]:
        return [sys.executable, "-m", "mhf_dist.cli", "prepare", *flags, "--out", str(to), "--num-cpus", "1"]

    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        command(out), env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    staging = work / "progress" / "staged" / "slow"
    terminate_when(process, staging.is_dir)  # staging has begun: its 8 blocks take 4 s
    assert not (work / "progress" / "staged" / "slow.json").exists() and not out.exists()

    rerun = subprocess.run(command(out), env=environment, capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert "source 'slow': staging" in rerun.stdout and "reusing" not in rerun.stdout
    whole = prepare(cfg_for(sources_setting(slow)), tmp_path / "whole", log=lambda _: None)
    assert read_manifest(out).content_sha256 == whole.content_sha256
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole") and not work.exists()


def test_a_complete_snapshot_is_reused_by_the_rerun_of_a_stopped_prepare(
    ray_session, tmp_path, monkeypatch, capfd
):
    """Stopped after staging (in the tokenize phase): the rerun takes the snapshot as it is. Ray Data's
    console stays quiet after the stop, as a stopped executor's thread may still log."""
    import mhf_dist.data.prepare.pipeline as pipeline

    setting = sources_setting({"name": "numbers", "dataset": "dataset_callables:slow", "args": {"count": 3},
                               "weight": 1})  # fmt: skip
    units = pipeline.run_units

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_units", stopped)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg_for(setting), tmp_path / "out", log=lambda _: None)
    assert (tmp_path / ".out.partial" / "progress" / "staged" / "numbers.json").is_file()
    capfd.readouterr()
    logging.getLogger("ray.data").warning("a stopped executor's late line")
    assert "late line" not in capfd.readouterr().err
    monkeypatch.setattr(pipeline, "run_units", units)
    lines: list[str] = []
    resumed = prepare(cfg_for(setting), tmp_path / "out", log=lines.append)
    assert "source 'numbers': reusing its staged snapshot (3 documents)" in lines
    whole = prepare(cfg_for(setting), tmp_path / "whole", log=lambda _: None)
    assert resumed.content_sha256 == whole.content_sha256

    # Stopped again, then rerun with args that differ only where the record masks them (a URI's user and
    # password): staged again, not reused, and no digest of theirs stored that a guess could be checked
    # against quickly.
    def with_uri(uri: str) -> str:
        return sources_setting({"name": "numbers", "dataset": "dataset_callables:slow",
                                "args": {"count": 3, "uri": uri}, "weight": 1})  # fmt: skip

    monkeypatch.setattr(pipeline, "run_units", stopped)
    with pytest.raises(KeyboardInterrupt):
        prepare(
            cfg_for(with_uri("postgresql://ann:pw-one@db/corpus")), tmp_path / "other", log=lambda _: None
        )
    record = (tmp_path / ".other.partial" / "progress" / "staged" / "numbers.json").read_text()
    assert "pw-one" not in record and '"args_salt"' in record
    monkeypatch.setattr(pipeline, "run_units", units)
    lines.clear()
    prepare(cfg_for(with_uri("postgresql://bob:pw-two@db/corpus")), tmp_path / "other", log=lines.append)
    assert any(line.startswith("source 'numbers': staged 3 documents") for line in lines), lines
    assert not any("reusing" in line for line in lines)


def _source(name: str, **args) -> str:
    return sources_setting({"name": "src", "dataset": f"dataset_callables:{name}", "args": args, "weight": 1})


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        (
            "data.corpus=dataset:no_such_module:documents",
            r"cannot import 'no_such_module' \(ModuleNotFoundError",
        ),
        ("data.corpus=dataset:dataset_callables:absent", r"'dataset_callables' has no function 'absent'"),
        ("data.corpus=dataset:dataset_callables:not_a_dataset", r"returned a list, not a ray\.data\.Dataset"),
        (_source("numbered", count=5), r"dataset source 'src' has no field 'text' \(fields: id\); set its"),
        (_source("numbers_as_text", count=5), r"field 'text' holds int64, not text; set text_field"),
        ("data.corpus=dataset:dataset_callables:nothing", r"dataset source 'corpus' .* is empty; give it"),
        (
            _source("failing", count=5, token="tok-s3cret-9"),
            r"failed while being read: ConnectionResetError: the warehouse closed the connection \(token "
            r"<redacted>\)",
        ),
        (
            _source("refuses_login", password="pw-s3cret-9"),
            r"PermissionError: login failed with password <red",
        ),
        (_source("numbered", unknown=1), r"numbered\(\*\*args\) raised TypeError: .*unexpected keyword"),
    ],
)
def test_a_dataset_that_cannot_be_used_is_one_line_and_leaves_nothing(
    ray_session, tmp_path, setting, problem
):
    start = time.monotonic()
    with pytest.raises(DataError, match=problem) as info:
        prepare(cfg_for(setting), tmp_path / "out", log=lambda _: None)
    assert "\n" not in str(info.value) and "s3cret" not in str(info.value) and time.monotonic() - start < 60
    assert list(tmp_path.iterdir()) == []  # no output, no work area


def test_a_missing_field_of_the_last_source_is_found_before_the_first_is_staged(ray_session, tmp_path):
    slow = {"name": "slow", "dataset": "dataset_callables:slow", "args": {"count": 40}, "weight": 1}
    numbers = {"name": "numbers", "dataset": "dataset_callables:numbered", "args": {"count": 5}, "weight": 1}
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(DataError, match=r"dataset source 'numbers' has no field 'text' \(fields: id\)"):
        prepare(cfg_for(sources_setting(slow, numbers)), tmp_path / "out", log=lines.append)
    assert time.monotonic() - start < 20  # staging `slow` would take 20 s
    assert not any("staging" in line for line in lines) and list(tmp_path.iterdir()) == []


def test_the_cli_reports_a_dataset_source_it_cannot_use_in_one_line_with_exit_2(
    ray_session, tmp_path, capsys
):
    flags = [arg for setting in SETTINGS for arg in ("--set", setting)]
    argv = [
        "prepare",
        "--corpus",
        "dataset:dataset_callables:numbers_as_text",
        *flags,
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: dataset source 'corpus': field 'text' holds int64, not text")
    assert main(["prepare", "--corpus", "dataset:not a callable", "--out", str(tmp_path / "o")]) == 2
    assert "--corpus: 'dataset:not a callable': write dataset:package.module:function;" in (  # its own words
        capsys.readouterr().err
    )
    table = '[{"name": "db", "dataset": "dataset_callables:numbered", "weight": 1}]'
    beside = ["prepare", "--corpus", "recall", "--set", f"data.sources={table}"]
    assert main([*beside, "--out", str(tmp_path / "o")]) == 2
    assert "corpus='recall' and sources name the text twice" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_dataset_the_mixture_cannot_weigh_is_refused_before_any_work(ray_session, tmp_path):
    import ray.data

    given = {"a": ray.data.from_items([{"text": "x"}])}
    corpus = write_jsonl(tmp_path / "c.jsonl", WEB)
    with pytest.raises(
        DataError, match=r"datasets 'a' and data\.corpus='.*c\.jsonl' cannot be weighed together"
    ):
        prepare(cfg_for(f"data.corpus={corpus}"), tmp_path / "o", log=lambda _: None, datasets=given)
    with pytest.raises(DataError, match=r"datasets 'b' are no source of data\.sources; add an entry"):
        prepare(cfg_for(sources_setting({"name": "a", "corpus": str(corpus), "weight": 1})), tmp_path / "o",
                log=lambda _: None, datasets={"b": given["a"]})  # fmt: skip
    with pytest.raises(DataError, match=r"source 'a' is given in Python and names .*c\.jsonl' too"):
        prepare(cfg_for(sources_setting({"name": "a", "corpus": str(corpus), "weight": 1})), tmp_path / "o",
                log=lambda _: None, datasets=given)  # fmt: skip
    with pytest.raises(DataError, match=r"source 'b' names no corpus or dataset; give it one"):
        prepare(cfg_for(sources_setting({"name": "b", "weight": 1})), tmp_path / "o", log=lambda _: None)
    with pytest.raises(ConfigError, match=r"source 'b' names a corpus and a dataset; give one of them"):
        cfg_for(sources_setting({"name": "b", "corpus": str(corpus), "dataset": "m:f", "weight": 1}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_secrets_in_a_dataset_sources_args_reach_neither_records_nor_mlflow(tmp_path):
    from mhf_dist.storage import redact_values
    from mhf_dist.tracking import connect, log_params

    args = {
        "url": "postgresql://reader:pg-s3cret@db:5432/corpus",
        "password": "pw-s3cret",
        "apiKey": "key-s3cret",
        "headers": {"Authorization": "Bearer tok-s3cret"},
        "dsn": "host=db password='two s3cret' user=reader",
        "conn": "AccountName=a;AccountKey=acc-s3cret==;Suffix=x",
        "shard_keys": ["id"],
        "table": "docs",
    }
    shown = redact_values(args)
    assert "s3cret" not in json.dumps(shown)
    assert (shown["shard_keys"], shown["table"], shown["url"]) == (
        ["id"],
        "docs",
        "postgresql://db:5432/corpus",
    )
    assert shown["conn"] == "AccountName=a;AccountKey=<redacted>;Suffix=x"
    cfg = cfg_for(sources_setting({"name": "db", "dataset": "m:f", "args": args, "weight": 1}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = connect(uri)
    run = client.create_run(client.create_experiment("secrets")).info.run_id
    log_params(uri, run, cfg.flat())
    params = client.get_run(run).data.params
    assert "data.sources" in params and "s3cret" not in json.dumps(params)
