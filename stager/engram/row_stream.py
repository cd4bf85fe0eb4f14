"""Reading an Engram table's rows in order: positioned reads into reused buffers, interleaved.

The packer and the full check both consume a table as a sequence of chunks of interleaved
264-byte rows. `iter_rows` yields them for any list of row ranges (`runs`) in one pass: a
filler thread reads and interleaves up to FILL_AHEAD chunks ahead into a ring of reused
buffers, so memory is the same for 10 rows or 384 M. A chunk never crosses the end of a run,
so a rank's rows start a fresh chunk and every write after a shard's 4 KiB header stays
4 KiB-aligned.

A local table opened for a pass (`Checkpoint.open(..., sequential=True)`) is read with O_DIRECT:
the disk fills the chunk buffers itself, without the page cache's copy and reclaim. Tensors lie
at any offset in a safetensors file (not even 8-byte-aligned), so each span of a chunk is read as
the whole 4 KiB blocks that hold it and its bytes are taken from inside them. Where O_DIRECT is
refused, and from an sftp source, the same buffers are filled with ordinary positioned reads of
exactly the wanted bytes.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stager.engram.checkpoint import EngramTable
from stager.engram.shard_format import ROW_BYTES, SCALE_BYTES, WEIGHT_BYTES

assert WEIGHT_BYTES % 8 == 0 and SCALE_BYTES == 8  # the 8-byte-word interleave below relies on both
from stager.base.errors import CannotRun
from stager.sources.local import DIRECT_ALIGN, LocalReader, aligned_buffer

# 16384 rows per chunk: 4 MiB reads from the weight span (large enough for NFS with --from-nas),
# 4.1 MiB interleaved. Measured per GiB packed: 1024-row chunks cost 15% more CPU in per-chunk
# overhead; 4096 to 65536 rows were within noise. A multiple of 512 rows, so every chunk write
# after the 4 KiB header stays 4 KiB-aligned.
CHUNK_ROWS = 16384
FILL_AHEAD = 3  # chunks read and interleaved ahead of the consumer (3 x 8.3 MiB of buffers)


class _Slot:
    """Reused buffers for one chunk: allocated once per pass, whatever the table size.

    All three are page-aligned: the weight and scale buffers so that an O_DIRECT read can fill
    them, with room for the block before and after the span; the interleaved rows so that the
    packer can hand them to an O_DIRECT write as they are. The interleave sees them as 8-byte
    words (a row is 33 of them, its scale one), at whatever offset the span starts in its block."""

    def __init__(self, rows: int):
        self.weight_blocks = aligned_buffer(_blocks_around(rows * WEIGHT_BYTES))
        self.scale_blocks = aligned_buffer(_blocks_around(rows * SCALE_BYTES))
        self._memory = aligned_buffer(rows * ROW_BYTES)
        self.rows = np.frombuffer(self._memory, np.uint64).reshape(rows, ROW_BYTES // 8)


def _blocks_around(length: int) -> int:
    """Bytes of whole blocks enough to hold `length` bytes starting anywhere in a block."""
    return _whole_blocks(length) + DIRECT_ALIGN


def _whole_blocks(length: int) -> int:
    """`length` rounded up to whole blocks."""
    return -(-length // DIRECT_ALIGN) * DIRECT_ALIGN


def read_exact(reader, view: memoryview, offset: int, where: str, *, needed: int | None = None) -> None:
    """Fill `view` from `offset` (into the caller's buffer itself on a local file, through pread
    elsewhere). With `needed`, only that many leading bytes must be there: the rest of `view` is
    block padding that may lie past the end of the file."""
    needed = len(view) if needed is None else needed
    done = 0
    try:
        while done < needed:
            if isinstance(reader, LocalReader):
                got = reader.readinto_at(view[done:], offset + done)
            else:
                data = reader.pread(len(view) - done, offset + done)
                got = len(data)
                view[done:done + got] = data
            if got == 0:
                raise CannotRun(f"{where}: ended at byte {offset + done}; the file changed while it was read")
            done += got
    except OSError as exc:
        raise CannotRun(f"{where}: read failed at byte {offset + done}: {exc.strerror or exc}") from None


def _read_span(reader, blocks: mmap.mmap, offset: int, length: int, where: str) -> np.ndarray:
    """The `length` bytes at `offset` in the file, read into `blocks`, as 8-byte words.

    Through O_DIRECT, the read covers the whole blocks holding the span and the words start
    `offset % DIRECT_ALIGN` bytes in. numpy moves 8-byte words from an offset that is not a
    multiple of 8 as fast as from an aligned one (the weight part of a chunk's interleave: 0.38 ms
    at offset 3, 0.35 ms at 0); copying the span to an aligned buffer first took 0.78 ms."""
    if isinstance(reader, LocalReader) and reader.direct:
        lead = offset % DIRECT_ALIGN
        size = _whole_blocks(lead + length)
    else:
        lead, size = 0, length
    read_exact(reader, memoryview(blocks)[:size], offset - lead, where, needed=lead + length)
    return np.frombuffer(blocks, np.uint64, count=length // 8, offset=lead)


def read_row(reader, table: EngramTable, row: int, into: memoryview, where: str) -> None:
    """One interleaved row, straight from the weight and scale spans (the sampled check's read)."""
    read_exact(reader, into[:WEIGHT_BYTES], table.weight.start + row * WEIGHT_BYTES, where)
    read_exact(reader, into[WEIGHT_BYTES:ROW_BYTES], table.scale.start + row * SCALE_BYTES, where)


def _fill(reader, table: EngramTable, slot: _Slot, start: int, count: int, where: str) -> memoryview:
    weight = _read_span(reader, slot.weight_blocks, table.weight.start + start * WEIGHT_BYTES, count * WEIGHT_BYTES,
                        where)
    scale = _read_span(reader, slot.scale_blocks, table.scale.start + start * SCALE_BYTES, count * SCALE_BYTES, where)
    rows = slot.rows[:count]
    rows[:, :WEIGHT_BYTES // 8] = weight.reshape(count, WEIGHT_BYTES // 8)
    rows[:, WEIGHT_BYTES // 8] = scale
    return memoryview(rows).cast("B")


def _chunks(runs: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    for lo, hi in runs:
        for start in range(lo, hi, CHUNK_ROWS):
            yield start, min(CHUNK_ROWS, hi - start)


def iter_rows(reader, table: EngramTable, runs: list[tuple[int, int]], where: str) -> Iterator[tuple[memoryview, int]]:
    """Yield (rows, first_row) for the rows of every run [lo, hi), in order, in chunks of at most
    CHUNK_ROWS that never cross a run's end.

    `rows` is a view of a reused buffer, valid until the next chunk is asked for: the slot is
    refilled only once the consumer has come back. Positioned reads and numpy copies release
    the GIL, so the filler runs beside the consumer's writes and hashing. Close the iterator
    (contextlib.closing) when stopping early: that cancels the reads ahead."""
    runs = [(lo, hi) for lo, hi in runs if hi > lo]
    if not runs:
        return
    chunks = _chunks(runs)
    count = sum(-(-(hi - lo) // CHUNK_ROWS) for lo, hi in runs)
    slots = [_Slot(min(CHUNK_ROWS, max(hi - lo for lo, hi in runs))) for _ in range(min(FILL_AHEAD, count))]
    pending: deque = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="engram-fill") as filler:

        def refill(slot: _Slot) -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append((filler.submit(_fill, reader, table, slot, *chunk, where), slot, chunk[0]))

        for slot in slots:
            refill(slot)
        try:
            while pending:
                future, slot, start = pending.popleft()
                yield future.result(), start
                refill(slot)
        finally:
            for future, _slot, _start in pending:
                future.cancel()
