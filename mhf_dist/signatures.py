"""Signature tables: every token id gets H MurmurHash3 bucket ids, no two tokens the same.

The contract (DESIGN.md): the key of token id t is its vocabulary string as UTF-8 bytes; coordinate j
is `mmh3.hash(key, seed + j, signed=False) % B`. Ids are visited in increasing order and a signature
already taken is re-drawn from `key + b"\\x00" + str(salt)` for salt = 1, 2, ... until free; the NUL
separator keeps a salted key from colliding with another token's plain key ("a1" vs "a" + salt 1).
Expansion appends rows by the same rule and never changes an existing row.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import mmh3
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mhf_dist.config import format_hash_spec
from mhf_dist.errors import SignatureError

FORMAT_VERSION = 1
MAX_SALT = 1_000_000


def smallest_uint_dtype(max_value: int) -> np.dtype:
    """The narrowest unsigned integer dtype that holds `max_value`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def token_signature(key: bytes, num_hashes: int, num_buckets: int, seed: int) -> tuple[int, ...]:
    """The unsalted signature of one key: coordinate j is MurmurHash3_x86_32(key, seed + j) mod B."""
    return tuple(mmh3.hash(key, seed + j, signed=False) % num_buckets for j in range(num_hashes))


def _salted_key(key: bytes, salt: int) -> bytes:
    return key if salt == 0 else key + b"\x00" + str(salt).encode()


class SignatureTable:
    """An immutable [V, H] table of bucket ids for a vocabulary, with its provenance."""

    def __init__(
        self,
        tokens: Sequence[str],
        rows: np.ndarray,
        salts: np.ndarray,
        num_hashes: int,
        num_buckets: int,
        seed: int,
    ) -> None:
        self._tokens = tuple(tokens)
        self._rows = rows
        self._salts = salts
        self.num_hashes = num_hashes
        self.num_buckets = num_buckets
        self.seed = seed
        self._rows.setflags(write=False)
        self._salts.setflags(write=False)
        self._torch_rows: torch.Tensor | None = None
        # A row of H small ints viewed as one 1/2/4/8-byte integer: 1-D `take` gathers ~3x faster.
        row_bytes = num_hashes * rows.dtype.itemsize
        self._packed = rows.view(f"<u{row_bytes}").reshape(-1) if row_bytes in (1, 2, 4, 8) else None
        self._fingerprint: str | None = None

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, tokens: Sequence[str], num_hashes: int, num_buckets: int, seed: int = 0) -> SignatureTable:
        """Signatures for `tokens` in id order (tokens[i] is the string of id i)."""
        _check_shape(num_hashes, num_buckets, seed)
        empty = cls(
            [],
            np.zeros((0, num_hashes), smallest_uint_dtype(num_buckets - 1)),
            np.zeros(0, np.uint32),
            num_hashes,
            num_buckets,
            seed,
        )
        return empty.expand(tokens)

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
        capacity = self.num_buckets**self.num_hashes
        if total > capacity:
            raise SignatureError(
                f"vocabulary of {total} tokens exceeds the {capacity} signatures of "
                f"H={self.num_hashes}, B={self.num_buckets}; use more hashes or buckets"
            )
        taken = {tuple(row) for row in self._rows.tolist()}
        rows, salts = [], []
        for token in new_tokens:
            key = token.encode("utf-8")
            for salt in range(MAX_SALT):
                signature = token_signature(
                    _salted_key(key, salt), self.num_hashes, self.num_buckets, self.seed
                )
                if signature not in taken:
                    break
            else:
                raise SignatureError(
                    f"no free signature for {token!r} after {MAX_SALT} salts; use more buckets"
                )
            taken.add(signature)
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
        )

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
        """sha256 over (H, B, seed, table): equal fingerprints mean interchangeable tables."""
        if self._fingerprint is None:
            digest = hashlib.sha256(
                f"mhf-signatures:{self.num_hashes}:{self.num_buckets}:{self.seed}:".encode()
            )
            digest.update(self._rows.astype("<u8").tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def lookup(self, ids: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Signatures of `ids` with shape [..., H]; numpy in, numpy out; torch in, int64 torch out."""
        if isinstance(ids, torch.Tensor):
            self._check_ids(ids.min().item(), ids.max().item(), ids.numel())
            if self._torch_rows is None:
                self._torch_rows = torch.from_numpy(self._rows.astype(np.int64))
            return self._torch_rows.to(ids.device)[ids.long()]
        ids = np.asarray(ids)
        if ids.size:
            self._check_ids(int(ids.min()), int(ids.max()), ids.size)
        if self._packed is None:
            return self._rows[ids]
        return self._packed.take(ids, mode="clip").view(self._rows.dtype).reshape(*ids.shape, self.num_hashes)

    def as_tensor(self) -> torch.Tensor:
        """The table as an int64 [V, H] tensor, as models hold it."""
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
        )
        if table.fingerprint != metadata.get("fingerprint"):
            raise SignatureError(
                f"signature table {str(path)!r} is corrupted (fingerprint mismatch); rebuild it"
            )
        return table

    def describe(self) -> dict[str, str | int]:
        return {
            "spec": self.spec,
            "seed": self.seed,
            "vocab_size": len(self),
            "fingerprint": self.fingerprint,
        }

    def __repr__(self) -> str:
        return f"SignatureTable({json.dumps(self.describe())})"


def _check_shape(num_hashes: int, num_buckets: int, seed: int) -> None:
    if num_hashes < 1:
        raise SignatureError(f"num_hashes={num_hashes}; a signature needs at least one hash (H>=1)")
    if num_buckets < 2:
        raise SignatureError(f"num_buckets={num_buckets}; use at least two buckets (B>=2)")
    if not (seed >= 0 and seed + num_hashes - 1 < 2**32):
        raise SignatureError(f"seed={seed} must lie in [0, 2**32 - H); pick a smaller non-negative seed")
