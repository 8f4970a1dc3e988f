"""User-facing errors: each carries one line that names the problem and the fix.

The CLI prints them as `error: <message>` and exits non-zero; library callers catch `MhfError`.
"""


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


class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM; its one line says where it stopped and how to go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
