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
