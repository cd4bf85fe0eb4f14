"""Whether a node is still there. Three signs, each judged within a bound, so that no node holds a
fleet run until its --timeout:

- **Its Ray node left the cluster** (the machine died, its raylet was killed): Ray's node table
  says so (`live_labels`), looked at every LOOK_INTERVAL. Ray never fails a task pinned by label
  to a dead node; it waits for the label to come back.
- **Its agent died** (kill -9, out of memory): the agent's calls fail at once. Whether the node
  itself still runs anything is asked with a task of nothing (`Pings`): answered within SILENCE,
  the node is alive; not, it is gone.
- **It answers nothing** (its processes stopped by SIGSTOP, a hung kernel, a paused VM): Ray keeps
  it in its node table as long as its health checks allow (30 s and more by default), and its
  calls neither return nor fail. Every node's actor (its broadcast agent, or the NodeCommand that
  runs its node-local command) is asked for its progress once a LOOK_INTERVAL (`Watch`), never
  waited on; one that has answered nothing for SILENCE is stalled.

What is trusted: an answer, and the time it came. A slow node still answers (its progress call
is a few counters read in a thread of its own), so silence is never taken for slowness: that is
the laggard rule's (broadcast/chain.py), by rate.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from typing import Callable

from stager.fleet.node import LABEL
from stager.fleet.report import Progress

LOOK_INTERVAL = 1.0
# How long a node may answer nothing before it counts as gone: a task of nothing after its agent
# died, or its agent's progress call. One bound for a death and a silence. The ping's task may
# need a Ray worker started on the node (seconds on a loaded one); an agent's progress call is
# answered in milliseconds, on the lab's 2 shared cores in 243 ms at most (docs/fleet.md, "A node
# that freezes"). A node stopped half-way once held `stage fleet mirror` until its --timeout
# (3,600 s), and its downstream waited 15 s (upstream.STALL_TIMEOUT) before it routed around it.
SILENCE = 10.0
# An agent's first answer: a Ray worker starting, its imports, the manifest, an SSH session to the
# NAS (up to 9 s on the loaded lab). The relays' start is given as long (broadcast/chain.py).
START = 60.0
# Answers kept per node, by look: the laggard rule compares the nodes' answers to the same look.
KEPT_LOOKS = 4


# How long the driver waits for a raylet to accept a connection, when two live Ray nodes claim one label.
RAYLET_CONNECT = 1.0


def live_labels(ray) -> set[str]:
    """The stage-node labels of the Ray nodes alive now."""
    return set(_claims(ray))


def _claims(ray) -> dict[str, list[dict]]:
    """Each stage-node label alive now, and the live Ray nodes that carry it."""
    claims: dict[str, list[dict]] = {}
    for node in ray.nodes():
        label = node.get("Labels", {}).get(LABEL)
        if node.get("Alive") and label:
            claims.setdefault(label, []).append(node)
    return claims


def placements(ray) -> dict[str, dict]:
    """For each stage-node label alive now, the Ray options (`.options(**...)`) that run a task or
    an actor on it: its label. But a label two live Ray nodes claim is a node that came back (a
    restarted raylet, a rebooted host) while the GCS still counts its old incarnation alive, until
    its health check gives up (30 s by default, 300 s on the lab). Scheduled by label, an agent
    landed on the old one, never ran, and its node read the whole data from the NAS beside the
    head: the first run after a rejoin took 1.75x (docs/fleet-lab.md). Such a label is pinned to
    the one of its Ray nodes whose raylet accepts a connection; to its label if not exactly one does."""
    return {label: _placement(label, nodes) for label, nodes in _claims(ray).items()}


def by_label(label: str) -> dict:
    return {"label_selector": {LABEL: label}}


def _placement(label: str, nodes: list[dict]) -> dict:
    if len(nodes) > 1:
        answering = [node for node in nodes if _raylet_answers(node)]
        if len(answering) == 1:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(answering[0]["NodeID"], soft=False)}
    return by_label(label)


def _raylet_answers(node: dict) -> bool:
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=RAYLET_CONNECT):
            return True
    except (OSError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class Stall:
    """An agent judged silent: how long it had answered nothing, and its last answer (what the
    node held then), None if it never answered."""

    node: str
    silent: float
    last: Progress | None


class Watch:
    """Every watched node's actor (`agents`: node -> an actor with a `progress` method) asked for
    its progress at each look (at most one a LOOK_INTERVAL), every answer taken without waiting:
    the latest per node, the last few per look, and in `stalled` the nodes silent for SILENCE
    (START before a first answer). A node is silent from
    the ask of its oldest call still unanswered after the latest it answered: a look that asked
    nothing (the driver busy elsewhere) makes no node silent. Counted from when the answer was
    taken instead, a node stopped just after an answer was judged a look late; counted from the
    latest call answered, a pause between looks made every node look silent (the 8-node lab moved
    five healthy nodes to the tail). A stalled agent is asked nothing more; its calls still pending
    are left to Ray (the driver ends the agent)."""

    def __init__(self, ray, agents: dict, silence: float = SILENCE, start: float = START):
        self.ray, self.agents, self.silence, self.start = ray, dict(agents), silence, start
        self.asking: dict = {}  # ObjectRef -> (node, look number)
        self.looks: list[float] = []  # when each look asked (monotonic), by look number
        self.answered: dict[str, int] = {}  # node -> the latest look it answered
        self.latest: dict[str, Progress] = {}
        self.by_look: dict[str, dict[int, Progress]] = {}  # node -> look number -> its answer to it
        self.stalled: dict[str, Stall] = {}
        self.on_look: Callable[[], None] | None = None  # told after each look: the driver's live display

    def add(self, node: str, actor) -> None:
        """Watch the node's new actor (its node-local command after its agent died): its answers
        count from now, none of the last actor's."""
        self.forget(node)
        self.latest.pop(node, None)
        self.by_look.pop(node, None)
        self.answered.pop(node, None)
        self.agents[node] = actor

    def forget(self, node: str) -> None:
        """Watch the node no more: its agent died (the death has its own path), or its part is over."""
        self.agents.pop(node, None)
        self.asking = {ref: asked for ref, asked in self.asking.items() if asked[0] != node}

    def look(self) -> list[Stall]:
        """Take the answers that came, ask again if a LOOK_INTERVAL has passed, and return the
        agents newly found stalled."""
        now = time.monotonic()
        self._take_answers()
        if not self.looks or now - self.looks[-1] >= LOOK_INTERVAL:
            self.looks.append(now)
            waiting = {node for node, _number in self.asking.values()}
            for node, agent in self.agents.items():
                if node in waiting and node not in self.latest:
                    continue  # not started yet: one call waits for it, not one per look
                self.asking[agent.progress.remote()] = (node, len(self.looks) - 1)
        found = self._judge(now)
        if self.on_look is not None:
            self.on_look()
        return found

    def pending(self) -> list:
        """The calls asked and not yet taken: a wait that should end when an answer comes waits on them too."""
        return list(self.asking)

    def silent_for(self, seconds: float) -> set[str]:
        """The watched agents that have answered before and have been silent for `seconds`: not
        stalled yet, but nothing should wait on them meanwhile."""
        now = time.monotonic()
        return {node for node, since in self._silent_since().items()
                if node in self.latest and now - since >= seconds}

    def next_look(self) -> float:
        """Seconds until the watch has something to do: ask again, or judge a node whose silence
        runs out. A wait loop waits no longer than this between looks."""
        now = time.monotonic()
        due = [self.looks[-1] + LOOK_INTERVAL] if self.looks else [now]
        due += [since + self._bound(node) for node, since in self._silent_since().items()]
        return max(0.0, min(LOOK_INTERVAL, min(due) - now))

    def _silent_since(self) -> dict[str, float]:
        """Per node with a call unanswered since the latest it answered: when the oldest was asked."""
        since: dict[str, float] = {}
        for node, number in self.asking.values():
            if number > self.answered.get(node, -1):
                since[node] = min(since.get(node, math.inf), self.looks[number])
        return since

    def _bound(self, node: str) -> float:
        return self.silence if node in self.latest else self.start

    def same_look(self, nodes: set[str]) -> tuple[float, dict[str, Progress]] | None:
        """The latest look every one of `nodes` has answered: when it asked, and their answers.
        Answers to one look were read within a moment of each other; the latest answer of each
        could be a second apart, many chunks at link speed."""
        for number in range(len(self.looks) - 1, max(-1, len(self.looks) - 1 - KEPT_LOOKS), -1):
            if all(number in self.by_look.get(node, {}) for node in nodes):
                return self.looks[number], {node: self.by_look[node][number] for node in nodes}
        return None

    def answers(self, node: str) -> list[tuple[float, Progress]]:
        """The node's answers kept, oldest first, each with when its look asked. Each answer's
        counts were read on the node's own clock (Progress.read_at): a rate between two of them
        holds however late either reached the driver."""
        return [(self.looks[number], answer) for number, answer in sorted(self.by_look.get(node, {}).items())]

    def _take_answers(self) -> None:
        if not self.asking:
            return
        ready, _ = self.ray.wait(list(self.asking), num_returns=len(self.asking), timeout=0)
        for ref in ready:
            asked = self.asking.pop(ref, None)
            if asked is None:
                continue  # forgotten meanwhile
            node, number = asked
            try:
                answer = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError:
                answer = None  # the agent answered, though not with its progress: it runs
            except self.ray.exceptions.RayError:
                # Not the agent's answer but Ray's: the actor, its worker or its node is gone (its
                # other calls fail too, and the death path takes it).
                self.forget(node)
                continue
            self.answered[node] = max(self.answered.get(node, -1), number)
            if isinstance(answer, Progress):
                self.latest[node] = answer
                kept = self.by_look.setdefault(node, {})
                kept[number] = answer
                for old in [n for n in kept if n <= number - KEPT_LOOKS]:
                    del kept[old]

    def _judge(self, now: float) -> list[Stall]:
        found = [Stall(node, now - since, self.latest.get(node)) for node, since in self._silent_since().items()
                 if now - since >= self._bound(node)]
        for stall in found:
            self.stalled[stall.node] = stall
            self.forget(stall.node)
        return found


def gather(ray, refs: dict, watch: Watch, until: float) -> dict[str, object]:
    """Each node's answer to one call (`refs`: ObjectRef -> node): its value, or the exception the
    call raised, in the order of `refs` (not of arrival: the plans' order is the chain's, manifest
    order, head first). Waits until `until` at most, and not for a node the watch finds stalled: a
    node missing from the answers did not answer."""
    pending, answers = dict(refs), {}
    while pending and time.monotonic() < until:
        ready, _ = ray.wait(list(pending), num_returns=len(pending),
                            timeout=max(0.0, min(watch.next_look(), until - time.monotonic())))
        for ref in ready:
            node = pending.pop(ref)
            try:
                answers[node] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the caller decides what a failed call means
                answers[node] = exc
        watch.look()
        pending = {ref: node for ref, node in pending.items() if node not in watch.stalled}
    return {node: answers[node] for node in refs.values() if node in answers}


class Pings:
    """Nodes whose agent died, each asked to run a task of nothing: one that does within SILENCE
    is alive (only its agent died, and its node-local command can take the agent's part); one that
    does not is gone. Asked at once, not when the driver next collects."""

    def __init__(self, ray, where: Callable[[str], dict] = by_label):
        self.ray = ray
        self.where = where  # a node's Ray options (placements)
        self.task = ray.remote(num_cpus=0, max_retries=0)(_nothing)
        self.asked: dict = {}  # ObjectRef -> (node, answer by (monotonic), why its agent died)

    def ask(self, node: str, why: str) -> None:
        ref = self.task.options(**self.where(node), name=f"stage fleet ping {node}").remote()
        self.asked[ref] = (node, time.monotonic() + SILENCE, why)

    def nodes(self) -> set[str]:
        return {node for node, _by, _why in self.asked.values()}

    def first_due(self) -> float:
        """When the next unanswered ping runs out (monotonic; inf with none)."""
        return min((by for _node, by, _why in self.asked.values()), default=math.inf)

    def answered(self, ref) -> tuple[str, str, bool]:
        """A ping that came back: (node, why its agent died, whether the task ran)."""
        node, _by, why = self.asked.pop(ref)
        try:
            self.ray.get(ref, timeout=1.0)
        except Exception:  # noqa: BLE001 - the node went while it was asked
            return node, why, False
        return node, why, True

    def overdue(self) -> tuple[str, str] | None:
        """A node that ran nothing within SILENCE: (node, why its agent died); its ping is cancelled."""
        for ref, (node, by, why) in list(self.asked.items()):
            if time.monotonic() >= by:
                self._cancel(ref)
                return node, why
        return None

    def drop_all(self) -> list[tuple[str, str]]:
        """At the deadline: every ping still unanswered, cancelled: [(node, why its agent died)]."""
        dropped = [(node, why) for node, _by, why in self.asked.values()]
        for ref in list(self.asked):
            self._cancel(ref)
        return dropped

    def _cancel(self, ref) -> None:
        self.asked.pop(ref, None)
        try:
            self.ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - it may have finished meanwhile
            pass


def _nothing() -> None:
    """The task `Pings` runs to learn whether a node still runs tasks."""
