"""A relay's listener under strangers, on real sockets: a flood of slow strangers while members
join, strangers from many addresses, and a relay in its own process under a pids cgroup, flooded
with no thread to spare. The strangers are real processes; the relays are those of
test_broadcast.py, with their NAS on a local path."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stager.fleet.broadcast import gate
from stager.fleet.broadcast.keys import join, mint
from stager.fleet.broadcast.relay import CHUNK, Relay, Session, Share
from stager.fleet.report import Delivery, FleetReport, NodeRun, table
from test_broadcast import MAN_IN_THE_MIDDLE, SEED, assert_landed, relays, run_all
from stager.mirror.observe import DigestCache
from stager.sources import open_source

MiB = 1024 * 1024

# Slow strangers: `count` connections from each source address (127.0.0.x: all of loopback is
# this machine), each sending one byte a second and never an answer. A connection the relay hangs
# up on is opened again a second later, as a stranger that keeps trying would. Prints "ready" once
# every first connection is made; after `seconds` prints what it saw: every connection the relay
# ended and how long it had held it, and the age of the ones still open.
SLOW_STRANGERS = r"""
import json, selectors, socket, sys, time
port, seconds, plan = int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
selector = selectors.DefaultSelector()
opened, held, reopen = {}, [], []  # socket -> (source, when); (source, seconds); (when, source)
def connect(source):
    sock = socket.socket()
    sock.bind((source, 0))
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))  # not waited for: a relay that stopped accepting stalls nothing here
    opened[sock] = (source, time.monotonic())
    selector.register(sock, selectors.EVENT_READ)
def ended(sock):
    source, since = opened.pop(sock)
    selector.unregister(sock)
    sock.close()
    held.append((source, time.monotonic() - since))
    reopen.append((time.monotonic() + 1, source))
for source, count in plan.items():
    for _ in range(count):
        connect(source)
print("ready", flush=True)
start = last_byte = time.monotonic()
while time.monotonic() - start < seconds:
    for ready, _ in selector.select(0.05):
        try:
            if not ready.fileobj.recv(4096):
                ended(ready.fileobj)
        except OSError:
            ended(ready.fileobj)
    now = time.monotonic()
    if now - last_byte >= 1:
        last_byte = now
        for sock in list(opened):
            try:
                sock.send(b"x")
            except BlockingIOError:
                pass  # still connecting
            except OSError:
                ended(sock)
    due = [item for item in reopen if item[0] <= now]
    reopen[:] = [item for item in reopen if item[0] > now]
    for _, source in due:
        connect(source)
now = time.monotonic()
ended_by = {}
for source, seconds_held in held:
    ended_by[source] = ended_by.get(source, 0) + 1
print(json.dumps({"ended": ended_by, "longest_held": max((s for _, s in held), default=0.0),
                  "oldest_open": max((now - since for _, since in opened.values()), default=0.0)}), flush=True)
"""

# A relay in a process of its own, so that a pids cgroup can hold it to its threads: it takes its
# key and NAS on stdin (never on the command line), prints its port, runs the session it is sent
# as the chain's head, prints what it did, and on "close" prints what its close returned.
RELAY_PROCESS = r"""
import json, sys
from stager.fleet.broadcast.relay import Relay, Session, Share
from stager.mirror.observe import DigestCache
from stager.sources import open_source
config = json.loads(sys.stdin.readline())
relay = Relay("a", config["hub"], DigestCache(open_source(config["nas"], {}), config["seed"]), (), streams=1)
print(relay.open("127.0.0.1", None, bytes.fromhex(config["key"]), bytes.fromhex(config["run_id"])), flush=True)
session = json.loads(sys.stdin.readline())
files = tuple(Share(*share) for share in session["files"])
print(json.dumps(relay.run(Session(0, files, tuple(map(tuple, session["chain"]))), True)), flush=True)
sys.stdin.readline()
print(json.dumps(relay.close()), flush=True)
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def nas(tmp_path) -> dict:
    """24 MiB in three files (one of several chunks with a short last one): at 8 MiB/s, a run of
    about three seconds, long enough for a flood to show in its time."""
    root = tmp_path / "nas"
    files = []
    for size in (10 * CHUNK + 4321, 9 * MiB, 5 * MiB - 4321):
        data = os.urandom(size)
        digest = hashlib.sha256(data).hexdigest()
        path = root / "models--acme--m" / "blobs" / digest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(Share(f"models--acme--m/blobs/{digest}", f"models--acme--m/blobs/{digest}", size))
    return {"root": root, "files": tuple(files)}


@contextlib.contextmanager
def started(*args: str):
    """A Python process of ours (stdin, stdout piped, text), killed and reaped on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def timed_chain(tmp_path: Path, nas: dict, flood: dict | None) -> tuple[float, dict, dict, list[int]]:
    """a -> b -> c, b's link from a at 8 MiB/s (a throttling process), every relay in this
    process; with `flood`, slow strangers against a's port (from SLOW_STRANGERS' addresses) from
    before the members join until after the relays could have cut every first one. Returns the
    run's seconds, the results, a's close() and the thread counts seen during the run."""
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id)
    threads: list[int] = []
    with contextlib.ExitStack() as stack:
        throttle = stack.enter_context(started(MAN_IN_THE_MIDDLE, str(running["a"][1]), "-1", str(8 * MiB)))
        strangers = None
        if flood is not None:
            strangers = stack.enter_context(started(SLOW_STRANGERS, str(running["a"][1]), "13", json.dumps(flood)))
            assert strangers.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # every first connection accepted, the flood's churn under way
        chain = (("a", "127.0.0.1", int(throttle.stdout.readline())), ("b", "127.0.0.1", running["b"][1]),
                 ("c", "127.0.0.1", running["c"][1]))
        done = threading.Event()

        def count_threads():
            while not done.wait(0.2):
                threads.append(threading.active_count())

        watcher = threading.Thread(target=count_threads)
        watcher.start()
        try:
            began = time.monotonic()
            results = run_all(running, Session(0, nas["files"], chain))
            seconds = time.monotonic() - began
        finally:
            done.set()
            watcher.join()
        if strangers is not None:
            seen = json.loads(strangers.stdout.readline())
            results["strangers"] = seen
        closed = {name: relay.close() for name, (relay, _) in running.items()}
    return seconds, results, closed["a"], threads


def test_a_flood_of_slow_strangers_holds_no_thread_is_cut_at_the_deadline_and_members_join_at_once(tmp_path, nas):
    """Against a: 200 slow strangers from 127.0.0.1 (the members' own address, over the bound of
    64 per address: they churn) and 30 from each of 127.0.0.2-6 (within it: they are held until
    the deadline). The members still join at once: the run takes at most 1.2x its clean time."""
    clean, results, refused, _ = timed_chain(tmp_path / "clean", nas, None)
    assert refused["refused"] == [] and results["b"]["upstreams"] == ["a"], results
    baseline = threading.active_count()
    flood = {"127.0.0.1": 200, **{f"127.0.0.{n}": 30 for n in range(2, 7)}}
    flooded, results, refused, threads = timed_chain(tmp_path / "flood", nas, flood)

    total = sum(share.size for share in nas["files"])
    for name, upstream in (("b", "a"), ("c", "b")):
        assert results[name]["upstreams"] == [upstream] and results[name]["peer_bytes"] == total, results
        assert_landed(tmp_path / "flood", name, nas)
    assert flooded <= 1.2 * clean, (flooded, clean)
    # No thread per connection: 350 strangers in flight or churning, and the process's threads are
    # the relays' own (each relay's gate, run and server threads, the throttle's reader).
    assert max(threads) <= baseline + 12, (threads, baseline)
    seen = results["strangers"]
    # A stranger is let go HANDSHAKE_DEADLINE after its accept, not 64 s (a byte a second of a
    # 64-byte answer) after it, and none was still open at the end past it.
    assert gate.HANDSHAKE_DEADLINE - 1 <= seen["longest_held"] <= gate.HANDSHAKE_DEADLINE + 1.5, seen
    assert seen["oldest_open"] <= gate.HANDSHAKE_DEADLINE + 1.5, seen
    # Counted by address: the churning address gave way, the others ran out of time; every
    # connection a stranger saw ended was counted against its own address.
    by_address = {entry["address"]: entry for entry in refused["refused"]}
    assert set(by_address) == set(flood), refused
    assert gate.CROWDED_ADDRESS in by_address["127.0.0.1"]["why"], by_address
    for address in flood:
        entry = by_address[address]
        assert entry["connections"] == sum(entry["why"].values()) >= seen["ended"][address], (address, entry, seen)
        if address != "127.0.0.1":
            assert entry["why"].get(gate.TOO_SLOW, 0) >= 30 and gate.CROWDED_ADDRESS not in entry["why"], entry


def test_the_refused_summary_is_bounded_and_counts_by_address(tmp_path, nas):
    """Strangers from 40 addresses, address n sending n connections with a bad proof each: the
    summary names the 10 refused most, most first, with exact counts, and puts the other 30
    together; the members still get every byte, and the fleet report says the same."""
    key, run_id = mint()
    running = relays(tmp_path, nas, key, run_id, names=("a", "b"))
    port = running["a"][1]
    try:
        for n in range(1, 41):
            for _ in range(n):
                with socket.socket() as sock:
                    sock.bind((f"127.0.1.{n}", 0))
                    sock.settimeout(10)
                    sock.connect(("127.0.0.1", port))
                    sock.recv(64)
                    sock.sendall(os.urandom(64))
                    with contextlib.suppress(ConnectionResetError):
                        assert sock.recv(64) == b""  # hung up on: nothing after the greeting
        chain = tuple((name, "127.0.0.1", running[name][1]) for name in ("a", "b"))
        results = run_all(running, Session(0, nas["files"], chain))
    finally:
        closed = running["a"][0].close()
        running["b"][0].close()
    assert results["b"]["peer_bytes"] == sum(share.size for share in nas["files"]), results
    assert_landed(tmp_path, "b", nas)
    expected = [{"address": f"127.0.1.{n}", "connections": n, "why": {gate.NO_PROOF: n}} for n in range(40, 30, -1)]
    other = sum(range(1, 31))
    assert closed["refused"] == expected + [{"address": None, "connections": other, "why": {gate.NO_PROOF: other}}]

    # The fleet report: the JSON field keeps its name and carries the summary; the table names the
    # first five addresses and counts the rest in one line.
    run = NodeRun("dgx1", 0, "ok", delivery=Delivery("broadcast", refused=tuple(closed["refused"])))
    report = FleetReport("mirror", (run,), 1.0, False, "dgx1:6379", transport="broadcast")
    assert report.to_json()["nodes"]["dgx1"]["refused_connections"] == closed["refused"]
    lines = [line for line in table(report) if "refused" in line]
    assert lines[0] == (f"  dgx1: refused 40 broadcast connections from 127.0.1.40 (40: {gate.NO_PROOF})")
    assert len(lines) == 6 and lines[-1] == f"  dgx1: refused {sum(range(1, 36))} more broadcast connections from " \
                                            "other addresses", lines


# ---- a thread limit --------------------------------------------------------------------------------

@contextlib.contextmanager
def pids_cgroup():
    """A pids cgroup (v1) of our own. Yields its directory; whatever is still in it at the end is
    moved back to the root before it is removed."""
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists():
        pytest.skip("no pids cgroup (v1) to limit a process's threads with here")
    group = root / f"stage-test-relay-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        (group / "pids.max").write_text("max")
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def probe_as_member(port: int, key: bytes, run_id: bytes) -> str:
    """Connect and prove the key, as a downstream would; then what the relay did."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        try:
            join(sock, key, run_id)
        except OSError as exc:
            return f"no handshake ({type(exc).__name__})"
        try:
            return "joined, then hung up" if sock.recv(1) == b"" else "joined, then served"
        except OSError as exc:
            return f"joined, then {type(exc).__name__}"


@contextlib.contextmanager
def head_in_its_own_process(tmp_path: Path, nas: dict, key: bytes, run_id: bytes):
    """Relay a, open, in a process of its own (RELAY_PROCESS): yields the process and a's port."""
    config = {"hub": str(tmp_path / "a" / "hub"), "nas": str(nas["root"]), "seed": SEED, "key": key.hex(),
              "run_id": run_id.hex()}
    with started(RELAY_PROCESS) as head:
        head.stdin.write(json.dumps(config) + "\n")
        head.stdin.flush()
        yield head, int(head.stdout.readline())


def b_joins(head, port: int, tmp_path: Path, nas: dict, key: bytes, run_id: bytes) -> tuple[dict, dict]:
    """Relay b, in this process, takes the session from a, the chain's head: b's run and a's. On
    one stream (a too): a connection is a thread at a, and the thread limit's test leaves room for one."""
    b = Relay("b", str(tmp_path / "b" / "hub"), DigestCache(open_source(str(nas["root"]), {}), SEED), (), streams=1)
    chain = (("a", "127.0.0.1", port), ("b", "127.0.0.1", b.open("127.0.0.1", None, key, run_id)))
    try:
        files = [(share.dest, share.source, share.size) for share in nas["files"]]
        head.stdin.write(json.dumps({"files": files, "chain": chain}) + "\n")
        head.stdin.flush()
        got = b.run(Session(0, nas["files"], chain), True)
        return got, json.loads(head.stdout.readline())
    finally:
        b.close()


def closed(head) -> dict:
    head.stdin.write("close\n")
    head.stdin.flush()
    return json.loads(head.stdout.readline())


def assert_b_got_everything_from_a(tmp_path: Path, nas: dict, got: dict, head_run: dict) -> None:
    total = sum(share.size for share in nas["files"])
    assert head_run["nas_bytes"] == total and head_run["fallbacks"] == [], head_run
    assert got["upstreams"] == ["a"] and got["peer_bytes"] == total and got["nas_bytes"] == 0, got
    for share in nas["files"]:
        for name in ("a", "b"):
            assert sha256(tmp_path / name / "hub" / share.dest) == sha256(nas["root"] / share.source), name


def test_a_thread_limit_does_not_take_the_listener_down(tmp_path, nas):
    """Relay a in a process of its own, in a pids cgroup that lets it start no thread more: 100
    slow strangers flood it, and a member that proves the key gets no thread to be served in (it
    is hung up on, and counted). With room for one thread more, b joins and gets every byte from a."""
    key, run_id = mint()
    with pids_cgroup() as group, head_in_its_own_process(tmp_path, nas, key, run_id) as (head, port):
        (group / "cgroup.procs").write_text(str(head.pid))
        (group / "pids.max").write_text((group / "pids.current").read_text())
        with started(SLOW_STRANGERS, str(port), "6", json.dumps({"127.0.0.1": 100})) as strangers:
            assert strangers.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            probed = probe_as_member(port, key, run_id)
            hit = int(dict(line.split() for line in (group / "pids.events").read_text().splitlines())["max"])
            (group / "pids.max").write_text(str(int((group / "pids.current").read_text()) + 1))
            got, head_run = b_joins(head, port, tmp_path, nas, key, run_id)
            seen = json.loads(strangers.stdout.readline())
        summary = closed(head)["refused"]

    assert probed == "joined, then hung up" and hit >= 1, (probed, hit)
    assert_b_got_everything_from_a(tmp_path, nas, got, head_run)
    [entry] = summary
    assert entry["address"] == "127.0.0.1" and entry["why"].get(gate.NO_THREAD) == 1, entry
    assert entry["why"].get(gate.CROWDED_ADDRESS, 0) >= seen["ended"]["127.0.0.1"] > 0, (entry, seen)


def test_a_relay_out_of_descriptors_lets_handshakes_go_and_keeps_listening(tmp_path, nas):
    """Relay a in a process of its own, its descriptor limit lowered to 20 more than it holds:
    100 slow strangers make its accept fail (EMFILE); the oldest handshakes give way and accepting
    pauses, but never ends. With the limit back and the flood still on, b joins and gets every
    byte from a."""
    key, run_id = mint()
    with head_in_its_own_process(tmp_path, nas, key, run_id) as (head, port):
        limits = resource.prlimit(head.pid, resource.RLIMIT_NOFILE)
        lowered = len(os.listdir(f"/proc/{head.pid}/fd")) + 20
        resource.prlimit(head.pid, resource.RLIMIT_NOFILE, (lowered, limits[1]))
        with started(SLOW_STRANGERS, str(port), "6", json.dumps({"127.0.0.1": 100})) as strangers:
            assert strangers.stdout.readline().strip() == "ready"
            time.sleep(1.5)
            resource.prlimit(head.pid, resource.RLIMIT_NOFILE, limits)
            got, head_run = b_joins(head, port, tmp_path, nas, key, run_id)
            strangers.stdout.readline()
        summary = closed(head)["refused"]

    assert_b_got_everything_from_a(tmp_path, nas, got, head_run)
    [entry] = summary
    # Counted as handshakes that gave way for want of a descriptor: accept did run out of them.
    assert entry["address"] == "127.0.0.1" and entry["why"].get(gate.STARVED, 0) > 0, entry
