"""The broadcast's bytes on a connection: frames and chunks moved straight between a socket and the
relay's own buffers, in as few system calls as the kernel allows.

A connection that proved the key is put in blocking mode with the kernel's own timeouts
(SO_RCVTIMEO, SO_SNDTIMEO) instead of Python's: a socket with a Python timeout polls before every
recv and send, and hands back a chunk in as many pieces as the network delivered it, each a
return to the interpreter. Here a chunk is one `recv_into` that waits for all of it (MSG_WAITALL)
and one `sendmsg` of its frame and its bytes. Every call releases the GIL while the kernel copies,
so the relay's other streams run meanwhile.
"""

from __future__ import annotations

import errno
import socket
import struct

from stager.fleet.broadcast.keys import MAC_BYTES, recv_exact

# A node forwards a chunk once it has all of it, so the last node finishes (N-1) chunk times
# after the head. 8 nodes on the lab's 200 Mbit/s links (medians of 3, each pair in the same
# rounds): 32.6 s with 8 MiB against 30.8 s with 4 MiB; 30.1 s with 2 MiB against 30.9 s with
# 4 MiB; 29.1 s with 1 MiB against 29.8 s with 2 MiB, at the same relay CPU per GB. On 25 GbE and
# up a chunk time is well under a millisecond, and a chunk's fixed cost (a frame, a key, a write)
# stays small beside hashing and copying its MiB.
CHUNK = 1024 * 1024

# SAMPLE follows a file's last chunk, on the stream that carries that chunk: what the node that
# read the file from the NAS found it to be, keyed like a chunk at offset = the file's size: its
# sample of the NAS file once its own check passed; with --full its hash of every byte it read,
# whether or not that is the file's name (a file refused on its head is then refused downstream
# without a hash). LOST there: nothing. LOST at a chunk: the sender will not get the rest.
DATA, LOST, END, SAMPLE = 1, 2, 3, 4
FRAME = struct.Struct("<BIQI32s")  # kind, file id, offset, length, the head's chunk key
SAMPLE_LIMIT = 256  # bytes: a sample's value is a 32-character hex digest
NO_MAC = bytes(MAC_BYTES)
# What a downstream asks on each of its connections: the session, which stream this connection
# is of how many (it carries chunk n of every file when n % streams == stream), the node's name,
# and per file the offset of the first chunk of this stream it does not hold (the file's size
# when it holds them all, or will not take the file from this sender).
REQUEST = struct.Struct("<IBBHI")  # session, stream, streams, length of the node name, number of files
MAX_STREAMS = 64
MAX_FILES = 1 << 20


class Protocol(Exception):
    """The other end sent something other than what was due."""


def chunks_in(size: int) -> int:
    return -(-size // CHUNK)


def request(session: int, stream: int, streams: int, node: str, offsets: list[int]) -> bytes:
    name = node.encode()
    return (REQUEST.pack(session, stream, streams, len(name), len(offsets)) + name
            + struct.pack(f"<{len(offsets)}Q", *offsets))


def read_request(sock: socket.socket) -> tuple[int, int, int, list[int]]:
    """A downstream's request: (session, stream, streams, the offset to start each file at)."""
    session, stream, streams, name_length, count = REQUEST.unpack(recv_exact(sock, REQUEST.size))
    if name_length > 255 or count > MAX_FILES or not 0 <= stream < streams <= MAX_STREAMS:
        raise Protocol("an oversized or malformed request")
    recv_exact(sock, name_length)
    return session, stream, streams, list(struct.unpack(f"<{count}Q", recv_exact(sock, 8 * count)))


def blocking(sock: socket.socket, seconds: float) -> None:
    """Block on `sock`, giving up after `seconds` without a byte in either direction."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_into_all(sock: socket.socket, view: memoryview) -> None:
    """Fill all of `view` from `sock`: ConnectionError if it closes first, TimeoutError if it is
    silent for the socket's timeout."""
    done = 0
    while done < len(view):
        try:
            got = sock.recv_into(view[done:], 0, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError(errno.ETIMEDOUT, "nothing received within the timeout") from None
        if not got:
            raise ConnectionError(f"the connection closed after {done} of {len(view)} bytes")
        done += got


def send_all(sock: socket.socket, *parts) -> None:
    """Send every byte of `parts` (bytes or memoryviews) in order, one system call when the socket
    buffer has room: TimeoutError if the peer takes nothing for the socket's timeout."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            raise TimeoutError(errno.ETIMEDOUT, "nothing sent within the timeout") from None
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views:
            views[0] = views[0][sent:]
