"""Moving bytes from a source Reader into an AtomicFile, as fast as the disks allow.

No hash needed: `copy_file_range`, which keeps the bytes in the kernel.  Hash
needed (--full): a reader thread fills rotating 8 MiB buffers while the caller
writes one and a hasher thread digests it; hashlib and blake3 release the GIL,
so hashing overlaps the I/O instead of adding to it.  Memory per copy is
3 x 8 MiB whatever the file size.  Either way, writeback of what was written
is started every 32 MiB, so the disk writes while the next bytes are read.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from stager.atomic import AtomicFile
from stager.sources.base import reaching
from stager.sources.local import DIRECT_ALIGN, LocalReader, aligned_buffer, reopen_direct

BUFFER_BYTES = 8 * 1024 * 1024
BUFFERS = 3
RANGE_CHUNK = 32 * 1024 * 1024
WRITEBACK_BYTES = 32 * 1024 * 1024


class SourceChanged(OSError):
    """The source shrank or grew during the copy."""


def copy_into(reader, out: AtomicFile, size: int, hasher=None, progress: Callable[[int], None] | None = None) -> None:
    progress = progress or (lambda n: None)
    if hasher is None and isinstance(reader, LocalReader) and _copy_range(reader, out, size, progress):
        return
    _pipeline(reader, out, size, hasher, progress)


def _copy_range(reader: LocalReader, out: AtomicFile, size: int, progress) -> bool:
    """Kernel-side copy. Returns False (nothing copied) where the filesystems do not support it."""
    done = 0
    while done < size:
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


class OffsetWriter:
    """Writes at explicit offsets: block-aligned pieces through an O_DIRECT descriptor of the temp
    file (no page-cache copy, nothing to reclaim), the rest through the page cache. The copy
    pipeline writes with it, and so does the fleet's broadcast with the chunks it receives."""

    def __init__(self, out: AtomicFile):
        self.out = out
        self.direct = reopen_direct(out.fd, os.O_WRONLY)

    def write(self, view: memoryview, offset: int) -> bool:
        """Write all of `view` at `offset`. True if it went around the page cache."""
        if self.direct >= 0 and offset % DIRECT_ALIGN == 0 and len(view) % DIRECT_ALIGN == 0:
            try:
                _pwrite_all(self.direct, view, offset)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.close()  # this device refuses O_DIRECT after all: the page cache it is
        _pwrite_all(self.out.fd, view, offset)
        return False

    def close(self) -> None:
        if self.direct >= 0:
            os.close(self.direct)
            self.direct = -1


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pipeline(reader, out: AtomicFile, size: int, hasher, progress) -> None:
    free: queue.Queue = queue.Queue()
    for _ in range(BUFFERS):
        free.put(aligned_buffer(BUFFER_BYTES))
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
    writer = OffsetWriter(out)
    written = flushed = 0
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="stage-hash") as hash_pool:
            while True:
                item = filled.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                buffer, got = item
                view = memoryview(buffer)[:got]
                hashing = hash_pool.submit(hasher.update, view) if hasher is not None else None
                if writer.write(view, written):
                    flushed = written + got  # nothing of it waits in the page cache
                written += got
                if written - flushed >= WRITEBACK_BYTES:
                    _queue_writeback(out.fd, flushed, written - flushed)
                    flushed = written
                if hashing is not None:
                    hashing.result()
                view.release()
                free.put(buffer)
                progress(got)
    finally:
        free.put(None)  # wakes the reader if the writer stopped early
        thread.join()
        writer.close()


def _queue_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing `length` bytes at `offset` to disk now, without waiting for it.

    DONTNEED on dirty pages queues their writeback (and drops them once clean). Without
    it a GiB-sized file sat dirty in the page cache until the closing fsync, which then
    wrote it all while the reads stood idle: writes now overlap the reads, as with `cp`
    under memory pressure, and the staged bytes do not evict the serving engine's pages.
    """
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
