"""The run's key: who may take part in a broadcast, and which chunks are the head's.

Trust model: the key is minted by the driver for one run (32 random bytes) and reaches the
nodes' relays only as an argument of a Ray call, on Ray's token-authenticated channel; it is
never written to disk, never in an argv or an environment. A connection is trusted only after
both ends proved that they hold it (a challenge each way, keyed BLAKE3 over both nonces), and a
chunk only when its keyed BLAKE3 over (run id, file id, offset, length, bytes) checks out. The
key proves membership and integrity; it does not hide the bytes (no encryption: the weights
travel in the clear, as they do from the NAS).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct

import blake3

KEY_BYTES = 32
RUN_ID_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
GREETING = b"stage-broadcast/1\n"
ANSWER_BYTES = NONCE_BYTES + MAC_BYTES  # what a client sends back: its nonce and its proof


class Refused(Exception):
    """The other end did not prove the run's key (or spoke something else)."""


def mint() -> tuple[bytes, bytes]:
    """A fresh (key, run id) for one run."""
    return secrets.token_bytes(KEY_BYTES), secrets.token_bytes(RUN_ID_BYTES)


def chunk_mac(key: bytes, run_id: bytes, file_id: int, offset: int, data) -> bytes:
    """Keyed BLAKE3 of one chunk and where it belongs: a chunk replayed at another offset, in
    another file or from another run fails, as does any changed byte. blake3 releases the GIL
    on large inputs, so a relay hashes one chunk while its other threads move the next."""
    hasher = blake3.blake3(key=key)
    hasher.update(b"chunk" + run_id + struct.pack("<IQQ", file_id, offset, len(data)))
    hasher.update(data)
    return hasher.digest()


def mac_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def _proof(key: bytes, role: bytes, run_id: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    # The role is part of what is hashed, so a server's answer can never be replayed as a client's.
    return blake3.blake3(role + run_id + server_nonce + client_nonce, key=key).digest()


def recv_exact(sock: socket.socket, length: int) -> bytes:
    data = bytearray()
    while len(data) < length:
        got = sock.recv(length - len(data))
        if not got:
            raise ConnectionError(f"the connection closed after {len(data)} of {length} bytes")
        data += got
    return bytes(data)


def challenge() -> tuple[bytes, bytes]:
    """Server side, first: what a new connection is sent (the greeting and a random nonce), and
    the nonce, kept to check its answer against."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    return GREETING + server_nonce, server_nonce


def server_proof(key: bytes, run_id: bytes, server_nonce: bytes, answer: bytes) -> bytes:
    """Server side, then: the client's ANSWER_BYTES (its nonce and its proof) checked against the
    challenge; returns the server's proof, to send back. A stranger gets Refused here, and its
    bytes are never read as a request."""
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if len(answer) != ANSWER_BYTES or not mac_ok(_proof(key, b"client", run_id, server_nonce, client_nonce), proof):
        raise Refused("it did not prove the run's key")
    return _proof(key, b"server", run_id, server_nonce, client_nonce)


def join(sock: socket.socket, key: bytes, run_id: bytes) -> None:
    """Client side: answer the server's challenge with ours and our proof, then check its proof."""
    greeting = recv_exact(sock, len(GREETING) + NONCE_BYTES)
    if not greeting.startswith(GREETING):
        raise Refused("it does not speak the broadcast protocol")
    server_nonce = greeting[len(GREETING):]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(key, b"client", run_id, server_nonce, client_nonce))
    if not mac_ok(_proof(key, b"server", run_id, server_nonce, client_nonce), recv_exact(sock, MAC_BYTES)):
        raise Refused("it did not prove the run's key")
