"""Signature tables: every token id gets H bucket ids (MurmurHash3, optionally LSH) in a [rows, H] table.

In every `Scheme` the key of token id t is its vocabulary string (as `convert_ids_to_tokens` gives it),
ids are visited in increasing order, and expansion appends rows by the same rule, never changing an
existing row. The contract (DESIGN.md) has two schemes:

- `reference` (the authors' HUIYINXUE/MHF `initialize_hash_map`; the paper's model): the first `num_lsh`
  coordinates (default 0) are LSH buckets of the string's character trigrams (`mhf_dist.lsh`); coordinate
  j in num_lsh..H-2 is `1 + mmh3.hash128(key, seed + j) % (B-1)`; the last is
  `1 + mmh3.hash128(key, seed + H-1+r) % (B-1)` for the first r = 0, 1, ... whose value differs from the
  last coordinate of the most recent earlier token with the same H-1 prefix (the authors' loop keeps one
  token per prefix; r is stored as the token's salt). A table equals theirs row for row, duplicate
  signatures included (at H=1, when three tokens share a prefix, when num_lsh == H):
  `duplicate_signatures` counts them, and exact scoring counts each row once in its normaliser, as the
  authors' `use_conditional_prob` does. Bucket 0 is reserved for the padding token's all-zero signature.
- `murmur32` (collision-free): coordinate j is `mmh3.hash(key, seed + j, signed=False) % B`; a taken
  signature is redrawn from `key + b"\\x00" + str(salt)` for salt = 1, 2, ... (the NUL keeps "a1" apart
  from "a" + salt 1).

A new scheme is a `Scheme` subclass with its own `name` (defining it registers it in `SCHEMES`).
A table may hold reserved rows past the last token id (an imported reference checkpoint's V rounded up
to a multiple of 128): no id maps to them, but exact scoring's normaliser counts them, as the authors' does.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import mmh3
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save

from mhf_dist.config import HashConfig, format_hash_spec
from mhf_dist.errors import MhfError, SignatureError
from mhf_dist.readers import check_file
from mhf_dist.storage import Location, local_copy, redact

# torch is imported only where a tensor is asked for: `mhf prepare`'s Ray tasks load tables and look up
# numpy rows, and importing torch cost each of their worker processes about a second of CPU.
if TYPE_CHECKING:
    import torch

FILE_FORMAT = "mhf-signature-table"
FORMAT_VERSION = 2  # 2: the scheme and the padding id are stored and covered by the fingerprint
# 3: also num_lsh and reserved rows; written only where there are any, so format-2 readers read the rest
FORMAT_VERSION_EXTENDED = 3
READABLE_VERSIONS = (str(FORMAT_VERSION), str(FORMAT_VERSION_EXTENDED))
MAX_SALT = 1_000_000
NO_PAD = -1


def token_signature(key: bytes, num_hashes: int, num_buckets: int, seed: int) -> tuple[int, ...]:
    """The unsalted murmur32 signature of one key: coordinate j is MurmurHash3_x86_32(key, seed + j) mod B."""
    return tuple(mmh3.hash(key, seed + j, signed=False) % num_buckets for j in range(num_hashes))


def reference_coordinate(token: str, seed: int, num_buckets: int) -> int:
    """One reference coordinate: 1 + MurmurHash3_x64_128(token, seed) mod (B-1); bucket 0 stays free."""
    return 1 + mmh3.hash128(token, seed) % (num_buckets - 1)


SCHEMES: dict[str, type[Scheme]] = {}


@dataclass(frozen=True)
class Scheme(ABC):
    """How each token's H coordinates in 0..B-1 are drawn from its string, `seed` and earlier rows."""

    name: ClassVar[str]
    draws_lsh: ClassVar[bool] = False  # whether the first `num_lsh` coordinates may be LSH buckets

    num_hashes: int
    num_buckets: int
    seed: int = 0
    num_lsh: int = 0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name in SCHEMES:
            raise SignatureError(f"signature scheme {cls.name!r} is already defined; give yours another name")
        SCHEMES[cls.name] = cls

    def __post_init__(self) -> None:
        if self.num_hashes < 1:
            raise SignatureError(f"num_hashes={self.num_hashes}; a signature needs at least one hash (H>=1)")
        if self.num_buckets < 2:
            raise SignatureError(f"num_buckets={self.num_buckets}; use at least two buckets (B>=2)")
        if not (self.seed >= 0 and self.seed + self.num_hashes - 1 < 2**32):
            raise SignatureError(
                f"seed={self.seed} must lie in [0, 2**32 - H); pick a smaller non-negative seed"
            )
        if not 0 <= self.num_lsh <= self.num_hashes:
            raise SignatureError(f"num_lsh={self.num_lsh} must lie in 0..H={self.num_hashes}")
        if self.num_lsh and not self.draws_lsh:
            with_lsh = ", ".join(name for name, scheme in SCHEMES.items() if scheme.draws_lsh)
            raise SignatureError(
                f"num_lsh={self.num_lsh}: LSH coordinates are the {with_lsh} scheme's, not {self.name}'s"
            )

    def __str__(self) -> str:
        return self.name

    @property
    def spec(self) -> str:
        return format_hash_spec(self.num_hashes, self.num_buckets)

    @property
    def dtype(self) -> np.dtype:
        return np.min_scalar_type(self.num_buckets - 1)  # the narrowest unsigned dtype that holds B-1

    @property
    @abstractmethod
    def capacity(self) -> int:
        """How many distinct signatures the scheme can give."""

    def shortfall(self, vocab_size: int) -> str | None:
        """What a vocabulary of `vocab_size` tokens is short of signatures (None: enough for each one)."""
        if vocab_size <= self.capacity:
            return None
        return (
            f"vocabulary of {vocab_size} tokens exceeds the {self.capacity} signatures of "
            f"H={self.num_hashes}, B={self.num_buckets} ({self.name} scheme"
        )

    def room_for(self, vocab_size: int) -> str | None:
        """`shortfall` as a warning (tokens will share signatures), or SignatureError where no table of
        `vocab_size` tokens can be built."""
        return self.shortfall(vocab_size)

    def padding_id(self, tokens: Sequence[str], pad_token: str | None) -> int:
        """The id whose signature this scheme keeps all zeros (NO_PAD: none, as here)."""
        return NO_PAD

    @abstractmethod
    def draw(self, earlier: np.ndarray, tokens: Sequence[str], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [len(tokens), H] and uint32 salts of `tokens`, the ids after `earlier`'s rows."""

    def table(self, tokens: Iterable[str], pad_token: str | None = None) -> SignatureTable:
        """The table of a vocabulary in id order; `pad_token` gets the all-zero row if the scheme has one."""
        tokens = list(tokens)
        empty = np.zeros((0, self.num_hashes), self.dtype)
        start = SignatureTable([], empty, np.zeros(0, np.uint32), self, self.padding_id(tokens, pad_token))
        return start.expand(tokens)

    def _as_arrays(self, rows: list[tuple[int, ...]], salts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        signatures = np.asarray(rows, dtype=self.dtype).reshape(len(rows), self.num_hashes)
        return signatures, np.asarray(salts, dtype=np.uint32)


class ReferenceScheme(Scheme):
    """The authors' rule (see the module docstring)."""

    name: ClassVar[str] = "reference"
    draws_lsh: ClassVar[bool] = True

    @property
    def capacity(self) -> int:
        """Distinct signatures, the padding token's included (the rule itself may repeat some)."""
        return (self.num_buckets - 1) ** self.num_hashes + 1

    def room_for(self, vocab_size: int) -> str | None:
        short = self.shortfall(vocab_size)
        if short is not None and self.capacity == 2:
            raise SignatureError(
                f"{short}): at B=2 every token but the padding one has one signature; use more buckets"
            )
        return short

    def padding_id(self, tokens: Sequence[str], pad_token: str | None) -> int:
        return tokens.index(pad_token) if pad_token in tokens else NO_PAD

    def draw(self, earlier: np.ndarray, tokens: Sequence[str], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        first_id = len(earlier)
        hashed = [token for offset, token in enumerate(tokens) if first_id + offset != pad_id]
        lsh_rows = iter(self._lsh_rows(hashed).tolist())
        latest = self._latest_by_prefix(earlier, pad_id)
        redrawn = self.num_lsh < self.num_hashes  # num_lsh == H: no coordinate is redrawn
        rows, salts = [], []
        for offset, token in enumerate(tokens):
            salt = 0
            if first_id + offset == pad_id:
                signature = (0,) * self.num_hashes
            else:
                prefix = (*next(lsh_rows), *self._murmur_prefix(token))
                signature = prefix
                if redrawn:
                    salt, last = self._last_coordinate(token, latest.get(prefix))
                    signature = (*prefix, last)
            if redrawn:
                latest[signature[:-1]] = signature[-1]
            rows.append(signature)
            salts.append(salt)
        return self._as_arrays(rows, salts)

    def _lsh_rows(self, tokens: list[str]) -> np.ndarray:
        if not self.num_lsh:
            return np.zeros((len(tokens), 0), np.int64)
        from mhf_dist.lsh import lsh_coordinates  # torch: only where LSH is asked for

        return lsh_coordinates(tokens, self.num_lsh, self.num_buckets, self.seed)

    def _murmur_prefix(self, token: str) -> tuple[int, ...]:
        coordinates = range(self.num_lsh, self.num_hashes - 1)
        return tuple(reference_coordinate(token, self.seed + j, self.num_buckets) for j in coordinates)

    def _last_coordinate(self, token: str, previous: int | None) -> tuple[int, int]:
        """(redraws, value): the first draw of the last coordinate that differs from `previous`."""
        seed = self.seed + self.num_hashes - 1
        for redraw in range(MAX_SALT):
            last = reference_coordinate(token, seed + redraw, self.num_buckets)
            if last != previous:
                return redraw, last
            if self.num_buckets == 2:
                raise SignatureError(
                    f"no signature for {token!r} differs from the previous token with its prefix: with B=2 "
                    "every coordinate but the padding token's is bucket 1; use more buckets"
                )
        raise SignatureError(f"no free signature for {token!r} after {MAX_SALT} redraws; use more buckets")

    def _latest_by_prefix(self, earlier: np.ndarray, pad_id: int) -> dict[tuple[int, ...], int]:
        """The last coordinate of each prefix's latest earlier token, skipping all-zero rows but the
        padding token's: tokens the authors' loop never visits (a checkpoint's added tokens)."""
        if self.num_lsh == self.num_hashes:
            return {}
        rows = enumerate(earlier.tolist())
        return {tuple(row[:-1]): row[-1] for token_id, row in rows if token_id == pad_id or any(row)}


class Murmur32Scheme(Scheme):
    """MurmurHash3_x86_32 coordinates, a taken signature redrawn from a salted key: collision-free."""

    name: ClassVar[str] = "murmur32"

    @property
    def capacity(self) -> int:
        return self.num_buckets**self.num_hashes

    def room_for(self, vocab_size: int) -> str | None:
        short = self.shortfall(vocab_size)
        if short is not None:
            raise SignatureError(f"{short}, collision-free); use more hashes or buckets")
        return None

    def draw(self, earlier: np.ndarray, tokens: Sequence[str], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Each token's first salted draw that no earlier token holds."""
        self.room_for(len(earlier) + len(tokens))
        taken = {tuple(row) for row in earlier.tolist()}
        rows, salts = [], []
        for token in tokens:
            salt, signature = self._first_free(token, taken)
            taken.add(signature)
            rows.append(signature)
            salts.append(salt)
        return self._as_arrays(rows, salts)

    def _first_free(self, token: str, taken: set[tuple[int, ...]]) -> tuple[int, tuple[int, ...]]:
        key = token.encode("utf-8")
        for salt in range(MAX_SALT):
            salted = key if salt == 0 else key + b"\x00" + str(salt).encode()
            signature = token_signature(salted, self.num_hashes, self.num_buckets, self.seed)
            if signature not in taken:
                return salt, signature
        raise SignatureError(f"no free signature for {token!r} after {MAX_SALT} redraws; use more buckets")


def make_scheme(name: str, num_hashes: int, num_buckets: int, seed: int = 0, num_lsh: int = 0) -> Scheme:
    """The registered scheme `name` of shape H x B, `seed` and `num_lsh` leading LSH coordinates."""
    if name not in SCHEMES:
        raise SignatureError(f"unknown signature scheme {name!r}; use one of {', '.join(SCHEMES)}")
    return SCHEMES[name](num_hashes, num_buckets, seed, num_lsh)


def scheme_for_config(hash_cfg: HashConfig) -> Scheme:
    """The scheme `model.hash` describes (spec, seed, scheme, num_lsh)."""
    return make_scheme(
        hash_cfg.signature_scheme, hash_cfg.num_hashes, hash_cfg.num_buckets, hash_cfg.seed, hash_cfg.num_lsh
    )


class SignatureTable:
    """An immutable [num_rows, H] table of bucket ids: row t is token id t's signature, rows past the
    last token are reserved (module docstring); `pad_id`'s row is all zeros (NO_PAD: none)."""

    def __init__(
        self, tokens: Sequence[str], rows: np.ndarray, salts: np.ndarray, scheme: Scheme, pad_id: int = NO_PAD
    ) -> None:
        if rows.ndim != 2 or rows.shape[0] < len(tokens) or salts.shape != (rows.shape[0],):
            raise SignatureError(
                f"a table of {len(tokens)} tokens needs at least as many rows and one salt per row; got "
                f"rows {rows.shape}, salts {salts.shape}"
            )
        self._tokens = tuple(tokens)
        self._rows = rows
        self._salts = salts
        self.scheme = scheme
        self.pad_id = pad_id
        self._rows.setflags(write=False)
        self._salts.setflags(write=False)
        self._torch_rows: torch.Tensor | None = None
        # A row of H small ints viewed as one 1/2/4/8-byte integer: 1-D `take` gathers ~3x faster.
        row_bytes = scheme.num_hashes * rows.dtype.itemsize
        self._packed = rows.view(f"<u{row_bytes}").reshape(-1) if row_bytes in (1, 2, 4, 8) else None

    @classmethod
    def build(
        cls,
        tokens: Sequence[str],
        num_hashes: int,
        num_buckets: int,
        seed: int = 0,
        scheme: str = "reference",
        pad_token: str | None = None,
        num_lsh: int = 0,
    ) -> SignatureTable:
        """The table the named scheme draws for `tokens`."""
        return make_scheme(scheme, num_hashes, num_buckets, seed, num_lsh).table(tokens, pad_token)

    def expand(self, new_tokens: Iterable[str]) -> SignatureTable:
        """A new table with rows for `new_tokens` after the last token (in reserved rows first); every
        existing row stays as it is."""
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
        count = len(self._tokens)
        rows, salts = self.scheme.draw(self._rows[:count], new_tokens, self.pad_id)
        leftover = slice(count + len(new_tokens), None)  # reserved rows no new token took
        return SignatureTable(
            self._tokens + tuple(new_tokens),
            np.concatenate([self._rows[:count], rows, self._rows[leftover]]),
            np.concatenate([self._salts[:count], salts, self._salts[leftover]]),
            self.scheme,
            self.pad_id,
        )

    # the scheme's shape, read through the table
    num_hashes = property(lambda self: self.scheme.num_hashes)
    num_buckets = property(lambda self: self.scheme.num_buckets)
    seed = property(lambda self: self.scheme.seed)
    num_lsh = property(lambda self: self.scheme.num_lsh)
    spec = property(lambda self: self.scheme.spec)

    def check_follows(
        self,
        hash_cfg: HashConfig,
        what: str,
        error: type[MhfError] = SignatureError,
        fix: str = "rebuild the table or change model.hash",
    ) -> None:
        """Raise `error` unless this table (`what`) was drawn by the scheme `model.hash` describes."""
        if self.scheme != scheme_for_config(hash_cfg):
            raise error(
                f"{what} is {self.spec} seed {self.seed} ({self.scheme.name} scheme, num_lsh {self.num_lsh}) "
                f"but model.hash says {hash_cfg.spec} seed {hash_cfg.seed} ({hash_cfg.signature_scheme} "
                f"scheme, num_lsh {hash_cfg.num_lsh}); {fix}"
            )

    def vocabulary_difference(self, tokens: Sequence[str]) -> str | None:
        """Where a tokenizer's vocabulary differs from this table's tokens, or None."""
        tokens = tuple(tokens)
        if tokens == self.tokens:
            return None
        differ = next((i for i, (a, b) in enumerate(zip(tokens, self.tokens, strict=False)) if a != b), None)
        if differ is None:
            return f"{len(tokens)} tokens there, {len(self.tokens)} in the signature table"
        return f"id {differ} is {tokens[differ]!r} there, {self.tokens[differ]!r} in the signature table"

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[str, ...]:
        return self._tokens

    @property
    def rows(self) -> np.ndarray:
        """The read-only [num_rows, H] table (token rows, then reserved ones)."""
        return self._rows

    @property
    def salts(self) -> np.ndarray:
        return self._salts

    @property
    def num_rows(self) -> int:
        """The tokens' rows and the reserved ones."""
        return self._rows.shape[0]

    @property
    def reserved_rows(self) -> int:
        return self.num_rows - len(self._tokens)

    @cached_property
    def duplicate_signatures(self) -> int:
        """Tokens whose signature an earlier token already has (0 under murmur32)."""
        token_rows = self._rows[: len(self._tokens)]
        return len(token_rows) - (len(np.unique(token_rows, axis=0)) if len(token_rows) else 0)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over (scheme, H, B, seed, rows, and num_lsh and the token count where not 0/all rows,
        so plain tables keep their earlier fingerprints): equal fingerprints mean interchangeable tables."""
        header = f"mhf-signatures:{self.scheme.name}:{self.num_hashes}:{self.num_buckets}:{self.seed}:"
        if self.num_lsh:
            header += f"lsh={self.num_lsh}:"
        if self.reserved_rows:
            header += f"tokens={len(self._tokens)}:"
        digest = hashlib.sha256(header.encode())
        digest.update(self._rows.astype("<u8").tobytes())
        return digest.hexdigest()

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
        """The table as an int64 [num_rows, H] tensor, as models hold it."""
        import torch

        return torch.from_numpy(self._rows.astype(np.int64))

    def _check_ids(self, low: int, high: int, count: int) -> None:
        if count and (low < 0 or high >= len(self)):
            bad = low if low < 0 else high
            raise SignatureError(
                f"token id {bad} is outside the signature table (ids 0..{len(self) - 1}); "
                "use the tokenizer this table was built from, or expand the table"
            )

    def describe(self) -> dict[str, str | int]:
        return {
            "spec": self.spec,
            "scheme": self.scheme.name,
            "seed": self.seed,
            "num_lsh": self.num_lsh,
            "vocab_size": len(self),
            "reserved_rows": self.reserved_rows,
            "duplicate_signatures": self.duplicate_signatures,
            "fingerprint": self.fingerprint,
        }

    def __repr__(self) -> str:
        return f"SignatureTable({json.dumps(self.describe())})"


def build_for_config(
    hash_cfg: HashConfig, tokens: Sequence[str], pad_token: str | None = None
) -> SignatureTable:
    """The table `model.hash` describes for a vocabulary in id order."""
    return scheme_for_config(hash_cfg).table(tokens, pad_token)


def save_table(table: SignatureTable, path: str | Path) -> None:
    """Write `table` as a safetensors file (no pickle), published whole (`Location.write_bytes`)."""
    extended = bool(table.num_lsh or table.reserved_rows)
    encoded = [token.encode("utf-8") for token in table.tokens]
    offsets = np.cumsum([0, *map(len, encoded)], dtype=np.int64)
    tensors = {
        "rows": np.ascontiguousarray(table.rows),
        "salts": np.ascontiguousarray(table.salts),
        "token_bytes": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
        "token_offsets": offsets,
    }
    metadata = {
        "format": FILE_FORMAT,
        "version": str(FORMAT_VERSION_EXTENDED if extended else FORMAT_VERSION),
        "num_hashes": str(table.num_hashes),
        "num_buckets": str(table.num_buckets),
        "seed": str(table.seed),
        "scheme": table.scheme.name,
        "pad_id": str(table.pad_id),
        "fingerprint": table.fingerprint,
    }
    if extended:
        metadata["num_lsh"] = str(table.num_lsh)
    # bytes, not safetensors' save_file: that writes its own temporary file beside the table first
    Location.of(path).write_bytes(save(tensors, metadata=metadata))


def check_same_table(
    model: str,
    model_fingerprint: str,
    data: str | Path | Location,
    data_fingerprint: str,
    fix: str,
    error: type[MhfError],
) -> None:
    """Shards (at `data`) carry the signature table of the model that reads them (`model`, in words)."""
    if model_fingerprint != data_fingerprint:
        raise error(
            f"{model} has signature fingerprint {model_fingerprint[:12]} but the shards in "
            f"{redact(str(data))!r} have {data_fingerprint[:12]}; {fix}"
        )


def load_table(path: str | Path | Location) -> SignatureTable:
    """The table `save_table` wrote (local or in a bucket); a bad file is a one-line error."""
    path = check_file(local_copy(path), SignatureError, "signature table").local
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises several types for a damaged file
        raise SignatureError(f"cannot read signature table {str(path)!r}: {err}; re-save it") from None
    if metadata.get("format") != FILE_FORMAT:
        raise SignatureError(f"{str(path)!r} is not an mhf signature table; pass a table saved by mhf-dist")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise SignatureError(
            f"signature table {str(path)!r} has format {metadata.get('version')}, this mhf-dist reads "
            f"formats {' and '.join(READABLE_VERSIONS)}; re-run `mhf prepare` (or re-export the model) "
            "to rebuild it"
        )
    try:
        blob = tensors["token_bytes"].tobytes()
        offsets = tensors["token_offsets"].tolist()
        tokens = [blob[start:end].decode("utf-8") for start, end in itertools.pairwise(offsets)]
    except (KeyError, UnicodeDecodeError) as err:  # bytes flipped in the file, which safetensors never checks
        raise SignatureError(
            f"signature table {str(path)!r} is corrupted (its tokens cannot be read: {err}); rebuild it"
        ) from None
    shape = [int(metadata[key]) for key in ("num_hashes", "num_buckets", "seed")]
    scheme = make_scheme(metadata["scheme"], *shape, int(metadata.get("num_lsh", "0")))
    table = SignatureTable(tokens, tensors["rows"], tensors["salts"], scheme, int(metadata["pad_id"]))
    if table.fingerprint != metadata.get("fingerprint"):
        raise SignatureError(f"signature table {str(path)!r} is corrupted (fingerprint mismatch); rebuild it")
    return table
