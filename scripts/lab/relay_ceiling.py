"""How fast one broadcast relay moves bytes when nothing else is the limit, by streams per hop.

    python scripts/lab/relay_ceiling.py --size-mib 1024 --streams 1,2 --reps 5 --dir /var/tmp/ceiling

One relay (the code of `stage fleet mirror`, in a process of its own) as a middle node between a
sender that costs little and a sink that discards. The sender speaks the broadcast's protocol: it
proves the run's key, then sends each chunk's frame with its key (computed before the clock starts)
and the chunk with os.sendfile from the page cache (a copy of the file in /dev/shm), and the file's
sample after its last chunk. The sink proves the key, asks for every stream and throws the bytes
away unchecked and uncopied (MSG_TRUNC). The relay receives, checks every key, writes with O_DIRECT
under --dir, keeps its recent chunks and passes every chunk on, as any node between two others does.

Per run: the time from the relay's start to the sink's last byte, the relay's rate over it, and the
relay process's CPU per GB received (every thread, user and system); then the medians per K, and
each K's rate over K = 1's. Runs rotate through the K values so that every K sees the same spells
of whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import resource
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path

from stager.fleet.broadcast import keys, wire
from stager.fleet.broadcast.relay import CHUNK, Relay, Session, Share
from stager.mirror.fingerprint import sampled_digest
from stager.mirror.observe import DigestCache
from stager.sources import open_source

SEED = 7  # of the sampled checks: the sender's sample of the file and the relay's check of its copy agree on it
SHM = Path("/dev/shm")


def relay_process(hub: Path, nas: Path, key: bytes, run_id: bytes, streams: int, ports, sessions, results, drained):
    relay = Relay("relay", str(hub), DigestCache(open_source(str(nas), {}), SEED), (), streams=streams)
    ports.put(relay.open("127.0.0.1", None, key, run_id))
    session = sessions.get()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    got = relay.run(session, True)
    drained.wait(600)  # the relay's serving threads are done once the sink has every byte
    after = resource.getrusage(resource.RUSAGE_SELF)
    results.put((started, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, got))
    relay.close()


class Sender:
    """The relay's upstream: every connection that proves the key is served the chunks of the
    stream it asks for, each frame keyed ahead of time and each chunk sent from the page cache."""

    def __init__(self, path: Path, share: Share, key: bytes, run_id: bytes, sample: str):
        self.path, self.share, self.key, self.run_id = path, share, key, run_id
        size = share.size
        with open(path, "rb") as source:
            self.macs = [keys.chunk_mac(key, run_id, 0, offset, source.read(CHUNK)) for offset in range(0, size, CHUNK)]
        payload = sample.encode()
        self.sample = wire.FRAME.pack(wire.SAMPLE, 0, size, len(payload),
                                      keys.chunk_mac(key, run_id, 0, size, payload)) + payload
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, open(self.path, "rb") as source:
            greeting, nonce = keys.challenge()
            conn.sendall(greeting)
            conn.sendall(keys.server_proof(self.key, self.run_id, nonce, keys.recv_exact(conn, keys.ANSWER_BYTES)))
            _, stream, streams, offsets = wire.read_request(conn)
            size = self.share.size
            last = wire.chunks_in(size) - 1
            for number in range(offsets[0] // CHUNK, last + 1, streams) if offsets[0] < size else ():
                offset = number * CHUNK
                length = min(CHUNK, size - offset)
                conn.sendall(wire.FRAME.pack(wire.DATA, 0, offset, length, self.macs[number]))
                sent = 0
                while sent < length:
                    sent += os.sendfile(conn.fileno(), source.fileno(), offset + sent, length - sent)
            if offsets[0] < size and last % streams == stream:
                conn.sendall(self.sample)
            conn.sendall(wire.FRAME.pack(wire.END, 0, 0, 0, wire.NO_MAC))
            with contextlib.suppress(OSError):
                conn.recv(1)  # until the relay hangs up: a close before then could cut what is still queued

    def close(self) -> None:
        self.listener.close()


def sink(port: int, key: bytes, run_id: bytes, streams: int, size: int) -> int:
    """Every stream of the relay's output, thrown away in the kernel (MSG_TRUNC: TCP discards what
    it would have copied out): bytes received."""
    total = []

    def drain(stream: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            keys.join(conn, key, run_id)
            first = stream * CHUNK
            conn.sendall(wire.request(0, stream, streams, "sink", [first if first < size else size]))
            buffer = bytearray(CHUNK)
            got = 0
            while True:
                n = conn.recv_into(buffer, CHUNK, socket.MSG_TRUNC)
                if not n:
                    break
                got += n
            total.append(got)

    threads = [threading.Thread(target=drain, args=(stream,)) for stream in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(total)


def one_run(root: Path, nas: Path, cached: Path, share: Share, sample: str, streams: int) -> dict:
    key, run_id = keys.mint()
    sender = Sender(cached, share, key, run_id, sample)
    hub = root / "relay" / "hub"
    shutil.rmtree(hub.parent, ignore_errors=True)
    context = multiprocessing.get_context("fork")
    ports, sessions, results, drained = context.Queue(), context.Queue(), context.Queue(), context.Event()
    proc = context.Process(target=relay_process, args=(hub, nas, key, run_id, streams, ports, sessions, results,
                                                       drained))
    proc.start()
    try:
        port = ports.get(timeout=60)
        # The sink's port is never dialled: a downstream connects to its upstream, not the other way.
        sessions.put(Session(0, (share,), (("sender", "127.0.0.1", sender.port), ("relay", "127.0.0.1", port),
                                           ("sink", "127.0.0.1", 0))))
        received = sink(port, key, run_id, streams, share.size)
        ended = time.monotonic()
        drained.set()
        started, user, system, got = results.get(timeout=600)
    finally:
        drained.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        sender.close()
        shutil.rmtree(hub.parent, ignore_errors=True)
    gb = (got["peer_bytes"] + got["nas_bytes"]) / 1e9
    landed = got["landed_files"] == 1 and got["peer_bytes"] == share.size
    # The sink gets each chunk with its frame, and the sample: at least the file's bytes.
    return {"streams": streams, "seconds": ended - started, "gb_per_s": share.size / 1e9 / (ended - started),
            "cpu_per_gb": (user + system) / gb, "user_per_gb": user / gb, "system_per_gb": system / gb,
            "ok": landed and received >= share.size and not got["bad_senders"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--streams", default="1,2", help="the K values to run, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/stage-relay-ceiling"),
                        help="where the relay writes (its disk is part of what is measured)")
    args = parser.parse_args()
    ks = [int(k) for k in args.streams.split(",")]
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    # The NAS the relay samples and the sender's copy both in /dev/shm: the relay opens the NAS file
    # uncached (DONTNEED), which would evict the sender's pages from an ordinary file's cache.
    nas = SHM / f"stage-relay-ceiling-{os.getpid()}"
    data = os.urandom(args.size_mib * 1024 * 1024)
    name = hashlib.sha256(data).hexdigest()
    (nas / "blobs").mkdir(parents=True)
    cached = nas / "blobs" / name
    cached.write_bytes(data)
    del data
    share = Share(f"models--a--b/blobs/{name}", f"blobs/{name}", cached.stat().st_size)
    reader = open_source(str(nas), {}).open(share.source, uncached=False)
    sample = sampled_digest(reader, SEED).value
    reader.close()
    runs: dict[int, list[dict]] = {k: [] for k in ks}
    try:
        for rep in range(args.reps):
            for k in ks[rep % len(ks):] + ks[:rep % len(ks)]:
                run = one_run(root, nas, cached, share, sample, k)
                runs[k].append(run)
                print(f"run {rep + 1}, K = {k}: {run['seconds']:.2f} s, {run['gb_per_s']:.2f} GB/s, relay "
                      f"{run['cpu_per_gb']:.2f} s CPU per GB (user {run['user_per_gb']:.2f}, system "
                      f"{run['system_per_gb']:.2f}){'' if run['ok'] else ', NOT RIGHT'}", flush=True)
    finally:
        shutil.rmtree(nas, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(run["gb_per_s"] for run in runs[ks[0]])
    for k in ks:
        rate = statistics.median(run["gb_per_s"] for run in runs[k])
        cpu = statistics.median(run["cpu_per_gb"] for run in runs[k])
        print(f"K = {k}: {rate:.2f} GB/s ({rate / base:.2f}x K = {ks[0]}), {cpu:.2f} s CPU per GB, medians of "
              f"{len(runs[k])}; every run right: {all(run['ok'] for run in runs[k])}")


if __name__ == "__main__":
    main()
