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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stager.mirror.copier import DirectWriter, SourceChanged
from stager.base.errors import CannotRun
from stager.mirror.execute import land_verified, writable_dir
from stager.mirror.fingerprint import Digest, Reference, sampled_digest
from stager.fleet.broadcast.gate import Gate, listen, thread_cpu
from stager.fleet.broadcast.keys import chunk_mac
from stager.fleet.broadcast.upstream import HANDSHAKE_TIMEOUT, Stopped, Upstream, why
from stager.fleet.broadcast.wire import (
    CHUNK, DATA, END, FRAME, LOST, NO_MAC, SAMPLE, Protocol, blocking, chunks_in, read_request, send_all,
)
from stager.fleet.report import Progress
from stager.base.lock import HUB_LOCK, writer_lock
from stager.mirror.observe import DigestCache
from stager.mirror.plan import CopyFile
from stager.sources.local import HUGE_PAGE, aligned_buffer
from stager.sources.throttle import Throttle

log = logging.getLogger("stager.fleet.broadcast")

# Streams per hop (connections, each with a thread at either end) when neither `--streams` nor
# `[fleet] streams` says: one per core this process may run on, at most AUTO_STREAMS. A stream's
# per-byte work (receive, key, write, send) releases the GIL, so K streams use K cores.
AUTO_STREAMS = 4
# How long a downstream that asks first waits for this node to start the same session.
SESSION_WAIT = 30.0
SEND_TIMEOUT = 60.0
# Chunks kept in memory after they are written, to be sent on from there: a healthy downstream is
# one or two chunks behind, and a node rerouted onto this one a few more. Read back from the copy
# instead (written around the page cache), every byte forwarded crossed the disk a second time: at
# 8 nodes the lab read 70 MB/s back, and a relay's CPU was 3.0 s per GB received against 2.6 s
# with these.
RECENT_CHUNKS = 8

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
        self.have = 0  # bytes written and checked: whole chunks, in any order (one stream may run ahead)
        self.fd = -1  # a read descriptor of the temp file: it survives the rename
        self.macs: dict[int, bytes] = {}  # chunk number -> its key, for each chunk written and checked
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


def default_streams() -> int:
    """Streams per hop for this node: its cores, at most AUTO_STREAMS."""
    return max(1, min(len(os.sched_getaffinity(0)), AUTO_STREAMS))


class Relay:
    """One node's relay for one fleet run. Built in the node's Ray actor; the key arrives with
    `open`, as a Ray call's argument, and lives in this object only.

    `digests` reads the NAS and keeps what was sampled of it, with the run's one seed (every node
    samples the same regions, so one node's sample of a file serves all): the node's closing
    mirror, in the same process, checks against the samples the landing checks used.

    `full` (stage fleet mirror --full, the same for every relay of a run): every file is checked
    against its reference (Share.reference) by the node that reads it from the NAS, as it reads,
    and the others take that node's hash with the chunks' keys (_Feed.fill)."""

    def __init__(self, node: str, hub: str, digests: DigestCache, never_write: tuple[str, ...], full: bool = False,
                 streams: int | None = None):
        self.node = node
        self.hub = Path(hub)
        self.digests = digests
        self.never_write = tuple(never_write)
        self.full = full
        self.streams = streams or default_streams()  # connections this node receives each session on
        self.cond = threading.Condition()
        self.sessions: dict[int, list[_Held]] = {}
        self.routes: dict[int, tuple] = {}  # session -> the chain as last rerouted by the driver
        self.feeds: dict[int, _Feed] = {}  # session -> where this node is receiving it from, while it is
        self.grew_at: float | None = None  # when a chunk last landed here (Progress.grew_at)
        self.cpu_seconds = 0.0  # of the threads that receive and serve, as each ends
        self.spare: list[_Chunk] = []  # chunk buffers no file holds and no sender uses
        self.closed = False
        self.gate: Gate | None = None  # the listener, and who it refused
        self._lock = contextlib.ExitStack()
        self._key = b""
        self._run_id = b""
        # --bwlimit: what this node sends its downstreams, all of them together (its NAS reads
        # have their own bucket, in its source).
        self.send_limit: Throttle | None = None

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
                            chunks=sum(chunks_in(held.size) if held.lost else len(held.macs)
                                       for held in self.sessions.get(number, ())),
                            read_at=time.monotonic(), grew_at=self.grew_at)

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
                    feed.fallbacks.append({"path": share.dest, "why": why(exc)})
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
        except (OSError, Protocol):
            pass  # the downstream went away or spoke nonsense: it reconnects to another holder
        finally:
            self.relay._count_cpu(started)

    def _serve(self) -> None:
        self.conn.settimeout(HANDSHAKE_TIMEOUT)
        number, stream, streams, offsets = read_request(self.conn)
        files = self._session(number)
        if files is None or len(offsets) != len(files):
            return
        blocking(self.conn, SEND_TIMEOUT)
        buffer = memoryview(aligned_buffer(CHUNK))
        for file_id, start in enumerate(offsets):
            if not self._send_file(file_id, files[file_id], start, stream, streams, buffer):
                return
        send_all(self.conn, FRAME.pack(END, 0, 0, 0, NO_MAC))

    def _session(self, number: int) -> list[_Held] | None:
        relay = self.relay
        with relay.cond:
            relay.cond.wait_for(lambda: number in relay.sessions or relay.closed, timeout=SESSION_WAIT)
            return relay.sessions.get(number)

    def _send_file(self, file_id: int, held: _Held, start: int, stream: int, streams: int, buffer) -> bool:
        """Send the file's chunks of `stream` (of `streams`) from `start` on, each as soon as this
        node holds it; then, on the stream that carries the file's last chunk, its sample. Nothing
        for a file the downstream already holds whole. False when this node is closing."""
        relay, conn = self.relay, self.conn
        if start >= held.size:
            return True
        if start % CHUNK or start // CHUNK % streams != stream:
            raise Protocol(f"asked for file {file_id} from {start}, not a chunk of its stream")
        last = chunks_in(held.size) - 1
        for number in range(start // CHUNK, last + 1, streams):
            offset = number * CHUNK
            with relay.cond:
                while number not in held.macs and not held.lost and not relay.closed:
                    relay.cond.wait(1.0)
                if relay.closed:
                    return False
                mac = held.macs.get(number)
                fd = held.fd
                recent = held.recent.get(number)
                if recent is not None:
                    recent.senders += 1
            if mac is None:
                send_all(conn, FRAME.pack(LOST, file_id, offset, 0, NO_MAC))
                return True
            length = min(CHUNK, held.size - offset)
            try:
                view = (recent.data if recent is not None else buffer)[:length]
                if recent is None and os.preadv(fd, [view], offset) != length:
                    raise OSError(errno.EIO, "its own copy is shorter than what it received")
                if relay.send_limit is not None:
                    relay.send_limit.take(length)
                send_all(conn, FRAME.pack(DATA, file_id, offset, length, mac), view)
            finally:
                if recent is not None:
                    with relay.cond:
                        recent.senders -= 1
                        relay._spare_if_free(recent)
        return self._send_sample(file_id, held) if last % streams == stream else True

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
    """Where this node's chunks of one session come from: its streams (upstream.Upstream), each
    from the nearest live upstream, else the NAS. Chunk n of a file travels on stream n % K; the
    streams of a file run in threads of their own (K - 1 of them, and the caller's), each
    receiving, checking, writing and keeping its chunks for the senders, and the file is whole when
    all have returned. A node with no upstream (the head) reads the NAS on every stream too, each
    read in its turn in the file's order (the NAS sees one sequential reader, as its read-ahead
    expects) while the keys and the writes run side by side; with --full it reads in one thread,
    hashing the file in order as it reads."""

    def __init__(self, relay: Relay, session: Session, files: list[_Held], cache: DigestCache):
        self.relay = relay
        self.session = session
        self.files = files
        self.cache = cache
        self.vouched: dict[int, Digest] = {}  # file id -> the sample its sender vouched for
        self.kept: list[tuple[_Held, int]] = []  # the chunks held in memory for the senders, oldest first
        self.fallbacks: list[dict] = []
        self.bad_senders: list[str] = []
        self.used: list[str] = []
        self.stopping = False  # a stream of the current file failed: the others give up on it
        self.nas = threading.Condition()  # the file's one NAS reader, what was read of it, whose turn it is
        self.read_nas: set[int] = set()  # files of which this node read some chunk from the NAS
        self.turn: dict[int, int] = {}  # file id -> the chunk to come next, for a file read from the NAS in order
        self.nas_bytes = 0
        self.upstreams = [Upstream(self, stream, relay.streams) for stream in range(relay.streams)]

    @property
    def peer_bytes(self) -> int:
        return sum(upstream.peer_bytes for upstream in self.upstreams)

    @property
    def source(self) -> str | None:
        """Where the next chunk is asked (the first stream's upstream, "nas", None while connecting)."""
        return self.upstreams[0].source

    def fill(self, file_id: int, reader, out, hasher) -> None:
        """land_verified's fill: the file's chunks, each checked, written at its offset; then the
        frame the sender puts after a file's last chunk: the sample (--full: the hash) it vouches
        for, taken up if every chunk came from peers (else this node sampled the NAS itself).

        With --full (a `hasher`) only a node reading the file from the NAS in order (the head)
        hashes as it reads; a node whose chunks came from peers relies on its sender's hash, and
        hashes its own copy only without one (a file read partly from the NAS, a lost sender)."""
        held = self.files[file_id]
        held.fd = os.open(f"/proc/self/fd/{out.fd}", os.O_RDONLY | os.O_CLOEXEC)
        hashed = 0  # bytes fed to `hasher`, in order from the first: this node's own reads of the NAS
        try:
            upstream = any(upstream.candidates for upstream in self.upstreams)
            if upstream or hasher is None:
                self._striped(file_id, reader, out, sample=hasher is None, in_order=not upstream)
            else:
                with DirectWriter(out.fd) as writer:
                    _, hashed = self._chunks(file_id, range(chunks_in(held.size)), None, reader, writer, hasher,
                                             sample=hasher is None)
            if hasher is not None and hashed < held.size and file_id not in self.vouched:
                _hash_copy(held.fd, hasher, hashed, held.size)
        except BaseException:
            self.close()  # what the upstreams still send for this file is of no use now
            raise

    def _striped(self, file_id: int, reader, out, sample: bool, in_order: bool) -> None:
        """Every stream's chunks of the file at once, then the sample from the stream that carried
        the last chunk: vouched for the file if no chunk of it came from the NAS. `in_order`: the
        NAS is read in the file's order, whichever stream reads."""
        held = self.files[file_id]
        last = chunks_in(held.size) - 1
        taken: list[str | None] = []

        def part(upstream: Upstream) -> None:
            with DirectWriter(out.fd) as writer:
                from_peer, _ = self._chunks(file_id, range(upstream.stream, last + 1, len(self.upstreams)), upstream,
                                            reader, writer, None, sample, in_order)
            if from_peer and last % len(self.upstreams) == upstream.stream:
                # Taken off the connection even when unused: a node that read part of the file
                # from the NAS and the rest from a peer (rerouted onto it) once read this frame
                # as the next file's first chunk and named a healthy peer.
                taken.append(upstream.take_sample(file_id, held.size))

        def alone() -> None:
            if in_order:  # every chunk from the NAS, in order, in this one thread
                with DirectWriter(out.fd) as writer:
                    self._chunks(file_id, range(last + 1), None, reader, writer, None, sample)
            else:
                for upstream in self.upstreams[:last + 1]:
                    part(upstream)

        # A file of fewer chunks than streams: a thread for each stream that carries one.
        self._in_threads([lambda upstream=upstream: part(upstream) for upstream in self.upstreams[:last + 1]], alone)
        if taken and taken[0] is not None and file_id not in self.read_nas:
            method = self.session.files[file_id].reference.method if self.relay.full else f"sampled:{self.cache.seed}"
            self.vouched[file_id] = Digest(method, held.size, taken[0])

    def _chunks(self, file_id: int, numbers: range, upstream: Upstream | None, reader, writer: DirectWriter,
                hasher, sample: bool, in_order: bool = False) -> tuple[bool, int]:
        """The chunks `numbers` of the file, each from `upstream` (checked) or else the NAS (keyed
        here), written at its offset and kept for the senders. Returns whether the last came from a
        peer, and how many bytes from the file's start went to `hasher` (an in-order NAS read)."""
        relay, held = self.relay, self.files[file_id]
        from_peer, hashed = False, 0
        for number in numbers:
            if self.stopping:
                raise Stopped()
            if number in held.macs:
                continue  # a file taken up again on one thread (see _in_threads): what its streams hold stays
            offset = number * CHUNK
            chunk = relay.take_chunk()
            view = chunk.data[:min(CHUNK, held.size - offset)]
            mac = upstream.receive(file_id, offset, view) if upstream is not None else None
            from_peer = mac is not None
            if mac is None:
                mac = self._read_nas(file_id, reader, view, offset, sample, in_order)
            elif in_order:  # a head moved to the tail takes its chunks from peers: the NAS's turn moves on
                self._turn_taken(file_id, number)
            writer.write(view, offset)
            if hasher is not None and hashed == offset:
                hasher.update(view)
                hashed += len(view)
            with relay.cond:
                held.macs[number] = mac
                held.have += len(view)
                relay.grew_at = time.monotonic()
                relay.keep_recent(held, number, chunk, self.kept)
                relay.cond.notify_all()
        return from_peer, hashed

    def _read_nas(self, file_id: int, reader, view: memoryview, offset: int, sample: bool, in_order: bool) -> bytes:
        """The chunk at `offset` read from the NAS into `view`, and its key, made here. Before the
        file's first read the NAS is sampled, as a copy from the NAS samples it (with --full the
        hash of every byte is the check instead). One stream reads at a time: the reader is the
        file's one; `in_order`, each once the chunk before it is read."""
        number = offset // CHUNK
        with self.nas:
            while in_order and self.turn.get(file_id, 0) != number:
                if self.stopping:
                    raise Stopped()
                self.nas.wait(1.0)
            if file_id not in self.read_nas:
                self.read_nas.add(file_id)
                if sample:
                    self.cache.remember(self.session.files[file_id].source, sampled_digest(reader, self.cache.seed))
            if reader.readinto_at(view, offset) != len(view):
                raise SourceChanged(errno.EIO, f"the NAS file ended before {self.files[file_id].size} bytes")
            self.nas_bytes += len(view)
            if in_order:
                self._turn_taken(file_id, number)
        return chunk_mac(self.relay._key, self.relay._run_id, file_id, offset, view)

    def _turn_taken(self, file_id: int, number: int) -> None:
        with self.nas:
            self.turn[file_id] = number + 1
            self.nas.notify_all()

    def _in_threads(self, parts: list, alone) -> None:
        """Run every part at once, the first in this thread and each other in a thread of its own,
        and return when all have; a part that fails stops the others at their next chunk (or wakes
        them from their upstream, or their turn at the NAS), and its error is raised. Where a thread
        cannot be started (a pids limit), the parts started are stopped and `alone` does the whole
        in this thread: a relay short of threads still lands the file."""
        errors: list[BaseException] = []

        def run(part) -> None:
            try:
                part()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread, below
                errors.append(exc)
                self._stop()

        def counted(part) -> None:
            started = thread_cpu()
            try:
                run(part)
            finally:
                self.relay._count_cpu(started)

        threads: list[threading.Thread] = []
        try:
            for part in parts[1:]:
                threads.append(threading.Thread(target=counted, args=(part,), name="stage-broadcast-stream",
                                                daemon=True))
                threads[-1].start()
        except RuntimeError:  # can't start new thread
            threads.pop()
            self._stop()
            for thread in threads:
                thread.join()
            self.stopping = False
            if any(not isinstance(exc, Stopped) for exc in errors):
                raise next(exc for exc in errors if not isinstance(exc, Stopped)) from None
            alone()
            return
        run(parts[0])
        for thread in threads:
            thread.join()
        self.stopping = False
        if errors:
            raise next((exc for exc in errors if not isinstance(exc, Stopped)), errors[0])

    def _stop(self) -> None:
        """The file's parts stop at their next chunk, or now if they wait on an upstream or the NAS."""
        self.stopping = True
        for upstream in self.upstreams:
            upstream.interrupt()
        with self.nas:
            self.nas.notify_all()

    def rerouted(self, chain) -> None:
        """From the driver's reroute (another thread): each stream whose upstream now comes after
        this node hangs up at once (Upstream.rerouted)."""
        for upstream in self.upstreams:
            upstream.rerouted(chain)

    def close(self) -> None:
        """Hang up on every upstream (a reconnect may ask them again)."""
        for upstream in self.upstreams:
            upstream.close()


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
