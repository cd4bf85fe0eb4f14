"""The copier's two paths, on real filesystems: an unhashed copy of a large file goes around the
page cache on both sides (O_DIRECT), byte for byte; a side that refuses O_DIRECT (ramfs) gets the
page cache, with the same bytes; DirectWriter puts any bytes at any offset."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from reliability_support import needs_root, ramfs
from stager.base.atomic import atomic_file
from stager.mirror.copier import BUFFER_BYTES, DirectWriter, copy_into
from stager.sources.local import DIRECT_ALIGN, LocalReader, aligned_buffer

MiB = 1024 * 1024
# Whole buffers, and a tail that ends inside a block: the last piece is read and written in two parts.
LARGE = 5 * BUFFER_BYTES + 3 * DIRECT_ALIGN + 1234


def cached_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now, as util-linux `fincore` counts them (mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def on_disk(path: Path) -> None:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{path} is in memory: no disk to go around the page cache to")


def pseudo_random_file(path: Path, size: int) -> bytes:
    data = b"".join(hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(-(-size // 32)))[:size]
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return data


def copy(source: Path, dest: Path) -> tuple[int, int]:
    """copy_into as the mirror calls it (no hasher); the page-cache bytes of both sides just after."""
    with LocalReader(str(source), uncached=True, sequential=True, direct=True) as reader:
        with atomic_file(dest, size_hint=reader.size, sync_dir=False) as out:
            copy_into(reader, out, reader.size)
            return cached_bytes(source), cached_bytes(out.temp)


def test_an_unhashed_large_copy_goes_around_the_page_cache_byte_for_byte(tmp_path):
    on_disk(tmp_path)
    data = pseudo_random_file(tmp_path / "source.bin", LARGE)
    assert cached_bytes(tmp_path / "source.bin") == 0
    source_cached, dest_cached = copy(tmp_path / "source.bin", tmp_path / "copy.bin")
    # Only the last partial block of each side went through the page cache (copy_file_range, the
    # old path, left all 40 MiB of the source there).
    assert source_cached <= DIRECT_ALIGN and dest_cached <= DIRECT_ALIGN, (source_cached, dest_cached)
    assert (tmp_path / "copy.bin").read_bytes() == data


def test_a_small_file_is_copied_in_the_kernel(tmp_path):
    """Below one buffer the pipeline's thread costs more than the page cache: copy_file_range."""
    on_disk(tmp_path)
    data = pseudo_random_file(tmp_path / "small.bin", BUFFER_BYTES - 1)
    source_cached, _ = copy(tmp_path / "small.bin", tmp_path / "copy.bin")
    assert source_cached > BUFFER_BYTES // 2
    assert (tmp_path / "copy.bin").read_bytes() == data


@pytest.mark.parametrize("side", ["source", "destination"])
def test_a_side_that_refuses_o_direct_copies_through_the_page_cache(tmp_path, side):
    """ramfs refuses O_DIRECT at open (EINVAL): a source there, or a destination there, still
    copies every byte, through the page cache."""
    needs_root()
    with ramfs(tmp_path / "ramfs") as memory:
        with pytest.raises(OSError) as refused:
            os.close(os.open(memory, os.O_RDONLY | os.O_DIRECT))
        assert refused.value.errno == errno.EINVAL
        where = {"source": memory, "destination": tmp_path}
        data = pseudo_random_file(where["source"] / "source.bin", LARGE)
        dest = (memory if side == "destination" else tmp_path) / "copy.bin"
        copy(where["source"] / "source.bin", dest)
        assert dest.read_bytes() == data


def test_direct_writer_puts_bytes_at_any_offset(tmp_path):
    """Pieces in any order, aligned or not, from aligned buffers and from plain bytes: the file
    holds exactly them, wherever the direct path took a piece and wherever it could not."""
    on_disk(tmp_path)
    data = os.urandom(3 * MiB + 777)
    pieces = [(2 * MiB, 3 * MiB), (0, MiB), (3 * MiB, len(data)), (MiB, MiB + 5000), (MiB + 5000, 2 * MiB)]
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with DirectWriter(fd) as writer:
            assert writer.direct >= 0
            for start, end in pieces:
                buffer = aligned_buffer(end - start)
                buffer[:] = data[start:end]
                writer.write(memoryview(buffer) if start % 2 == 0 else data[start:end], start)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == data
