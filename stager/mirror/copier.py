"""Moving bytes from a source Reader into an AtomicFile, as fast as the disks allow, and as
cheaply for the CPU.

Files of BUFFER_BYTES and more go the direct path whether or not they are hashed: a reader
thread fills rotating page-aligned 8 MiB buffers with O_DIRECT reads while the caller writes
one with O_DIRECT and, with --full, a hasher thread digests it (hashlib and blake3 release the
GIL, so hashing overlaps the I/O instead of adding to it).  The bytes never enter the page
cache on either side: on this kind of machine, the page cache's copies, writeback and reclaim
cost more CPU than the hash does (docs/benchmarks.md).  Memory per copy is 3 x 8 MiB whatever
the file size.  Smaller files, and sources or disks that refuse O_DIRECT, copy with
`copy_file_range`, which keeps the bytes in the kernel; writeback of what went through the
page cache is started every 32 MiB, so the disk writes while the next bytes are read.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from stager.base.atomic import AtomicFile
from stager.sources.base import reaching
from stager.sources.local import DIRECT_ALIGN, LocalReader, aligned_buffer, reopen_direct
from stager.base.workers import stop_point

BUFFER_BYTES = 8 * 1024 * 1024
BUFFERS = 3
RANGE_CHUNK = 32 * 1024 * 1024
WRITEBACK_BYTES = 32 * 1024 * 1024


class _BufferPool:
    """Copy buffers kept for the next copy: a new buffer's pages are faulted in and zeroed on first
    use, 24 MiB per file, which cost as much system time as the direct I/O of a small blob."""

    def __init__(self):
        self._free: list = []
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_buffer(BUFFER_BYTES)

    def give_back(self, buffers) -> None:
        with self._lock:
            self._free.extend(buffers)


# At most BUFFERS per copy running at once (--jobs copies): what the copies held anyway.
_buffers = _BufferPool()


class SourceChanged(OSError):
    """The source shrank or grew during the copy."""


def copy_into(reader, out: AtomicFile, size: int, hasher=None, progress: Callable[[int], None] | None = None) -> None:
    progress = progress or (lambda n: None)
    if hasher is None and isinstance(reader, LocalReader) and not _worth_direct(reader, out, size) \
            and _copy_range(reader, out, size, progress):
        return
    _pipeline(reader, out, size, hasher, progress)


def _worth_direct(reader: LocalReader, out: AtomicFile, size: int) -> bool:
    """Whether an unhashed copy should take the direct pipeline rather than copy_file_range.

    Only files of a whole buffer or more: below that, the pipeline's thread per file costs more
    than the page cache saves, and the sampled check has just read most of a small file into the
    cache anyway. The source must read direct (on NFS, each 8 MiB read goes to the server as
    rsize-sized RPCs in flight together; a filesystem that refuses O_DIRECT gets
    copy_file_range), and so must the temp file's disk, which is asked once per file here."""
    if size < BUFFER_BYTES or not reader.direct:
        return False
    probe = reopen_direct(out.fd, os.O_WRONLY)
    if probe < 0:
        return False
    os.close(probe)
    return True


def _copy_range(reader: LocalReader, out: AtomicFile, size: int, progress) -> bool:
    """Kernel-side copy. Returns False (nothing copied) where the filesystems do not support it."""
    done = 0
    while done < size:
        stop_point()  # Ctrl-C: stop at the next chunk, not at the end of a 20 GB file
        try:
            with reaching(reader.path):  # the local disk never says ENOTCONN: that is the source
                got = os.copy_file_range(reader.fd, out.fd, min(RANGE_CHUNK, size - done), done, done)
        except OSError as exc:
            if done == 0 and exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                return False
            raise
        if got == 0:
            raise SourceChanged(errno.EIO, f"the source ended at {done} of {size} bytes: it changed while it was copied")
        if size >= WRITEBACK_BYTES:
            _queue_writeback(out.fd, done, got)
        done += got
        progress(got)
    if reader.pread(1, size):
        raise SourceChanged(errno.EIO, f"the source grew beyond {size} bytes: it changed while it was copied")
    return True


class DirectWriter:
    """Writes bytes at given offsets into an open file, around the page cache where it can.

    The block-aligned part of each write goes through a second descriptor of the same file opened
    with O_DIRECT (reopen_direct): straight from the caller's buffer to the disk, with no copy into
    the page cache and nothing for writeback and reclaim to do. The rest (a piece that starts off
    a block boundary, the last partial block of a file), and everything where the filesystem
    refuses O_DIRECT at the open or at the first write, goes through the ordinary descriptor, and
    every WRITEBACK_BYTES of it is handed to writeback (DONTNEED on the dirty range), so that the
    closing fsync does not find a GiB still dirty. The caller still fsyncs `fd`: O_DIRECT skips the
    page cache, not the filesystem's journal.

    Buffers must be page-aligned for the direct path (aligned_buffer, or a view into one at a
    multiple of DIRECT_ALIGN): the kernel refuses others with EINVAL, and the first refusal turns
    the direct path off for the rest of the file. Usable from any thread, one write at a time."""

    def __init__(self, fd: int):
        self.fd = fd
        self.direct = reopen_direct(fd, os.O_WRONLY)
        self._dirty: tuple[int, int] | None = None  # the range written through the page cache since the last writeback

    def write(self, data: memoryview | bytes, offset: int) -> None:
        """Write all of `data` at `offset`."""
        view = memoryview(data)
        aligned = len(view) - len(view) % DIRECT_ALIGN if offset % DIRECT_ALIGN == 0 else 0
        if self.direct >= 0 and aligned:
            try:
                _pwrite_all(self.direct, view[:aligned], offset)
                view, offset = view[aligned:], offset + aligned
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.close()  # this device refuses O_DIRECT writes after all: the page cache it is
        if view:
            _pwrite_all(self.fd, view, offset)
            self._written_buffered(offset, offset + len(view))

    def _written_buffered(self, start: int, end: int) -> None:
        if self._dirty is not None:
            start, end = min(start, self._dirty[0]), max(end, self._dirty[1])
        if end - start >= WRITEBACK_BYTES:
            _queue_writeback(self.fd, start, end - start)
            self._dirty = None
        else:
            self._dirty = (start, end)

    def close(self) -> None:
        """Close the O_DIRECT descriptor (not `fd`, which stays the caller's)."""
        if self.direct >= 0:
            os.close(self.direct)
            self.direct = -1

    def __enter__(self) -> "DirectWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pipeline(reader, out: AtomicFile, size: int, hasher, progress) -> None:
    buffers = [_buffers.take() for _ in range(BUFFERS)]
    free: queue.Queue = queue.Queue()
    for buffer in buffers:
        free.put(buffer)
    filled: queue.Queue = queue.Queue()

    def read_loop() -> None:
        try:
            done = 0
            while done < size:
                buffer = free.get()
                if buffer is None:
                    return
                want = min(len(buffer), size - done)
                got = reader.readinto(memoryview(buffer)[:want])
                if got == 0:
                    raise SourceChanged(errno.EIO, f"the source ended at {done} of {size} bytes: it changed while it was copied")
                filled.put((buffer, got))
                done += got
            filled.put(None)
        except BaseException as exc:  # handed to the writer, which raises it
            filled.put(exc)

    thread = threading.Thread(target=read_loop, name="stage-read", daemon=True)
    thread.start()
    written = 0
    try:
        with DirectWriter(out.fd) as writer, ThreadPoolExecutor(1, thread_name_prefix="stage-hash") as hash_pool:
            while True:
                item = filled.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                buffer, got = item
                stop_point()
                view = memoryview(buffer)[:got]
                hashing = hash_pool.submit(hasher.update, view) if hasher is not None else None
                writer.write(view, written)
                written += got
                if hashing is not None:
                    hashing.result()
                view.release()
                free.put(buffer)
                progress(got)
    finally:
        free.put(None)  # wakes the reader if the writer stopped early
        thread.join()
        _buffers.give_back(buffers)  # every view of them is released: nothing reads or writes them now


def _queue_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing `length` bytes at `offset` to disk now, without waiting for it.

    DONTNEED on dirty pages queues their writeback (and drops them once clean). Without
    it a GiB-sized file sat dirty in the page cache until the closing fsync, which then
    wrote it all while the reads stood idle: writes now overlap the reads, as with `cp`
    under memory pressure, and the staged bytes do not evict the serving engine's pages.
    """
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
