"""Every file a user hands in is read through one reader per kind: a damaged, empty or non-UTF-8 file is
one line naming the file, the position and the fix, never a parser's traceback."""

import re
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mhf_dist.cli import main
from mhf_dist.config import load_config, parse_override
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader
from mhf_dist.data.shards import read_manifest, reprepare, verify_shards
from mhf_dist.data.tokenizer import EOS, TextTokenizer
from mhf_dist.errors import ConfigError, DataError, MhfError, SignatureError
from mhf_dist.readers import read_json, read_jsonl, read_text, read_yaml
from mhf_dist.signatures import SignatureTable, load_table, save_table
from mhf_dist.submit import load_job_spec
from mhf_dist.sweep.spec import load_sweep

NOT_UTF8 = b'{"a": 1,\n "b": "caf\xe9"}\n'  # latin-1 e-acute at byte offset 19, line 2
ROW = b'{"text": "a", "n": 1}\n'


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_text_that_is_not_utf8_names_the_byte_offset_and_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(NOT_UTF8)
    with pytest.raises(DataError) as err:
        read_text(path, DataError, "save it as UTF-8")
    assert one_line(err) == (
        f"{str(path)!r} is not UTF-8: byte 0xe9 at byte offset 19 (line 2) cannot be decoded; "
        "save it as UTF-8"
    )
    with pytest.raises(DataError, match=r"'.*missing.txt' does not exist; check the path"):
        read_text(tmp_path / "missing.txt", DataError, "save it as UTF-8")
    with pytest.raises(DataError, match=r"' is not a file; check the path$"):  # a folder
        read_text(tmp_path, DataError, "save it as UTF-8")
    assert read_text("/dev/null", DataError, "save it as UTF-8") == ""  # a device or pipe is read
    with pytest.raises(ConfigError, match=r"^config file '.*' is not a file; check the path$"):
        load_config(str(tmp_path) + "/")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"a": 1,\n "b": [1, 2', r"is damaged \(invalid JSON at line 2\); redo it$"),
        (b"", r"is empty; redo it$"),
        (b" \n", r"is empty; redo it$"),
        (NOT_UTF8, r"is not UTF-8: byte 0xe9 at byte offset 19 \(line 2\) cannot be decoded; redo it$"),
        (b'{"a": {"b": 1, "b": 2}}', r"gives the key 'b' twice in one object; redo it$"),
    ],
)
def test_a_truncated_empty_non_utf8_or_ambiguous_json_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        read_json(path, ConfigError, "redo it")
    assert one_line(err).startswith(repr(str(path)))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (ROW + b'\n{"text": "b"\n', r"x.jsonl:3: not valid JSON \(.*column 13\); fix it"),
        (ROW + b"[1, 2]\n", r"x.jsonl:2: an array, not a JSON object; fix it"),
        (ROW + b'{"txt": "b", "n": 1}\n', r"x.jsonl:2: missing field 'text'; each line needs text, n"),
        (b'{"text": "a", "n": "1"}\n', r"x.jsonl:1: field 'n' must be a whole number, not a string"),
        (b'{"text": "a", "n": 1.5}\n', r"x.jsonl:1: field 'n' must be a whole number, not a number"),
        (ROW + NOT_UTF8, r"byte 0xe9 at byte offset 41 \(line 3\)"),
        (
            ROW + b'{"text": "b", "n": 1, "text": "c"}\n',
            r"x.jsonl:2: the key 'text' is given twice; keep one",
        ),
    ],
)
def test_a_jsonl_file_names_the_line_that_fails(tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        read_jsonl(path, DataError, "fix it", {"text": str, "n": int})
    one_line(err)


def test_jsonl_rows_are_dicts_and_an_empty_file_has_none(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n\n  \n{"text": "b", "extra": 1}\n')
    assert read_jsonl(path, DataError, "fix it", {"text": str}) == [{"text": "a"}, {"text": "b", "extra": 1}]
    path.write_text("")
    assert read_jsonl(path, DataError, "fix it") == []


def test_yaml_names_line_and_column_and_an_empty_file_is_none(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^cannot parse .*x.yaml at line 3, column 1: .*; fix the YAML$"):
        read_yaml(path, ConfigError, "fix the YAML")
    path.write_bytes(b"train:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"byte 0xe9 at byte offset 18 \(line 2\)"):
        read_yaml(path, ConfigError, "fix the YAML")
    path.write_text("")
    assert read_yaml(path, ConfigError, "fix the YAML") is None


def test_a_yaml_key_given_twice_is_one_line_and_merge_keys_still_merge(tmp_path):
    """PyYAML keeps the last of two equal keys: `steps: 5 ... steps: 7` would silently drop one."""
    path = tmp_path / "x.yaml"
    path.write_text("train:\n  steps: 5\n  lr: 0.1\n  steps: 7\n")
    with pytest.raises(
        ConfigError, match=r"x.yaml at line 4, column 3: key 'steps' is given twice; keep one"
    ):
        read_yaml(path, ConfigError, "fix the YAML")
    with pytest.raises(ConfigError, match=r"^'train=\{steps: 1, steps: 2\}': key 'steps' is given twice"):
        parse_override("train={steps: 1, steps: 2}")
    path.write_text("base: &base {steps: 5, lr: 0.1}\ntrain:\n  <<: *base\n  steps: 7\n")
    assert read_yaml(path, ConfigError, "fix the YAML")["train"] == {"steps": 7, "lr": 0.1}


def test_config_sweep_and_job_files_are_read_through_the_yaml_reader(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nseeds: [1\n")
    for load in (lambda path: load_config(str(path)), load_sweep, load_job_spec):
        with pytest.raises(ConfigError, match=r"cannot parse .*bad.yaml at line 3, column 1") as err:
            load(bad)
        one_line(err)
    bad.write_bytes(b"name: caf\xe9\n")
    for load in (lambda path: load_config(str(path)), load_sweep, load_job_spec):
        not_utf8 = r"bad.yaml' is not UTF-8: byte 0xe9 at byte offset 9 \(line 1\).*; save it as UTF-8$"
        with pytest.raises(ConfigError, match=not_utf8):
            load(bad)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    TextTokenizer.bytes().save(path)
    return path


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[: len(data) // 2], r"^cannot read tokenizer '.*': EOF while parsing .* line \d+"),
        (lambda data: b"", r"^cannot read tokenizer '.*': EOF while parsing a value at line 1"),
        (
            lambda data: data[:40] + b"\xff" + data[41:],
            r"is not UTF-8: byte 0xff at byte offset 40 \(line 3\)",
        ),
        (lambda data: b'{"version": "1.0"}', r"^cannot read tokenizer '.*': Model missing"),
    ],
)
def test_a_broken_tokenizer_json_is_one_data_error_line(tokenizer_json, tmp_path, damage, message):
    broken = tmp_path / "tokenizer.json"
    broken.write_bytes(damage(tokenizer_json.read_bytes()))
    with pytest.raises(DataError, match=message) as err:
        TextTokenizer.load(broken)
    assert one_line(err).endswith("; pass a tokenizer.json file")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prepared") / "data"
    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=20"]
    prepare(load_config("tiny", overrides), directory, log=lambda _: None)
    return directory


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, r"is damaged \(invalid JSON at line \d+\)"),  # None: the first half of the real one
        (b"", "is empty"),
        (b'{"format": "caf\xe9"}', r"is not UTF-8: byte 0xe9 at byte offset 15 \(line 1\) cannot be decoded"),
    ],
)
def test_a_truncated_empty_or_non_utf8_manifest_is_one_line_for_verify_data_and_train(
    prepared, tmp_path, capsys, content, problem
):
    copy = tmp_path / "data"
    shutil.copytree(prepared, copy)
    manifest = copy / "manifest.json"
    manifest.write_bytes(content if content is not None else manifest.read_bytes()[:200])
    expected = rf"manifest.json' {problem}; {re.escape(reprepare(copy))}$"
    for read in (read_manifest, verify_shards, lambda path: RowReader(path, "train")):  # train reads these
        with pytest.raises(DataError, match=expected) as err:
            read(copy)
        one_line(err)
    assert main(["verify-data", str(copy)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")


def test_a_damaged_data_page_of_a_shard_is_one_line_naming_the_shard(prepared, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(prepared, copy)
    shard = copy / "train-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[100:600] = bytes(byte ^ 0x5A for byte in data[100:600])  # pages, not the footer check_shard reads
    shard.write_bytes(bytes(data))
    reader = RowReader(copy, "train", signatures=False)
    with pytest.raises(
        DataError, match=rf"^shard {shard} is damaged \(.*\); re-run `mhf prepare --overwrite"
    ) as err:
        reader.read_range(0, reader.num_rows)
    one_line(err)


def test_a_signature_table_with_flipped_token_bytes_is_one_line(tmp_path):
    path = tmp_path / "sig.safetensors"
    save_table(SignatureTable.build(["a", "b", "c"], 2, 8), path)
    data = path.read_bytes()
    start = data.index(b"abc", 8 + int.from_bytes(data[:8], "little"))  # token_bytes in the data section
    path.write_bytes(data[:start] + b"\xff" + data[start + 1 :])
    with pytest.raises(
        SignatureError, match=r"is corrupted \(its tokens cannot be read: .*\); rebuild it"
    ) as err:
        load_table(path)
    one_line(err)


def test_a_word_outside_the_recall_vocabulary_is_an_error_not_eos():
    tokenizer = TextTokenizer.recall(40)
    assert tokenizer.encode_batch([f"k1 v0 {EOS} v3"]) == [[1, 20, tokenizer.eos_id, 23]]
    with pytest.raises(DataError) as err:
        tokenizer.encode_batch(["k1 v0", "k1 hello v0 world k2 hello"])
    assert one_line(err) == (
        "unknown word(s) 'hello', 'world': the tokenizer is word-level with a fixed vocabulary of 40 words "
        "and no <unk> token; use only its words"
    )
    with pytest.raises(DataError, match="unknown word"):
        tokenizer.encode_pair("k1 v0 k1", " nope")


def word_level(vocab: dict[str, int], **unk: str) -> TextTokenizer:
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, **unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer(tokenizer)


def test_a_word_level_tokenizer_with_an_explicit_unk_maps_unknown_words_to_it():
    tokenizer = word_level({"a": 0, EOS: 1, "<unk>": 2}, unk_token="<unk>")
    assert tokenizer.encode_batch(["a b"]) == [[0, 2]]
    without = word_level({"a": 0, EOS: 1})  # unk_token defaults to "<unk>", which is not in its vocabulary
    with pytest.raises(DataError, match=r"^unknown word\(s\) 'b': the tokenizer is word-level"):
        without.encode_batch(["a b"])


def test_text_with_undecodable_command_line_bytes_is_one_line():
    text = b"abc\xff\xfe".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    for tokenizer in (TextTokenizer.bytes(), TextTokenizer.recall(40)):
        with pytest.raises(DataError) as err:
            tokenizer.encode_batch(["fine", text])
        assert one_line(err) == (
            r"text 'abc\udcff\udcfe' is not valid UTF-8 (byte 0xff at character 3); pass UTF-8 text"
        )


def test_every_reader_raises_the_callers_error_class(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"\xff")

    class Mine(MhfError):
        pass

    for reader in (read_text, read_json, read_jsonl, read_yaml):
        with pytest.raises(Mine):
            reader(path, Mine, "fix")
