"""The driver's side of the broadcast: one relay per node (inside the node's agent, a Ray actor
pinned to it), one chain per session, and what each node got from where.

The driver hands this module the agents and the sessions it decided on (which files, for which
nodes); the chain only moves and checks bytes. Every wait is bounded: a relay that cannot start,
dies or outlives the broadcast's share of the deadline is killed, and what it did not land is
copied from the NAS by the node's closing `stage mirror`.
"""

from __future__ import annotations

import time
from typing import Callable

from stager.fleet.broadcast.keys import mint
from stager.fleet.broadcast.relay import Session, Share, chunks_in
from stager.manifest import Manifest

OPEN_TIMEOUT = 60.0
CLOSE_TIMEOUT = 10.0
# How the driver spots a laggard: every WATCH_INTERVAL it asks each relay how many chunks it holds;
# a node receiving at less than LAG_FRACTION of the best rate its upstream has shown, and
# LAG_MIN_CHUNKS behind it, goes to the tail.
WATCH_INTERVAL = 1.0
PROGRESS_TIMEOUT = 2.0
LAG_FRACTION = 0.5
# After a move, nobody is judged for this long: the rerouted nodes are reconnecting, and a second
# of nothing received made the node just rerouted off a laggard look like one (the lab saw it).
REROUTE_GRACE = 3.0
# Rates are taken over this many looks (two intervals): see _Laggards.
RATE_LOOKS = 3
# A healthy relay is one chunk behind its upstream (it forwards what it has written), two for a
# moment. With 4 MiB chunks, 3 behind (12 MiB) found a node at a quarter of the rate only after its
# upstream had read the whole 48 MiB of the lab's runs, and its downstream finished 1.4x later
# than in a clean run; 2 (8 MiB) found it in time. With 1 MiB chunks, 4 leaves a healthy node
# room for a moment's jitter and still finds a laggard within 4 MiB.
LAG_MIN_CHUNKS = 4


def bind_host(address: str) -> str:
    """The host part of `nodes.X.address` ([user@]host[:port], the port being SSH's)."""
    host = address.rpartition("@")[2]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.split(":", 1)[0] if host.count(":") == 1 else host


def broadcast(ray, manifest: Manifest, relays: dict,
              plan: Callable[[], list[tuple[tuple[str, ...], tuple[Share, ...]]]], *,
              deadline: float, ports: tuple[int, int] | None,
              done: Callable[[str, str | None], None]) -> dict[str, dict]:
    """Open the relays of the nodes in `relays` (Ray actors pinned to them, offering the relay's
    calls), then (while they open) ask `plan` for the sessions, then run every session's chain.
    Returns per node {peer_bytes, nas_bytes, landed_files, fallbacks, bad_senders, refused,
    relay_cpu_seconds, error}. The key and run id are minted here and go to the relays as arguments of `open`, over
    Ray's authenticated channel, and nowhere else.

    `done(name, gone)` is called as soon as a node has no more to receive: its relay has let go of
    the hub's lock by then (it goes on serving its downstream from what it wrote), so the node's own
    closing mirror can run while slower nodes still receive. A node in no chain is done at once.
    `gone` says why the node's agent is dead (Ray's word for it), None while it lives."""
    key, run_id = mint()
    nodes = list(relays)
    stats = {name: {"peer_bytes": 0, "nas_bytes": 0, "landed_files": 0, "fallbacks": [], "bad_senders": [],
                    "refused": [], "error": None} for name in nodes}
    try:
        opening = {name: relays[name].open.remote(bind_host(manifest.nodes[name].address), ports, key, run_id)
                   for name in nodes}
        sessions = plan()
        needed = {name for members, _ in sessions for name in members}
        listening, gone = {}, {}
        for name, ref in opening.items():
            try:
                listening[name] = ray.get(ref, timeout=max(1.0, min(OPEN_TIMEOUT, deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - this node stages from the NAS instead
                if name in needed:
                    stats[name]["error"] = f"relay did not start: {_last_line(exc)}"
                if isinstance(exc, ray.exceptions.RayActorError):
                    gone[name] = _last_line(exc)
        chains = [tuple((name, bind_host(manifest.nodes[name].address), listening[name])
                        for name in members if name in listening) for members, _files in sessions]
        # One node left of a chain reads the NAS itself, in its mirror.
        runs = [Session(number, files, chain) for number, ((_, files), chain) in enumerate(zip(sessions, chains))
                if len(chain) >= 2]
        last = {name: session.number for session in runs for name, _, _ in session.chain}
        for name in nodes:
            if name not in last:
                _release(ray, {name: relays[name]}, stats)
                done(name, gone.get(name))
        for session in runs:
            _run_chain(ray, relays, session, stats, deadline, last, done, gone)
    finally:
        _release(ray, relays, stats)
    return stats


def _run_chain(ray, relays: dict, session: Session, stats: dict[str, dict], deadline: float,
               last: dict[str, int], done: Callable[[str, str | None], None], gone: dict[str, str]) -> None:
    running = {relays[name].run.remote(session, last[name] == session.number): name for name, _, _ in session.chain}
    watch = _Laggards(ray, relays, session)
    while running:
        ready, _ = ray.wait(list(running), num_returns=1,
                            timeout=max(0.0, min(WATCH_INTERVAL, deadline - time.monotonic())))
        if not ready:
            if time.monotonic() >= deadline:
                for name in running.values():
                    stats[name]["error"] = "the broadcast did not finish within its share of --timeout"
                    ray.kill(relays[name], no_restart=True)
                return
            watch.check(set(running.values()))
            continue
        name = running.pop(ready[0])
        try:
            got = ray.get(ready[0])
        except Exception as exc:  # noqa: BLE001 - the relay died (kill -9, OOM): its mirror stages it
            stats[name]["error"] = f"relay failed: {_last_line(exc)}"
            if isinstance(exc, ray.exceptions.RayActorError):
                gone[name] = _last_line(exc)
        else:
            mine = stats[name]
            for field in ("peer_bytes", "nas_bytes", "landed_files"):
                mine[field] += got[field]
            mine["fallbacks"] += got["fallbacks"]
            mine["bad_senders"] = sorted(set(mine["bad_senders"]) | set(got["bad_senders"]))
        if last[name] == session.number:
            done(name, gone.get(name))
    for name in watch.moved:
        stats[name]["moved_to_tail"] = True


class _Laggards:
    """A node far behind its upstream holds back every node after it: it is moved to the tail of
    the chain, where the last node serves it from disk, and its downstream takes the chunks from
    its upstream instead. Once per node, and never the head (it reads the NAS for everyone).

    Judged by rate, not by chunks held: a node just rerouted off a laggard starts that laggard's
    distance behind its new upstream and keeps it while both receive at full speed. Judged by how
    far behind alone, it was moved too, behind the laggard, and stalled there. Rates are taken over
    the last RATE_LOOKS looks: over one, a healthy node's one whole chunk against its upstream's two
    looked like half the rate."""

    def __init__(self, ray, relays: dict, session: Session):
        self.ray, self.relays, self.session = ray, relays, session
        self.chain = session.chain
        self.moved: set[str] = set()
        self.total = sum(chunks_in(share.size) for share in session.files)
        self.looks: list[tuple[float, dict[str, int]]] = []  # the last few looks: when, and who held what
        self.quiet_until = 0.0  # no judging before this (monotonic): a reroute is settling
        self.peaks: dict[str, float] = {}  # each node's best receive rate so far, chunks per second

    def check(self, running: set[str]) -> None:
        names = [name for name, _, _ in self.chain]
        refs = {name: self.relays[name].progress.remote(self.session.number) for name in names if name in running}
        try:
            held = dict(zip(refs, self.ray.get(list(refs.values()), timeout=PROGRESS_TIMEOUT)))
        except Exception:  # noqa: BLE001 - a relay that does not answer is routed around by its downstream
            return
        for name in names:
            held.setdefault(name, self.total)  # finished (or gone: its downstream looks elsewhere)
        now = time.monotonic()
        settled = [look for look in self.looks if look[0] >= self.quiet_until]
        self.looks = settled[-(RATE_LOOKS - 1):] + [(now, held)]
        if len(self.looks) < RATE_LOOKS:
            return  # rates need that many looks, all after the last reroute settled
        then, before = self.looks[0]
        rates = {name: (held[name] - before.get(name, 0)) / max(now - then, 1e-3) for name in names}
        for name, rate in rates.items():
            self.peaks[name] = max(rate, self.peaks.get(name, 0.0))
        name = laggard(names, held, rates, self.peaks, self.moved)
        if name is not None:
            self.moved.add(name)
            self.quiet_until = now + REROUTE_GRACE
            self.chain = tuple(hop for hop in self.chain if hop[0] != name) + tuple(
                hop for hop in self.chain if hop[0] == name)
            for other in running:
                self.relays[other].reroute.remote(self.session.number, self.chain)


def laggard(names: list[str], held: dict[str, int], rates: dict[str, float], peaks: dict[str, float],
            moved: set[str]) -> str | None:
    """The first node (not the head, not the tail, not moved before) LAG_MIN_CHUNKS behind its
    upstream and receiving at less than LAG_FRACTION of the best rate that upstream has shown
    (chunks per second over the last looks): what it could be sending, even once it has finished."""
    for index in range(1, len(names) - 1):
        name, upstream = names[index], names[index - 1]
        if (name not in moved and held[upstream] - held[name] >= LAG_MIN_CHUNKS
                and rates[name] < LAG_FRACTION * peaks.get(upstream, 0.0)):
            return name
    return None


def _release(ray, relays: dict, stats: dict[str, dict]) -> None:
    """Close the relays: each stops serving and lets go of the hub's lock (again, harmlessly, for
    one that already did). A relay that is dead or does not answer is left to the driver, which
    ends every agent when the run is over."""
    closing = {name: relay.close.remote() for name, relay in relays.items()}
    for name, ref in closing.items():
        try:
            closed = ray.get(ref, timeout=CLOSE_TIMEOUT)
            stats[name]["refused"], stats[name]["relay_cpu_seconds"] = closed["refused"], closed["cpu_seconds"]
        except Exception:  # noqa: BLE001 - already dead or hung
            pass


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
