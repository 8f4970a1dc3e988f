"""User-facing errors: each carries one line that names the problem and the fix.

The CLI prints them as `error: <message>` and exits non-zero; library callers catch `MhfError`.
"""

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
    """A run stopped by SIGINT or SIGTERM; its one line says where it stopped and how to go on. Not an
    `Exception`, for the reason KeyboardInterrupt is not one: code that catches `Exception` (ours around a
    library that raises bare ones, a library's own) must not take a SIGTERM for its error and go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def first_problem(err: ValidationError) -> tuple[str, str]:
    """Where pydantic's validation first failed (dotted keys; "" for a check of the whole model) and its
    message, without pydantic's "Value error, " prefix: one problem, as a one-line error names it."""
    problem = err.errors()[0]
    where = ".".join(str(part) for part in problem["loc"])
    return where, " ".join(problem["msg"].removeprefix("Value error, ").split())


def problem_line(err: ValidationError) -> str:
    """`first_problem` as the words of a one-line error: "key: message", or the message of a whole-model
    check (which names its keys itself)."""
    where, message = first_problem(err)
    return f"{where}: {message}" if where else message
