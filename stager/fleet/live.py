"""Each node's part as the run goes, for a live display (a line per node: bytes, rate, ETA, where
from), and the one warning for nodes that read the NAS instead of their peers.

Where the driver learns it, without ever waiting for it: every node's actor answers the driver's
progress call once a second anyway (liveness.Watch). A broadcast node's agent says what its relay
holds and where from, then what its closing mirror copies; a node that runs its node-local command
(--transport nas or sftp, a node that takes no part in the broadcast, one whose agent died) says
the byte counts that command writes to a pipe (node.NodeCommand, base/progress_pipe.py).

The fallback: a node that reads from the NAS what a peer could have sent it (it has no `address`,
fewer than two nodes have one, its agent died, its relay did not start) is named once, with its
reason, as soon as the bytes it sets out to copy are known (its mirror's first count), else at the
end of the run; the report keeps what it read (FleetReport.fallbacks).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from stager.base.units import format_size
from stager.fleet.report import NAS, Fallback, NodeRun, Progress

DRAW_INTERVAL = 0.5  # the display is redrawn at most this often (and when a node ends)
RATE_WINDOW = 5.0  # seconds of samples a rate is taken over: a chunk's burst is not a rate


@dataclass(frozen=True)
class NodeState:
    """What the display shows of one node now."""

    node: str
    doing: str  # "planning", "receiving", "copying", ...; once ended, the node's status
    source: str | None = None  # where its bytes come from now: NAS, a peer's name
    done_bytes: int | None = None
    total_bytes: int | None = None
    rate: float | None = None  # bytes per second over about the last RATE_WINDOW (Tracker._rate)
    seconds: float = 0.0  # since the run started; once ended, the node's own seconds
    ended: bool = False

    @property
    def eta(self) -> float | None:
        if not self.rate or self.total_bytes is None or self.done_bytes is None:
            return None
        return max(0, self.total_bytes - self.done_bytes) / self.rate

    def line(self, width: int) -> str:
        """One line: `dgx2  receiving from dgx1   1.20 GiB of 9.00 GiB  112.40 MiB/s  ETA 1:10`."""
        what = self.doing + (f" from {self.source}" if self.source else "")
        parts = [self.node.ljust(width), what.ljust(22)]
        if self.ended:
            if self.done_bytes:
                parts.append(format_size(self.done_bytes))
            parts.append(f"in {clock(self.seconds)}")
            return "  ".join(parts).rstrip()
        if self.total_bytes:
            parts.append(f"{format_size(self.done_bytes or 0)} of {format_size(self.total_bytes)}")
            if self.rate is not None:
                parts.append(f"{format_size(int(self.rate))}/s")
            eta = self.eta
            parts.append(f"ETA {clock(eta)}" if eta is not None else clock(self.seconds))
        else:
            parts.append(clock(self.seconds))
        return "  ".join(parts).rstrip()


def clock(seconds: float) -> str:
    """0:07, 1:10, 1:02:03."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


@dataclass
class _Direct:
    nodes: tuple[str, ...]
    why: str
    every: bool  # every node of the run reads for itself: one read of the data is owed anyway
    said: Fallback | None = None


class Tracker:
    """The run's nodes as they go: `tick(driver)` (from the driver's waits and each of the watch's
    looks) reads what is known without waiting, hands the display its lines, and says a fallback
    once its bytes are known."""

    def __init__(self, command: str, names: list[str], *, show: Callable[[list[str]], None] | None = None,
                 warn: Callable[[str], None] | None = None, full: bool = False):
        self.command, self.names = command, list(names)
        self.show, self.warn = show, warn
        # A --full mirror's first bar hashes the node's own files; its second copies.
        self.copy_step = 2 if full and command == "mirror" else 1
        self.started = time.monotonic()
        self.tasks: dict[str, Progress] = {}  # node -> its node-local command's latest progress
        self.agents: dict[str, Progress] = {}  # node -> its agent's last answer seen
        self.as_tasks: set[str] = set()  # nodes whose node-local command ran in a NodeCommand
        # node -> (what it was doing, read at, grew at, bytes done) of its recent answers, for its rate
        self.samples: dict[str, deque] = {}
        self.drawn = 0.0
        self.ended: set[str] = set()
        self.direct: list[_Direct] = []
        self.named: set[str] = set()

    # ---- what the driver tells it ------------------------------------------------------------------

    def reads_nas(self, nodes: list[str], why: str, every: bool = False) -> None:
        """`nodes` read from the NAS what their peers could send them, for `why`. Each node is
        named once in a run."""
        fresh = tuple(node for node in nodes if node not in self.named)
        if fresh:
            self.named.update(fresh)
            self.direct.append(_Direct(fresh, why, every))

    # ---- each look ---------------------------------------------------------------------------------

    def tick(self, driver, final: bool = False) -> None:
        now = time.monotonic()
        tasks = {part.node: part.source for part in driver.running.values() if not part.agent}
        self.as_tasks.update(tasks)
        for node, progress in driver.watch.latest.items():
            (self.tasks if node in tasks else self.agents)[node] = progress
        states = [self._state(node, now, driver, tasks) for node in self.names]
        self._say_known(driver.runs)
        newly_ended = {state.node for state in states if state.ended} - self.ended
        self.ended |= newly_ended
        if self.show is not None and (final or newly_ended or now - self.drawn >= DRAW_INTERVAL):
            self.drawn = now
            width = max((len(node) for node in self.names), default=0)
            self.show([state.line(width) for state in states])

    def fallbacks(self, runs: dict[str, NodeRun]) -> tuple[Fallback, ...]:
        """At the end of the run (runs with their deliveries): each fallback with what its nodes
        read from the NAS, those found only now (a relay that did not start) too; any not said
        yet is said now."""
        for run in runs.values():
            whole = [f for f in (run.delivery.fallbacks if run.delivery else ()) if f.get("path") is None]
            if whole:
                self.reads_nas([run.node], str(whole[0].get("why")))
        final = []
        for direct in self.direct:
            read = [runs[node].delivery.nas_bytes if node in runs and runs[node].delivery else 0
                    for node in direct.nodes]
            fallback = _fallback(direct, read)
            if direct.said is None and self.warn is not None:
                self.warn(fallback.line())
            direct.said = fallback
            final.append(fallback)
        return tuple(final)

    # ---- inside ------------------------------------------------------------------------------------

    def _state(self, node: str, now: float, driver, tasks: dict[str, str | None]) -> NodeState:
        run = driver.runs.get(node)
        if run is not None:
            # A task's mirror copied all it got; a broadcast node's bytes are its relay's too, whose
            # last answer may predate its last chunk: the table has them.
            got = run.bytes if self.command == "mirror" and node in self.as_tasks else None
            return NodeState(node, run.status, done_bytes=got, seconds=run.seconds or now - self.started,
                             ended=True)
        elapsed = now - self.started
        if node in driver.watch.stalled:
            return NodeState(node, "stalled", seconds=elapsed)
        if node in tasks:
            task = self.tasks.get(node)
            if task is None:
                return NodeState(node, f"running stage {self.command}", seconds=elapsed)
            doing = {"hash": "hashing", "mirror": "copying", "verify": "verifying"}.get(task.phase, task.phase)
            return self._moving(node, doing, task.source, task.copy_done, task.copy_total, (task.phase, task.step),
                                task, now)
        if node in driver.pings.nodes():
            return NodeState(node, "agent died; asking its node", seconds=elapsed)
        agent = self.agents.get(node)
        if agent is None:
            return NodeState(node, "starting", seconds=elapsed)
        if agent.phase == "plan":
            return NodeState(node, "planning", seconds=elapsed)
        if agent.phase == "broadcast" and agent.total_bytes:
            source = NAS if agent.source == "nas" else agent.source
            return self._moving(node, "receiving" if source else "connecting", source, agent.done_bytes,
                                agent.total_bytes, ("broadcast", agent.session), agent, now)
        if agent.phase == "mirror" and agent.copy_total:
            copying = agent.step >= self.copy_step
            return self._moving(node, "copying" if copying else "hashing", NAS if copying else None, agent.copy_done,
                                agent.copy_total, ("mirror", agent.step), agent, now)
        return NodeState(node, "finishing" if agent.phase in ("mirror", "done") else "waiting", seconds=elapsed)

    def _moving(self, node: str, doing: str, source: str | None, done: int, total: int, what: tuple,
                 progress: Progress, now: float) -> NodeState:
        return NodeState(node, doing, source, done, total, self._rate(node, what, done, progress),
                         now - self.started)

    def _rate(self, node: str, what: tuple, done: int, progress: Progress) -> float | None:
        """Bytes per second over about RATE_WINDOW, on the node's own clock: the bytes counted since
        the instant the oldest kept count was reached, over the time from that instant to the
        latest reading. Counts move in steps (a 1 MiB chunk, a progress line): a rate from one
        reading to the next would count a chunk that landed just after the first reading as if
        it took the whole interval (3 MiB/s shown at a 2 MiB/s --bwlimit). From an instant of
        growth, only bytes that came after it count, so the rate never shows more than moved.
        `what` is the phase the count belongs to: a new one starts a new window."""
        samples = self.samples.get(node)
        if samples is None or (samples and samples[-1][0] != what):
            samples = self.samples[node] = deque()
        if progress.grew_at is None:
            return None
        if not samples or samples[-1][1] != progress.read_at:
            samples.append((what, progress.read_at, progress.grew_at, done))
        while len(samples) > 2 and progress.read_at - samples[1][1] >= RATE_WINDOW:
            samples.popleft()
        _, _, since, first = samples[0]
        span = progress.read_at - since
        return (done - first) / span if span >= 1.0 else None

    def _say_known(self, runs: dict[str, NodeRun]) -> None:
        for direct in self.direct:
            if direct.said is not None:
                continue
            known = [self._planned(node, runs) for node in direct.nodes]
            if all(bytes_ is not None for bytes_ in known):
                direct.said = _fallback(direct, known)
                if self.warn is not None:
                    self.warn(direct.said.line())

    def _planned(self, node: str, runs: dict[str, NodeRun]) -> int | None:
        """What the node copies from the NAS, once known: its mirror's count of what it set out to
        copy, or what it copied once it ended."""
        run = runs.get(node)
        if run is not None:
            return int((run.report or {}).get("copied_bytes") or 0)
        task = self.tasks.get(node)
        return task.copy_total if task is not None and task.phase == "mirror" else None


def _fallback(direct: _Direct, read: list[int]) -> Fallback:
    total = sum(read)
    return Fallback(direct.nodes, direct.why, total, total - max(read, default=0) if direct.every else total)
