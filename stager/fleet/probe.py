"""What a node measures at the start of a fleet mirror, in its agent, for the driver's choice between
the broadcast and direct reads (choice.py). Each measure is bounded in time, and a NAS read also in
bytes: the bytes a probe reads are read again by the copy.

- `read_nas`: how fast this node reads a file it needs from the NAS, through the reader a copy uses
  (uncached, nothing read ahead past the probe's own reads). The first piece is not counted: it
  rides a burst (a shaper's bucket, a TCP window already open) and once made a 100 Mbit/s NAS
  look seven times faster.
- `relay_ceiling`: the most this node's cores could give a relay, were they all its own: the keyed
  BLAKE3 of a few MiB, timed in CPU time (a quota does not slow it), over RELAY_WORK, times the
  CPUs the process may run on. A NAS read faster than this by every node needs no further measure
  to beat the broadcast.
- `relay_work`: how many bytes a second this node's CPU gets through a relay's work now, as the
  cores it may use allow (a cgroup's CPU quota, the other load of the machine): the keyed BLAKE3
  every chunk costs, hashed for PROBE_SECONDS of wall time, over RELAY_WORK. Measured rather than
  read from the cgroup: under `ip netns exec` the cgroup filesystem is not mounted, and a quota is
  not the only thing that takes a node's cores.
- `payload` and `LinkProbe`: how fast the next node in the chain pulls bytes from this one over
  Ray's own object transfer, on the links between the nodes: PAYLOAD_PIECES objects fetched at
  once, timed from the first one in, so that what a pull costs to start (finding the object, the
  request, a burst) is not counted; readable while the pulls run, so that a choice that cannot
  wait for the last piece takes the rate so far.
"""

from __future__ import annotations

import os
import threading
import time

import blake3

from stager.sources.local import aligned_buffer

PROBE_SECONDS = 0.2
PIECE = 256 * 1024
PROBE_MIN = 4 * PIECE  # the first piece and three timed ones
# A relay's CPU per byte received, as a multiple of the keyed BLAKE3 of that byte: the whole node
# (agent, relay threads, closing mirror, counted by cgroup) against the hash alone, both measured
# on the lab (docs/fleet-lab.md, "What a node costs").
RELAY_WORK = 8.0
# 6 MiB: 0.25 s at 200 Mbit/s, while the agents plan. A pull of 1 MiB over the lab's links at
# 200 Mbit/s, timed alone, came out at 0.7 of them.
PAYLOAD_PIECE = 1024 * 1024
PAYLOAD_PIECES = 6


def read_nas(source, rel: str, cap: int, seconds: float = PROBE_SECONDS) -> float:
    """Bytes per second: `rel` read from its start in PIECE reads until `seconds` have passed or
    `cap` bytes are in (at least PROBE_MIN), timed from the end of the first piece."""
    reader = source.open(rel, uncached=True, sequential=False)
    view = memoryview(aligned_buffer(PIECE))
    end = min(max(cap, PROBE_MIN), reader.size)
    done, first, timed_from = 0, 0, 0.0
    started = time.monotonic()
    try:
        while done < end and (not first or time.monotonic() - started < seconds):
            got = reader.readinto_at(view[:min(PIECE, end - done)], done)
            if got <= 0:
                break
            done += got
            if not first:
                first, timed_from = done, time.monotonic()
    finally:
        reader.close()
    timed = time.monotonic() - timed_from
    return (done - first) / timed if done > first and timed > 0 else done / max(time.monotonic() - started, 1e-6)


def relay_ceiling() -> float:
    """Bytes per second a relay could reach on every core this process may use (see the module)."""
    data = memoryview(aligned_buffer(PIECE))
    key = bytes(32)
    started = time.thread_time()
    for _ in range(16):
        blake3.blake3(data, key=key).digest()
    return 16 * PIECE / max(time.thread_time() - started, 1e-6) / RELAY_WORK * len(os.sched_getaffinity(0))


def relay_work(seconds: float = PROBE_SECONDS) -> float:
    """Bytes per second this node's CPU would carry through a relay now (see the module's doc)."""
    data = memoryview(aligned_buffer(PIECE))
    key = bytes(32)
    done = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        blake3.blake3(data, key=key).digest()
        done += PIECE
    return done / max(time.monotonic() - started, 1e-6) / RELAY_WORK


def payload() -> bytes:
    """One piece of what the next node pulls: kept in this node's Ray object store while the
    driver holds it."""
    return bytes(PAYLOAD_PIECE)


class LinkProbe:
    """A node's pulls of the payload pieces of the node before it, and how far they have come."""

    def __init__(self):
        self._lock = threading.Lock()
        self._first: float | None = None  # when the first piece was in: the clock starts there
        self._timed = (0, 0.0)  # bytes in after the first piece, and the seconds since it

    def pull(self, refs: list, ray) -> float | None:
        """Fetch every piece at once (from the moment they all exist); the rate at the end."""
        pending = list(refs)
        ray.wait(pending, num_returns=len(pending), fetch_local=False)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, fetch_local=True)
            got = sum(len(ray.get(ref)) for ref in ready)
            now = time.monotonic()
            with self._lock:
                if self._first is None:
                    self._first = now
                else:
                    self._timed = (self._timed[0] + got, now - self._first)
        return self.rate()

    def rate(self) -> float | None:
        """Bytes per second so far (None before a piece after the first is in)."""
        with self._lock:
            done, seconds = self._timed
        return done / seconds if done and seconds > 0 else None
