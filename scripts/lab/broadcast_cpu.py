"""CPU per GB received of a broadcast relay, each relay in its own process, on loopback.

    python scripts/lab/broadcast_cpu.py --nodes 3 --size-mib 512 --dir /var/tmp/bc

A NAS directory with one file of --size-mib, then a chain of --nodes relays (the same code as
`stage fleet mirror --transport broadcast`); each prints its user+system CPU seconds per GB it
received, and how many of those a keyed BLAKE3 of the same bytes costs on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import resource
import shutil
import time
from pathlib import Path

from stager.fleet.broadcast.keys import chunk_mac, mint
from stager.fleet.broadcast.relay import CHUNK, Relay, Session, Share
from stager.mirror.observe import DigestCache
from stager.sources import open_source

SEED = 7  # of the sampled checks: one for the run, as the fleet's agents share it


def node(name, root, nas, key, run_id, ports, chains, results, done):
    relay = Relay(name, str(root / name / "hub"), DigestCache(open_source(str(nas), {}), SEED), ())
    ports.put((name, relay.open("127.0.0.1", None, key, run_id)))
    session = chains.get()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    got = relay.run(session, True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    results.put((name, cpu, time.monotonic() - started, got))
    done.wait(600)  # keep serving until every downstream is done
    relay.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/stage-broadcast-cpu"))
    args = parser.parse_args()
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    nas = root / "nas"
    data = os.urandom(args.size_mib * 1024 * 1024)
    name = hashlib.sha256(data).hexdigest()
    (nas / "blobs").mkdir(parents=True)
    (nas / "blobs" / name).write_bytes(data)
    share = Share(f"models--a--b/blobs/{name}", f"blobs/{name}", len(data))
    key, run_id = mint()
    started = time.process_time()
    for offset in range(0, len(data), CHUNK):
        chunk_mac(key, run_id, 0, offset, memoryview(data)[offset:offset + CHUNK])
    mac_per_gb = (time.process_time() - started) / (len(data) / 1e9)
    del data
    context = multiprocessing.get_context("fork")
    ports, results, done = context.Queue(), context.Queue(), context.Event()
    chains = [context.Queue() for _ in range(args.nodes)]
    names = [f"n{i}" for i in range(args.nodes)]
    procs = [context.Process(target=node, args=(n, root, nas, key, run_id, ports, chains[i], results, done))
             for i, n in enumerate(names)]
    for proc in procs:
        proc.start()
    listening = dict(ports.get(timeout=60) for _ in names)
    session = Session(0, (share,), tuple((n, "127.0.0.1", listening[n]) for n in names))
    for queue in chains:
        queue.put(session)
    print(f"keyed BLAKE3 alone: {mac_per_gb:.2f} s CPU per GB")
    for _ in names:
        n, cpu, seconds, got = results.get(timeout=600)
        received = got["peer_bytes"] + got["nas_bytes"]
        print(f"{n}: {cpu / (received / 1e9):.2f} s CPU per GB ({seconds:.1f} s wall, "
              f"{got['peer_bytes']} from peers, {got['nas_bytes']} from the NAS)")
    done.set()
    for proc in procs:
        proc.join()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
