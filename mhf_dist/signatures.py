"""Signature tables: every token id gets H MurmurHash3 bucket ids, no two tokens the same.

The contract (DESIGN.md) has two schemes; in both the key of token id t is its vocabulary string (the
tokenizer's token, as `convert_ids_to_tokens` gives it), ids are visited in increasing order, and
expansion appends rows by the same rule and never changes an existing row.

- `reference` (the authors' HUIYINXUE/MHF; the paper's model): coordinate j < H-1 is
  `1 + mmh3.hash128(key, seed + j) % (B-1)`; the last is `1 + mmh3.hash128(key, seed + H-1+r) % (B-1)`
  for the first r = 0, 1, ... that leaves the whole signature unused (r is stored as the token's salt).
  Bucket 0 of every coordinate is reserved: only the padding token's signature is all zeros. (The
  authors' loop compares a new last coordinate only with the previous token of the same prefix; the two
  rules agree unless three tokens share an H-1 prefix, which at H4B16K over 32K tokens never happens.)
- `murmur32` (this project's first scheme): coordinate j is `mmh3.hash(key, seed + j, signed=False) % B`;
  a taken signature is redrawn from `key + b"\\x00" + str(salt)` for salt = 1, 2, ...; the NUL separator
  keeps a salted key from colliding with another token's plain key ("a1" vs "a" + salt 1).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import mmh3
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mhf_dist.config import HashConfig, format_hash_spec
from mhf_dist.errors import SignatureError

# torch is imported only where a tensor is asked for: `mhf prepare`'s Ray tasks load tables and look up
# numpy rows, and importing torch cost each of their worker processes about a second of CPU.
if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 2  # 2: the scheme and the padding id are stored and covered by the fingerprint
MAX_SALT = 1_000_000
SCHEMES = ("reference", "murmur32")
NO_PAD = -1


def smallest_uint_dtype(max_value: int) -> np.dtype:
    """The narrowest unsigned integer dtype that holds `max_value`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def token_signature(key: bytes, num_hashes: int, num_buckets: int, seed: int) -> tuple[int, ...]:
    """The unsalted murmur32 signature of one key: coordinate j is MurmurHash3_x86_32(key, seed + j) mod B."""
    return tuple(mmh3.hash(key, seed + j, signed=False) % num_buckets for j in range(num_hashes))


def reference_coordinate(token: str, seed: int, num_buckets: int) -> int:
    """One reference coordinate: 1 + MurmurHash3_x64_128(token, seed) mod (B-1); bucket 0 stays free."""
    return 1 + mmh3.hash128(token, seed) % (num_buckets - 1)


def _salted_key(key: bytes, salt: int) -> bytes:
    return key if salt == 0 else key + b"\x00" + str(salt).encode()


def _murmur32_candidates(token: str, num_hashes: int, num_buckets: int, seed: int):
    key = token.encode("utf-8")
    for salt in range(MAX_SALT):
        yield salt, token_signature(_salted_key(key, salt), num_hashes, num_buckets, seed)


def _reference_candidates(token: str, num_hashes: int, num_buckets: int, seed: int):
    prefix = tuple(reference_coordinate(token, seed + j, num_buckets) for j in range(num_hashes - 1))
    for redraw in range(MAX_SALT):
        yield redraw, (*prefix, reference_coordinate(token, seed + num_hashes - 1 + redraw, num_buckets))


_CANDIDATES = {"reference": _reference_candidates, "murmur32": _murmur32_candidates}


class SignatureTable:
    """An immutable [V, H] table of bucket ids for a vocabulary, with its provenance.

    `pad_id` is the token whose signature is all zeros under the reference scheme (NO_PAD: none).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        rows: np.ndarray,
        salts: np.ndarray,
        num_hashes: int,
        num_buckets: int,
        seed: int,
        scheme: str = "reference",
        pad_id: int = NO_PAD,
    ) -> None:
        if scheme not in SCHEMES:
            raise SignatureError(f"unknown signature scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
        self._tokens = tuple(tokens)
        self._rows = rows
        self._salts = salts
        self.num_hashes = num_hashes
        self.num_buckets = num_buckets
        self.seed = seed
        self.scheme = scheme
        self.pad_id = pad_id
        self._rows.setflags(write=False)
        self._salts.setflags(write=False)
        self._torch_rows: torch.Tensor | None = None
        # A row of H small ints viewed as one 1/2/4/8-byte integer: 1-D `take` gathers ~3x faster.
        row_bytes = num_hashes * rows.dtype.itemsize
        self._packed = rows.view(f"<u{row_bytes}").reshape(-1) if row_bytes in (1, 2, 4, 8) else None
        self._fingerprint: str | None = None

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        tokens: Sequence[str],
        num_hashes: int,
        num_buckets: int,
        seed: int = 0,
        scheme: str = "reference",
        pad_token: str | None = None,
    ) -> SignatureTable:
        """Signatures for `tokens` in id order (tokens[i] is the string of id i).

        Under the reference scheme `pad_token` (if given and present) gets the all-zero signature.
        """
        _check_shape(num_hashes, num_buckets, seed)
        empty = cls(
            [],
            np.zeros((0, num_hashes), smallest_uint_dtype(num_buckets - 1)),
            np.zeros(0, np.uint32),
            num_hashes,
            num_buckets,
            seed,
            scheme,
        )
        if scheme != "reference" or pad_token is None or pad_token not in tokens:
            return empty.expand(tokens)
        pad_id = list(tokens).index(pad_token)
        head = empty.expand(tokens[:pad_id])
        padded = cls(
            (*head.tokens, pad_token),
            np.concatenate([head.rows, np.zeros((1, num_hashes), head.rows.dtype)]),
            np.concatenate([head.salts, np.zeros(1, np.uint32)]),
            num_hashes,
            num_buckets,
            seed,
            scheme,
            pad_id,
        )
        return padded.expand(tokens[pad_id + 1 :])

    def expand(self, new_tokens: Iterable[str]) -> SignatureTable:
        """A new table with rows appended for `new_tokens`; every existing row stays as it is."""
        new_tokens = list(new_tokens)
        known = set(self._tokens)
        for token in new_tokens:
            if not isinstance(token, str):
                raise SignatureError(f"token {token!r} is not a string; pass vocabulary strings")
            if token in known:
                raise SignatureError(
                    f"token {token!r} is already in the table (id {self._tokens.index(token)}); "
                    "expand with new tokens only"
                )
            known.add(token)
        total = len(self._tokens) + len(new_tokens)
        capacity = self.capacity
        if total > capacity:
            raise SignatureError(
                f"vocabulary of {total} tokens exceeds the {capacity} signatures of "
                f"H={self.num_hashes}, B={self.num_buckets} ({self.scheme} scheme); "
                "use more hashes or buckets"
            )
        taken = {tuple(row) for row in self._rows.tolist()}
        # The reference scheme redraws only the last coordinate: a prefix holds at most B-1 tokens.
        prefix_room = collections.Counter(signature[:-1] for signature in taken)
        rows, salts = [], []
        for token in new_tokens:
            salt, signature = self._first_free(token, taken, prefix_room)
            taken.add(signature)
            prefix_room[signature[:-1]] += 1
            rows.append(signature)
            salts.append(salt)
        dtype = smallest_uint_dtype(self.num_buckets - 1)
        new_rows = np.asarray(rows, dtype=dtype).reshape(len(rows), self.num_hashes)
        return SignatureTable(
            self._tokens + tuple(new_tokens),
            np.concatenate([self._rows, new_rows]),
            np.concatenate([self._salts, np.asarray(salts, dtype=np.uint32)]),
            self.num_hashes,
            self.num_buckets,
            self.seed,
            self.scheme,
            self.pad_id,
        )

    def _first_free(
        self, token: str, taken: set[tuple[int, ...]], prefix_room: collections.Counter
    ) -> tuple[int, tuple[int, ...]]:
        """(redraws, signature): the scheme's first draw for `token` that no earlier token holds."""
        draws = _CANDIDATES[self.scheme](token, self.num_hashes, self.num_buckets, self.seed)
        for salt, signature in draws:
            if self.scheme == "reference" and prefix_room[signature[:-1]] >= self.num_buckets - 1:
                raise SignatureError(
                    f"no free signature for {token!r}: all {self.num_buckets - 1} last-coordinate "
                    f"values after its first {self.num_hashes - 1} are taken (the reference scheme "
                    "redraws only the last one); use more buckets or hashes"
                )
            if signature not in taken:
                return salt, signature
        raise SignatureError(f"no free signature for {token!r} after {MAX_SALT} redraws; use more buckets")

    @property
    def capacity(self) -> int:
        """How many tokens the scheme can give distinct signatures (the padding token included)."""
        if self.scheme == "reference":
            return (self.num_buckets - 1) ** self.num_hashes + 1
        return self.num_buckets**self.num_hashes

    # --- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[str, ...]:
        return self._tokens

    @property
    def rows(self) -> np.ndarray:
        """The read-only [V, H] table, in the smallest unsigned dtype that holds B."""
        return self._rows

    @property
    def salts(self) -> np.ndarray:
        return self._salts

    @property
    def spec(self) -> str:
        return format_hash_spec(self.num_hashes, self.num_buckets)

    @property
    def fingerprint(self) -> str:
        """sha256 over (scheme, H, B, seed, table): equal fingerprints mean interchangeable tables."""
        if self._fingerprint is None:
            digest = hashlib.sha256(
                f"mhf-signatures:{self.scheme}:{self.num_hashes}:{self.num_buckets}:{self.seed}:".encode()
            )
            digest.update(self._rows.astype("<u8").tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def lookup(self, ids: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Signatures of `ids` with shape [..., H]; numpy in, numpy out; torch in, int64 torch out."""
        if "torch" in sys.modules and isinstance(ids, sys.modules["torch"].Tensor):  # no torch, no tensor
            self._check_ids(ids.min().item(), ids.max().item(), ids.numel())
            if self._torch_rows is None:
                self._torch_rows = self.as_tensor()
            return self._torch_rows.to(ids.device)[ids.long()]
        ids = np.asarray(ids)
        if ids.size:
            self._check_ids(int(ids.min()), int(ids.max()), ids.size)
        if self._packed is None:
            return self._rows[ids]
        return self._packed.take(ids, mode="clip").view(self._rows.dtype).reshape(*ids.shape, self.num_hashes)

    def as_tensor(self) -> torch.Tensor:
        """The table as an int64 [V, H] tensor, as models hold it."""
        import torch

        return torch.from_numpy(self._rows.astype(np.int64))

    def _check_ids(self, low: int, high: int, count: int) -> None:
        if count and (low < 0 or high >= len(self)):
            bad = low if low < 0 else high
            raise SignatureError(
                f"token id {bad} is outside the signature table (ids 0..{len(self) - 1}); "
                "use the tokenizer this table was built from, or expand the table"
            )

    # --- persistence --------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a safetensors file (no pickle) atomically: temp file in the same folder, then rename."""
        path = Path(path)
        encoded = [token.encode("utf-8") for token in self._tokens]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(blob) for blob in encoded])
        tensors = {
            "rows": np.ascontiguousarray(self._rows),
            "salts": np.ascontiguousarray(self._salts),
            "token_bytes": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
            "token_offsets": offsets,
        }
        metadata = {
            "format": "mhf-signature-table",
            "version": str(FORMAT_VERSION),
            "num_hashes": str(self.num_hashes),
            "num_buckets": str(self.num_buckets),
            "seed": str(self.seed),
            "scheme": self.scheme,
            "pad_id": str(self.pad_id),
            "fingerprint": self.fingerprint,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: str | Path) -> SignatureTable:
        path = Path(path)
        if not path.is_file():
            raise SignatureError(f"signature table {str(path)!r} does not exist; check the path")
        try:
            with safe_open(str(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises several types for a damaged file
            raise SignatureError(f"cannot read signature table {str(path)!r}: {err}; re-save it") from None
        if metadata.get("format") != "mhf-signature-table":
            raise SignatureError(
                f"{str(path)!r} is not an mhf signature table; pass a table saved by mhf-dist"
            )
        if metadata.get("version") != str(FORMAT_VERSION):
            raise SignatureError(
                f"signature table {str(path)!r} has format {metadata.get('version')}, this mhf-dist reads "
                f"format {FORMAT_VERSION}; re-run `mhf prepare` (or re-export the model) to rebuild it"
            )
        blob = tensors["token_bytes"].tobytes()
        offsets = tensors["token_offsets"].tolist()
        tokens = [blob[start:end].decode("utf-8") for start, end in itertools.pairwise(offsets)]
        table = cls(
            tokens,
            tensors["rows"],
            tensors["salts"],
            int(metadata["num_hashes"]),
            int(metadata["num_buckets"]),
            int(metadata["seed"]),
            metadata["scheme"],
            int(metadata["pad_id"]),
        )
        if table.fingerprint != metadata.get("fingerprint"):
            raise SignatureError(
                f"signature table {str(path)!r} is corrupted (fingerprint mismatch); rebuild it"
            )
        return table

    def follows(self, hash_cfg: HashConfig) -> bool:
        """Whether this table is of the shape, seed and scheme `model.hash` describes."""
        mine = (self.num_hashes, self.num_buckets, self.seed, self.scheme)
        return mine == (hash_cfg.num_hashes, hash_cfg.num_buckets, hash_cfg.seed, hash_cfg.signature_scheme)

    def describe(self) -> dict[str, str | int]:
        return {
            "spec": self.spec,
            "scheme": self.scheme,
            "seed": self.seed,
            "vocab_size": len(self),
            "fingerprint": self.fingerprint,
        }

    def __repr__(self) -> str:
        return f"SignatureTable({json.dumps(self.describe())})"


def build_for_config(
    hash_cfg: HashConfig, tokens: Sequence[str], pad_token: str | None = None
) -> SignatureTable:
    """The table `model.hash` describes (spec, seed, scheme) for a vocabulary in id order."""
    return SignatureTable.build(
        tokens, hash_cfg.num_hashes, hash_cfg.num_buckets, hash_cfg.seed, hash_cfg.signature_scheme, pad_token
    )


def _check_shape(num_hashes: int, num_buckets: int, seed: int) -> None:
    if num_hashes < 1:
        raise SignatureError(f"num_hashes={num_hashes}; a signature needs at least one hash (H>=1)")
    if num_buckets < 2:
        raise SignatureError(f"num_buckets={num_buckets}; use at least two buckets (B>=2)")
    if not (seed >= 0 and seed + num_hashes - 1 < 2**32):
        raise SignatureError(f"seed={seed} must lie in [0, 2**32 - H); pick a smaller non-negative seed")
