"""Publishing files and directories so that a reader never sees half of one, and reading JSON files so
that a damaged one is a one-line error.

Every write that others may read goes through `staged_file` or `staged_directory`: the content is
written to a private staging path, then published in one step by `_publish`. On a local disk that step
is a rename. It is the one place a storage backend without rename (an object store) would implement
its own rule instead: upload the staged objects, then write the object that marks them complete last.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mhf_dist.errors import MhfError


@contextmanager
def staged_file(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yields a new sibling of `path` to write; on success it replaces `path` in one step, on any error
    (or interrupt) it is removed and `path` is left as it was. `suffix` keeps the extension that
    writers such as matplotlib choose a format by."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_name(path, suffix)
    os.close(os.open(staging, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies
    try:
        yield staging
        _publish(staging, path)
    finally:
        staging.unlink(missing_ok=True)


@contextmanager
def staged_directory(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory beside `path`; on success it becomes `path`, on any error it is
    removed. With `replace`, an existing `path` is swapped out and deleted only once the new one is in
    place (callers decide whether what is there may be replaced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_name(path, "")
    staging.mkdir()  # mode 0777 less the umask, as any new directory (mkdtemp's would be 0700)
    try:
        yield staging
        if path.exists() and replace:
            retired = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(retired)
            _publish(staging, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            _publish(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_name(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{suffix}"


def _publish(staging: Path, path: Path) -> None:
    """Make the fully written `staging` visible as `path` in one step (local disk: a rename; a file
    replaces a file, a directory must not exist yet)."""
    if staging.is_dir() and path.exists():
        raise FileExistsError(f"{path} appeared while it was being written")
    os.replace(staging, path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    with staged_file(path) as staging:
        staging.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> Path:
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path, error: type[MhfError], fix: str) -> Any:
    """The parsed file; invalid JSON is `error` naming the file, the line and `fix`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise error(f"{str(path)!r} is damaged (invalid JSON at line {err.lineno}); {fix}") from None
