"""One writer per destination: a second `stage` on the same hub refuses instead of interleaving."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from stager.errors import CannotRun


@contextlib.contextmanager
def writer_lock(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` for the duration, or exit 3 at once.

    flock is released by the kernel when the holder dies (even by kill -9), so a
    stale lock file never blocks the next run. The holder's pid is written for the
    message. Refusing beats waiting: cron and launchers retry, and a waiting
    second run would only re-copy what the first one is copying.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise CannotRun(f"{what} is locked by another stage process (pid {holder}); lock file {lock_path}") from None
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            # The pid only names the holder in a refusal. A full disk must not stop a run that may
            # have nothing to write; one that does gets the preflight's figures instead.
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        yield
    finally:
        os.close(fd)
