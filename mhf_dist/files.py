"""Small helpers for files others read: a JSON record written whole (`write_json_atomic`, published as
`storage.Location.write_bytes` publishes), and `unwritable`, which finds where nothing can be made.
Reading them: `mhf_dist.readers`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mhf_dist.storage import Location


def unwritable(path: Path) -> Path | None:
    """The nearest existing part of `path` (itself, or the folder it would be made in) when nothing can
    be made there: a file, or a folder that refuses a new entry, tried by making one and removing it
    (`os.access` says yes to root everywhere, `/proc` included). None when `path` can be written."""
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".mhf-probe-"))
    except OSError:  # NotADirectoryError for a file, PermissionError, or a file system that takes none
        return existing
    return None


def write_json_atomic(path: str | Path | Location, payload: dict[str, Any]) -> None:
    Location.of(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
