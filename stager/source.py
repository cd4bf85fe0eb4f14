"""Read-only access to a source hub (the NAS, or a peer), addressed by hub-relative paths.

Everything that reads the NAS goes through a `Source`, which offers no way to
write: the NAS is read-only to this tool by construction, not by discipline.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stager.errors import CannotRun


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


DIRECT_ALIGN = 4096


class LocalReader:
    """Positioned reads on a local or NFS file. `uncached` drops the client's page cache
    first, so a stale NFS client cache cannot answer for the server's bytes.

    `direct` also opens the file with O_DIRECT, which sequential `readinto` calls use when
    offset and length are block-aligned (callers pass page-aligned buffers, see
    copier.aligned_buffer): the disk or the NFS server fills the buffer itself, which saves
    the page cache's copy and its reclaim, a third of `--full`'s CPU. Anything unaligned, and
    filesystems without O_DIRECT (tmpfs, some FUSE), read through the page cache as before."""

    def __init__(self, path: str, *, uncached: bool, sequential: bool = False, direct: bool = False):
        self.path = path
        with reaching(path):
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a regular file", path)
        self.size = st.st_size
        self._pos = 0
        self._direct = reopen_direct(self.fd, os.O_RDONLY) if direct else -1
        if uncached:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if sequential:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def pread(self, length: int, offset: int) -> bytes:
        chunks = []
        while length > 0:
            with reaching(self.path):
                data = os.pread(self.fd, length, offset)
            if not data:
                break
            chunks.append(data)
            length -= len(data)
            offset += len(data)
        return b"".join(chunks)

    def readinto(self, buffer: memoryview) -> int:
        fd = self.fd
        if self._direct >= 0 and self._pos % DIRECT_ALIGN == 0 and len(buffer) % DIRECT_ALIGN == 0:
            fd = self._direct
        with reaching(self.path):
            try:
                got = os.preadv(fd, [buffer], self._pos)
            except OSError as exc:
                if fd == self.fd or exc.errno != errno.EINVAL:
                    raise
                self._close_direct()  # a buffer the device refuses: the page cache from here on
                got = os.preadv(self.fd, [buffer], self._pos)
        self._pos += got
        return got

    def _close_direct(self) -> None:
        if self._direct >= 0:
            os.close(self._direct)
            self._direct = -1

    def state(self) -> tuple[int, ...]:
        """Size, mtime and ctime now: a copy is kept only if these did not move while it ran."""
        with reaching(self.path):
            st = os.fstat(self.fd)
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def drop_cache(self) -> None:
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._close_direct()
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, writable buffer (anonymous memory), as O_DIRECT needs."""
    return mmap.mmap(-1, size)


def reopen_direct(fd: int, flags: int) -> int:
    """A second descriptor on the same open file with O_DIRECT, or -1 where the filesystem has
    none. Reopened through /proc, so it is the very inode already checked, never a new lookup."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


class LocalSource:
    """A hub on a local or NFS-mounted path."""

    def __init__(self, hub: str, aliases: dict[str, str] | None = None):
        self.url = hub
        self.root = Path(hub)
        self.aliases = dict(aliases or {})
        try:
            is_dir = stat.S_ISDIR(os.stat(hub).st_mode)
        except OSError as exc:
            raise CannotRun(f"NAS hub {hub} is not reachable: {exc.strerror}") from None
        if not is_dir:
            raise CannotRun(f"NAS hub {hub} is not reachable (not a directory)")
        # Absolute links may name the hub by its configured path or by its real path.
        self._prefixes = sorted({os.path.normpath(hub), os.path.realpath(hub)}, key=len, reverse=True)
        self._real_root = os.path.realpath(hub)
        self._canonical: dict[str, str | None] = {}

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else str(self.root)

    def display(self, rel: str) -> str:
        return self.path(rel)

    def lstat(self, rel: str) -> Stat | None:
        try:
            with reaching(self.path(rel)):
                return stat_from_os(os.lstat(self.path(rel)))
        except FileNotFoundError:
            return None

    def readlink(self, rel: str) -> str:
        try:
            with reaching(self.path(rel)):
                return os.readlink(self.path(rel))
        except PermissionError as exc:
            if exc.errno != errno.EPERM:
                raise
            # No local filesystem refuses readlink with EPERM; sshfs does, for every target that is
            # absolute or holds "..", which is every link of a hub cache (its contain_symlinks).
            raise OSError(exc.errno, f"{exc.strerror}: the link cannot be read; an sshfs mount must "
                                     f"be mounted with -o no_contain_symlinks to serve a hub") from None

    def listdir(self, rel: str) -> list[str]:
        with reaching(self.path(rel)):
            return sorted(os.listdir(self.path(rel)))

    def read_small(self, rel: str, limit: int) -> bytes:
        with reaching(self.path(rel)), open(self.path(rel), "rb") as handle:
            return handle.read(limit)

    def canonical_dir(self, rel_dir: str) -> str | None:
        # Once per directory and run: realpath lstats every component, and a walk asks for the
        # same few blob directories once per entry (a third of walking 1,000 small files).
        if rel_dir not in self._canonical:
            self._canonical[rel_dir] = relative_inside(os.path.realpath(self.path(rel_dir)), self._real_root)
        return self._canonical[rel_dir]

    def absolute_to_rel(self, target: str) -> str | None:
        return absolute_to_rel(target, self.aliases, self._prefixes)

    def open(self, rel: str, *, uncached: bool, sequential: bool = False) -> LocalReader:
        # Sequential reads of a source are whole-file copies: straight into the copier's buffers.
        return LocalReader(self.path(rel), uncached=uncached, sequential=sequential, direct=sequential)


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


def open_source(hub: str, aliases: dict[str, str]) -> Source:
    """A Source for a path or URL. sftp:// sources need the optional paramiko dependency."""
    if "://" in hub and not hub.startswith("file://"):
        from stager.remote import open_remote_source

        return open_remote_source(hub, aliases)
    return LocalSource(hub.removeprefix("file://"), aliases)
