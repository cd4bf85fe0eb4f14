#!/usr/bin/env python3
"""Measure `stage fleet mirror` on the namespace lab (scripts/lab/fleet_lab.py): its transports side by
side, in the same runs, against a plain unverified chain.

    python scripts/lab/fleet_bench.py --nodes 1,2,4,8 --rate 200 --size 512MiB --reps 3 \\
        --transports nas,sftp,broadcast,chain --kill --out docs/results/fleet-lab-measurements.json

One lab of max(--nodes) nodes is built; each round runs every (N, transport) pair once, in an
order rotated by one each round, onto emptied node hubs, with `--nodes dgx1..dgxN`. For each run:

- seconds: the wall time of `stage fleet mirror` from the driver (the chain: first byte sent to
  last node done);
- nas_sent: the bytes the NAS sent, from its veth's counters (frames, so SSH and TCP/IP framing
  included); nas_read: what sftp-server read from the hub's files (its own log);
- cpu: each node's CPU seconds (its cgroup's cpu.stat: raylet, workers and `stage` commands),
  less what the node burned idle over the same time (measured just before the run);
- relay_cpu: the CPU of each relay that received from a peer: the broadcast's relay threads (the
  fleet JSON's relay_cpu_seconds: receive, check, write, serve), the plain chain's relay process;
- ok: every file of every node has the NAS file's SHA-256 (checked after the run).

`chain` is a measurement baseline, not a transport: the NAS namespace streams the files in
--chunk chunks to dgx1, which writes each chunk and passes it to dgx2, and so on; plain Python
sockets, no hashing, no Ray. Its relays' CPU is their own rusage (wait4).

`plain` is the plain unverified relay the whole-node CPU target is measured against: the NAS
namespace sends the files with sendfile, and each node receives 1 MiB at a time with recv_into
into one page-aligned buffer, writes it with O_DIRECT from that buffer and passes it on with
sendall; no hashing, no Ray. Its CPU is each node's cgroup, as for every transport.

Other transports: `auto` is `stage fleet mirror` told no transport (the driver's choice, and its
measures); `auto-full` the same with --full; `nas`, `sftp`, `broadcast` as --transport says;
`broadcast@K` the broadcast on K streams per hop (--streams K), for K side by side in the same rounds.

Modes of the lab (fleet_lab.py): --fast-nas (the NAS as a path every namespace reads, past the
shaped links) and --cpu-quota CORES (each node's processes capped by cgroup v1); both make direct
reads win. --sizes 256MiB,768MiB runs every round on a lab of each size: a node's CPU per byte is
then the difference of its CPU at the two sizes over the difference of the sizes (the `cpu` table
of `markdown`), its fixed and per-file costs (Ray's workers, starts, walks) taken out.

`stream` is the other baseline, at N = 1 only: one SSH stream (`ssh nas cat` of the snapshot's
files into dgx1's /dev/null), the time S takes through the shaped NAS link as one TCP stream with
its framing: S/R as measured, beside S/R from the nominal rate.

`--kill` adds, per round and for the transports that claim to survive it (broadcast), a run at
max N in which one node in the middle is killed (kill -9 of every process in its namespace) half
way through the clean run's time; the others' times are compared with the clean run's.

The JSON (--out) holds every run and a summary of medians; `markdown RESULTS` prints its tables:
T, the wall time, for each N and transport, with T / (S/R), S/R being the time the model's S bytes
take at the link's rate R; and each transport's NAS bytes and CPU, lowest to highest over N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet_lab import Lab, LabConfig, Member, MiB, parse_size  # noqa: E402
from stager.fleet.broadcast.relay import CHUNK as BROADCAST_CHUNK  # noqa: E402

GB = 1e9
CHAIN_PORT = 7700
TRANSPORT_ARGS = {"nas": ["--transport", "nas"], "sftp": ["--transport", "sftp"],
                  "broadcast": ["--transport", "broadcast"], "auto": [], "auto-full": ["--full"],
                  "broadcast-full": ["--transport", "broadcast", "--full"]}
PLAIN_CHUNK = 1024 * 1024
DIRECT_ALIGN = 4096
SURVIVES_A_KILL = ("broadcast",)


def transport_args(transport: str) -> list[str]:
    """The fleet options of one of this bench's transports: NAME, or NAME@K for --streams K."""
    name, _, streams = transport.partition("@")
    return TRANSPORT_ARGS[name] + (["--streams", streams] if streams else [])


# ---- the plain chain (a baseline) -----------------------------------------------------------------

def chain_relay(listen: str, forward: str | None, out_dir: Path, chunk: int) -> None:
    """Receive files (name, size, bytes) from upstream, write each chunk, and pass it downstream."""
    host, port = listen.rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    # Downstream first: relays start tail first, so when dgx1 accepts, the whole chain is up.
    downstream = connect(forward) if forward else None
    upstream, _ = server.accept()
    buffer = bytearray(chunk)
    view = memoryview(buffer)

    def exactly(n: int) -> memoryview:
        got = 0
        while got < n:
            read = upstream.recv_into(view[got:n])
            if not read:
                raise ConnectionError("upstream closed")
            got += read
        return view[:n]

    while True:
        header = bytes(exactly(4))
        (name_len,) = struct.unpack("!I", header)
        if name_len == 0:
            break
        name = bytes(exactly(name_len)).decode()
        (size,) = struct.unpack("!Q", bytes(exactly(8)))
        if downstream:
            downstream.sendall(header + name.encode() + struct.pack("!Q", size))
        with open(out_dir / name, "wb") as handle:
            left = size
            while left:
                piece = exactly(min(chunk, left))
                handle.write(piece)
                if downstream:
                    downstream.sendall(piece)
                left -= len(piece)
    if downstream:
        downstream.sendall(struct.pack("!I", 0))
        downstream.shutdown(socket.SHUT_WR)
        downstream.recv(1)  # the next relay closes when it is done: the chain ends at its tail
    upstream.close()


def connect(address: str, timeout: float = 30) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=60)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def chain_send(to: str, files: list[str], chunk: int) -> None:
    """Send NAME=PATH files down the chain."""
    sock = connect(to)
    for spec in files:
        name, _, where = spec.partition("=")
        path = Path(where)
        name = name.encode()
        sock.sendall(struct.pack("!I", len(name)) + name + struct.pack("!Q", path.stat().st_size))
        with open(path, "rb") as handle:
            while data := handle.read(chunk):
                sock.sendall(data)
    sock.sendall(struct.pack("!I", 0))
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)


def run_chain(lab: Lab, nodes: list[Member], chunk: int) -> dict:
    files = sorted(p for p in (lab.nas_hub / lab.snapshot_dir).iterdir())
    blobs = [f"{p.name}={p.resolve()}" for p in files]
    me = [sys.executable, str(Path(__file__).resolve())]
    relays = []
    for i, member in reversed(list(enumerate(nodes))):
        out = lab.staged_hub(member.name) / "chain"
        out.mkdir(parents=True, exist_ok=True)
        forward = f"{nodes[i + 1].address}:{CHAIN_PORT}" if i + 1 < len(nodes) else None
        argv = [*me, "chain-relay", "--listen", f"{member.address}:{CHAIN_PORT}", "--out", str(out),
                "--chunk", str(chunk)] + (["--forward", forward] if forward else [])
        relays.insert(0, lab.spawn(member, argv, stderr=None))
    time.sleep(1.0)  # the relays' interpreters start before the clock does
    before, started = lab.counters(), time.monotonic()
    sender = lab.spawn(lab.nas, [*me, "chain-send", "--to", f"{nodes[0].address}:{CHAIN_PORT}", "--chunk",
                                 str(chunk), *blobs], stderr=None)
    usage = {}
    for member, relay in zip(nodes, relays):
        _, status, rusage = os.wait4(relay.pid, 0)
        relay.returncode = os.waitstatus_to_exitcode(status)
        usage[member.name] = rusage.ru_utime + rusage.ru_stime
    seconds = time.monotonic() - started
    sender.wait()
    sent = lab.counters() - before
    by_name = {p.name: lab.sha256[p.name] for p in files}
    ok = all(relay.returncode == 0 for relay in relays) and all(
        sha256(lab.staged_hub(m.name) / "chain" / name) == digest for m in nodes for name, digest in by_name.items())
    return {"seconds": seconds, "nas_sent": sent.rx_bytes, "nas_read": None, "cpu": usage, "relay_cpu": usage,
            "ok": ok, "code": 0}


def plain_relay(listen: str, forward: str | None, out_dir: Path) -> None:
    """The plain unverified relay: recv_into one aligned 1 MiB buffer, an O_DIRECT write from it,
    sendall of it downstream. A file's last partial block is written padded, then truncated."""
    import mmap

    host, port = listen.rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    downstream = connect(forward) if forward else None
    upstream, _ = server.accept()
    buffer = mmap.mmap(-1, PLAIN_CHUNK)
    view = memoryview(buffer)

    def exactly(n: int) -> memoryview:
        got = 0
        while got < n:
            read = upstream.recv_into(view[got:n])
            if not read:
                raise ConnectionError("upstream closed")
            got += read
        return view[:n]

    while True:
        (name_len,) = struct.unpack("!I", bytes(exactly(4)))
        if name_len == 0:
            break
        name = bytes(exactly(name_len)).decode()
        (size,) = struct.unpack("!Q", bytes(exactly(8)))
        if downstream:
            downstream.sendall(struct.pack("!I", name_len) + name.encode() + struct.pack("!Q", size))
        fd = os.open(out_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        offset = 0
        while offset < size:
            length = min(PLAIN_CHUNK, size - offset)
            piece = exactly(length)
            padded = -(-length // DIRECT_ALIGN) * DIRECT_ALIGN
            if padded > length:
                view[length:padded] = bytes(padded - length)
            os.pwrite(fd, view[:padded], offset)
            if downstream:
                downstream.sendall(piece)
            offset += length
        os.ftruncate(fd, size)
        os.close(fd)
    if downstream:
        downstream.sendall(struct.pack("!I", 0))
        downstream.shutdown(socket.SHUT_WR)
        downstream.recv(1)
    upstream.close()


def plain_send(to: str, files: list[str]) -> None:
    """Send NAME=PATH files down the plain relays, each with sendfile (from the page cache)."""
    sock = connect(to)
    for spec in files:
        name, _, where = spec.partition("=")
        with open(where, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            sock.sendall(struct.pack("!I", len(name.encode())) + name.encode() + struct.pack("!Q", size))
            sock.sendfile(handle)
    sock.sendall(struct.pack("!I", 0))
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)


def run_plain(lab: Lab, nodes: list[Member]) -> dict:
    files = sorted(p for p in (lab.nas_hub / lab.snapshot_dir).iterdir())
    me = [sys.executable, str(Path(__file__).resolve())]
    idle = idle_rates(lab, nodes)
    cpu_before = {m.name: lab.cpu_seconds(m) or 0.0 for m in nodes}
    relays = []
    for i, member in reversed(list(enumerate(nodes))):
        out = lab.staged_hub(member.name) / "plain"
        out.mkdir(parents=True, exist_ok=True)
        forward = f"{nodes[i + 1].address}:{CHAIN_PORT}" if i + 1 < len(nodes) else None
        argv = [*me, "plain-relay", "--listen", f"{member.address}:{CHAIN_PORT}", "--out", str(out)] + (
            ["--forward", forward] if forward else [])
        relays.insert(0, lab.spawn(member, argv, stderr=None))
    time.sleep(1.0)  # the relays' interpreters start before the clock does
    before, started = lab.counters(), time.monotonic()
    sender = lab.spawn(lab.nas, [*me, "plain-send", "--to", f"{nodes[0].address}:{CHAIN_PORT}",
                                 *(f"{p.name}={p.resolve()}" for p in files)], stderr=None)
    codes = [relay.wait() for relay in relays]
    seconds = time.monotonic() - started
    sender.wait()
    sent = lab.counters() - before
    cpu = {m.name: (lab.cpu_seconds(m) or 0.0) - cpu_before[m.name] - idle[m.name] * (seconds + 1.0) for m in nodes}
    ok = all(code == 0 for code in codes) and all(
        sha256(lab.staged_hub(m.name) / "plain" / p.name) == lab.sha256[p.name] for m in nodes for p in files)
    return {"seconds": seconds, "nas_sent": sent.rx_bytes, "nas_read": None, "cpu": cpu, "relay_cpu": cpu,
            "ok": ok, "code": 0, "from_nas": [nodes[0].name]}


def run_stream(lab: Lab, member: Member) -> dict:
    """One SSH stream of the snapshot's files from the NAS into `member`'s /dev/null."""
    files = sorted(str(p.resolve()) for p in (lab.nas_hub / lab.snapshot_dir).iterdir())
    argv = ["ssh", "-i", str(lab.ssh_key), "-o", f"UserKnownHostsFile={lab.known_hosts}", "-o", "BatchMode=yes",
            f"root@{lab.nas.address}", "cat " + " ".join(shlex.quote(path) for path in files)]
    before, started = lab.counters(), time.monotonic()
    code = lab.spawn(member, argv).wait()
    seconds = time.monotonic() - started
    return {"seconds": seconds, "nas_sent": (lab.counters() - before).rx_bytes, "nas_read": None, "cpu": {},
            "relay_cpu": {}, "ok": code == 0, "code": code}


def sha256(path: Path) -> str | None:
    import hashlib

    if not path.exists():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while data := handle.read(8 * MiB):
            digest.update(data)
    return digest.hexdigest()


# ---- runs of `stage fleet mirror` -----------------------------------------------------------------

def sftp_read(lab: Lab) -> int:
    prefix = f'close "{lab.nas_hub}/'
    return sum(int(line.split(" bytes read ")[1].split()[0]) for line in lab.sftp_log.read_text().splitlines()
               if line.startswith(prefix) and " bytes read " in line)


def idle_rates(lab: Lab, nodes: list[Member], seconds: float = 2.0) -> dict[str, float]:
    """CPU seconds per second each node burns with nothing to do (Ray's raylet and agents)."""
    first = {m.name: lab.cpu_seconds(m) or 0.0 for m in nodes}
    time.sleep(seconds)
    return {m.name: ((lab.cpu_seconds(m) or 0.0) - first[m.name]) / seconds for m in nodes}


def run_fleet_mirror(lab: Lab, transport: str, nodes: list[Member], timeout: float,
                     kill: tuple[str, float] | None = None) -> dict:
    idle = idle_rates(lab, nodes)
    cpu_before = {m.name: lab.cpu_seconds(m) or 0.0 for m in nodes}
    # A broadcast needs two nodes; with one it is that node reading the NAS, which is T(1).
    broadcast = transport.partition("@")[0] == "broadcast"
    chosen = TRANSPORT_ARGS["nas"] if broadcast and len(nodes) == 1 else transport_args(transport)
    argv = [sys.executable, "-m", "stager", "fleet", "mirror", *chosen, "--json", "--nodes",
            ",".join(m.name for m in nodes), "--timeout", str(int(timeout)), "--manifest", str(lab.manifest)]
    before, read_before, started = lab.counters(), sftp_read(lab), time.monotonic()
    proc = subprocess.Popen(argv, env=lab.driver_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killer = None
    if kill:
        killer = threading.Timer(kill[1], lab.kill_node, args=(kill[0],))
        killer.start()
    out, err = proc.communicate(timeout=timeout + 60)
    seconds = time.monotonic() - started
    if killer:
        killer.cancel()
    sent = lab.counters() - before
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    cpu = {m.name: (lab.cpu_seconds(m) or 0.0) - cpu_before[m.name] - idle[m.name] * seconds for m in nodes}
    survivors = [m.name for m in nodes if not kill or m.name != kill[0]]
    ok = all(lab.staged_digests(name) == lab.sha256 for name in survivors)
    node_seconds = {name: run.get("seconds") for name, run in (report or {}).get("nodes", {}).items()}
    # Relays that received from a peer (not the head, whose NAS reads run in paramiko's thread).
    relay_cpu = {name: run["relay_cpu_seconds"] for name, run in (report or {}).get("nodes", {}).items()
                 if run.get("relay_cpu_seconds") is not None and run.get("peer_bytes")}
    return {"seconds": seconds, "nas_sent": sent.rx_bytes, "nas_read": sftp_read(lab) - read_before, "cpu": cpu,
            "relay_cpu": relay_cpu, "ok": ok, "code": proc.returncode, "node_seconds": node_seconds,
            "chosen": (report or {}).get("transport"), "choice": (report or {}).get("choice"),
            # The nodes that read the shared files from the NAS themselves (a chain's head; every
            # node reading directly): their CPU is the NAS protocol's too, not a relay's alone.
            "from_nas": sorted(name for name, run in (report or {}).get("nodes", {}).items()
                               if run.get("nas_bytes") and not run.get("peer_bytes")),
            # Why a node read the NAS instead of its peers, or did not finish: what a round that
            # took longer than its peers needs to be explained afterwards.
            "node_trouble": {name: {key: run[key] for key in ("status", "error", "fallbacks", "moved_to_tail")
                                    if run.get(key) and run.get(key) != "ok"}
                             for name, run in (report or {}).get("nodes", {}).items()
                             if run.get("error") or run.get("fallbacks") or run.get("moved_to_tail")},
            "error": None if proc.returncode == 0 else err.strip().splitlines()[-3:],
            "stderr": err.strip().splitlines()[-40:] if proc.returncode or "warning" in err else []}


# ---- the rounds ---------------------------------------------------------------------------------------

def bench(args) -> dict:
    counts = sorted(set(args.nodes))
    sizes = args.sizes or [args.size]
    results = {"config": {"rate_mbit": args.rate, "size": sizes[0], "sizes": sizes, "files": args.files,
                          "chunk": args.chunk, "broadcast_chunk": BROADCAST_CHUNK, "nodes": counts, "reps": args.reps,
                          "transports": args.transports, "kill": args.kill, "fast_nas": args.fast_nas,
                          "cpu_quota": args.cpu_quota},
               "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
               "runs": []}
    for size in sizes:
        config = LabConfig(nodes=max(counts), rate_mbit=args.rate, size=size, files=args.files,
                           fast_nas=args.fast_nas, cpu_quota=args.cpu_quota)
        with Lab(config) as lab:
            bench_lab(lab, args, counts, results)
    results["summary"] = summarize(results)
    save(results, args)
    return results


def bench_lab(lab: Lab, args, counts: list[int], results: dict) -> None:
    """Every round on one lab (one size of the model)."""
    results["config"].setdefault("data_bytes_by_size", {})[str(lab.config.size)] = lab.data_bytes
    results["config"].setdefault("data_bytes", lab.data_bytes)
    link_seconds = lab.data_bytes * 8 / (args.rate * 1e6)
    pairs = [(n, t) for n in counts for t in args.transports if t != "stream" or n == 1]
    for rep in range(args.reps):
        rotated = pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]
        for n, transport in rotated:
            nodes = [lab.nodes[f"dgx{i}"] for i in range(1, n + 1)]
            lab.wipe_hubs()
            timeout = max(120.0, 6 * n * link_seconds + 60)
            run = (run_chain(lab, nodes, args.chunk) if transport == "chain"
                   else run_plain(lab, nodes) if transport == "plain"
                   else run_stream(lab, nodes[0]) if transport == "stream"
                   else run_fleet_mirror(lab, transport, nodes, timeout))
            record(results, args, {"transport": transport, "n": n, "rep": rep, "size": lab.config.size,
                                   "data_bytes": lab.data_bytes, **run})
        if args.kill:
            for transport in (t for t in args.transports if t.partition("@")[0] in SURVIVES_A_KILL):
                n = max(counts)
                clean = [r for r in results["runs"] if r["transport"] == transport and r["n"] == n
                         and not r.get("killed")]
                victim = f"dgx{max(2, n // 2)}"
                at = 0.5 * statistics.median(r["seconds"] for r in clean)
                lab.wipe_hubs()
                nodes = [lab.nodes[f"dgx{i}"] for i in range(1, n + 1)]
                run = run_fleet_mirror(lab, transport, nodes, max(120.0, 6 * n * link_seconds + 60),
                                       kill=(victim, at))
                record(results, args, {"transport": transport, "n": n, "rep": rep, "killed": victim,
                                       "killed_at": at, "size": lab.config.size, "data_bytes": lab.data_bytes,
                                       **run})
                lab.rejoin(lab.nodes[victim])


def record(results: dict, args, run: dict) -> None:
    results["runs"].append(run)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in run.items() if k != "cpu"}),
          file=sys.stderr, flush=True)
    save(results, args)


def save(results: dict, args) -> None:
    """Every run as it ends (a long bench cut short keeps what it measured), and the summary last."""
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def summarize(results: dict) -> dict:
    """Per transport and N: medians of seconds, T/(S/R), NAS bytes / S, CPU per GB received, at the
    first size; with two sizes or more, each node's CPU per byte (`cpu_per_byte`)."""
    config = results["config"]
    data = config["data_bytes"]
    link_seconds = data * 8 / (config["rate_mbit"] * 1e6)
    summary: dict = {}
    for run in results["runs"]:
        if run.get("size", config["size"]) != config["size"]:
            continue
        key = run["transport"] + (" (one node killed)" if run.get("killed") else "")
        summary.setdefault(key, {}).setdefault(str(run["n"]), []).append(run)
    out: dict = {}
    for key, by_n in summary.items():
        out[key] = {}
        for n, runs in sorted(by_n.items(), key=lambda kv: int(kv[0])):
            seconds = statistics.median(r["seconds"] for r in runs)
            nodes_cpu = [cpu for r in runs for name, cpu in r["cpu"].items()]
            relays = [cpu for r in runs for name, cpu in (r.get("relay_cpu") or {}).items()]
            entry = {"runs": len(runs), "seconds": round(seconds, 2), "s_over_r": round(seconds / link_seconds, 3),
                     "nas_sent_per_s": round(statistics.median(r["nas_sent"] for r in runs) / data, 3),
                     "cpu_s_per_gb": round(statistics.median(nodes_cpu) / (data / GB), 2) if nodes_cpu else None,
                     "relay_cpu_s_per_gb": round(statistics.median(relays) / (data / GB), 2) if relays else None,
                     "all_ok": all(r["ok"] for r in runs)}
            reads = [r["nas_read"] for r in runs if r.get("nas_read") is not None]
            if reads:
                entry["nas_read_per_s"] = round(statistics.median(reads) / data, 3)
            out[key][n] = entry
    stream = out.get("stream", {}).get("1")
    for key in out:
        first = out[key].get("1")
        for n, entry in out[key].items():
            if first:
                entry["t_over_t1"] = round(entry["seconds"] / first["seconds"], 3)
            if stream:  # T / (S/R) with S/R as one stream through the shaped link takes it
                entry["t_over_stream"] = round(entry["seconds"] / stream["seconds"], 3)
    if len(config.get("sizes") or ()) >= 2:
        out["cpu_per_byte"] = cpu_per_byte(results)
    return out


def cpu_per_byte(results: dict) -> dict:
    """Per transport and N, a node's CPU seconds per GB of data, counted per byte, by its part:
    `from NAS` (it read the data from the NAS: a chain's head, the plain chain's first node) and
    `from a peer`. The median over the runs and the nodes of that part of the cgroups' CPU at the
    largest size, less that at the smallest, over the difference in data: what every run costs
    whatever its size (Ray's workers and their start, the walks, the files' fixed costs) falls
    out, and what is left grows with the bytes."""
    sizes = sorted(results["config"]["sizes"])
    small, large = sizes[0], sizes[-1]
    cpu: dict = {}
    data: dict = {}
    for run in results["runs"]:
        if run.get("killed") or not run.get("ok") or run.get("size") not in (small, large):
            continue
        data[run["size"]] = run["data_bytes"]
        for node, seconds in run["cpu"].items():
            part = "from NAS" if node in (run.get("from_nas") or ()) else "from a peer"
            cpu.setdefault((run["transport"], run["n"], part), {}).setdefault(run["size"], []).append(seconds)
    out: dict = {}
    for (transport, n, part), by_size in sorted(cpu.items()):
        if small in by_size and large in by_size:
            grown = statistics.median(by_size[large]) - statistics.median(by_size[small])
            out.setdefault(transport, {}).setdefault(str(n), {})[part] = round(grown / ((data[large] - data[small]) / GB),
                                                                              2)
    return out


def markdown(results: dict) -> str:
    """Two tables, every column labelled: the wall time T per N, with T over S/R (the time S bytes
    take at the link's rate R); then per transport what it cost, from its smallest to its largest
    N. A results file written before summaries were saved is summarized here."""
    summary, config = results.get("summary") or summarize(results), results["config"]
    counts = [str(n) for n in config["nodes"]]
    keys = [key for key in summary if key != "cpu_per_byte"]
    lines = ["| nodes N | " + " | ".join(f"{key}: T (T / (S/R))" for key in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for n in counts:
        cells = []
        for key in keys:
            entry = summary[key].get(n)
            cells.append(f"{entry['seconds']:.1f} s ({entry['s_over_r']:.2f})" if entry else "")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    costs = (("NAS bytes sent / S", "nas_sent_per_s", "{:.2f}"),
             ("CPU per GB received, per node", "cpu_s_per_gb", "{:.1f} s"),
             ("a relay's own CPU per GB received", "relay_cpu_s_per_gb", "{:.2f} s"))
    lines += ["", "| transport (lowest-highest over N) | " + " | ".join(label for label, _, _ in costs) + " |",
              "|---|" + "---|" * len(costs)]
    marginal = summary.get("cpu_per_byte")
    for key in keys:
        cells = []
        for _label, field, fmt in costs:
            values = [summary[key][n][field] for n in counts if n in summary[key] and summary[key][n].get(field)
                      is not None]
            cells.append(f"{fmt.format(min(values))}-{fmt.format(max(values))}" if values else "")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if marginal:
        lines += ["", "| transport, N | a node's CPU s per GB, counted per byte (two sizes), by its part |",
                  "|---|---|"]
        for transport, by_n in marginal.items():
            for n, by_part in by_n.items():
                cells = ", ".join(f"{part}: {value:.2f}" for part, value in by_part.items())
                lines.append(f"| {transport}, {n} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_bench.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # The chain's two halves run inside the lab's namespaces, started by the bench itself: no help
    # line for them, and none in the list of commands (argparse printed "==SUPPRESS==" there).
    sub = parser.add_subparsers(dest="command", metavar="[markdown RESULTS]")
    relay = sub.add_parser("chain-relay")
    relay.add_argument("--listen", required=True)
    relay.add_argument("--forward")
    relay.add_argument("--out", type=Path, required=True)
    relay.add_argument("--chunk", type=int, required=True)
    send = sub.add_parser("chain-send")
    send.add_argument("--to", required=True)
    send.add_argument("--chunk", type=int, required=True)
    send.add_argument("files", nargs="+")
    plain = sub.add_parser("plain-relay")
    plain.add_argument("--listen", required=True)
    plain.add_argument("--forward")
    plain.add_argument("--out", type=Path, required=True)
    plain_send_parser = sub.add_parser("plain-send")
    plain_send_parser.add_argument("--to", required=True)
    plain_send_parser.add_argument("files", nargs="+")
    table = sub.add_parser("markdown", help="print the tables of a results file (JSON from --out)")
    table.add_argument("results", type=Path)
    parser.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--rate", type=float, default=200.0, help="Mbit/s, every link (200)")
    parser.add_argument("--size", type=parse_size, default=512 * MiB, help="model bytes (512MiB)")
    parser.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                        help="a lab of each of these model sizes, every round on each (CPU per byte from two)")
    parser.add_argument("--fast-nas", action="store_true", help="the NAS as a path every namespace reads (fleet_lab.py)")
    parser.add_argument("--cpu-quota", type=float, metavar="CORES", help="each node's processes capped at CORES cores")
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--chunk", type=parse_size, default=8 * MiB, help="the plain chain's chunk (8MiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transports", type=lambda s: s.split(","),
                        default=["nas", "sftp", "broadcast", "chain", "stream"])
    parser.add_argument("--kill", action="store_true", help="also a run at max N with one node killed half-way")
    parser.add_argument("--out", type=Path, help="write the results (JSON) here, after every run")
    args = parser.parse_args(argv)
    if args.command == "chain-relay":
        chain_relay(args.listen, args.forward, args.out, args.chunk)
        return 0
    if args.command == "chain-send":
        chain_send(args.to, args.files, args.chunk)
        return 0
    if args.command == "plain-relay":
        plain_relay(args.listen, args.forward, args.out)
        return 0
    if args.command == "plain-send":
        plain_send(args.to, args.files)
        return 0
    if args.command == "markdown":
        print(markdown(json.loads(args.results.read_text())))
        return 0
    results = bench(args)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
