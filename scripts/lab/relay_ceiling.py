"""How fast one broadcast relay moves bytes when nothing else is the limit, by streams per hop.

    python scripts/lab/relay_ceiling.py --size-mib 1024 --streams 1,2 --reps 5 --dir /var/tmp/ceiling
    python scripts/lab/relay_ceiling.py --relays stager,bare-keyed,bare --streams 1,2

One relay (the code of `stage fleet mirror`, in a process of its own) as a middle node between a
sender that costs little and a sink that discards. The sender speaks the broadcast's protocol: it
proves the run's key, then sends each chunk's frame with its key (computed before the clock starts)
and the chunk with os.sendfile from the page cache (a copy of the file in /dev/shm), and the file's
sample after its last chunk. The sink proves the key, asks for every stream and throws the bytes
away unchecked and uncopied (MSG_TRUNC). The relay receives, checks every key, writes with O_DIRECT
under --dir, keeps its recent chunks and passes every chunk on, as any node between two others does.

`--relays` puts other relays in its place, in the same runs: `bare-keyed` is the least a relay's
data path can cost here, the same calls per chunk as the relay's (the frame and the chunk received
whole into an aligned buffer, the chunk's key checked, an O_DIRECT write from that buffer, frame and
chunk sent on in one call) in a bare loop per stream, with no bookkeeping, no landing check, no
kept chunks and no serving thread; `bare` is the same without the key.

Per run: the time from the relay's start to the sink's last byte, the relay's rate over it, and the
relay process's CPU per GB received (every thread, user and system); then the medians per relay
and K, and each K's rate over the first K's. Runs rotate through the (relay, K) pairs so that each
sees the same spells of whatever else the machine is doing.
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
from stager.sources.local import DIRECT_ALIGN, aligned_buffer

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


def bare_process(hub: Path, size: int, keyed: bool, key: bytes, run_id: bytes, streams: int, ports, sessions,
                 results, drained):
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    _, host, port = sessions.get().chain[0]
    hub.mkdir(parents=True)
    fd = os.open(hub / "blob", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    downs = {}
    while len(downs) < streams:  # the sink's connections, each proving the key and naming its stream
        conn, _ = listener.accept()
        greeting, nonce = keys.challenge()
        conn.sendall(greeting)
        conn.sendall(keys.server_proof(key, run_id, nonce, keys.recv_exact(conn, keys.ANSWER_BYTES)))
        downs[wire.read_request(conn)[1]] = conn

    def stream(number: int) -> None:
        with socket.create_connection((host, port)) as up, downs[number] as down:
            keys.join(up, key, run_id)
            first = number * CHUNK
            up.sendall(wire.request(0, number, streams, "relay", [first if first < size else size]))
            header, buffer = memoryview(bytearray(wire.FRAME.size)), memoryview(aligned_buffer(CHUNK))
            while True:
                wire.recv_into_all(up, header)
                kind, file_id, offset, length, mac = wire.FRAME.unpack(header)
                if kind == wire.END:
                    return
                view = buffer[:length]
                wire.recv_into_all(up, view)
                if kind == wire.DATA:
                    if keyed and not keys.mac_ok(keys.chunk_mac(key, run_id, file_id, offset, view), mac):
                        raise ValueError(f"a chunk at {offset} failed its key")
                    os.pwrite(fd, view[:length - length % DIRECT_ALIGN], offset)  # the direct write's whole blocks
                wire.send_all(down, header, view)

    threads = [threading.Thread(target=stream, args=(number,)) for number in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    drained.wait(600)
    after = resource.getrusage(resource.RUSAGE_SELF)
    results.put((started, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                 {"peer_bytes": size, "nas_bytes": 0, "landed_files": 1, "bad_senders": []}))


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


def one_run(root: Path, nas: Path, cached: Path, share: Share, sample: str, relay: str, streams: int) -> dict:
    key, run_id = keys.mint()
    sender = Sender(cached, share, key, run_id, sample)
    hub = root / "relay" / "hub"
    shutil.rmtree(hub.parent, ignore_errors=True)
    context = multiprocessing.get_context("fork")
    ports, sessions, results, drained = context.Queue(), context.Queue(), context.Queue(), context.Event()
    queues = (key, run_id, streams, ports, sessions, results, drained)
    proc = context.Process(target=relay_process, args=(hub, nas, *queues)) if relay == "stager" else \
        context.Process(target=bare_process, args=(hub, share.size, relay == "bare-keyed", *queues))
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
    return {"relay": relay, "streams": streams, "seconds": ended - started, "gb_per_s": share.size / 1e9 / (ended - started),
            "cpu_per_gb": (user + system) / gb, "user_per_gb": user / gb, "system_per_gb": system / gb,
            "ok": landed and received >= share.size and not got["bad_senders"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--streams", default="1,2", help="the K values to run, comma-separated")
    parser.add_argument("--relays", default="stager", help="stager (the relay of stage fleet mirror), bare-keyed, "
                                                           "bare: which relays to run, comma-separated")
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
    pairs = [(relay, k) for relay in args.relays.split(",") for k in ks]
    runs: dict[tuple[str, int], list[dict]] = {pair: [] for pair in pairs}
    try:
        for rep in range(args.reps):
            for relay, k in pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]:
                run = one_run(root, nas, cached, share, sample, relay, k)
                runs[relay, k].append(run)
                print(f"run {rep + 1}, {relay}, K = {k}: {run['seconds']:.2f} s, {run['gb_per_s']:.2f} GB/s, "
                      f"{run['cpu_per_gb']:.2f} s CPU per GB (user {run['user_per_gb']:.2f}, system "
                      f"{run['system_per_gb']:.2f}){'' if run['ok'] else ', NOT RIGHT'}", flush=True)
    finally:
        shutil.rmtree(nas, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    for relay, k in pairs:
        base = statistics.median(run["gb_per_s"] for run in runs[relay, ks[0]])
        rate = statistics.median(run["gb_per_s"] for run in runs[relay, k])
        cpu = statistics.median(run["cpu_per_gb"] for run in runs[relay, k])
        print(f"{relay}, K = {k}: {rate:.2f} GB/s ({rate / base:.2f}x K = {ks[0]}), {cpu:.2f} s CPU per GB, medians "
              f"of {len(runs[relay, k])}; every run right: {all(run['ok'] for run in runs[relay, k])}")


if __name__ == "__main__":
    main()
