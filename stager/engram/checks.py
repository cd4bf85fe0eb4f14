"""The one rule that decides both "repack?" (pack) and "verified" (`stage verify`), and verify itself.

Trust: nothing on disk is believed for itself. A shard counts only when its size, its header,
its receipt, its SHA256SUMS line and its rows (sampled, or all of them with `--full`) agree with
what this layout and the source checkpoint would produce now. A sampled check reads the same
bounded number of rows (both boundary rows and SAMPLE_ROWS seeded ones) whatever the shard's size.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import stat
from contextlib import closing
from pathlib import Path

import numpy as np

from stager.base import hints
from stager.engram.checkpoint import Checkpoint, open_checkpoint
from stager.engram.node_shards import node_ranks, shard_specs
from stager.engram.receipts import RECEIPT_KEYS, read_receipt, receipt_for
from stager.engram.row_stream import iter_rows, read_exact, read_row
from stager.engram.shard_format import HEADER_BYTES, ROW_BYTES, ShardSpec, describe_header, parse_shard_name
from stager.base.errors import BadInput, CannotRun
from stager.mirror.hub import Problem
from stager.manifest import Manifest
from stager.mirror.records import SUMS_NAME, read_sums
from stager.sources.local import LocalReader
from stager.mirror.verify import VerifyReport

SAMPLE_ROWS = 64  # seeded rows per sampled check, plus both boundary rows


def check_shard(spec: ShardSpec, checkpoint: Checkpoint, sums: dict[str, str], *, seed: int,
                full: bool = False) -> str | None:
    """Why the shard on disk does not match what this layout and source would write; None if it does.

    The one rule, for both "repack?" and "verified": the exact size; the header
    (never adopt a shard whose lo/hi disagree with the chosen layout); a receipt whose
    model, commit, source blob, layer, rank, TP, layout, rows and bytes equal this run's;
    a SHA256SUMS entry equal to the receipt's sha256; then the rows against the source:
    a seeded sample plus both boundary rows, or (full) every byte re-derived and the
    file's sha256 against SHA256SUMS. A sampled check also hashes the whole shard (a local
    read, no source rows) when its inode changed after its receipt was written (ctime newer
    than the receipt's mtime: a write into it, a truncate, a chmod): such a shard whose sha256
    differs from SHA256SUMS is never "up to date", whichever rows the sample happened to pick.  The tool version is not compared: the format is
    versioned by its magic, and a newer tool has no reason to rewrite identical bytes.
    """
    try:
        st = os.lstat(spec.path)
    except FileNotFoundError:
        return "not packed yet"
    if not stat.S_ISREG(st.st_mode):
        # A link could point at the NAS copy, which is exactly what packing exists to avoid.
        return "not a regular file"
    if st.st_size != spec.bytes:
        return f"size {st.st_size} != {spec.bytes} (truncated, or from another layout)"
    with LocalReader(str(spec.path), uncached=False) as shard:
        problem = describe_header(shard.pread(HEADER_BYTES, 0), spec)
        if problem:
            return problem
        receipt = read_receipt(spec)
        if receipt is None:
            return f"no readable receipt {spec.receipt.name}"
        wanted = receipt_for(spec, checkpoint, "")
        for key in RECEIPT_KEYS:
            if receipt.get(key) != wanted[key]:
                return f"receipt {key} {receipt.get(key)!r} != {wanted[key]!r}"
        listed = sums.get(spec.path.name)
        if listed != receipt.get("sha256"):
            return f"{SUMS_NAME} {'has no entry' if listed is None else 'entry differs from the receipt'}"
        reader = checkpoint.open(checkpoint.tables[spec.layer].file, sequential=full)
        try:
            if full:
                return _full_check(spec, checkpoint, reader, shard, listed)
            sampled = _sampled_check(spec, checkpoint, reader, shard, seed)
        finally:
            reader.close()
        if sampled is None and _changed_since_receipt(os.fstat(shard.fd), spec):
            digest = _sha256_of(shard, spec.bytes)
            if digest != listed:
                return (f"sha256 {digest} differs from {SUMS_NAME} ({listed}): the shard was changed after "
                        "it was packed")
        return sampled


def _changed_since_receipt(st: os.stat_result, spec: ShardSpec) -> bool:
    """Whether the shard's inode changed after its receipt was written. The receipt is written
    after the shard's rename, so an untouched shard's ctime is never newer; ctime cannot be set
    back by a user (utime moves it to now), so a later write into the shard always shows."""
    try:
        return st.st_ctime_ns > os.lstat(spec.receipt).st_mtime_ns
    except OSError:
        return True


def _sha256_of(shard: LocalReader, size: int) -> str:
    hasher = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = shard.pread(min(8 << 20, size - offset), offset)
        if not chunk:
            break
        hasher.update(chunk)
        offset += len(chunk)
    return hasher.hexdigest()


def sample_rows(lo: int, hi: int, seed: int, layer: int) -> list[int]:
    """Both boundary rows and SAMPLE_ROWS seeded rows of [lo, hi), sorted (none for an empty shard:
    a table with fewer rows than TP leaves some floor ranks a header and no rows)."""
    if hi <= lo:
        return []
    rng = random.Random(f"{seed}:{layer}:{lo}:{hi}")
    picks = {lo, hi - 1} | {rng.randrange(lo, hi) for _ in range(min(SAMPLE_ROWS, hi - lo))}
    return sorted(picks)


def _sampled_check(spec: ShardSpec, checkpoint: Checkpoint, reader, shard: LocalReader, seed: int) -> str | None:
    table = checkpoint.tables[spec.layer]
    where = checkpoint.source.display(checkpoint.finals[table.file])
    theirs = bytearray(ROW_BYTES)
    for row in sample_rows(spec.lo, spec.hi, seed, spec.layer):
        read_row(reader, table, row, memoryview(theirs), where)
        if shard.pread(ROW_BYTES, spec.offset(row)) != theirs:
            return f"row {row} differs from the source"
    return None


def _full_check(spec: ShardSpec, checkpoint: Checkpoint, reader, shard: LocalReader, listed: str) -> str | None:
    """Re-derive every row from the source and compare it with the shard, hashing the shard as it is read."""
    table = checkpoint.tables[spec.layer]
    where = checkpoint.source.display(checkpoint.finals[table.file])
    hasher = hashlib.sha256(shard.pread(HEADER_BYTES, 0))
    buffer = np.empty(0, np.uint8)
    first_bad = None
    with closing(iter_rows(reader, table, [(spec.lo, spec.hi)], where)) as chunks:
        for rows, first_row in chunks:
            if len(buffer) < len(rows):
                buffer = np.empty(len(rows), np.uint8)
            mine = buffer[:len(rows)]
            read_exact(shard, memoryview(mine), spec.offset(first_row), str(spec.path))
            hasher.update(mine)
            if first_bad is None:
                derived = np.frombuffer(rows, np.uint8)
                if not np.array_equal(mine, derived):
                    first_bad = first_row + int(np.flatnonzero((mine != derived).reshape(-1, ROW_BYTES).any(axis=1))[0])
    if first_bad is not None:
        return f"row {first_bad} differs from a full re-derivation from the source"
    digest = hasher.hexdigest()
    return None if digest == listed else f"sha256 {digest} differs from {SUMS_NAME} ({listed})"


def verify_engram(manifest: Manifest, node_name: str, *, full: bool, seed: int | None) -> VerifyReport:
    """Check the node's shards (every rank it serves), and every other shard of the current TP
    size in its engram_dir, with `check_shard` against the staged snapshot. Problems name the
    shard; one repair command covers every rank that needs packing."""
    seed = secrets.randbits(32) if seed is None else seed
    report = VerifyReport("full" if full else "sampled", None if full else seed)
    engram_dir = Path(manifest.node(node_name).engram_dir or "")
    # A rank the node cannot serve is a mistake in the manifest, not a problem found on the disk:
    # exit 2 naming the key, as pack-engram says it.
    node_ranks(manifest, node_name, manifest.engram.world)
    try:
        checkpoint = open_checkpoint(manifest, node_name, from_nas=False)
        specs = shard_specs(manifest, node_name, checkpoint)
        on_disk = _present(engram_dir, manifest.engram.world, {s.layer for s in specs})
        others = sorted({rank for _layer, rank in on_disk} - {s.rank for s in specs})
        if others:
            specs += [s for s in shard_specs(manifest, node_name, checkpoint, ranks=others)
                      if (s.layer, s.rank) in on_disk]
        sums = read_sums(engram_dir / SUMS_NAME)
    except (BadInput, CannotRun) as exc:
        report.checked += 1
        report.problems.append(Problem(str(engram_dir), "could_not_check", exc.message))
        return report
    failing: list[int] = []
    content = False  # a row or the sha256 differs: only a pack that re-derives every row sees it again
    for spec in specs:
        report.checked += 1
        try:
            reason = check_shard(spec, checkpoint, sums, seed=seed, full=full)
        except CannotRun as exc:
            report.problems.append(Problem(str(spec.path), "could_not_check", exc.message))
            continue
        if reason is None:
            report.ok += 1
            continue
        kind = "missing" if reason == "not packed yet" else "mismatch"
        # A sampled pack-engram with its own seed may pick none of the bad rows and call the shard
        # "up to date": the printed repair once exited 0 while the shard kept failing sha256sum -c.
        differs = reason.startswith(("row ", "sha256 "))
        content = content or differs
        repair = hints.command("pack-engram", "--node", node_name, "--rank", spec.rank, *(["--full"] if differs else []))
        report.problems.append(Problem(str(spec.path), kind, f"{reason} (repair: {repair})"))
        if spec.rank not in failing:
            failing.append(spec.rank)
    if failing:
        ranks = [arg for rank in sorted(failing) for arg in ("--rank", rank)]
        report.repairs.append(hints.command("pack-engram", "--node", node_name, *ranks, *(["--full"] if content else [])))
    return report


def _present(engram_dir: Path, world: int, layers: set[int]) -> set[tuple[int, int]]:
    """(layer, rank) of the shards of this TP size and these layers found in `engram_dir`."""
    found = set()
    try:
        names = os.listdir(engram_dir)
    except OSError:
        return found
    for name in names:
        parsed = parse_shard_name(name)
        if parsed and parsed[2] == world and parsed[0] in layers and parsed[1] < world:
            found.add(parsed[:2])
    return found
