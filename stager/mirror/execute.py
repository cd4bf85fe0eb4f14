"""Carry out a Plan. The only code that writes into the local hub.

Order: final files (blobs), then links from the blob back to the snapshot entry,
then metadata, then refs.  A run killed at any point leaves only complete files
under final names (see atomic.py), and a ref is written only once its snapshot
is whole, so a client never resolves a revision into a half-staged snapshot.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import posixpath
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stager.base import identity
from stager.mirror import store_modes
from stager.base.atomic import AtomicFile, SyncBatch, atomic_file, atomic_symlink, atomic_write_bytes, ensure_dir, fsync_dir, sweep_temps
from stager.mirror.copier import SourceChanged, copy_into
from stager.base.errors import CannotRun, StageError
from stager.mirror.fingerprint import Digest, Verdict, judge, new_hasher, sampled_digest
from stager.mirror.hub import SHARED_STORE, BadRef, Problem, node_ref
from stager.mirror.observe import DigestCache
from stager.mirror.plan import CopyFile, MakeLink, Plan, kept_hops
from stager.base.units import format_size
from stager.mirror.verify import NAS_FILE_BAD, check_local_chain
from stager.base.workers import worker_pool

log = logging.getLogger(__name__)  # `stage -v`: a line per file written (see cli/terminal.py)

# Below this size a file's fsync (a journal commit, ~3 ms here) costs more than its bytes: such
# files are made durable in batches of BATCH_FILES with one syncfs (see atomic.SyncBatch).
SMALL_FILE = 4 * 1024 * 1024
BATCH_FILES = 256


@dataclass(frozen=True)
class ExecResult:
    copied_files: int
    copied_bytes: int
    problems: tuple[Problem, ...]
    failed: frozenset[str]  # hub-relative paths that could not be written


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
            progress: Callable[[int], None] | None = None, never_write: tuple[str, ...] = ()) -> ExecResult:
    """Copies, links and metadata. Refs are left to publish_refs, which runs after this."""
    tally = _Tally()
    # Every directory about to be written is checked and swept, metadata ones too: a run killed
    # while writing a shared-store `.refs` manifest left its temp file there for good.
    writes = (*plan.copies, *plan.links, *plan.metadata, *plan.refs)
    for directory in sorted({posixpath.dirname(w.dest) for w in writes}):
        sweep_temps(writable_dir(local_hub, directory, never_write))

    batch = SyncBatch(local_hub)

    def copy_one(copy: CopyFile) -> None:
        small = copy.size < SMALL_FILE
        try:
            _copy_verified(copy, source, local_hub, cache, full, progress, batch if small else None)
        except StageError:
            raise
        except (_Mismatch, OSError) as exc:
            problem = _copy_problem(exc, copy, source, local_hub).about(copy.name, copy.blob)
            with tally.lock:
                tally.failed.add(copy.dest)
                tally.problems.append(problem)
            return
        with tally.lock:
            tally.files += 1
            tally.bytes += copy.size
        if log.isEnabledFor(logging.INFO):  # not a path built per file of a 100k-file run for nothing
            log.info("copied %s (%s): %s", copy.known_as, format_size(copy.size), copy.reason)
        if small and len(batch) >= BATCH_FILES:
            batch.commit()  # outside the per-file handler: a failed sync fails the run, not one file

    try:
        # Disk full or interrupted: the pool stops the queued copies instead of failing each in
        # turn, and waits for the running ones before their temp files are discarded.
        with worker_pool(jobs, "stage-copy", "copies") as pool:
            for future in [pool.submit(_each, copy_one, group) for group in _task_groups(plan.copies, jobs)]:
                future.result()
        batch.commit()
    except BaseException:
        batch.discard()
        raise
    finally:
        batch.close()
    # The copies renamed without a directory fsync each; one per directory makes them durable
    # before any link or ref can point at them.
    _fsync_dirs(tally, local_hub, [c.dest for c in plan.copies if c.dest not in tally.failed])

    # Links are made from the blob end back to the snapshot entry, and only to a hop that already
    # ends in a file that did not fail: a kill between two links never leaves one dangling.
    for link in _blob_end_first(plan.links):
        target = _target(link)
        if target in tally.failed or not inside(local_hub, target).is_file():
            tally.failed.add(link.dest)
            continue
        _write_local(tally, local_hub, link.dest,
                     lambda path: atomic_symlink(link.target, path, sync_dir=False))
    _fsync_dirs(tally, local_hub, [link.dest for link in plan.links if link.dest not in tally.failed])
    for meta in plan.metadata:
        mode = store_modes.file_mode(local_hub, meta.dest)
        _write_local(tally, local_hub, meta.dest, lambda path: atomic_write_bytes(path, meta.content, chmod=mode))
    return ExecResult(tally.files, tally.bytes, tuple(tally.problems), frozenset(tally.failed))


# Small files per pool task: handing each to a worker thread (a future, a queue, a wake-up, the
# GIL passed back and forth) cost about as much as copying it.
SMALL_GROUP = 16


def _task_groups(copies: tuple[CopyFile, ...], jobs: int) -> list[list[CopyFile]]:
    """The copies in plan order, each large one a task of its own and runs of small ones in tasks
    of up to SMALL_GROUP, fewer when that would leave workers without a task."""
    small = sum(1 for copy in copies if copy.size < SMALL_FILE)
    per_task = max(1, min(SMALL_GROUP, small // max(1, 4 * jobs)))
    groups: list[list[CopyFile]] = []
    for copy in copies:
        if copy.size < SMALL_FILE and groups and groups[-1][-1].size < SMALL_FILE and len(groups[-1]) < per_task:
            groups[-1].append(copy)
        else:
            groups.append([copy])
    return groups


def _each(work, items) -> None:
    for item in items:
        work(item)


def publish_refs(plan: Plan, snapshots, local_hub: Path, failed: frozenset[str],
                 never_write: tuple[str, ...] = ()) -> list[Problem]:
    """Write each repo's refs, last, and only when its snapshot is whole on the node: every entry
    walked without a problem, none of its files failed, and every entry resolving locally.

    A ref moved after a failed copy, or onto a snapshot the NAS had not finished, once left a
    serving node on a revision that offline clients could not load. Otherwise the node stays
    on the commit it had; the problem says so."""
    problems: list[Problem] = []
    for snap in snapshots:
        refs = [r for r in plan.refs if r.dest.startswith(f"{snap.repo_dir}/refs/")]
        if not refs:
            continue
        broken = _first_break(snap, local_hub, failed)
        for ref in refs:
            path = inside(local_hub, ref.dest)
            if broken is None:
                writable_dir(local_hub, posixpath.dirname(ref.dest), never_write)
                atomic_write_bytes(path, ref.content)
                continue
            problems.append(Problem(str(path), "ref_not_moved",
                                    f"stays on {_current_commit(path)}: snapshot {snap.commit} is not whole on "
                                    f"the node ({broken})"))
    return problems


def _first_break(snap, local_hub: Path, failed: frozenset[str]) -> str | None:
    if snap.problems:
        return f"{len(snap.problems)} entr{'y' if len(snap.problems) == 1 else 'ies'} not staged"
    # realpath once per directory of this pass: unmemoized, it lstat-ed every component of the hub
    # path for every hop of every entry, a fifth of a 1,000-small-file mirror.
    realpath = functools.lru_cache(maxsize=None)(identity.resolved)
    for entry in snap.entries:
        if any(hop in failed for hop in kept_hops(entry, snap.repo_dir)):
            return f"{entry.path} failed"
        _final, problem, _links = check_local_chain(local_hub, entry.rel, realpath)
        if problem is not None:
            return f"{entry.path}: {problem.kind}"
    return None


def _current_commit(ref: Path) -> str:
    # Never a blocking read: a FIFO at the node's ref hung the mirror while it built this message.
    try:
        return node_ref(ref)
    except FileNotFoundError:
        return "nothing"
    except BadRef:
        return "a ref that names no commit"
    except OSError as exc:
        return f"an unreadable ref ({exc.strerror})"


def writable_dir(local_hub: Path, rel_dir: str, never_write: tuple[str, ...] = ()) -> Path:
    """Make a directory of the node hub and check, at the moment of use, that writing in it
    writes in the node hub: a `blobs/` linked or bind-mounted into the NAS once had the mirror
    write into the NAS. Shared-store directories take huggingface_hub's modes (see store_modes)."""
    path = inside(local_hub, rel_dir)
    try:
        ensure_dir(path)
    except OSError as exc:
        raise CannotRun(f"cannot create {exc.filename or path} in the node hub: {exc.strerror}") from None
    escape = identity.escape_from(identity.resolved(path), identity.resolved(local_hub), never_write)
    if escape:
        raise CannotRun(f"{path} {escape}; refusing to write through a link")
    if rel_dir == SHARED_STORE or rel_dir.startswith(SHARED_STORE + "/"):
        store_modes.fix_directory(path, local_hub)
    return path


def _write_local(tally: _Tally, local_hub: Path, dest: str, write) -> None:
    """One link or metadata file; a local failure is a problem with the local path, or exit 3
    when the node hub cannot be written at all."""
    path = inside(local_hub, dest)
    try:
        write(path)
    except OSError as exc:
        tally.failed.add(dest)
        tally.problems.append(_local_problem(exc, path))


def _copy_problem(exc: Exception, copy: CopyFile, source, local_hub: Path) -> Problem:
    """Which side failed, named by its own path: the source changed or is wrong, the local write
    failed (or the node hub cannot be written: exit 3), or the source could not be read."""
    if isinstance(exc, SourceChanged):
        return Problem(source.display(copy.source), "mismatch", exc.strerror)
    if isinstance(exc, _Mismatch):
        return Problem(source.display(copy.source), "mismatch", str(exc))
    if _local_side(exc, local_hub):
        return _local_problem(exc, inside(local_hub, copy.dest))
    return Problem(source.display(copy.source), "unreadable", exc.strerror or str(exc))


def _local_side(exc: OSError, local_hub: Path) -> bool:
    root = str(local_hub).rstrip("/") + "/"
    return exc.errno == errno.EROFS or any(str(name).startswith(root) for name in (exc.filename, exc.filename2) if name)


def _local_problem(exc: OSError, path: Path) -> Problem:
    """Local write errors name the local path: they once read "unreadable <NAS path>"."""
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise CannotRun(f"cannot write {path} in the node hub: {exc.strerror}") from None
    return Problem(str(path), "local_error", f"cannot write the local file: {exc.strerror or exc}")


def _fsync_dirs(tally: _Tally, local_hub: Path, dests: list[str]) -> None:
    """One fsync per directory written. A directory someone removed meanwhile (an operator
    deleting what the audit listed) fails what was written in it, as a problem of this run:
    it once ended the whole mirror as "cannot run"."""
    by_directory: dict[str, list[str]] = {}
    for dest in dests:
        by_directory.setdefault(posixpath.dirname(dest), []).append(dest)
    for directory in sorted(by_directory):
        try:
            fsync_dir(inside(local_hub, directory))
        except FileNotFoundError:
            tally.failed.update(by_directory[directory])
            tally.problems.append(Problem(str(inside(local_hub, directory)), "local_error",
                                          "removed from the node hub during the run"))


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
    """The bytes are not the source's (land_verified's refusal)."""


def _unchanged_during_copy(reader, before: tuple[int, ...], copied_sample: Digest, seed: int) -> None:
    """Refuse a copy whose source moved under it: a file rewritten in place during the copy was
    staged torn (old head, new tail) and one still growing as a prefix, both under exit 0, where
    the only hash was of the bytes just read. Size, mtime and ctime must not have moved, and a
    fresh sample of the source (past any client cache) must match the copy."""
    after = reader.state()
    if after != before:
        raise _Mismatch(f"the source changed while it was copied (size, mtime, ctime {before} -> {after}); "
                        "not staged, run the mirror again once the file is complete")
    if hasattr(reader, "drop_cache"):
        reader.drop_cache()
    if judge(copied_sample, sampled_digest(reader, seed)) is not Verdict.MATCH:
        raise _Mismatch("a fresh sample of the source differs from the copy: the source changed while it was "
                        "copied; not staged, run the mirror again once the file is complete")


def _copy_verified(copy: CopyFile, source, local_hub: Path, cache: DigestCache, full: bool, progress,
                   batch: SyncBatch | None = None) -> None:
    """Copy one file from the source and check it *before* the rename (see land_verified)."""
    land_verified(copy, source, local_hub, cache, full,
                  lambda reader, out, hasher: copy_into(reader, out, copy.size, hasher, progress), batch)


Fill = Callable[[object, AtomicFile, object], None]


def _nas_file_bad(copy: CopyFile, got: Digest) -> str:
    return (f"the NAS copy does not match its {copy.reference.origin} ({got.method}: {got.value} != "
            f"{copy.reference.value}): {NAS_FILE_BAD}")


def land_verified(copy: CopyFile, source, local_hub: Path, cache: DigestCache, full: bool, fill: Fill,
                  batch: SyncBatch | None = None, vouched: Callable[[], Digest | None] | None = None) -> None:
    """Put one file's bytes into a temp file beside its final name with `fill(reader, out, hasher)`
    and check them *before* the rename, so a wrong byte never gets a final name.

    `reader` is the source's file, opened for the copy; `fill` writes copy.size bytes into `out`
    (a copy from the source, or bytes from elsewhere that must match it, as the fleet's
    broadcast lands them) and feeds them to `hasher` in file order when there is one. The
    check is the same whoever filled the file: --full hashes the stream (one read) against the
    reference; the default re-reads the sampled regions of the temp file against the source.
    Raises OSError (SourceChanged among them) or a mismatch; the temp file is then discarded.

    `vouched` (the broadcast's) gives, once the file is filled, what the node that read these
    very bytes from the source found them to be, after that node's own check (its key proves who
    sent it); or None. By default that is its sample of the source, with this run's seed: the
    temp file is checked against it and the source is not read again (every node of a chain
    sampling the NAS twice cost more NAS bytes than the data, on shards of a few MiB). With
    --full it is that node's hash of every byte it read, and stands for this copy's own (the
    chunk keys tie these bytes to that read): one hash on one node checks every node's copy
    against the reference. A fill that passes `vouched` samples the source itself before its
    first read of it, if it reads it at all, and with --full feeds `hasher` every byte; the
    check after the fill is then the usual one.

    With --full the source's hash is kept in `cache` once known: a source found not to match its
    reference in this run (here, or by the node that vouched) is refused again without a read.
    """
    if full and copy.reference.value is not None:
        known = cache.known(copy.source, copy.reference.method)
        if known is not None and known.value != copy.reference.value:
            raise _Mismatch(_nas_file_bad(copy, known))
    dest = inside(local_hub, copy.dest)
    # A small file is copied in the kernel from the pages its sample just read (copier.py): no
    # O_DIRECT descriptor and read-ahead advice to set up for it, three syscalls a file.
    reader = source.open(copy.source, uncached=True, sequential=copy.size >= SMALL_FILE)
    try:
        if reader.size != copy.size:
            raise _Mismatch(f"source size changed from {copy.size} to {reader.size} since the walk")
        before = reader.state()
        hasher = new_hasher(copy.reference.method, copy.size) if full else None
        if not full and vouched is None:
            # Sampled through the reader the copy uses, before the copy: the copy then finds the
            # sampled pages cached, where a second uncached open read a small file twice from the NAS.
            cache.remember(copy.source, sampled_digest(reader, cache.seed))
        with atomic_file(dest, size_hint=copy.size, mtime_ns=copy.mtime_ns, sync_dir=False, batch=batch,
                         chmod=store_modes.file_mode(local_hub, copy.dest)) as out:
            fill(reader, out, hasher)
            vouch = vouched() if vouched is not None else None
            if full:
                got = vouch or Digest(copy.reference.method, copy.size, hasher.hexdigest())
                expected = got if copy.reference.value is None else Digest(copy.reference.method, copy.size,
                                                                            copy.reference.value)
            else:
                got = sampled_digest(out, cache.seed)
                if vouch is not None:
                    cache.remember(copy.source, vouch)
                expected = vouch or cache.sampled(copy.source)
            if vouch is None:
                # A vouched file was checked so by the node that read it from the source.
                # The sample of the copy is read once: the default mode already took it as `got`.
                _unchanged_during_copy(reader, before, sampled_digest(out, cache.seed) if full else got, cache.seed)
            if full:
                cache.remember(copy.source, got)  # the source's own hash, read once in this run
            if judge(got, expected) is not Verdict.MATCH and full and copy.reference.value is not None:
                # The bytes just read from the NAS, unchanged during the read, are not what their
                # own name (or the trees listing) says: no copy of them can be right.
                raise _Mismatch(_nas_file_bad(copy, got))
            if judge(got, expected) is not Verdict.MATCH:
                raise _Mismatch(f"copied bytes do not match the source sample ({got.method}: {got.value} != "
                                f"{expected.value})")
            st = os.fstat(out.fd)  # the inode keeps its identity through the rename (now or batched)
        cache.remember_written(dest, got, (st.st_dev, st.st_ino, copy.size, copy.mtime_ns))
        if hasattr(reader, "drop_cache"):
            reader.drop_cache()
    finally:
        reader.close()
