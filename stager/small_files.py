"""Reading the small files a run depends on (the manifest, SHA256SUMS and other records, receipts,
refs, the textfile) without trusting what is at the name.

A FIFO at the name would block the open or the read forever, a device such as /dev/zero would
fill memory, and a directory fails late with a confusing error. Each is opened without blocking,
checked to be a regular file through the open descriptor (no race with a rename), and read up to
a limit.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def read_regular(path: Path | str, limit: int | None = None, *, follow: bool = False) -> bytes:
    """The bytes of the regular file at `path`. Raises OSError: as open(2) does (FileNotFoundError;
    ELOOP for a symlink unless `follow`), EINVAL "not a regular file", EFBIG when it holds more
    than `limit` bytes."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)
