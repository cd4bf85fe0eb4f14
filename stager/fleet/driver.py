"""The fleet driver: which node runs what, and what each one reported.

Each node runs its node-local command (`stage mirror --node X --json`, ...) as a subprocess of a
Ray actor (node.NodeCommand) scheduled with the label selector `stage-node=X` and `num_cpus=0`:
the exit code and the JSON are exactly the node-local contract, and the actor never holds a CPU
slot that GPU work is waiting for. A node that is not in the Ray cluster, or that has not
answered by the deadline, is reported as unreachable (exit 3); the fleet's exit code is the
worst node's.

For `mirror` the driver also decides where each node's bytes come from (the transport): its own
source (`nas`), a staged peer over SFTP (`sftp`, --fan-out), or, for the files two or more
nodes need, the broadcast (`broadcast`, the default), after which each node's own mirror finishes
(started as soon as that node has received its part). It never knows how a byte moves:
that is the transport's, and a transport never decides what a node needs. Whether a node is
still there (its Ray node, its actor, its answers) is liveness.py's; a node whose actor (its
broadcast agent or its NodeCommand) answers nothing for liveness.SILENCE is reported `stalled`
(exit 3) with what it held.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, NamedTuple

from stager.base.errors import BadInput
from stager.fleet.cluster import CONNECT_TIMEOUT, connect, require_ray
from stager.fleet.live import Tracker
from stager.fleet.liveness import SILENCE, Pings, Watch, by_label, gather, live_labels, placements
from stager.fleet.node import LABEL, LOCK_WAIT, NodeCommand, node_argv
from stager.fleet.options import (
    BroadcastOptions, PruneOptions, broadcast_options, choose_transport, mirror_options, prune_options,
    verify_options,
)
from stager.fleet.report import NAS, Delivery, FleetReport, NodeRun, from_answer, stalled, unreachable
from stager.manifest import Manifest

if TYPE_CHECKING:
    from stager.fleet.choice import Choice


def run_fleet(manifest: Manifest, command: str, nodes: list[str] | None, *, timeout: float,
              fan_out: bool = False, transport: str | None = None, ports: str | None = None, full: bool = False,
              subset: str | None = None, prune: PruneOptions = PruneOptions(), bwlimit: str | None = None,
              streams: int | None = None, allow_unauthenticated: bool = False,
              show: Callable[[list[str]], None] | None = None,
              warn: Callable[[str], None] | None = None) -> FleetReport:
    """`show` is handed a line per node as the run goes (live.Tracker), `warn` the warning for
    nodes that read the NAS instead of their peers, once."""
    names = list(dict.fromkeys(nodes or manifest.nodes))
    if not names:
        raise BadInput(f"{manifest.path}: nodes: no nodes to run on")
    for name in names:
        manifest.node(name)
    # Told nothing, the broadcast chooses per group between itself and direct reads (choice.py).
    choosing = transport is None and not fan_out
    told = transport is not None or fan_out
    transport = choose_transport(manifest, command, names, fan_out, transport)
    told_broadcast = broadcast_options(transport, ports, streams, full, bwlimit)
    options = verify_options(command, full, subset) + prune_options(command, prune) + mirror_options(
        command, bwlimit)
    require_ray()
    started = time.monotonic()
    tracker = Tracker(command, names, show=show, warn=warn, full=full)
    if transport == "nas" and not told:
        tracker.reads_nas(*everyone_reads_nas(manifest, names))
    # Ray prints what its raylets report (a worker killed, ...) on this process's stdout, where
    # --json promises one object: while Ray is up, whatever it prints goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        address, auth, runs, delivered, choice = _run(manifest, command, names, transport, told_broadcast, options,
                                                      started, timeout, allow_unauthenticated, choosing, tracker)
    if choice is not None:
        transport = choice.transport
    if transport is not None:
        runs = {name: with_delivery(manifest, runs[name], transport, delivered.get(name)) for name in names}
    return FleetReport(command, tuple(runs[name] for name in names), time.monotonic() - started,
                       transport == "sftp", address, auth, transport, choice,
                       tracker.fallbacks(runs) if command == "mirror" else (), manifest.nas.hub)


def _run(manifest: Manifest, command: str, names: list[str], transport: str | None,
         told_broadcast: BroadcastOptions, options: tuple[str, ...], started: float, timeout: float,
         allow_unauthenticated: bool, choosing: bool, tracker: Tracker):
    ray, address, auth = connect(min(CONNECT_TIMEOUT, timeout), allow_unauthenticated)
    delivered: dict[str, dict] = {}
    try:
        driver = Driver(ray, manifest, command, started + timeout, timeout, options, tracker=tracker)
        if transport == "sftp":
            from stager.fleet.sftp_tree import fan_out as stage_by_tree

            runs = stage_by_tree(driver, names)
        elif transport == "broadcast":
            driver.options = ("--wait", f"{LOCK_WAIT:g}", *options)
            driver.choosing = choosing
            delivered = broadcast_shared(driver, names, told_broadcast)
            runs = driver.all_at_once([name for name in names if name not in driver.started()])
            for name, why in driver.replaced.items():
                got = delivered.setdefault(name, {})
                got["error"] = got.get("error") or why
        else:
            runs = driver.all_at_once(names)
        tracker.tick(driver, final=True)
    finally:
        driver.end_actors()
        ray.shutdown()
    return address, auth, runs, delivered, driver.choice


def everyone_reads_nas(manifest: Manifest, names: list[str]) -> tuple[list[str], str, bool]:
    """The nodes a mirror leaves to read the NAS each, told no transport with fewer than two
    addresses, and why: (nodes, why, every node of the run). A node with a source of its own
    reads that, not the NAS."""
    addressed = [name for name in names if manifest.nodes[name].address]
    why = (f"only {addressed[0]} has" if addressed else "none of them has") + (
        " nodes.<name>.address in the manifest, and the broadcast needs it on two or more nodes")
    readers = [name for name in names if manifest.source_for(name) == manifest.nas.hub]
    return (readers if len(readers) >= 2 else []), why, True


def place(manifest: Manifest, url: str | None) -> str | None:
    """Where a node copies from, in a word: NAS, a peer's name (its hub over SFTP), else the URL."""
    if url is None or url == manifest.nas.hub:
        return NAS
    from stager.fleet.sftp_tree import peer_url

    return next((name for name, node in manifest.nodes.items() if node.address and peer_url(manifest, name) == url),
                url)


def broadcast_shared(driver: "Driver", names: list[str], told: BroadcastOptions) -> dict[str, dict]:
    """The files two or more nodes need, moved by the broadcast. Each node that can take part gets
    an agent (agent.py) that opens its relay while it makes the node's plan (a dry run), and runs
    the node's closing mirror as soon as the relay has received its last file; the other nodes
    run their own mirror at once. The broadcast gets the deadline less a share kept for the
    closing mirrors. `told`: the ports, streams, --full and --bwlimit the agents take."""
    from stager.fleet.agent import start_agents
    from stager.fleet.broadcast.chain import broadcast
    from stager.fleet.choice import Choice, Probes, choose
    from stager.fleet.needs import shared_files

    manifest = driver.manifest
    present = driver.present(names)
    # Who can take part: an address to listen on, and the NAS itself as source (see needs.py).
    able = [name for name in present if manifest.nodes[name].address and manifest.source_for(name) == manifest.nas.hub]
    readers = [name for name in present if manifest.source_for(name) == manifest.nas.hub]
    if len(able) < 2:
        why = (f"only {able[0]} can" if able else "none of them can") + (
            " take part in the broadcast, which needs nodes.<name>.address and a live Ray node on two or more nodes")
        driver.tracker.reads_nas(readers if len(readers) >= 2 else [], why, every=True)
        return {}
    driver.tracker.reads_nas([name for name in readers if name not in able],
                             "no nodes.<name>.address in the manifest, where the broadcast would listen")
    for name in present:
        if name not in able:
            driver.launch(name)
    # One seed for the run: every node samples the same regions, so one node's sample serves all.
    watch = driver.watch_agents(start_agents(driver.ray, os.path.abspath(manifest.path), able, secrets.randbits(32),
                                             full=told.full, bwlimit=told.bwlimit, streams=told.streams,
                                             where=driver.where))
    # The links are measured whether or not the driver chooses: the chain judges its head by them.
    probes = Probes(driver.ray, driver.agents, watch, manifest.fleet, bwlimit=told.bwlimit,
                    choosing=driver.choosing)

    def plan():
        refs = {driver.agents[name].plan.remote(driver.budget()): name for name in able}
        answers = gather(driver.ray, refs, watch, driver.deadline)  # a stalled node's plan is not waited for
        groups = shared_files(manifest, {name: driver.node_run(answer, name) for name, answer in answers.items()})
        if not driver.choosing:
            return groups
        rates = probes.rates(groups)
        driver.choice = Choice(tuple(choose(groups, rates)), rates)
        # A group read directly is each node's closing mirror's to copy from the NAS.
        return [group for group, chosen in zip(groups, driver.choice.groups) if chosen.transport == "broadcast"]

    reserve = min(300.0, 0.3 * driver.timeout)
    # Each node's closing mirror starts as soon as its relay has its last file: a slow node at the
    # chain's tail once held back every other node's refs until it was done.
    return broadcast(driver.ray, manifest, driver.agents, plan, deadline=driver.deadline - reserve, ports=told.ports,
                     done=driver.finish, watch=watch, links=probes.known_links)


def with_delivery(manifest: Manifest, run: NodeRun, transport: str, delivered: dict | None) -> NodeRun:
    """The node's run with where its bytes came from: what the broadcast delivered, plus what its
    own mirror copied (from the NAS, or from a peer over SFTP). Its sources, in a word each: the
    peers its relay received from, NAS if the relay read from it, then its own mirror's source."""
    got = delivered or {}
    copied = int((run.report or {}).get("copied_bytes") or 0)
    sources = [*(got.get("upstreams") or ()), *([NAS] if got.get("nas_bytes") else []),
               *([place(manifest, run.source)] if copied else [])]
    from_nas = run.source == manifest.nas.hub
    fallbacks = list(got.get("fallbacks") or [])
    if got.get("error"):
        fallbacks.append({"path": None, "why": got["error"]})
    return replace(run, delivery=Delivery(
        transport, peer_bytes=int(got.get("peer_bytes", 0)) + (0 if from_nas else copied),
        nas_bytes=int(got.get("nas_bytes", 0)) + (copied if from_nas else 0), fallbacks=tuple(fallbacks),
        bad_senders=tuple(got.get("bad_senders") or ()), refused=tuple(got.get("refused") or ()),
        moved_why=got.get("moved_why"), relay_cpu_seconds=got.get("relay_cpu_seconds"),
        landed_files=int(got.get("landed_files", 0)), sources=tuple(dict.fromkeys(sources))))


class Part(NamedTuple):
    """A node's part the driver waits for: its node-local command in a NodeCommand, or its
    closing mirror in its broadcast agent (`agent`)."""

    node: str
    source: str | None  # the source it was told to copy from, if not its own
    actor: object
    agent: bool


@dataclass
class Driver:
    """Runs each node's part within the deadline and keeps what it reported: a node-local command
    in a NodeCommand pinned to the node, a broadcast node's closing mirror in its agent (replaced
    by the command if the agent died). Whether a node is still there is liveness.py's."""

    ray: object
    manifest: Manifest
    command: str
    deadline: float
    timeout: float
    options: tuple[str, ...] = ()
    running: dict = field(default_factory=dict)  # ObjectRef -> Part
    runs: dict[str, NodeRun] = field(default_factory=dict)
    agents: dict = field(default_factory=dict)  # node -> its broadcast agent (agent.py), for this run
    commands: dict = field(default_factory=dict)  # node -> the NodeCommand running its node-local command
    replaced: dict[str, str] = field(default_factory=dict)  # node -> why its agent's part fell back to its command
    tracker: Tracker | None = None  # each node's part as it goes, for a display; who reads the NAS instead
    agents_started: float = 0.0  # when the agents were started (monotonic): a broadcast node's seconds count from it
    choosing: bool = False  # the broadcast chooses per group between itself and direct reads
    choice: Choice | None = None  # what it chose, once the groups are known

    def __post_init__(self):
        # Two calls at once: its command's run, and the driver's progress calls beside it. One
        # restart: the GCS leases an actor's worker through some node's raylet, and when that
        # node had just died (a node that came back, its old Ray node not yet given up) the
        # creation waited for the death and was then cancelled as a restart ("the actor never
        # ran"), failing a live node. A call already sent is never retried (max_task_retries=0):
        # a command that ran is never run twice.
        self.node_command = self.ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0,
                                            max_concurrency=2)(NodeCommand)
        self.tracker = self.tracker or Tracker(self.command, [])
        self.watch = Watch(self.ray, {})  # every node's actor, asked for its progress
        self.watch.on_look = lambda: self.tracker.tick(self)
        self.placement: dict[str, dict] = {}  # node -> the Ray options that run on it (liveness.placements)
        self.pings = Pings(self.ray, self.where)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def budget(self) -> float:
        """The time a node's command may take: a little less than what is left, so that it can
        still say "timed out" (alive but slow) rather than be counted as silent."""
        return max(1.0, self.left() - min(5.0, 0.1 * self.timeout))

    def present(self, names: list[str]) -> list[str]:
        """The named nodes that have a live Ray node labelled for them; the others are unreachable.
        Where each runs is kept for the run (`where`)."""
        self.placement = placements(self.ray)
        for name in names:
            if name not in self.placement:
                self.runs[name] = unreachable(name, f"no live Ray node is labelled {LABEL}={name}")
        return [name for name in names if name in self.placement]

    def where(self, node: str) -> dict:
        """The Ray options that run a task or an agent on `node`."""
        return self.placement.get(node) or by_label(node)

    def started(self) -> set[str]:
        """The nodes whose command was launched, or that were found unreachable or stalled."""
        return ({part.node for part in self.running.values()} | self.pings.nodes() | set(self.runs)
                | set(self.watch.stalled))

    # ---- launching ------------------------------------------------------------------------------

    def launch(self, node: str, source: str | None = None) -> None:
        argv = node_argv(self.manifest, self.command, node, source, self.options)
        actor = self.node_command.options(**self.where(node)).remote()
        ref = actor.run.remote(argv, self.budget(), place(self.manifest, source or self.manifest.source_for(node)))
        self.commands[node] = actor
        self.running[ref] = Part(node, source, actor, agent=False)
        self.watch.add(node, actor)

    def watch_agents(self, agents: dict) -> Watch:
        """The run's broadcast agents, one per node, asked for their progress from now on."""
        self.agents = agents
        self.agents_started = time.monotonic()
        for node, agent in agents.items():
            self.watch.add(node, agent)
        return self.watch

    def finish(self, node: str, gone: str | None = None) -> None:
        """The node's closing mirror, in its agent (which shares the relay's NAS samples); if the
        agent is `gone`, the node-local command, once the node shows it is alive (`replace`)."""
        agent = self.agents[node]
        if gone is not None:
            self.replace(node, agent, gone)
            return
        self.running[agent.finish.remote(self.budget())] = Part(node, None, agent, agent=True)

    def replace(self, node: str, agent, why: str) -> None:
        """The agent died (kill -9, OOM): if its node still runs a task of nothing within SILENCE,
        the node-local command does the agent's part (wait_one launches it); if not, the node is
        unreachable."""
        self.ray.kill(agent, no_restart=True)
        self.watch.forget(node)
        self.pings.ask(node, why)

    def end_actors(self) -> None:
        """No actor outlives the run: one still running a command past the deadline is ended
        with it, and a stalled one when its node runs again (a mirror or relay killed at any point
        leaves only temp files, which the next run sweeps; a NodeCommand's command is sent SIGTERM
        by the kernel when its worker ends)."""
        for actor in [*self.agents.values(), *self.commands.values()]:
            self.ray.kill(actor, no_restart=True)
        self.agents.clear()
        self.commands.clear()

    # ---- collecting -----------------------------------------------------------------------------

    def all_at_once(self, names: list[str]) -> dict[str, NodeRun]:
        for node in self.present(names):
            self.launch(node)
        while self.wait_one():
            pass
        self.give_up()
        return self.runs

    def wait_one(self) -> NodeRun | None:
        """The next node to finish (or found gone or stalled), or None at the deadline."""
        while (self.running or self.pings.asked) and self.left() > 0:
            wait = min(self.watch.next_look(), self.left(), self.pings.first_due() - time.monotonic())
            ready, _ = self.ray.wait([*self.running, *self.pings.asked], num_returns=1, timeout=max(0.0, wait))
            self.tracker.tick(self)
            if ready and ready[0] in self.pings.asked:
                self._pinged(ready[0])
                continue
            if ready:
                part = self.running.pop(ready[0])
                node = part.node
                run = self.collect(ready[0], node, part.source)
                if part.agent and run.status == "unreachable" and node in live_labels(self.ray):
                    self.replace(node, part.actor, run.error or "")
                    continue
                self.watch.forget(node)
                if not part.agent:
                    self.ray.kill(part.actor, no_restart=True)  # its command is over: its worker goes now
                if part.agent and run.seconds is not None:
                    # The node's part: its plan and what its relay received, not its closing mirror alone.
                    run = replace(run, seconds=time.monotonic() - self.agents_started)
                self.runs[node] = run
                return run
            gone = self.stalled_node() or self.silent_node() or self.lost_node()
            if gone is not None:
                return gone
        return None

    def collect(self, ref, node: str, source: str | None) -> NodeRun:
        try:
            answer = self.ray.get(ref, timeout=max(1.0, self.left()))
        except self.ray.exceptions.RayError as exc:
            answer = exc
        return self.node_run(answer, node, source)

    def node_run(self, answer, node: str, source: str | None = None) -> NodeRun:
        """The node's run from its command's answer, or from the exception its call raised."""
        if isinstance(answer, BaseException):
            text = str(answer).strip()
            return unreachable(node, f"the Ray task failed: {text.splitlines()[-1] if text else type(answer).__name__}",
                               source)
        return from_answer(self.command, node, answer, source, self.timeout)

    def give_up(self) -> None:
        """At the deadline: cancel what is still running (its command is killed on the node). And
        a node found stalled before its command was started is reported so."""
        for part in self.running.values():
            self.ray.kill(part.actor, no_restart=True)
            self.runs[part.node] = unreachable(part.node, f"no answer within {self.timeout:g}s", part.source)
        self.running.clear()
        for node, why in self.pings.drop_all():
            self.runs[node] = unreachable(node, f"its agent died ({why}); no answer within {self.timeout:g}s")
        for node, stall in self.watch.stalled.items():
            self.runs.setdefault(node, self._stalled(node, stall))

    # ---- nodes found gone -----------------------------------------------------------------------

    def _pinged(self, ref) -> None:
        """A ping came back: if the task ran, the node's node-local command takes the agent's part."""
        node, why, alive = self.pings.answered(ref)
        if not alive:
            self.runs[node] = unreachable(node, f"its agent died ({why}) and its Ray node failed a task of nothing")
            return
        self.replaced[node] = f"relay failed: the node's agent died ({why})"
        self.tracker.reads_nas([node], f"its broadcast agent died ({why})")
        self.launch(node)

    def stalled_node(self) -> NodeRun | None:
        """A running node whose actor has answered nothing for SILENCE: stalled, and waited for no
        more (its actor is ended with the run's others)."""
        self.watch.look()
        for ref, part in list(self.running.items()):
            stall = self.watch.stalled.get(part.node)
            if stall is not None:
                del self.running[ref]
                self.runs[part.node] = self._stalled(part.node, stall)
                return self.runs[part.node]
        return None

    def _stalled(self, node: str, stall) -> NodeRun:
        return stalled(node, stall.silent, stall.last, self.command if node in self.commands else None)

    def silent_node(self) -> NodeRun | None:
        """A node whose agent died and that ran no task of nothing within SILENCE: unreachable."""
        overdue = self.pings.overdue()
        if overdue is None:
            return None
        node, why = overdue
        self.runs[node] = unreachable(node, f"its agent died ({why}) and its Ray node ran nothing within "
                                            f"{SILENCE:g}s")
        return self.runs[node]

    def lost_node(self) -> NodeRun | None:
        """A running node whose Ray node has left the cluster, reported unreachable and its task
        cancelled. Ray never fails a task pinned by label to a node that died: it stays pending,
        and a node killed mid-broadcast held its whole fleet run until the deadline."""
        try:
            live = live_labels(self.ray)
        except Exception:  # noqa: BLE001 - the GCS did not answer this once: look again next interval
            return None
        for ref, part in list(self.running.items()):
            if part.node not in live:
                del self.running[ref]
                self.ray.kill(part.actor, no_restart=True)
                self.runs[part.node] = unreachable(
                    part.node, f"its Ray node ({LABEL}={part.node}) left the cluster during the run", part.source)
                return self.runs[part.node]
        return None
