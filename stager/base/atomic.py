"""The one way this tool puts bytes under a final name.

temp file in the target directory -> write -> fsync -> rename over the final
name -> fsync the directory.  A reader (or the serving engine) therefore sees
either the old file or the complete new one, never a prefix: a killed copy
leaves only a temp file, which the next run sweeps.  Locks cannot be trusted on
NFS, renames within one directory can.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stager.base.errors import CannotRun
from stager.base.interrupts import signals_held

TEMP_MARK = ".stage-"
# `.<name>.stage-<8 hex>.tmp`: hidden, and never mistaken for huggingface_hub's `*.incomplete`.
TEMP_PATTERN = re.compile(r"^\..*\.stage-[0-9a-f]{8}\.tmp$")


# Who may use what this tool creates. A file gets the read and write bits of the directory it is
# created in (owner read-write always, never executable); a directory made here gets the mode of
# its parent, setgid and sticky bits included. The umask is not consulted: a hub's own mode says who
# shares it. A group-shared hub (2775) thus stays usable by its group whoever runs the tool and
# whatever their umask (a lock file created 0644 under umask 022 refused the group's second user
# with exit 3 for ever), and a private hub (0700) stays private, even under umask 000.
# huggingface_hub does the same for its store (store_modes.py): directories copy the hub's mode.
def shared_file_mode(directory: Path | str) -> int:
    return 0o600 | (stat.S_IMODE(os.stat(directory).st_mode) & 0o066)


def shared_dir_mode(parent: Path | str) -> int:
    return 0o700 | (stat.S_IMODE(os.stat(parent).st_mode) & (0o777 | stat.S_ISGID | stat.S_ISVTX))


def is_temp_name(name: str) -> bool:
    return bool(TEMP_PATTERN.match(name))


# Temp names only need to be unique within this run (the writer lock keeps other runs out, and
# O_EXCL refuses a clash): a counter from a random start, instead of an urandom call per file.
_temp_numbers = itertools.count(secrets.randbits(32))


def temp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_MARK}{next(_temp_numbers) & 0xFFFFFFFF:08x}.tmp")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raise_if_disk_full(exc: OSError, path: Path) -> None:
    """Turn ENOSPC/EDQUOT into the documented exit 3 with the file named."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise CannotRun(f"no space left on device while writing {path}") from None


@dataclass
class AtomicFile:
    """An open temp file; `fd` is a raw read-write descriptor (copy_file_range, re-reads)."""

    path: Path
    temp: Path
    fd: int

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def pread(self, length: int, offset: int) -> bytes:
        """Read back what was written: the check before the rename reads the temp file."""
        return os.pread(self.fd, length, offset)


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int | None = None, size_hint: int = 0, mtime_ns: int | None = None,
                sync_dir: bool = True, batch: "SyncBatch | None" = None, chmod: int | None = None) -> Iterator[AtomicFile]:
    """Write `path` atomically. The temp file is removed if the body raises.

    `size_hint` preallocates (ENOSPC surfaces before any byte is copied, and the
    extent stays contiguous); `mtime_ns` is applied before the rename so the
    final name never carries a wrong mtime.  `sync_dir=False` leaves the
    directory fsync to a caller that renames many files into one directory and
    fsyncs it once: each fsync is a journal commit, and one per file cost 1,000
    small files about a sixth of their copy time.  With `batch`, the complete
    temp file is handed to the batch, which syncs and renames it (see SyncBatch).
    `chmod` sets an exact mode (no umask) before the rename, e.g. a read-only payload. Without
    `mode` the file gets its directory's sharing (shared_file_mode); with it, `mode` less the umask.
    """
    path = Path(path)
    fd, temp = -1, None
    try:
        with signals_held():  # a signal between the temp's creation and here left it behind
            fd, temp = _create_temp(path, mode)
        if size_hint > 0:
            _preallocate(fd, size_hint)
        handle = AtomicFile(path, temp, fd)
        yield handle
        if batch is None:
            os.fsync(fd)
        # Staged bytes are cold until the engine maps them: keep them from evicting its pages.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if chmod is not None:
            os.fchmod(fd, chmod)
        if mtime_ns is not None:
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        fd, closing = -1, fd  # forgotten first: a signal after the close must not close the number again
        os.close(closing)
        if batch is not None:
            batch.add(temp, path)
            return
        os.replace(temp, path)
        if sync_dir:
            fsync_dir(path.parent)
    except BaseException as exc:
        if temp is not None:
            _discard(fd, temp)
        if isinstance(exc, OSError):
            raise_if_disk_full(exc, path)
        raise


def _create_temp(path: Path, mode: int | None) -> tuple[int, Path]:
    """A new temp file beside `path`, created exclusively. A name already taken (a planted link,
    another writer's file) is left alone and another name tried: deleting it would remove
    something this run did not make."""
    shared = shared_file_mode(path.parent) if mode is None else None
    for _ in range(8):
        temp = temp_path_for(path)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600 if shared is not None else mode)
        except FileExistsError:
            continue
        except OSError as exc:
            raise_if_disk_full(exc, path)
            raise
        if shared is not None:
            os.fchmod(fd, shared)  # exact: open(2)'s mode is cut by the umask
        return fd, temp
    raise CannotRun(f"cannot create a temp file beside {path}: every name tried exists")


class SyncBatch:
    """Many small complete temp files made durable together, then renamed.

    `commit()` runs one `syncfs` on the target filesystem for all their bytes, then
    the renames, then one fsync per directory.  Same guarantee as atomic_file: no
    final name before its bytes are on disk, and a kill leaves only temp files,
    which the next run sweeps.  Why: an fsync per file is a journal commit each,
    and 1,000 small files spent seconds in them where `cp -r && sync` spends one.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)  # any directory on the filesystem the files land on
        self._pending: list[tuple[Path, Path]] = []
        self._lock = threading.Lock()
        # Opened before any file of the batch is written: syncfs reports the filesystem's writeback
        # errors since *this descriptor* was opened, and each file's writeback starts (DONTNEED)
        # before the batch commits. A descriptor opened at commit time missed an error already
        # recorded, and the file would have been renamed.
        self._fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, temp: Path, path: Path) -> None:
        with self._lock:
            self._pending.append((temp, path))

    def commit(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            _syncfs(self._fd, self.directory)
            for temp, path in pending:
                os.replace(temp, path)
            for directory in sorted({path.parent for _, path in pending}):
                fsync_dir(directory)
        except OSError as exc:
            for temp, _ in pending:
                _discard(-1, temp)
            raise_if_disk_full(exc, pending[0][1])
            raise

    def discard(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for temp, _ in pending:
            _discard(-1, temp)


def _syncfs(fd: int, directory: Path) -> None:
    """Write back every dirty page of the filesystem holding `directory` (open as `fd`), and report
    its writeback errors since `fd` was opened."""
    import ctypes  # only batches need it; `stage --help` stays fast

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "syncfs"):
        os.sync()  # no syncfs in this libc: sync everything, which is more, never less
    elif libc.syncfs(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(directory))


def _preallocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        # Filesystems without fallocate (some FUSE, old NFS) still work, just without the early ENOSPC.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _discard(fd: int, temp: Path) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(temp)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None, mtime_ns: int | None = None,
                       chmod: int | None = None) -> None:
    with atomic_file(path, mode=mode, mtime_ns=mtime_ns, chmod=chmod) as out:
        out.write(data)


def _atomic_place(path: Path, make, sync_dir: bool = True) -> None:
    path = Path(path)
    temp = temp_path_for(path)
    try:
        make(temp)
        os.replace(temp, path)
        if sync_dir:
            fsync_dir(path.parent)
    except BaseException as exc:  # a signal too: the temp link is this run's to remove
        if not isinstance(exc, FileExistsError):  # ...unless the name was taken: not ours
            with contextlib.suppress(OSError):
                os.unlink(temp)
        if isinstance(exc, OSError):
            raise_if_disk_full(exc, path)
        raise


def atomic_symlink(target: str, path: Path, *, sync_dir: bool = True) -> None:
    """Create or replace the symlink `path -> target` (replacing never fails with EEXIST).

    symlink(2) creates the whole link or nothing, so a new name gets it directly; only an
    existing name needs the temp link and the rename over it (a third of the cost of 1,000
    small files' links went to that detour)."""
    try:
        os.symlink(target, path)
    except FileExistsError:
        _atomic_place(path, lambda temp: os.symlink(target, temp), sync_dir)
        return
    except OSError as exc:
        raise_if_disk_full(exc, Path(path))
        raise
    if sync_dir:
        fsync_dir(Path(path).parent)


def atomic_hardlink(existing: Path, path: Path) -> None:
    _atomic_place(path, lambda temp: os.link(existing, temp, follow_symlinks=False))


def ensure_dir(directory: Path) -> None:
    """Make `directory` and its missing parents, each with its parent's sharing (shared_dir_mode).

    A parent removed between its mkdir and its child's (an operator deleting what the audit
    listed, during a mirror) is made again: that race once ended the mirror as "cannot run"."""
    for attempt in range(ENSURE_DIR_ATTEMPTS):
        try:
            _make_missing(Path(directory))
            return
        except FileNotFoundError:
            if attempt == ENSURE_DIR_ATTEMPTS - 1:
                raise


ENSURE_DIR_ATTEMPTS = 5


def _make_missing(directory: Path) -> None:
    missing = []
    while not os.path.isdir(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:
            if not os.path.isdir(made):
                raise
            continue  # made by another process meanwhile: its mode is its maker's
        except OSError as exc:
            raise_if_disk_full(exc, made)
            raise
        os.chmod(made, shared_dir_mode(made.parent))


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest ancestor that exists: where a directory not made yet would be made."""
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable(directory: Path) -> None:
    """Raise, without writing anything, the OSError that writing in `directory` (made first if
    missing) would meet now: a read-only file system, or no write access for this user. A dry run
    calls it so that it ends as the real run would (exit 3, the same message), where it once
    listed its plan and exited 0 for a run that could not write a byte."""
    existing = nearest_existing(directory)
    # The name the first write would fail on, in `existing` (the directory to make, or the `.locks`
    # of one that exists): the error then reads as the real run's does.
    below = Path(directory).relative_to(existing).parts[:1] if existing != directory else (".locks",)
    first = str(existing.joinpath(*below))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), first)
    effective = os.access in os.supports_effective_ids
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), first)


def ensure_real_dir(directory: Path) -> Path:
    """Make `directory` and check that it is a directory of its own, not a link to one.

    Files this tool writes beside data (locks, records, receipts) are created in a directory
    checked here: a `.locks` planted as a symlink would otherwise carry them anywhere."""
    ensure_dir(directory)
    if os.path.islink(directory):
        raise CannotRun(f"{directory} is a symlink to {os.readlink(directory)}; refusing to write through it")
    return directory


def open_for_write(path: Path, flags: int) -> int:
    """os.open for writing a regular file that never follows a link at `path` and never blocks on
    a FIFO there (either fails with exit 3, naming the path): opened without O_NONBLOCK, a FIFO
    with no reader waits for ever. A file of ours gets at least its directory's sharing
    (shared_file_mode): a lock made 0644 by an older run is opened to the group again."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CannotRun(f"{path} is a symlink; refusing to write through it") from None
        if exc.errno == errno.ENXIO:  # a FIFO that nobody reads
            raise CannotRun(f"{path} is not a regular file; refusing to write to it") from None
        raise_if_disk_full(exc, path)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CannotRun(f"{path} is not a regular file; refusing to write to it")
    shared = shared_file_mode(Path(path).parent)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & shared != shared:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | shared)  # only adds what the directory grants
    os.set_blocking(fd, True)
    return fd


def sweep_temps(directory: Path) -> list[Path]:
    """Remove temp files a killed run left in `directory` (caller holds the writer lock)."""
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            if is_temp_name(entry.name) and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed
