"""A node's part in a broadcast: the relay, run inside the node's Ray actor.

For each session (the files one set of nodes all need, and the chain over exactly those nodes)
the relay receives every file from the nearest live node before it in the chain, or reads it
from the NAS when it is the head or no upstream is left. Every chunk's key (keys.chunk_mac) is
checked before the chunk is written or passed on. The file lands through the executor's own
check-and-rename (execute.land_verified), so nothing a peer sends reaches a final name
unverified: the node that read the file from the NAS checks it against the NAS, as a copy from
the NAS is checked, then sends its sample of the NAS file after the last chunk, keyed like one;
each node downstream checks its copy against that sample (and forwards it) instead of reading
the NAS again.

Downstream nodes are served what this relay has already written and checked: its last few
chunks from memory, older ones read back from its copy. The receive never waits for a
downstream (a chunk being sent when the receive needs a buffer is left to its sender, and the
receive takes another), so a slow or dead downstream cannot stall it, and a downstream can
resume from any (file, chunk) it asks for, on any holder. Whatever the relay cannot land (a bad
or silent upstream with no other holder and an unreadable NAS, a file that changed) is left to
the node's closing `stage mirror`, which copies it from the NAS: a fallback, reported.

The relay holds the node hub's writer lock from `open` until its last session is landed (then the
node's closing mirror may start while it still serves downstream nodes); a relay killed at any
point leaves only temp files (swept by the next mirror) and the blobs it had fully checked.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import resource
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from stager.mirror.copier import DirectWriter, SourceChanged
from stager.base.errors import CannotRun
from stager.mirror.execute import land_verified, writable_dir
from stager.mirror.fingerprint import Digest, Reference, sampled_digest
from stager.fleet.broadcast.gate import SOCKET_BUFFER, Gate, listen, thread_cpu
from stager.fleet.broadcast.keys import MAC_BYTES, Refused, chunk_mac, join, mac_ok, recv_exact
from stager.fleet.broadcast.wire import blocking, recv_into_all, send_all
from stager.fleet.report import Progress
from stager.base.lock import HUB_LOCK, writer_lock
from stager.mirror.observe import DigestCache
from stager.mirror.plan import CopyFile
from stager.sources.local import HUGE_PAGE, aligned_buffer

log = logging.getLogger("stager.fleet.broadcast")

# A node forwards a chunk once it has all of it, so the last node finishes (N-1) chunk times
# after the head. 8 nodes on the lab's 200 Mbit/s links (medians of 3, each pair in the same
# rounds): 32.6 s with 8 MiB against 30.8 s with 4 MiB; 30.1 s with 2 MiB against 30.9 s with
# 4 MiB; 29.1 s with 1 MiB against 29.8 s with 2 MiB, at the same relay CPU per GB. On 25 GbE and
# up a chunk time is well under a millisecond, and a chunk's fixed cost (a frame, a key, a write)
# stays small beside hashing and copying its MiB.
CHUNK = 1024 * 1024
CONNECT_TIMEOUT = 5.0
HANDSHAKE_TIMEOUT = 10.0
JOIN_ATTEMPTS = 3
# An upstream that sends nothing for this long is routed around (a hung node, a cut link).
STALL_TIMEOUT = 15.0
# How long a downstream that asks first waits for this node to start the same session.
SESSION_WAIT = 30.0
SEND_TIMEOUT = 60.0
# Chunks kept in memory after they are written, to be sent on from there: a healthy downstream is
# one or two chunks behind, and a node rerouted onto this one a few more. Read back from the copy
# instead (written around the page cache), every byte forwarded crossed the disk a second time: at
# 8 nodes the lab read 70 MB/s back, and a relay's CPU was 3.0 s per GB received against 2.6 s
# with these.
RECENT_CHUNKS = 8

# SAMPLE follows a file's last chunk: what the node that read the file from the NAS found it to
# be, keyed like a chunk at offset = the file's size: its sample of the NAS file once its own check
# passed; with --full its hash of every byte it read, whether or not that is the file's name (a
# file refused on its head is then refused downstream without a hash). LOST there: nothing.
DATA, LOST, END, SAMPLE = 1, 2, 3, 4
FRAME = struct.Struct("<BIQI32s")  # kind, file id, offset, length, the head's chunk key
SAMPLE_LIMIT = 256  # bytes: a sample's value is a 32-character hex digest
REQUEST = struct.Struct("<IHI")  # session, length of the node name, number of files
NO_MAC = bytes(MAC_BYTES)


@dataclass(frozen=True)
class Share:
    """One file that several nodes need: its hub-relative name on the node and on the NAS."""

    dest: str
    source: str
    size: int
    # What its bytes must hash to with --full (its blob name, the trees listing), from the plan.
    reference: Reference = Reference("blake3", None, "source copy")


@dataclass(frozen=True)
class Session:
    """The files one set of nodes needs, and the chain over exactly those nodes, head first."""

    number: int
    files: tuple[Share, ...]
    chain: tuple[tuple[str, str, int], ...]  # (node, host, port)


class _Held:
    """One file of a session on this node: how much of it is written, with the chunks' keys."""

    def __init__(self, size: int):
        self.size = size
        self.have = 0  # written and checked, from offset 0: always a whole number of chunks, or size
        self.fd = -1  # a read descriptor of the temp file: it survives the rename
        self.macs: dict[int, bytes] = {}
        self.recent: dict[int, _Chunk] = {}  # chunk number -> its bytes, for the last few written
        self.lost = False  # this node will not get the rest: downstream nodes look elsewhere
        self.sample: str | None = None  # the NAS file's sample, once this node's copy passed its check
        self.refusal: str | None = None  # --full: the NAS bytes' hash, which is not the file's name


class _Chunk:
    """A chunk buffer (page-aligned, for the direct write), and how many senders are using it."""

    def __init__(self, data: memoryview):
        self.data = data
        self.senders = 0
        self.retired = False  # out of its file's recent chunks: spare again once no sender uses it


class _Protocol(Exception):
    """An upstream sent something other than the chunk that was due."""


def chunks_in(size: int) -> int:
    return -(-size // CHUNK)


class Relay:
    """One node's relay for one fleet run. Built in the node's Ray actor; the key arrives with
    `open`, as a Ray call's argument, and lives in this object only.

    `digests` reads the NAS and keeps what was sampled of it, with the run's one seed (every node
    samples the same regions, so one node's sample of a file serves all): the node's closing
    mirror, in the same process, checks against the samples the landing checks used.

    `full` (stage fleet mirror --full, the same for every relay of a run): every file is checked
    against its reference (Share.reference) by the node that reads it from the NAS, as it reads,
    and the others take that node's hash with the chunks' keys (_Feed.fill)."""

    def __init__(self, node: str, hub: str, digests: DigestCache, never_write: tuple[str, ...], full: bool = False):
        self.node = node
        self.hub = Path(hub)
        self.digests = digests
        self.never_write = tuple(never_write)
        self.full = full
        self.cond = threading.Condition()
        self.sessions: dict[int, list[_Held]] = {}
        self.routes: dict[int, tuple] = {}  # session -> the chain as last rerouted by the driver
        self.feeds: dict[int, _Feed] = {}  # session -> where this node is receiving it from, while it is
        self.cpu_seconds = 0.0  # of the threads that receive and serve, as each ends
        self.spare: list[_Chunk] = []  # chunk buffers no file holds and no sender uses
        self.closed = False
        self.gate: Gate | None = None  # the listener, and who it refused
        self._lock = contextlib.ExitStack()
        self._key = b""
        self._run_id = b""

    # ---- the run's life -------------------------------------------------------------------------

    def open(self, host: str, ports: tuple[int, int] | None, key: bytes, run_id: bytes) -> int:
        """Take the node hub's writer lock and listen on `host`; returns the port."""
        self._key, self._run_id = key, run_id
        try:
            self.hub.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CannotRun(f"node hub {self.hub} cannot be created: {exc.strerror}") from None
        self._lock.enter_context(writer_lock(self.hub / HUB_LOCK, f"local hub {self.hub}"))
        # One read descriptor per landed file stays open to serve it: a model of many shards
        # would run into a soft limit of 1,024.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.gate = Gate(self.node, listen(host, ports), key, run_id, self._start_serving)
        return self.gate.port

    def progress(self, phase: str) -> Progress:
        """What this node holds of the sessions it was given, and where its next chunk comes from
        (the driver asks once a second: a silent node, a laggard, a progress display). Counters
        read under the lock: it never waits for the receive, the disk or the NAS. The latest
        session's chunks too: a chain moves whole chunks, and a file a little under a chunk left a
        node two files behind short of two chunks' bytes."""
        with self.cond:
            number = max(self.sessions, default=None)
            files = [held for session in self.sessions.values() for held in session]
            feed = self.feeds.get(number)
            return Progress(phase, done_bytes=sum(held.have for held in files),
                            total_bytes=sum(held.size for held in files),
                            landed_files=sum(held.sample is not None for held in files),
                            source=feed.source if feed is not None else None, session=number,
                            chunks=sum(chunks_in(held.size) if held.lost else chunks_in(held.have)
                                       for held in self.sessions.get(number, ())))

    def reroute(self, number: int, chain: tuple[tuple[str, str, int], ...]) -> None:
        """A new order for the session's chain (a laggard moved to the tail): this node takes
        its chunks from its new upstream from the next chunk on, or at once if its upstream was
        the laggard."""
        with self.cond:
            self.routes[number] = chain
            feed = self.feeds.get(number)
        if feed is not None:
            feed.rerouted(chain)

    def close(self) -> dict:
        """Stop serving, close every descriptor, release the lock. Returns who was refused (the
        gate's summary by address), and the CPU seconds the relay's threads have used."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.gate is not None:
            self.gate.close()
        with self.cond:
            for files in self.sessions.values():
                for held in files:
                    if held.fd >= 0:
                        os.close(held.fd)
                        held.fd = -1
        self._lock.close()
        self._key = b""
        gate = self.gate
        with self.cond:
            return {"refused": gate.refusals.summary() if gate else [],
                    "cpu_seconds": self.cpu_seconds + (gate.cpu_seconds if gate else 0.0)}

    # ---- receiving ------------------------------------------------------------------------------

    def run(self, session: Session, last: bool) -> dict:
        """Receive and land every file of the session; returns what came from where. After this
        node's `last` session the hub's lock is let go: nothing more is written, and what was
        landed is served from the descriptors held open, so the node's closing mirror can start."""
        started = thread_cpu()
        files = [_Held(share.size) for share in session.files]
        with self.cond:
            self.sessions[session.number] = files
            self.cond.notify_all()
        nas, cache = self.digests.source, self.digests
        feed = _Feed(self, session, files, cache)
        with self.cond:
            self.feeds[session.number] = feed
        landed = 0
        try:
            for file_id, share in enumerate(session.files):
                try:
                    self._land(file_id, share, nas, cache, feed)
                    landed += 1
                except Exception as exc:  # noqa: BLE001 - any failure: the node's mirror copies it from the NAS
                    feed.fallbacks.append({"path": share.dest, "why": _why(exc)})
                    with self.cond:
                        files[file_id].lost = True
                        self.cond.notify_all()
        finally:
            with self.cond:
                self.feeds.pop(session.number, None)
            feed.close()
            self.drop_recent(feed.kept)
            if last:
                self._lock.close()
            self._count_cpu(started)
        return {"peer_bytes": feed.peer_bytes, "nas_bytes": feed.nas_bytes, "landed_files": landed,
                "fallbacks": feed.fallbacks, "bad_senders": sorted(set(feed.bad_senders)),
                "upstreams": feed.used}

    def _land(self, file_id: int, share: Share, nas, cache: DigestCache, feed: "_Feed") -> None:
        meta = nas.lstat(share.source)
        if meta is None or meta.kind != "file" or meta.size != share.size:
            raise SourceChanged(errno.EIO, "the NAS file changed since the plan")
        writable_dir(self.hub, posixpath.dirname(share.dest), self.never_write)
        # The reference counts with --full only: by default a fleet mirror checks by samples against the NAS.
        copy = CopyFile(share.dest, share.source, share.size, meta.mtime_ns, share.reference, "broadcast")
        full = self.full
        try:
            land_verified(copy, nas, self.hub, cache, full,
                          lambda reader, out, hasher: feed.fill(file_id, reader, out, hasher),
                          vouched=lambda: feed.vouched.get(file_id))
        except Exception:
            # The NAS's bytes hash to something other than the file's name: every node downstream
            # is told so, and refuses the file without hashing it or reading the NAS.
            refusal = cache.known(share.source, share.reference.method) if full and share.reference.value else None
            if refusal is not None and refusal.value != share.reference.value:
                with self.cond:
                    feed.files[file_id].refusal = refusal.value
            raise
        verdict = cache.known(share.source, share.reference.method) if full else cache.sampled(share.source)
        with self.cond:
            feed.files[file_id].sample = verdict.value
            self.cond.notify_all()

    # ---- serving --------------------------------------------------------------------------------

    def _start_serving(self, conn: socket.socket) -> None:
        """The gate's hand-off of a connection that proved the key: a downstream, served in a
        thread of its own (members only, so a handful per run)."""
        threading.Thread(target=_Downstream(self, conn).serve, name="stage-broadcast-serve", daemon=True).start()

    def _count_cpu(self, started: float) -> None:
        with self.cond:
            self.cpu_seconds += thread_cpu() - started

    # ---- chunk buffers --------------------------------------------------------------------------

    def take_chunk(self) -> _Chunk:
        """A buffer to receive the next chunk into: a spare one, else one of a new huge page's."""
        with self.cond:
            if not self.spare:
                self.spare.extend(_huge_page_of_chunks())
            return self.spare.pop()

    def keep_recent(self, held: _Held, number: int, chunk: _Chunk, order: list) -> None:
        """Keep the chunk just written in memory for the senders; the oldest kept chunk of the
        session (`order`: (file, chunk number), oldest first) goes. Called holding `cond`."""
        held.recent[number] = chunk
        order.append((held, number))
        if len(order) > RECENT_CHUNKS:
            old_held, old_number = order.pop(0)
            old = old_held.recent.pop(old_number)
            old.retired = True
            self._spare_if_free(old)

    def drop_recent(self, order: list) -> None:
        """The session is over on this side: its kept chunks are read back from the copies."""
        with self.cond:
            for held, number in order:
                chunk = held.recent.pop(number)
                chunk.retired = True
                self._spare_if_free(chunk)
            order.clear()

    def _spare_if_free(self, chunk: _Chunk) -> None:
        # A few spares at most: more would only be memory held for a chunk nobody receives.
        if chunk.retired and chunk.senders == 0 and len(self.spare) <= RECENT_CHUNKS:
            chunk.retired = False
            self.spare.append(chunk)


class _Downstream:
    """One downstream that proved the key, in a thread of its own: each file from where it asks,
    as this node gets it (its recent chunks from memory, older ones read back from its copy),
    then the file's sample. What _Feed is on the other end."""

    def __init__(self, relay: Relay, conn: socket.socket):
        self.relay = relay
        self.conn = conn

    def serve(self) -> None:
        started = thread_cpu()
        try:
            with self.conn:
                self._serve()
        except (OSError, _Protocol):
            pass  # the downstream went away or spoke nonsense: it reconnects to another holder
        finally:
            self.relay._count_cpu(started)

    def _serve(self) -> None:
        self.conn.settimeout(HANDSHAKE_TIMEOUT)
        number, offsets = _read_request(self.conn)
        files = self._session(number)
        if files is None or len(offsets) != len(files):
            return
        blocking(self.conn, SEND_TIMEOUT)
        buffer = aligned_buffer(CHUNK)
        for file_id, start in enumerate(offsets):
            if not self._send_file(file_id, files[file_id], start, buffer):
                return
        send_all(self.conn, FRAME.pack(END, 0, 0, 0, NO_MAC))

    def _session(self, number: int) -> list[_Held] | None:
        relay = self.relay
        with relay.cond:
            relay.cond.wait_for(lambda: number in relay.sessions or relay.closed, timeout=SESSION_WAIT)
            return relay.sessions.get(number)

    def _send_file(self, file_id: int, held: _Held, offset: int, buffer) -> bool:
        """Send the file from `offset` as this node gets it, then its sample; nothing for a file
        the downstream already holds whole. False when this node is closing."""
        relay, conn = self.relay, self.conn
        if offset >= held.size:
            return True
        while offset < held.size:
            with relay.cond:
                while held.have <= offset and not held.lost and not relay.closed:
                    relay.cond.wait(1.0)
                if relay.closed:
                    return False
                if held.have <= offset:
                    conn.sendall(FRAME.pack(LOST, file_id, offset, 0, NO_MAC))
                    return True
                mac = held.macs[offset // CHUNK]
                fd = held.fd
                recent = held.recent.get(offset // CHUNK)
                if recent is not None:
                    recent.senders += 1
            length = min(CHUNK, held.size - offset)
            try:
                view = memoryview(recent.data if recent is not None else buffer)[:length]
                if recent is None and os.preadv(fd, [view], offset) != length:
                    raise OSError(errno.EIO, "its own copy is shorter than what it received")
                send_all(conn, FRAME.pack(DATA, file_id, offset, length, mac), view)
                view.release()
            finally:
                if recent is not None:
                    with relay.cond:
                        recent.senders -= 1
                        relay._spare_if_free(recent)
            offset += length
        return self._send_sample(file_id, held)

    def _send_sample(self, file_id: int, held: _Held) -> bool:
        """After a file's last chunk: its NAS sample once this node's own check has passed (LOST
        if it failed), so the downstream need not sample the NAS itself. False when closing."""
        relay, conn = self.relay, self.conn
        with relay.cond:
            while held.sample is None and not held.lost and not relay.closed:
                relay.cond.wait(1.0)
            if relay.closed:
                return False
            sample = held.sample if held.sample is not None else held.refusal
        if sample is None:
            conn.sendall(FRAME.pack(LOST, file_id, held.size, 0, NO_MAC))
        else:
            payload = sample.encode()
            mac = chunk_mac(relay._key, relay._run_id, file_id, held.size, payload)
            conn.sendall(FRAME.pack(SAMPLE, file_id, held.size, len(payload), mac) + payload)
        return True


class _Feed:
    """Where this node's chunks come from: the nearest live upstream, else the NAS."""

    def __init__(self, relay: Relay, session: Session, files: list[_Held], cache: DigestCache):
        self.relay = relay
        self.session = session
        self.files = files
        self.cache = cache
        self.vouched: dict[int, Digest] = {}  # file id -> the sample its sender vouched for
        self.route = session.chain
        self.shunned: set[str] = set()  # upstreams that died, went silent or sent a bad chunk
        self.candidates = self._upstreams(session.chain)
        self.conn: socket.socket | None = None
        self.header = memoryview(bytearray(FRAME.size))  # each frame's header is received into this
        self.upstream = ""
        self.lost: set[int] = set()  # files the current upstream said it does not hold
        self.hung_up = False  # the current connection was cut by a reroute, not by its upstream
        self.kept: list[tuple[_Held, int]] = []  # the chunks held in memory for the senders, oldest first
        self.peer_bytes = 0
        self.nas_bytes = 0
        self.fallbacks: list[dict] = []
        self.bad_senders: list[str] = []
        self.used: list[str] = []

    @property
    def source(self) -> str | None:
        """Where the next chunk is asked: the upstream it is connected to, "nas" when no upstream
        is left, None while it connects to the next one."""
        if self.conn is not None:
            return self.upstream
        return None if self.candidates else "nas"

    def fill(self, file_id: int, reader, out, hasher) -> None:
        """land_verified's fill: the file's chunks, each checked, written at its offset; then the
        frame the sender puts after a file's last chunk: the sample (--full: the hash) it vouches
        for, taken up if every chunk came from peers (else this node sampled the NAS itself).

        With --full (a `hasher`) only a node reading the file from the NAS from its first byte on
        hashes as it reads; a node whose chunks came from peers relies on its sender's hash, and
        hashes its own copy only without one (a file read partly from the NAS, a lost sender)."""
        relay, held = self.relay, self.files[file_id]
        held.fd = os.open(f"/proc/self/fd/{out.fd}", os.O_RDONLY | os.O_CLOEXEC)
        writer = DirectWriter(out.fd)
        from_nas = False
        last_from_peer = False
        hashed = 0  # bytes fed to `hasher`, in order from the first: this node's own reads of the NAS
        try:
            while held.have < held.size:
                offset = held.have
                chunk = relay.take_chunk()
                view = memoryview(chunk.data)[:min(CHUNK, held.size - offset)]
                mac = self._from_peers(file_id, offset, view)
                if mac is None:
                    if not from_nas and hasher is None:
                        # Before the first byte read from the NAS, as a copy from the NAS samples it.
                        self.cache.remember(self.session.files[file_id].source, sampled_digest(reader, self.cache.seed))
                    from_nas = True
                    if reader.readinto_at(view, offset) != len(view):
                        raise SourceChanged(errno.EIO, f"the NAS file ended before {held.size} bytes")
                    mac = chunk_mac(relay._key, relay._run_id, file_id, offset, view)
                    self.nas_bytes += len(view)
                    last_from_peer = False
                else:
                    self.peer_bytes += len(view)
                    last_from_peer = True
                writer.write(view, offset)
                if hasher is not None and hashed == offset and not last_from_peer:
                    hasher.update(view)
                    hashed += len(view)
                length = len(view)
                view.release()
                with relay.cond:
                    held.macs[offset // CHUNK] = mac
                    held.have = offset + length
                    relay.keep_recent(held, offset // CHUNK, chunk, self.kept)
                    relay.cond.notify_all()
            if last_from_peer:
                # Taken off the connection even when unused: a node that read part of the file
                # from the NAS and the rest from a peer (rerouted onto it) once read this frame
                # as the next file's first chunk and named a healthy peer.
                self._take_sample(file_id, held.size, vouched=not from_nas)
            if hasher is not None and hashed < held.size and file_id not in self.vouched:
                _hash_copy(held.fd, hasher, hashed, held.size)
        except BaseException:
            self.close()  # what the upstream still sends for this file is of no use now
            raise
        finally:
            writer.close()

    def _take_sample(self, file_id: int, size: int, vouched: bool) -> None:
        """The SAMPLE frame that follows the file's last chunk on the same connection, checked by
        its key, and `vouched` for the file. None of it (LOST, a silent or lost upstream):
        land_verified samples the NAS."""
        if self.conn is None:
            return
        try:
            kind, got_file, got_offset, length, mac = FRAME.unpack(recv_exact(self.conn, FRAME.size))
            if kind == LOST and (got_file, got_offset) == (file_id, size):
                return
            if kind != SAMPLE or (got_file, got_offset) != (file_id, size) or length > SAMPLE_LIMIT:
                raise _Protocol(f"sent frame {kind} for file {got_file} at {got_offset} where file {file_id}'s "
                                f"sample was due")
            payload = recv_exact(self.conn, length)
        except (OSError, _Protocol) as exc:
            self._failed(exc, "no sample from it")
            return
        if not mac_ok(chunk_mac(self.relay._key, self.relay._run_id, file_id, size, payload), mac):
            self.bad_senders.append(self.upstream)
            self._drop()
            return
        if vouched:
            method = self.session.files[file_id].reference.method if self.relay.full else f"sampled:{self.cache.seed}"
            self.vouched[file_id] = Digest(method, size, payload.decode("ascii", "replace"))

    def _from_peers(self, file_id: int, offset: int, view: memoryview) -> bytes | None:
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
                    raise _Protocol(f"sent frame {kind} for file {got_file} at {got_offset} ({length} bytes) where "
                                    f"file {file_id} at {offset} was due")
                recv_into_all(self.conn, view)
            except (OSError, _Protocol) as exc:
                self._failed(exc, "trying the next holder")
                continue
            if mac_ok(chunk_mac(relay._key, relay._run_id, file_id, offset, view), mac):
                return mac
            # Refused: not written, not passed on; the same chunk is asked of the next holder.
            log.warning("%s: a chunk from %s failed its key (file %d, offset %d); refused", relay.node,
                        self.upstream, file_id, offset)
            self.bad_senders.append(self.upstream)
            self._drop()

    def _upstreams(self, chain) -> list[tuple[str, str, int]]:
        """The nodes before this one in `chain`, nearest first: who to ask, in turn, before the NAS."""
        names = [name for name, _, _ in chain]
        return [hop for hop in reversed(chain[:names.index(self.relay.node)]) if hop[0] not in self.shunned]

    def _follow_route(self) -> None:
        """Take a rerouted chain into use: a new nearest upstream is asked from the next chunk on."""
        with self.relay.cond:
            route = self.relay.routes.get(self.session.number, self.route)
        if route == self.route:
            return
        self.route = route
        self.candidates = self._upstreams(route)
        if self.conn is not None and (not self.candidates or self.candidates[0][0] != self.upstream):
            self.conn.close()
            self.conn = None

    def _failed(self, exc: BaseException, then: str) -> None:
        """The current upstream's connection failed: it is left for good, and named if it broke
        the protocol. Unless a reroute hung up on it: then the new upstream is asked."""
        if self.hung_up:
            self.hung_up = False
            self.close()
            return
        log.warning("%s: upstream %s lost (%s); %s", self.relay.node, self.upstream, _why(exc), then)
        if isinstance(exc, _Protocol):
            self.bad_senders.append(self.upstream)
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
                    self.bad_senders.append(name)
                log.warning("%s: cannot take the broadcast from %s (%s)", relay.node, name, _why(exc))
                self.shunned.add(name)
                self.candidates.pop(0)
                continue
            self.conn, self.upstream, self.lost, self.hung_up = sock, name, set(), False
            self.used.append(name)
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
        """Where to start each file: what this node already holds (all of a file it is done with)."""
        me = self.relay.node.encode()
        offsets = [held.size if held.lost else held.have for held in self.files]
        return (REQUEST.pack(self.session.number, len(me), len(offsets)) + me
                + struct.pack(f"<{len(offsets)}Q", *offsets))

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


def _read_request(conn: socket.socket) -> tuple[int, list[int]]:
    number, name_length, count = REQUEST.unpack(recv_exact(conn, REQUEST.size))
    if name_length > 255 or count > 1 << 20:
        raise _Protocol("an oversized request")
    recv_exact(conn, name_length)
    return number, list(struct.unpack(f"<{count}Q", recv_exact(conn, 8 * count)))


def _hash_copy(fd: int, hasher, start: int, size: int) -> None:
    """Feed `hasher` this node's copy from `start` to `size`, read back from its descriptor."""
    buffer = memoryview(aligned_buffer(CHUNK))
    offset = start
    while offset < size:
        got = os.preadv(fd, [buffer[:min(CHUNK, size - offset)]], offset)
        if got <= 0:
            raise OSError(errno.EIO, f"its own copy ended at {offset} of {size} bytes")
        hasher.update(buffer[:got])
        offset += got


def _huge_page_of_chunks() -> list[_Chunk]:
    """Chunk buffers carved from one huge page (transparent huge pages where the kernel has them):
    the direct write pins one page for two chunks instead of 512, and the receive's copy and the
    key's hash run over two TLB entries."""
    page = memoryview(aligned_buffer(HUGE_PAGE))
    return [_Chunk(page[at:at + CHUNK]) for at in range(0, HUGE_PAGE, CHUNK)]


def _why(exc: BaseException) -> str:
    return (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).strip()
