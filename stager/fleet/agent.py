"""A node's part in one broadcast fleet mirror, from its plan to its closing mirror, in one process:
a Ray actor pinned to the node (`num_cpus=0`) that makes the node's plan (the dry run), hosts its
relay, and runs its closing `stage mirror`.

Why one process: as `stage` commands of their own, the plan and the closing mirror cost every
node two more interpreter starts, two more walks of the NAS, and a sample of every file read
back from the NAS by every node, though its relay had just checked the file against a sample of
the NAS taken with the same seed. On the namespace lab those fixed rounds, not the chain, made
the fleet's time grow with N. Here the three share one DigestCache with the run's one seed.

What is trusted: a NAS sample in that cache was read from the NAS in this run by this node, or
by the fleet member that read the file's bytes from the NAS, whose sample arrived under the run's
key (relay.py); nothing else is in it. The node-local contract is unchanged: each call answers
what `stage mirror --node X --json` would have printed, with its exit code, in the shape of
node.run_on_node's answer. An agent that cannot start or dies is replaced by that command run as
a NodeCommand (node.py, driver.py): whatever fails falls back to the NAS for that node.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Callable

from stager.base.errors import EXIT_OK, EXIT_PROBLEMS, ending
from stager.fleet import probe
from stager.fleet.broadcast.relay import Relay
from stager.fleet.liveness import by_label
from stager.fleet.node import LOCK_WAIT
from stager.fleet.report import Progress


class NodeAgent:
    """One node's agent for one fleet run. The broadcast calls the relay's methods through it
    (open, run, reroute, close); the driver calls `plan` and `finish`, and `progress` once a
    second (liveness.Watch)."""

    def __init__(self, node: str, manifest_path: str, seed: int, full: bool = False, bwlimit: int | None = None,
                 streams: int | None = None):
        """`bwlimit` (bytes per second, --bwlimit): what the node reads from the NAS (its relay as a
        chain's head or fallback, its samples, its closing mirror: one bucket), and, in a bucket
        of its own, what its relay sends its downstreams. `streams` (--streams): the connections its
        relay receives each session on, else `[fleet] streams`, else its cores (relay.default_streams)."""
        from stager.base import hints
        from stager.mirror import pipeline as mirror
        from stager.manifest import load_manifest
        from stager.mirror.observe import DigestCache
        from stager.sources.throttle import Throttle

        manifest = load_manifest(manifest_path)
        hints.use_manifest(manifest_path)  # a `repair:` line in a report names the run's manifest
        self.node = node
        self.job = mirror.node_job(manifest, node, None, jobs=mirror.default_jobs(), seed=seed, bwlimit=bwlimit)
        # The job's source is the NAS: only nodes that stage from the NAS itself take part.
        self.digests = DigestCache(self.job.source, seed)
        self.full = full  # stage fleet mirror --full: the plan, the relay and the closing mirror alike
        self.relay = Relay(node, manifest.nodes[node].hub, self.digests, self.job.never_write, full,
                           streams or manifest.fleet.streams)
        self.relay.send_limit = Throttle(bwlimit) if bwlimit else None
        self.phase = "plan"
        self.link = probe.LinkProbe()  # the driver's measure of the link into this node
        # The closing mirror's bar: (step, bytes done, bytes to do, when its bytes last grew).
        self.copying: tuple[int, int, int, float | None] = (0, 0, 0, None)

    def progress(self) -> Progress:
        """What the node holds and where its bytes come from now, in its current phase: answered
        from counters, whatever its other calls are doing, so that an agent that does not answer
        is one that cannot (its processes stopped, its node hung), never one that is busy."""
        step, done, total, grew_at = self.copying
        held = self.relay.progress(self.phase)
        return replace(held, copy_done=done, copy_total=total, step=step,
                       grew_at=grew_at if self.phase == "mirror" else held.grew_at)

    def _count(self, total: int) -> Callable[[int], None]:
        """The closing mirror's progress bar, kept for `progress` (a --full mirror has two: its
        hashing of the node's files, then its copy)."""
        step = self.copying[0] + 1
        self.copying = (step, 0, total, None)
        lock = threading.Lock()

        def update(n: int) -> None:
            with lock:
                self.copying = (step, self.copying[1] + n, total, time.monotonic())

        return update

    # ---- the node-local command, in this process -------------------------------------------------

    def plan(self, budget: float) -> dict:
        """`stage mirror --dry-run`: what this node would copy, and why."""
        from stager.mirror.pipeline import mirror

        return _answer(lambda: mirror(self.job, full=self.full, dry_run=True, digests=self.digests), budget)

    def finish(self, budget: float) -> dict:
        """The closing `stage mirror`, once the relay has let go of the hub's lock: what the
        broadcast landed is found present and checked; the rest comes from the NAS; links,
        metadata and, last, the refs are written; all is verified against the NAS's samples."""
        from stager.mirror.pipeline import mirror

        self.phase = "mirror"
        answer = _answer(lambda: mirror(self.job, full=self.full, dry_run=False, wait=LOCK_WAIT,
                                        digests=self.digests, progress_factory=self._count), budget)
        self.phase = "done"
        return answer

    # ---- the broadcast's calls, to the relay ------------------------------------------------------

    def open(self, host: str, ports: tuple[int, int] | None, key: bytes, run_id: bytes) -> int:
        return self.relay.open(host, ports, key, run_id)

    def run(self, session, last: bool) -> dict:
        self.phase = "broadcast"
        return self.relay.run(session, last)

    def reroute(self, number: int, chain) -> None:
        self.relay.reroute(number, chain)

    def close(self) -> dict:
        return self.relay.close()

    # ---- the driver's measures, for its choice of transport (choice.py, probe.py) ----------------

    def probe_nas(self, rel: str, cap: int) -> tuple[float, float]:
        """Bytes per second this node reads `rel` from the NAS at, now; and the most its cores
        could give a relay."""
        return probe.read_nas(self.digests.source, rel, cap), probe.relay_ceiling()

    def probe_cpu(self) -> float:
        return probe.relay_work()

    def probe_payload(self) -> bytes:
        return probe.payload()

    def probe_pull(self, refs: list) -> float | None:
        """Bytes per second of the pulls of `refs` (the node before it's payload pieces; in a
        list, or Ray would fetch them before the call)."""
        import ray

        return self.link.pull(refs, ray)

    def probe_pulled(self) -> float | None:
        """The rate of those pulls so far."""
        return self.link.rate()


def start_agents(ray, manifest_path: str, names: list[str], seed: int, full: bool = False,
                 bwlimit: int | None = None, streams: int | None = None,
                 where: Callable[[str], dict] = by_label) -> dict:
    """An agent on each named node, pinned by `where` (its label, or its one live Ray node:
    liveness.placements). Creation returns at once; an agent that cannot start shows when it is
    first called. Its Ray name says its node and its run: named by the node alone, a second run on
    the cluster (another hub, or a run started while the last one's agents were being ended) was
    refused by Ray, the name taken."""
    actor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=32)(NodeAgent)
    run = f"{os.getpid()}-{time.time_ns()}"
    return {name: actor.options(**where(name), name=f"stage fleet agent {name} {run}").remote(
        name, manifest_path, seed, full, bwlimit, streams) for name in names}


def _answer(command: Callable, budget: float) -> dict:
    """The node-local command's answer: {code, stdout (its JSON), stderr (its error line),
    seconds, host, timed_out}. At `budget` the answer is "timed out" while the command goes on;
    the driver then ends the agent, and the command with it (a mirror killed at any point
    leaves only temp files, which the next one sweeps)."""
    started = time.monotonic()
    answer: dict = {}

    def work() -> None:
        try:
            report = command()
        except Exception as exc:  # noqa: BLE001 - the node-local contract: an exit code and one line
            code, message = ending(exc)
            answer.update(code=code, stdout=json.dumps({"error": message, "exit_code": code}),
                          stderr=f"stage: error: {message}\n")
        else:
            answer.update(code=EXIT_PROBLEMS if report.problems else EXIT_OK, stdout=json.dumps(report.to_json()),
                          stderr="")

    worker = threading.Thread(target=work, name="stage-fleet-command", daemon=True)
    worker.start()
    worker.join(max(0.1, budget))
    timed_out = worker.is_alive()
    if timed_out:
        answer = {"code": None, "stdout": "", "stderr": ""}
    return {**answer, "seconds": time.monotonic() - started, "host": socket.gethostname(), "timed_out": timed_out}
