"""The signature contract: both schemes' MurmurHash3 coordinates, collision-free redraws, stable
expansion, storage."""

import json
import pickle

import mmh3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mhf_dist.errors import SignatureError
from mhf_dist.signatures import SignatureTable, token_signature

vocabularies = st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=200, unique=True)


def test_murmurhash3_x86_32_reference_vectors_through_the_table_code_path():
    assert mmh3.hash("hello", 0) == 613153351
    assert token_signature(b"hello", 1, 2**32, 0) == (613153351,)
    assert token_signature(b"", 1, 2**32, 0) == (0,)
    assert token_signature(b"hello", 2, 2**32, 0) == (613153351, mmh3.hash(b"hello", 1, signed=False))


def test_unsalted_coordinate_is_mmh3_of_the_token_string_mod_b():
    tokens = ["the", "Ġcat", "<|endoftext|>", "日本"]
    table = SignatureTable.build(tokens, num_hashes=4, num_buckets=16384, seed=7, scheme="murmur32")
    for token_id, token in enumerate(tokens):
        assert table.salts[token_id] == 0
        expected = [mmh3.hash(token, 7 + j, signed=False) % 16384 for j in range(4)]
        assert table.rows[token_id].tolist() == expected


def test_reference_coordinates_are_one_plus_mmh3_x64_128_mod_b_minus_one_and_pad_is_zeros():
    tokens = ["the", "Ġcat", "<pad>", "日本", "<|endoftext|>"]
    table = SignatureTable.build(tokens, num_hashes=4, num_buckets=16384, pad_token="<pad>")
    assert table.rows[2].tolist() == [0, 0, 0, 0] and table.pad_id == 2
    for token_id, token in enumerate(tokens):
        if token == "<pad>":
            continue
        # mmh3's defaults: x64 arch, unsigned; the str is hashed as its UTF-8 bytes
        expected = [
            1 + mmh3.hash128(token.encode(), seed=j, x64arch=True, signed=False) % 16383 for j in range(4)
        ]
        assert table.rows[token_id].tolist() == expected and table.salts[token_id] == 0


def test_reference_collisions_redraw_only_the_last_coordinate_with_the_next_seed():
    tokens = [f"token{i}" for i in range(1500)]
    table = SignatureTable.build(tokens, num_hashes=2, num_buckets=64)
    assert table.rows.min() >= 1, "bucket 0 belongs to the padding token alone"
    redrawn = np.flatnonzero(table.salts)
    assert len(redrawn) > 0, "1500 tokens in 63 x 63 signatures must collide"
    earlier = {}
    for token_id, (token, row) in enumerate(zip(tokens, table.rows.tolist(), strict=True)):
        first = 1 + mmh3.hash128(token, seed=0) % 63
        candidates = [
            (first, 1 + mmh3.hash128(token, seed=1 + r) % 63) for r in range(table.salts[token_id] + 1)
        ]
        assert tuple(row) == candidates[-1]
        assert all(candidate in earlier for candidate in candidates[:-1])  # each skipped draw was taken
        earlier[tuple(row)] = token_id


@settings(max_examples=40, deadline=None)
@given(vocabularies, st.integers(1, 2), st.integers(0, 3), st.sampled_from(["reference", "murmur32"]))
def test_every_token_gets_a_distinct_signature_even_when_collisions_are_frequent(
    tokens, num_hashes, seed, scheme
):
    num_buckets = 64 if num_hashes == 2 else 256
    table = SignatureTable.build(tokens, num_hashes, num_buckets, seed, scheme=scheme)
    assert len({tuple(row) for row in table.rows.tolist()}) == len(tokens)
    assert table.rows.max() < num_buckets


def test_collisions_are_redrawn_with_a_recorded_salt():
    tokens = [f"token{i}" for i in range(3000)]
    table = SignatureTable.build(tokens, num_hashes=2, num_buckets=64, scheme="murmur32")
    salted = np.flatnonzero(table.salts)
    assert len(salted) > 0, "3000 tokens in 4096 signatures must collide"
    for token_id in salted[:20]:
        key = tokens[token_id].encode() + b"\x00" + str(table.salts[token_id]).encode()
        assert tuple(table.rows[token_id]) == token_signature(key, 2, 64, 0)


@settings(max_examples=30, deadline=None)
@given(vocabularies, vocabularies, st.sampled_from(["reference", "murmur32"]))
def test_expansion_keeps_old_rows_and_stays_collision_free(old, new, scheme):
    new = [token for token in new if token not in set(old)]
    table = SignatureTable.build(old, 2, 64, scheme=scheme)
    expanded = table.expand(new)
    assert np.array_equal(expanded.rows[: len(old)], table.rows)
    assert expanded.tokens[: len(old)] == table.tokens
    assert len({tuple(row) for row in expanded.rows.tolist()}) == len(old) + len(new)
    assert expanded.fingerprint != table.fingerprint or not new


@pytest.mark.parametrize("scheme", ["reference", "murmur32"])
def test_expansion_equals_building_the_whole_vocabulary_at_once(scheme):
    tokens = [f"w{i}" for i in range(500)]
    grown = SignatureTable.build(tokens[:300], 2, 64, scheme=scheme).expand(tokens[300:])
    assert grown.fingerprint == SignatureTable.build(tokens, 2, 64, scheme=scheme).fingerprint


def test_save_load_round_trip_is_exact(tmp_path):
    table = SignatureTable.build(["a", "b", "ü", "<|endoftext|>", "Ġ"], 3, 100, seed=5, pad_token="ü")
    table.save(tmp_path / "sig.safetensors")
    loaded = SignatureTable.load(tmp_path / "sig.safetensors")
    assert loaded.tokens == table.tokens
    assert np.array_equal(loaded.rows, table.rows) and loaded.rows.dtype == table.rows.dtype
    assert (loaded.num_hashes, loaded.num_buckets, loaded.seed) == (3, 100, 5)
    assert (loaded.scheme, loaded.pad_id) == ("reference", 2)
    assert loaded.fingerprint == table.fingerprint
    assert not list(tmp_path.glob("*.tmp"))


def test_saved_file_is_safetensors_not_pickle(tmp_path):
    """The safetensors layout: an 8-byte little-endian header length, a JSON header naming every tensor
    with its dtype, shape and byte range, then raw bytes; nothing a pickle loader can run."""
    SignatureTable.build(["a", "b"], 2, 8).save(tmp_path / "sig.safetensors")
    blob = (tmp_path / "sig.safetensors").read_bytes()
    header_size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_size])
    assert set(header) == {"__metadata__", "rows", "salts", "token_bytes", "token_offsets"}
    assert header["rows"]["dtype"] == "U8" and header["rows"]["shape"] == [2, 2]
    assert max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__") == (
        len(blob) - 8 - header_size
    )
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(blob)


@pytest.mark.parametrize("change", ["num_hashes", "num_buckets", "seed", "row", "scheme"])
def test_fingerprint_changes_when_any_ingredient_changes(change):
    tokens = [f"t{i}" for i in range(50)]
    base = SignatureTable.build(tokens, 2, 64, 0)
    if change == "row":
        other = SignatureTable.build([*tokens[:-1], "different"], 2, 64, 0)
    elif change == "scheme":  # the same rows under another scheme's name are another table
        other = SignatureTable(tokens, base.rows.copy(), base.salts.copy(), 2, 64, 0, "murmur32")
    else:
        kwargs = {"num_hashes": 2, "num_buckets": 64, "seed": 0}
        kwargs[change] += 1
        other = SignatureTable.build(tokens, **kwargs)
    assert other.fingerprint != base.fingerprint


@pytest.mark.parametrize(("num_buckets", "dtype"), [(256, np.uint8), (257, np.uint16), (65536, np.uint16)])
def test_rows_use_the_smallest_unsigned_dtype_that_holds_b(num_buckets, dtype):
    assert SignatureTable.build(["a", "b"], 2, num_buckets).rows.dtype == dtype


def test_lookup_is_vectorised_for_numpy_and_torch():
    table = SignatureTable.build([f"t{i}" for i in range(10)], 3, 64)
    ids = np.array([[0, 9, 3], [1, 1, 2]])
    looked_up = table.lookup(ids)
    assert looked_up.shape == (2, 3, 3)
    assert np.array_equal(looked_up[0, 1], table.rows[9])
    as_torch = table.lookup(torch.from_numpy(ids))
    assert as_torch.dtype == torch.int64 and torch.equal(
        as_torch, torch.from_numpy(looked_up.astype(np.int64))
    )


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(SignatureError, match="exceeds the 4 signatures"):
        SignatureTable.build(["a", "b", "c", "d", "e"], 2, 2, scheme="murmur32")
    with pytest.raises(SignatureError, match=r"exceeds the 10 signatures of H=2, B=4 \(reference scheme\)"):
        SignatureTable.build([f"t{i}" for i in range(11)], 2, 4)
    with pytest.raises(SignatureError, match="all 3 last-coordinate values after its first 1 are taken"):
        SignatureTable.build([f"t{i}" for i in range(10)], 2, 4)
    with pytest.raises(SignatureError, match=r"H>=1"):
        SignatureTable.build(["a"], 0, 8)
    with pytest.raises(SignatureError, match=r"B>=2"):
        SignatureTable.build(["a"], 2, 1)
    table = SignatureTable.build(["a", "b"], 2, 8)
    with pytest.raises(SignatureError, match=r"token id 2 is outside the signature table \(ids 0..1\)"):
        table.lookup(np.array([0, 2]))
    with pytest.raises(SignatureError, match="token id -1"):
        table.lookup(torch.tensor([-1]))
    with pytest.raises(SignatureError, match="already in the table"):
        table.expand(["c", "a"])
    with pytest.raises(SignatureError, match="does not exist"):
        SignatureTable.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    with pytest.raises(SignatureError, match="cannot read signature table"):
        SignatureTable.load(tmp_path / "junk.safetensors")
