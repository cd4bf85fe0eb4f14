"""The source layer's common ground: what a source hub looks like to the rest of the tool.

A source (the NAS, or a peer) is addressed by hub-relative paths and offers no way to
write: the NAS is read-only to this tool by construction, not by discipline. `local.py`
serves paths (local disks, NFS, sshfs), `sftp.py` serves `sftp://` peers; both build on
this module only, and `stager.sources.open_source` picks one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from typing import Protocol

from stager.base.errors import CannotRun


@dataclass(frozen=True)
class Stat:
    kind: str  # "file", "dir", "link" or "other" (FIFO, socket, device)
    size: int
    mtime_ns: int
    mode: int


def stat_from_os(st: os.stat_result) -> Stat:
    return stat_from_mode(st.st_mode, st.st_size, st.st_mtime_ns)


def stat_from_mode(mode: int, size: int, mtime_ns: int) -> Stat:
    if stat.S_ISLNK(mode):
        kind = "link"
    elif stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISDIR(mode):
        kind = "dir"
    else:
        kind = "other"
    return Stat(kind, size, mtime_ns, mode)


# How a network mount (NFS, sshfs, SMB) says that its server is gone, as opposed to one bad file.
# Every later read would fail the same way, so the run stops with exit 3 instead of reporting
# each remaining entry as unreadable.
LOST_MOUNT_ERRNOS = frozenset({errno.ESTALE, errno.ENOTCONN, errno.ECONNABORTED, errno.ECONNRESET, errno.EHOSTDOWN,
                               errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT})


@contextlib.contextmanager
def reaching(path: str):
    """Turn a lost network mount under `path` into CannotRun; other errors pass through."""
    try:
        yield
    except OSError as exc:
        if exc.errno in LOST_MOUNT_ERRNOS:
            raise CannotRun(f"NAS unreachable: {path}: {exc.strerror}") from None
        raise


class Reader(Protocol):
    size: int

    def pread(self, length: int, offset: int) -> bytes: ...

    def readinto(self, buffer: memoryview) -> int: ...

    def readinto_at(self, buffer: memoryview, offset: int) -> int: ...

    def state(self) -> tuple[int, ...]: ...

    def close(self) -> None: ...


class Source(Protocol):
    """A hub tree that can be listed and read, never written."""

    url: str  # how reports name this source

    def display(self, rel: str) -> str: ...

    def lstat(self, rel: str) -> Stat | None: ...

    def readlink(self, rel: str) -> str: ...

    def listdir(self, rel: str) -> list[str]: ...

    def read_small(self, rel: str, limit: int) -> bytes: ...

    def canonical_dir(self, rel_dir: str) -> str | None:
        """The hub-relative real path of a directory (following symlinks), None if it leaves the hub."""

    def absolute_to_rel(self, target: str) -> str | None:
        """Map an absolute link target written on the NAS to a hub-relative path, None if outside."""

    def open(self, rel: str, *, uncached: bool, sequential: bool = False) -> Reader: ...


def absolute_to_rel(target: str, aliases: dict[str, str], roots: list[str]) -> str | None:
    """An absolute link target as a hub-relative path: the longest matching alias prefix is
    replaced by its mapping first, then the result must lie under one of the hub's `roots`."""
    target = os.path.normpath(target)
    for prefix, mapped in sorted(aliases.items(), key=lambda item: len(item[0]), reverse=True):
        prefix = os.path.normpath(prefix)
        if target == prefix or target.startswith(prefix + "/"):
            target = os.path.normpath(mapped + target[len(prefix):])
            break
    for root in roots:
        rel = relative_inside(target, root)
        if rel is not None:
            return rel
    return None


def relative_inside(path: str, root: str) -> str | None:
    if path == root:
        return ""
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1:]
    return None
