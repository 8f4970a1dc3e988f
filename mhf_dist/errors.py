"""User-facing errors, each one line naming the problem and the fix (the CLI prints `error: <message>`;
an `Interrupted` it prints as `interrupted: <message>`, exit 128 + the signal)."""

from __future__ import annotations

import reprlib
import shlex
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class MhfError(Exception):
    """A mistake in the user's input, reported as one line without a traceback."""


class ConfigError(MhfError):
    """An unknown preset, a malformed YAML file, a bad `--set` override or an invalid value."""


class SignatureError(MhfError):
    """A signature table that cannot be built, loaded, expanded or indexed as asked."""


class DataError(MhfError):
    """A corpus, tokenizer or shard that cannot be used as given."""


class TrainingError(MhfError):
    """A run that cannot go on: a non-finite loss, a checkpoint that does not fit the run."""


class ModelOutputError(MhfError):
    """A model whose outputs hold nan or inf: a diverged or damaged checkpoint."""


class Interrupted(BaseException):
    """A run stopped by SIGINT or SIGTERM; its line says how to go on. Not an `Exception`, like
    KeyboardInterrupt: code that catches `Exception` must not take a SIGTERM for its error and go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Resumable(Interrupted):
    """Stopped work that the same command line, `flag` added ("": none), goes on with; the CLI prints
    that command after `lead`."""

    def __init__(self, message: str, exit_code: int, flag: str, lead: str = "go on with") -> None:
        super().__init__(message, exit_code)
        self.flag = flag
        self.lead = lead


def stopped(sig: int, what: str = "rerun the command to start again") -> Interrupted:
    return Interrupted(f"{signal.Signals(sig).name}; {what}", 128 + sig)


@contextmanager
def advising(what: str) -> Iterator[None]:
    """An interrupt of the block says `what` to do next in place of its own advice."""
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as err:
        raise stopped(err.exit_code - 128 if isinstance(err, Interrupted) else signal.SIGINT, what) from None


def as_interrupted(err: BaseException) -> Interrupted | None:
    """`err` as the interrupt the CLI reports, also one that `err` was raised while handling (a library's
    clean-up that failed as the interrupt unwound through it); None if it is no interrupt."""
    for cause in chain(err):
        if isinstance(cause, Interrupted):
            return cause
        if isinstance(cause, KeyboardInterrupt):
            return stopped(signal.SIGINT)
    return None


def chain(err: BaseException) -> list[BaseException]:
    """`err`, the error it was raised from or while handling, that one's, and so on (each once)."""
    found: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and all(cause is not seen for seen in found):
        found.append(cause)
        cause = cause.__cause__ or cause.__context__
    return found


def console_line(stop: BaseException, argv: Sequence[str]) -> str:
    """What the CLI prints after `interrupted: ` or `error: `; one with a `flag` to go on with (a
    `Resumable`, a sweep's failed trials) names the whole command that goes on."""
    if getattr(stop, "flag", None) is None:
        return str(stop)
    words = ["mhf", *argv, stop.flag] if stop.flag and stop.flag not in argv else ["mhf", *argv]
    return f"{stop}; {stop.lead}: {shlex.join(words)}"


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, or its type's name where it has none: for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def first_problem(err: ValidationError) -> tuple[str, str]:
    """Where pydantic's validation first failed (dotted keys; "" for the whole model) and its message."""
    problem = err.errors()[0]
    where = ".".join(str(part) for part in problem["loc"])
    if problem["type"] == "model_type":  # pydantic's words name the class: a section is a mapping
        return where, "Input should be a mapping of its keys"
    return where, " ".join(problem["msg"].removeprefix("Value error, ").split())


def refused_value(err: ValidationError) -> str:
    """` (got VALUE)`: the key's value pydantic first refused; "" for a whole model's or mapping's."""
    problem = err.errors()[0]
    value = problem.get("input")
    if problem["type"] == "string_type" and value is None:  # `--set data.path=`
        return " (got null, as YAML reads an empty value; give one)"
    if problem["type"] == "string_type" and isinstance(value, dict | list | bool | int | float):  # `010`
        kind = {dict: "mapping", list: "list", bool: "boolean"}.get(type(value), "number")
        shown = "" if isinstance(value, dict | list) else f" {value!r},"
        return f" (got{shown} a {kind}: quote it in YAML to keep it text)"
    return f" (got {reprlib.repr(value)})" if problem["loc"] and not isinstance(value, dict) else ""


def problem_line(err: ValidationError) -> str:
    """`first_problem` as "key: message", or a whole-model check's message (which names its keys)."""
    where, message = first_problem(err)
    return f"{where}: {message}" if where else message
