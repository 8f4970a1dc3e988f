"""The demo flow end to end at a few steps: corpus -> BPE -> rows -> signatures -> three families."""

import json
import math

import numpy as np
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.packing import Packer, shuffled_batches
from mhf_dist.demo import run_demo
from mhf_dist.errors import DataError
from mhf_dist.signatures import SignatureTable


def test_builtin_corpus_needs_no_network_and_is_english_text():
    documents = builtin_documents()
    assert len(documents) > 50 and sum(map(len, documents)) > 300_000
    assert documents == builtin_documents()


def test_packing_reproduces_the_token_stream_with_every_eos():
    documents = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    stream = [token for doc in documents for token in (*doc, 0)]
    packer = Packer(3)
    rows = packer.add(np.array(stream))
    rebuilt = [token for row in rows.tolist() for token in row[:3]] + [rows[-1, -1]]
    assert rebuilt == stream[: len(rebuilt)] and len(rebuilt) + packer.dropped_tokens == len(stream)
    assert rows.shape == ((len(stream) - 1) // 3, 4)


def test_streaming_packer_gives_the_same_rows_however_the_stream_is_cut():
    stream = np.arange(100)
    whole = Packer(7).add(stream)
    packer = Packer(7)
    pieces = np.concatenate([packer.add(part) for part in np.split(stream, [1, 2, 30, 31, 64])])
    assert np.array_equal(whole, pieces) and packer.dropped_tokens == (100 - 1) % 7


def test_packer_rejects_a_seq_len_below_two():
    with pytest.raises(DataError, match="seq_len >= 2"):
        Packer(1)


def test_batches_are_reproducible_per_seed():
    rows = np.arange(40).reshape(10, 4)
    first = [b["tokens"].tolist() for _, b in zip(range(7), shuffled_batches(rows, 3, seed=1), strict=False)]
    again = [b["tokens"].tolist() for _, b in zip(range(7), shuffled_batches(rows, 3, seed=1), strict=False)]
    assert first == again


def test_demo_trains_all_three_families_and_writes_results(ray_session, tmp_path):
    cfg = load_config("tiny", ["train.steps=3", "train.log_every=1"])
    lines = []
    results = run_demo(cfg, tmp_path, log=lines.append)
    assert [r["family"] for r in results] == ["mhf", "qwen3", "qwen3_matched"]
    assert all(
        math.isfinite(r["val_nll"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_nll"])) for r in results
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["val_nll"] for r in saved["results"]] == [r["val_nll"] for r in results]
    table = SignatureTable.load(tmp_path / "data" / "signatures.safetensors")
    assert len(table) == cfg.model.vocab_size and table.spec == "H2B1K"
    assert any(line.startswith("step 3/3 | loss") for line in lines)
