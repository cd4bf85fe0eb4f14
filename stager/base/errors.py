"""Exit codes and the two exceptions that end a command early.

Problems found in the data (a dangling link, a mismatching blob) are *not*
exceptions: they are collected as `Problem` values and reported together, so one
bad entry never stops the rest of a node from staging.  Exceptions are for the
cases where the command itself cannot go on.
"""

from __future__ import annotations

import errno
import os

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


def ending(exc: Exception) -> tuple[int, str]:
    """The exit code and the one-line message of an exception that ends a command: a StageError's
    own, an OSError nobody mapped as CannotRun naming its path, anything else as an internal error
    (the contract is one line, never a traceback)."""
    if isinstance(exc, StageError):
        return exc.exit_code, exc.message
    if isinstance(exc, OSError):
        return EXIT_CANNOT_RUN, describe_os_error(exc)
    return EXIT_CANNOT_RUN, f"internal error: {type(exc).__name__}: {exc} (set STAGE_DEBUG=1 for the traceback)"


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError nobody mapped: what failed, on which path, and who needs access."""
    path = exc.filename if exc.filename is not None else exc.filename2
    if exc.errno == errno.EROFS:
        return f"read-only file system: {path}: remount it read-write, or stage onto another filesystem"
    if exc.errno in (errno.EACCES, errno.EPERM) and path is not None:
        path = os.fspath(path)
        # Creating a file fails on the file's name; the directory is what needs the access.
        target, need = (path, "access to") if os.path.lexists(path) else (os.path.dirname(path) or ".", "write access to")
        return (f"permission denied: {target}{_ownership(target)}: stage runs as user {_user()}, "
                f"which needs {need} it; run stage as a user who has it, or grant {_user()} access")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: stage runs as user {_user()}"
    reason = exc.strerror or str(exc)
    return f"{reason}: {path}" if path is not None else reason


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _ownership(path: str) -> str:
    import grp
    import pwd
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return ""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f" (owner {owner}:{group}, mode {stat.filemode(st.st_mode)})"
