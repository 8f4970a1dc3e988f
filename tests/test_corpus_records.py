"""No silent wrong results in the data path: every record of a corpus is a document or is counted (and,
without text, refused unless `data.missing_text: skip`); a field of another type is one line; every file
is read once, through links and loops; a cached copy of a bucket's object is current."""

from __future__ import annotations

import bz2
import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.corpus import Skipped, corpus_files, read_documents
from mhf_dist.data.prepare import prepare
from mhf_dist.errors import DataError
from mhf_dist.storage import Location, local_copy

# 40 records: 3 without text (a missing key, a null, a missing key), 2 empty, 35 documents
TEXTS: list[str | None] = [f"record {index} is about the harbour at dawn" for index in range(40)]
MISSING_AT = (6, 19, 33)
for _index in MISSING_AT:
    TEXTS[_index] = None
TEXTS[10] = TEXTS[27] = ""
DOCUMENTS = [text for text in TEXTS if text]


def json_lines() -> bytes:
    rows = []
    for index, text in enumerate(TEXTS):
        if index == 0:
            rows.append("")  # a blank line is no record: the first missing one is on line 8, not 7
        rows.append(
            json.dumps({"id": index} if text is None and index != 19 else {"id": index, "text": text})
        )
    return ("\n".join(rows) + "\n").encode()


def table_bytes(kind: str) -> bytes:
    table = pa.table({"text": pa.array(TEXTS, pa.string())})
    sink = pa.BufferOutputStream()
    if kind == "parquet":
        pq.write_table(table, sink, row_group_size=7)
    else:
        with ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=9)
    return sink.getvalue().to_pybytes()


def compressed(data: bytes, codec: str | None) -> bytes:
    if codec == "gzip":
        return gzip.compress(data, mtime=0)  # the same bytes in every process: they name a test
    if codec == "bz2":
        return bz2.compress(data)
    if codec == "zstd":
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as stream:
            stream.write(data)
        return sink.getvalue().to_pybytes()
    return data


# file name -> (bytes, where the first record without text is)
READERS = {
    "docs.jsonl": (json_lines(), "docs.jsonl:8"),
    "docs.jsonl.gz": (compressed(json_lines(), "gzip"), "docs.jsonl.gz:8"),
    "docs.json.bz2": (compressed(json_lines(), "bz2"), "docs.json.bz2:8"),
    "docs.jsonl.zst": (compressed(json_lines(), "zstd"), "docs.jsonl.zst:8"),
    "docs.parquet": (table_bytes("parquet"), "docs.parquet: row 7"),
    "docs.arrow": (table_bytes("arrow"), "docs.arrow: row 7"),
    "docs.arrow.zst": (compressed(table_bytes("arrow"), "zstd"), "docs.arrow.zst: row 7"),
}


@pytest.fixture(params=["local", "bucket"])
def root(request, tmp_path) -> Location:
    return (
        Location.of(tmp_path) if request.param == "local" else Location.of(request.getfixturevalue("bucket"))
    )


@pytest.mark.parametrize("name", list(READERS))
def test_every_reader_gives_the_documents_and_counts_each_record_it_leaves_out(root, name):
    data, first = READERS[name]
    (root / name).write_bytes(data)
    (file,) = corpus_files((root / name).uri)
    skipped = Skipped()
    read = [
        text for batch in read_documents(file, "text", None, skipped) for text in batch["text"].to_pylist()
    ]
    assert read == DOCUMENTS
    assert (skipped.missing, skipped.empty) == (3, 2)
    assert skipped.first_missing == f"{root / name}".replace(name, first)


@pytest.mark.parametrize(
    ("name", "data", "problem"),
    [
        ("n.parquet", None, r"n\.parquet': field 'text' holds int64, not text; set data\.text_field"),
        ("l.arrow", None, r"l\.arrow': field 'text' holds list<item: string>, not text"),
        (
            "j.jsonl",
            b'{"text": "a"}\n\n{"text": "b"}\n{"text": 7}\n',
            r"j\.jsonl:4: field 'text' holds a JSON number",
        ),
        (
            "o.jsonl.gz",
            gzip.compress(b'{"text": {"a": 1}}\n', mtime=0),
            r"o\.jsonl\.gz:1: field 'text' holds a JSON object",
        ),
    ],
)
def test_a_field_of_another_type_is_one_line_naming_it(tmp_path, name, data, problem):
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / name)
    elif name.endswith(".arrow"):
        table = pa.table({"text": [["a"], ["b"]]})
        with ipc.new_stream(str(tmp_path / name), table.schema) as writer:
            writer.write_table(table)
    else:
        (tmp_path / name).write_bytes(data)
    (file,) = corpus_files(str(tmp_path / name))
    with pytest.raises(DataError, match=problem) as info:
        list(read_documents(file, "text"))
    assert "\n" not in str(info.value)


SETTINGS = ["data.tokenizer=bytes", "model.vocab_size=259", "model.hash.spec=H2B64", "train.seq_len=32",
            "data.val_percent=10"]  # fmt: skip


def test_prepare_refuses_records_without_text_then_a_rerun_with_skip_goes_on_and_records_them(
    ray_session, tmp_path
):
    (tmp_path / "docs.jsonl").write_bytes(json_lines())
    corpus = [f"data.corpus={tmp_path / 'docs.jsonl'}", *SETTINGS]
    with pytest.raises(DataError) as info:
        prepare(load_config("tiny", corpus), tmp_path / "out", log=lambda _: None)
    assert str(info.value) == (
        f"3 records of corpus {str(tmp_path / 'docs.jsonl')!r} have no text in 'text' (the first: "
        f"{tmp_path / 'docs.jsonl'}:8); fix them, or pass --set data.missing_text=skip to leave them out"
    )
    assert not (tmp_path / "out").exists()
    lines: list[str] = []
    manifest = prepare(
        load_config("tiny", [*corpus, "data.missing_text=skip"]), tmp_path / "out", log=lines.append
    )
    assert "resumed: 1 of 1 tokenized parts were already written and checked" in lines
    assert any(line.startswith("warning: 3 records of corpus") and "were left out" in line for line in lines)
    assert "2 records of corpus" in next(line for line in lines if "with empty text" in line)
    (source,) = manifest.sources
    assert (source.missing_text, source.empty) == (3, 2)
    assert sum(info.documents for info in manifest.splits.values()) == len(DOCUMENTS)
    assert [(file.path, file.bytes) for file in source.files] == [
        (str(tmp_path / "docs.jsonl"), len(json_lines()))
    ]


def test_the_records_left_out_are_params_of_the_training_run(tmp_path):
    from mhf_dist.data.shards import Manifest, SourceInfo
    from mhf_dist.tracking import connect
    from mhf_dist.train.ray_trainer import TrainOptions, _tracking_run

    source = SourceInfo(name="corpus", corpus="c", weight=1.0, documents=35, tokens=900, share=1.0,
                        validation_documents=0, validation_tokens=0, missing_text=3, empty=2)  # fmt: skip
    manifest = Manifest.model_construct(sources=[source], content_sha256="0" * 64)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config("tiny", [f"data.path={tmp_path}"])
    run_id = _tracking_run(uri, Location.of(tmp_path / "run"), cfg, TrainOptions(), {}, manifest)
    params = connect(uri).get_run(run_id).data.params
    assert (params["data.records_without_text"], params["data.empty_records"]) == ("3", "2")


def test_a_directory_is_read_once_through_a_link_to_itself_and_a_second_link_to_a_file(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "inner").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha\n")
    (corpus / "inner" / "b.txt").write_text("beta\n")
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)  # a folder holding a link to itself
    (corpus / "inner" / "also-a.txt").symlink_to(corpus / "a.txt")
    (corpus / "inner" / "report.docx").write_bytes(b"PK")  # not read, and said so
    lines: list[str] = []
    files = corpus_files(str(corpus), lines.append)
    assert [Path(file.uri).relative_to(corpus).as_posix() for file in files] == ["a.txt", "inner/b.txt"]
    assert lines == [
        f"corpus {str(corpus)!r}: skipping 1 file(s) of no corpus kind, e.g. 'inner/report.docx'",
        f"corpus {str(corpus)!r} reaches 1 of its files a second time (through links); each is read once",
    ]
    globbed = corpus_files(f"{corpus}/**/*.txt", lines.append)
    assert sorted(os.path.realpath(file.uri) for file in globbed) == [
        str(corpus / "a.txt"),
        str(corpus / "inner" / "b.txt"),
    ]


def test_a_cached_copy_of_a_replaced_object_is_fetched_again(bucket, tmp_path, monkeypatch):
    """The same size and name, other bytes: the listing's sizes alone would keep the stale copy."""
    monkeypatch.setenv("MHF_CACHE", str(tmp_path / "cache"))
    model = Location.of(f"{bucket}/model")
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"A" * 4096)
    first = local_copy(model)
    assert (first / "model.safetensors").read_bytes() == b"A" * 4096
    assert local_copy(model) == first  # unchanged: not fetched again
    (model / "model.safetensors").write_bytes(b"B" * 4096)
    again = local_copy(model)
    assert again != first and (again / "model.safetensors").read_bytes() == b"B" * 4096
