"""Fingerprints, reference hashes, and the single rule that decides "equal".

Sampled fingerprint (the default ladder rung, also the mirror's keep-or-copy test):
    xxh3-128 over: the head (256 KiB, extended to cover a safetensors header, at most
    64 MiB), the tail (256 KiB), and 8 interior chunks of 64 KiB at offsets drawn from
    a seeded RNG that depends only on (seed, size).  Both sides are sampled at the same
    offsets.  Size and mtime are never trusted: NFS attributes go stale, and a
    size+mtime tool once reported a complete mirror while files held zeros.

Full hash: the whole content, hashed with the strongest reference available:
    sha256 for a 64-hex blob name, git blob sha1 for a 40-hex one, the lfs_sha256 or
    blob_id in trees/<commit>.json for a real file, else a blake3 of the source copy.
"""

from __future__ import annotations

import enum
import hashlib
import random
import struct
from dataclasses import dataclass
from typing import Callable

import blake3
import xxhash

from stager.mirror.hub import GIT_SHA1_NAME, SHA256_NAME, Entry
from stager.sources.local import aligned_buffer
from stager.base.workers import stop_point

HEAD_BYTES = 256 * 1024
MAX_HEAD_BYTES = 64 * 1024 * 1024
TAIL_BYTES = 256 * 1024
INTERIOR_CHUNKS = 8
INTERIOR_BYTES = 64 * 1024
ALIGN = 4096
FULL_CHUNK = 8 * 1024 * 1024


class Verdict(enum.Enum):
    MATCH = "match"
    DIFFER = "differ"
    UNCHECKED = "could-not-check"


@dataclass(frozen=True)
class Digest:
    """What was observed of one file by one method. `value` None means it could not be computed."""

    method: str  # "sampled:<seed>", "sha256", "git-sha1", "blake3"
    size: int | None
    value: str | None
    error: str = ""


def judge(local: Digest, reference: Digest) -> Verdict:
    """The one equality rule, for both "needs copying" and "verified".

    Equal means: both sides were observed, by the same method, with the same size
    and the same digest.  A side that could not be observed (unreadable, no
    reference hash) makes the verdict could-not-check, which is never equal.
    """
    if local.value is None or reference.value is None or local.method != reference.method:
        return Verdict.UNCHECKED
    if local.size is not None and reference.size is not None and local.size != reference.size:
        return Verdict.DIFFER
    return Verdict.MATCH if local.value == reference.value else Verdict.DIFFER


def sample_spans(size: int, seed: int, head: int = HEAD_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of every sampled region, in file order, for a file of `size` bytes."""
    head = min(size, max(head, HEAD_BYTES))
    tail_start = max(head, size - TAIL_BYTES)
    spans = [(0, head)]
    interior = tail_start - head
    if interior > 0:
        rng = random.Random(f"{seed}:{size}")
        slots = max(1, interior // ALIGN)
        for _ in range(INTERIOR_CHUNKS):
            start = head + rng.randrange(slots) * ALIGN
            spans.append((start, min(INTERIOR_BYTES, tail_start - start)))
    if size > tail_start:
        spans.append((tail_start, size - tail_start))
    return sorted(set(spans))


def safetensors_head(first_bytes: bytes, size: int) -> int:
    """Bytes of head to sample so the whole safetensors header is covered (if it looks like one)."""
    if len(first_bytes) < 8:
        return HEAD_BYTES
    (length,) = struct.unpack("<Q", first_bytes[:8])
    if 0 < length <= MAX_HEAD_BYTES - 8 and 8 + length <= size and first_bytes[8:9] == b"{":
        return max(HEAD_BYTES, 8 + length)
    return HEAD_BYTES


def sampled_digest(reader, seed: int) -> Digest:
    """Sampled fingerprint of an open Reader. Reads only the sampled spans."""
    method = f"sampled:{seed}"
    try:
        size = reader.size
        # One read covers the default head, which holds the whole of a small file: the other
        # spans are sliced from it instead of costing a read (and a NAS round trip) each.
        first = reader.pread(min(size, HEAD_BYTES), 0)
        head = safetensors_head(first[:8 + 1], size)
        hasher = xxhash.xxh3_128()
        for offset, length in sample_spans(size, seed, head):
            data = first[offset:offset + length] if offset + length <= len(first) else reader.pread(length, offset)
            if len(data) != length:
                return Digest(method, size, None, f"short read at offset {offset}")
            hasher.update(struct.pack("<QQ", offset, length))
            hasher.update(data)
        return Digest(method, size, hasher.hexdigest())
    except OSError as exc:
        return Digest(method, None, None, exc.strerror or str(exc))


@dataclass(frozen=True)
class Reference:
    """The expected full hash of an entry, and where that expectation comes from."""

    method: str  # sha256 | git-sha1 | blake3
    value: str | None  # None: compute from the source copy
    origin: str  # "blob name", "trees json", "source copy"


def reference_for(entry: Entry, tree_listing: dict) -> Reference:
    """Strongest reference first: the blob's own name, then trees/<commit>.json, then the source bytes."""
    name = entry.etag
    if name and SHA256_NAME.match(name):
        return Reference("sha256", name, "blob name")
    if name and GIT_SHA1_NAME.match(name):
        return Reference("git-sha1", name, "blob name")
    listed = tree_listing.get(entry.path)
    if isinstance(listed, dict):
        if isinstance(listed.get("lfs_sha256"), str) and SHA256_NAME.match(listed["lfs_sha256"]):
            return Reference("sha256", listed["lfs_sha256"], "trees json")
        if isinstance(listed.get("blob_id"), str) and GIT_SHA1_NAME.match(listed["blob_id"]):
            return Reference("git-sha1", listed["blob_id"], "trees json")
    return Reference("blake3", None, "source copy")


def new_hasher(method: str, size: int):
    """A hashlib-like object; git-sha1 is primed with the git blob header."""
    if method == "sha256":
        return hashlib.sha256()
    if method == "git-sha1":
        hasher = hashlib.sha1()
        hasher.update(b"blob %d\0" % size)
        return hasher
    if method == "blake3":
        return blake3.blake3()
    raise ValueError(f"unknown hash method {method!r}")


def full_digest(reader, method: str, on_bytes: Callable[[int], None] | None = None) -> Digest:
    """Hash a whole file with `method`, streaming in FULL_CHUNK pieces (bounded memory)."""
    try:
        size = reader.size
        hasher = new_hasher(method, size)
        view = memoryview(aligned_buffer(FULL_CHUNK))  # aligned: a direct reader fills it without a copy
        done = 0
        while done < size:
            stop_point()  # a run being left stops hashing at the next chunk
            got = reader.readinto(view)
            if got == 0:
                return Digest(method, size, None, f"short read at offset {done}")
            hasher.update(view[:got])
            done += got
            if on_bytes:
                on_bytes(got)
        return Digest(method, size, hasher.hexdigest())
    except OSError as exc:
        return Digest(method, None, None, exc.strerror or str(exc))
