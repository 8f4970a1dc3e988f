"""Publishing files and directories so that a reader never sees half of one (reading them:
`mhf_dist.readers`).

Every write that others may read goes through `staged_file` or `staged_directory`: the content is
written to a private staging path, then published in one step. On a local disk that step is a rename
(`_publish`). An object store has no rename: the staging path is a local temporary one, its files are
uploaded, and a directory's `marker` file (its manifest or config) is uploaded last, so a reader that
trusts only directories with their marker never sees half of one (`storage.Location.upload`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mhf_dist.storage import Location, is_uri


@contextmanager
def staged_file(path: str | Path | Location, suffix: str = ".tmp") -> Iterator[Path]:
    """Yields a new sibling of `path` to write; on success it replaces `path` in one step, on any error
    (or interrupt) it is removed and `path` is left as it was. `suffix` keeps the extension that
    writers such as matplotlib choose a format by. For an object-store URI the staging file is local
    and uploaded in one request on success."""
    if _remote(path):
        with tempfile.TemporaryDirectory(prefix="mhf-staged-") as tmp:
            staging = Path(tmp) / f"file{suffix}"
            staging.touch()
            yield staging
            Location.of(path).write_bytes(staging.read_bytes())
        return
    path = Location.of(path).local
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_name(path, suffix)
    os.close(os.open(staging, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies
    mode = staging.stat().st_mode & 0o777
    try:
        yield staging
        os.chmod(staging, mode)  # a writer that replaces its file (safetensors) makes it 0600
        _publish(staging, path)
    finally:
        staging.unlink(missing_ok=True)


@contextmanager
def staged_directory(path: str | Path | Location, marker: str | None = None) -> Iterator[Path]:
    """Yields an empty staging directory beside `path`, which must not exist; on success it becomes
    `path`, on any error it is removed. For an object-store URI the staging directory is local and its
    files are uploaded with `marker` last."""
    if _remote(path):
        where = Location.of(path)
        with tempfile.TemporaryDirectory(prefix="mhf-staged-") as tmp:
            yield Path(tmp)
            if where.exists():
                raise FileExistsError(f"{where} appeared while it was being written")
            where.upload(Path(tmp), last=marker)
        return
    path = Location.of(path).local
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_name(path, "")
    staging.mkdir()  # mode 0777 less the umask, as any new directory (mkdtemp's would be 0700)
    try:
        yield staging
        mode = (
            staging.stat().st_mode & 0o666
        )  # a new file's: 0666 less the umask, as the folder is 0777 less it
        for written in staging.rglob("*"):  # a writer that replaces its file (safetensors) makes it 0600
            if written.is_file():
                os.chmod(written, mode)
        publish_directory(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_directory(staging: Path, path: Path, replace: bool = False) -> None:
    """Make the complete local directory `staging` visible as `path` by a rename; with `replace`, an
    existing directory `path` is swapped out and deleted only once the new one is in place (put back
    if that fails). A file or a link at `path` is never replaced."""
    if not (replace and path.exists()):
        _publish(staging, path)
        return
    if path.is_symlink() or not path.is_dir():
        raise FileExistsError(f"{path} is not a directory; a directory does not replace it")
    retired = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    path.rename(retired)
    try:
        _publish(staging, path)
    except BaseException:
        retired.rename(path)
        raise
    shutil.rmtree(retired)


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


def _remote(path: str | Path | Location) -> bool:
    return path.remote if isinstance(path, Location) else is_uri(path)


def _staging_name(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{suffix}"


def _publish(staging: Path, path: Path) -> None:
    """Make the fully written `staging` visible as `path` in one step (local disk: a rename; a file
    replaces a file, a directory must not exist yet)."""
    if staging.is_dir() and path.exists():
        raise FileExistsError(f"{path} appeared while it was being written")
    os.replace(staging, path)


def write_text_atomic(path: str | Path | Location, text: str) -> Path | Location:
    Location.of(path).write_text(text)
    return path if isinstance(path, Location) or is_uri(path) else Path(path)


def write_json_atomic(path: str | Path | Location, payload: dict[str, Any]) -> Path | Location:
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
