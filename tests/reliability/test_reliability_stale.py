"""Stale attributes: a NAS file rewritten with the same size and its mtime put back, and a local
file of the right size and a newer mtime holding zeros. A size+mtime tool calls both unchanged;
the sampled fingerprint (head, tail, seeded interior chunks) must not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reliability_support import MiB, build_staging, random_safetensors, run_json, sha256_file, untouched
from stager.mirror.fingerprint import HEAD_BYTES, TAIL_BYTES, safetensors_head, sample_spans

REAL = "weights/real.safetensors"
SEED = 424242


@pytest.fixture
def staged(tmp_path):
    staging = build_staging(tmp_path, shards=2, shard_bytes=2 * MiB)
    staging.snapshot.add_real(REAL, random_safetensors(77, 4 * MiB))
    staging.snapshot.finish()
    assert staging.mirror("--seed", str(SEED)).code == 0
    return staging


def rewrite_keeping_attributes(staging, offset: int) -> bytes:
    """Flip bytes at `offset` of the NAS's real file in place, keep its size, put its mtime back,
    and list the new content in trees/<commit>.json as a regenerated snapshot listing would."""
    path = staging.snapshot.dir / REAL
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[offset:offset + 16] = bytes(b ^ 0xFF for b in data[offset:offset + 16])
    with open(path, "r+b") as handle:  # same inode, as an in-place rewrite on the NAS leaves it
        handle.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    staging.snapshot.add_real(REAL, bytes(data))  # refreshes the listing entry; same bytes again
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    staging.snapshot.finish()
    return bytes(data)


def local_copy(staging) -> Path:
    return staging.local / staging.snapshot.dir.relative_to(staging.nas) / REAL


def spans_of(staging) -> list[tuple[int, int]]:
    path = staging.snapshot.dir / REAL
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = safetensors_head(handle.read(9), size)
    return sample_spans(size, SEED, head)


def test_same_size_same_mtime_rewrite_in_the_head_is_recopied(staged):
    local = local_copy(staged)
    size_and_mtime = (local.stat().st_size, local.stat().st_mtime_ns)
    new = rewrite_keeping_attributes(staged, 100_000)  # inside the 256 KiB head, past the header
    nas = os.stat(staged.snapshot.dir / REAL)
    assert (nas.st_size, nas.st_mtime_ns) == size_and_mtime, "a size+mtime comparison would keep the copy"
    with untouched(staged.nas):
        report = run_json(staged.mirror())
    assert report["copied_files"] == 1 and report["copied_bytes"] == len(new)
    assert local.read_bytes() == new
    assert staged.verify_full().code == 0


def test_a_change_in_a_seeded_interior_chunk_is_recopied(staged):
    spans = spans_of(staged)
    size = (staged.snapshot.dir / REAL).stat().st_size
    interior = [(o, n) for o, n in spans if HEAD_BYTES <= o and o + n <= size - TAIL_BYTES]
    assert len(interior) >= 4, spans
    offset, length = interior[len(interior) // 2]
    new = rewrite_keeping_attributes(staged, offset + length // 2)
    with untouched(staged.nas):
        report = run_json(staged.mirror("--seed", str(SEED)))
    assert report["copied_files"] == 1
    assert local_copy(staged).read_bytes() == new


def test_a_change_outside_every_sample_is_caught_by_the_full_rung(staged):
    """The documented limit of sampling: a mid-file change between the samples of this seed passes the
    sampled rung; `verify --full` names it and `mirror --full` repairs it."""
    spans = spans_of(staged)
    offset = next(o + n + 4096 for (o, n), (nxt, _) in zip(spans, spans[1:]) if nxt - (o + n) > 3 * 4096)
    new = rewrite_keeping_attributes(staged, offset)
    with untouched(staged.nas):
        assert run_json(staged.mirror("--seed", str(SEED)))["copied_files"] == 0
        full = staged.verify_full()
        assert full.code == 1
        problem, = run_json(full)["problems"]
        assert problem["kind"] == "mismatch" and problem["path"].endswith(REAL)
        assert run_json(staged.mirror("--full"))["copied_files"] == 1
    assert local_copy(staged).read_bytes() == new
    assert staged.verify_full().code == 0


@pytest.mark.parametrize("damage", ["zeros", "another shard"])
def test_right_size_newer_mtime_wrong_bytes_locally_is_recopied(staged, damage):
    snapshot = staged.local / staged.snapshot.dir.relative_to(staged.nas)
    victim = Path(os.path.realpath(snapshot / "model-00001-of-00002.safetensors"))
    other = Path(os.path.realpath(snapshot / "model-00002-of-00002.safetensors"))
    good = sha256_file(victim)
    size = victim.stat().st_size
    with open(victim, "r+b") as handle:
        if damage == "zeros":  # what a preallocated, interrupted copy leaves
            handle.truncate(0)
            handle.truncate(size)
        else:
            handle.write(other.read_bytes()[:size])
    newer = victim.stat().st_mtime_ns + 3600 * 10**9
    os.utime(victim, ns=(newer, newer))
    with untouched(staged.nas):
        report = run_json(staged.mirror())
    assert report["copied_files"] == 1
    assert sha256_file(victim) == good
    assert json.loads(staged.verify_full().stdout)["problems"] == []
