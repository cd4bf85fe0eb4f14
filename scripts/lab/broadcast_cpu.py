"""CPU per GB received of a broadcast relay, each relay in its own process, on loopback.

    python scripts/lab/broadcast_cpu.py --nodes 3 --size-mib 512 --reps 5 --dir /var/tmp/bc

A NAS directory with one file of --size-mib, then, --reps times, a chain of --nodes relays (the
same code as `stage fleet mirror --transport broadcast`, --streams connections per hop); each
relay's user+system CPU seconds (its whole process, every thread) per GB it received, then the
medians per place in the chain (head, middle relays, tail), beside what a keyed BLAKE3 of the
same bytes costs on this machine (the median of as many runs).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

from stager.fleet.broadcast.keys import chunk_mac, mint
from stager.fleet.broadcast.relay import CHUNK, Relay, Session, Share
from stager.mirror.observe import DigestCache
from stager.sources import open_source

SEED = 7  # of the sampled checks: one for the run, as the fleet's agents share it


def node(name, root, nas, key, run_id, streams, ports, chains, results, done):
    relay = Relay(name, str(root / name / "hub"), DigestCache(open_source(str(nas), {}), SEED), (), streams=streams)
    ports.put((name, relay.open("127.0.0.1", None, key, run_id)))
    session = chains.get()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    got = relay.run(session, True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    results.put((name, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                 time.monotonic() - started, got))
    done.wait(600)  # keep serving until every downstream is done
    relay.close()


def mac_seconds_per_gb(size: int) -> float:
    """A keyed BLAKE3 over `size` bytes, chunk by chunk as the relays key them: CPU s per GB."""
    data = memoryview(bytearray(os.urandom(CHUNK)))
    key, run_id = mint()
    started = time.process_time()
    for offset in range(0, size, CHUNK):
        chunk_mac(key, run_id, 0, offset, data)
    return (time.process_time() - started) / (size / 1e9)


def chain(root: Path, nas: Path, share: Share, nodes: int, streams: int) -> list[tuple[str, float, float, float, dict]]:
    """One run of a chain of `nodes` relays: per node (name, user s, system s, wall s, what it got)."""
    key, run_id = mint()
    context = multiprocessing.get_context("fork")
    ports, results, done = context.Queue(), context.Queue(), context.Event()
    chains = [context.Queue() for _ in range(nodes)]
    names = [f"n{i}" for i in range(nodes)]
    procs = [context.Process(target=node, args=(n, root, nas, key, run_id, streams, ports, chains[i], results, done))
             for i, n in enumerate(names)]
    for proc in procs:
        proc.start()
    try:
        listening = dict(ports.get(timeout=60) for _ in names)
        session = Session(0, (share,), tuple((n, "127.0.0.1", listening[n]) for n in names))
        for queue in chains:
            queue.put(session)
        got = {}
        for _ in names:
            n, user, system, seconds, stats = results.get(timeout=600)
            got[n] = (n, user, system, seconds, stats)
        return [got[n] for n in names]
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for n in names:
            shutil.rmtree(root / n, ignore_errors=True)


def place(index: int, nodes: int) -> str:
    return "head" if index == 0 else "tail" if index == nodes - 1 else "middle"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--streams", type=int, default=1, help="connections per hop (stage fleet mirror --streams)")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/stage-broadcast-cpu"))
    args = parser.parse_args()
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    nas = root / "nas"
    data = os.urandom(args.size_mib * 1024 * 1024)
    name = hashlib.sha256(data).hexdigest()
    (nas / "blobs").mkdir(parents=True)
    with open(nas / "blobs" / name, "wb") as out:
        out.write(data)
        # Settled on disk first: a relay opens the NAS file uncached (DONTNEED), and the first one
        # to do so paid for writing back the GB this script had just left dirty (5 % of its CPU).
        os.fsync(out.fileno())
    share = Share(f"models--a--b/blobs/{name}", f"blobs/{name}", len(data))
    del data
    per_place: dict[str, list[float]] = {}
    macs = []
    try:
        for rep in range(args.reps):
            macs.append(mac_seconds_per_gb(share.size))
            for index, (n, user, system, seconds, got) in enumerate(chain(root, nas, share, args.nodes, args.streams)):
                gb = (got["peer_bytes"] + got["nas_bytes"]) / 1e9
                per_place.setdefault(place(index, args.nodes), []).append((user + system) / gb)
                print(f"run {rep + 1} {n} ({place(index, args.nodes)}): {(user + system) / gb:.2f} s CPU per GB "
                      f"(user {user / gb:.2f}, system {system / gb:.2f}; {seconds:.1f} s wall, "
                      f"{got['peer_bytes']} from peers, {got['nas_bytes']} from the NAS)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"medians of {args.reps}, {args.streams} stream(s) per hop: keyed BLAKE3 alone "
          f"{statistics.median(macs):.2f} s CPU per GB; "
          + "; ".join(f"{where} {statistics.median(values):.2f}" for where, values in per_place.items()))


if __name__ == "__main__":
    main()
