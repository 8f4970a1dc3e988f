"""Writing files so that a reader never sees half of one (a temporary sibling, then a rename), and
reading JSON files so that a damaged one is a one-line error."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mhf_dist.errors import MhfError


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> Path:
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path, error: type[MhfError], fix: str) -> Any:
    """The parsed file; invalid JSON is `error` naming the file, the line and `fix`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise error(f"{str(path)!r} is damaged (invalid JSON at line {err.lineno}); {fix}") from None
