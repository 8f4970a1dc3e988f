"""Prepared shards on disk: parquet files of packed rows with their signatures, and the manifest.

A prepared directory holds `manifest.json` (written last: its presence means the directory is
complete), `tokenizer.json`, `signatures.safetensors` and `{split}-{index:05d}.parquet` shards with two
columns: `input_ids` (fixed-size list of seq_len+1 int32) and `signatures` (fixed-size list of
(seq_len+1)*H unsigned ints, row-major [T+1, H], in the smallest type that holds B).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mhf_dist.config import Config
from mhf_dist.errors import DataError
from mhf_dist.signatures import SignatureTable

if TYPE_CHECKING:
    import ray.data

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SIGNATURES_FILE = "signatures.safetensors"
SPLITS = ("train", "validation")
FORMAT = "mhf-shards"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ShardWriter:
    """Buffers packed rows of one split and writes them as fixed-size parquet shards."""

    def __init__(self, directory: Path, split: str, table: SignatureTable, seq_len: int, rows_per_shard: int):
        self.directory, self.split, self.table = directory, split, table
        self.seq_len, self.rows_per_shard = seq_len, rows_per_shard
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, rows: np.ndarray) -> None:
        if len(rows):
            self._pending.append(rows)
            self._pending_rows += len(rows)
        while self._pending_rows >= self.rows_per_shard:
            stacked = np.concatenate(self._pending)
            self._write(stacked[: self.rows_per_shard])
            rest = stacked[self.rows_per_shard :]
            self._pending, self._pending_rows = ([rest] if len(rest) else []), len(rest)

    def close(self) -> dict[str, Any]:
        if self._pending_rows:
            self._write(np.concatenate(self._pending))
        self._pending, self._pending_rows = [], 0
        rows = sum(shard["rows"] for shard in self.shards)
        return {"rows": rows, "target_tokens": rows * self.seq_len, "shards": self.shards}

    def _write(self, rows: np.ndarray) -> None:
        width = self.seq_len + 1
        signatures = self.table.lookup(rows)  # [n, T+1, H], the table's own small dtype
        columns = {
            "input_ids": pa.FixedSizeListArray.from_arrays(
                pa.array(rows.reshape(-1).astype(np.int32)), width
            ),
            "signatures": pa.FixedSizeListArray.from_arrays(
                pa.array(signatures.reshape(-1)), width * self.table.num_hashes
            ),
        }
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        path = self.directory / name
        pq.write_table(pa.table(columns), path, compression="zstd")
        self.shards.append({"file": name, "rows": len(rows), "sha256": file_sha256(path)})


def content_hash(splits: dict[str, dict[str, Any]]) -> str:
    """sha256 over every shard's name and digest, in split and shard order."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for shard in splits[split]["shards"]:
            digest.update(f"{shard['file']}:{shard['sha256']}\n".encode())
    return digest.hexdigest()


def read_manifest(path: str | Path) -> dict[str, Any]:
    manifest_path = Path(path) / MANIFEST
    if not Path(path).is_dir():
        raise DataError(f"prepared data {str(path)!r} does not exist; run `mhf prepare` first")
    if not manifest_path.is_file():
        raise DataError(
            f"{str(path)!r} is not a complete prepared dataset (no {MANIFEST}); rerun `mhf prepare`"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{manifest_path} is not an mhf-dist shard manifest; point data.path at `mhf prepare` output"
        )
    return manifest


def check_compatible(manifest: dict[str, Any], cfg: Config, fingerprint: str | None = None) -> None:
    """Refuse shards that do not fit the model: each mismatch names both values."""
    hashes = manifest["signatures"]
    pairs = [
        ("seq_len", manifest["seq_len"], cfg.train.seq_len, "train.seq_len"),
        ("vocab_size", manifest["tokenizer"]["vocab_size"], cfg.model.vocab_size, "model.vocab_size"),
    ]
    if cfg.model.family == "mhf":
        pairs += [
            ("hash spec", hashes["spec"], cfg.model.hash.spec, "model.hash.spec"),
            ("hash seed", hashes["seed"], cfg.model.hash.seed, "model.hash.seed"),
            ("signature scheme", hashes.get("scheme"), cfg.model.hash.signature_scheme, "model.hash.scheme"),
        ]
    for name, have, want, key in pairs:
        if have != want:
            raise DataError(
                f"shards have {name} {have} but the model has {want}; set --set {key}={have} or re-prepare"
            )
    if fingerprint is not None and fingerprint != hashes["fingerprint"]:
        raise DataError(
            f"shards have signature fingerprint {hashes['fingerprint'][:12]} "
            f"but the model has {fingerprint[:12]}; "
            "prepare the data with the model's tokenizer and hash config"
        )


def shard_files(path: str | Path, manifest: dict[str, Any], split: str) -> list[str]:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    shards = manifest["splits"][split]["shards"]
    if not shards:
        raise DataError(
            f"prepared data {str(path)!r} has no {split} rows; use more text or a smaller seq_len"
        )
    for shard in shards:
        check_shard(Path(path), shard)
    return [str(Path(path) / shard["file"]) for shard in shards]


def check_shard(directory: Path, shard: dict[str, Any]) -> None:
    """A shard must exist, have a readable parquet footer and the manifest's row count.

    The footer is a few KB at the end of the file, so this costs one small read per shard whatever the
    data size, and it catches what happens to files in practice (deleted, truncated by a full disk or an
    interrupted copy, swapped for another run's shard). The manifest's sha256 of each shard catches any
    change at all but reads every byte; `verify_shards` does that on demand.
    """
    path = directory / shard["file"]
    fix = f"re-run `mhf prepare --overwrite --out {directory}`"
    if not path.is_file():
        raise DataError(f"shard {path} is missing; {fix}")
    try:
        rows = pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException):
        raise DataError(f"shard {path} is truncated or not parquet; {fix}") from None
    if rows != shard["rows"]:
        raise DataError(f"shard {path} holds {rows} rows but the manifest says {shard['rows']}; {fix}")


def verify_shards(path: str | Path) -> int:
    """Every shard of every split against the manifest's sha256 (reads all the data); returns the count."""
    manifest = read_manifest(path)
    count = 0
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            check_shard(Path(path), shard)
            if file_sha256(Path(path) / shard["file"]) != shard["sha256"]:
                raise DataError(
                    f"shard {Path(path) / shard['file']} differs from the one prepared (sha256 mismatch); "
                    f"re-run `mhf prepare --overwrite --out {path}`"
                )
            count += 1
    return count


def load_shards(
    path: str | Path, split: str, cfg: Config | None = None, fingerprint: str | None = None
) -> ray.data.Dataset:
    """The rows of one split as a Ray Dataset, after checking the manifest against the model config."""
    import ray.data

    manifest = read_manifest(path)
    if cfg is not None:
        check_compatible(manifest, cfg, fingerprint)
    return ray.data.read_parquet(shard_files(path, manifest, split))


def read_rows(path: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows of one split in this process: (input_ids [N, T+1] int64, signatures [N, T+1, H])."""
    manifest = read_manifest(path)
    tables = [pq.read_table(file) for file in shard_files(path, manifest, split)]
    return arrow_to_arrays(
        pa.concat_tables(tables), manifest["seq_len"], manifest["signatures"]["num_hashes"]
    )


def arrow_to_arrays(table: pa.Table, seq_len: int, num_hashes: int) -> tuple[np.ndarray, np.ndarray]:
    width = seq_len + 1
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy().astype(np.int64)
    sigs = table.column("signatures").combine_chunks().flatten().to_numpy()
    return ids.reshape(-1, width), sigs.reshape(-1, width, num_hashes)
