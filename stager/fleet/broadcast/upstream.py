"""One stream of a node's receive: a connection to the nearest live node before it in the chain,
carrying chunk n of every file of the session when n % streams == stream.

Each stream connects, proves the key, asks, receives and checks on its own, in its own thread,
and leaves an upstream that died, went silent or sent a bad chunk on its own: no lock is shared
with the node's other streams while a chunk's bytes move, and one stream's trouble (a sender that
could serve one connection and not the next, a byte flipped on one link) costs the others nothing.
Every chunk of every stream is checked, so a sender left by one stream and kept by another can
pass on no byte that is not the head's. What the streams share is the tally of who was used and
who was bad.

Resume: each connection's request names, per file, the first chunk of its stream this node does
not hold, so a stream that loses its upstream mid-file asks the next holder from its last checked
chunk on, and no chunk crosses the network twice.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from stager.fleet.broadcast.gate import SOCKET_BUFFER
from stager.fleet.broadcast.keys import Refused, chunk_mac, join, mac_ok, recv_exact
from stager.fleet.broadcast.wire import (
    CHUNK, DATA, FRAME, LOST, SAMPLE, SAMPLE_LIMIT, Protocol, blocking, chunks_in, recv_into_all, request,
)

if TYPE_CHECKING:
    from stager.fleet.broadcast.relay import _Feed

log = logging.getLogger("stager.fleet.broadcast")

CONNECT_TIMEOUT = 5.0
HANDSHAKE_TIMEOUT = 10.0
JOIN_ATTEMPTS = 3
# An upstream that sends nothing for this long is routed around (a cut link). A node that stops
# answering altogether is moved out of the way by the driver before (chain.SILENT_REROUTE).
STALL_TIMEOUT = 15.0


class Stopped(Exception):
    """The file this stream was receiving failed on another stream: its chunks are of no use."""


class Upstream:
    """Stream `stream` of `streams` of one session's receive on this node (see the module)."""

    def __init__(self, feed: "_Feed", stream: int, streams: int):
        self.feed = feed
        self.relay = feed.relay
        self.stream, self.streams = stream, streams
        self.route = feed.session.chain
        self.shunned: set[str] = set()  # upstreams this stream left for good
        self.candidates = self._upstreams(self.route)
        self.conn: socket.socket | None = None
        self.header = memoryview(bytearray(FRAME.size))  # each frame's header is received into this
        self.upstream = ""
        self.lost: set[int] = set()  # files the current upstream said it does not hold
        self.hung_up = False  # the current connection was cut by a reroute, not by its upstream
        self.peer_bytes = 0

    @property
    def source(self) -> str | None:
        """Where the next chunk is asked: the upstream it is connected to, "nas" when no upstream
        is left, None while it connects to the next one."""
        if self.conn is not None:
            return self.upstream
        return None if self.candidates else "nas"

    def receive(self, file_id: int, offset: int, view: memoryview) -> bytes | None:
        """The chunk at `offset` into `view` from an upstream, checked; its key. None: read it
        from the NAS (no upstream is left, or the upstream does not hold the file)."""
        relay = self.relay
        while True:
            self._follow_route()
            if file_id in self.lost:
                return None
            if self.conn is None and not self._connect():
                return None
            try:
                recv_into_all(self.conn, self.header)
                kind, got_file, got_offset, length, mac = FRAME.unpack(self.header)
                if kind == LOST and got_file == file_id:
                    self.lost.add(file_id)
                    return None
                if (kind, got_file, got_offset, length) != (DATA, file_id, offset, len(view)):
                    raise Protocol(f"sent frame {kind} for file {got_file} at {got_offset} ({length} bytes) where "
                                   f"file {file_id} at {offset} was due")
                recv_into_all(self.conn, view)
            except (OSError, Protocol) as exc:
                self._failed(exc, "trying the next holder")
                continue
            if mac_ok(chunk_mac(relay._key, relay._run_id, file_id, offset, view), mac):
                self.peer_bytes += len(view)
                return mac
            # Refused: not written, not passed on; the same chunk is asked of the next holder.
            log.warning("%s: a chunk from %s failed its key (file %d, offset %d); refused", relay.node,
                        self.upstream, file_id, offset)
            self.feed.bad_senders.append(self.upstream)
            self._drop()

    def take_sample(self, file_id: int, size: int) -> str | None:
        """The SAMPLE frame that follows the file's last chunk on this stream, checked by its key.
        None (LOST, a silent or lost upstream, a bad key): land_verified samples the NAS."""
        if self.conn is None:
            return None
        try:
            kind, got_file, got_offset, length, mac = FRAME.unpack(recv_exact(self.conn, FRAME.size))
            if kind == LOST and (got_file, got_offset) == (file_id, size):
                return None
            if kind != SAMPLE or (got_file, got_offset) != (file_id, size) or length > SAMPLE_LIMIT:
                raise Protocol(f"sent frame {kind} for file {got_file} at {got_offset} where file {file_id}'s "
                               f"sample was due")
            payload = recv_exact(self.conn, length)
        except (OSError, Protocol) as exc:
            self._failed(exc, "no sample from it")
            return None
        if not mac_ok(chunk_mac(self.relay._key, self.relay._run_id, file_id, size, payload), mac):
            self.feed.bad_senders.append(self.upstream)
            self._drop()
            return None
        return payload.decode("ascii", "replace")

    def _upstreams(self, chain) -> list[tuple[str, str, int]]:
        """The nodes before this one in `chain`, nearest first: who to ask, in turn, before the NAS."""
        names = [name for name, _, _ in chain]
        return [hop for hop in reversed(chain[:names.index(self.relay.node)]) if hop[0] not in self.shunned]

    def _follow_route(self) -> None:
        """Take a rerouted chain into use: a new nearest upstream is asked from the next chunk on."""
        with self.relay.cond:
            route = self.relay.routes.get(self.feed.session.number, self.route)
        if route == self.route:
            return
        self.route = route
        self.candidates = self._upstreams(route)
        if self.conn is not None and (not self.candidates or self.candidates[0][0] != self.upstream):
            self.close()

    def _failed(self, exc: BaseException, then: str) -> None:
        """The current upstream's connection failed: it is left for good, and named if it broke
        the protocol. Unless a reroute hung up on it (the new upstream is asked), or another
        stream's failure ended the file (Stopped)."""
        if self.feed.stopping:
            self.close()
            raise Stopped() from None
        if self.hung_up:
            self.hung_up = False
            self.close()
            return
        log.warning("%s: upstream %s lost (%s); %s", self.relay.node, self.upstream, why(exc), then)
        if isinstance(exc, Protocol):
            self.feed.bad_senders.append(self.upstream)
        self._drop()

    def rerouted(self, chain) -> None:
        """From the driver's reroute (another thread): if this node's upstream now comes after it
        (it was the laggard, moved to the tail), hang up at once. Finishing the chunk in flight at
        the laggard's pace held the node back by a chunk's time at a quarter of the rate (2.7 s
        at 25 Mbit/s on the lab)."""
        names = [name for name, _, _ in chain]
        conn = self.conn
        if (conn is None or self.upstream not in names or self.relay.node not in names
                or names.index(self.upstream) < names.index(self.relay.node)):
            return
        self.hung_up = True
        self.interrupt()

    def interrupt(self) -> None:
        """Wake this stream's thread if it waits on its upstream (from another thread)."""
        conn = self.conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _connect(self) -> bool:
        relay = self.relay
        while self.candidates:
            name, host, port = self.candidates[0]
            try:
                sock = self._join(host, port)
                sock.sendall(self._request())
                blocking(sock, STALL_TIMEOUT)
            except (OSError, Refused) as exc:
                if isinstance(exc, Refused):
                    self.feed.bad_senders.append(name)
                log.warning("%s: cannot take the broadcast from %s (%s)", relay.node, name, why(exc))
                self.shunned.add(name)
                self.candidates.pop(0)
                continue
            self.conn, self.upstream, self.lost, self.hung_up = sock, name, set(), False
            self.feed.used.append(name)
            return True
        return False

    def _join(self, host: str, port: int) -> socket.socket:
        """A connection to the upstream at (host, port), both ends having proved the key. A
        handshake the upstream hung up on is tried again, JOIN_ATTEMPTS in all: under a flood of
        strangers from this node's own address its gate lets the oldest handshakes give way
        (gate.py), and one member's is seldom among them twice running."""
        attempts = JOIN_ATTEMPTS
        while True:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
                sock.settimeout(HANDSHAKE_TIMEOUT)
                join(sock, self.relay._key, self.relay._run_id)
                return sock
            except ConnectionError:
                sock.close()
                attempts -= 1
                if not attempts:
                    raise
            except BaseException:
                sock.close()
                raise

    def _request(self) -> bytes:
        """Where this stream starts each file: its first chunk this node does not hold (the size:
        it holds them all, or the file is lost here and the closing mirror copies it)."""
        offsets = []
        with self.relay.cond:
            for held in self.feed.files:
                missing = () if held.lost else (
                    number for number in range(self.stream, chunks_in(held.size), self.streams)
                    if number not in held.macs)
                offsets.append(next((number * CHUNK for number in missing), held.size))
        return request(self.feed.session.number, self.stream, self.streams, self.relay.node, offsets)

    def _drop(self) -> None:
        """Leave the current upstream for good (it died, went silent or sent a bad frame)."""
        self.close()
        if self.candidates:
            self.shunned.add(self.candidates.pop(0)[0])

    def close(self) -> None:
        """Hang up on the current upstream (a reconnect may ask it again)."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def why(exc: BaseException) -> str:
    return (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).strip()
