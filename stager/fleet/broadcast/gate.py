"""A relay's door: its listening socket, and the handshake every connection passes before it is
served.

Trust model: nothing a connection sends is trusted until it has proved the run's key
(keys.server_proof). Until then it costs the relay one descriptor and a few bytes in one selector
loop, never a thread of its own, and for at most HANDSHAKE_DEADLINE from its accept however slowly
it sends. A stranger could otherwise stop a relay for the rest of a run: a thread per connection
ran into the process's thread limit and `can't start new thread` ended the accept loop, and a
timeout per `recv` let a client sending one byte a second hold its thread for a minute.

At most HANDSHAKES are in flight, HANDSHAKES_PER_ADDRESS from one address. At a bound the oldest
handshake in flight gives way (of the new connection's address, else of the address holding the
most): a member answers within a round trip of its connect, so the oldest is the one least likely
to be a member, whereas closing the newest would let a few dozen slow connections, renewed every
deadline, lock every member out. Whatever does not get through is counted by address
(`Refusals`), in a table of bounded size.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from typing import Callable

from stager.base.errors import CannotRun
from stager.fleet.broadcast.keys import ANSWER_BYTES, Refused, challenge, server_proof

log = logging.getLogger("stager.fleet.broadcast")

SOCKET_BUFFER = 8 * 1024 * 1024
# From accept to a proved key, whatever the client's pace: a member needs one round trip.
HANDSHAKE_DEADLINE = 10.0
HANDSHAKES = 256
HANDSHAKES_PER_ADDRESS = 64
# The kernel's queue of connections not yet accepted: a burst of strangers overflowing a short one
# would make a member's connect wait out a SYN retransmission (a second, then more).
BACKLOG = 1024
# Accepts per wake-up, so that answers and deadlines are served between bursts of a flood.
ACCEPT_BURST = 64
# After accept failed for want of a descriptor or memory: the connection stays queued and the
# listener readable, and accepting again at once would spin.
ACCEPT_PAUSE = 0.1
CLOSE_WAIT = 5.0
# The refused summary: this many addresses by name, most refused first, the rest together; at
# most REFUSED_TRACKED addresses are counted one by one, so a flood from many addresses (an IPv6
# prefix) costs a fixed amount of memory.
REFUSED_SHOWN = 10
REFUSED_TRACKED = 1024

NO_PROOF = "it did not prove the run's key"
LEFT = "it left before proving the run's key"
TOO_SLOW = f"it did not prove the run's key within {HANDSHAKE_DEADLINE:g} s"
CROWDED_ADDRESS = f"it gave way to newer connections (over {HANDSHAKES_PER_ADDRESS} handshakes from its address)"
CROWDED = f"it gave way to newer connections (over {HANDSHAKES} handshakes at once)"
STARVED = "it gave way to newer connections (the relay was out of descriptors)"
NO_THREAD = "it proved the run's key, but no thread could be started to serve it"


def listen(host: str, ports: tuple[int, int] | None) -> socket.socket:
    """A listening socket on `host`, on the first free port of `ports` (else one the kernel picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last: OSError | None = None
    for port in range(ports[0], ports[1] + 1) if ports else (0,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        # Set on the listener, so every accepted connection starts with windows this large.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            sock.bind((host, port))
            sock.listen(BACKLOG)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    where = f"ports {ports[0]}-{ports[1]}" if ports else "any port"
    raise CannotRun(f"cannot listen on {host} ({where}) for the broadcast: {last.strerror if last else 'no port'}")


def thread_cpu() -> float:
    """CPU seconds the calling thread has used (the relay reports its threads' CPU per GB)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


class Refusals:
    """Connections refused, counted by address and reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_address: dict[str, Counter[str]] = {}
        self._untracked: Counter[str] = Counter()  # from addresses beyond REFUSED_TRACKED

    def add(self, address: str, why: str) -> bool:
        """Count one refusal; True if it is this address's first (the one worth a log line)."""
        with self._lock:
            counts = self._by_address.get(address)
            if counts is None:
                if len(self._by_address) >= REFUSED_TRACKED:
                    self._untracked[why] += 1
                    return False
                counts = self._by_address[address] = Counter()
            counts[why] += 1
            return counts.total() == 1

    def summary(self) -> list[dict]:
        """The REFUSED_SHOWN addresses refused most, most first, then every other address together
        (address None): each {address, connections, why: {reason: connections}}."""
        with self._lock:
            ranked = sorted(self._by_address.items(), key=lambda item: (-item[1].total(), item[0]))
            rest = Counter(self._untracked)
            for _, counts in ranked[REFUSED_SHOWN:]:
                rest.update(counts)
            entries = [_entry(address, counts) for address, counts in ranked[:REFUSED_SHOWN]]
        return entries + ([_entry(None, rest)] if rest else [])


def _entry(address: str | None, counts: Counter[str]) -> dict:
    return {"address": address, "connections": counts.total(), "why": dict(counts.most_common())}


class _Handshake:
    """One connection between its accept and its proof, or its end."""

    __slots__ = ("sock", "address", "deadline", "nonce", "answer")

    def __init__(self, sock: socket.socket, address: tuple, deadline: float, nonce: bytes):
        self.sock, self.address, self.deadline, self.nonce = sock, address, deadline, nonce
        self.answer = bytearray()

    @property
    def host(self) -> str:
        return self.address[0]


class Gate:
    """Accepts and handshakes every connection to `listener` in one thread; a connection that
    proved the key goes to `admitted(sock)` (blocking again), which serves it."""

    def __init__(self, node: str, listener: socket.socket, key: bytes, run_id: bytes,
                 admitted: Callable[[socket.socket], None]):
        self.node = node
        self.listener = listener
        self.port = listener.getsockname()[1]
        self.refusals = Refusals()
        self.cpu_seconds = 0.0  # of the gate's thread, once it has ended
        self._key, self._run_id = key, run_id
        self._admitted = admitted
        self._pending: dict[socket.socket, _Handshake] = {}  # in accept order: oldest first
        self._by_address: dict[str, dict[socket.socket, _Handshake]] = {}
        self._paused_until = 0.0  # accepting is paused until then (monotonic); 0: it is not
        self._starved = False  # accept has failed for want of a descriptor: logged once
        self._closing = False
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        listener.setblocking(False)
        self._wake_in.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="stage-broadcast-gate", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:
            self._shut()
            raise CannotRun(f"cannot start the broadcast's listener: {exc}") from None

    def close(self) -> None:
        """Stop accepting: the port is closed and every handshake in flight hung up on when this
        returns. Connections already admitted are their servers' to end."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_out.send(b"\0")
        self._thread.join(CLOSE_WAIT)
        self._key = b""
        if self._thread.is_alive():  # the loop never takes this long between looks at _closing
            log.warning("%s: the broadcast's listener did not stop within %g s; its port is closed", self.node,
                        CLOSE_WAIT)
            self.listener.close()

    # ---- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        started = thread_cpu()
        try:
            while not self._closing:
                # Answers first, then new connections: a member's answer that arrived with a
                # burst of strangers is checked before the burst can make it give way.
                ready = [key for key, _ in self._selector.select(self._wait())]
                for key in ready:
                    if isinstance(key.data, _Handshake):
                        self._guarded(key.data, self._read_answer)
                    elif key.fileobj is self._wake_in:
                        with contextlib.suppress(OSError):
                            self._wake_in.recv(64)
                if any(key.fileobj is self.listener for key in ready):
                    self._accept_burst()
                now = time.monotonic()
                self._expire(now)
                if self._paused_until and now >= self._paused_until:
                    self._paused_until = 0.0
                    self._selector.register(self.listener, selectors.EVENT_READ)
        finally:
            self._shut()
            self.cpu_seconds = thread_cpu() - started

    def _wait(self) -> float:
        """Until the oldest handshake's deadline or the end of a pause, at most a second."""
        now, until = time.monotonic(), 1.0
        if self._pending:
            until = min(until, next(iter(self._pending.values())).deadline - now)
        if self._paused_until:
            until = min(until, self._paused_until - now)
        return max(0.0, until)

    def _accept_burst(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # reset while it was queued
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM
                if not self._starved:
                    log.warning("%s: the broadcast's listener cannot accept (%s); the oldest handshakes give way",
                                self.node, exc.strerror or exc)
                self._starved = True
                if self._pending:
                    self._give_way(next(iter(self._pending.values())), STARVED)
                self._paused_until = time.monotonic() + ACCEPT_PAUSE
                self._selector.unregister(self.listener)
                return
            self._guarded(_Handshake(sock, address, time.monotonic() + HANDSHAKE_DEADLINE, b""), self._greet)

    def _guarded(self, handshake: _Handshake, step: Callable[[_Handshake], None]) -> None:
        """One connection's step: whatever it raises ends that connection only."""
        try:
            step(handshake)
        except OSError:
            self._end(handshake, LEFT)
        except Exception as exc:  # noqa: BLE001 - one connection must never stop the listener
            log.warning("%s: a broadcast handshake with %s failed: %r", self.node, handshake.host, exc)
            self._end(handshake, f"its handshake failed ({type(exc).__name__})")

    # ---- one connection -------------------------------------------------------------------------

    def _greet(self, handshake: _Handshake) -> None:
        """Make room for it within the bounds, send the challenge, and wait for its answer."""
        handshake.sock.setblocking(False)
        self._make_room(handshake.host)
        greeting, handshake.nonce = challenge()
        # A fresh connection's send buffer takes the 50 bytes whole.
        if handshake.sock.send(greeting) != len(greeting):
            raise ConnectionError("the greeting was not taken whole")
        self._pending[handshake.sock] = handshake
        self._by_address.setdefault(handshake.host, {})[handshake.sock] = handshake
        self._selector.register(handshake.sock, selectors.EVENT_READ, handshake)

    def _make_room(self, host: str) -> None:
        mine = self._by_address.get(host, {})
        if len(mine) >= HANDSHAKES_PER_ADDRESS:
            self._give_way(next(iter(mine.values())), CROWDED_ADDRESS)
        elif len(self._pending) >= HANDSHAKES:
            self._give_way(next(iter(max(self._by_address.values(), key=len).values())), CROWDED)

    def _give_way(self, oldest: _Handshake, why: str) -> None:
        """End the oldest handshake, unless its whole answer has arrived unread: a member's answer
        that came in with a burst of strangers is checked, and the member admitted."""
        self._guarded(oldest, self._read_answer)
        if oldest.sock in self._pending:
            self._end(oldest, why)

    def _read_answer(self, handshake: _Handshake) -> None:
        """Take what has arrived of the answer; once it is whole, check it: a stranger is refused,
        a member gets the server's proof and goes to `admitted`."""
        try:
            got = handshake.sock.recv(ANSWER_BYTES - len(handshake.answer))
        except (BlockingIOError, InterruptedError):
            return
        if not got:
            self._end(handshake, LEFT)
            return
        handshake.answer += got
        if len(handshake.answer) < ANSWER_BYTES:
            return
        self._forget(handshake)
        try:
            proof = server_proof(self._key, self._run_id, handshake.nonce, bytes(handshake.answer))
        except Refused:
            self._end(handshake, NO_PROOF)
            return
        # The client sends nothing more until it has this, so the send buffer is empty.
        if handshake.sock.send(proof) != len(proof):
            raise ConnectionError("the proof was not taken whole")
        handshake.sock.setblocking(True)
        try:
            self._admitted(handshake.sock)
        except RuntimeError:  # can't start new thread: a pids cgroup or RLIMIT_NPROC
            self._end(handshake, NO_THREAD)

    def _expire(self, now: float) -> None:
        """Hang up on every handshake past its deadline (the oldest are first)."""
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._end(oldest, TOO_SLOW)

    def _end(self, handshake: _Handshake, why: str) -> None:
        """Hang up on the connection and count it against its address."""
        self._forget(handshake)
        handshake.sock.close()
        if self.refusals.add(handshake.host, why):
            log.warning("%s refused a broadcast connection from %s: %s (more from that address are counted, "
                        "not logged)", self.node, handshake.host, why)

    def _forget(self, handshake: _Handshake) -> None:
        if self._pending.pop(handshake.sock, None) is None:
            return
        mine = self._by_address[handshake.host]
        del mine[handshake.sock]
        if not mine:
            del self._by_address[handshake.host]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(handshake.sock)

    def _shut(self) -> None:
        for handshake in list(self._pending.values()):
            self._forget(handshake)
            handshake.sock.close()
        self._selector.close()
        for sock in (self.listener, self._wake_in, self._wake_out):
            sock.close()
