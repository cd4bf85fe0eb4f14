"""Reading the small files a run depends on (the manifest, SHA256SUMS and other records, receipts,
refs, trees and safetensors indexes on the NAS, the textfile) without trusting what is at the name.

A FIFO at the name would block the open or the read forever, a device such as /dev/zero would
fill memory, and a directory fails late with a confusing error. Each is opened without blocking,
checked to be a regular file through the open descriptor (no race with a rename), and read up to
a limit. Every read of a file whose kind is not proven goes through here or through a source's
reader (sources/local.py), which opens the same way; tests/base/test_small_files.py fails on a new
`open(` anywhere else.

Reads of this tool's own leave files' access times alone where the kernel allows it
(open_keeping_atime): an atime says when a process last used a file, and prune orders by it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path


def open_keeping_atime(path: Path | str, flags: int) -> int:
    """os.open(path, flags) for a read of this tool's own, leaving the file's access time as it was.

    A file's atime is when a process last read it, and `stage prune --until-free` removes the
    least recently used first: a verify or an audit reading every file made every model look used
    that night. O_NOATIME needs the file's owner or CAP_FOWNER; without them (EPERM) the file is
    opened plainly, and that read moves the atime as any reader's would."""
    try:
        return os.open(path, flags | os.O_NOATIME)
    except PermissionError as exc:
        if exc.errno != errno.EPERM:
            raise
    return os.open(path, flags)


@contextlib.contextmanager
def open_regular(path: Path | str, *, follow: bool = False) -> Iterator[int]:
    """A read-only descriptor on the regular file at `path`, closed on exit. Raises OSError as
    open(2) does (FileNotFoundError; ELOOP for a symlink unless `follow`), EINVAL "not a regular
    file" for a FIFO, socket, device or directory: O_NONBLOCK makes the open of a FIFO return at
    once, where a blocking open waits for a writer that never comes. The read is never use
    (open_keeping_atime): refs, records and listings are bookkeeping."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = open_keeping_atime(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        yield fd
    finally:
        os.close(fd)


def read_regular(path: Path | str, limit: int | None = None, *, follow: bool = False) -> bytes:
    """The bytes of the regular file at `path`. Raises OSError as open_regular does, and EFBIG
    when it holds more than `limit` bytes."""
    with open_regular(path, follow=follow) as fd:
        data = _read_up_to(fd, None if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def read_regular_head(path: Path | str, limit: int, *, follow: bool = False) -> bytes:
    """The first `limit` bytes (or fewer) of the regular file at `path`; raises as open_regular."""
    with open_regular(path, follow=follow) as fd:
        return _read_up_to(fd, limit)


def _read_up_to(fd: int, limit: int | None) -> bytes:
    chunks, size = [], 0
    while limit is None or size < limit:
        chunk = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
