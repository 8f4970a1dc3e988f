"""Where mhf-dist reads and writes: a local path or an object-store URI (`s3://`, `gs://`), through one
`pyarrow.fs` filesystem either way (`Location.of`). Endpoint and credentials come from the standard
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ..., the instance role; for GCS the default
credentials and `STORAGE_EMULATOR_HOST`) or a URI's query options; requests time out and retry a few
times, so an unreachable endpoint fails within seconds.

A write that others may read is published whole: staged privately, then renamed into place on a local
disk; an object store has no rename, so a directory's files are uploaded with its marker file last and a
reader that waits for the marker never sees half of one. What only a local disk has (links, `on_disk`,
`staging`, `ray_storage`) is asked of a `Location`, never decided by the caller.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import glob
import hashlib
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import pyarrow.fs as pafs

from mhf_dist.errors import MhfError, first_line

REQUEST_TIMEOUT_S = 20  # a store that stops answering fails a request after this (MHF_STORAGE_TIMEOUT_S)
TIMEOUT_VARIABLE = "MHF_STORAGE_TIMEOUT_S"
CACHE_VARIABLE = "MHF_CACHE"  # where remote models are copied to before loading (default ~/.cache/mhf-dist)
GOOGLE_SCHEMES = ("gs", "gcs")  # Google Cloud Storage's, as pyarrow reads them
NAME_MAX = 255  # bytes in a file name on Linux's file systems (ext4, XFS, btrfs, tmpfs)
# A local output is written beside itself first, under its name and at most 14 more bytes: `.NAME.<12 hex>`
# (`staged_directory`), `.NAME.partial` (prepare's work area), `.NAME.old-<8 hex>` (`publish_directory`).
STAGING_ROOM = 14
_SCHEME_NAME = r"[a-zA-Z][a-zA-Z0-9+.-]*"  # RFC 3986's
_SCHEME = re.compile(rf"^({_SCHEME_NAME})://")
_URI = re.compile(rf"{_SCHEME_NAME}://[^\s'\"]+")
WILDCARD = re.compile(r"[*?\[]")
# A URI that lost a slash: any scheme (not file:, whose `file:/x` is valid) with one, an object store's
# with none. One letter is a Windows drive (`C:/x`), not a scheme.
_URI_TYPO = re.compile(
    r"^(?!file:)(?P<scheme>[a-z][a-z0-9+.-]+):/(?!/)|^(?P<store>s3|gs|gcs|hdfs|viewfs|abfss?):(?!/)", re.I
)


class StorageError(MhfError):
    """A location that cannot be reached, does not exist or refuses the credentials (`problem`)."""

    def __init__(self, message: str, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem


def is_uri(location: str | Path) -> bool:
    """A location with a scheme other than file:// (`s3://bucket/x`, `gs://bucket/x`)."""
    match = _SCHEME.match(str(location))
    return bool(match) and match.group(1).lower() != "file"


def redact(location: str | Path) -> str:
    """`location` without user info and query options (where credentials could be): safe to print or log."""
    text = str(location)
    if not _SCHEME.match(text):
        return text
    parts = urlsplit(text)
    netloc, path = parts.netloc, parts.path
    if ":" in netloc and "@" in path:  # user:secret whose secret holds an unencoded "/" (AWS keys may)
        netloc, _, path = path.rsplit("@", 1)[-1].partition("/")
        path = f"/{path}" if path else ""
    elif "@" not in netloc and not parts.query:
        return text  # nothing to remove (and urlunsplit would drop a slash of `sqlite:////abs/path`)
    return urlunsplit((parts.scheme, netloc.rsplit("@", 1)[-1], path, "", ""))


def redact_text(text: str) -> str:
    """Every URI inside `text` redacted (for error messages a library wrote)."""
    return _URI.sub(lambda match: redact(match.group(0)), text)


# A name is secret when one of its words (split at `_`, `-`, `.` and case changes) is one of these, or
# when it is a key of one of KEY_KINDS (`api_key`, `AccountKey`; not `shard_keys` or `sort_key`).
SECRET_WORDS = frozenset(
    ["password", "passwd", "pwd", "pw", "pass", "passphrase", "secret", "token", "credential", "credentials",
     "creds", "auth", "authorization", "bearer", "jwt", "pat", "apikey", "accountkey", "sslkey", "dsn",
     "cookie", "signature", "sas"]
)  # fmt: skip
KEY_KINDS = frozenset(["api", "access", "private", "secret", "account", "signing", "master", "encryption"])
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
# Secrets inside a string: `password=...` or `token: ...` (to the next `;`, `,`, space or closing quote),
# `Bearer ...`, and a scheme-less `user:password@host`.
_IN_TEXT = re.compile(
    r"\b(?:password|passwd|pwd|passphrase|secret|token|accountkey|sharedaccesssignature|api_?key)\s*[=:]\s*"
    r"(?P<a>'[^']*'|\"[^\"]*\"|[^;,\s]+)|\bbearer\s+(?P<b>\S+)|(?<![\w/:])[\w.%+-]+:(?P<c>[^\s@/:'\"]+)@(?=[\w.-])",
    re.IGNORECASE,
)
REDACTED = "<redacted>"


def secret_name(name: str) -> bool:
    words = {word.lower() for word in _WORD.findall(name)}
    return bool(words & SECRET_WORDS) or ("key" in words and bool(words & KEY_KINDS))


def secrets_in(value: Any) -> set[str]:
    """The secret strings in `value` (a Dataset source's args): under a secret-looking name, after a
    secret-looking flag in a list (`["--password", "..."]`), a URI's password, one written in a string."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found |= _strings(item) if secret_name(str(key)) else secrets_in(item)
    elif isinstance(value, list | tuple):
        for before, item in zip([None, *value], value, strict=False):
            flag = isinstance(before, str) and before.startswith("-") and secret_name(before)
            found |= _strings(item) if flag else secrets_in(item)
    elif isinstance(value, str):
        for match in _URI.finditer(value):
            with contextlib.suppress(ValueError):
                found.add(urlsplit(match.group(0)).password or "")
        found |= {next(group for group in match.groups() if group) for match in _IN_TEXT.finditer(value)}
    return {secret.strip("'\"") for secret in found if len(secret.strip("'\"")) >= 3}


def _strings(value: Any) -> set[str]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return set().union(*map(_strings, value))
    return {str(value)} if value is not None else set()


def masked(text: str, secrets: set[str]) -> str:
    """`text` with every one of `secrets` (longest first) and every URI's credentials masked."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return redact_text(text)


def redact_values(value: Any) -> Any:
    """Values to show or record (a Dataset source's args, MLflow params): secrets masked, URIs redacted."""
    secrets = secrets_in(value)

    def walk(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: REDACTED if secret_name(str(key)) else walk(inner) for key, inner in item.items()}
        if isinstance(item, list | tuple):
            return [walk(inner) for inner in item]
        return masked(item, secrets) if isinstance(item, str) else item

    return walk(value)


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether the URL's host and port accept a TCP connection within `timeout` seconds: a cheap look
    before a client that retries for half a minute (Ray Client, the Hugging Face hub) is asked."""
    parts = urlsplit(url)
    default = {"https": 443, "http": 80, "ray": 10001}.get(parts.scheme, 0)  # Ray Client's own default
    try:
        with socket.create_connection((parts.hostname or "", parts.port or default), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def request_timeout() -> float:
    """Seconds a request to an object store may go unanswered: MHF_STORAGE_TIMEOUT_S, else 20."""
    text = os.environ.get(TIMEOUT_VARIABLE) or str(REQUEST_TIMEOUT_S)
    with contextlib.suppress(ValueError):
        if 0 < float(text) < float("inf"):
            return float(text)
    raise StorageError(f"{TIMEOUT_VARIABLE}={text!r}: give a number of seconds above 0, e.g. 20")


@functools.lru_cache(maxsize=16)
def _s3(endpoint: str | None, region: str | None) -> pafs.FileSystem:
    return pafs.S3FileSystem(
        connect_timeout=5,
        request_timeout=request_timeout(),
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),  # an unreachable endpoint fails fast
        endpoint_override=endpoint,  # None: pyarrow's default, as if left out
        region=region or None,
    )


@functools.lru_cache(maxsize=16)
def _gcs(emulator: str | None) -> pafs.FileSystem:
    options: dict[str, Any] = {"retry_time_limit": timedelta(seconds=request_timeout())}
    if emulator:  # `http://HOST:PORT` (Google's clients) or `HOST:PORT`
        scheme, _, host = emulator.rpartition("://")
        options.update(endpoint_override=host, scheme=scheme or "http", anonymous=True)
    return pafs.GcsFileSystem(**options)


def local_path(text: str) -> Path:
    """A local path as written or as a `file:` URI's path (`file:///x`, `file://localhost/x`), `~` expanded.
    A `~user` without a home, a `file:` URI that is not one absolute path of this machine, or an object
    store's URI that lost a slash (`s3:/bucket`, which would make a local folder named `s3:`) is one line."""
    if typo := _URI_TYPO.match(text):
        scheme = (typo.group("scheme") or typo.group("store")).lower()
        fixed = f"{scheme}://{text[typo.end() :].lstrip('/')}"
        raise StorageError(
            f"{text!r} is missing a slash of {scheme}://: write {fixed}, or ./{text} if it is local"
        )
    path = text
    if text[:5].lower() == "file:":
        parts = urlsplit(text)
        if "@" in parts.netloc:  # user info, perhaps a secret: not echoed
            raise StorageError(f"{redact(text)!r}: a file: URI takes no user; write file:///ABSOLUTE/PATH")
        if parts.netloc.lower() not in ("", "localhost") or not parts.path.startswith("/"):
            raise StorageError(f"{text!r} is no absolute path on this machine; write file:///ABSOLUTE/PATH")
        if parts.query or parts.fragment:
            raise StorageError(f"{text!r}: a file: URI keeps no ? or #; write them as %3F and %23")
        path = unquote(parts.path)
    if "\x00" in path:
        raise StorageError(f"{text!r} holds a NUL byte (%00), which no path may; remove it")
    try:
        return Path(path).expanduser()
    except RuntimeError:  # what expanduser raises for a user it finds no home directory of
        home = path.split("/", 1)[0]
        raise StorageError(f"{text!r}: {home!r} has no home directory here; write the path out") from None


def check_trimmed(text: str, error: type[Exception] = StorageError) -> None:
    """A location a user wrote has no white space around it (` s3://b/x` would be a local folder named so);
    for what users write (arguments, config keys, job specs), not for names read from a listing."""
    if text != text.strip():
        raise error(f"{text!r} begins or ends with white space; remove it")


def path_text(path: Path) -> str:
    """`path` as text that `local_path` reads back as it: `./s3:x`, not the mistyped URI `s3:x`."""
    text = str(path)
    return f"./{text}" if not path.is_absolute() and re.match(f"{_SCHEME_NAME}:", text) else text


def unwritable(path: Path) -> Path | None:
    """The nearest existing part of `path` when nothing can be made there (tried by making an entry:
    `os.access` says yes to root everywhere, `/proc` included); None when `path` can be written."""
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".mhf-probe-"))
    except OSError:  # NotADirectoryError for a file, PermissionError, or a file system that takes none
        return existing
    return None


@dataclass(frozen=True)
class Location:
    """A file or directory: `uri` as the user wrote it (re-resolved in other processes), `fs` and `path`."""

    uri: str
    fs: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, location: str | Path | Location) -> Location:
        """`location` (a local path, a `file:` URI or a store's URI) with the filesystem holding it."""
        if isinstance(location, Location):
            return location
        text = str(location)
        if not is_uri(text):
            path = str(local_path(text).absolute())
            return cls(path, pafs.LocalFileSystem(), path)
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        inside = (parts.netloc.rsplit("@", 1)[-1] + parts.path).rstrip("/")
        if not parts.netloc:
            raise StorageError(f"{redact(text)!r} names no bucket; write {scheme}://BUCKET/PATH")
        folders = parts.path.removeprefix("/").removesuffix("/")
        if folders and any(part in ("", ".", "..") for part in folders.split("/")):
            raise StorageError(
                f"{redact(text)!r} has an empty, . or .. folder in its path; write {scheme}://BUCKET/PATH"
            )
        if scheme == "s3" and not parts.query and "@" not in parts.netloc:
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            return cls(text, _s3(_endpoint(), region), inside)
        if scheme in GOOGLE_SCHEMES and not parts.query and "@" not in parts.netloc:
            return cls(text, _gcs(os.environ.get("STORAGE_EMULATOR_HOST")), inside)
        try:
            return cls(text, *pafs.FileSystem.from_uri(text))
        except (ValueError, OSError) as err:  # pyarrow.ArrowInvalid is a ValueError
            # No type or code tells an unknown scheme from a bad option: pyarrow's words (a test pins them).
            if str(err).startswith("Unrecognized filesystem type"):
                raise StorageError(
                    f"{redact(text)!r}: pyarrow knows no filesystem for {scheme}://; "
                    "use a local path, s3:// or gs://"
                ) from None
            raise StorageError(f"{redact(text)!r}: {redact_text(first_line(err))}") from None

    def __str__(self) -> str:
        return redact(self.uri)

    def __truediv__(self, name: str) -> Location:
        if not self.remote:
            return Location.of(Path(self.path) / name)
        parts = urlsplit(self.uri)
        joined = urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + name.strip("/")))
        return Location(joined, self.fs, f"{self.path.rstrip('/')}/{name.strip('/')}")

    @property
    def remote(self) -> bool:
        return is_uri(self.uri)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def local(self) -> Path:
        """The local path (only for a location on the local disk)."""
        if self.remote:
            raise StorageError(f"{self} is not on the local disk")
        return Path(self.path)

    def as_given(self) -> Path | Location:
        """A local location as a `Path` (as callers always had it), a remote one as itself."""
        return self if self.remote else self.local

    @property
    def real(self) -> str:
        """What this location reaches: its real path on the local disk (links followed), else its URI."""
        return self.uri if self.remote else os.path.realpath(self.path)

    def is_symlink(self) -> bool:
        return not self.remote and self.local.is_symlink()

    def file_above(self) -> Path | None:
        """A local file where a folder above this location would have to be (never in an object store)."""
        above = [] if self.remote else self.local.parents
        return next((parent for parent in above if parent.is_file()), None)

    def ray_storage(self) -> dict[str, Any]:
        """Ray Train's and Tune's `storage_path` and `storage_filesystem` (None: Ray's own local disk)."""
        return {"storage_path": self.path, "storage_filesystem": self.fs if self.remote else None}

    def check_bucket(self) -> None:
        """A remote location's bucket exists (a missing one reads as empty, fails a write late)."""
        if not self.remote:
            return
        root = Location(urlunsplit(urlsplit(self.uri)._replace(path="")), self.fs, self.path.split("/", 1)[0])
        if not root.is_dir():
            raise StorageError(f"the bucket of {str(self)!r} does not exist; create it or fix the URI")

    def check_writable(self, error: type[MhfError], fix: str) -> None:
        """Before any work: its bucket exists, or its local folder takes new entries and every name on its
        path fits the file system, its own with room for the staging name beside it."""
        if self.remote:
            self.check_bucket()
            return
        *folders, name = self.local.parts
        for part, limit in [*((folder, NAME_MAX) for folder in folders), (name, NAME_MAX - STAGING_ROOM)]:
            if (length := len(os.fsencode(part))) > limit:
                why = "the file system's limit" if limit == NAME_MAX else "it is first written beside itself"
                raise error(
                    f"the name {part[:24]!r}... is {length} bytes; it may have at most {limit} ({why}); {fix}"
                )
        if (closed := unwritable(self.local.parent)) is not None:
            raise error(f"cannot write in {str(closed)!r} (not a writable directory); {fix}")

    def info(self) -> pafs.FileInfo:
        with storage_errors(self):
            return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def size(self) -> int:
        return self.info().size

    def read_bytes(self) -> bytes:
        with storage_errors(self), self.fs.open_input_stream(self.path, compression=None) as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> None:
        """The whole file in one step (local: staged and renamed; object store: one upload)."""
        if not self.remote:
            with self.staged_file() as staging:
                staging.write_bytes(data)
            return
        with storage_errors(self), self.fs.open_output_stream(self.path, compression=None) as stream:
            stream.write(data)

    @contextlib.contextmanager
    def staged_file(self) -> Iterator[Path]:
        """A local file to write that replaces this one in one step on success, removed on any error."""
        if self.remote:
            with tempfile.TemporaryDirectory(prefix="mhf-staged-") as tmp:
                staging = Path(tmp) / "file.tmp"
                staging.touch()
                yield staging
                self.write_bytes(staging.read_bytes())
            return
        path = self.local
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging_name(path, ".tmp")
        os.close(os.open(staging, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies
        mode = staging.stat().st_mode & 0o777
        try:
            yield staging
            os.chmod(staging, mode)  # a writer that replaces its file (safetensors) makes it 0600
            _publish(staging, path)
        finally:
            staging.unlink(missing_ok=True)

    @contextlib.contextmanager
    def staged_directory(self, marker: str | None = None) -> Iterator[Path]:
        """An empty local directory that becomes this one (which must not exist) on success, uploaded with
        `marker` last to an object store, and is removed on any error."""
        if self.remote:
            with tempfile.TemporaryDirectory(prefix="mhf-staged-") as tmp:
                yield Path(tmp)
                if self.exists():
                    raise FileExistsError(f"{self} appeared while it was being written")
                self.upload(Path(tmp), last=marker)
            return
        path = self.local
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging_name(path, "")
        staging.mkdir()  # mode 0777 less the umask, as any new directory (mkdtemp's would be 0700)
        try:
            yield staging
            # A new file's mode: 0666 less the umask, as the staging folder's is 0777 less it.
            mode = staging.stat().st_mode & 0o666
            for written in staging.rglob("*"):  # a writer that replaces its file (safetensors) makes it 0600
                if written.is_file():
                    os.chmod(written, mode)
            publish_directory(staging, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def staging(self, prefix: str) -> tempfile.TemporaryDirectory[str]:
        """A temp directory for files on their way here: inside it if local (`clear_staging`), else TMPDIR."""
        return tempfile.TemporaryDirectory(dir=None if self.remote else self.path, prefix=prefix)

    def clear_staging(self, prefix: str) -> None:
        """The `staging(prefix)` directories a stopped process left here, removed."""
        for staging in [] if self.remote else self.local.glob(f"{prefix}*"):
            shutil.rmtree(staging, ignore_errors=True)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def files(self, links: bool = False) -> list[tuple[str, int]]:
        """(relative path, size) of every file below this directory, sorted. With `links`, a local directory's
        links to directories are followed, each directory entered once (a link to a parent is no loop)."""
        if not self.is_dir():
            return []
        if links and not self.remote:
            entered: set[tuple[int, int]] = set()
            found = []
            for folder, folders, names in os.walk(self.path, followlinks=True):
                identity = os.stat(folder)
                if (identity.st_dev, identity.st_ino) in entered:
                    folders.clear()
                    continue
                entered.add((identity.st_dev, identity.st_ino))
                paths = [Path(folder) / name for name in names]
                found += [(str(p.relative_to(self.path)), p.stat().st_size) for p in paths if p.is_file()]
            return sorted(found)
        with storage_errors(self):
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True))
        base = self.path.rstrip("/") + "/"
        files = (info for info in infos if info.type == pafs.FileType.File)
        return sorted((info.path.removeprefix(base), info.size) for info in files)

    def children(self) -> list[Location]:
        """The entries directly inside this directory, sorted by name."""
        if not self.is_dir():
            return []
        with storage_errors(self):
            infos = self.fs.get_file_info(pafs.FileSelector(self.path))
        return [self / info.base_name for info in sorted(infos, key=lambda i: i.path)]

    def make_dirs(self) -> None:
        with storage_errors(self):
            self.fs.create_dir(self.path, recursive=True)

    def remove(self) -> None:
        """Delete this file or directory tree (nothing if missing)."""
        kind = self.info().type
        with storage_errors(self):
            if kind == pafs.FileType.Directory:
                self.fs.delete_dir(self.path)
            elif kind == pafs.FileType.File:
                self.fs.delete_file(self.path)

    def upload(self, local: Path, last: str | None = None) -> None:
        """Copy the local directory `local` here, its file `last` (a marker) after all the others."""
        names = [str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()]
        with storage_errors(self):
            for name in sorted(names, key=lambda name: (name == last, name)):  # `last` at the end
                target = f"{self.path}/{name}"
                pafs.copy_files(str(local / name), target, pafs.LocalFileSystem(), self.fs, use_threads=False)

    def download(self, local: Path) -> Path:
        """Copy this directory (or file) to the local path `local`; returns it."""
        with storage_errors(self):
            (local.parent if self.is_file() else local).mkdir(parents=True, exist_ok=True)
            pafs.copy_files(self.path, str(local), self.fs, pafs.LocalFileSystem())
        return local

    @contextlib.contextmanager
    def on_disk(self, wanted: Callable[[str], bool] = lambda name: True) -> Iterator[Path]:
        """This directory on the local disk, else a temporary copy of the files `wanted` accepts (by name)."""
        if not self.remote:
            yield self.local
            return
        with tempfile.TemporaryDirectory(prefix="mhf-restore-") as tmp:
            for name, _ in self.files():
                if wanted(name):
                    (self / name).download(Path(tmp) / name)
            yield Path(tmp)


def matches(spec: str) -> list[tuple[Location, int]]:
    """The files (with sizes) the glob `spec` matches, `**` recursive; in a bucket, fnmatch on a listing."""
    if not is_uri(spec):
        found = glob.glob(str(local_path(spec)), recursive=True)  # a file: URI's, `~` expanded
        paths = sorted(Path(p).absolute() for p in found if Path(p).is_file())
        return [(Location.of(path), path.stat().st_size) for path in paths]
    first = WILDCARD.search(spec)
    assert first is not None
    base = Location.of(spec[: spec.rfind("/", 0, first.start())])
    pattern = Location.of(spec).path
    return [
        (base / name, size)
        for name, size in base.files()
        if fnmatch.fnmatchcase(f"{base.path.rstrip('/')}/{name}", pattern)
    ]


def publish_directory(staging: Path, path: Path, replace: bool = False) -> None:
    """Rename the complete `staging` to `path`; with `replace`, an existing directory there is deleted only
    once the new one is in place (put back if that fails). A file or a link is never replaced."""
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


def _staging_name(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{suffix}"


def staging_leftover(path: str) -> bool:
    """Whether the relative path is a `staged_file`'s staging file (a writer killed before its rename
    leaves it)."""
    return re.fullmatch(r"\..+\.[0-9a-f]{12}\.tmp", path.rsplit("/", 1)[-1]) is not None


def _publish(staging: Path, path: Path) -> None:
    """Rename `staging` to `path`: a file replaces a file, a directory must not exist yet."""
    if staging.is_dir() and path.exists():
        raise FileExistsError(f"{path} appeared while it was being written")
    os.replace(staging, path)


def local_copy(location: str | Path | Location, marker: str | None = None) -> Path:
    """A local path holding `location`: itself, or a copy cached by the URI and every object's name, size
    and ETag (a replaced object is downloaded again). A remote directory without `marker` is refused."""
    where = Location.of(location)
    if not where.remote:
        return where.local
    listing = where.files() if (folder := where.is_dir()) else [("", where.size())] if where.exists() else []
    if not listing:
        raise StorageError(f"{where} does not exist; check the URI")
    if marker is not None and folder and marker not in dict(listing):
        raise StorageError(f"{where} has no {marker}: it is incomplete or not what was asked for")
    versions = [(name, size, _version(where / name if name else where)) for name, size in listing]
    key = hashlib.sha256(repr((redact(where.uri), versions)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "mhf-dist") / "remote"
    target = cache / key / where.name  # the copy keeps its name (MLflow names artifacts after it)
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{key}-"))
        try:
            where.download(staging / where.name)
            os.replace(staging, cache / key)
        except OSError:
            if not target.exists():  # another process published the same copy first: use theirs
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _version(where: Location) -> str:
    """An object's version as its store tells it: the ETag (S3, GCS), else its modification time."""
    with storage_errors(where), where.fs.open_input_stream(where.path, compression=None) as stream:
        etag = next((value for key, value in (stream.metadata() or {}).items() if key.lower() == "etag"), "")
    if etag:
        return etag.decode() if isinstance(etag, bytes) else str(etag)
    return str(where.info().mtime_ns)


@contextlib.contextmanager
def storage_errors(location: Location | str) -> Iterator[None]:
    """An OSError from the filesystem becomes one line naming the problem and the fix."""
    try:
        yield
    except (StorageError, FileNotFoundError):
        raise
    except OSError as err:
        raise StorageError(describe_failure(str(location), err), store_problem(str(location), err)) from None


# pyarrow raises a plain OSError for a failed request, its text carrying the store's own error code:
# S3's as "AWS Error NETWORK_CONNECTION during ...", GCS's as "google::cloud::Status(UNAVAILABLE: ...".
_CODE = re.compile(r"\bAWS Error ([A-Z_]+) during |\bgoogle::cloud::Status\(([A-Z_]+): ")
UNREACHABLE, NO_BUCKET, REFUSED = "unreachable", "no bucket", "refused"
_PROBLEMS = {
    "NETWORK_CONNECTION": UNREACHABLE,  # S3: no connection, no answer in time, unknown host
    "UNAVAILABLE": UNREACHABLE,  # GCS
    "NO_SUCH_BUCKET": NO_BUCKET,
    "ACCESS_DENIED": REFUSED,
    "INVALID_ACCESS_KEY_ID": REFUSED,
    "SIGNATURE_DOES_NOT_MATCH": REFUSED,
}
# pyarrow's own refusal to create a directory in a missing bucket carries no code: its words are matched
# (tests/test_object_storage.py pins them, as it pins every code above to a real server's error).
_NO_BUCKET_TO_CREATE = "To create buckets, enable the allow_bucket_creation option"


def store_problem(location: str, err: BaseException) -> str | None:
    """What a failed request to `location` ran into (UNREACHABLE, NO_BUCKET, REFUSED), or None."""
    # GCS's 401 and 403; a local file's (a cache, a copy's target) names its file
    if is_uri(location) and isinstance(err, PermissionError) and err.filename is None:
        return REFUSED
    if match := _CODE.search(str(err)):
        return _PROBLEMS.get(match.group(1) or match.group(2))
    return NO_BUCKET if _NO_BUCKET_TO_CREATE in str(err) else None


def describe_failure(location: str, err: BaseException) -> str:
    """One line for a failed request: which location, what went wrong, what to do."""
    where = redact(location)
    problem = store_problem(location, err)
    google = urlsplit(location).scheme.lower() in GOOGLE_SCHEMES
    if problem == UNREACHABLE and google:
        return f"cannot reach Google Cloud Storage for {where!r}; check the network or STORAGE_EMULATOR_HOST"
    if problem == UNREACHABLE:
        endpoint = _endpoint() or "the default endpoint"
        return f"cannot reach the object store at {endpoint} for {where!r}; check AWS_ENDPOINT_URL"
    if problem == NO_BUCKET:
        return f"the bucket of {where!r} does not exist; create it or fix the URI"
    if problem == REFUSED:
        check = (
            "GOOGLE_APPLICATION_CREDENTIALS (or the instance's service account)"
            if google
            else "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the instance role)"
        )
        return f"the object store refused the credentials for {where!r}; check {check}"
    text = redact_text(str(err)).strip()
    first = text.splitlines()[0] if text else "unknown error"
    return f"cannot use {where!r} ({first[:200]})"
