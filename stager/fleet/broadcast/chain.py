"""The driver's side of the broadcast: one relay per node (inside the node's agent, a Ray actor
pinned to it), one chain per session, and what each node got from where.

The driver hands this module the agents and the sessions it decided on (which files, for which
nodes); the chain only moves and checks bytes. Every wait is bounded: a relay that cannot start,
dies or outlives the broadcast's share of the deadline is killed, and what it did not land is
copied from the NAS by the node's closing `stage mirror`. A node that answers nothing (the
driver's liveness.Watch) is moved out of every other node's way, and waited for no more.
"""

from __future__ import annotations

import time
from typing import Callable

from stager.base.errors import StageError
from stager.fleet.broadcast.keys import mint
from stager.fleet.broadcast.relay import CHUNK, Session, Share, chunks_in
from stager.fleet.liveness import LOOK_INTERVAL, START, Watch, gather
from stager.fleet.report import Progress
from stager.manifest import Manifest

CLOSE_TIMEOUT = 10.0
# How the driver spots a laggard: at each look (liveness.Watch, once a second) every relay says how
# many chunks it holds; a node receiving at less than LAG_FRACTION of the best rate its upstream
# has shown, and LAG_MIN_CHUNKS behind it, goes to the tail.
LAG_FRACTION = 0.5
# A node whose agent has answered none of the driver's looks for this long (three looks) is moved
# out of its chain's way, as a laggard is, so that its downstream takes the chunks from its upstream
# well before the node is found stalled (liveness.SILENCE) and waited for no more. A moving node's
# agent answers within milliseconds however slow its link or disk (docs/fleet.md): slowness is the
# laggard rule's, never this one's. Before, the downstream waited 15 s (upstream.STALL_TIMEOUT).
SILENT_REROUTE = 3.0
# ... unless the node after it is still receiving from it at a healthy pace: it has received a
# chunk within this long before its latest answer, has answered within this long, and receives at
# better than a laggard's pace (_Route.still_sending). A relay that sends is not frozen, whatever
# its answers do: on a link the data fills to dropping, the driver's look and its answer are
# packets behind the chunks, and TCP's backoff after a loss can hold them for seconds. Moved
# then, a busy head hands the NAS read to the node after it, however slow that node's link. A
# frozen node's downstream stops within its send buffer's drain: at once on the lab's links.
HELD_BACK = 2.0
# A head landing chunks at less than this fraction of what a link between two other nodes carried
# holds every node at its pace (_Route._slow_head). Not LAG_FRACTION: a healthy head sits near half
# of the probe on the lab (a probe's burst through tbf reads 14-15 MB/s on a 12.5 MB/s link, and
# three streams a hop on 2 cores land 8 MiB/s), and CI moved one; a head whose link or disk is 4x
# slower sits at a quarter or less.
SLOW_HEAD_FRACTION = 1 / 3
# The head is judged over at least this much of its own clock: a look's interval, less a tenth for
# when a node reads its counts (a look's call that waited on a full link is read late, and the
# next one on time).
HEAD_SPAN = 0.9 * LOOK_INTERVAL
SLOW_HEAD_WHY = "as the chain's head it read and passed on the data at less than a third of what the links carry"
SILENT_WHY = f"it answered nothing for {SILENT_REROUTE:g}s while the node after it received little or nothing"
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
              done: Callable[[str, str | None], None], watch: Watch,
              links: Callable[[], dict[str, float]] = dict) -> dict[str, dict]:
    """Open the relays of the nodes in `relays` (Ray actors pinned to them, offering the relay's
    calls), then (while they open) ask `plan` for the sessions, then run every session's chain.
    Returns per node {peer_bytes, nas_bytes, landed_files, upstreams, fallbacks, bad_senders, refused,
    relay_cpu_seconds, error}, and moved_why for a node moved to the tail. The key and run id are
    minted here and go to the relays as arguments of `open`, over Ray's authenticated channel, and
    nowhere else.

    `done(name, gone)` is called as soon as a node has no more to receive: its relay has let go of
    the hub's lock by then (it goes on serving its downstream from what it wrote), so the node's own
    closing mirror can run while slower nodes still receive. A node in no chain is done at once.
    `gone` says why the node's agent is dead (Ray's word for it), None while it lives. A node the
    `watch` finds stalled is never done: the driver reports it stalled, and ends its agent."""
    key, run_id = mint()
    nodes = list(relays)
    stats = {name: {"peer_bytes": 0, "nas_bytes": 0, "landed_files": 0, "upstreams": [], "fallbacks": [],
                    "bad_senders": [], "refused": [], "error": None} for name in nodes}
    try:
        opening = {name: relays[name].open.remote(bind_host(manifest.nodes[name].address), ports, key, run_id)
                   for name in nodes}
        sessions = plan()
        needed = {name for members, _ in sessions for name in members}
        opened = gather(ray, {ref: name for name, ref in opening.items()}, watch,
                        min(deadline, time.monotonic() + START))
        listening, gone = {}, {}
        for name in nodes:
            port = opened.get(name)
            if isinstance(port, int):
                listening[name] = port
                continue
            why = _last_line(port) if isinstance(port, BaseException) else f"no answer within {START:g}s"
            if name in needed and name not in watch.stalled:  # else this node stages from the NAS instead
                stats[name]["error"] = f"relay did not start: {why}"
            if isinstance(port, ray.exceptions.RayActorError):
                gone[name] = why
        chains = [tuple((name, bind_host(manifest.nodes[name].address), listening[name])
                        for name in members if name in listening) for members, _files in sessions]
        # One node left of a chain reads the NAS itself, in its mirror.
        runs = [Session(number, files, chain) for number, ((_, files), chain) in enumerate(zip(sessions, chains))
                if len(chain) >= 2]
        last = {name: session.number for session in runs for name, _, _ in session.chain}
        for name in nodes:
            if name not in last and name not in watch.stalled:
                _release(ray, {name: relays[name]}, stats, watch)
                done(name, gone.get(name))
        for session in runs:
            _run_chain(ray, relays, session, stats, deadline, last, done, gone, watch, links)
    finally:
        _release(ray, relays, stats, watch)
    return stats


def _run_chain(ray, relays: dict, session: Session, stats: dict[str, dict], deadline: float,
               last: dict[str, int], done: Callable[[str, str | None], None], gone: dict[str, str],
               watch: Watch, links: Callable[[], dict[str, float]] = dict) -> None:
    # Without the nodes that stalled or died in an earlier session: one node left reads the NAS itself, in its mirror.
    session = Session(session.number, session.files,
                      tuple(hop for hop in session.chain if hop[0] not in watch.stalled and hop[0] not in gone))
    if len(session.chain) < 2:
        for name, _, _ in session.chain:
            if last[name] == session.number:
                done(name, gone.get(name))
        return
    running = {relays[name].run.remote(session, last[name] == session.number): name for name, _, _ in session.chain}
    route = _Route(relays, session, links)
    while running:
        # Woken by an answer to a look too, not only by a relay ending: a slow head's answers reach
        # the driver late on its full link, and each waited for the next look to be read.
        ready, _ = ray.wait(list(running) + watch.pending(), num_returns=1,
                            timeout=max(0.0, min(watch.next_look(), deadline - time.monotonic())))
        watch.look()
        silent = set(watch.stalled) | watch.silent_for(SILENT_REROUTE)
        route.around(silent, set(running.values()) - silent, route.still_sending(silent, watch))
        ended = [ref for ref in ready if ref in running]
        running = {ref: name for ref, name in running.items() if name not in watch.stalled}
        if not ended:
            if time.monotonic() >= deadline:
                for name in running.values():
                    stats[name]["error"] = "the broadcast did not finish within its share of --timeout"
                    ray.kill(relays[name], no_restart=True)
                return
            route.check(set(running.values()) - silent, watch)
            continue
        if ended[0] not in running:
            continue  # its node was just found stalled
        name = running.pop(ended[0])
        try:
            got = ray.get(ended[0])
        except Exception as exc:  # noqa: BLE001 - the relay died (kill -9, OOM): its mirror stages it
            stats[name]["error"] = f"relay failed: {_last_line(exc)}"
            if isinstance(exc, ray.exceptions.RayActorError):
                gone[name] = _last_line(exc)
                watch.forget(name)
                # Out of the others' way: counted as holding everything where it stood, it made
                # the node after it look far behind, and the laggard rule moved that one.
                route.around({name}, set(running.values()), why="its relay died")
        else:
            mine = stats[name]
            for field in ("peer_bytes", "nas_bytes", "landed_files"):
                mine[field] += got[field]
            mine["fallbacks"] += got["fallbacks"]
            mine["upstreams"] = list(dict.fromkeys(mine["upstreams"] + list(got.get("upstreams") or ())))
            mine["bad_senders"] = sorted(set(mine["bad_senders"]) | set(got["bad_senders"]))
        if last[name] == session.number or name in gone:  # a dead node is in no later session
            done(name, gone.get(name))
    for name, why in route.why_moved.items():
        stats[name]["moved_why"] = why


class _Route:
    """The chain's order as the session goes. A node far behind its upstream holds back every node
    after it, and a node that answers nothing holds them back for good: either is moved to the tail
    of the chain, and the node that was taking chunks from it hangs up at once and takes them from
    its upstream instead (the relay's reroute); there the last node serves it from disk. A laggard,
    once, and never the head (it reads the NAS for everyone); the head is judged by the links
    between the other nodes instead (_slow_head). A node silent for SILENT_REROUTE, the
    head too (the next node then reads the NAS), whenever an answering node comes after it and the
    node right after it is not still receiving from it at a healthy pace (still_sending): nobody
    takes anything from it meanwhile, and if it answers again it is served at the tail as a
    laggard is.

    Laggards are judged by rate, not by chunks held: a node just rerouted off a laggard starts that
    laggard's distance behind its new upstream and keeps it while both receive at full speed. Judged
    by how far behind alone, it was moved too, behind the laggard, and stalled there. Rates are taken
    over the last RATE_LOOKS looks: over one, a healthy node's one whole chunk against its
    upstream's two looked like half the rate. Only looks every running node answered count: a node
    that does not answer is not slow, it is the watch's to judge (liveness.SILENCE).

    The head's rate is what it reads from the NAS, not what it can send: on a NAS faster than the
    links it lands chunks far faster than any link carries them, and every node after it in turn
    looked like a laggard (4 nodes on the lab's fast NAS: all three moved, one after the other,
    each then waiting at the tail for the nodes it had been ahead of). A slow node right after the
    head cannot be told from a slow uplink of the head's but by moving it: so the node after the
    head is judged against the head's rate once, and from then on against the best rate any node
    has received at from the head, which is what the head has shown it can send."""

    def __init__(self, relays: dict, session: Session, links: Callable[[], dict[str, float]] = dict):
        self.relays, self.session, self.links = relays, session, links
        self.chain = session.chain
        self.moved: set[str] = set()
        self.total = sum(chunks_in(share.size) for share in session.files)
        self.looks: list[tuple[float, dict[str, int]]] = []  # the last few looks: when, and who held what
        self.seen = -1.0  # the time of the last look taken
        self.quiet_until = 0.0  # no judging before this (monotonic): a reroute is settling
        self.peaks: dict[str, float] = {}  # each node's best receive rate so far, chunks per second
        self.head_tried = False  # a node was moved from right after the head (see above)
        self.after_head = 0.0  # the best rate a node right after the head has received at
        self.untold: set[str] = set()  # moved while silent: told the order once it answers again
        self.why_moved: dict[str, str] = {}  # every node moved, and why, for its row
        # The head's first answer since the chain last changed at which it had landed a chunk: on
        # its clock when, and chunks held (_slow_head). Every move clears it (_to_tail).
        self.head_landing: tuple[float, int] | None = None

    def around(self, silent: set[str], answering: set[str], sending: set[str] = frozenset(),
               why: str = SILENT_WHY) -> None:
        """Move each silent (or dead) node that a running, answering node still comes after to the
        tail, but one still `sending` (still_sending). One that answers again (silent for less
        than liveness.SILENCE) is told the order then: it would go on taking its chunks from its
        old upstream, whose uplink then carries them twice, to it and to the node rerouted onto
        that upstream in its place."""
        for name in sorted(self.untold & answering):
            self.untold.discard(name)
            self.relays[name].reroute.remote(self.session.number, self.chain)
        for name in [name for name, _, _ in self.chain if name in silent and name not in sending]:
            names = [hop[0] for hop in self.chain]
            if answering & set(names[names.index(name) + 1:]):
                self._to_tail(name, why, answering, time.monotonic())
                self.untold.add(name)

    def still_sending(self, silent: set[str], watch: Watch) -> set[str]:
        """The silent nodes, not stalled, whose next node in the chain is still receiving from them
        at a healthy pace: it answered within HELD_BACK; its last chunk had landed less than
        HELD_BACK before that answer; and over its answers kept (a few seconds, on its own clock)
        it received at no less than LAG_FRACTION of the best rate any node has received at. A
        slow node whose own answers are late on its full link still trickles chunks to the next
        node: it is moved, as a laggard would be."""
        names = [hop[0] for hop in self.chain]
        lagging = watch.silent_for(HELD_BACK)
        # The head's rate is its NAS read's, which on a fast NAS no link carries.
        best = max((rate for node, rate in self.peaks.items() if node != names[0]), default=0.0)
        sending = set()
        for name in silent - set(watch.stalled):
            after = names[names.index(name) + 1] if name in names[:-1] else None
            answers = watch.answers(after) if after is not None else []
            if not best or after in lagging or len(answers) < 2:
                continue
            (_, first), (_, last) = answers[0], answers[-1]
            span = last.read_at - first.read_at
            rate = (self._held(last) - self._held(first)) / span if span >= 1.0 else 0.0
            if last.grew_at is not None and last.read_at - last.grew_at < HELD_BACK and rate >= LAG_FRACTION * best:
                sending.add(name)
        return sending

    def check(self, running: set[str], watch: Watch) -> None:
        """The slow-head rule, on the head's own answers; the laggard rule, on the latest look
        every running node answered."""
        names = [name for name, _, _ in self.chain]
        moved_at = self._slow_head(names, running, watch)
        if moved_at is not None:
            self.moved.add(names[0])
            self._to_tail(names[0], SLOW_HEAD_WHY, running, moved_at)
            return
        look = watch.same_look(running)
        if look is None or look[0] <= self.seen:
            return
        now, answers = look
        self.seen = now
        held = {name: self._held(answers[name]) for name in running}
        for name in names:
            held.setdefault(name, self.total)  # finished (or gone: its downstream looks elsewhere)
        settled = [look for look in self.looks if look[0] >= self.quiet_until]
        self.looks = settled[-(RATE_LOOKS - 1):] + [(now, held)]
        if len(self.looks) < RATE_LOOKS:
            return  # a laggard's rate needs that many looks, all after the last reroute settled
        then, before = self.looks[0]
        rates = {name: (held[name] - before.get(name, 0)) / max(now - then, 1e-3) for name in names}
        for name, rate in rates.items():
            self.peaks[name] = max(rate, self.peaks.get(name, 0.0))
        if len(names) > 1:
            self.after_head = max(self.after_head, rates[names[1]])
        name = laggard(names, held, rates, self.peaks, self.moved, self.after_head if self.head_tried else None)
        if name is not None:
            self.head_tried |= name == names[1]
            self.moved.add(name)
            self._to_tail(name, "it fell behind its upstream", running, now)

    def _slow_head(self, names: list[str], running: set[str], watch: Watch) -> float | None:
        """When the look asked that showed the head holding the chain back, or None: since the
        first of its answers at which it had landed a chunk (its NAS open and first samples are
        not its pace), and for at least a look's interval on its own clock, it has landed chunks at
        less than SLOW_HEAD_FRACTION of what a link between two other nodes carried (the driver's
        link probes, Ray's own transfer, while the agents planned; the pull into the node after the
        head crossed the head's own link, so it is no measure of the others). The laggard rule
        never judges the head, which reads the NAS for everyone, so a head with a slow link or
        disk held every node at its pace (the lab, dgx1 at a quarter of the rate: the others
        landed at 25.8 s against 9.2 s); and the node after it, starved, was taken for a laggard.

        Judged on the head's answers alone, timed by its clock: a slow head's link is full, its
        answers reach the driver late, and a look every node had answered came a second after
        the head's own (the lab's slow head was moved at 3 s of landing, not 2). Moved, the next
        node reads the NAS from the chunk it was missing, and the head takes its chunks at the
        tail. Once a session (why_moved keeps that it was): on a NAS slower than the links the
        new head is no faster, and one reroute is all that costs."""
        if SLOW_HEAD_WHY in self.why_moved.values() or len(names) < 3 or names[0] not in running:
            return None
        head, after = names[0], names[1]
        settled = ((asked, answer.read_at, self._held(answer)) for asked, answer in watch.answers(head)
                   if asked >= self.quiet_until)
        landing = [look for look in settled if look[2]]
        if not landing:
            return None
        self.head_landing = self.head_landing or landing[0][1:]
        then, before = self.head_landing
        asked, read_at, held = landing[-1]
        span = read_at - then
        if held >= self.total or span < HEAD_SPAN:
            return None
        measured = [rate for node, rate in self.links().items() if node not in (head, after) and node in names]
        if measured and (held - before) / span < SLOW_HEAD_FRACTION * max(measured) / CHUNK:
            return asked
        return None

    def _held(self, progress: Progress) -> int:
        """Chunks a node held of this session at its answer: none before it started it, all once past it."""
        if progress.session == self.session.number:
            return progress.chunks
        return self.total if progress.session is not None and progress.session > self.session.number else 0

    def _to_tail(self, name: str, why: str, running: set[str], now: float) -> None:
        """`name` to the tail, `why` kept for its row. The new order goes to every running node,
        the moved one too (a silent one is not running): it takes its next chunk from the node now
        before it. Left out, a laggard went on taking its chunks from its old upstream. After the
        trial move of a fast NAS's head (above) that upstream was the head, whose uplink then
        carried every byte twice, to the moved node and to the rest of the chain: 4 nodes on the
        lab's fast NAS took 93 s where 2 took 47."""
        self.why_moved[name] = why
        self.quiet_until = now + REROUTE_GRACE
        self.head_landing = None
        self.chain = tuple(hop for hop in self.chain if hop[0] != name) + tuple(
            hop for hop in self.chain if hop[0] == name)
        for node in running:
            self.relays[node].reroute.remote(self.session.number, self.chain)


def laggard(names: list[str], held: dict[str, int], rates: dict[str, float], peaks: dict[str, float],
            moved: set[str], head_sends: float | None = None) -> str | None:
    """The first node (not the head, not the tail, not moved before) LAG_MIN_CHUNKS behind its
    upstream and receiving at less than LAG_FRACTION of the best rate that upstream has shown
    (chunks per second over the last looks): what it could be sending, even once it has finished.
    For the head, what it has shown it sends (`head_sends`, once known: see _Route), if less."""
    for index in range(1, len(names) - 1):
        name, upstream = names[index], names[index - 1]
        best = peaks.get(upstream, 0.0)
        if index == 1 and head_sends is not None:
            best = min(best, head_sends)
        if name not in moved and held[upstream] - held[name] >= LAG_MIN_CHUNKS and rates[name] < LAG_FRACTION * best:
            return name
    return None


def _release(ray, relays: dict, stats: dict[str, dict], watch: Watch) -> None:
    """Close the relays, all at once: each stops serving and lets go of the hub's lock (again,
    harmlessly, for one that already did). A relay that is dead, stalled or does not answer within
    CLOSE_TIMEOUT is left to the driver, which ends every agent when the run is over."""
    closing = {relay.close.remote(): name for name, relay in relays.items() if name not in watch.stalled}
    for name, closed in gather(ray, closing, watch, time.monotonic() + CLOSE_TIMEOUT).items():
        if isinstance(closed, dict):
            stats[name]["refused"], stats[name]["relay_cpu_seconds"] = closed["refused"], closed["cpu_seconds"]


def _last_line(exc: BaseException) -> str:
    """One line for what a relay's call raised: a stage error's own message, as the node-local
    command prints it (Ray's text ends with its class's path: "stager.base.errors.CannotRun: ...");
    else the last line of Ray's text."""
    cause = exc if isinstance(exc, StageError) else getattr(exc, "cause", None)
    if isinstance(cause, StageError):
        return cause.message
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
