"""`mhf prepare` on Ray: packing, signatures, split stability, determinism, resuming, bad input."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.corpus import corpus_files
from mhf_dist.data.prepare import WRITTEN_HERE, plan_parts, prepare, prepare_if_missing
from mhf_dist.data.reader import RowReader
from mhf_dist.data.shards import (
    check_compatible,
    check_tokenizer,
    is_validation,
    read_manifest,
    reprepare,
    save_tokenizer,
    verify_shards,
)
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError, SignatureError
from mhf_dist.signatures import SignatureTable, load_table, save_table
from mhf_dist.storage import Location

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent on this machine")

PARAGRAPHS = [
    f"Paragraph {i} talks about {topic} and how {topic} relates to item number {i * 7}."
    for i, topic in enumerate(["trains", "hashes", "buckets", "rivers", "ships", "clouds", "glass"] * 12)
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("corpus")
    (directory / "a.txt").write_text("\n\n".join(PARAGRAPHS[:40]) + "\n")
    (directory / "b.txt").write_text("\n \n".join(PARAGRAPHS[40:]) + "\n")
    return directory


def byte_cfg(corpus, out, *extra):
    return load_config(
        "tiny",
        [
            f"data.corpus={corpus}",
            "data.tokenizer=bytes",
            "model.vocab_size=259",
            "model.hash.spec=H2B64",
            "train.seq_len=32",
            "data.rows_per_shard=16",
            "data.val_percent=20",
            f"data.path={out}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def prepared(ray_session, corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "shards"
    cfg = byte_cfg(corpus_dir, out)
    manifest = prepare(cfg, out, num_cpus=2, log=lambda line: None)
    return cfg, out, manifest


def read_rows(path, split):
    rows = RowReader(path, split).read_range()
    return rows["tokens"], rows["signatures"]


def corpus_stream(split: str, val_percent: float = 20) -> list[int]:
    tokenizer = TextTokenizer.bytes()
    documents = [p for p in PARAGRAPHS if (split == "validation") == is_validation(p, val_percent)]
    return [token for ids in tokenizer.encode_batch(documents) for token in (*ids, tokenizer.eos_id)]


@pytest.mark.parametrize("split", ["train", "validation"])
def test_rows_reproduce_the_token_stream_in_order_with_every_eos(prepared, split):
    _, out, manifest = prepared
    rows, _ = read_rows(out, split)
    rebuilt = [token for row in rows.tolist() for token in row[:-1]] + [int(rows[-1, -1])]
    stream = corpus_stream(split)
    assert rebuilt == stream[: len(rebuilt)]
    assert len(stream) - len(rebuilt) == manifest.splits[split].dropped_tokens < 32
    assert manifest.splits[split].rows == len(rows)


def test_signature_column_equals_the_table_lookup_for_every_row(prepared):
    _, out, manifest = prepared
    table = load_table(out / "signatures.safetensors")
    for split in ("train", "validation"):
        ids, signatures = read_rows(out, split)
        assert np.array_equal(signatures, table.lookup(ids))
    assert signatures.dtype == np.uint8 and manifest.signatures.dtype == "uint8"
    assert manifest.signatures.fingerprint == table.fingerprint


def test_split_is_disjoint_by_document_and_matches_the_stable_hash(prepared):
    _, _, manifest = prepared
    validation_docs = sum(is_validation(p, 20) for p in PARAGRAPHS)
    assert manifest.splits["validation"].documents == validation_docs
    assert manifest.splits["train"].documents == len(PARAGRAPHS) - validation_docs
    assert 0 < validation_docs < len(PARAGRAPHS)


@pytest.mark.parametrize(("cpus", "files", "part_bytes"), [(1, 1, 1 << 30), (3, 7, 1), (2, 7, 2500)])
def test_same_inputs_give_byte_identical_shards_whatever_the_parallelism(
    prepared, tmp_path, monkeypatch, cpus, files, part_bytes
):
    """The fixture ran 2 files as one part on 2 CPUs; here the same documents in 1 or 7 files, cut into
    1, 7 or 4 parts (tokenize tasks, each a part file of its own), with 1 to 3 tasks at a time: shards
    cut across other part and batch boundaries."""
    import mhf_dist.data.prepare.plan as prepare_module

    _, _, manifest = prepared
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, part in enumerate(np.array_split(np.array(PARAGRAPHS, dtype=object), files)):
        (corpus / f"{index}.txt").write_text("\n\n".join(part) + "\n")
    monkeypatch.setattr(prepare_module, "PART_BYTES", part_bytes)
    again = prepare(
        byte_cfg(corpus, tmp_path / "again"), tmp_path / "again", num_cpus=cpus, log=lambda _: None
    )
    assert again.content_sha256 == manifest.content_sha256
    assert again.splits == manifest.splits
    parts = len(plan_parts([corpus_files(str(corpus))], ["text"]))
    assert parts == {1 << 30: 1, 1: 7, 2500: 4}[part_bytes]


def test_a_bucket_output_holds_the_local_outputs_bytes_and_verify_data_reads_it(prepared, bucket, capsys):
    cfg, local, manifest = prepared
    out = f"{bucket}/shards"
    remote = prepare(byte_cfg(cfg.data.corpus, out), out, log=lambda _: None)
    assert remote.content_sha256 == manifest.content_sha256
    # In a bucket the files are in a version folder that the manifest names; no parts, no progress left.
    version = remote.folder
    assert re.fullmatch(r"v-[0-9a-f]{12}", version) and remote.moved_to("") == manifest
    stored = sorted(path for path, _ in Location.of(out).files())
    assert stored == sorted(
        name if name == "manifest.json" else f"{version}/{name}" for name in (p.name for p in local.iterdir())
    )
    assert {"manifest.json", f"{version}/tokenizer.json", f"{version}/signatures.safetensors"} < set(stored)
    for name in set(stored) - {"manifest.json", f"{version}/signatures.safetensors"}:  # (safetensors orders
        assert Location.of(f"{out}/{name}").read_bytes() == (local / Path(name).name).read_bytes(), name
    table = load_table(f"{out}/{version}/signatures.safetensors")  # its header's metadata freely)
    assert table.fingerprint == manifest.signatures.fingerprint
    assert main(["verify-data", out]) == 0
    shards = sum(len(info.shards) for info in manifest.splits.values())
    assert (
        f"{shards} shards, tokenizer.json and the signature table in {out} match" in capsys.readouterr().out
    )
    lines = []
    prepare_if_missing(byte_cfg(cfg.data.corpus, out), log=lines.append)
    assert lines == [f"prepared shards found in {out}; not preparing again"]


def test_the_shards_are_checked_against_the_model_config(prepared):
    cfg, out, _ = prepared
    with pytest.raises(
        DataError, match=r"shards have seq_len 32 but the model has 64; set --set train\.seq_len=32"
    ):
        check_compatible(
            read_manifest(out), load_config("tiny", ["model.vocab_size=259", "model.hash.spec=H2B64"])
        )
    other = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(
                update={"hash": cfg.model.hash.model_copy(update={"spec": "H3B64"})}
            )
        }
    )
    with pytest.raises(DataError, match="shards have hash spec H2B64 but the model has H3B64"):
        check_compatible(read_manifest(out), other)


def test_mhf_train_refuses_shards_that_do_not_fit_before_ray_starts_leaving_nothing(
    prepared, tmp_path, monkeypatch, capsys
):
    import mhf_dist.train.ray_trainer as ray_trainer

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the shards were checked")

    monkeypatch.setattr(ray_trainer, "ensure_ray", no_ray)
    _, out, _ = prepared
    sets = ["data.tokenizer=bytes", "model.vocab_size=259", "model.hash.spec=H2B64", f"data.path={out}"]
    argv = ["train", *(arg for item in sets for arg in ("--set", item)), "--storage", str(tmp_path / "runs")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: shards have seq_len 32 but the model has 64; set --set train.seq_len=32 or re-prepare"
    )
    assert not (tmp_path / "runs").exists()  # a refused run leaves no storage folder
    # A signature table that is not the one the manifest records is the data's fault, not model.hash's.
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    table = load_table(out / "signatures.safetensors")
    save_table(SignatureTable.build(table.tokens, 2, 64, seed=7), swapped / "signatures.safetensors")
    argv = [*argv, "--set", "train.seq_len=32", "--set", f"data.path={swapped}"]
    assert main(argv) == 2
    assert re.fullmatch(
        rf"error: {re.escape(str(swapped))}/signatures.safetensors has seed 7 but the manifest says 0; "
        + re.escape(reprepare(swapped)),
        capsys.readouterr().err.strip().splitlines()[-1],
    )
    assert not (tmp_path / "runs").exists()


def test_shard_files_hold_fixed_size_rows_one_per_row_group(prepared):
    _, out, manifest = prepared
    first = pq.read_table(out / manifest.splits["train"].shards[0].file)
    assert first.num_rows == 16
    assert pq.ParquetFile(out / manifest.splits["train"].shards[0].file).num_row_groups == 16
    assert first.schema.field("input_ids").type.list_size == 33
    assert first.schema.field("signatures").type.list_size == 33 * 2


def test_a_failed_run_leaves_nothing_that_looks_prepared(ray_session, tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    out = tmp_path / "out"
    with pytest.raises(DataError, match="fewer than one row of seq_len\\+1=33"):
        prepare(byte_cfg(tmp_path / "short.txt", out), out, log=lambda _: None)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    with pytest.raises(DataError, match=r"no manifest\.json"):
        out.mkdir() or read_manifest(out)


def test_invalid_utf8_is_replaced_counted_and_warned_through_the_log(ray_session, tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(
        ("\n\n".join(PARAGRAPHS[:30]) + "\n\nbroken \xff\xfe bytes here").encode("latin-1")
    )
    lines = []
    manifest = prepare(byte_cfg(tmp_path / "bad.txt", tmp_path / "o"), tmp_path / "o", log=lines.append)
    replaced = sum(manifest.splits[split].replaced for split in ("train", "validation"))
    assert replaced == 2
    assert any(line.startswith("warning: 2 invalid UTF-8 sequences") for line in lines)
    assert capsys.readouterr().err == ""  # nothing past the log given


@pytest.mark.parametrize(
    ("corpus", "extra", "message"),
    [
        ("{tmp}/missing-dir/*.txt", [], "matches no file"),
        ("{tmp}/empty.txt", [], "holds no text"),
        ("{tmp}/notes.md", [], r"is not \.arrow, \.json, \.jsonl, \.parquet, \.raw, \.txt \(\.txt/"),
        ("{tmp}/docs.jsonl", ["data.text_field=body"], "has no field 'body'"),
        ("{tmp}/docs.jsonl", ["data.tokenizer={tmp}/broken.json"], "cannot read tokenizer"),
        ("{tmp}/docs.jsonl", ["data.tokenizer=bpe", "model.vocab_size=100"], "model.vocab_size"),
        # found by a Ray Data task, not before: the first file reads, the second is no gzip
        ("{tmp}/mixed", [], r"cannot read corpus file '.*b\.jsonl\.gz' as json \(.*\); fix or remove it$"),
    ],
)
def test_bad_input_is_a_one_line_error(ray_session, tmp_path, corpus, extra, message):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text(json.dumps({"text": PARAGRAPHS[0]}) + "\n")
    (tmp_path / "mixed" / "b.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in PARAGRAPHS) + "\n")
    cfg = byte_cfg(corpus.format(tmp=tmp_path), tmp_path / "out", *[e.format(tmp=tmp_path) for e in extra])
    with pytest.raises(DataError, match=message) as info:
        prepare(cfg, tmp_path / "out", log=lambda _: None)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_jsonl_and_parquet_corpora_give_the_same_rows(ray_session, tmp_path):
    import pyarrow as pa

    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"body": p}) for p in PARAGRAPHS) + "\n")
    pq.write_table(pa.table({"body": PARAGRAPHS}), tmp_path / "docs.parquet")
    hashes = []
    for name in ("docs.jsonl", "docs.parquet"):
        cfg = byte_cfg(tmp_path / name, tmp_path / name, "data.text_field=body")
        hashes.append(prepare(cfg, tmp_path / f"out-{name}", log=lambda _: None).content_sha256)
    assert hashes[0] == hashes[1]


def test_a_hugging_face_name_without_network_says_to_pass_a_local_path(ray_session, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="pass a local path"):
        corpus_files("hf:Salesforce/wikitext")


def test_cli_prepare_reports_errors_in_one_line(ray_session, tmp_path, capsys):
    code = main(["prepare", "--corpus", str(tmp_path / "nothing.txt"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: mhf prepare: argument --corpus: ") and "does not exist" in err


@needs_shared
def test_minimind_tokenizer_loads_and_prepares_wikitext(ray_session, tmp_path):
    tokenizer = TextTokenizer.resolve(str(SHARED / "minimind" / "tokenizer.json"), 6400, [])
    assert tokenizer.vocab_size == 6400
    cfg = load_config(
        "tiny",
        [
            f"data.corpus={SHARED / 'wikitext-2-raw' / 'wiki.valid.raw'}",
            f"data.tokenizer={SHARED / 'minimind' / 'tokenizer.json'}",
            "model.vocab_size=6400",
            "model.hash.spec=H2B4K",
            "train.seq_len=128",
        ],
    )
    manifest = prepare(cfg, tmp_path / "wiki", log=lambda _: None)
    assert manifest.splits["train"].rows > 1000 and manifest.tokenizer.vocab_size == 6400


def test_the_recall_corpus_prepares_one_generated_example_per_row_without_ray(tmp_path):
    from mhf_dist.data.recall import TRAIN_SEED, VALIDATION_SEED, make_recall

    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=50"]
    cfg = load_config("tiny", [*overrides, "data.recall.num_pairs=5", "data.recall.num_queries=3"])
    manifest = prepare(cfg, tmp_path / "data", log=lambda _: None)
    assert manifest.splits["train"].rows == 50 and manifest.splits["validation"].rows == 2
    for split, seed, count in (("train", TRAIN_SEED, 50), ("validation", VALIDATION_SEED, 2)):
        rows, _ = read_rows(tmp_path / "data", split)
        assert np.array_equal(rows, make_recall(count, 5, 3, 32, 40, seed).rows)
    tokenizer = TextTokenizer.load(tmp_path / "data" / "tokenizer.json")
    assert tokenizer.vocab_size == 40 and tokenizer.decode([1, 20, 39]) == "k1 v0 v19"


def test_a_missing_truncated_or_swapped_shard_is_named_before_any_row_is_read(tmp_path, capsys):
    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=50"]
    cfg = load_config("tiny", [*overrides, "data.rows_per_shard=20"])
    prepare(cfg, tmp_path / "data", log=lambda _: None)
    assert main(["verify-data", str(tmp_path / "data")]) == 0
    assert "4 shards, tokenizer.json" in capsys.readouterr().out  # 20 + 20 + 10 train rows, 2 validation rows
    first, second = tmp_path / "data" / "train-00000.parquet", tmp_path / "data" / "train-00002.parquet"
    whole = first.read_bytes()
    first.write_bytes(whole[:-100])
    with pytest.raises(DataError, match=r"shard .*train-00000.parquet is truncated or not parquet; re-run"):
        read_rows(tmp_path / "data", "train")
    first.write_bytes(second.read_bytes())  # another shard's file in its place: 10 rows, not 20
    with pytest.raises(DataError, match=r"train-00000\.parquet holds 10 rows but the manifest says 20"):
        read_rows(tmp_path / "data", "train")
    first.unlink()
    with pytest.raises(DataError, match=r"train-00000\.parquet is missing"):
        read_rows(tmp_path / "data", "train")
    first.write_bytes(whole)
    table = pq.read_table(second)
    pq.write_table(table, second)  # one row group for all rows: the reader needs one row per group
    with pytest.raises(DataError, match=r"train-00002\.parquet is not one row per row group as prepared"):
        read_rows(tmp_path / "data", "train")
    pq.write_table(table, second, row_group_size=1, compression="snappy")  # only sha256 tells this one
    read_rows(tmp_path / "data", "train")
    assert main(["verify-data", str(tmp_path / "data")]) == 2
    assert "train-00002.parquet differs from the one prepared (sha256 mismatch)" in capsys.readouterr().err


def recall_data(tmp_path: Path) -> Path:
    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=50"]
    prepare(
        load_config("tiny", [*overrides, "data.rows_per_shard=20"]), tmp_path / "data", log=lambda _: None
    )
    return tmp_path / "data"


def flip_byte(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_a_shard_byte_changed_in_its_data_passes_the_footer_check_and_fails_verify_data(tmp_path):
    """The reader's check reads footers only (one small read per shard); a change in the data pages is
    what `verify_shards` reads every byte for."""
    data = recall_data(tmp_path)
    flip_byte(data / "train-00001.parquet", 4)  # the first byte after the leading magic: a page header
    RowReader(data, "train").check_all()
    with pytest.raises(
        DataError, match=r"train-00001\.parquet differs from the one prepared \(sha256 mismatch\)"
    ):
        verify_shards(data)


def test_a_shard_byte_changed_in_its_footer_fails_the_reader_and_verify_data(tmp_path):
    data = recall_data(tmp_path)
    shard = data / "validation-00000.parquet"
    flip_byte(shard, shard.stat().st_size - 1)  # the trailing magic
    for check in (RowReader(data, "validation").check_all, lambda: verify_shards(data)):
        with pytest.raises(DataError, match=r"validation-00000\.parquet is truncated or not parquet; re-run"):
            check()


def edit_manifest(data: Path, edit) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    edit(manifest)
    (data / "manifest.json").write_text(json.dumps(manifest))


def _set_sha256(manifest):
    manifest["splits"]["train"]["shards"][0]["sha256"] = "0" * 64


def _set_rows(manifest):
    manifest["splits"]["train"]["shards"][0]["rows"] = 21


def _set_seq_len(manifest):
    manifest["seq_len"] = "32"


def _add_key(manifest):
    manifest["tokenizer"]["pad_id"] = 0


def _drop_fingerprint(manifest):
    del manifest["signatures"]["fingerprint"]


def _drop_split(manifest):
    del manifest["splits"]["validation"]


def _old_version(manifest):
    manifest["version"] = 1


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (_set_sha256, "content_sha256 is not the hash of the shards' names and digests"),
        (_set_rows, r"splits\.train: rows 50 is not the sum of its shards' rows"),
        (_set_seq_len, "seq_len: Input should be a valid integer"),
        (_add_key, "tokenizer.pad_id: Extra inputs are not permitted"),
        (_drop_fingerprint, "signatures.fingerprint: Field required"),
        (_drop_split, "no validation split"),
        (_old_version, r"manifest version 1, this mhf-dist reads version 2 \(one row per row group"),
    ],
)
def test_a_manifest_edited_by_hand_fails_to_load_with_one_line(tmp_path, edit, problem):
    data = recall_data(tmp_path)
    edit_manifest(data, edit)
    with pytest.raises(DataError, match=problem) as info:
        RowReader(data, "train")
    assert "\n" not in str(info.value) and str(info.value).endswith(reprepare(data))


def test_damaged_manifest_json_is_a_one_line_error(tmp_path):
    data = recall_data(tmp_path)
    (data / "manifest.json").write_text((data / "manifest.json").read_text()[:-10])
    with pytest.raises(DataError, match=r"manifest\.json' is damaged \(invalid JSON at line \d+\); re-run"):
        read_manifest(data)


def test_the_manifest_keeps_its_on_disk_shape_and_one_written_before_the_later_fields_still_reads(tmp_path):
    data = recall_data(tmp_path)
    on_disk = json.loads((data / "manifest.json").read_text())
    assert sorted(on_disk) == [
        "config", "content_sha256", "document_format", "format", "packing", "rows_per_group", "seq_len",
        "signatures", "splits", "tokenizer", "version",
    ]  # fmt: skip
    assert sorted(on_disk["splits"]["train"]) == [
        "documents",
        "dropped_tokens",
        "replaced",
        "rows",
        "shards",
        "target_tokens",
    ]  # fmt: skip  (no `mixture` without replay)
    assert on_disk["tokenizer"]["bos_id"] is None and read_manifest(data).model_dump(mode="json") == on_disk
    rows = RowReader(data, "train").read_range()

    def as_first_written(manifest):  # version 2 before packing, document formats and LSH were recorded
        for section, key in ((None, "packing"), (None, "document_format"), ("tokenizer", "bos_id"),
                             ("signatures", "num_lsh"), ("signatures", "duplicate_signatures")):  # fmt: skip
            del (manifest[section] if section else manifest)[key]

    edit_manifest(data, as_first_written)
    old = read_manifest(data)
    assert (old.packing, old.document_format, old.tokenizer.bos_id) == ("overlap", "eos", None)
    assert (old.signatures.num_lsh, old.signatures.duplicate_signatures) == (0, 0)
    again = RowReader(data, "train").read_range()
    assert all(np.array_equal(again[key], rows[key]) for key in ("tokens", "signatures"))


def test_an_unwritable_output_or_zero_cpus_fails_before_any_work(tmp_path, capsys):
    recall = ["--set", "data.corpus=recall", "--set", "model.vocab_size=40", "--set", "train.seq_len=32"]
    (tmp_path / "a-file").write_text("not a directory")
    assert main(["prepare", *recall, "--out", str(tmp_path / "a-file" / "data")]) == 2
    assert "a-file' is a file; choose a path under a directory" in capsys.readouterr().err
    assert main(["prepare", *recall, "--out", str(tmp_path / "data"), "--num-cpus", "0"]) == 2
    assert "argument --num-cpus: '0': use a whole number of at least 1" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]  # nothing staged or written


def test_an_interrupted_prepare_leaves_no_manifest_and_a_rerun_resumes_to_the_same_shards(
    ray_session, tmp_path
):
    """SIGTERM once some shards are written: one line, exit 143, no manifest anywhere; the rerun skips
    the tokenized part and the shards already written (its log says how many) and writes the shards an
    uninterrupted run writes."""
    import subprocess
    import sys

    from faults import terminate_when

    from mhf_dist.data.corpus import builtin_documents

    (tmp_path / "big.txt").write_text("\n\n".join(builtin_documents() * 3))  # ~1.4M characters
    out, work = tmp_path / "out", tmp_path / ".out.partial"
    settings = ["--tokenizer", "bytes", "--set", "model.vocab_size=259", "--set", "data.rows_per_shard=128"]
    command = [sys.executable, "-m", "mhf_dist.cli", "prepare", "--corpus", str(tmp_path / "big.txt"),
               *settings, "--out", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    terminate_when(process, lambda: len(list(work.glob("progress/shards/*.json"))) >= 3)
    assert not out.exists() and not list(tmp_path.glob("**/manifest.json"))
    written = len(list(work.glob("progress/shards/*.json")))
    # A bucket run works in its output prefix: what it leaves there is what --overwrite and a rerun take.
    left = [path for path, _ in Location.of(work).files() if not Path(path).name.startswith(".")]
    assert {"progress/key.json", "progress/parts/00000.arrow", "progress/parts/00000.json"} <= set(left)
    assert [path for path in left if not WRITTEN_HERE.fullmatch(path)] == []

    cfg = load_config("tiny", ["data.tokenizer=bytes", "model.vocab_size=259", "data.rows_per_shard=128",
                               f"data.corpus={tmp_path / 'big.txt'}"])  # fmt: skip
    lines = []
    resumed = prepare(cfg, out, log=lines.append)
    assert "resumed: 1 of 1 tokenized parts were already written and checked" in lines
    skipped = next(line for line in lines if line.startswith("resumed:") and line.endswith("shards were "
                   "already written and checked"))  # fmt: skip
    assert int(skipped.split()[1]) == written < resumed.splits["train"].rows // 128
    assert not work.exists() and verify_shards(out) == sum(len(s.shards) for s in resumed.splits.values())
    uninterrupted = prepare(cfg, tmp_path / "whole", log=lambda _: None)
    assert resumed.content_sha256 == uninterrupted.content_sha256
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())


# --- what --overwrite may replace ---------------------------------------------------------------------

RECALL = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.rows_per_shard=20"]


def recall_cfg(examples: int = 50):
    return load_config("tiny", [*RECALL, f"data.recall.examples={examples}"])


def local_tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`, hidden ones too, with a file's bytes (None: a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def bucket_tree(root: Location) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name, _ in root.files()}


def _a_thesis_folder(out: Location) -> None:
    (out / "thesis.txt").write_text("three years of work")
    (out / "chapters" / "one.txt").write_text("chapter one")


def _another_tools_manifest(out: Location) -> None:
    (out / "manifest.json").write_text(json.dumps({"format": "someone-elses", "files": ["tokenizer.json"]}))
    (out / "tokenizer.json").write_text("{}")


def _our_shards_and_a_note(out: Location) -> None:
    prepare(recall_cfg(), out, log=lambda _: None)
    (out / "notes.txt").write_text("kept beside the shards")


def _a_note_called_manifest(out: Location) -> None:
    (out / "manifest.json").write_text("# notes\n")
    (out / "tokenizer.json").write_text("{}")


def _a_folder_named_like_a_shard(out: Location) -> None:
    (out / "manifest.json").write_text(json.dumps({"format": "mhf-shards"}))
    (out / "train-00000.parquet" / "part-0.txt").write_text("a partitioned table of someone's")


def _notes_in_a_progress_folder(out: Location) -> None:
    (out / "manifest.json").write_text("x")
    (out / "progress" / "thesis.txt").write_text("data")


def _a_plain_file(out: Location) -> None:
    out.write_text("not a directory")


@pytest.fixture(params=["local", "bucket"])
def root(request, tmp_path) -> Location:
    """Where a test's outputs go: a local directory or a new bucket."""
    if request.param == "local":
        return Location.of(tmp_path)
    return Location.of(request.getfixturevalue("bucket"))


def snapshot(root: Location) -> dict:
    return bucket_tree(root) if root.remote else local_tree(root.local)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_a_thesis_folder, r"is not shards mhf prepare wrote \(it holds 'chapters/one\.txt'\)"),
        (_a_note_called_manifest, r"is not shards mhf prepare wrote \(its manifest\.json is not JSON\)"),
        (_a_folder_named_like_a_shard, r"\(it holds 'train-00000\.parquet/part-0\.txt'\)"),
        (_notes_in_a_progress_folder, r"\(it holds 'progress/thesis\.txt'\)"),
        (_another_tools_manifest, r"is not shards mhf prepare wrote \(its manifest\.json is not an mhf"),
        (_our_shards_and_a_note, r"is not shards mhf prepare wrote \(it holds 'notes\.txt'\)"),
        (_a_plain_file, "is a file, not a directory of shards"),
    ],
)
def test_overwrite_refuses_what_prepare_did_not_write_and_leaves_it_byte_identical(root, make, why):
    out = root / "out"
    make(out)
    before = snapshot(root)
    with pytest.raises(DataError, match=why) as info:
        prepare(recall_cfg(), out, overwrite=True, log=lambda _: None)
    message = str(info.value)
    assert message.startswith(f"output {str(out)!r} ") and "\n" not in message
    assert message.endswith("; choose another --out or remove it yourself")
    assert snapshot(root) == before  # nothing moved aside, nothing deleted, nothing written


def test_the_cli_refuses_overwrite_of_a_foreign_folder_with_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    _a_thesis_folder(Location.of(out))
    before = local_tree(tmp_path)
    flags = [arg for setting in RECALL for arg in ("--set", setting)]
    assert main(["prepare", *flags, "--out", str(out), "--overwrite"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1] == (
        f"error: output {str(out)!r} is not shards mhf prepare wrote (it holds 'chapters/one.txt'); choose "
        "another --out or remove it yourself"
    )
    assert local_tree(tmp_path) == before


def test_a_folder_of_yours_where_a_prepare_works_is_refused_and_left_as_it_is(tmp_path):
    """`.NAME.partial` beside a local output is resumed or replaced: one holding a file prepare does not
    write is the user's, and so is a link; a staging file a killed writer left is prepare's."""
    work, out = tmp_path / ".out.partial", tmp_path / "out"

    def refused(holds: str) -> None:
        before = local_tree(tmp_path)
        with pytest.raises(DataError) as info:
            prepare(recall_cfg(), out, log=lambda _: None)
        assert str(info.value) == (
            f"{str(work)!r}, the work area of a prepare of {str(out)!r}, is not mhf's ({holds}); move it "
            "away or choose another --out"
        )
        assert local_tree(tmp_path) == before

    (work / "progress").mkdir(parents=True)
    (work / "progress" / "mynotes.txt").write_text("precious")
    refused("it holds 'progress/mynotes.txt'")
    (tmp_path / "mine").mkdir()
    work.rename(tmp_path / "mine" / "kept")
    work.symlink_to(tmp_path / "mine")
    refused("it holds 'kept/progress/mynotes.txt'")
    (tmp_path / "mine" / "kept" / "progress" / "mynotes.txt").unlink()
    refused("a link or a file")
    work.unlink()  # a killed writer's staging file is prepare's own: the work area is taken over
    (work / "progress").mkdir(parents=True)
    (work / ".tokenizer.json.0123456789ab.tmp").write_bytes(b"cut short")
    prepare(recall_cfg(), out, log=lambda _: None)
    assert not work.exists() and (out / "manifest.json").is_file()


def test_overwrite_replaces_shards_prepare_wrote_and_leaves_nothing_beside_them(root):
    out = root / "out"
    prepare(recall_cfg(), out, log=lambda _: None)
    with pytest.raises(DataError, match=r"holds prepared shards; pass --overwrite or choose another --out$"):
        prepare(recall_cfg(60), out, log=lambda _: None)
    manifest = prepare(recall_cfg(60), out, overwrite=True, log=lambda _: None)
    assert read_manifest(out) == manifest and manifest.splits["train"].rows == 60
    written = {"manifest.json", *manifest.file_names()}  # in a bucket, the new version's folder alone
    assert set(snapshot(root)) == {f"out/{name}" for name in written} | (
        {"out"} if not root.remote else set()
    )


def test_overwrite_replaces_an_empty_directory_and_our_shards_around_a_damaged_manifest(tmp_path):
    """The damaged manifest's own error advises --overwrite: that must then work."""
    out = tmp_path / "out"
    out.mkdir()
    prepare(recall_cfg(), out, log=lambda _: None)  # an empty directory needs no --overwrite
    (out / "manifest.json").write_text((out / "manifest.json").read_text()[:-10])
    with pytest.raises(DataError, match=r"re-run `mhf prepare --overwrite --out"):
        read_manifest(out)
    prepare(recall_cfg(), out, overwrite=True, log=lambda _: None)
    assert verify_shards(out) == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_on_a_bucket_replaces_a_dataset_prepared_on_ray_but_not_one_with_a_stray_file(
    prepared, bucket
):
    cfg = byte_cfg(prepared[0].data.corpus, "unused")
    out = Location.of(f"{bucket}/data")
    prepare(cfg, out, log=lambda _: None)
    stale = dict(bucket_tree(out))
    prepare(byte_cfg(prepared[0].data.corpus, "unused", "data.val_percent=30"), out, overwrite=True,
            log=lambda _: None)  # fmt: skip
    assert bucket_tree(out) != stale and verify_shards(out) == sum(
        len(info.shards) for info in read_manifest(out).splits.values()
    )
    (out / "stale.txt").write_text("from before")
    before = bucket_tree(Location.of(bucket))
    with pytest.raises(DataError, match=r"\(it holds 'stale\.txt'\); choose another --out or remove it"):
        prepare(cfg, out, overwrite=True, log=lambda _: None)
    assert bucket_tree(Location.of(bucket)) == before


def test_overwrite_in_a_bucket_replaces_an_older_layout_and_never_works_in_a_version_its_manifest_names(
    bucket, tmp_path
):
    out = Location.of(f"{bucket}/out")
    prepare(recall_cfg(), tmp_path / "old", log=lambda _: None)
    out.upload(tmp_path / "old", last="manifest.json")  # the older layout: every file beside the manifest
    assert verify_shards(out) == 4
    first = prepare(recall_cfg(60), out, overwrite=True, log=lambda _: None)
    assert sorted(bucket_tree(out)) == sorted(["manifest.json", *first.file_names()])
    # Stopped between its switch and its clean-up, a run left its key in the live version; the manifest
    # was then edited so that it no longer reads. An unfinished version is resumed, an orphan removed.
    (out / first.folder / "progress" / "key.json").write_text("{}")
    edited = json.loads((out / "manifest.json").read_text()) | {"version": 3}
    (out / "manifest.json").write_text(json.dumps(edited))
    (out / "v-ffffffffffff" / "progress" / "key.json").write_text("{}")
    (out / "v-fffffffffffe" / "train-00000.parquet").write_text("half written")
    second = prepare(recall_cfg(70), out, overwrite=True, log=lambda _: None)
    assert second.folder == "v-ffffffffffff" and read_manifest(out) == second
    assert sorted(bucket_tree(out)) == sorted(["manifest.json", *second.file_names()])
    assert second.moved_to("") == prepare(recall_cfg(70), tmp_path / "new", log=lambda _: None)
    assert verify_shards(out) == verify_shards(tmp_path / "new")
    # Another tool's manifest beside a version folder is not ours to replace.
    (out / "manifest.json").write_text(json.dumps({"format": "someone-elses"}))
    before = bucket_tree(out)
    with pytest.raises(DataError, match=r"its manifest\.json is not an mhf shard manifest\); choose another"):
        prepare(recall_cfg(), out, overwrite=True, log=lambda _: None)
    assert bucket_tree(out) == before


def test_a_file_put_in_the_output_while_overwrite_runs_is_never_deleted(root, monkeypatch):
    """Ownership is checked again at the switch: locally the rename would delete the file, so the run
    stops before it (the old dataset kept); in a bucket the clean-up after the switch leaves it."""
    from mhf_dist.data.prepare import recall as recall_prepare

    out = root / "out"
    old = prepare(recall_cfg(), out, log=lambda _: None)

    def meanwhile(tokenizer, path):
        (out / "notes.txt").write_text("mine")
        save_tokenizer(tokenizer, path)

    monkeypatch.setattr(recall_prepare, "save_tokenizer", meanwhile)
    if not root.remote:
        with pytest.raises(DataError) as raised:
            prepare(recall_cfg(60), out, overwrite=True, log=lambda _: None)
        assert str(raised.value).startswith(
            f"output {str(out)!r} is no longer only shards mhf prepare wrote (it holds 'notes.txt'); move"
        )
        assert read_manifest(out) == old
    else:
        new = prepare(recall_cfg(60), out, overwrite=True, log=lambda _: None)
        assert sorted(bucket_tree(out)) == sorted(["manifest.json", "notes.txt", *new.file_names()])
    assert (out / "notes.txt").read_text() == "mine"


def test_the_demo_refuses_a_data_folder_it_did_not_write_and_names_workdir(tmp_path, monkeypatch):
    from mhf_dist import demo

    monkeypatch.setattr(demo, "run_sweep", lambda *_, **__: pytest.fail("the demo went on to its sweep"))
    _a_thesis_folder(Location.of(tmp_path / "data"))
    before = local_tree(tmp_path)
    with pytest.raises(DataError, match=r"; choose another --workdir or remove it yourself$") as info:
        demo.run_demo("tiny", RECALL, tmp_path, log=lambda _: None)
    assert repr(str(tmp_path / "data")) in str(info.value)
    assert local_tree(tmp_path) == before


def test_a_directory_never_replaces_a_file_and_a_failed_swap_puts_the_old_one_back(tmp_path, monkeypatch):
    import mhf_dist.storage as storage

    staging, out = tmp_path / ".staging", tmp_path / "out"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "new.txt").write_text("new")
    out.write_text("a file")
    before = local_tree(tmp_path)
    with pytest.raises(FileExistsError, match="is not a directory"):
        storage.publish_directory(staging, out, replace=True)
    assert local_tree(tmp_path) == before
    out.unlink()
    (out / "old").mkdir(parents=True)
    (out / "old" / "old.txt").write_text("old")
    before = local_tree(tmp_path)

    def disk_full(staging: Path, path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "_publish", disk_full)
    with pytest.raises(OSError, match="No space left"):
        storage.publish_directory(staging, out, replace=True)
    assert local_tree(tmp_path) == before  # the old directory back in place, no .out.old-* beside it


# --- verify-data and the tokenizer every run checks ---------------------------------------------------


def _truncate_tokenizer(data: Path) -> None:
    (data / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes()[:-20])


def _another_tokenizer(data: Path) -> None:
    TextTokenizer.bytes().save(data / "tokenizer.json")


def _flip_a_signature_row(data: Path) -> None:
    path = data / "signatures.safetensors"
    blob = path.read_bytes()
    header_size = int.from_bytes(blob[:8], "little")
    start = json.loads(blob[8 : 8 + header_size])["rows"]["data_offsets"][0]
    flip_byte(path, 8 + header_size + start + 3)


def _edit_vocab_size(data: Path) -> None:
    edit_manifest(data, lambda manifest: manifest["tokenizer"].update(vocab_size=41))


def _edit_seq_len(data: Path) -> None:
    edit_manifest(data, lambda manifest: manifest.update(seq_len=31))


def _edit_num_hashes(data: Path) -> None:
    edit_manifest(data, lambda manifest: manifest["signatures"].update(num_hashes=3))


def _copy_a_shard_beside_them(data: Path) -> None:
    (data / "train-00009.parquet").write_bytes((data / "train-00000.parquet").read_bytes())


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_truncate_tokenizer, r"tokenizer\.json does not match the manifest's sha256"),
        (_another_tokenizer, r"tokenizer\.json does not match the manifest's sha256"),
        (_flip_a_signature_row, r"signature table .*signatures\.safetensors is damaged"),
        (_edit_vocab_size, r"tokenizer\.json has vocab_size 40 but the manifest says 41"),
        (_edit_seq_len, r"train-00000\.parquet column input_ids is .*\[33\], but the manifest means seq_len"),
        (_edit_num_hashes, r"signatures\.safetensors has num_hashes 2 but the manifest says 3"),
        (
            _copy_a_shard_beside_them,
            r"holds train-00009\.parquet, a shard its manifest does not list; remove",
        ),
    ],
)
def test_verify_data_checks_every_file_the_manifest_lists_and_its_fields(tmp_path, capsys, damage, problem):
    data = recall_data(tmp_path)
    assert verify_shards(data) == 4
    damage(data)
    with pytest.raises(DataError, match=problem) as info:
        verify_shards(data)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(reprepare(data))
    assert main(["verify-data", str(data)]) == 2 and "error: " in capsys.readouterr().err


def test_a_run_refuses_a_broken_tokenizer_json_before_any_ray_work(tmp_path, monkeypatch):
    import mhf_dist.train.ray_trainer as ray_trainer

    data = recall_data(tmp_path)
    _truncate_tokenizer(data)
    monkeypatch.setattr(ray_trainer, "ensure_ray", lambda **_: pytest.fail("Ray started"))
    cfg = load_config(
        "tiny",
        [*RECALL, f"data.path={data}", f"topology.storage={tmp_path / 'runs'}", "train.precision=fp32"],
    )
    with pytest.raises(DataError) as info:
        ray_trainer.train(cfg, ray_trainer.TrainOptions())
    assert str(info.value) == (
        f"{data / 'tokenizer.json'} does not match the manifest's sha256; {reprepare(data)}"
    )
    assert not (tmp_path / "runs").exists()


def test_the_tokenizer_check_takes_the_file_prepare_wrote_and_one_an_earlier_version_saved_pretty(tmp_path):
    data = recall_data(tmp_path)
    manifest = read_manifest(data)
    written = (data / "tokenizer.json").read_bytes()
    assert hashlib.sha256(written).hexdigest() == manifest.tokenizer.sha256  # the bytes are what it records
    check_tokenizer(data, manifest)
    TextTokenizer.load(data / "tokenizer.json").save(data / "tokenizer.json")  # pretty, as before
    assert (data / "tokenizer.json").read_bytes() != written
    check_tokenizer(data, manifest)
    assert verify_shards(data) == 4


def test_an_empty_corpus_says_it_is_empty_not_to_change_the_vocab_size(tmp_path):
    """A BPE learned from no text has the 257 byte tokens alone: the error is the corpus, not the size."""
    (tmp_path / "empty.txt").write_text("\n\n")
    held_out = next(p for p in PARAGRAPHS if is_validation(p, 20))
    (tmp_path / "held-out.txt").write_text(held_out + "\n")
    out = tmp_path / "out"
    for corpus, problem in (
        (
            "empty.txt",
            f"corpus {str(tmp_path / 'empty.txt')!r} holds no text; pass a corpus with at least one",
        ),
        ("held-out.txt", r"all 1 documents are held out for validation \(data.val_percent=20\)"),
    ):
        cfg = load_config(
            "tiny",
            [f"data.corpus={tmp_path / corpus}", "data.tokenizer=bpe", "model.vocab_size=300",
             "data.val_percent=20"],
        )  # fmt: skip
        with pytest.raises(DataError, match=problem) as info:
            prepare(cfg, out, log=lambda _: None)
        assert "vocab_size" not in str(info.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "held-out.txt"]


def test_a_learned_bpe_the_settings_refuse_leaves_nothing_and_a_hash_without_room_learns_none(
    tmp_path, monkeypatch
):
    """A BPE smaller than model.vocab_size is refused once learned, leaving no work area behind (but a
    staged Dataset snapshot, which a rerun of other settings reuses); a vocabulary no table of
    model.hash can hold, or a BPE to learn with a data.signatures table, is refused before any BPE is
    learned."""
    (tmp_path / "small.txt").write_text("".join(f"{p}\n\n" for p in PARAGRAPHS))
    sets = [f"data.corpus={tmp_path / 'small.txt'}", "data.tokenizer=bpe", "model.vocab_size=5000"]
    refused = r"^tokenizer has \d+ tokens but model.vocab_size=5000; set"
    with pytest.raises(DataError, match=refused):
        prepare(load_config("tiny", sets), tmp_path / "out", log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == ["small.txt"]
    staged = tmp_path / ".out.partial" / "progress" / "staged" / "web" / "000000.parquet"
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"a stand-in snapshot")
    with pytest.raises(DataError, match=refused):
        prepare(load_config("tiny", sets), tmp_path / "out", log=lambda _: None)
    assert [p for p in (tmp_path / ".out.partial").rglob("*") if p.is_file()] == [staged]
    no_table = [
        sets[0],
        "data.tokenizer=bytes",
        "model.vocab_size=259",
        f"data.signatures={tmp_path / 'no-model'}",
    ]
    with pytest.raises(SignatureError, match=r"no-model.* does not exist"):
        prepare(load_config("tiny", no_table), tmp_path / "out", log=lambda _: None)
    assert [p for p in (tmp_path / ".out.partial").rglob("*") if p.is_file()] == [staged]
    monkeypatch.setattr(TextTokenizer, "train_bpe", lambda *_: pytest.fail("a BPE was learned"))
    with pytest.raises(
        DataError, match=r"^data.signatures fixes the vocabulary .* \(data.tokenizer=bpe\) would"
    ):
        prepare(load_config("tiny", [*no_table, *sets[1:]]), tmp_path / "out", log=lambda _: None)
    with pytest.raises(SignatureError, match=r"exceeds the 2 signatures of H=8, B=2 \(reference scheme\)"):
        prepare(load_config("tiny", [*sets, "model.hash.spec=H8B2"]), tmp_path / "out", log=lambda _: None)
    recall = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "model.hash.spec=H8B2"]
    with pytest.raises(SignatureError, match=r"exceeds the 2 signatures of H=8, B=2"):  # generated rows too
        prepare(load_config("tiny", recall), tmp_path / "recall", log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "small.txt"]  # as it was


def test_data_without_a_validation_split_is_trained_without_val_nll_and_named_when_scored(tmp_path):
    """data.val_percent=0 writes no validation shard: a run's validator has no rows (so no val_nll, not a
    failed run), and reading the split says which setting made it empty."""
    from mhf_dist.train.worker import Validator

    cfg = load_config("tiny", [*RECALL, "data.val_percent=0", f"data.path={tmp_path / 'data'}"])
    assert not prepare(cfg, tmp_path / "data", log=lambda _: None).splits["validation"].shards
    assert not Validator(cfg, rank=0, world_size=1, batch_size=4)
    with pytest.raises(DataError, match=r"no validation rows; prepare them with data.val_percent above 0$"):
        RowReader(tmp_path / "data", "validation")
    # a share too small for one row holds out nothing either: prepare says so, and the fix is another
    lines = []
    little = [*RECALL, "data.recall.examples=50", "data.val_percent=1"]  # half a row
    prepare(load_config("tiny", little), tmp_path / "little", log=lines.append)
    assert any(
        line.startswith("warning: data.val_percent=1 held out too little text for one row") for line in lines
    )
    with pytest.raises(DataError, match=r"no validation rows; prepare more text, a larger data.val_percent"):
        RowReader(tmp_path / "little", "validation")


def test_a_tokenizer_json_is_read_from_a_file_uri_under_home_or_from_a_bucket(bucket, tmp_path, monkeypatch):
    words = TextTokenizer.train_bpe(["one two three four"] * 20, 280)
    monkeypatch.setenv("HOME", str(tmp_path))
    for place in (tmp_path / "tok.json", f"{bucket}/tok.json"):
        save_tokenizer(words, place)
    for spec in (f"file://{tmp_path}/tok.json", "~/tok.json", f"{bucket}/tok.json"):
        assert TextTokenizer.resolve(spec, 280, []).sha256 == words.sha256, spec
    with pytest.raises(DataError, match=r"^tokenizer '~/nothing\.json' is neither 'bpe', .* nor an existing"):
        TextTokenizer.resolve("~/nothing.json", 280, [])


def test_the_longest_output_name_the_check_lets_through_is_prepared_and_overwritten(tmp_path):
    """Its work area `.NAME.partial` and the old dataset set aside, `.NAME.old-<8 hex>`, fit in 255 bytes."""
    with pytest.raises(DataError, match=r"is 242 bytes; it may have at most 241 \(.*\); choose another"):
        prepare(recall_cfg(), tmp_path / ("o" * 242), log=lambda _: None)
    assert not any(tmp_path.iterdir())
    out = tmp_path / ("o" * 241)
    prepare(recall_cfg(), out, log=lambda _: None)
    assert prepare(recall_cfg(60), out, overwrite=True, log=lambda _: None).splits["train"].rows == 60
    assert [path.name for path in tmp_path.iterdir()] == [out.name]
