"""The kinds of value a command-line argument takes (every one has a `Kind` as its `type`, or
tests/test_contract.py fails), each read where argparse reads it or refused in one `error:` line before any
work, as `MhfParser` refuses argparse's own mistakes. Local paths are checked; bucket URIs pass as they are.
"""

from __future__ import annotations

import argparse
import glob
import reprlib
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, NoReturn

from pydantic import Field, TypeAdapter
from pydantic.fields import FieldInfo

from mhf_dist.config import (
    DATASET_PREFIX,
    DIRECTORY_NAME,
    DIRECTORY_NAME_RULE,
    MAX_SEED,
    MAX_VOCAB,
    MIN_VOCAB,
    check_corpus,
    parse_override,
)
from mhf_dist.errors import MhfError
from mhf_dist.sizes import byte_size
from mhf_dist.storage import check_trimmed, is_uri, local_path, path_text, unwritable


@dataclass(frozen=True, eq=False)
class Kind:
    """`parse` reads the text or raises `ValueError`; `takes`: what is allowed, for the error line; `bad`
    and `good`: texts the contract test feeds it."""

    takes: str
    parse: Callable[[str], Any]
    bad: tuple[str, ...] = ()
    good: tuple[str, ...] = ()

    def __call__(self, text: str) -> Any:
        try:
            text.encode("utf-8")  # bytes that are not UTF-8 reach Python as surrogate escapes
            return self.parse(text)
        except UnicodeEncodeError:
            _fail(f"{text.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8 text; give it as UTF-8")
        except (ValueError, MhfError) as err:  # pydantic's ValidationError; the library's own check's line
            _fail(str(err) if isinstance(err, MhfError) else f"{text!r}: {self.takes}")
        except OverflowError:  # an integer no float holds, in pydantic's finiteness check
            _fail(f"{reprlib.repr(text)}: a {len(text)}-digit number; {self.takes}")


def _fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message) from None


BOUNDS = ("ge", "gt", "le", "lt")


def number(takes: str, kind: type = int, **bounds: float) -> Kind:
    """A whole or finite number within pydantic's `bounds`; bad texts: just outside each bound, not one."""
    adapter = TypeAdapter(Annotated[kind, Field(allow_inf_nan=False, **bounds)])
    step = 1 if kind is int else 0.5
    outside, inside = {"ge": -1, "gt": 0, "le": 1, "lt": 0}, {"ge": 0, "gt": step, "le": 0, "lt": -step}
    bad = [str(value + outside[bound]) for bound, value in bounds.items()]
    bad += ["x", "", *(["1.5", "9" * 400] if kind is int else ["nan", "inf", "1e400"])]
    good = [str(value + inside[bound]) for bound, value in bounds.items()] or ["-2", "0", "3"]
    return Kind(takes, lambda text: adapter.validate_python(kind(text)), tuple(bad), tuple(good))


def bounded_as(field: FieldInfo, takes: str) -> Kind:
    """A config key's flag's number kind, within the field's bounds: one rule for both."""
    bounds = {name: getattr(rule, name) for rule in field.metadata for name in BOUNDS if hasattr(rule, name)}
    return number(takes, field.annotation, **bounds)


def matching(takes: str, pattern: str) -> Kind:
    """Text in which pydantic finds the regular expression `pattern` (anchor it with ^ and $)."""
    return Kind(takes, TypeAdapter(Annotated[str, Field(pattern=pattern)]).validate_strings)


def _jobs_api(text: str) -> str:
    """An http(s):// or ray:// URL with a host, or `auto`: Ray's job client would take a bare HOST:PORT
    for a GCS address and wait 30 s for it."""
    url = urllib.parse.urlparse(text := text.strip())  # its port raises ValueError outside 0-65535
    if text != "auto" and (url.scheme not in ("http", "https", "ray") or not url.hostname or url.port == 0):
        raise ValueError(text)
    return text


def _path(text: str, want: str, local: bool = False) -> str:
    """The local path `text` names, if it is an existing "file", "directory" or "file or directory", a
    "place" (a directory, or one that can be created) or an "output" (a place this user may write in);
    a URI as it is, unless the path must be `local`."""
    check_trimmed(text)
    if is_uri(TEXT.parse(text)):
        if local:
            _fail(f"{text!r} is a URI; give a local directory")
        return text
    path = local_path(text)
    try:
        exists = path.exists()
        nearest = next(part for part in (path.absolute(), *path.absolute().parents) if part.exists())
    except OSError as err:  # a name longer than the filesystem allows, say
        _fail(f"{text!r} cannot be used ({err.strerror}); choose another path")
    if not exists and want not in ("place", "output"):
        _fail(f"{text!r} does not exist; give an existing {want}")
    if want == "file" and not path.is_file():
        _fail(f"{text!r} is {'a directory' if path.is_dir() else 'not a file'}; give a file")
    if exists and want not in ("file", "file or directory") and not path.is_dir():
        _fail(f"{text!r} is {'a file' if path.is_file() else 'not a directory'}; give a directory")
    if not exists and not nearest.is_dir():
        _fail(f"{text!r} cannot be created: {str(nearest)!r} is a file; choose a path under a directory")
    if want == "output" and (closed := unwritable(path.absolute())) is not None:
        _fail(f"{text!r} cannot be written: {str(closed)!r} is not writable; choose a writable place")
    return path_text(path)


def _corpus(text: str) -> str:
    """A corpus name, `hf:NAME`, `dataset:module:function`, a glob (checked when read) or a path."""
    from mhf_dist.data.corpus import BUILTIN_NAME
    from mhf_dist.data.recall import CORPUS as RECALL

    if text.startswith(("hf:", DATASET_PREFIX)):
        try:
            return check_corpus(text)
        except ValueError as err:  # its own words, not the kind's list of forms
            _fail(str(err))
    names = (BUILTIN_NAME, RECALL)
    if text in names or glob.has_magic(text):
        return text
    path = _path(text, "file or directory")
    return f"./{path}" if path in names else path  # a folder `./recall`, not the corpus


COUNT = number("use a whole number of at least 1", ge=1)
NATURAL = number("use a whole number, 0 or more", ge=0)
SEED = number("use a whole number from 0 to 2**63 - 1", ge=0, le=MAX_SEED)
INTEGER = number("use a whole number")
POSITIVE = number("use a finite number above 0", float, gt=0)
NON_NEGATIVE = number("use a finite number, 0 or more", float, ge=0)
PROBABILITY = number("use a number above 0 and at most 1", float, gt=0, le=1)
SHARE = number("use a number from 0 up to (not including) 1", float, ge=0, lt=1)
PORT = number("use a TCP port, 1-65535", ge=1, le=65535)
WINDOW = number("use a whole number of at least 2 tokens", ge=2)
RETRIES = number("use a number of restarts, 0 or more, or -1 for no limit", ge=-1)
VOCABULARY = number(f"use a vocabulary size from {MIN_VOCAB} to {MAX_VOCAB:,}", ge=MIN_VOCAB, le=MAX_VOCAB)
TEXT = matching("give some text", r"\S")  # text, not only spaces
# A name or path the command resolves itself, and checks there (a preset or YAML file; a run or checkpoint).
NAME_OR_PATH = Kind("give a name or a path", TEXT.parse)
# A run's name is a directory under the storage path and its MLflow run name: one path component.
RUN_NAME = matching(DIRECTORY_NAME_RULE, DIRECTORY_NAME)
# Ray names a job's log files and records by it: no `/`, no space (such a job stays PENDING for good).
SUBMISSION_ID = matching(
    "use letters, digits, '-', '_' and '.', starting with a letter or digit",
    r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
)
VARIABLE = matching(
    "write NAME=VALUE, NAME of letters, digits and _, e.g. MHF_STORAGE=/shared/mhf", r"^[A-Za-z_]\w*=(?s:.*)$"
)
ASSIGNMENT = Kind("write KEY=VALUE, e.g. train.steps=50", lambda text: parse_override(text) and text)
SIZE = Kind("write a size in bytes or such as 500MB", lambda text: byte_size(text) and text)
JOBS_API = Kind(
    "give the Ray Jobs API's URL, http://HOST:PORT (the dashboard's, e.g. http://127.0.0.1:8265), "
    "a ray://HOST:PORT or auto",
    _jobs_api,
)
FILE = Kind("give an existing file", partial(_path, want="file"))
DIRECTORY = Kind("give an existing directory", partial(_path, want="directory"))
FILE_OR_DIRECTORY = Kind("give an existing path", partial(_path, want="file or directory"))
# Where a command finds what it reads (an MLflow store, a cluster's state) and writes what it makes.
PLACE = Kind("give a directory", partial(_path, want="place"))
OUTPUT_DIRECTORY = Kind("give a directory to write to", partial(_path, want="output"))
LOCAL_PLACE = Kind("give a local directory", partial(_path, want="place", local=True))
CORPUS = Kind(
    "give builtin, recall, hf:NAME, dataset:package.module:function, a glob or an existing path", _corpus
)


class Distinct(argparse.Action):
    """A repeatable flag's values, or one `nargs="+"` flag's, none twice (it would redo the same work)."""

    unit = "value"
    identity = staticmethod(lambda value: value)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest)
        before = [] if before is None or before is self.default else before
        if isinstance(values, list) and before:  # nargs: the flag's values all at once
            parser.error(f"argument {option_string} is given twice; give all its values after one")
        chosen = list(values) if isinstance(values, list) else [*before, values]
        seen = [self.identity(value) for value in chosen]
        for at, value in enumerate(seen):
            if value in seen[:at]:
                parser.error(f"argument {option_string}: {value} is given twice; give each {self.unit} once")
        setattr(namespace, self.dest, chosen)


class DistinctKeys(Distinct):
    """`KEY=VALUE` values, no KEY twice: which of the two would be meant?"""

    unit = "key"
    identity = staticmethod(lambda value: value.partition("=")[0].strip())


class MhfParser(argparse.ArgumentParser):
    """argparse with its errors as one line: `error: mhf train: <what>; see mhf train --help`."""

    commands: dict[str, argparse.ArgumentParser]  # the sub-commands' parsers by name (cli.build_parser)

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)
