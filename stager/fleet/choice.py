"""Never slower than direct reads: the driver's choice, per group of files two or more nodes need,
between the broadcast and every node reading the NAS itself.

A group goes down its chain at the rate of the chain's slowest member: the head reading the NAS by
itself, each other node receiving from the one before it (its link, or its CPU for a relay's work);
read directly, each node reads it at what the NAS gives it while every node of the group reads at
once. The driver takes the faster, by time: the broadcast's S / rate plus a chunk's time per hop,
against S / the slowest node's direct rate. A group read directly is left to each node's closing
mirror, which copies it from the NAS as `--transport nas` would.

The rates are told in the manifest (`[fleet]`: nas_rate, nas_node_rate, relay_rate) or measured in
the first second of the run, each only when it can change the choice (probe.py, in the agents): the
links into each node after the head while the agents plan (Ray's own transfer, each node pulling
from the one before it); then the head reading the NAS alone, with what its cores could give a relay
at most; then, only if the NAS alone is NAS_MARGIN times faster than what the chain carries as far
as known (_pace), every node reading it at once (and if direct reads then beat the most the
broadcast could do, by the links so far or once they are in, nothing more is measured); then what
each node's CPU gives a relay now, under its quota and load. So on the usual cluster, a NAS no
faster than one link, the measures read the NAS once, PROBE_SHARE of the data (at least
probe.PROBE_MIN), by the head.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from stager.base.units import format_size
from stager.fleet.broadcast.relay import CHUNK, Share
from stager.fleet.probe import PAYLOAD_PIECES
from stager.fleet.liveness import Watch, gather
from stager.manifest import FleetConfig

# What the measures may read of the NAS, as a share of the data they decide for (and at least
# probe.PROBE_MIN each): by the head alone; then, only on a NAS at least NAS_MARGIN times faster
# than the slowest hop of the chain, by every node at once, EACH_SHARE between them.
PROBE_SHARE = 0.0025
EACH_SHARE = 0.02
# Below it, direct reads could beat the chain only on a NAS that serves every node at once as fast
# as it serves one, and by less than this factor. On the lab, whose NAS link is a node link, the
# head's SFTP read and a Ray pull differed by up to 1.42x (fleet-lab.md): a tighter factor read the
# NAS from every node on usual runs.
NAS_MARGIN = 1.5
# The same, by links whose pulls are not done: those rates are rough, and a NAS no faster than a
# link must not be read by every node for want of waiting a quarter of a second.
HASTE_MARGIN = 3.0
PROBE_WAIT = 10.0  # seconds: a probe not answered by then is not waited for (its rate is unknown)
LINK_LOOK = 0.05  # seconds between looks at the links' pulls while they run


@dataclass(frozen=True)
class Rates:
    """What the driver knows of the paths bytes can take, in bytes per second, and how it knows
    each (`told` in the manifest, else measured; None: not needed for the choice, not measured)."""

    nas_alone: float | None = None  # one node reading the NAS by itself: the broadcast's head
    nas_each: dict[str, float] = field(default_factory=dict)  # each node, every node reading at once
    link: dict[str, float] = field(default_factory=dict)  # bytes reaching each node from the one before it
    cpu: dict[str, float] = field(default_factory=dict)  # what each node's CPU gives a relay's work
    ceiling: dict[str, float] = field(default_factory=dict)  # the most each node's cores could give a relay
    told: tuple[str, ...] = ()  # the [fleet] keys these came from
    bwlimit: float | None = None  # --bwlimit: no node reads the NAS, nor sends to a peer, faster

    def relay(self, node: str) -> float | None:
        """What `node` can receive and pass on: the least of its link and its CPU, as known."""
        known = [rate for rate in (self.link.get(node), self.cpu.get(node)) if rate]
        return min(known) if known else None

    def to_json(self) -> dict:
        return {key: (round(value) if isinstance(value, float) else
                      {name: round(rate) for name, rate in value.items()} if isinstance(value, dict) else value)
                for key, value in asdict(self).items()}


@dataclass(frozen=True)
class GroupChoice:
    """How one group's files move, and why: each transport's time as the rates predict it, and
    what sets the chosen one's pace."""

    nodes: tuple[str, ...]
    files: int
    bytes: int
    transport: str  # "broadcast" or "nas"
    seconds: dict[str, float | None]  # predicted: {"broadcast": ..., "nas": ...}; None where unknown
    limit: str  # what the chosen transport waits on, in words

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "files": self.files, "bytes": self.bytes, "transport": self.transport,
                "seconds": {k: None if v is None else round(v, 2) for k, v in self.seconds.items()},
                "limit": self.limit}


@dataclass(frozen=True)
class Choice:
    """The run's choice: every group's, and the rates behind them."""

    groups: tuple[GroupChoice, ...]
    rates: Rates

    @property
    def transport(self) -> str:
        """The run's transport: the broadcast if any group takes it, else direct reads ("nas")."""
        return "broadcast" if any(group.transport == "broadcast" for group in self.groups) else "nas"

    def to_json(self) -> dict:
        return {"groups": [group.to_json() for group in self.groups], "rates": self.rates.to_json()}

    def lines(self) -> list[str]:
        """For the table: one line per group, with the rates it was chosen on."""
        return [_line(group, self.rates) for group in self.groups]


def choose(groups: list[tuple[tuple[str, ...], tuple[Share, ...]]], rates: Rates) -> list[GroupChoice]:
    """Each group's transport, by the rates (pure). Without a direct rate for a node (not needed:
    the NAS alone was no faster than the chain), the broadcast."""
    return [_group_choice(members, files, rates) for members, files in groups]


def _group_choice(members: tuple[str, ...], files: tuple[Share, ...], rates: Rates) -> GroupChoice:
    """Direct reads only when they beat the broadcast's streaming time: within the chain's fill (a
    chunk's time per hop) of each other, the broadcast, which reads the NAS once instead of N
    times. Under a --bwlimit below every measure both move at the limit, and direct reads won by
    the fill alone, reading the NAS at N times the limit the operator set."""
    size = sum(share.size for share in files)
    broadcast_rate, bound = _broadcast_rate(members, rates)
    streaming = size / broadcast_rate if broadcast_rate else None
    broadcast = streaming + (len(members) - 1) * CHUNK / broadcast_rate if broadcast_rate else None
    direct_rates = {name: _capped(rates.nas_each.get(name), rates.bwlimit) for name in members}
    direct = size / min(direct_rates.values()) if direct_rates and all(direct_rates.values()) else None
    if direct is not None and (streaming is None or direct < streaming):
        slowest = min(members, key=lambda name: direct_rates[name])
        capped = " (--bwlimit)" if direct_rates[slowest] == rates.bwlimit else ""
        return GroupChoice(members, len(files), size, "nas", {"broadcast": broadcast, "nas": direct},
                           f"each node reads the NAS at {_rate(direct_rates[slowest])}{capped} with {len(members)} "
                           f"reading ({slowest} the slowest)")
    return GroupChoice(members, len(files), size, "broadcast", {"broadcast": broadcast, "nas": direct}, bound)


def _capped(rate: float | None, limit: float | None) -> float | None:
    return rate if rate is None or limit is None else min(rate, limit)


def _direct_wins(groups: list[tuple[tuple[str, ...], tuple[Share, ...]]], rates: Rates) -> bool:
    return all(group.transport == "nas" for group in choose(groups, rates))


def _broadcast_rate(members: tuple[str, ...], rates: Rates) -> tuple[float | None, str]:
    """The chain's rate (or the most it could be, as far as the rates are known), and what sets
    it: the head's NAS read, a link into a node after it, or a node's CPU."""
    candidates = [(rates.nas_alone, f"its head reads the NAS at {_rate(rates.nas_alone)}")] if rates.nas_alone else []
    for index, name in enumerate(members):
        link, cpu, ceiling = rates.link.get(name), rates.cpu.get(name), rates.ceiling.get(name)
        if link and index:
            candidates.append((link, f"{name} receives at {_rate(link)} from the node before it"))
        if cpu:
            candidates.append((cpu, f"{name}'s CPU carries a relay at {_rate(cpu)}"))
        if ceiling:
            candidates.append((ceiling, f"{name}'s cores carry a relay at {_rate(ceiling)} at most"))
    if rates.bwlimit and candidates:
        candidates.append((rates.bwlimit, f"--bwlimit caps every node at {_rate(rates.bwlimit)}"))
    if not candidates:
        return None, "no rate known"
    return min(candidates, key=lambda item: item[0])


def _pace(hops: list[float], bounds: list[float]) -> float | None:
    """What the chain carries, for deciding whether direct reads are worth measuring: the median of
    its hops, and no more than any of `bounds` (a node's cores). Not the slowest hop: a node whose
    link or CPU is slow is the laggard rule's, moved to the tail where it holds no other node back;
    and on the lab's 2 cores one link, measured while the agents started, came out at 0.67 of what
    it carries, below the head's read of a NAS no faster than a link, and every node read the NAS
    on a usual run (CI). The choice itself still takes the slowest hop (_broadcast_rate)."""
    known = [statistics.median(hops)] if hops else []
    return min([*known, *bounds], default=None)


def _rate(rate: float | None) -> str:
    return "?" if rate is None else f"{format_size(int(rate))}/s"


def _line(group: GroupChoice, rates: Rates) -> str:
    how = "the broadcast" if group.transport == "broadcast" else "direct reads"
    other = "nas" if group.transport == "broadcast" else "broadcast"
    versus = (f"{group.seconds[group.transport]:.1f}s against {group.seconds[other]:.1f}s"
              if group.seconds[group.transport] is not None and group.seconds[other] is not None else
              f"{group.seconds[group.transport] or 0:.1f}s")
    told = f" (told: {', '.join(rates.told)})" if rates.told else ""
    return (f"transport: {how} for {group.files} files ({format_size(group.bytes)}) on {', '.join(group.nodes)}: "
            f"{versus} predicted; {group.limit}{told}")


# ---- measuring ------------------------------------------------------------------------------------

class Probes:
    """The run's measures, started as soon as the agents are (the links, while they plan), and
    completed once the groups are known, each only if it can change the choice."""

    def __init__(self, ray, agents: dict, watch: Watch, told: FleetConfig, bwlimit: int | None = None,
                 choosing: bool = True):
        self.ray, self.agents, self.watch, self.told = ray, agents, watch, told
        # --bwlimit: no node reads the NAS, nor sends to a peer, faster, whatever its link.
        self.bwlimit = float(bwlimit) if bwlimit else None
        self.links: dict = {}  # the link probes still out: ObjectRef -> the node pulling
        self.link_rates: dict[str, float] = {}
        self._payloads: dict = {}
        # Each node after the head pulls from the one before it, all at the same time. The link
        # into the head is no hop (the head reads the NAS): its pull, from the last node, measured
        # nothing the choice uses, and on the lab's 2 cores it held the next node's first piece
        # back 250 ms where it comes in 50 ms without it. Told the transport, the links serve the
        # chain's judging of its head only, which leaves out the link out of the head: its pull
        # filled a slow head's uplink for 2 s (6 MiB at 25 Mbit/s on the lab) just as it began to
        # read the NAS, whose ACKs then queued behind it, and every node started 2 s late.
        pulling = list(agents)[0 if choosing else 1:]
        if told.relay_rate is None and len(pulling) >= 2:
            payloads = {name: [agents[name].probe_payload.remote() for _ in range(PAYLOAD_PIECES)]
                        for name in pulling[:-1]}
            self.links = {agents[name].probe_pull.remote(payloads[before]): name
                          for before, name in zip(pulling, pulling[1:])}
            self._payloads = payloads

    def rates(self, groups: list[tuple[tuple[str, ...], tuple[Share, ...]]]) -> Rates:
        told = self.told
        keys = tuple(key for key in ("nas_rate", "nas_node_rate", "relay_rate") if getattr(told, key) is not None)
        if not groups:
            return Rates(told=keys, bwlimit=self.bwlimit)
        names = [name for name in self.agents if any(name in members for members, _ in groups)]
        largest = max((share for _, files in groups for share in files), key=lambda share: share.size)
        data = sum(share.size for _, files in groups for share in files)
        nas_alone, ceiling = self._nas_alone(names[0], largest, int(PROBE_SHARE * data))
        nas_each = self._nas_told(names)
        head_read = _capped(nas_alone, self.bwlimit)  # no node reads the NAS faster than --bwlimit
        if not nas_each and head_read is not None and self._nas_outruns(names, head_read, ceiling):
            nas_each, ceiling = self._nas_each(names, largest, data)
        # Direct reads that beat the most the broadcast could do need nothing more measured: by the
        # links so far, looked at while their pulls run (rough: HASTE_MARGIN times what they show),
        # then by the links measured (the CPU can only slow a chain).
        for links, done in self._links_as_they_come(names) if nas_each else ():
            most = links if done else {name: HASTE_MARGIN * rate for name, rate in links.items()}
            if _direct_wins(groups, Rates(nas_alone=nas_alone, nas_each=nas_each, link=most, ceiling=ceiling,
                                          bwlimit=self.bwlimit)):
                return Rates(nas_alone=nas_alone, nas_each=nas_each, link=links, ceiling=ceiling, told=keys,
                             bwlimit=self.bwlimit)
        link = self._links(names, wait=True)
        cpu = self._cpu(names)
        pace = _pace([rate for rate in (Rates(link=link, cpu=cpu).relay(name) for name in names[1:]) if rate], [])
        if not nas_each and head_read is not None and pace is not None and head_read > NAS_MARGIN * pace:
            nas_each, ceiling = self._nas_each(names, largest, data)  # the CPU, not the link, holds the chain back
        return Rates(nas_alone=nas_alone, nas_each=nas_each, link=link, cpu=cpu, ceiling=ceiling, told=keys,
                     bwlimit=self.bwlimit)

    def known_links(self) -> dict[str, float]:
        """What each link carries as far as measured, without waiting (told: relay_rate for every
        node), and no more than --bwlimit: for the chain, which judges its head by them
        (chain._Route._slow_head). Uncapped, a head reading the NAS at a 2 MiB/s --bwlimit was
        slower than a third of a loopback link's pull, and moved for nothing."""
        return {name: _capped(rate, self.bwlimit) for name, rate in self._known_links().items()}

    def _known_links(self) -> dict[str, float]:
        if self.told.relay_rate is not None:
            return self._told_links(list(self.agents))
        if self.links:
            ready, _ = self.ray.wait(list(self.links), num_returns=len(self.links), timeout=0)
            answers = {}
            for ref in ready:
                name = self.links.pop(ref)
                try:
                    answers[name] = self.ray.get(ref)
                except Exception:  # noqa: BLE001 - a pull that failed measured nothing
                    continue
            self._keep_links(answers)
        return dict(self.link_rates)

    def _told_links(self, names: list[str]) -> dict[str, float]:
        return {name: float(self.told.relay_rate) for name in names}

    def _keep_links(self, answers: dict[str, object]) -> None:
        """Keep the rates of the pulls that answered with one; once none is out, let go of the payloads."""
        self.link_rates.update({name: rate for name, rate in answers.items() if isinstance(rate, float)})
        if not self.links:
            self._payloads = {}  # the payloads leave the object stores

    def _nas_outruns(self, names: list[str], nas_alone: float, ceiling: dict[str, float]) -> bool:
        """Whether the NAS, read by the head alone, is NAS_MARGIN times faster than what the chain
        carries (_pace: the median of the links into the nodes after the head, at most the head's
        cores): worth measuring with every node. The head's ceiling bounds the chain from above, so
        a NAS NAS_MARGIN times faster than it needs no link measured. Else by the links' pulls as
        far as they have come, looked at every LINK_LOOK while they run, as soon as that is clear
        (HASTE_MARGIN), else once they are done: on a NAS faster than the links, waiting for the
        last piece (half a second on the lab's links) cost runs that direct reads take in three, and
        one look taken before the second piece was in waited for all of them; a pull measured over
        two pieces is rough. The link into the head is no hop: the head reads the NAS. Counted as
        one, a head whose pull was slowed by its neighbours' start (8 agents starting on the lab's 2
        cores) sent every node to read the NAS on usual runs."""
        if ceiling and nas_alone > NAS_MARGIN * min(ceiling.values()):
            return True
        for links, done in self._links_as_they_come(names[1:]):
            pace = _pace(list(links.values()), list(ceiling.values()))
            if pace is not None and nas_alone > (NAS_MARGIN if done else HASTE_MARGIN) * pace:
                return True
        return False

    def _links_as_they_come(self, names: list[str]):
        """The links into `names` as (rates, done): at each look while their pulls run (every
        LINK_LOOK, rates so far), then once they are done or PROBE_WAIT has passed. A caller that
        has what it needs stops asking."""
        until = time.monotonic() + PROBE_WAIT
        while self.links and time.monotonic() < until:
            yield self._links(names, wait=False), False
            _, running = self.ray.wait(list(self.links), num_returns=len(self.links), timeout=LINK_LOOK)
            if not running:
                break
        yield self._links(names, wait=True), True

    def _links(self, names: list[str], wait: bool) -> dict[str, float]:
        """Each node's link from the one before it: told, or as measured; unless `wait`, a pull
        not done yet gives its rate so far (none before its second piece)."""
        if self.told.relay_rate is not None:
            return self._told_links(names)
        if wait and self.links:
            answers = gather(self.ray, self.links, self.watch, time.monotonic() + PROBE_WAIT)
            self.links = {}
            self._keep_links(answers)
        if not self.links:
            return {name: rate for name, rate in self.link_rates.items() if name in names}
        running = [name for name in self.links.values() if name in names]
        so_far = self._ask({name: self.agents[name].probe_pulled.remote() for name in running})
        return {name: rate for name, rate in so_far.items() if isinstance(rate, float)}

    def _nas_alone(self, head: str, share: Share, cap: int) -> tuple[float | None, dict[str, float]]:
        """The head's NAS rate, reading alone, and its relay ceiling."""
        told = [rate for rate in (self.told.nas_rate, self.told.nas_node_rate) if rate is not None]
        if told:
            return float(min(told)), {}
        answers = self._ask({head: self.agents[head].probe_nas.remote(share.source, cap)})
        return (answers[head][0], {head: answers[head][1]}) if head in answers else (None, {})

    def _nas_told(self, names: list[str]) -> dict[str, float]:
        """Each node's direct rate as the manifest gives it: its own, or its share of the NAS."""
        told = self.told
        shared = told.nas_rate / len(names) if told.nas_rate is not None else None
        known = [rate for rate in (shared, told.nas_node_rate) if rate is not None]
        return {name: float(min(known)) for name in names} if known else {}

    def _nas_each(self, names: list[str], share: Share, data: int) -> tuple[dict[str, float], dict[str, float]]:
        """Every node's NAS rate, all reading at once, and their relay ceilings."""
        per_node = int(EACH_SHARE * data / len(names))
        answers = self._ask({name: self.agents[name].probe_nas.remote(share.source, per_node) for name in names})
        return ({name: rate for name, (rate, _) in answers.items()},
                {name: ceiling for name, (_, ceiling) in answers.items()})

    def _cpu(self, names: list[str]) -> dict[str, float]:
        if self.told.relay_rate is not None:
            return {}
        return self._ask({name: self.agents[name].probe_cpu.remote() for name in names})

    def _ask(self, calls: dict) -> dict:
        """Each node's answer, those that came within PROBE_WAIT and did not fail."""
        answers = gather(self.ray, {ref: name for name, ref in calls.items()}, self.watch,
                         time.monotonic() + PROBE_WAIT)
        return {name: answer for name, answer in answers.items() if not isinstance(answer, BaseException)}
