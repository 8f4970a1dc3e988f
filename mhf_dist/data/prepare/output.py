"""Which output prepare may write, its work area, and publishing: the rules of ownership.

The work area is `.NAME.partial/` beside a local output, renamed to NAME at the end. In a bucket, which
has no rename, it is a new version folder in the output prefix (or the unfinished one a run left there,
to resume), and the manifest is the switch: one PUT naming the new version's files replaces the old
version at once, and only then is the old one deleted, so a reader always finds one complete version.
A prefix holding anything prepare does not write is not ours to replace, nor is a local work area
holding such a file (`check_output`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from mhf_dist.data.prepare.records import KEY_FILE, PARTS, PROGRESS, SHARDS, STAGED, InputsKey, read_record
from mhf_dist.data.shards import (
    FORMAT,
    MANIFEST,
    SHARD_FILE,
    SIGNATURES_FILE,
    TOKENIZER_FILE,
    VERSION_FOLDER,
    Manifest,
    write_manifest,
)
from mhf_dist.errors import DataError, MhfError
from mhf_dist.signatures import load_table
from mhf_dist.storage import Location, publish_directory, staging_leftover

# Every file a prepare writes in its output: the manifest, and the files of a version (in a bucket in its
# version folder, where the progress folder is kept while the run is unfinished).
WRITTEN_HERE = re.compile(
    re.escape(MANIFEST)
    + rf"|({VERSION_FOLDER}/)?("
    + "|".join(
        (
            *(re.escape(name) for name in (TOKENIZER_FILE, SIGNATURES_FILE)),
            SHARD_FILE.pattern,
            rf"{PROGRESS}/{re.escape(KEY_FILE)}",
            rf"{PROGRESS}/{PARTS}/\d{{5,}}\.(arrow|json)",  # a part's tokens, and its record
            rf"{PROGRESS}/{SHARDS}/({SHARD_FILE.pattern})\.json",
            rf"{PROGRESS}/{STAGED}/[A-Za-z0-9_-]+(\.json|/\d{{6,}}\.parquet)",  # a Dataset source, staged
        )
    )
    + ")"
)
BUCKET_WORK = re.compile(rf"({VERSION_FOLDER}/|{PROGRESS}/)")  # only a bucket run of ours makes these


def check_output(out: Location, overwrite: bool, flag: str = "--out") -> None:
    """Before any work: `out` (named by the option `flag`) is absent, empty, or shards this command wrote,
    replaced only with `overwrite` (a partial run of ours in a bucket is resumed); else it is refused."""
    keep_out = f"choose another {flag} or remove it yourself"
    out.check_writable(DataError, f"choose another {flag}")
    if out.is_symlink():
        raise DataError(f"output {str(out)!r} is a symbolic link, not a directory of shards; {keep_out}")
    if out.is_file():
        raise DataError(f"output {str(out)!r} is a file, not a directory of shards; {keep_out}")
    entries = out.children()
    if entries:
        foreign = _foreign(out, entries)
        if foreign is not None:
            raise DataError(f"output {str(out)!r} is not shards mhf prepare wrote ({foreign}); {keep_out}")
        if (out / MANIFEST).is_file() and not overwrite:
            raise DataError(
                f"output {str(out)!r} holds prepared shards; pass --overwrite or choose another {flag}"
            )
    work = None if out.remote else work_directory(out)  # in a bucket, a version folder checked above
    if work is not None and (work.exists() or work.is_symlink()):  # to be resumed or replaced: ours alone
        files = [path for path, _ in work.files() if not staging_leftover(path)]
        stranger = next((path for path in files if not WRITTEN_HERE.fullmatch(path)), None)
        if stranger is not None or work.is_symlink() or not work.is_dir():
            holds = f"it holds {stranger!r}" if stranger else "a link or a file"
            raise DataError(
                f"{str(work)!r}, the work area of a prepare of {str(out)!r}, is not mhf's ({holds}); move it "
                f"away or choose another {flag}"
            )


def _foreign(out: Location, entries: list[Location]) -> str | None:
    """Why the non-empty directory `out` is not shards of ours (to replace, or in a bucket to resume),
    or None when every file in it is one this command writes, with a manifest of ours (or a damaged one
    beside a signature table of ours)."""
    files = [path for path, _ in out.files()]
    stranger = next((path for path in files if not WRITTEN_HERE.fullmatch(path)), None)
    if stranger is None:  # an empty folder, or a link to one
        holding = {path.split("/", 1)[0] for path in files}
        stranger = next((entry.name for entry in entries if entry.name not in holding), None)
    if stranger is not None:
        return f"it holds {stranger!r}"
    if MANIFEST not in files:  # a bucket run of ours that did not finish, or not ours
        unfinished = out.remote and any(BUCKET_WORK.match(path) for path in files)
        return None if unfinished else f"it has no {MANIFEST}"
    try:
        raw = json.loads((out / MANIFEST).read_bytes())
    except ValueError:
        tables = (out / path for path in files if path.rsplit("/", 1)[-1] == SIGNATURES_FILE)
        return None if any(map(_our_signature_table, tables)) else f"its {MANIFEST} is not JSON"
    ours = isinstance(raw, dict) and raw.get("format") == FORMAT
    return None if ours else f"its {MANIFEST} is not an mhf shard manifest"


def _our_signature_table(path: Location) -> bool:
    try:
        load_table(path)
    except MhfError:
        return False
    return True


def work_directory(out: Location) -> Location:
    """Where a prepare of `out` writes: `.NAME.partial` locally; in a bucket an unfinished or new version."""
    if not out.remote:
        return Location.of(out.local.parent / f".{out.local.name}.partial")
    named = _named_versions(out)
    unfinished = (
        entry
        for entry in out.children()
        if re.fullmatch(VERSION_FOLDER, entry.name)
        and entry.name not in named
        and (entry / PROGRESS).is_dir()
    )
    return next(unfinished, None) or out / f"v-{uuid.uuid4().hex[:12]}"


def _named_versions(out: Location) -> set[str]:
    """The version folders the manifest at `out` names, read from its text: one that is damaged or
    edited still keeps its folder from being taken for work."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return set()
    return set(re.findall(VERSION_FOLDER, manifest.read_bytes().decode(errors="replace")))


def open_work(work: Location, key: InputsKey, log: Callable[[str], None]) -> None:
    """Resume `work` if its key is `key`, else start it afresh, keeping only the staged snapshots."""
    key_file = work / PROGRESS / KEY_FILE
    if key_file.is_file():
        if read_record(key_file, InputsKey) == key:
            log(f"resuming the partial prepare in {work} (same inputs and settings)")
            return
        log(f"the partial prepare in {work} had other inputs or settings; starting over")
    _clear_but_staged(work)
    for folder in (PARTS, SHARDS):
        (work / PROGRESS / folder).make_dirs()
    key_file.write_text(key.model_dump_json(indent=1) + "\n")


def publish(work: Location, out: Location, manifest: Manifest) -> Manifest:
    """Remove what the manifest does not name, write it, and then either rename a local output into
    place or, in a bucket, delete the version it replaced (another run's unfinished version, and a
    folder holding a file prepare does not write, stay). Returns the manifest as published."""
    for folder in (PARTS, SHARDS, STAGED):
        (work / PROGRESS / folder).remove()
    named = {*manifest.file_names(), PROGRESS}
    for entry in work.children():
        if entry.name not in named:
            entry.remove()
    if not out.remote:
        entries = out.children()
        foreign = _foreign(out, entries) if entries else None
        if foreign is not None:  # written there while this prepare ran: the rename would delete it
            raise DataError(
                f"output {str(out)!r} is no longer only shards mhf prepare wrote ({foreign}); move that out "
                f"and rerun: the new shards wait in {work}"
            )
        write_manifest(work, manifest)
        (work / PROGRESS).remove()
        publish_directory(work.local, out.local, replace=True)
        return manifest
    replaced = _named_versions(out)
    manifest = manifest.moved_to(work.name)
    write_manifest(out, manifest)
    (work / PROGRESS).remove()
    for entry in out.children():
        unfinished = re.fullmatch(VERSION_FOLDER, entry.name) and (entry / PROGRESS).is_dir()
        if entry.name in (MANIFEST, work.name) or (unfinished and entry.name not in replaced):
            continue
        paths = [f"{entry.name}/{path}" for path, _ in entry.files()] or [entry.name]
        if all(WRITTEN_HERE.fullmatch(path) for path in paths):  # ours alone: nothing anyone added since
            entry.remove()
    return manifest


def _clear_but_staged(work: Location) -> None:
    """Remove all of `work` but its staged Dataset snapshots (a rerun of other settings reuses them)."""
    for entry in work.children():
        if entry.name != PROGRESS:
            entry.remove()
    for entry in (work / PROGRESS).children():
        if entry.name != STAGED:
            entry.remove()


def discard(work: Location, error: MhfError) -> MhfError:
    """A run that cannot succeed with these inputs leaves nothing to resume, its staged snapshots aside."""
    _clear_but_staged(work)
    if not work.files():
        work.remove()
    return error
