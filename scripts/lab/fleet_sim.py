#!/usr/bin/env python3
"""A fluid model of staging N nodes from one NAS: every node reads the NAS (direct), the SFTP
peer tree (`--transport sftp`), the pipelined broadcast chain, and the plain chain baseline.

    python scripts/lab/fleet_sim.py predict --n 1,8,64,1024 --link-gbe 25,100,400 --nas-gbps 1,10 --size 700GB \
        --streams 4 --cpu-per-gb 0.8 --node-cores 64
    python scripts/lab/fleet_sim.py one --transport broadcast --n 8 --link-mbit 200 --nas-mbit 200 --size 512MiB
    python scripts/lab/fleet_sim.py check docs/results/fleet-lab-measurements.json      # against the lab, within 15 %

The model (bytes per second throughout; every node has `link` up and `link` down, the NAS has
one uplink of `nas`, and each node's relay can move `relay_cores / cpu_per_gb` GB/s):

- direct: each node reads S plus its sampled checks from the NAS; the NAS's uplink is shared
  max-min fairly (water-filling) among the nodes still reading, each capped by its own link and
  by one SFTP stream's rate times --jobs.
- sftp tree: one node from the NAS, then each staged node serves one waiting node at a time
  (event-driven, as the driver launches them); each transfer costs `transfer_overhead` (a task
  start, a walk, the closing check) plus S at the slower of the two links and the SFTP rate.
- broadcast: one chain in which every chunk is read from the NAS once and passed on as soon as
  it has arrived: S / rate + (N-1) x chunk / rate, the rate being the least of the NAS, the links
  and the relay's CPU; then each node's sampled check reads its share from the NAS. A straggler
  is put at the tail, where it holds no one back; a node killed part-way costs the nodes behind
  it `detect` seconds and the chunk in flight.
- chain: the broadcast's arithmetic without the Ray run's overheads or the sampled checks.
- chosen: what `stage fleet mirror` does told no transport (stager/fleet/choice.py): the faster of
  direct reads and the broadcast, so never above direct reads; with the cores it keeps busy on a
  node (its rate times its CPU per GB: a relay's for the broadcast, a NAS reader's for direct).

A relay of K streams (--streams; K processes, a connection each, chunks striped across them)
moves at most min(K, the node's cores) / cpu_per_gb, cpu_per_gb being one stream's CPU seconds per
GB it receives and passes on, as measured (scripts/lab/broadcast_cpu.py, fleet_bench.py).

Every transport pays a fixed `startup` (the driver joining Ray, the tasks starting, the walk).
On the lab every node shares one machine's cores: each node's measured CPU per GB then queues on
`host_cores` on top of the transfer. fit() takes the CPU per GB and the tree's task launch as
measured and fits the cores and each transport's start from the N = 1 and 2 runs only, so how
the times grow to N = 8 is the model's; `check` compares every (transport, N <= 8) of a
measurements file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

MiB = 1024 * 1024
GB = 1e9
TRANSPORTS = ("nas", "sftp", "broadcast", "chain")


@dataclass(frozen=True)
class Cluster:
    """What the nodes and the NAS can move, in bytes per second, and the job's shape."""

    n: int
    size: float  # S: the bytes every node needs
    files: int
    link: float  # every node's link, each direction
    nas: float  # the NAS's uplink (or its disks, if slower)
    chunk: float = 8 * MiB
    cpu_per_gb: float = 3.0  # CPU seconds one relay stream spends per GB received (and passed on)
    relay_cores: float = 1.0  # the relay's streams (K, a process each), so the cores it can keep busy
    node_cores: float = math.inf  # a node's cores: the relay keeps at most this many busy
    disk: float = math.inf  # a node's disk, writing
    direct_cpu_per_gb: float = 0.5  # a node's CPU seconds per GB read from a NAS mount and written
    stragglers: tuple[tuple[int, float], ...] = ()  # (node index, its link rate)
    killed: tuple[int, float] | None = None  # (node index, at this fraction of the run)

    def link_of(self, node: int) -> float:
        return dict(self.stragglers).get(node, self.link)


@dataclass(frozen=True)
class Overheads:
    """Seconds and bytes the lab adds beyond moving S: fitted by fit() from the lab's N = 1 runs."""

    startup: dict = field(default_factory=lambda: {"nas": 4.0, "sftp": 4.0, "broadcast": 5.0, "chain": 0.2})
    transfer_overhead: float = 3.0  # sftp tree: each peer transfer's own start, walk and check
    sftp_stream: float = 70e6  # one paramiko SFTP stream (docs/fleet.md: 65-75 MB/s on loopback)
    jobs: int = 4  # files copied at once per node
    sample_per_file: float = 2 * MiB  # each node's sampled check reads this much per file from the NAS
    detect: float = 3.0  # broadcast: seconds until the nodes behind a dead one route around it
    hop_latency: float = 0.002
    round_launch: float = 0.0  # sftp tree: the driver's seconds to start each next transfer's task
    peer_extra: float = 0.0  # sftp tree: what a transfer from a peer costs beyond one from the NAS
    # The lab only: all its nodes share one machine's cores. Each node's CPU per GB received is
    # measured (its cgroup), and the work of the nodes moving bytes at once queues on these cores
    # on top of the transfer (a relay that is not scheduled does not move its bytes). None: every
    # node has its own cores (a real cluster), and only the relay's own CPU limit applies.
    host_cores: float | None = None
    cpu_per_gb: dict = field(default_factory=dict)  # per transport, measured; a relay's default: Cluster's
    # The broadcast charged every node a sampled check of the NAS: the code reads the samples once,
    # at the chain's head, and sends them down the chain; on the lab the charge stands in for what
    # the model lacks (docs/fleet-lab.md, "The simulator"), so fit() keeps it, and predict() does not.
    samples_per_node: bool = True


@dataclass(frozen=True)
class Outcome:
    seconds: float  # the run: the last node done
    per_node: tuple[float, ...]
    nas_bytes: float
    limit: str  # what bounds the rate: "NAS", "link", "relay CPU", "SFTP", "rounds"


def host_cpu(c: Cluster, o: Overheads, transport: str, busy: int) -> float:
    """Seconds the lab's shared cores add when `busy` nodes each move S at once."""
    if o.host_cores is None:
        return 0.0
    return busy * c.size / GB * o.cpu_per_gb.get(transport, c.cpu_per_gb) / o.host_cores


def simulate(transport: str, cluster: Cluster, over: Overheads = Overheads()) -> Outcome:
    return {"nas": direct, "sftp": sftp_tree, "broadcast": broadcast, "chain": chain}[transport](cluster, over)


def direct(c: Cluster, o: Overheads) -> Outcome:
    need = [c.size + c.files * o.sample_per_file] * c.n
    cpu = c.node_cores / c.direct_cpu_per_gb * GB
    caps = [min(c.link_of(i), o.sftp_stream * o.jobs, c.disk, cpu) for i in range(c.n)]
    finish = water_fill(need, caps, c.nas)
    start = o.startup["nas"] + host_cpu(c, o, "nas", c.n)
    bound = min(c.link, o.sftp_stream * o.jobs, c.disk, cpu)
    limit = "NAS" if c.nas < sum(caps) else {c.link: "link", c.disk: "disk", cpu: "CPU"}.get(bound, "SFTP")
    return Outcome(start + max(finish), tuple(start + f for f in finish), sum(need), limit)


def water_fill(need: list[float], caps: list[float], total: float) -> list[float]:
    """When each flow finishes, sharing `total` max-min fairly under per-flow caps."""
    left, done, now = list(need), [0.0] * len(need), 0.0
    active = [i for i in range(len(need)) if left[i] > 0]
    while active:
        rates, budget, open_ = {}, total, sorted(active, key=lambda i: caps[i])
        while open_:
            share = budget / len(open_)
            i = open_[0]
            if caps[i] <= share:
                rates[i] = caps[i]
                budget -= caps[i]
                open_.pop(0)
            else:
                for j in open_:
                    rates[j] = share
                open_ = []
        step = min(left[i] / rates[i] for i in active)
        now += step
        for i in active:
            left[i] -= rates[i] * step
        for i in [i for i in active if left[i] <= 1e-6 * need[i]]:
            done[i] = now
            active.remove(i)
    return done


def sftp_tree(c: Cluster, o: Overheads) -> Outcome:
    """Event-driven: a staged node serves one waiting node at a time; the first reads the NAS."""
    def transfer(src_rate: float, node: int, alongside: int) -> float:
        rate = min(src_rate, c.link_of(node), o.sftp_stream * o.jobs)
        return (o.transfer_overhead + c.size / rate + c.files * o.sample_per_file / min(c.nas, c.link_of(node))
                + host_cpu(c, o, "sftp", 2 * alongside))  # the serving sshd works as hard as the reader

    start = o.startup["sftp"] - o.transfer_overhead
    done = {0: start + transfer(c.nas, 0, 1)}
    free_at = [(done[0], 0)]  # (time a server is free, server)
    waiting = list(range(1, c.n))
    while waiting:
        free_at.sort()
        at = free_at[0][0]
        # Every server free at this moment starts one transfer: they run side by side.
        servers = [server for when, server in free_at if when <= at + 1e-9][:len(waiting)]
        free_at = [(when, server) for when, server in free_at if server not in servers]
        for server in servers:
            node = waiting.pop(0)
            done[node] = at + o.round_launch + o.peer_extra + transfer(c.link_of(server), node, len(servers))
            free_at += [(done[node], server), (done[node], node)]
    per_node = tuple(done[i] for i in range(c.n))
    return Outcome(max(per_node), per_node, c.size + c.n * c.files * o.sample_per_file,
                   "rounds" if c.n > 2 else "SFTP" if o.sftp_stream * o.jobs < c.link else "link")


def chain_rate(c: Cluster, nodes: list[int]) -> tuple[float, str]:
    relay = min(c.relay_cores, c.node_cores) / c.cpu_per_gb * GB
    candidates = [(c.nas, "NAS"), (min(c.link_of(i) for i in nodes), "link"), (relay, "relay CPU"), (c.disk, "disk")]
    return min(candidates)


def broadcast(c: Cluster, o: Overheads, startup: str = "broadcast", samples: bool = True) -> Outcome:
    slow = {i for i, rate in c.stragglers if rate < c.link}
    chain_nodes = [i for i in range(c.n) if i not in slow]
    rate, limit = chain_rate(c, chain_nodes or list(range(c.n)))
    start = o.startup[startup] + host_cpu(c, o, startup, c.n)
    per_hop = c.chunk / rate + o.hop_latency
    finish = {}
    for position, node in enumerate(chain_nodes):
        finish[node] = start + c.size / rate + position * per_hop
    # A straggler hangs off the tail: it receives at its own rate and forwards to no one.
    for node in slow:
        finish[node] = start + c.size / min(rate, c.link_of(node)) + len(chain_nodes) * per_hop
    if c.killed is not None:
        victim, fraction = c.killed
        behind = chain_nodes[chain_nodes.index(victim) + 1:] if victim in chain_nodes else []
        for node in behind:
            finish[node] += o.detect + c.chunk / rate
        finish.pop(victim, None)
    check = c.files * o.sample_per_file if samples else 0.0
    readers = len(finish) if o.samples_per_node else 1
    if check:
        # The closing checks read the NAS at once: its uplink is shared by every node.
        finish = {node: t + readers * check / c.nas for node, t in finish.items()}
    per_node = tuple(finish[i] for i in sorted(finish))
    return Outcome(max(per_node), per_node, c.size + readers * check, limit)


def chain(c: Cluster, o: Overheads) -> Outcome:
    return broadcast(replace(c, killed=None), o, startup="chain", samples=False)


@dataclass(frozen=True)
class Chosen:
    """The transport `stage fleet mirror` takes told nothing, and what it costs a node."""

    transport: str  # "broadcast" or "nas"
    outcome: Outcome
    cores: float  # a node's cores kept busy while it moves bytes
    other: Outcome  # the transport not taken


def chosen(c: Cluster, o: Overheads) -> Chosen:
    """The faster of direct reads and the broadcast (fleet/choice.py's rule, with the model's
    times): never above direct reads. Cores: the rate times the CPU per GB of the transport's work."""
    by_nas, by_broadcast = direct(c, o), broadcast(c, o)
    if by_nas.seconds <= by_broadcast.seconds:
        rate = c.size / max(by_nas.seconds - o.startup["nas"], 1e-9)
        return Chosen("nas", by_nas, rate / GB * c.direct_cpu_per_gb, by_broadcast)
    rate, _ = chain_rate(c, list(range(c.n)))
    return Chosen("broadcast", by_broadcast, rate / GB * c.cpu_per_gb, by_nas)


# ---- calibration on the lab -------------------------------------------------------------------------

def lab_cluster(config: dict, n: int, transport: str = "", cpu_per_gb: float = 3.0) -> Cluster:
    """The lab as the model sees it. `chunk` is the plain chain's (a bench option); the broadcast's
    is stager's own, recorded as `broadcast_chunk` (8 MiB in runs before it was recorded)."""
    rate = config["rate_mbit"] * 1e6 / 8
    chunk = config.get("broadcast_chunk", 8 * MiB) if transport == "broadcast" else config.get("chunk", 8 * MiB)
    return Cluster(n=n, size=config["data_bytes"], files=config["files"], link=rate, nas=rate,
                   chunk=chunk, cpu_per_gb=cpu_per_gb)


def medians(results: dict) -> dict[tuple[str, int], float]:
    groups: dict[tuple[str, int], list[float]] = {}
    for run in results["runs"]:
        if not run.get("killed") and run.get("ok"):
            groups.setdefault((run["transport"], run["n"]), []).append(run["seconds"])
    return {key: statistics.median(values) for key, values in groups.items()}


def measured_cpu(results: dict) -> dict[str, float]:
    """Each transport's CPU seconds per GB per node in the lab's runs (the median over its runs
    and nodes of the nodes' cgroups): an input, measured, not fitted."""
    data = results["config"]["data_bytes"]
    cpu: dict[str, float] = {}
    for transport in TRANSPORTS:
        per_node = [seconds / (data / GB) for run in results["runs"] if run["transport"] == transport
                    and not run.get("killed") for seconds in (run.get("cpu") or {}).values()]
        if per_node:
            cpu[transport] = statistics.median(per_node)
    return cpu


def fit(results: dict) -> Overheads:
    """The lab's overheads. Measured, not fitted: each transport's CPU per GB per node (the
    median of the nodes' cgroups), and from the tree's N = 2 runs the driver's launch between
    transfers and a peer transfer's extra seconds (the nodes' own times). Fitted: the shared
    cores the lab's nodes got, from direct reads at N = 1 and 2, and each transport's fixed start
    from its N = 1 run. So how the times grow from N = 2 to 8 is the model's, not the fit's."""
    config, measured = results["config"], medians(results)
    cpu = measured_cpu(results)
    # The tree at N = 2 (one transfer from the NAS, then one from the peer): the driver's time
    # between the two node commands, and how much longer the peer's transfer took.
    pairs = [run for run in results["runs"] if run["transport"] == "sftp" and run["n"] == 2
             and len(run.get("node_seconds") or {}) == 2 and not run.get("killed")]
    launch = [(run["seconds"] - sum(run["node_seconds"].values())) / 2 for run in pairs]
    extra = [run["node_seconds"]["dgx2"] - run["node_seconds"]["dgx1"] for run in pairs]
    base = replace(Overheads(), cpu_per_gb=cpu, round_launch=statistics.median(launch) if launch else 0.0,
                   peer_extra=max(0.0, statistics.median(extra)) if extra else 0.0)
    cores = None
    if ("nas", 1) in measured and ("nas", 2) in measured and "nas" in cpu:
        # The second node adds its bytes on the NAS link (the model's) and its CPU on the shared
        # cores (what is left of the step).
        bare = replace(base, startup={t: 0.0 for t in TRANSPORTS})
        link_step = (simulate("nas", lab_cluster(config, 2), bare).seconds
                     - simulate("nas", lab_cluster(config, 1), bare).seconds)
        cpu_step = measured[("nas", 2)] - measured[("nas", 1)] - link_step
        cores = config["data_bytes"] / GB * cpu["nas"] / cpu_step if cpu_step > 0 else None
    base = replace(base, host_cores=cores)
    startup = dict(base.startup)
    for transport in TRANSPORTS:
        if (transport, 1) in measured:
            bare = replace(base, startup={**base.startup, transport: 0.0}, transfer_overhead=0.0)
            one = simulate(transport, lab_cluster(config, 1, transport), bare).seconds
            startup[transport] = max(0.0, measured[(transport, 1)] - one)
    return replace(base, startup=startup, transfer_overhead=startup["sftp"])


def check(results: dict, tolerance: float = 0.15, max_n: int = 8) -> list[dict]:
    """Every measured (transport, N <= max_n): the lab's median and the model's time."""
    over, config = fit(results), results["config"]
    rows = []
    for (transport, n), seconds in sorted(medians(results).items()):
        if n > max_n or transport not in TRANSPORTS:
            continue
        predicted = simulate(transport, lab_cluster(config, n, transport), over).seconds
        rows.append({"transport": transport, "n": n, "lab": round(seconds, 2), "model": round(predicted, 2),
                     "error": round(predicted / seconds - 1, 3), "within": abs(predicted / seconds - 1) <= tolerance})
    return rows


# ---- predictions at cluster scale ------------------------------------------------------------------

def predict(ns: list[int], links_gbe: list[float], nas_gbps: list[float], size: float, files: int,
            cpu_per_gb: float, relay_cores: float | None, over: Overheads, node_cores: float = math.inf,
            disk: float = math.inf, direct_cpu_per_gb: float = 0.5) -> list[dict]:
    """direct (a NAS mount: no SFTP cap), today's SFTP tree, the broadcast with its relay of
    `relay_cores` streams at `cpu_per_gb` each (at most `node_cores` busy; None: as many as the
    bound below needs), the same chain with a
    relay that costs no CPU (a NIC- or GPU-driven copy: NCCL/NIXL), and what the driver chooses
    (`chosen`: the faster of direct and the broadcast, with the cores it keeps busy), at cluster
    scale. `bound` is min(NAS, link, disk write): what the chosen transport's rate is held to."""
    over = replace(over, samples_per_node=False)
    mounted = replace(over, sftp_stream=float("inf"))
    rows = []
    for link_gbe in links_gbe:
        for nas in nas_gbps:
            bound = min(nas * GB, link_gbe * 1e9 / 8, disk)
            # K, told or enough streams for the bound, never more than the node's cores.
            streams = relay_cores if relay_cores is not None else min(node_cores, math.ceil(bound / GB * cpu_per_gb))
            for n in ns:
                cluster = Cluster(n=n, size=size, files=files, link=link_gbe * 1e9 / 8, nas=nas * GB,
                                  cpu_per_gb=cpu_per_gb, relay_cores=streams, node_cores=node_cores, disk=disk,
                                  direct_cpu_per_gb=direct_cpu_per_gb)
                row = {"link_gbe": link_gbe, "nas_gbps": nas, "n": n, "streams": streams}
                for name, transport, model, shape in (
                        ("direct", "nas", mounted, cluster), ("sftp", "sftp", over, cluster),
                        ("broadcast", "broadcast", over, cluster),
                        ("native", "broadcast", over, replace(cluster, cpu_per_gb=1e-9))):
                    outcome = simulate(transport, shape, model)
                    row[name] = round(outcome.seconds, 1)
                    row[f"{name}_limit"] = outcome.limit
                pick = chosen(cluster, mounted)
                row["chosen"] = round(pick.outcome.seconds, 1)
                row["chosen_transport"] = pick.transport
                row["chosen_limit"] = pick.outcome.limit
                row["chosen_cores"] = round(pick.cores, 1)
                moving = pick.outcome.seconds - over.startup["nas" if pick.transport == "nas" else "broadcast"]
                row["of_bound"] = round(size / max(moving, 1e-9) / bound, 3)
                rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| link | NAS | N | direct | sftp tree | broadcast, K streams | broadcast, no relay CPU "
             "| chosen (cores a node keeps busy; rate / min(NAS, link, disk)) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:,.0f} s ({r[k + '_limit']})" for k in ("direct", "sftp", "broadcast", "native")]
        cells[2] = f"K = {r['streams']:g}: " + cells[2]
        cells.append(f"{r['chosen_transport']}, {r['chosen']:,.0f} s ({r['chosen_cores']:g} cores; "
                     f"{r['of_bound']:.0%})")
        lines.append(f"| {r['link_gbe']:g} GbE | {r['nas_gbps']:g} GB/s | {r['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_size(text: str) -> float:
    units = {"": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024, "mib": MiB, "gib": 1024 * MiB}
    text = text.strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(number) * units[text[len(number):]]


def numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_sim.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See docs/fleet-lab.md, 'The simulator'.")
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one", help="one transport on one cluster")
    one.add_argument("--transport", choices=TRANSPORTS, required=True)
    one.add_argument("--n", type=int, required=True)
    one.add_argument("--link-mbit", type=float, required=True, help="every node's link, Mbit/s")
    one.add_argument("--nas-mbit", type=float, required=True, help="the NAS's uplink, Mbit/s")
    one.add_argument("--size", type=parse_size, required=True, help="bytes every node needs (512MiB, 700GB)")
    one.add_argument("--files", type=int, default=6)
    one.add_argument("--chunk", type=parse_size, default=8 * MiB)
    one.add_argument("--cpu-per-gb", type=float, default=3.0, help="a relay's CPU seconds per GB (the lab's)")
    one.add_argument("--relay-cores", type=float, default=1.0)
    one.add_argument("--straggler", action="append", default=[], metavar="INDEX=MBIT",
                     help="node INDEX (0-based) has its own link rate")
    one.add_argument("--kill", metavar="INDEX@FRACTION", help="node INDEX dies at FRACTION of the run")
    one.add_argument("--calibration", type=Path, help="fit the overheads from this lab measurements file")
    pred = sub.add_parser("predict", help="direct, tree and broadcast at cluster scale (JSON lines)")
    pred.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[2, 8, 64, 256, 1024])
    pred.add_argument("--link-gbe", type=numbers, default=[25, 100, 400])
    pred.add_argument("--nas-gbps", type=numbers, default=[1, 10], help="the NAS's rate, GB/s")
    pred.add_argument("--size", type=parse_size, default=700e9)
    pred.add_argument("--files", type=int, default=160)
    pred.add_argument("--cpu-per-gb", type=float, default=3.0,
                      help="one relay stream's CPU seconds per GB it receives (measured: broadcast_cpu.py)")
    pred.add_argument("--relay-cores", "--streams", dest="relay_cores", type=lambda v: None if v == "auto" else float(v),
                      default=1.0, help="the relay's streams per hop, K (a process and a core each); auto: enough "
                                        "for min(NAS, link, disk), at most --node-cores")
    pred.add_argument("--node-cores", type=float, default=math.inf, help="a node's cores (the relay uses at most these)")
    pred.add_argument("--disk-gbps", type=float, default=math.inf, help="a node's disk, writing, GB/s")
    pred.add_argument("--direct-cpu-per-gb", type=float, default=0.5,
                      help="a node's CPU seconds per GB read from a NAS mount and written")
    pred.add_argument("--calibration", type=Path)
    pred.add_argument("--markdown", action="store_true", help="a table instead of JSON lines")
    chk = sub.add_parser("check", help="compare the model with a lab measurements file (exit 1 beyond 15 %%)")
    chk.add_argument("results", type=Path)
    chk.add_argument("--tolerance", type=float, default=0.15)
    args = parser.parse_args(argv)

    over = Overheads()
    if getattr(args, "calibration", None):
        over = fit(json.loads(args.calibration.read_text()))
    if args.command == "check":
        rows = check(json.loads(args.results.read_text()), args.tolerance)
        for row in rows:
            print(json.dumps(row))
        return 0 if rows and all(row["within"] for row in rows) else 1
    if args.command == "predict":
        # At cluster scale the lab's per-run overheads (Ray on a 2-core machine) are not the cost.
        rows = predict(args.n, args.link_gbe, args.nas_gbps, args.size, args.files, args.cpu_per_gb,
                       args.relay_cores, over, args.node_cores, args.disk_gbps * GB, args.direct_cpu_per_gb)
        print(markdown(rows) if args.markdown else "\n".join(json.dumps(row) for row in rows))
        return 0
    stragglers = tuple((int(i), float(r) * 1e6 / 8) for i, _, r in (s.partition("=") for s in args.straggler))
    killed = None
    if args.kill:
        index, _, fraction = args.kill.partition("@")
        killed = (int(index), float(fraction or 0.5))
    cluster = Cluster(n=args.n, size=args.size, files=args.files, link=args.link_mbit * 1e6 / 8,
                      nas=args.nas_mbit * 1e6 / 8, chunk=args.chunk, cpu_per_gb=args.cpu_per_gb,
                      relay_cores=args.relay_cores, stragglers=stragglers, killed=killed)
    outcome = simulate(args.transport, cluster, over)
    print(json.dumps({"seconds": round(outcome.seconds, 2), "per_node": [round(t, 2) for t in outcome.per_node],
                      "nas_bytes": int(outcome.nas_bytes), "limit": outcome.limit}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
