"""The broadcast's relays on real sockets: three relays in this process, a NAS on a local path,
and real processes in between (a man in the middle that flips a byte, strangers without the
key). The fleet-level runs, on a real Ray cluster, are in test_fleet.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_ray import ActorDied, Call, FakeRay, QuietWatch
from stager.fleet.broadcast import keys
from stager.fleet.broadcast.keys import mint
from stager.fleet.broadcast.wire import FRAME
from stager.fleet.broadcast.relay import CHUNK, Relay, Session, Share
from stager.base.lock import HUB_LOCK
from stager.mirror.observe import DigestCache
from stager.sources import open_source

MiB = 1024 * 1024
SEED = 7

# A real process between two relays: it forwards both ways and flips one byte of what the
# upstream sends, once, at the given offset of the stream (past the handshake, inside a chunk),
# or (flip_at -1) passes the upstream's bytes on at `rate` bytes/s: a slow link.
MAN_IN_THE_MIDDLE = r"""
import socket, sys, threading, time
target, flip_at = int(sys.argv[1]), int(sys.argv[2])
rate = float(sys.argv[3]) if len(sys.argv) > 3 else 0
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
flipped = False
def pipe(src, dst, corrupt):
    global flipped
    seen = 0
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            if corrupt and not flipped and seen <= flip_at < seen + len(data):
                data = bytearray(data); data[flip_at - seen] ^= 0xFF; data = bytes(data); flipped = True
            seen += len(data)
            dst.sendall(data)
            if corrupt and rate:
                time.sleep(len(data) / rate)
    except OSError:  # a reset: passed on as a close, as a cut link would be
        pass
    # shutdown, not only close: the other direction's thread is blocked reading dst, and a close
    # alone sends nothing while it is.
    try:
        dst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    dst.close()
while True:
    client, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", target))
    threading.Thread(target=pipe, args=(upstream, client, True), daemon=True).start()
    threading.Thread(target=pipe, args=(client, upstream, False), daemon=True).start()
"""

# A stranger: connects, answers the challenge with random bytes (or with a proof made from a
# wrong key), then reports every byte it got after the greeting.
STRANGER = r"""
import os, socket, sys
from stager.fleet.broadcast import keys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
if sys.argv[2] == "wrong-key":
    try:
        keys.join(sock, os.urandom(32), os.urandom(16))
        print("joined")
    except (keys.Refused, ConnectionError, OSError) as exc:
        print("refused:", type(exc).__name__)
else:
    keys.recv_exact(sock, len(keys.GREETING) + keys.NONCE_BYTES)
    sock.sendall(os.urandom(64) + b"\0" * 64)  # no proof, then what a request would look like
    rest = b""
    while True:
        try:
            got = sock.recv(65536)
        except OSError:
            break
        if not got:
            break
        rest += got
    print("after the greeting:", len(rest))
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def nas(tmp_path) -> dict:
    """Two files on a local NAS: one of several chunks with a short last one, one small."""
    root = tmp_path / "nas"
    files = {}
    for name, size in (("big", 2 * CHUNK + 12345), ("small", 3 * MiB)):
        data = os.urandom(size)
        digest = hashlib.sha256(data).hexdigest()
        path = root / "models--acme--m" / "blobs" / digest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[name] = Share(f"models--acme--m/blobs/{digest}", f"models--acme--m/blobs/{digest}", size)
    return {"root": root, "files": (files["big"], files["small"])}


def relays(tmp_path: Path, nas: dict, key: bytes, run_id: bytes, names=("a", "b", "c"),
           nas_for=lambda name, source: source, streams: int = 1) -> dict[str, tuple]:
    """A relay per name, each with its own view of the NAS (`nas_for` may wrap it) and digests
    sampled with the run's seed, as each node's agent gives its relay. One stream per hop unless
    asked: the tests that count bytes on the wire count them on one connection."""
    out = {}
    for name in names:
        digests = DigestCache(nas_for(name, open_source(str(nas["root"]), {})), SEED)
        relay = Relay(name, str(tmp_path / name / "hub"), digests, (), streams=streams)
        out[name] = (relay, relay.open("127.0.0.1", None, key, run_id))
    return out


def run_all(running: dict, session: Session) -> dict[str, dict]:
    """Every relay's run of the session at once, each in a thread named after its node."""
    results: dict[str, dict] = {}

    def one(name):
        results[name] = running[name][0].run(session, True)

    threads = [threading.Thread(target=one, args=(name,), name=name) for name in running]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def assert_landed(tmp_path: Path, name: str, nas: dict) -> None:
    for share in nas["files"]:
        landed = tmp_path / name / "hub" / share.dest
        assert sha256(landed) == sha256(nas["root"] / share.source), (name, share.dest)


def run_with_a_flip(tmp_path: Path, nas: dict, flip_at: int, **options) -> dict[str, dict]:
    """a -> (man in the middle, flipping the byte at `flip_at` of what a sends) -> b -> c."""
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, **options)
    middle = subprocess.Popen([sys.executable, "-c", MAN_IN_THE_MIDDLE, str(running["a"][1]), str(flip_at)],
                              stdout=subprocess.PIPE, text=True)
    try:
        chain = (("a", "127.0.0.1", int(middle.stdout.readline())), ("b", "127.0.0.1", running["b"][1]),
                 ("c", "127.0.0.1", running["c"][1]))
        return run_all(running, Session(0, nas["files"], chain))
    finally:
        middle.kill()
        middle.wait()
        for relay, _ in running.values():
            relay.close()


def test_a_byte_flipped_on_the_wire_is_refused_the_sender_named_and_the_chunk_fetched_again(tmp_path, nas):
    results = run_with_a_flip(tmp_path, nas, 200_000)  # inside the first chunk's bytes
    total = sum(share.size for share in nas["files"])
    assert results["a"]["nas_bytes"] == total and results["a"]["bad_senders"] == []
    # b refused the bad chunk, named a, and (no other holder before it) read the rest from the NAS.
    assert results["b"]["bad_senders"] == ["a"] and results["b"]["nas_bytes"] == total
    assert results["b"]["peer_bytes"] == 0 and results["b"]["landed_files"] == 2
    assert results["c"] == {"peer_bytes": total, "nas_bytes": 0, "landed_files": 2, "fallbacks": [],
                            "bad_senders": [], "upstreams": ["b"]}
    for name in results:
        assert_landed(tmp_path, name, nas)
        # Nothing but the landed files: no temp file left, the lock free.
        blobs = tmp_path / name / "hub" / "models--acme--m" / "blobs"
        assert sorted(os.listdir(blobs)) == sorted(Path(share.dest).name for share in nas["files"])
        assert (tmp_path / name / "hub" / HUB_LOCK).exists()


class _CountingSource:
    """The relay's real NAS source, counting the bytes its readers return (per relay)."""

    def __init__(self, source, tally: dict, name: str):
        self.source, self.tally, self.name = source, tally, name

    def open(self, rel, **options):
        return _CountingReader(self.source.open(rel, **options), self.tally, self.name)

    def __getattr__(self, attribute):
        return getattr(self.source, attribute)


class _CountingReader:
    def __init__(self, reader, tally: dict, name: str):
        self.reader, self.tally, self.name = reader, tally, name

    def pread(self, length, offset):
        data = self.reader.pread(length, offset)
        self.tally[self.name] = self.tally.get(self.name, 0) + len(data)
        return data

    def readinto_at(self, view, offset):
        got = self.reader.readinto_at(view, offset)
        self.tally[self.name] = self.tally.get(self.name, 0) + got
        return got

    def __getattr__(self, attribute):
        return getattr(self.reader, attribute)


def test_only_the_node_that_reads_the_nas_samples_it_and_its_sample_is_keyed(tmp_path, nas):
    """a -> b -> c: a reads every byte and samples the NAS; b and c check their copies against
    the sample a sends after each file and read nothing from the NAS. Then a byte of that sample
    is flipped on the wire to b: b refuses it, names a, and samples the NAS itself."""
    from stager.fleet.broadcast import keys, relay as relay_module

    tally: dict[str, int] = {}

    def counted(name, source):
        return _CountingSource(source, tally, name)

    total = sum(share.size for share in nas["files"])
    key, run_id = mint()
    running = relays(tmp_path / "clean", nas, key, run_id, nas_for=counted)
    try:
        chain = tuple((name, "127.0.0.1", running[name][1]) for name in ("a", "b", "c"))
        results = run_all(running, Session(0, nas["files"], chain))
    finally:
        for relay, _ in running.values():
            relay.close()
    assert results["a"]["nas_bytes"] == total and total < tally["a"] < 2 * total, tally
    assert "b" not in tally and "c" not in tally, tally
    assert [results[name]["peer_bytes"] for name in ("b", "c")] == [total, total]
    for name in running:
        assert_landed(tmp_path / "clean", name, nas)

    # The big file's sample follows its three chunks on the a -> b stream.
    big = nas["files"][0]
    handshake = len(keys.GREETING) + keys.NONCE_BYTES + keys.MAC_BYTES
    frame = relay_module.FRAME.size
    inside_sample = handshake + 3 * frame + big.size + frame + 5
    tally.clear()
    results = run_with_a_flip(tmp_path / "flipped", nas, inside_sample, nas_for=counted)
    assert results["b"]["bad_senders"] == ["a"] and results["b"]["landed_files"] == 2, results["b"]
    assert results["b"]["peer_bytes"] == total - nas["files"][1].size  # the small file: from the NAS
    assert tally.get("b", 0) > nas["files"][1].size, tally  # and the big file's sample, taken by b itself
    assert results["c"]["bad_senders"] == [] and "c" not in tally, (results["c"], tally)
    for name in results:
        assert_landed(tmp_path / "flipped", name, nas)


def test_strangers_are_refused_before_any_data_and_logged(tmp_path, nas):
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, names=("a", "b"))
    port = running["a"][1]
    try:
        strangers = [subprocess.run([sys.executable, "-c", STRANGER, str(port), kind], capture_output=True, text=True,
                                    timeout=60) for kind in ("no-key", "wrong-key")]
        chain = tuple((name, "127.0.0.1", running[name][1]) for name in ("a", "b"))
        results = run_all(running, Session(0, nas["files"], chain))
    finally:
        refused = running["a"][0].close()["refused"]
        running["b"][0].close()
    assert strangers[0].stdout.strip() == "after the greeting: 0", strangers[0].stderr
    assert strangers[1].stdout.strip() == "refused: ConnectionError", strangers[1].stderr
    assert refused == [{"address": "127.0.0.1", "connections": 2, "why": {"it did not prove the run's key": 2}}], refused
    # The members, holding the key, still got every byte.
    assert results["b"]["peer_bytes"] == sum(share.size for share in nas["files"])
    assert_landed(tmp_path, "b", nas)


def test_a_downstream_whose_upstream_dies_resumes_from_the_next_holder(tmp_path, nas):
    """b is gone before it sends a byte (its port closed): c takes the whole session from a."""
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id)
    dead_relay, dead_port = running.pop("b")
    dead_relay.close()
    chain = (("a", "127.0.0.1", running["a"][1]), ("b", "127.0.0.1", dead_port), ("c", "127.0.0.1", running["c"][1]))
    try:
        results = run_all(running, Session(0, nas["files"], chain))
    finally:
        for relay, _ in running.values():
            relay.close()
    assert results["c"]["upstreams"] == ["a"] and results["c"]["peer_bytes"] == sum(s.size for s in nas["files"])
    assert results["c"]["bad_senders"] == []
    assert_landed(tmp_path, "c", nas)


def test_a_laggard_moved_to_the_tail_no_longer_holds_back_its_downstream(tmp_path, nas):
    """b's inbound link runs at 2 MiB/s. Once the chain is rerouted to a -> c -> b (the driver's
    decision, see test_the_driver_moves_the_first_laggard), c hangs up on b at once, takes its
    chunks from a and finishes long before b, which is then served by c from disk."""
    from stager.fleet.broadcast.relay import CHUNK as chunk

    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id)
    # b's own inbound link is slow, whoever sends: b dials a and c through throttling processes.
    slow = {name: subprocess.Popen([sys.executable, "-c", MAN_IN_THE_MIDDLE, str(running[name][1]), "-1",
                                    str(2 * MiB)], stdout=subprocess.PIPE, text=True) for name in ("a", "c")}
    finished: dict[str, float] = {}
    try:
        hops = {"a": ("a", "127.0.0.1", running["a"][1]), "b": ("b", "127.0.0.1", running["b"][1]),
                "c": ("c", "127.0.0.1", running["c"][1])}
        b_view = {**hops, **{name: (name, "127.0.0.1", int(proc.stdout.readline())) for name, proc in slow.items()}}
        results: dict[str, dict] = {}

        def one(name, chain):
            results[name] = running[name][0].run(Session(0, nas["files"], chain), True)
            finished[name] = time.monotonic()

        started = time.monotonic()
        threads = [threading.Thread(target=one, args=(name, chain)) for name, chain in (
            ("a", (hops["a"], hops["b"], hops["c"])), ("b", (b_view["a"], hops["b"], hops["c"])),
            ("c", (hops["a"], hops["b"], hops["c"])))]
        for thread in threads:
            thread.start()
        while running["b"][0].progress("broadcast").chunks < 1 and time.monotonic() - started < 30:
            time.sleep(0.05)
        rerouted = time.monotonic()
        running["c"][0].reroute(0, (hops["a"], hops["c"], hops["b"]))
        running["b"][0].reroute(0, (b_view["a"], b_view["c"], hops["b"]))
        for thread in threads:
            thread.join(60)
    finally:
        for proc in slow.values():
            proc.kill()
            proc.wait()
        for relay, _ in running.values():
            relay.close()
    total = sum(share.size for share in nas["files"])
    assert results["c"]["upstreams"][-1] == "a" and results["c"]["peer_bytes"] == total, results
    assert results["b"]["upstreams"][-1] == "c" and results["b"]["peer_bytes"] == total, results
    # c did not wait for b: at 2 MiB/s b needs about 6 s for the data, and 2 s for its next chunk,
    # which c, waiting on b when rerouted, once waited for before it asked a.
    assert finished["c"] < finished["b"], (finished, started, results)
    assert finished["c"] - rerouted < 0.6 * chunk / (2 * MiB), (finished, rerouted)
    for name in running:
        assert_landed(tmp_path, name, nas)


def test_the_driver_moves_the_first_laggard():
    from stager.fleet.broadcast.chain import LAG_MIN_CHUNKS, laggard

    names = ["a", "b", "c", "d"]
    full, slow = 1.5, 0.4  # chunks per second over the last looks
    fast = dict.fromkeys(names, full)
    healthy = {"a": LAG_MIN_CHUNKS * 4, "b": LAG_MIN_CHUNKS * 4 - 1, "c": LAG_MIN_CHUNKS * 3, "d": LAG_MIN_CHUNKS * 3}
    assert laggard(names, healthy, fast, fast, set()) is None
    behind = {**healthy, "b": LAG_MIN_CHUNKS * 2, "c": LAG_MIN_CHUNKS, "d": LAG_MIN_CHUNKS}
    trailing = {"a": full, "b": slow, "c": slow, "d": slow}
    assert laggard(names, behind, trailing, trailing, set()) == "b"
    assert laggard(names, behind, trailing, trailing, {"b"}) is None  # once per node; c only trails b
    # Rerouted off b onto a, c starts b's distance behind a and keeps it at full speed: not slow.
    assert laggard(["a", "c", "b", "d"], behind, {**trailing, "c": full}, {**trailing, "c": full}, {"b"}) is None
    # Behind an upstream that has finished (its rate now 0), b still holds c back: moved.
    done = {**behind, "a": 8 * LAG_MIN_CHUNKS}
    assert laggard(names, done, {**trailing, "a": 0.0}, trailing, set()) == "b"
    # Nor early in the run, nor the head (it reads the NAS for everyone), nor the tail.
    assert laggard(names, {"a": LAG_MIN_CHUNKS - 1, "b": 0, "c": 0, "d": 0}, trailing, trailing, set()) is None
    assert laggard(names, {"a": LAG_MIN_CHUNKS, "b": LAG_MIN_CHUNKS, "c": LAG_MIN_CHUNKS, "d": 0}, trailing, trailing,
                   set()) is None


class _FakeRelay:
    """A relay's agent: `run` answers with `call`; each reroute's chain is kept."""

    def __init__(self, call: Call):
        self.reroutes: list[tuple] = []
        self.run = SimpleNamespace(remote=lambda *args: call)
        self.reroute = SimpleNamespace(remote=lambda number, chain: self.reroutes.append(chain))


def _route_after(pace: dict[str, float], looks: int = 40, total: int = 4000, links: dict[str, float] | None = None,
                 behind: dict[str, int] | None = None):
    """The chain's _Route after `looks` looks a second apart, each node receiving `pace` chunks a
    second (the head: reading the NAS), never past its upstream in the order of the moment.
    `links`: the driver's link probes, bytes a second into each node from the one before it.
    `behind`: nodes whose answers reach the driver that many looks late (a full link), their
    counts read on time."""
    from stager.fleet.broadcast.chain import _Route
    from stager.fleet.report import Progress

    names = list(pace)
    route = _Route({name: _FakeRelay(Call()) for name in names},
                   Session(0, (Share("blobs/x", "blobs/x", total * CHUNK),), tuple((n, "h", 0) for n in names)),
                   lambda: dict(links or {}))
    held = dict.fromkeys(names, 0.0)
    kept: dict[str, dict[int, Progress]] = {name: {} for name in names}
    for step in range(looks):
        order = [hop[0] for hop in route.chain]
        for index, name in enumerate(order):
            ahead = total if index == 0 else held[order[index - 1]]
            held[name] = max(held[name], min(ahead, held[name] + pace[name]))
        for name in names:
            kept[name][step] = Progress("broadcast", session=0, chunks=int(held[name]), read_at=500.0 + step)
        shown = {name: {n: p for n, p in kept[name].items() if n <= step - (behind or {}).get(name, 0)}
                 for name in names}

        def same_look(running, shown=shown):
            number = min(max(shown[name], default=-1) for name in running)
            return None if number < 0 else (1000.0 + number, {name: shown[name][number] for name in running})

        route.check(set(names), SimpleNamespace(
            same_look=same_look, answers=lambda node, shown=shown: [(1000.0 + n, p) for n, p in sorted(shown[node].items())]))
    return route


def test_a_head_that_reads_the_nas_faster_than_the_links_moves_no_node_but_one_trial():
    """On a NAS faster than the links the head lands 20 chunks a second and sends 1.5: every node
    after it in turn once looked like a laggard and was moved (the lab's 4 nodes at 11 MB/s a node
    against 23). The node after the head is judged against the head's rate once; then against what
    the head has shown it sends."""
    route = _route_after({"a": 20.0, "b": 1.5, "c": 1.5, "d": 1.5})
    assert route.moved <= {"b"}, route.chain
    # A node truly slow, found right after the head once the trial is spent, is still moved.
    route = _route_after({"a": 20.0, "b": 1.5, "c": 0.4, "d": 1.5})
    assert "c" in route.moved and "d" not in route.moved, (route.moved, route.chain)
    # On the usual cluster the head reads at a link's rate, and a slow node after it goes.
    route = _route_after({"a": 1.5, "b": 0.4, "c": 1.5, "d": 1.5})
    assert route.moved == {"b"}, route.chain


def test_a_head_slower_than_the_links_between_the_others_is_moved_once_from_its_first_second_on():
    """The laggard rule never judges the head: a head at a quarter of the rate held every node at
    its pace. It is judged by the links the driver measured between the other nodes (the pull
    into the node after it crossed the head's own link), from its second answer at which it has
    landed chunks, and moved once; the next node then reads the NAS, and nobody else is moved.
    A head at the links' pace, or above a third of it, or landing far faster on a fast NAS, stays;
    without link measures nothing is judged."""
    from stager.fleet.broadcast.chain import SLOW_HEAD_WHY

    links = {"b": 3 * MiB, "c": 12.5 * MiB, "d": 12.5 * MiB}
    for looks in (2, 40):
        route = _route_after({"a": 3.0, "b": 12.0, "c": 12.0, "d": 12.0}, looks=looks, links=links)
        assert [hop[0] for hop in route.chain] == ["b", "c", "d", "a"], (looks, route.chain)
        assert route.why_moved == {"a": SLOW_HEAD_WHY}
    assert _route_after({"a": 3.0, "b": 12.0, "c": 12.0, "d": 12.0}, looks=1, links=links).why_moved == {}
    # Judged on its own answers: moved at its second, though another node's answers trail two
    # looks behind (judged on looks every node had answered, it was moved two looks later); a
    # head whose own answers are late is judged when they come.
    route = _route_after({"a": 3.0, "b": 12.0, "c": 12.0, "d": 12.0}, looks=2, links=links, behind={"d": 2})
    assert route.why_moved == {"a": SLOW_HEAD_WHY}, route.chain
    for looks, moved in ((3, {}), (4, {"a": SLOW_HEAD_WHY})):
        route = _route_after({"a": 3.0, "b": 12.0, "c": 12.0, "d": 12.0}, looks=looks, links=links, behind={"a": 2})
        assert route.why_moved == moved, (looks, route.chain)
    for pace, told in (({"a": 12.0, "b": 12.0, "c": 12.0, "d": 12.0}, links),
                       # a healthy head slowed by its CPU (three streams a hop on 2 cores: 8 MiB/s
                       # against a probe's burst of 15 MB/s), which CI once moved
                       ({"a": 8.0, "b": 8.0, "c": 8.0, "d": 8.0}, dict.fromkeys("bcd", 15e6)),
                       ({"a": 4.5, "b": 4.5, "c": 4.5, "d": 4.5}, dict.fromkeys("bcd", 12.5 * MiB)),
                       ({"a": 20.0, "b": 1.5, "c": 1.5, "d": 1.5}, dict.fromkeys("bcd", 1.5 * MiB)),
                       ({"a": 3.0, "b": 12.0, "c": 12.0, "d": 12.0}, None)):
        route = _route_after(pace, links=told)
        assert "a" not in route.why_moved and route.chain[0][0] == "a", (pace, route.chain)


def test_a_node_moved_to_the_tail_is_told_the_new_order_and_leaves_its_old_upstream():
    """The laggard itself gets the new order, as every running node does: it then takes its
    chunks from the node now before it (test_a_laggard_moved_to_the_tail_no_longer_holds_back_its_
    downstream shows the relay's side). Left out, it went on taking them from its old upstream; on
    the lab's fast NAS that was the head after the trial move, whose uplink then carried every byte
    twice (4 nodes took 93 s where 2 took 47)."""
    for pace in ({"a": 1.5, "b": 0.4, "c": 1.5, "d": 1.5}, {"a": 20.0, "b": 1.5, "c": 1.5, "d": 1.5}):
        route = _route_after(pace)
        for name in route.moved:
            told = route.relays[name].reroutes
            assert told and told[-1] == route.chain and told[-1][-1][0] in route.moved, (name, told, route.chain)
        assert route.moved, pace


def test_a_node_moved_while_silent_is_told_the_order_once_it_answers_again():
    """b answers nothing for a few seconds (less than liveness.SILENCE): it is moved to the tail
    and c is rerouted onto a. A frozen b cannot be told; once it answers again it is, or it would
    go on taking its chunks from a, whose uplink would then carry them to b and to c both."""
    from stager.fleet.broadcast.chain import _Route

    names = ["a", "b", "c", "d"]
    route = _Route({name: _FakeRelay(Call()) for name in names},
                   Session(0, (Share("blobs/x", "blobs/x", 64 * CHUNK),), tuple((n, "h", 0) for n in names)))
    route.around({"b"}, {"a", "c", "d"})
    assert [hop[0] for hop in route.chain] == ["a", "c", "d", "b"]
    assert route.relays["c"].reroutes and not route.relays["b"].reroutes
    route.around(set(), {"a", "c", "d"})  # still silent: nothing more
    assert not route.relays["b"].reroutes
    route.around(set(), set(names))  # b answers again
    assert route.relays["b"].reroutes == [route.chain]
    route.around(set(), set(names))  # told once
    assert len(route.relays["b"].reroutes) == 1


def test_a_silent_node_is_moved_only_once_the_node_after_it_stops_receiving():
    """The head answers nothing for 3 s while b, after it, still lands chunks at the chain's pace:
    its looks were lost on a full link, its relay sends, and it stays the head (moved, it would
    hand the NAS read to b, whatever b's link). Once b has received nothing for HELD_BACK, or
    receives at a laggard's pace (a slow node whose own answers are late on its full link), the
    silent node is moved, and the row says why. Without a rate to judge by yet, or when the node
    after it is itself late to answer, silence moves it as it always did."""
    from stager.fleet.broadcast.chain import HELD_BACK, _Route
    from stager.fleet.report import Progress

    names = ["a", "b", "c"]
    route = _Route({name: _FakeRelay(Call()) for name in names},
                   Session(0, (Share("blobs/x", "blobs/x", 64 * CHUNK),), tuple((n, "h", 0) for n in names)))
    route.peaks = {"a": 40.0, "b": 4.0, "c": 4.0}  # the head reads a fast NAS: its rate is no link's

    def watch(grew_ago: float | None = 0.3, pace: float = 4.0, lagging: set[str] = frozenset(),
              stalled: tuple = ()):
        """b's last three answers, a second apart on its clock, at `pace` chunks a second."""
        answers = {number: Progress("broadcast", session=0, chunks=int(10 + pace * number), read_at=500.0 + number,
                                    grew_at=None if grew_ago is None else 500.0 + number - grew_ago)
                   for number in range(3)}
        return SimpleNamespace(answers=lambda node: sorted(answers.items()) if node == "b" else [],
                               stalled=dict.fromkeys(stalled),
                               silent_for=lambda seconds: set(lagging))

    for receiving in (watch(), watch(grew_ago=HELD_BACK - 0.1), watch(pace=2.5)):
        assert route.still_sending({"a"}, receiving) == {"a"}
        route.around({"a"}, {"b", "c"}, route.still_sending({"a"}, receiving))
        assert [hop[0] for hop in route.chain] == names and not route.why_moved
    for starved in (watch(grew_ago=HELD_BACK + 0.1), watch(grew_ago=None), watch(pace=1.5),
                    watch(lagging={"b"}), watch(stalled=("a",))):
        assert route.still_sending({"a"}, starved) == set()
    route.peaks = {}
    assert route.still_sending({"a"}, watch()) == set()
    route.around({"a"}, {"b", "c"}, route.still_sending({"a"}, watch(grew_ago=HELD_BACK + 0.5)))
    assert [hop[0] for hop in route.chain] == ["b", "c", "a"]
    assert route.why_moved == {"a": "it answered nothing for 3s while the node after it received little or nothing"}


def test_a_relay_that_dies_is_moved_out_of_the_chain_at_once():
    """b dies (its run fails as Ray fails a dead actor's call) while c and d still receive: both
    are told at once of an order with b at the tail, and b is done with why. Left where it stood,
    b counted as holding every chunk, so c, reconnecting to a, looked far behind b and the laggard
    rule moved c behind d (8 nodes on the lab: a killed node cost 1.5x)."""
    from stager.fleet.broadcast.chain import _run_chain

    share = Share("models--acme--m/blobs/x", "models--acme--m/blobs/x", 64 * CHUNK)
    chain = tuple((name, "127.0.0.1", 7900 + index) for index, name in enumerate("abcd"))
    calls = {"a": Call(), "b": Call(error=ActorDied("The actor is unavailable"), ready=True), "c": Call(),
             "d": Call()}
    relays = {name: _FakeRelay(call) for name, call in calls.items()}
    stats = {name: {"peer_bytes": 0, "nas_bytes": 0, "landed_files": 0, "upstreams": [], "fallbacks": [],
                    "bad_senders": [], "refused": [], "error": None} for name in relays}
    finished: list[tuple[str, str | None]] = []

    def done(name, gone):
        finished.append((name, gone))
        if name == "b":  # the others finish once b is dealt with
            for other in "acd":
                calls[other].value = {"peer_bytes": 0, "nas_bytes": 0, "landed_files": 0, "fallbacks": [],
                                      "upstreams": [], "bad_senders": []}
                calls[other].ready = True

    _run_chain(FakeRay(), relays, Session(0, (share,), chain), stats, time.monotonic() + 30,
               dict.fromkeys(relays, 0), done, {}, QuietWatch())
    assert finished[0] == ("b", "The actor is unavailable"), finished
    moved = tuple(name for name, _, _ in relays["c"].reroutes[0])
    assert moved == ("a", "c", "d", "b"), relays["c"].reroutes
    assert relays["d"].reroutes and relays["a"].reroutes and not relays["b"].reroutes
    assert stats["b"]["error"] == "relay failed: The actor is unavailable"
    assert sorted(name for name, _ in finished) == ["a", "b", "c", "d"]
    # Its row says it was moved, and why; the others were not moved.
    assert stats["b"]["moved_why"] == "its relay died" and not any("moved_why" in stats[n] for n in "acd")
    from stager.fleet.driver import with_delivery
    from stager.fleet.report import FleetReport, NodeRun, table

    manifest = SimpleNamespace(nas=SimpleNamespace(hub="/nas/hf/hub"))
    runs = tuple(with_delivery(manifest, NodeRun(name, 0, "ok"), "broadcast", stats[name]) for name in "abcd")
    report = FleetReport("mirror", runs, 1.0, False, "dgx1:6379", transport="broadcast")
    rows = report.to_json()["nodes"]
    assert {n: (rows[n]["moved_to_tail"], rows[n]["moved_why"]) for n in "abcd"} == {
        "a": (False, None), "b": (True, "its relay died"), "c": (False, None), "d": (False, None)}
    assert [line for line in table(report) if "moved" in line] == [
        "  b: its relay died; it was moved to the tail of the chain"]


# ---- K streams per hop -------------------------------------------------------------------------------

# A real process between a downstream and its upstream, on every connection of a hop: each
# connection's upstream bytes pass through with one byte flipped at `flip_at` of that connection
# (flip_at -1: none), and the connection accepted `cut_nth` (1 for the first; 0: none) is shut
# both ways once `cut_at` bytes of it have passed. It prints its port, then one line per connection it ended.
SPLICE = r"""
import socket, sys, threading
target, flip_at, cut_nth, cut_at = (int(arg) for arg in sys.argv[1:5])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
def pipe(src, dst, flip, cut):
    seen = 0
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            if cut and seen + len(data) > cut_at:
                dst.sendall(data[:cut_at - seen])
                print("cut", flush=True)
                for sock in (src, dst):  # closed both ways, as a killed process's connections are
                    sock.shutdown(socket.SHUT_RDWR)
                return
            if flip and seen <= flip_at < seen + len(data):
                data = bytearray(data); data[flip_at - seen] ^= 0xFF; data = bytes(data)
            seen += len(data)
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
accepted = 0
while True:
    client, _ = server.accept()
    accepted += 1
    upstream = socket.create_connection(("127.0.0.1", target))
    threading.Thread(target=pipe, args=(upstream, client, flip_at >= 0, accepted == cut_nth), daemon=True).start()
    threading.Thread(target=pipe, args=(client, upstream, False, False), daemon=True).start()
"""

STREAMS = 3


@pytest.fixture
def striped_nas(tmp_path) -> dict:
    """Files of more chunks than a hop has streams, each with a short last chunk: every stream
    carries several chunks of each, and a different stream carries each file's last one."""
    root = tmp_path / "nas"
    files = []
    for size in (13 * CHUNK + 777, 7 * CHUNK + 5, 2 * CHUNK + 1):
        data = os.urandom(size)
        digest = hashlib.sha256(data).hexdigest()
        path = root / "models--acme--m" / "blobs" / digest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(Share(f"models--acme--m/blobs/{digest}", f"models--acme--m/blobs/{digest}", size))
    return {"root": root, "files": tuple(files)}


@contextlib.contextmanager
def spliced(port: int, flip_at: int = -1, cut_nth: int = 0, cut_at: int = 0):
    """SPLICE in front of `port`: yields (its port, the process)."""
    proc = subprocess.Popen([sys.executable, "-c", SPLICE, str(port), str(flip_at), str(cut_nth), str(cut_at)],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), proc
    finally:
        proc.kill()
        proc.wait()


def test_k_streams_carry_every_chunk_once_and_a_stream_cut_mid_file_resumes_from_its_last_checked_chunk(
        tmp_path, striped_nas):
    """a -> b -> c, three streams per hop. One of c's three connections to b is reset inside its
    second chunk of the first file: that stream asks a, the next holder, from the first chunk of
    its own it does not hold, and the other two go on from b. Every node's bytes are right, c read
    nothing from the NAS and received every byte once, and nobody is named a bad sender."""
    nas = striped_nas
    total = sum(share.size for share in nas["files"])
    handshake = len(keys.GREETING) + keys.NONCE_BYTES + keys.MAC_BYTES
    second_chunk = handshake + 2 * FRAME.size + CHUNK + CHUNK // 2
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, streams=STREAMS)
    try:
        with spliced(running["b"][1], cut_nth=2, cut_at=second_chunk) as (b_port, splice):
            hops = {name: (name, "127.0.0.1", port) for name, (_, port) in running.items()}
            results: dict[str, dict] = {}

            def one(name, chain):
                results[name] = running[name][0].run(Session(0, nas["files"], chain), True)

            c_view = (hops["a"], ("b", "127.0.0.1", b_port), hops["c"])
            threads = [threading.Thread(target=one, args=(name, chain)) for name, chain in (
                ("a", tuple(hops.values())), ("b", tuple(hops.values())), ("c", c_view))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert splice.stdout.readline().strip() == "cut"
    finally:
        for relay, _ in running.values():
            relay.close()
    assert results["b"]["peer_bytes"] == total and sorted(results["b"]["upstreams"]) == ["a"] * STREAMS
    # Every byte once: a stream that asked again from the start would have been sent a chunk it
    # holds, which it would refuse as the wrong frame and name its sender.
    assert results["c"]["peer_bytes"] == total and results["c"]["nas_bytes"] == 0, results["c"]
    assert sorted(results["c"]["upstreams"]) == ["a"] + ["b"] * STREAMS, results["c"]
    assert results["c"]["bad_senders"] == [] and results["c"]["landed_files"] == len(nas["files"]), results["c"]
    for name in running:
        assert_landed(tmp_path, name, nas)


def test_a_corrupting_peer_is_refused_on_every_stream(tmp_path, striped_nas, caplog):
    """a -> b -> c, three streams per hop, a byte flipped inside the first chunk of each of b's
    connections to a: each stream refuses its own bad chunk (at its first chunk's offset), names a,
    and reads its chunks from the NAS (there is no other holder); c, downstream, gets every byte
    from b and names nobody."""
    nas = striped_nas
    total = sum(share.size for share in nas["files"])
    handshake = len(keys.GREETING) + keys.NONCE_BYTES + keys.MAC_BYTES
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, streams=STREAMS)
    caplog.set_level("WARNING", logger="stager.fleet.broadcast")
    try:
        with spliced(running["a"][1], flip_at=handshake + FRAME.size + 1000) as (a_port, _):
            chain = (("a", "127.0.0.1", a_port), ("b", "127.0.0.1", running["b"][1]),
                     ("c", "127.0.0.1", running["c"][1]))
            results = run_all(running, Session(0, nas["files"], chain))
    finally:
        for relay, _ in running.values():
            relay.close()
    refused = sorted(record.getMessage() for record in caplog.records if "failed its key" in record.getMessage())
    assert refused == [f"b: a chunk from a failed its key (file 0, offset {stream * CHUNK}); refused"
                       for stream in range(STREAMS)], refused
    assert results["b"]["bad_senders"] == ["a"] and results["b"]["peer_bytes"] == 0, results["b"]
    assert results["b"]["nas_bytes"] == total and results["b"]["landed_files"] == len(nas["files"]), results["b"]
    assert results["c"]["bad_senders"] == [] and results["c"]["peer_bytes"] == total, results["c"]
    for name in ("b", "c"):
        assert_landed(tmp_path, name, nas)


def test_strangers_asking_for_each_stream_are_refused_and_the_members_get_every_stream(tmp_path, striped_nas):
    """Strangers ask a relay for each of its three streams, with no proof or a proof from a wrong
    key: every one is refused before a byte of data, and b, a member, takes all three streams."""
    nas = striped_nas
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, names=("a", "b"), streams=STREAMS)
    port = running["a"][1]
    try:
        strangers = [subprocess.run([sys.executable, "-c", STRANGER, str(port), kind], capture_output=True, text=True,
                                    timeout=60) for kind in ("no-key", "wrong-key") for _ in range(STREAMS)]
        chain = tuple((name, "127.0.0.1", running[name][1]) for name in ("a", "b"))
        results = run_all(running, Session(0, nas["files"], chain))
    finally:
        refused = running["a"][0].close()["refused"]
        running["b"][0].close()
    assert [stranger.stdout.strip() for stranger in strangers] == (
        ["after the greeting: 0"] * STREAMS + ["refused: ConnectionError"] * STREAMS), strangers
    assert refused == [{"address": "127.0.0.1", "connections": 2 * STREAMS,
                        "why": {"it did not prove the run's key": 2 * STREAMS}}], refused
    assert results["b"]["peer_bytes"] == sum(share.size for share in nas["files"]), results["b"]
    assert sorted(results["b"]["upstreams"]) == ["a"] * STREAMS
    assert_landed(tmp_path, "b", nas)


def test_a_relay_sends_at_most_its_send_limit_over_all_its_streams(tmp_path, striped_nas):
    """stage fleet mirror --bwlimit on the broadcast: what a relay sends, every stream of every
    downstream together, is held to its send limit; the NAS (a local path here) is not limited,
    so the downstream's time is the limit's. Without it the same run takes a fraction of that."""
    from stager.sources.throttle import Throttle

    nas, rate = striped_nas, 8 * MiB
    total = sum(share.size for share in nas["files"])
    took = {}
    for limited in (False, True):
        key, run_id = mint()
        root = tmp_path / ("limited" if limited else "free")
        running = relays(root, nas, key, run_id, names=("a", "b"), streams=STREAMS)
        running["a"][0].send_limit = Throttle(rate) if limited else None
        chain = tuple((name, "127.0.0.1", running[name][1]) for name in ("a", "b"))
        started = time.monotonic()
        try:
            results = run_all(running, Session(0, nas["files"], chain))
        finally:
            for relay, _ in running.values():
                relay.close()
        took[limited] = time.monotonic() - started
        assert results["b"]["peer_bytes"] == total and results["b"]["nas_bytes"] == 0, results["b"]
        assert_landed(root, "b", nas)
    print(f"\n{total / MiB:.1f} MiB to one downstream on {STREAMS} streams: {took[False]:.2f} s unlimited, "
          f"{took[True]:.2f} s at 8 MiB/s ({total / rate:.2f} s expected)")
    assert 0.9 * total / rate <= took[True] <= 1.1 * total / rate, took
    assert took[False] < 0.5 * took[True], took


def test_a_relay_that_could_not_start_is_reported_in_the_node_local_commands_words():
    """Ray's text for an actor call that raised ends with the class's path. A relay whose hub was
    locked by another run was reported as "relay did not start: stager.base.errors.CannotRun: local
    hub ... is locked ..."; it says what `stage mirror` says. Other errors keep Ray's last line."""
    from ray.exceptions import RayTaskError

    from stager.base.errors import CannotRun
    from stager.fleet.broadcast.chain import _last_line

    locked = CannotRun("local hub /nvme/hub is locked by another stage process (pid 7)")
    trace = "Traceback (most recent call last):\n  ...\nstager.base.errors.CannotRun: " + locked.message
    raised = RayTaskError("NodeAgent.open", trace, locked)
    assert _last_line(raised) == _last_line(raised.as_instanceof_cause()) == locked.message
    other = RayTaskError("NodeAgent.open", "Traceback ...\nOSError: [Errno 98] Address in use", OSError(98, "x"))
    assert _last_line(other) == "OSError: [Errno 98] Address in use"
