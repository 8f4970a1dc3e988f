"""Prepared shards on disk: parquet files of packed rows with their signatures, and the manifest.

A prepared directory holds `manifest.json` (written last: its presence means the directory is
complete), `tokenizer.json`, `signatures.safetensors` and `{split}-{index:05d}.parquet` shards with two
columns: `input_ids` (fixed-size list of seq_len+1 int32) and `signatures` (fixed-size list of
(seq_len+1)*H unsigned ints, row-major [T+1, H], in the smallest type that holds B), one row per row
group (`rows_per_group` in the manifest; `mhf_dist.data.reader` reads rows by index through it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mhf_dist.config import Config
from mhf_dist.data.tokenizer import FORMAT_TEXT, LEGACY_FORMAT
from mhf_dist.errors import DataError
from mhf_dist.signatures import SignatureTable

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SIGNATURES_FILE = "signatures.safetensors"
SPLITS = ("train", "validation")
FORMAT = "mhf-shards"
ROWS_PER_GROUP = 1  # every parquet row group is one row: the unit the training reader reads


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(rows: np.ndarray, table: SignatureTable, directory: Path, name: str) -> dict[str, Any]:
    """Write packed rows [n, T+1] with their signatures as `directory/name`; returns its manifest entry.

    One row per row group: the training reader decodes single rows (`mhf_dist.data.reader` says why).
    """
    width = rows.shape[1]
    signatures = table.lookup(rows)  # [n, T+1, H], the table's own small dtype
    columns = {
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1).astype(np.int32)), width),
        "signatures": pa.FixedSizeListArray.from_arrays(
            pa.array(signatures.reshape(-1)), width * table.num_hashes
        ),
    }
    path = directory / name
    pq.write_table(
        pa.table(columns),
        path,
        compression="zstd",
        row_group_size=1,
        use_dictionary=False,  # a dictionary page per one-row group would cost more than it saves
        write_statistics=False,
    )
    return {"file": name, "rows": len(rows), "sha256": file_sha256(path)}


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


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


def document_format(manifest: dict[str, Any]) -> str:
    """The shards' document format (bos / eos); manifests written before it was recorded are eos."""
    return manifest.get("document_format", LEGACY_FORMAT)


def check_compatible(manifest: dict[str, Any], cfg: Config, fingerprint: str | None = None) -> None:
    """Refuse shards that do not fit the model: each mismatch names both values."""
    have, want = document_format(manifest), cfg.data.document_format
    if want != "auto" and want != have:
        raise DataError(
            f"shards hold {have}-format documents ({FORMAT_TEXT[have]}) but data.document_format is "
            f"{want}; set --set data.document_format={have} or re-prepare with {want}"
        )
    hashes = manifest["signatures"]
    pairs = [
        ("seq_len", manifest["seq_len"], cfg.train.seq_len, "train.seq_len"),
        ("packing", manifest.get("packing", "overlap"), cfg.data.packing, "data.packing"),
        ("vocab_size", manifest["tokenizer"]["vocab_size"], cfg.model.vocab_size, "model.vocab_size"),
    ]
    if cfg.model.family == "mhf":
        pairs += [
            ("hash spec", hashes["spec"], cfg.model.hash.spec, "model.hash.spec"),
            ("hash seed", hashes["seed"], cfg.model.hash.seed, "model.hash.seed"),
            ("signature scheme", hashes.get("scheme"), cfg.model.hash.signature_scheme, "model.hash.scheme"),
            ("LSH coordinate count", hashes.get("num_lsh", 0), cfg.model.hash.num_lsh, "model.hash.num_lsh"),
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


def split_shards(path: str | Path, manifest: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """The manifest's shard entries of one split; an unknown or empty split is a one-line error."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    shards = manifest["splits"][split]["shards"]
    if not shards:
        raise DataError(
            f"prepared data {str(path)!r} has no {split} rows; use more text or a smaller seq_len"
        )
    return shards


def check_shard(directory: Path, shard: dict[str, Any]) -> pq.FileMetaData:
    """A shard must exist, have a readable parquet footer, the manifest's row count and one row per row
    group; returns the footer (so the reader opening the shard need not read it again).

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
        metadata = pq.read_metadata(path)
    except (OSError, pa.ArrowException):
        raise DataError(f"shard {path} is truncated or not parquet; {fix}") from None
    if metadata.num_rows != shard["rows"]:
        raise DataError(
            f"shard {path} holds {metadata.num_rows} rows but the manifest says {shard['rows']}; {fix}"
        )
    if metadata.num_row_groups != shard["rows"]:
        raise DataError(f"shard {path} is not one row per row group as prepared; {fix}")
    return metadata


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
