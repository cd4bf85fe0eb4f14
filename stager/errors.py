"""Exit codes and the two exceptions that end a command early.

Problems found in the data (a dangling link, a mismatching blob) are *not*
exceptions: they are collected as `Problem` values and reported together, so one
bad entry never stops the rest of a node from staging.  Exceptions are for the
cases where the command itself cannot go on.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEMS = 1  # ran to the end, found problems (named in the report)
EXIT_BAD_INPUT = 2  # bad manifest, bad arguments, malformed input files
EXIT_CANNOT_RUN = 3  # not enough space, lock held, NAS unreachable, disk full


class StageError(Exception):
    """An error that ends the command with a one-line message and an exit code."""

    exit_code = EXIT_CANNOT_RUN

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadInput(StageError):
    """The input is unusable: manifest, arguments, or a malformed source file."""

    exit_code = EXIT_BAD_INPUT


class CannotRun(StageError):
    """The environment prevents the command from running: space, lock, unreachable NAS."""

    exit_code = EXIT_CANNOT_RUN
