"""One writer per destination: a second `stage` on the same hub refuses instead of interleaving.

`writer_lock` takes a place's lock; `LockTable` tells who holds one without taking it (the audit,
and a verify that runs while a mirror writes)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stager.base.atomic import ensure_real_dir, open_for_write
from stager.base.errors import CannotRun

# Every writer lock this tool takes, by what it guards. operations.md lists them for operators, and
# the audit reads /proc/locks for them; a command that writes into a place takes that place's lock.
HUB_LOCK = ".locks/stager.lock"  # in a node hub; huggingface_hub's scanner skips .locks/
ENGRAM_LOCK = ".locks/engram.lock"  # in an engram_dir: pack-engram, and archive when it rewrites its records
ARCHIVE_LOCK = ".stage-archive.lock"  # in an archive DEST
PROC_LOCKS = "/proc/locks"


@contextlib.contextmanager
def writer_lock(lock_path: Path, what: str, *, wait: float = 0) -> Iterator[bool]:
    """Hold an exclusive flock on `lock_path` for the duration, or exit 3; yields whether it had
    to wait for another holder.

    flock is released by the kernel when the holder dies (even by kill -9), so a
    stale lock file never blocks the next run. A refusal names the holder from the kernel's
    lock table (LockTable), never from the file: a pid written there outlives its writer, and a
    refused mirror once named a dead pid while another process held the lock. By default a
    held lock is refused at once: cron retries, and a waiting
    second run would only re-copy what the first one is copying. `wait` seconds of
    patience are for a caller that must have the node ready before it goes on (a Slurm
    prolog while cron's mirror runs).
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
            waited = _take(fd, wait)
        except BlockingIOError:
            after = f" after {wait:g} s" if wait else ""
            # The open descriptor's inode: the file this run tried, whatever is at the name now.
            state, pid = LockTable.read().state_of(os.fstat(fd))
            raise CannotRun(f"{what} {describe_holder(state, pid)}{after}; lock file {lock_path}") from None
        yield waited
    finally:
        os.close(fd)


def _take(fd: int, wait: float) -> bool:
    """flock(fd), polling for up to `wait` seconds while another process holds it; True if it had
    to wait. BlockingIOError when it is still held at the end."""
    deadline = time.monotonic() + wait
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return waited
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            waited = True
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def describe_holder(state: str, pid: int | None) -> str:
    """How a refusal names who holds a lock (LockTable.state's answer): the pid from the kernel's
    table, or that the table cannot tell."""
    if state == "held":
        return f"is locked by another stage process (pid {pid})"
    if state == "free":  # released between the refused flock and the reading of the table
        return "was locked by another stage process, which released it before it could be named; run again"
    return f"is locked by another process, which {PROC_LOCKS} cannot name here"


@dataclass(frozen=True)
class LockTable:
    """Who holds a flock(2), from the kernel's table /proc/locks: (major, minor, inode) -> pid.

    Reading the table takes no lock. Testing a writer's lock by taking it, even for an instant,
    would make a mirror that starts in that instant refuse with exit 3 ("locked"). Lines look like
    `1: FLOCK  ADVISORY  WRITE 4242 fe:00:2163045 0 EOF` (device numbers in hex); a waiter's line
    has `->` before FLOCK and holds nothing.

    The table is trusted only after it shows a lock of our own: a flock on an anonymous memfd
    (no file is touched) must appear in it, or `readable` is False, as where there is no /proc.
    An emulated /proc (gVisor, some sandboxes) can list no locks at all, which would otherwise
    read as "no writer anywhere". The table lists only holders in the reader's pid namespace, so
    the audit must run where the writers run (on the host, not in a container of its own)."""

    readable: bool
    holders: dict[tuple[int, int, int], int]

    @classmethod
    def read(cls, path: str | None = None) -> "LockTable":
        try:
            probe = os.memfd_create("stage-lock-probe", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return cls(False, {})
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh anonymous file: nobody else can hold it
            mine = os.fstat(probe)
            with open(path or PROC_LOCKS, encoding="ascii", errors="replace") as table:
                text = table.read()
        except OSError:
            return cls(False, {})
        finally:
            os.close(probe)
        holders = {}
        for line in text.splitlines():
            fields = line.split()
            if len(fields) < 6 or fields[1] != "FLOCK":
                continue
            try:
                major, minor, inode = fields[5].split(":")
                holders[(int(major, 16), int(minor, 16), int(inode))] = int(fields[4])
            except ValueError:
                continue
        if holders.pop((os.major(mine.st_dev), os.minor(mine.st_dev), mine.st_ino), None) is None:
            return cls(False, {})
        return cls(True, holders)

    def state(self, lock: Path) -> tuple[str, int | None]:
        """("held", pid), ("free", None), or ("unsure", None) when the table cannot tell."""
        if not self.readable:
            return "unsure", None
        try:
            st = os.lstat(lock)
        except (FileNotFoundError, NotADirectoryError):
            return "free", None  # never created: no writer has run there
        except OSError:
            return "unsure", None
        if not stat.S_ISREG(st.st_mode):
            return "free", None  # lock.writer_lock refuses a lock file that is not a regular file
        return self.state_of(st)

    def state_of(self, st: os.stat_result) -> tuple[str, int | None]:
        """`state` for the file `st` describes (an open descriptor's fstat)."""
        if not self.readable:
            return "unsure", None
        pid = self.holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        if pid is not None:
            return "held", pid
        # Same inode, other device: btrfs subvolumes and overlayfs report a device in stat() that
        # differs from the one in the lock table. It is probably our lock, so the writer may be live.
        if any(inode == st.st_ino for _major, _minor, inode in self.holders):
            return "unsure", None
        return "free", None
