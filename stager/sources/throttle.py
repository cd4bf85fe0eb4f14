"""`--bwlimit`: one read rate for everything a run reads from its sources, whatever its threads.

A mirror copies `--jobs` files at once, and samples, hashes and verifies beside them; a limit per
reader would let the run take `--jobs` times the rate from the NAS. So a run has one Throttle,
and every byte of file content read through a ThrottledSource (copies, samples, full hashes,
small files such as indexes and trees listings) is taken from it before it is read. Listings,
attributes and link reads carry no file content and are not counted.

The bucket holds at most two pieces: a run that was idle starts with that much at once, and at
no moment has it read more than the rate allows plus those two pieces (100 ms of the rate, or
2 MiB at 20 MiB/s and up). Reads are cut into pieces so that one 8 MiB copy buffer cannot take
the whole bucket and leave the other readers waiting behind it.
"""

from __future__ import annotations

import threading
import time

from stager.sources.base import Reader, Source, Stat

MAX_PIECE = 1024 * 1024
MIN_PIECE = 4096  # O_DIRECT reads need whole blocks: pieces are cut at multiples of this
PIECE_SECONDS = 0.05


class Throttle:
    """A token bucket shared by threads: `take(n)` returns once n more bytes fit the rate.

    Each take reserves its place at once (the time by which everything taken so far is paid for
    moves on by n / rate) and then sleeps until its bytes fall due, so takers are served in the
    order they came, and a long queue of readers still adds up to the rate and no more."""

    def __init__(self, rate: int):
        self.rate = rate
        piece = int(rate * PIECE_SECONDS) // MIN_PIECE * MIN_PIECE
        self.piece = min(MAX_PIECE, max(MIN_PIECE, piece))
        self._slack = 2 * self.piece / rate  # the bucket's size, in seconds of the rate
        self._lock = threading.Lock()
        self._paid_until = time.monotonic()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._paid_until = max(self._paid_until, now - self._slack) + n / self.rate
            due = self._paid_until - self._slack
        if due > now:
            time.sleep(due - now)


class ThrottledReader:
    """A source reader whose reads are cut into the throttle's pieces, each taken before it is read."""

    def __init__(self, reader: Reader, throttle: Throttle):
        self._reader = reader
        self._throttle = throttle
        self.size = reader.size

    def pread(self, length: int, offset: int) -> bytes:
        pieces = []
        for start in range(0, max(0, min(length, self.size - offset)), self._throttle.piece):
            want = min(self._throttle.piece, length - start)
            self._throttle.take(want)
            data = self._reader.pread(want, offset + start)
            pieces.append(data)
            if len(data) < want:
                break
        return b"".join(pieces)

    def readinto(self, buffer: memoryview) -> int:
        return self._in_pieces(buffer, lambda piece, _at: self._reader.readinto(piece))

    def readinto_at(self, buffer: memoryview, offset: int) -> int:
        return self._in_pieces(buffer, lambda piece, at: self._reader.readinto_at(piece, offset + at))

    def _in_pieces(self, buffer: memoryview, read) -> int:
        got = 0
        for start in range(0, len(buffer), self._throttle.piece):
            piece = buffer[start:start + self._throttle.piece]
            self._throttle.take(len(piece))
            n = read(piece, start)
            got += n
            if n < len(piece):
                break
        return got

    def state(self) -> tuple[int, ...]:
        return self._reader.state()

    def drop_cache(self) -> None:
        if hasattr(self._reader, "drop_cache"):
            self._reader.drop_cache()

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "ThrottledReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ThrottledSource:
    """`source`, with every byte of file content read from it taken from `throttle` first."""

    def __init__(self, source: Source, throttle: Throttle):
        self._source = source
        self.throttle = throttle
        self.url = source.url

    def display(self, rel: str) -> str:
        return self._source.display(rel)

    def lstat(self, rel: str) -> Stat | None:
        return self._source.lstat(rel)

    def readlink(self, rel: str) -> str:
        return self._source.readlink(rel)

    def listdir(self, rel: str) -> list[str]:
        return self._source.listdir(rel)

    def read_small(self, rel: str, limit: int) -> bytes:
        data = self._source.read_small(rel, limit)  # its size is known only once read
        self.throttle.take(len(data))
        return data

    def canonical_dir(self, rel_dir: str) -> str | None:
        return self._source.canonical_dir(rel_dir)

    def absolute_to_rel(self, target: str) -> str | None:
        return self._source.absolute_to_rel(target)

    def open(self, rel: str, *, uncached: bool, sequential: bool = False) -> ThrottledReader:
        return ThrottledReader(self._source.open(rel, uncached=uncached, sequential=sequential), self.throttle)
