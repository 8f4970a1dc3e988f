"""The signature contract: both schemes' MurmurHash3 coordinates, the reference scheme's LSH coordinates
and its authors' redraw rule (checked row for row against `authors_loop`, an independent statement of the
authors' loop), murmur32's collision-free redraws, stable expansion, storage."""

import itertools
import json
import pickle

import mmh3
import numpy as np
import pytest
import torch
from authors_loop import authors_hash_map
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from mhf_dist import lsh, signatures
from mhf_dist.errors import SignatureError
from mhf_dist.signatures import (
    NO_PAD,
    SCHEMES,
    Murmur32Scheme,
    ReferenceScheme,
    Scheme,
    SignatureTable,
    load_table,
    make_scheme,
    reference_coordinate,
    save_table,
    token_signature,
)

vocabularies = st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=200, unique=True)


def test_murmurhash3_x86_32_reference_vectors_through_the_table_code_path():
    assert mmh3.hash("hello", 0) == 613153351
    assert token_signature(b"hello", 1, 2**32, 0) == (613153351,)
    assert token_signature(b"", 1, 2**32, 0) == (0,)
    assert token_signature(b"hello", 2, 2**32, 0) == (613153351, mmh3.hash(b"hello", 1, signed=False))


KNOWN_TOKENS = ["the", "Ġcat", "<pad>", "日本"]
H4B16K = [
    (
        ReferenceScheme(4, 16384),
        [[10484, 13483, 15281, 7079], [2135, 14715, 13145, 12937], [0, 0, 0, 0], [2857, 14822, 6730, 10078]],
        2,
    ),
    (
        ReferenceScheme(4, 16384, num_lsh=2),
        [[5428, 980, 15281, 7079], [5510, 15150, 13145, 12937], [0, 0, 0, 0], [15255, 1962, 6730, 10078]],
        2,
    ),
    (
        Murmur32Scheme(4, 16384),
        [
            [8034, 1797, 1433, 6660],
            [4977, 7427, 1848, 7287],
            [5322, 12345, 12907, 5910],
            [14658, 11655, 273, 10591],
        ],
        NO_PAD,  # murmur32 keeps no all-zero signature: the padding token is hashed like any other
    ),
]


@pytest.mark.parametrize(
    ("scheme", "rows", "pad_id"), H4B16K, ids=["reference", "reference-lsh2", "murmur32"]
)
def test_each_scheme_alone_draws_the_signatures_it_always_drew(scheme, rows, pad_id):
    """Pinned rows (from the tables every prepared dataset and exported model holds): a change to a
    scheme's rule, its seeds or its padding id shows here, with no table code in between."""
    assert scheme.padding_id(KNOWN_TOKENS, "<pad>") == pad_id
    drawn, salts = scheme.draw(np.zeros((0, 4), scheme.dtype), KNOWN_TOKENS, pad_id)
    assert drawn.tolist() == rows and drawn.dtype == np.uint16 and salts.tolist() == [0, 0, 0, 0]
    assert make_scheme(scheme.name, 4, 16384, 0, scheme.num_lsh) == scheme


@pytest.mark.parametrize(
    ("scheme", "rows", "salts"),
    [
        (ReferenceScheme(1, 16), [15, 4, 12, 3, 1, 7], [0, 0, 0, 1, 1, 0]),
        (Murmur32Scheme(1, 8), [2, 3, 7, 5, 6, 4], [0, 0, 0, 1, 2, 4]),
    ],
    ids=["reference", "murmur32"],
)
def test_each_scheme_alone_redraws_by_its_own_rule(scheme, rows, salts):
    """Single-hash schemes over six tokens: reference redraws only a repeat of the previous token's
    bucket (tokens 3 and 4), murmur32 every bucket taken before (its salts climb as buckets fill)."""
    drawn, drawn_salts = scheme.draw(np.zeros((0, 1), scheme.dtype), list("abcdef"), NO_PAD)
    assert drawn[:, 0].tolist() == rows and drawn_salts.tolist() == salts


def test_a_new_scheme_is_one_class_usable_by_name_everywhere(monkeypatch, tmp_path):
    monkeypatch.setattr(signatures, "SCHEMES", dict(SCHEMES))

    class FirstByte(Scheme):
        name = "first-byte"

        @property
        def capacity(self) -> int:
            return self.num_buckets

        def draw(self, earlier, tokens, pad_id):
            return self._as_arrays(
                [(token.encode()[0] % self.num_buckets,) for token in tokens], [0] * len(tokens)
            )

    table = SignatureTable.build(["a", "b"], 1, 256, scheme="first-byte")
    assert table.rows.tolist() == [[97], [98]] and table.scheme == FirstByte(1, 256)
    with pytest.raises(SignatureError, match="scheme 'reference' is already defined"):

        class Mine(Scheme):
            name = "reference"

    save_table(table, tmp_path / "sig.safetensors")
    assert load_table(tmp_path / "sig.safetensors").fingerprint == table.fingerprint
    with pytest.raises(SignatureError, match="LSH coordinates are the reference scheme's, not first-byte's"):
        make_scheme("first-byte", 2, 8, num_lsh=1)


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
@given(vocabularies, st.integers(1, 2), st.integers(0, 3))
def test_murmur32_gives_every_token_a_distinct_signature_even_when_collisions_are_frequent(
    tokens, num_hashes, seed
):
    num_buckets = 64 if num_hashes == 2 else 256
    table = SignatureTable.build(tokens, num_hashes, num_buckets, seed, scheme="murmur32")
    assert len({tuple(row) for row in table.rows.tolist()}) == len(tokens)
    assert table.rows.max() < num_buckets and table.duplicate_signatures == 0


@settings(max_examples=40, deadline=None)
@given(vocabularies, st.integers(1, 3), st.sampled_from([2, 3, 8, 64]), st.integers(0, 3), st.data())
def test_reference_tables_equal_the_authors_loop_row_for_row(tokens, num_hashes, num_buckets, seed, data):
    pad_id = data.draw(st.sampled_from([None, *range(len(tokens))]))
    pad_token = None if pad_id is None else tokens[pad_id]
    try:
        table = SignatureTable.build(tokens, num_hashes, num_buckets, seed, pad_token=pad_token)
    except SignatureError as err:  # where the authors' loop would never end: no second value to draw
        assert num_buckets == 2 and "with B=2 every coordinate but the padding token's is bucket 1" in str(
            err
        )
        return
    expected = authors_hash_map(tokens, num_hashes, num_buckets, pad_id=pad_id, seed=seed)
    assert np.array_equal(table.rows.astype(np.int64), expected.numpy())
    distinct = len({tuple(row) for row in table.rows.tolist()})
    assert table.duplicate_signatures == len(tokens) - distinct
    latest = {}  # the rule itself: a token differs from the latest earlier token of its prefix
    for row in table.rows.tolist():
        assert latest.get(tuple(row[:-1])) != row[-1] or not any(row)
        latest[tuple(row[:-1])] = row[-1]


def test_single_hash_tables_keep_only_consecutive_tokens_apart_and_count_their_duplicates():
    """H1B64 over 300 tokens (the paper's H1B4K.. at small scale): no prefix, so the one coordinate is
    redrawn only when it equals the previous token's; the build warns through the count, never fails."""
    tokens = [f"tok{i}" for i in range(300)]
    table = SignatureTable.build(tokens, 1, 64, pad_token="tok7")
    column = table.rows[:, 0].tolist()
    assert column[7] == 0 and all(value >= 1 for i, value in enumerate(column) if i != 7)
    assert all(a != b for a, b in itertools.pairwise(column))
    assert table.duplicate_signatures == 300 - len(set(column)) > 200
    assert table.describe()["duplicate_signatures"] == table.duplicate_signatures
    assert table.scheme.capacity == 64 < len(table)  # more tokens than distinct signatures is fine here
    assert np.array_equal(table.rows.astype(np.int64), authors_hash_map(tokens, 1, 64, pad_id=7).numpy())


def test_the_padding_token_is_the_latest_of_its_prefix_too():
    """Their loop records the padding token's 0 as the latest last coordinate of its prefix; at H=1 the
    prefix is everyone's, so the token after the padding token is never redrawn, even onto the bucket of
    the token before it."""
    first = reference_coordinate("a", 0, 16)
    after = next(f"c{i}" for i in range(100) if reference_coordinate(f"c{i}", 0, 16) == first)
    table = SignatureTable.build(["a", "<pad>", after], 1, 16, pad_token="<pad>")
    assert table.rows[:, 0].tolist() == [first, 0, first] and table.duplicate_signatures == 1
    assert np.array_equal(
        table.rows.astype(np.int64), authors_hash_map(["a", "<pad>", after], 1, 16, pad_id=1)
    )
    grown = SignatureTable.build(["a", "<pad>"], 1, 16, pad_token="<pad>").expand([after])
    assert np.array_equal(grown.rows, table.rows)  # the state rebuilt from the rows keeps the padding token


def test_a_third_token_of_a_prefix_is_compared_with_the_latest_only_so_it_may_repeat_the_first():
    """The authors' dict keeps one token per prefix: where three tokens share an H-1 prefix, the third is
    redrawn only against the second and may take the first one's signature (H2B4 makes it frequent)."""
    tokens = [f"w{i}" for i in range(40)]
    table = SignatureTable.build(tokens, 2, 4)
    rows = [tuple(row) for row in table.rows.tolist()]
    repeated = [i for i, row in enumerate(rows) if row in rows[:i]]
    assert repeated and table.duplicate_signatures == len(repeated)
    for index in repeated:
        same_prefix = [i for i in range(index) if rows[i][0] == rows[index][0]]
        assert rows[same_prefix[-1]] != rows[index]  # apart from the latest one, not from every one


def test_lsh_matrices_streamed_in_chunks_equal_one_whole_draw(monkeypatch):
    monkeypatch.setattr(lsh, "_CHUNK_VALUES", 3 * 5 * 16)  # 16 rows a chunk: several chunks
    shape = (48, 3, 5)
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    normalised = torch.nn.functional.normalize(whole, dim=-1)
    for j in range(3):
        assert torch.equal(lsh.normal_slice(11, shape, j), whole[:, j, :])
        assert torch.equal(lsh.normal_slice(11, shape, j, normalize=True), normalised[:, j, :])


LSH_TOKENS = ["the", "Ġthe", "Ġthere", "Ġtheir", "ab", "a", "", "aaaa", "<pad>", "日本語", "Ġcat", "Ġcats"]


@pytest.mark.parametrize(
    ("num_hashes", "num_buckets", "num_lsh"),
    [(2, 64, 1), (3, 64, 2), (4, 64, 3), (2, 64, 2), (1, 64, 1), (2, 4096, 1)],
    ids=["H2-1:1", "H3-2:1", "H4-3:1", "H2-2:0", "H1-1:0", "H2B4K-1:1"],
)
def test_lsh_coordinates_equal_the_authors_loop_row_for_row(num_hashes, num_buckets, num_lsh):
    tokens = [*LSH_TOKENS, *(f"Ġword{i}" for i in range(60)), *(f"x{i}y" for i in range(30))]
    table = SignatureTable.build(tokens, num_hashes, num_buckets, pad_token="<pad>", num_lsh=num_lsh)
    expected = authors_hash_map(tokens, num_hashes, num_buckets, num_lsh, pad_id=tokens.index("<pad>"))
    assert np.array_equal(table.rows.astype(np.int64), expected.numpy())
    assert table.num_lsh == num_lsh and table.rows[tokens.index("<pad>")].tolist() == [0] * num_hashes
    lsh_part = table.rows[:, :num_lsh]
    assert lsh_part[[i for i, t in enumerate(tokens) if t != "<pad>"]].min() >= 1
    assert table.duplicate_signatures == len(tokens) - len({tuple(r) for r in table.rows.tolist()})
    if num_lsh == num_hashes:  # nothing is redrawn: every prefix collision is a duplicate
        assert table.salts.max() == 0 and table.duplicate_signatures > 0


def test_lsh_at_the_papers_bucket_count_equals_the_authors_one_token_products():
    """B = 16,384 (H4B16K, LSH:MMH3 2:2): the blocked second stage picks the same arg-max as the authors'
    one-token products on every token (a float32 near-tie could differ; none does here)."""
    tokens = [*LSH_TOKENS, *(f"Ġtok{i}en" for i in range(40))]
    table = SignatureTable.build(tokens, 4, 16384, pad_token="<pad>", num_lsh=2)
    expected = authors_hash_map(tokens, 4, 16384, 2, pad_id=tokens.index("<pad>"))
    assert np.array_equal(table.rows.astype(np.int64), expected.numpy())


def test_collisions_are_redrawn_with_a_recorded_salt():
    tokens = [f"token{i}" for i in range(3000)]
    table = SignatureTable.build(tokens, num_hashes=2, num_buckets=64, scheme="murmur32")
    salted = np.flatnonzero(table.salts)
    assert len(salted) > 0, "3000 tokens in 4096 signatures must collide"
    for token_id in salted[:20]:
        key = tokens[token_id].encode() + b"\x00" + str(table.salts[token_id]).encode()
        assert tuple(table.rows[token_id]) == token_signature(key, 2, 64, 0)


@settings(max_examples=30, deadline=None)
@given(vocabularies, vocabularies, st.sampled_from(["reference", "murmur32"]), st.integers(1, 2), st.data())
def test_expansion_keeps_old_rows_and_follows_the_scheme(old, new, scheme, num_hashes, data):
    new = [token for token in new if token not in set(old)]
    num_buckets = 64 if scheme == "reference" else 256
    pad_id = data.draw(st.integers(0, len(old) - 1))  # the last old token too: H=1 then starts from 0
    table = SignatureTable.build(old, num_hashes, num_buckets, scheme=scheme, pad_token=old[pad_id])
    expanded = table.expand(new)
    assert np.array_equal(expanded.rows[: len(old)], table.rows)
    assert expanded.tokens[: len(old)] == table.tokens
    if scheme == "murmur32":
        assert len({tuple(row) for row in expanded.rows.tolist()}) == len(old) + len(new)
    else:  # the authors' loop over old + new: their state after the old tokens is rebuilt from the rows
        expected = authors_hash_map([*old, *new], num_hashes, num_buckets, pad_id=pad_id).numpy()
        assert np.array_equal(expanded.rows.astype(np.int64), expected)
    assert expanded.fingerprint != table.fingerprint or not new


def test_expanding_a_table_whose_added_tokens_were_never_hashed_continues_the_authors_loop():
    """An imported H1 table: the authors hash the base vocabulary only, so the added tokens' all-zero
    rows are not part of their loop's state; a new token is compared with the last base token."""
    base, added = [f"b{i}" for i in range(50)], ["<x>", "<y>"]
    rows = authors_hash_map(base, 1, 16, rows=52).numpy().astype(np.uint8)
    imported = SignatureTable([*base, *added], rows, np.zeros(52, np.uint32), ReferenceScheme(1, 16))
    new = next(f"n{i}" for i in range(100) if reference_coordinate(f"n{i}", 0, 16) == rows[49, 0])
    grown = imported.expand([new])
    assert grown.rows[52, 0] == authors_hash_map([*base, new], 1, 16)[50, 0] != rows[49, 0]
    assert grown.salts[52] == 1


@pytest.mark.parametrize("scheme", ["reference", "murmur32"])
def test_expansion_equals_building_the_whole_vocabulary_at_once(scheme):
    tokens = [f"w{i}" for i in range(500)]
    grown = SignatureTable.build(tokens[:300], 2, 64, scheme=scheme).expand(tokens[300:])
    assert grown.fingerprint == SignatureTable.build(tokens, 2, 64, scheme=scheme).fingerprint


def test_save_load_round_trip_is_exact(tmp_path):
    table = SignatureTable.build(["a", "b", "ü", "<|endoftext|>", "Ġ"], 3, 100, seed=5, pad_token="ü")
    save_table(table, tmp_path / "sig.safetensors")
    loaded = load_table(tmp_path / "sig.safetensors")
    assert loaded.tokens == table.tokens
    assert np.array_equal(loaded.rows, table.rows) and loaded.rows.dtype == table.rows.dtype
    assert (loaded.num_hashes, loaded.num_buckets, loaded.seed) == (3, 100, 5)
    assert (loaded.scheme, loaded.pad_id) == (ReferenceScheme(3, 100, 5), 2)
    assert loaded.fingerprint == table.fingerprint
    assert not list(tmp_path.glob("*.tmp"))


def test_lsh_and_reserved_rows_survive_save_and_load_and_a_plain_table_keeps_format_2(tmp_path):
    table = SignatureTable.build(LSH_TOKENS, 3, 64, pad_token="<pad>", num_lsh=1)
    rows = np.concatenate([table.rows, np.zeros((4, 3), table.rows.dtype)])  # 4 reserved rows
    salts = np.concatenate([table.salts, np.zeros(4, np.uint32)])
    padded = SignatureTable(table.tokens, rows, salts, table.scheme, table.pad_id)
    assert (len(padded), padded.num_rows, padded.reserved_rows) == (len(LSH_TOKENS), len(LSH_TOKENS) + 4, 4)
    for name, original in (("lsh", table), ("padded", padded)):
        save_table(original, tmp_path / f"{name}.safetensors")
        loaded = load_table(tmp_path / f"{name}.safetensors")
        assert (loaded.num_lsh, loaded.tokens, loaded.reserved_rows) == (
            1,
            original.tokens,
            original.reserved_rows,
        )
        assert np.array_equal(loaded.rows, original.rows) and loaded.fingerprint == original.fingerprint
    assert padded.as_tensor().shape == (len(LSH_TOKENS) + 4, 3)  # what a model's normaliser holds
    with pytest.raises(SignatureError, match=r"token id 12 is outside the signature table \(ids 0..11\)"):
        padded.lookup(np.array([len(LSH_TOKENS)]))  # a reserved row is no id
    save_table(SignatureTable.build(["a", "b"], 2, 8), tmp_path / "plain.safetensors")
    with safe_open(str(tmp_path / "plain.safetensors"), framework="numpy") as handle:
        assert handle.metadata()["version"] == "2" and "num_lsh" not in handle.metadata()
    with safe_open(str(tmp_path / "lsh.safetensors"), framework="numpy") as handle:
        assert (handle.metadata()["version"], handle.metadata()["num_lsh"]) == ("3", "1")


def test_saved_file_is_safetensors_not_pickle(tmp_path):
    """The safetensors layout: an 8-byte little-endian header length, a JSON header naming every tensor
    with its dtype, shape and byte range, then raw bytes; nothing a pickle loader can run."""
    save_table(SignatureTable.build(["a", "b"], 2, 8), tmp_path / "sig.safetensors")
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


@pytest.mark.parametrize(
    "change", ["num_hashes", "num_buckets", "seed", "row", "scheme", "num_lsh", "token_count"]
)
def test_fingerprint_changes_when_any_ingredient_changes(change):
    tokens = [f"t{i}" for i in range(50)]
    base = SignatureTable.build(tokens, 2, 64, 0)
    if change == "row":
        other = SignatureTable.build([*tokens[:-1], "different"], 2, 64, 0)
    elif change == "scheme":  # the same rows under another scheme's name are another table
        other = SignatureTable(tokens, base.rows.copy(), base.salts.copy(), Murmur32Scheme(2, 64))
    elif change == "num_lsh":  # the same rows said to hold an LSH coordinate
        other = SignatureTable(tokens, base.rows.copy(), base.salts.copy(), ReferenceScheme(2, 64, num_lsh=1))
    elif change == "token_count":  # the same rows, the last one reserved (no id)
        other = SignatureTable(tokens[:-1], base.rows.copy(), base.salts.copy(), base.scheme)
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
    with pytest.raises(SignatureError, match=r"exceeds the 4 signatures of H=2, B=2 \(murmur32 scheme"):
        SignatureTable.build(["a", "b", "c", "d", "e"], 2, 2, scheme="murmur32")
    beyond = SignatureTable.build([f"t{i}" for i in range(11)], 2, 4)  # reference: duplicates, no error
    assert beyond.scheme.capacity == 10 and beyond.duplicate_signatures >= 1
    with pytest.raises(SignatureError, match=r"num_lsh=3 must lie in 0..H=2"):
        SignatureTable.build(["a"], 2, 8, num_lsh=3)
    with pytest.raises(SignatureError, match="LSH coordinates are the reference scheme's, not murmur32's"):
        SignatureTable.build(["a"], 2, 8, scheme="murmur32", num_lsh=1)
    with pytest.raises(
        SignatureError, match="unknown signature scheme 'sha1'; use one of reference, murmur32"
    ):
        SignatureTable.build(["a"], 2, 8, scheme="sha1")
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
        load_table(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    with pytest.raises(SignatureError, match="cannot read signature table"):
        load_table(tmp_path / "junk.safetensors")
