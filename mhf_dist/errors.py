"""User-facing errors, each one line naming the problem and the fix (the CLI prints `error: <message>`)."""

from __future__ import annotations

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


def first_problem(err: ValidationError) -> tuple[str, str]:
    """Where pydantic's validation first failed (dotted keys; "" for the whole model) and its message."""
    problem = err.errors()[0]
    where = ".".join(str(part) for part in problem["loc"])
    return where, " ".join(problem["msg"].removeprefix("Value error, ").split())


def problem_line(err: ValidationError) -> str:
    """`first_problem` as "key: message", or a whole-model check's message (which names its keys)."""
    where, message = first_problem(err)
    return f"{where}: {message}" if where else message
