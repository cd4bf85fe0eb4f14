"""A source hub on a path: a local disk, an NFS or sshfs mount, a bind mount."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from pathlib import Path

from stager.base import identity
from stager.base.errors import CannotRun
from stager.base.small_files import open_keeping_atime, read_regular_head
from stager.sources.base import Stat, absolute_to_rel, reaching, relative_inside, stat_from_os


DIRECT_ALIGN = 4096


class LocalReader:
    """Positioned reads on a local or NFS file. `uncached` drops the client's page cache
    first, so a stale NFS client cache cannot answer for the server's bytes.

    `direct` also opens the file with O_DIRECT, which `readinto` and `readinto_at` use for the
    whole blocks of a read from a block-aligned offset (callers pass page-aligned buffers, see
    aligned_buffer): the disk, the NFS server or the FUSE daemon (sshfs) fills the buffer itself,
    which saves the page cache's copy and its reclaim, a third of `--full`'s CPU and most of the
    default mirror's. A last partial block, reads from unaligned offsets, and filesystems
    without O_DIRECT (ramfs, tmpfs on older kernels, some FUSE) go through the page cache.

    `keep_atime` (the default: a read of this tool's own, a node's file checked or packed) leaves
    the file's access time as it was where the kernel allows it (small_files.open_keeping_atime);
    a source's files are read with it off (LocalSource)."""

    def __init__(self, path: str, *, uncached: bool, sequential: bool = False, direct: bool = False,
                 keep_atime: bool = True):
        self.path = path
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        with reaching(path):
            # Non-blocking: a FIFO put at the name since the walk's lstat would block a plain open.
            self.fd = open_keeping_atime(path, flags) if keep_atime else os.open(path, flags)
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(self.fd, True)
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

    @property
    def direct(self) -> bool:
        """True while block-aligned reads still go around the page cache."""
        return self._direct >= 0

    def readinto(self, buffer: memoryview) -> int:
        got = self.readinto_at(buffer, self._pos)
        self._pos += got
        return got

    def readinto_at(self, buffer: memoryview, offset: int) -> int:
        """One positioned read into `buffer`; how many bytes it got (fewer at the end of the file).

        From a block-aligned offset, the buffer's whole blocks are read direct and only a last
        partial block (a file's final bytes) through the page cache: reading a file's last piece
        buffered whole put up to 8 MiB per file through the page cache."""
        aligned = len(buffer) - len(buffer) % DIRECT_ALIGN if offset % DIRECT_ALIGN == 0 else 0
        if self._direct < 0 or not aligned:
            return self._preadv(self.fd, buffer, offset)
        try:
            got = self._preadv(self._direct, buffer[:aligned], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._close_direct()  # a buffer the device refuses: the page cache from here on
            return self._preadv(self.fd, buffer, offset)
        if got < aligned or aligned == len(buffer):
            return got
        return got + self._preadv(self.fd, buffer[aligned:], offset + aligned)

    def _preadv(self, fd: int, buffer: memoryview, offset: int) -> int:
        with reaching(self.path):
            return os.preadv(fd, [buffer], offset)

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


HUGE_PAGE = 2 * 1024 * 1024


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, writable buffer (anonymous memory), as O_DIRECT needs.

    Buffers of a huge page or more ask for transparent huge pages: an O_DIRECT request from
    physically contiguous memory goes to the disk in fewer, larger pieces. An 8 MiB direct copy
    of 168 MB here took 0.45-0.52 s with them and 0.70-0.85 s without, at the same CPU."""
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which is shmem, whose page
    # lookups (shmem_get_folio) and pinning were the largest kernel cost of a direct copy.
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out or disabled: ordinary pages, as before
            pass
    return buffer


def reopen_direct(fd: int, flags: int) -> int:
    """A second descriptor on the same open file with O_DIRECT, or -1 where the filesystem has
    none. Reopened through /proc, so it is the very inode already checked, never a new lookup;
    with the first one's O_NOATIME, so that reading through it keeps the atime too."""
    flags |= fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NOATIME
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


class LocalSource:
    """A hub on a local or NFS-mounted path.

    Reading a source's file is a use of it (`keep_atime` off): a node staging or checking a model
    is a node that needs it, which is what a NAS-side cleanup by last access must see (an NFS
    server keeps its own atimes anyway). A node's own hub read as a source (pack-engram's
    checkpoint) passes `keep_atime=True`: the tool reading it is not a process using the model."""

    def __init__(self, hub: str, aliases: dict[str, str] | None = None, *, keep_atime: bool = False):
        self.url = hub
        self.keep_atime = keep_atime
        self.root = Path(hub)
        self.aliases = dict(aliases or {})
        try:
            is_dir = stat.S_ISDIR(os.stat(hub).st_mode)
        except OSError as exc:
            raise CannotRun(f"NAS hub {hub} is not reachable: {exc.strerror}") from None
        if not is_dir:
            raise CannotRun(f"NAS hub {hub} is not reachable (not a directory)")
        # Absolute links may name the hub by its configured path or by its real path.
        self._prefixes = sorted({os.path.normpath(hub), identity.resolved(hub)}, key=len, reverse=True)
        self._real_root = identity.resolved(hub)
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
        # Links followed: a snapshot's index or config is a link to its blob. A FIFO named
        # `*.safetensors.index.json` on the NAS hung mirror and verify in a blocking open.
        with reaching(self.path(rel)):
            return read_regular_head(self.path(rel), limit, follow=True)

    def canonical_dir(self, rel_dir: str) -> str | None:
        # Once per directory and run: realpath lstats every component, and a walk asks for the
        # same few blob directories once per entry (a third of walking 1,000 small files).
        if rel_dir not in self._canonical:
            self._canonical[rel_dir] = relative_inside(identity.resolved(self.path(rel_dir)), self._real_root)
        return self._canonical[rel_dir]

    def absolute_to_rel(self, target: str) -> str | None:
        return absolute_to_rel(target, self.aliases, self._prefixes)

    def open(self, rel: str, *, uncached: bool, sequential: bool = False) -> LocalReader:
        # Sequential reads are whole-file copies and whole-span passes (an Engram table): straight
        # into the caller's page-aligned buffers.
        return LocalReader(self.path(rel), uncached=uncached, sequential=sequential, direct=sequential,
                           keep_atime=self.keep_atime)
