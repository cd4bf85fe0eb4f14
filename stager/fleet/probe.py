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
- `payload` and `pull`: how fast the next node in the chain pulls bytes from this one over Ray's own
  object transfer, on the links between the nodes: a small pull and a large one, the difference
  timed, so that what every pull costs (finding the object, the request) is not counted.
"""

from __future__ import annotations

import os
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
# The second 4 MiB larger: 0.17 s at 200 Mbit/s, while the agents plan. With 1 MiB more, a pull
# over the lab's links at 200 Mbit/s came out at 0.7 of them.
PAYLOAD_BYTES = (1024 * 1024, 5 * 1024 * 1024)


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


def payload(size: int) -> bytes:
    """What the next node pulls: kept in this node's Ray object store while the driver holds it."""
    return bytes(size)


def pull(small, large, ray) -> float:
    """Bytes per second of a pull to this node: the large payload's time less the small one's,
    over their difference in bytes; both timed from the moment they exist."""
    ray.wait([small, large], num_returns=2, fetch_local=False)
    started = time.monotonic()
    low = len(ray.get(small))
    middle = time.monotonic()
    high = len(ray.get(large))
    ended = time.monotonic()
    extra = (ended - middle) - (middle - started)
    return (high - low) / extra if extra > 0 else high / max(ended - middle, 1e-6)
