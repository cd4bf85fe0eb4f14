"""Each node's part as the run goes, for a live display (a line per node: bytes, rate, ETA, where
from), and the one warning for nodes that read the NAS instead of their peers.

Where the driver learns it, without ever waiting for it:
- a broadcast node's agent answers the driver's progress call once a second anyway
  (liveness.Watch): what its relay holds and where from, then what its closing mirror copies;
- a node that runs its node-local command as a Ray task (--transport nas or sftp, a node that
  takes no part in the broadcast, one whose agent died) has that command write its byte counts
  to a pipe (base/progress_pipe.py); the task posts them to the run's Board, an actor, at most
  once a POST_INTERVAL, and the driver reads the board once a BOARD_INTERVAL.
A board that does not start, or answers late, leaves the tasks' lines without bytes, nothing more.

The fallback: a node that reads from the NAS what a peer could have sent it (it has no `address`,
fewer than two nodes have one, its agent died, its relay did not start) is named once, with its
reason, as soon as the bytes it sets out to copy are known (its mirror's first count), else at the
end of the run; the report keeps what it read (FleetReport.fallbacks).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from stager.base import progress_pipe
from stager.base.units import format_size
from stager.fleet.report import NAS, Fallback, NodeRun, Progress

POST_INTERVAL = 1.0  # a task posts its command's progress at most this often
BOARD_INTERVAL = 1.0  # the driver reads the board at most this often
DRAW_INTERVAL = 0.5  # the display is redrawn at most this often (and when a node ends)
RATE_WINDOW = 5.0  # seconds of samples a rate is taken over: a chunk's burst is not a rate


class Board:
    """The run's tasks post their node's progress here; the driver reads it. A Ray actor with no
    CPU, for the run only."""

    def __init__(self):
        self.latest: dict[str, Progress] = {}

    def put(self, node: str, progress: Progress) -> None:
        self.latest[node] = progress

    def read(self) -> dict[str, Progress]:
        return self.latest


class TaskProgress:
    """In a node's Ray task: the pipe its node-local command writes its counts to, read in a thread
    and posted to the run's board. `source` names where the command copies from (NAS, a peer)."""

    def __init__(self, board, node: str, argv: list[str], source: str | None):
        self.board, self.node, self.source = board, node, source
        self.command = argv[0]
        # A --full mirror first hashes the node's own files (its first bar), then copies.
        self.copy_step = 2 if self.command == "mirror" and "--full" in argv else 1
        self.read_fd, self.write_fd = os.pipe()
        self.thread = threading.Thread(target=self._read, name="stage-fleet-progress", daemon=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, progress_pipe.PROGRESS_FD: str(self.write_fd)}

    def started(self) -> None:
        """The command holds the write end now: this process lets go of its own."""
        os.close(self.write_fd)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(timeout=POST_INTERVAL)

    def _read(self) -> None:
        posted, last = 0.0, None
        with os.fdopen(self.read_fd, "rb") as pipe:
            for line in pipe:
                counts = progress_pipe.parse(line)
                if counts is None:
                    continue
                last = self._progress(*counts)
                if time.monotonic() - posted >= POST_INTERVAL or counts[1] >= counts[2]:
                    posted = time.monotonic()
                    self._post(last)
                    last = None
        if last is not None:
            self._post(last)

    def _progress(self, step: int, done: int, total: int) -> Progress:
        phase = "hash" if step < self.copy_step else self.command
        return Progress(phase, source=self.source if phase == "mirror" else None, copy_done=done,
                        copy_total=total, step=step)

    def _post(self, progress: Progress) -> None:
        try:
            self.board.put.remote(self.node, progress)
        except Exception:  # noqa: BLE001 - the board is gone: the run goes on without its lines
            pass


@dataclass(frozen=True)
class NodeState:
    """What the display shows of one node now."""

    node: str
    doing: str  # "planning", "receiving", "copying", ...; once ended, the node's status
    source: str | None = None  # where its bytes come from now: NAS, a peer's name
    done_bytes: int | None = None
    total_bytes: int | None = None
    rate: float | None = None  # bytes per second over the last RATE_WINDOW
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
    once its bytes are known. `board`: start a Board for the tasks' counts (only when something
    shows them)."""

    def __init__(self, ray, command: str, names: list[str], *, show: Callable[[list[str]], None] | None = None,
                 warn: Callable[[str], None] | None = None, board: bool = False, full: bool = False):
        self.ray, self.command, self.names = ray, command, list(names)
        self.show, self.warn = show, warn
        # A --full mirror's first bar hashes the node's own files; its second copies.
        self.copy_step = 2 if full and command == "mirror" else 1
        self.started = time.monotonic()
        self.wants_board = board
        self.board = None  # started with the first task, once the driver has joined the cluster
        self.asked = None  # a read of the board not answered yet
        self.asked_at = 0.0
        self.tasks: dict[str, Progress] = {}  # node -> its task's latest progress, from the board
        self.agents: dict[str, Progress] = {}  # node -> its agent's last answer seen
        self.as_tasks: set[str] = set()  # nodes whose node-local command ran as a Ray task
        self.samples: dict[str, deque] = {}  # node -> (when, what it was doing, bytes done), for its rate
        self.drawn = 0.0
        self.ended: set[str] = set()
        self.direct: list[_Direct] = []
        self.named: set[str] = set()

    # ---- what the driver tells it ------------------------------------------------------------------

    def task_args(self, node: str, source: str | None) -> tuple:
        """The extra arguments of a node's task (node.run_on_node): the board, and how to name
        the node and its source, when there is a board."""
        if self.wants_board:
            self.wants_board = False
            try:
                self.board = self.ray.remote(num_cpus=0, max_restarts=0)(Board).options(
                    name=f"stage fleet board {os.getpid()}-{time.time_ns()}").remote()
            except Exception:  # noqa: BLE001 - no board: the tasks' lines go without bytes
                self.board = None
        return (self.board, node, source) if self.board is not None else ()

    def reads_nas(self, nodes: list[str], why: str, every: bool = False) -> None:
        """`nodes` read from the NAS what their peers could send them, for `why`. Each node is
        named once in a run."""
        fresh = tuple(node for node in nodes if node not in self.named)
        if fresh:
            self.named.update(fresh)
            self.direct.append(_Direct(fresh, why, every))

    def end(self) -> None:
        if self.board is not None:
            try:
                self.ray.kill(self.board, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with the cluster already
                pass
            self.board = None

    # ---- each look ---------------------------------------------------------------------------------

    def tick(self, driver, final: bool = False) -> None:
        now = time.monotonic()
        self._read_board(now)
        watch = driver.watch
        if watch is not None:
            self.agents.update(watch.latest)
        tasks = {node: source for node, source, agent in driver.running.values() if agent is None}
        self.as_tasks.update(tasks)
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

    def _read_board(self, now: float) -> None:
        if self.board is None:
            return
        if self.asked is not None:
            ready, _ = self.ray.wait([self.asked], num_returns=1, timeout=0)
            if not ready:
                return
            try:
                self.tasks.update(self.ray.get(ready[0]))
            except Exception:  # noqa: BLE001 - the board died: the tasks' lines go without bytes
                self.board = None
                return
            finally:
                self.asked = None
        if now - self.asked_at >= BOARD_INTERVAL:
            self.asked, self.asked_at = self.board.read.remote(), now

    def _state(self, node: str, now: float, driver, tasks: dict[str, str | None]) -> NodeState:
        run = driver.runs.get(node)
        if run is not None:
            # A task's mirror copied all it got; a broadcast node's bytes are its relay's too, whose
            # last answer may predate its last chunk: the table has them.
            got = run.bytes if self.command == "mirror" and node in self.as_tasks else None
            return NodeState(node, run.status, done_bytes=got, seconds=run.seconds or now - self.started,
                             ended=True)
        elapsed = now - self.started
        watch = driver.watch
        if watch is not None and node in watch.stalled:
            return NodeState(node, "stalled", seconds=elapsed)
        if node in tasks:
            task = self.tasks.get(node)
            if task is None:
                return NodeState(node, f"running stage {self.command}", seconds=elapsed)
            doing = {"hash": "hashing", "mirror": "copying", "verify": "verifying"}.get(task.phase, task.phase)
            return self._moving(node, doing, task.source, task.copy_done, task.copy_total, (task.phase, task.step),
                                now)
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
                                agent.total_bytes, ("broadcast", agent.session), now)
        if agent.phase == "mirror" and agent.copy_total:
            copying = agent.step >= self.copy_step
            return self._moving(node, "copying" if copying else "hashing", NAS if copying else None, agent.copy_done,
                                agent.copy_total, ("mirror", agent.step), now)
        return NodeState(node, "finishing" if agent.phase in ("mirror", "done") else "waiting", seconds=elapsed)

    def _moving(self, node: str, doing: str, source: str | None, done: int, total: int, what: tuple,
                now: float) -> NodeState:
        samples = self.samples.get(node)
        if samples is None or samples[-1][1] != what:
            samples = self.samples[node] = deque()
        samples.append((now, what, done))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        first_at, _, first = samples[0]
        rate = (done - first) / (now - first_at) if now - first_at >= 1.0 else None
        return NodeState(node, doing, source, done, total, rate, now - self.started)

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
