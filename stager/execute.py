"""Carry out a Plan. The only code that writes into the local hub.

Order: final files (blobs), then links from the blob back to the snapshot entry,
then metadata, then refs.  A run killed at any point leaves only complete files
under final names (see atomic.py), and a ref is written only once its snapshot
is whole, so a client never resolves a revision into a half-staged snapshot.
"""

from __future__ import annotations

import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stager.atomic import SyncBatch, atomic_file, atomic_symlink, atomic_write_bytes, ensure_dir, fsync_dir, sweep_temps
from stager.copier import copy_into
from stager.errors import StageError
from stager.fingerprint import Digest, Verdict, judge, new_hasher, sampled_digest
from stager.hub import Problem
from stager.observe import DigestCache
from stager.plan import CopyFile, MakeLink, Plan


# Below this size a file's fsync (a journal commit, ~3 ms here) costs more than its bytes: such
# files are made durable in batches of BATCH_FILES with one syncfs (see atomic.SyncBatch).
SMALL_FILE = 4 * 1024 * 1024
BATCH_FILES = 256


@dataclass(frozen=True)
class ExecResult:
    copied_files: int
    copied_bytes: int
    problems: tuple[Problem, ...]


class _Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.files = 0
        self.bytes = 0
        self.problems: list[Problem] = []
        self.failed: set[str] = set()


def inside(root: Path, rel: str) -> Path:
    """The local path of a hub-relative name. Refuses anything that would land outside the root."""
    base = str(root).rstrip("/")
    path = os.path.normpath(f"{base}/{rel}")  # strings, not pathlib: this runs several times per file
    if rel.startswith("/") or ".." in rel.split("/") or not path.startswith(base + "/"):
        raise StageError(f"refusing to write {path}: outside the local hub {root}")
    return Path(path)


def execute(plan: Plan, source, local_hub: Path, cache: DigestCache, *, full: bool, jobs: int,
            progress: Callable[[int], None] | None = None) -> ExecResult:
    tally = _Tally()
    # Every directory about to be written is swept, metadata ones too: a run killed while
    # writing a shared-store `.refs` manifest left its temp file there for good.
    writes = (*plan.copies, *plan.links, *plan.metadata, *plan.refs)
    for directory in sorted({posixpath.dirname(w.dest) for w in writes}):
        ensure_dir(inside(local_hub, directory))
        sweep_temps(inside(local_hub, directory))

    batch = SyncBatch(local_hub)

    def copy_one(copy: CopyFile) -> None:
        small = copy.size < SMALL_FILE
        try:
            _copy_verified(copy, source, local_hub, cache, full, progress, batch if small else None)
        except StageError:
            raise
        except (_Mismatch, OSError) as exc:
            with tally.lock:
                tally.failed.add(copy.dest)
                kind = "mismatch" if isinstance(exc, _Mismatch) else "unreadable"
                detail = str(exc) if isinstance(exc, _Mismatch) else (exc.strerror or str(exc))
                tally.problems.append(Problem(source.display(copy.source), kind, detail))
            return
        with tally.lock:
            tally.files += 1
            tally.bytes += copy.size
        if small and len(batch) >= BATCH_FILES:
            batch.commit()  # outside the per-file handler: a failed sync fails the run, not one file

    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="stage-copy") as pool:
        futures = [pool.submit(copy_one, copy) for copy in plan.copies]
        try:
            for future in futures:
                future.result()
            batch.commit()
        except BaseException:
            # Disk full or interrupted: stop queued copies now instead of failing each in turn.
            for future in futures:
                future.cancel()
            pool.shutdown(wait=True)
            batch.discard()
            raise
    # The copies renamed without a directory fsync each; one per directory makes them durable
    # before any link or ref can point at them.
    _fsync_dirs(local_hub, (c.dest for c in plan.copies if c.dest not in tally.failed))

    # Links are made from the blob end back to the snapshot entry, and only to a hop that already
    # ends in a file that did not fail: a kill between two links never leaves one dangling.
    made: set[str] = set()  # one mkdir per directory, not one per link (1,000 small files: 1,000 links)
    for link in _blob_end_first(plan.links):
        target = _target(link)
        if target in tally.failed or not inside(local_hub, target).is_file():
            tally.failed.add(link.dest)
            continue
        if posixpath.dirname(link.dest) not in made:
            ensure_dir(inside(local_hub, posixpath.dirname(link.dest)))
            made.add(posixpath.dirname(link.dest))
        atomic_symlink(link.target, inside(local_hub, link.dest), sync_dir=False)
    _fsync_dirs(local_hub, (link.dest for link in plan.links if link.dest not in tally.failed))
    for meta in (*plan.metadata, *plan.refs):
        path = inside(local_hub, meta.dest)
        ensure_dir(path.parent)
        atomic_write_bytes(path, meta.content)
    return ExecResult(tally.files, tally.bytes, tuple(tally.problems))


def _fsync_dirs(local_hub: Path, dests) -> None:
    for directory in sorted({posixpath.dirname(dest) for dest in dests}):
        fsync_dir(inside(local_hub, directory))


def _target(link: MakeLink) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(link.dest), link.target))


def _blob_end_first(links: tuple[MakeLink, ...]) -> list[MakeLink]:
    """Each link after the planned link it points to. Sorting by path depth got this backwards:
    the snapshot entry is the deepest path, so it was made before the repo blob link it needs."""
    targets = {link.dest: _target(link) for link in links}

    def planned_hops(dest: str) -> int:
        hops = 0
        while dest in targets and hops <= len(targets):  # the bound stops a (never planned) cycle
            dest, hops = targets[dest], hops + 1
        return hops

    return sorted(links, key=lambda link: (planned_hops(link.dest), link.dest))


class _Mismatch(Exception):
    pass


def _copy_verified(copy: CopyFile, source, local_hub: Path, cache: DigestCache, full: bool, progress,
                   batch: SyncBatch | None = None) -> None:
    """Copy one file and check it *before* the rename, so a wrong byte never gets a final name.

    --full hashes the stream during the copy (one read) against the reference;
    the default re-reads the sampled regions of the temp file against the source.
    """
    dest = inside(local_hub, copy.dest)
    reader = source.open(copy.source, uncached=True, sequential=True)
    try:
        if reader.size != copy.size:
            raise _Mismatch(f"source size changed from {copy.size} to {reader.size} since the walk")
        hasher = new_hasher(copy.reference.method, copy.size) if full else None
        if not full:
            # Sampled through the reader the copy uses, before the copy: the copy then finds the
            # sampled pages cached, where a second uncached open read a small file twice from the NAS.
            cache.remember(copy.source, sampled_digest(reader, cache.seed))
        with atomic_file(dest, size_hint=copy.size, mtime_ns=copy.mtime_ns, sync_dir=False, batch=batch) as out:
            copy_into(reader, out, copy.size, hasher, progress)
            if full:
                got = Digest(copy.reference.method, copy.size, hasher.hexdigest())
                if copy.reference.value is None:
                    cache.remember(copy.source, got)  # the source's own hash, read once
                    expected = got
                else:
                    expected = Digest(copy.reference.method, copy.size, copy.reference.value)
            else:
                got = sampled_digest(out, cache.seed)
                expected = cache.sampled(copy.source)
            if judge(got, expected) is not Verdict.MATCH:
                raise _Mismatch(
                    f"copied bytes do not match the {copy.reference.origin if full else 'source sample'}"
                    f" ({got.method}: {got.value} != {expected.value})")
            st = os.fstat(out.fd)  # the inode keeps its identity through the rename (now or batched)
        cache.remember_written(dest, got, (st.st_dev, st.st_ino, copy.size, copy.mtime_ns))
        if hasattr(reader, "drop_cache"):
            reader.drop_cache()
    finally:
        reader.close()
