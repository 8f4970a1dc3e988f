"""`--tokenizer mistral-v0.3`: Mistral-7B-v0.3's tokenizer converted from mistral-common, the authors'
signature table over it, and prepared data in its document format (`<s> text`, no `</s>`)."""

import json

import numpy as np
import pytest
from authors_loop import authors_hash_map

from mhf_dist.config import load_config
from mhf_dist.data import mistral
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.signatures import SignatureTable, build_for_config, load_table

pytest.importorskip("mistral_common", reason="mistral-v0.3 needs the mistral-common package")

V, H, B = 32768, 4, 16384
MISTRAL_SET = ["model.vocab_size=32768", "model.hash.spec=H4B16384", "data.tokenizer=mistral-v0.3"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(mistral.CACHE_ENV, str(cache))
        return TextTokenizer.resolve("mistral-v0.3", V, [])


def test_the_vocabulary_is_mistral_v03s_with_its_special_and_byte_tokens(tokenizer):
    vocab = tokenizer.vocabulary()
    assert tokenizer.vocab_size == len(vocab) == V
    assert vocab[:10] == ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # fmt: skip
    # The Hub's v0.3 names for the control ids mistral-common renamed later ([IMG], [REFERENCE_DOC_0], ...).
    assert vocab[10] == "[control_8]" and vocab[13] == "[control_11]" and vocab[770] == "[control_768]"
    assert vocab[771] == "<0x00>" and vocab[781] == "<0x0A>" and vocab[1026] == "<0xFF>"
    specials = {
        index for index, added in tokenizer.tokenizer.get_added_tokens_decoder().items() if added.special
    }
    assert specials == set(range(771))
    assert (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_token) == (2, 1, "</s>")
    assert tokenizer.resolve_format("auto") == "bos"


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("Hello world", ["▁Hello", "▁world"]),
        ("The cat sat.", ["▁The", "▁cat", "▁sat", "."]),
        ("a\nb", ["▁a", "<0x0A>", "b"]),  # a newline has no piece: byte fallback
        ("𝔘", ["▁", "<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]),  # a rare character: its four UTF-8 bytes
    ],
)
def test_known_encodings_round_trip(tokenizer, text, tokens):
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    assert encoding.tokens == tokens
    assert tokenizer.decode(encoding.ids) == text
    # The default special tokens put `<s>` first and no `</s>` (LlamaTokenizerFast's template).
    assert tokenizer.tokenizer.encode(text).ids == [1, *encoding.ids]


def test_english_and_chinese_text_encode_as_sentencepiece_does_and_decode_back(tokenizer):
    spm = pytest.importorskip("sentencepiece")
    processor = spm.SentencePieceProcessor(model_file=str(mistral.source_model()))
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "中文分词测试，你好世界。",
        "naïve café, déjà vu: 3.14159 and 1234567 digits!",
        "def f(x):\n\treturn x**2",
        "emoji 🤖 and ligature ﬁ",
    ]
    for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True):
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == text


def test_conversion_is_deterministic_cached_once_and_a_damaged_cache_is_converted_again(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(mistral.CACHE_ENV, str(tmp_path))
    text = mistral.tokenizer_json()
    cached, checksum = sorted((tmp_path / "tokenizers").iterdir())
    assert cached.read_text(encoding="utf-8") == text == mistral.convert(mistral.source_model()).to_str()
    monkeypatch.setattr(mistral, "convert", lambda source: pytest.fail("converted again"))
    assert mistral.tokenizer_json() == text  # a later call reads the cache
    monkeypatch.undo()
    monkeypatch.setenv(mistral.CACHE_ENV, str(tmp_path))
    for damage in (text.replace('"▁the"', '"▁teh"'), "garbage{{{"):  # edited (valid JSON) or broken
        cached.write_text(damage, encoding="utf-8")
        assert mistral.tokenizer_json() == text and cached.read_text(encoding="utf-8") == text
    assert sorted(path.name for path in cached.parent.iterdir()) == [cached.name, checksum.name]


def test_the_reference_h4b16k_table_is_the_authors_row_for_row(tokenizer):
    tokens = tokenizer.vocabulary()
    cfg = load_config("tiny", MISTRAL_SET)
    ours = build_for_config(cfg.model.hash, tokens, tokenizer.pad_token)
    authors = authors_hash_map(tokens, H, B, pad_id=tokenizer.eos_id)
    assert authors[2].tolist() == [0, 0, 0, 0] and ours.pad_id == 2
    np.testing.assert_array_equal(ours.rows.astype(np.int64), authors)
    direct = SignatureTable.build(tokens, H, B, 0, "reference", pad_token="</s>")
    assert direct.fingerprint == ours.fingerprint


DOCS = [
    "MultiHashFormer replaces the token table with hashed buckets.",
    "每个词元由四个哈希桶表示。",
    "A third document, with a newline\nin it and a rare 𝔘.",
    "The fourth one is short.",
] * 6


@pytest.mark.parametrize("document_format", ["auto", "eos"])
def test_prepared_mistral_rows_lead_documents_with_bos_and_hold_no_eos(
    ray_session, tmp_path, tokenizer, monkeypatch, document_format
):
    monkeypatch.setenv(mistral.CACHE_ENV, str(tmp_path / "cache"))
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(DOCS) + "\n")
    cfg = load_config(
        "tiny",
        [*MISTRAL_SET, f"data.corpus={corpus}", "data.val_percent=0", "train.seq_len=32",
         f"data.document_format={document_format}"],
    )  # fmt: skip
    out = tmp_path / "data"
    manifest = prepare(cfg, out, num_cpus=2, log=lambda line: None)
    rows = RowReader(out, "train").read_range()["tokens"]
    stream = np.concatenate([rows[0], *(row[1:] for row in rows[1:])])  # rows overlap by one token
    if document_format == "auto":
        assert manifest.document_format == "bos" and manifest.tokenizer.bos_id == 1
        expected = [token for ids in tokenizer.encode_batch(DOCS) for token in (1, *ids)]
        assert 2 not in stream
    else:
        assert manifest.document_format == "eos"
        expected = [token for ids in tokenizer.encode_batch(DOCS) for token in (*ids, 2)]
        assert 1 not in stream
    assert stream.tolist() == expected[: len(stream)]
    table = load_table(out / "signatures.safetensors")
    authors = authors_hash_map(tokenizer.vocabulary(), H, B, pad_id=2)
    np.testing.assert_array_equal(table.rows.astype(np.int64), authors)
    signatures = RowReader(out, "train").read_range(0, 2)["signatures"]
    np.testing.assert_array_equal(signatures, authors[rows[:2]])
    assert json.loads((out / "manifest.json").read_text())["signatures"]["spec"] == "H4B16K"
