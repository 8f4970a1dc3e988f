"""The kinds of value a command-line argument takes, each checked where argparse reads it.

Every argument of `mhf` that takes a value is declared with one of the `Kind`s below as its `type`
(the contract test, tests/test_contract.py, fails for one that is not). A kind turns the text into its
value or refuses it with one line that says what the argument takes, so a bad number or a path of the
wrong kind stops the command before it does any work. `MhfParser` prints argparse's own errors (an
unknown flag, a missing argument) as that same one `error:` line.

Paths are checked on the local disk only: kind (file or directory), existence, and for outputs the
nearest existing parent being a writable directory. Bucket URIs (`s3://`, `gs://`) pass here and are
checked by the command that opens them.
"""

from __future__ import annotations

import argparse
import glob
import math
import re
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mhf_dist.config import MAX_SEED, MAX_VOCAB, MIN_VOCAB
from mhf_dist.errors import MhfError
from mhf_dist.files import unwritable
from mhf_dist.storage import is_uri


@dataclass(frozen=True)
class Kind:
    """An argument type: `parse` reads the text or raises `argparse.ArgumentTypeError`; `takes` says in
    a few words what is allowed (for the error line); `bad` are texts it must refuse and `good` texts
    it must take, which the contract test feeds to every argument of this kind."""

    name: str
    takes: str
    parse: Callable[[str], Any]
    bad: tuple[str, ...]
    good: tuple[str, ...] = ()

    def __call__(self, text: str) -> Any:
        _check_text(text)
        try:
            return self.parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r}: {self.takes}") from None
        except MhfError as err:  # the library's own check of such a value, whose line says it all
            raise argparse.ArgumentTypeError(str(err)) from None

    def __repr__(self) -> str:  # argparse names the type in some messages
        return self.name


def _check_text(text: str) -> None:
    """Arguments are text: bytes that are not UTF-8 reach Python as surrogate escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"{text.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8 text; give it as UTF-8"
        ) from None


def _whole(text: str, low: int, high: int | None = None) -> int:
    value = int(text.strip())
    if value < low or (high is not None and value > high):
        raise ValueError(text)
    return value


def _real(text: str, low: float, high: float = math.inf, open_ends: str = "") -> float:
    """A finite number in [low, high]; `open_ends` "low", "high" or both exclude those ends."""
    value = float(text)
    outside = value < low or value > high
    on_open_end = ("low" in open_ends and value == low) or ("high" in open_ends and value == high)
    if not math.isfinite(value) or outside or on_open_end:
        raise ValueError(text)
    return value


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


def _assignment(text: str) -> str:
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(text)
    return text


def _jobs_api(text: str) -> str:
    """What Ray's job client takes: the dashboard's http(s) URL, a Ray Client `ray://` one, or `auto`
    (on a cluster node); a URL with a host and, if any, a port in range. A bare HOST:PORT it would take
    for a cluster's GCS address, and wait 30 s for."""
    if text.strip() == "auto":
        return "auto"
    url = urllib.parse.urlparse(text.strip())
    if url.scheme not in ("http", "https", "ray") or not url.hostname:
        raise ValueError(text)
    if url.port == 0:  # reading the port raises ValueError for one outside 0-65535
        raise ValueError(text)
    return text.strip()


def _variable(text: str) -> str:
    """`NAME=VALUE` whose NAME an environment variable can have (`${NAME}` in a job spec)."""
    if not re.fullmatch(r"[A-Za-z_]\w*", _assignment(text).partition("=")[0]):
        raise ValueError(text)
    return text


def _size(text: str) -> str:
    from mhf_dist.sizes import byte_size  # imports transformers' hub helpers: only for `mhf export-hf`

    byte_size(text)
    return text


def _local(text: str) -> Path | None:
    """The local path `text` names (`~` expanded, `file://` dropped), or None for a bucket URI."""
    if is_uri(text):
        return None
    return Path(text.removeprefix("file://")).expanduser()


def _matching(text: str, pattern: str) -> str:
    if not re.fullmatch(pattern, text):
        raise ValueError(text)  # Kind says what it takes
    return text


def _exists(path: Path, text: str) -> bool:
    try:
        return path.exists()
    except OSError as err:  # a name longer than the filesystem allows, say
        _fail(f"{text!r} cannot be used ({err.strerror}); choose another path")


def _fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def _existing(text: str, want: str | None) -> str:
    """A path that exists (`want`: "file", "directory" or None for either), as the local path it names;
    bucket URIs pass as they are."""
    path = _local(_nonempty(text))
    if path is None:
        return text
    if not _exists(path, text):
        _fail(f"{text!r} does not exist; give an existing {want or 'file or directory'}")
    if want == "file" and not path.is_file():
        _fail(f"{text!r} is a directory; give a file")
    if want == "directory" and not path.is_dir():
        _fail(f"{text!r} is a file; give a directory")
    return str(path)


def _place(text: str) -> str:
    """A directory a command reads, or creates when it writes: not a file, nor under one."""
    path = _local(_nonempty(text))
    if path is None:
        return text
    if _exists(path, text) and not path.is_dir():
        _fail(f"{text!r} is a file; give a directory")
    parent = path.absolute()
    while not _exists(parent, text):
        parent = parent.parent
    if not parent.is_dir():
        _fail(f"{text!r} cannot be created: {str(parent)!r} is a file; choose a path under a directory")
    return str(path)


def _output(text: str) -> str:
    """A directory a command writes in: a `_place` whose nearest existing part (itself, or the parent
    it is created in) this user may write in."""
    place = _place(text)
    path = _local(place)
    if path is None:
        return place
    existing = unwritable(path.absolute())
    if existing is not None:
        _fail(f"{text!r} cannot be written: {str(existing)!r} is not writable; choose a writable place")
    return place


def _corpus(text: str) -> str:
    """A corpus name (`builtin`, `recall`), `hf:NAME`, `dataset:package.module:function`, a bucket URI or
    glob (checked when read), else a path that exists."""
    from mhf_dist.config import DATASET_PREFIX, check_corpus
    from mhf_dist.data.corpus import BUILTIN_NAME
    from mhf_dist.data.recall import CORPUS as RECALL

    if text.startswith("hf:"):
        _nonempty(text.removeprefix("hf:"))
        return text
    if text.startswith(DATASET_PREFIX):
        return check_corpus(text)
    if text in (BUILTIN_NAME, RECALL) or glob.has_magic(text):
        return text
    return _existing(text, None)


NUMBERS = ("0", "-1", "nan", "inf", "1e400", "x", "")
COUNT = Kind("count", "use a whole number of at least 1", lambda text: _whole(text, 1), NUMBERS, ("1", "64"))
NATURAL = Kind(
    "natural",
    "use a whole number, 0 or more",
    lambda text: _whole(text, 0),
    ("-1", "1.5", "x", ""),
    ("0", "5"),
)
SEED = Kind(
    "seed",
    "use a whole number from 0 to 2**64 - 1",
    lambda text: _whole(text, 0, MAX_SEED),
    ("-1", "18446744073709551616", "1.5", "x"),
    ("0", "18446744073709551615"),
)
INTEGER = Kind(
    "integer",
    "use a whole number",
    lambda text: _whole(text, -sys.maxsize),
    ("1.5", "nan", "x", ""),
    ("-2", "0", "3"),
)
POSITIVE = Kind(
    "positive",
    "use a finite number above 0",
    lambda text: _real(text, 0.0, open_ends="low"),
    NUMBERS,
    ("0.5", "989", "1e-3"),
)
NON_NEGATIVE = Kind(
    "non-negative",
    "use a finite number, 0 or more",
    lambda text: _real(text, 0.0),
    ("-1", "nan", "inf", "x"),
    ("0", "0.7"),
)
PROBABILITY = Kind(
    "probability",
    "use a number above 0 and at most 1",
    lambda text: _real(text, 0.0, 1.0, open_ends="low"),
    ("0", "-0.5", "1.5", "nan", "x"),
    ("1", "0.9"),
)
SHARE = Kind(
    "share",
    "use a number from 0 up to (not including) 1",
    lambda text: _real(text, 0.0, 1.0, open_ends="high"),
    ("-0.1", "1", "nan", "x"),
    ("0", "0.25"),
)
PORT = Kind(
    "port",
    "use a TCP port, 1-65535",
    lambda text: _whole(text, 1, 65535),
    ("0", "65536", "-1", "x"),
    ("1", "8265", "65535"),
)
WINDOW = Kind(
    "window",
    "use a whole number of at least 2 tokens",
    lambda text: _whole(text, 2),
    ("1", "0", "-1", "x"),
    ("2", "128"),
)
RETRIES = Kind(
    "retries",
    "use a number of restarts, 0 or more, or -1 for no limit",
    lambda text: _whole(text, -1),
    ("-2", "1.5", "x"),
    ("-1", "0", "3"),
)
VOCABULARY = Kind(
    "vocabulary",
    f"use a vocabulary size from {MIN_VOCAB} to {MAX_VOCAB:,}",
    lambda text: _whole(text, MIN_VOCAB, MAX_VOCAB),
    (str(MIN_VOCAB - 1), "0", str(MAX_VOCAB + 1), "x"),
    ("259", "151936"),
)
ZERO_STAGE = Kind(
    "zero stage",
    "use a ZeRO stage: 0, 1, 2 or 3",
    lambda text: _whole(text, 0, 3),
    ("4", "-1", "x"),
    ("0", "3"),
)
JOBS_API = Kind(
    "jobs api",
    "give the Ray Jobs API's URL, http://HOST:PORT (the dashboard's, e.g. http://127.0.0.1:8265), a "
    "ray://HOST:PORT or auto",
    _jobs_api,
    ("127.0.0.1:8265", "http://", "http://h:99999", "http://h:0", "ftp://h:1"),
    ("http://127.0.0.1:8265", "https://ray.example.com", "ray://head:10001", "auto"),
)
TEXT = Kind("text", "give some text", _nonempty, ("", "   "), ("x", "héllo wörld"))
# Ray names a job's log files and records by it: no `/`, no space (such a job stays PENDING for good).
# A run's name is a directory under the storage path and its MLflow run name: one path component.
RUN_NAME = Kind(
    "run name",
    "use letters, digits and . _ - = , + (one directory name, starting with a letter or digit)",
    lambda text: _matching(text, r"[A-Za-z0-9][A-Za-z0-9_.=,+-]{0,199}"),
    ("", "a/b", "../up", "has space", ".hidden"),
    ("pretrain-7", "lr=0.003-seed0"),
)
SUBMISSION_ID = Kind(
    "submission id",
    "use letters, digits, '-', '_' and '.', starting with a letter or digit",
    lambda text: _matching(text, r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"),
    ("", "a/b", "has space", "-x", "../up"),
    ("pretrain-7", "run_2026.12"),
)
VARIABLE = Kind(
    "variable",
    "write NAME=VALUE, NAME of letters, digits and _, e.g. MHF_STORAGE=/shared/mhf",
    _variable,
    ("MHF_STORAGE", "=5", "", "A B=x", "1A=x"),
    ("MHF_STORAGE=/x", "A="),
)
ASSIGNMENT = Kind(
    "assignment",
    "write KEY=VALUE, e.g. train.steps=50",
    _assignment,
    ("steps", "=5", ""),
    ("train.steps=5", "data.corpus=a=b"),
)
SIZE = Kind(
    "size", "write a size in bytes or such as 500MB", _size, ("0", "-5", "5XB", ""), ("500MB", "1000")
)
TOO_LONG = "/tmp/" + "n" * 300  # a path component over every common filesystem's 255 bytes
FILE = Kind(
    "file",
    "give an existing file",
    lambda text: _existing(text, "file"),
    ("", TOO_LONG),
    ("s3://bucket/file.yaml",),
)
DIRECTORY = Kind(
    "directory",
    "give an existing directory",
    lambda text: _existing(text, "directory"),
    ("", TOO_LONG),
    ("s3://bucket/model",),
)
FILE_OR_DIRECTORY = Kind(
    "file or directory",
    "give an existing path",
    lambda text: _existing(text, None),
    ("", TOO_LONG),
    ("s3://bucket/x",),
)
CORPUS = Kind(
    "corpus",
    "give builtin, recall, hf:NAME, dataset:package.module:function, a glob or an existing path",
    _corpus,
    ("", "hf:", "dataset:", "dataset:module", "dataset:a b:f"),
    (
        "builtin",
        "recall",
        "hf:wikitext",
        "dataset:corpora.wiki:load",
        "s3://bucket/*.jsonl.gz",
        "texts/*.jsonl",
    ),
)
OUTPUT_DIRECTORY = Kind(
    "output directory",
    "give a directory to write to",
    _output,
    ("", "/proc/x/out", TOO_LONG),
    ("s3://bucket/out",),
)
# Where a command finds what it reads (an MLflow store, a cluster's state) and writes what it makes.
PLACE = Kind("place", "give a directory", _place, ("", TOO_LONG), ("s3://bucket/store",))
# A file, directory or name the command resolves itself (a preset name or a YAML file; a run name or a
# checkpoint directory): existence is checked where the name is looked up.
NAME_OR_PATH = Kind("name or path", "give a name or a path", _nonempty, ("",), ("tiny", "my-run"))


class Distinct(argparse.Action):
    """The values of a repeatable flag (`action="append"`) or of one flag (`nargs="+"`), none given
    twice: a value repeated would only do the same work again."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        before = getattr(namespace, self.dest)
        given_before = before is not None and before is not self.default
        if isinstance(values, list):  # nargs: the flag's values all at once
            if given_before:
                parser.error(f"argument {option_string} is given twice; give all its values after one")
            chosen = list(values)
        else:
            chosen = [*(before if given_before else []), values]
        seen = [self.identity(value) for value in chosen]
        repeated = next((value for at, value in enumerate(seen) if value in seen[:at]), None)
        if repeated is not None:
            parser.error(f"argument {option_string}: {repeated} is given twice; give each {self.unit} once")
        setattr(namespace, self.dest, chosen)

    unit = "value"

    def identity(self, value: Any) -> Any:
        """What must differ between two values."""
        return value


class DistinctKeys(Distinct):
    """`KEY=VALUE` values (`--set`, `--env`), no KEY given twice: which of the two would be meant?"""

    unit = "key"

    def identity(self, value: Any) -> Any:
        return value.partition("=")[0].strip()


class MhfParser(argparse.ArgumentParser):
    """argparse with its errors as one line: `error: mhf train: <what>; see mhf train --help`.
    `commands` holds the sub-commands' parsers by name, once `add_commands` made them."""

    commands: dict[str, argparse.ArgumentParser]

    def add_commands(self, **kwargs: Any) -> argparse._SubParsersAction:
        action = self.add_subparsers(**kwargs)
        self.commands = action.choices
        return action

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)
