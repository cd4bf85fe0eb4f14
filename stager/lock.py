"""One writer per destination: a second `stage` on the same hub refuses instead of interleaving."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from stager.atomic import ensure_real_dir, open_for_write
from stager.errors import CannotRun

# Every writer lock this tool takes, by what it guards. operations.md lists them for operators, and
# the audit reads /proc/locks for them; a command that writes into a place takes that place's lock.
HUB_LOCK = ".locks/stager.lock"  # in a node hub; huggingface_hub's scanner skips .locks/
ENGRAM_LOCK = ".locks/engram.lock"  # in an engram_dir: pack-engram, and archive when it rewrites its records
ARCHIVE_LOCK = ".stage-archive.lock"  # in an archive DEST


@contextlib.contextmanager
def writer_lock(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` for the duration, or exit 3 at once.

    flock is released by the kernel when the holder dies (even by kill -9), so a
    stale lock file never blocks the next run. The holder's pid is written for the
    message. Refusing beats waiting: cron and launchers retry, and a waiting
    second run would only re-copy what the first one is copying.
    """
    ensure_real_dir(lock_path.parent)
    # Never through a link: a symlink planted at the lock's name once had root truncate its target.
    fd = open_for_write(lock_path, os.O_RDWR | os.O_CREAT)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        # A hard link planted at the name would have its other name truncated below.
        os.close(fd)
        raise CannotRun(f"lock file {lock_path} is not a regular file of its own (links: {st.st_nlink})")
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
