"""`stage archive SRC... DEST`: move files to an archive, SHA-256 checked on both sides.

Trust model: SRC and DEST are spellings, compared by identity (resolved path, (st_dev, st_ino),
bind mounts), never as strings, and every place is checked again at the moment it is used. A DEST
name that leads back to its source was once "adopted" as an identical copy of itself, and the
source, the only copy, deleted.

validate (arguments, walk SRC, DEST's names: a refusal writes nothing, not even the lock)
-> lock DEST -> leave out files open for writing -> look at DEST (hash same-size names on both
sides) -> plan (copy / adopt / refuse) -> preflight -> move, in batches of about BATCH_BYTES:

    each file: copy into a temp file in DEST, hashing the source stream on the way
    -> fsync, drop the temp file's cached pages, re-read it from DEST and hash again
    -> rename into place, only when both hashes match and the source did not change
    then, once per batch: the sources still unchanged and not open for writing
    -> SHA256SUMS, archive.jsonl -> per source directory: a MOVED.txt section, its own
    SHA256SUMS without the moved names -> delete each source that is still the file copied

A kill at any point leaves the source, or a complete and verified copy under its final name in
DEST (usually both), and SHA256SUMS lists only what DEST holds. The re-run finds the copies,
hashes both sides again, adopts them and finishes the job.

Layout: like `cp -r`, a SRC ends up at DEST/<basename of SRC>. SHA256SUMS lives in DEST and
names files by their DEST-relative path (`tp2/engram-l1-r0of2.bin`), which is what
`sha256sum -c` resolves when run in DEST.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from stager.base.atomic import TEMP_MARK, atomic_file, check_writable, ensure_dir, fsync_dir, is_temp_name, sweep_temps
from stager.mirror.copier import SourceChanged, copy_into
from stager.engram.shard_format import parse_shard_name
from stager.base.errors import BadInput, CannotRun
from stager.mirror.fingerprint import Digest, Verdict, full_digest, judge
from stager.mirror.hub import Problem
from stager.base.identity import file_id, overlap, resolved, same_place, writers
from stager.base.lock import ARCHIVE_LOCK, ENGRAM_LOCK, writer_lock
from stager.mirror.pipeline import free_bytes
from stager.mirror.records import (MOVED_NAME, SUMS_NAME, append_journal, drop_from_sums, moved_block, moved_record,
                            read_journal, update_sums)
from stager.sources.local import LocalReader
from stager.base.units import format_size

JOURNAL_NAME = "archive.jsonl"
# This tool's records: never archived as data, wherever they are found, and never written through a link.
RECORDS = (SUMS_NAME, JOURNAL_NAME, ARCHIVE_LOCK, MOVED_NAME)
# Records are written once per batch, not per file: SHA256SUMS rewritten after each of 2,000 small
# shards took 23 s. A kill costs the re-run at most about one batch of re-hashing on both sides.
BATCH_BYTES = 1 << 30


@dataclass(frozen=True)
class SourceFile:
    """One regular file to move, as seen by the walk."""

    path: Path  # absolute, its directory resolved
    name: str  # "/"-separated path inside DEST: the SHA256SUMS name
    group: Path  # the directory whose MOVED.txt records the move
    in_group: str  # path relative to `group`, as MOVED.txt names it
    destination: str  # the directory in DEST that corresponds to `group`
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    inode: tuple[int, int]


@dataclass(frozen=True)
class Walked:
    files: tuple[SourceFile, ...]
    skipped: tuple[Problem, ...]  # found inside a SRC directory and left in place
    problems: tuple[Problem, ...]  # named on the command line and not archivable
    already_archived: tuple[str, ...]  # SRC gone, and DEST's journal says it was moved there
    leftovers: tuple[Path, ...]  # temp files of records in SRC, left by a killed run


@dataclass(frozen=True)
class DestLook:
    """What DEST holds under a file's name. Same-size files are hashed on both sides."""

    kind: str  # absent | file | dir | link | other
    size: int = 0
    source: Digest | None = None
    dest: Digest | None = None
    dest_id: tuple[int, int] | None = None


@dataclass(frozen=True)
class Step:
    file: SourceFile
    action: str  # copy | adopt | refuse
    detail: str = ""
    sha256: str | None = None  # adopt: the hash both sides already agreed on
    dest_id: tuple[int, int] | None = None  # adopt: the DEST file that was hashed


@dataclass(frozen=True)
class Placed:
    """A verified copy under its final name in DEST."""

    file: SourceFile
    target: Path
    sha256: str
    how: str  # copied | adopted
    dest_id: tuple[int, int]


@dataclass
class ArchiveReport:
    dest: str
    moved: list[dict] = field(default_factory=list)
    skipped: list[Problem] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    already_archived: list[str] = field(default_factory=list)
    moved_txt: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False
    would_move: list[dict] = field(default_factory=list)  # --dry-run: {path, to, bytes, action, reason}

    def to_json(self) -> dict:
        return {
            "dest": self.dest,
            "dry_run": self.dry_run,
            "would_move": self.would_move,
            "files": self.moved,
            "moved_files": len(self.moved),
            "moved_bytes": sum(m["bytes"] for m in self.moved),
            "copied_bytes": sum(m["bytes"] for m in self.moved if m["action"] == "copied"),
            "adopted_files": sum(1 for m in self.moved if m["action"] == "adopted"),
            "already_archived": self.already_archived,
            "skipped": [p.to_json() for p in self.skipped],
            "problems": [p.to_json() for p in self.problems],
            "moved_txt": self.moved_txt,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }


# ---------------------------------------------------------------- validate: nothing is written


def protected_places(manifest: str | None) -> tuple[str, ...]:
    """The NAS hub, the nodes' own sources and the alias targets of the manifest: places this tool
    never writes. The manifest is optional here: `--manifest` or $STAGE_MANIFEST must load, the
    default manifests/cluster.toml is read only if it exists."""
    from stager.manifest import MANIFEST_ENV, load_manifest, resolve_manifest_path

    path = resolve_manifest_path(manifest)
    if not manifest and not os.environ.get(MANIFEST_ENV) and not path.exists():
        return ()
    loaded = load_manifest(manifest)
    node_sources = [node.source for node in loaded.nodes.values() if node.source]
    return tuple(dict.fromkeys(map(resolved, loaded.local_sources(node_sources))))


def check_dest(dest: str, protected: tuple[str, ...]) -> Path:
    """DEST must already exist: an archive mount that is not mounted is an empty directory on the
    local disk, and creating DEST there would "archive" onto the disk being freed. It must not
    overlap the NAS, however spelled."""
    # As the kernel reads `..`: collapsing `other/link/..` into `other` first hid a DEST inside SRC.
    path = Path(resolved(dest))
    if not path.is_dir():
        raise BadInput(f"{path}: DEST is not an existing directory (create it on the archive host first)")
    for place in protected:
        if overlap(path, place):
            raise BadInput(f"{path}: DEST overlaps {place}, a NAS hub or alias target of the manifest, "
                           "which this tool never writes")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CannotRun(f"{path}: DEST is not writable")
    return path


def named_sources(sources: list[str], dest: Path) -> list[Path]:
    """SRC paths as the kernel reads them: the directory part resolved (`..` after a link climbs
    from the link's target), the last component kept, so a SRC that is a link stays a link.
    Refused (exit 2): any that overlap each other or DEST, or would land on the same DEST name."""
    if not sources:
        raise BadInput("stage archive needs at least one SRC before DEST")
    named: list[Path] = []
    for text in sources:
        spelled = os.path.join(os.getcwd(), text)
        head, name = os.path.split(spelled.rstrip("/") or "/")
        src = Path(resolved(spelled) if name in ("", ".", "..") else os.path.join(resolved(head), name))
        if src == Path("/"):
            raise BadInput(f"{text}: cannot archive the root directory")
        if overlap(src, dest):
            raise BadInput(f"{src}: SRC and DEST {dest} overlap")
        if src.name in RECORDS:
            raise BadInput(f"{src}: {src.name} is a record of this tool and is never archived as data")
        for other in named:
            if other.name == src.name:
                raise BadInput(f"{other} and {src} would both be archived as {src.name}")
            if overlap(src, other):
                raise BadInput(f"{other} and {src} overlap; name each file once")
        named.append(src)
    return named


def walk_sources(named: list[Path], dest: Path) -> Walked:
    """List what each SRC holds, without following a symlink anywhere."""
    journal = read_journal(dest / JOURNAL_NAME)
    files: dict[str, SourceFile] = {}
    receipts: list[SourceFile] = []
    groups: list[Path] = []
    skipped: list[Problem] = []
    problems: list[Problem] = []
    done: list[str] = []
    leftovers: list[Path] = []
    for src in named:
        st = _lstat(src)
        if st is None:
            if not any(_within(str(r.get("source", "")), str(src)) for r in journal):
                raise BadInput(f"{src}: no such file or directory (and {dest / JOURNAL_NAME} has no record of it)")
            done.append(str(src))
        elif stat.S_ISLNK(st.st_mode):
            problems.append(Problem(str(src), "symlink", f"is a symlink to {os.readlink(src)}; name the real path "
                                                         "to archive it (links are never followed)"))
        elif stat.S_ISDIR(st.st_mode):
            groups.append(src)
            _walk_dir(src, src, dest, files, skipped, leftovers)
        elif stat.S_ISREG(st.st_mode):
            files[src.name] = _source_file(src, st, src.name, src.parent, src.name, dest)
            receipts.extend(_receipt(src, dest))
        else:
            problems.append(Problem(str(src), "not_a_file", "a FIFO, socket or device cannot be archived"))
    for receipt in receipts:
        files.setdefault(receipt.name, receipt)
    for parent in {f.group for f in files.values()} - set(groups):  # a named file's directory
        leftovers.extend(Path(e.path) for e in _scandir(parent) if _record_temp(e.name))
    return Walked(tuple(files.values()), tuple(skipped), tuple(problems), tuple(done), tuple(leftovers))


def _receipt(shard: Path, dest: Path) -> list[SourceFile]:
    """An Engram shard named on its own takes its receipt along (ShardSpec.receipt): left behind,
    the receipt would describe a shard that is no longer there."""
    receipt = shard.with_suffix(".json")
    st = _lstat(receipt) if parse_shard_name(shard.name) else None
    if st is None or not stat.S_ISREG(st.st_mode):
        return []
    return [_source_file(receipt, st, receipt.name, receipt.parent, receipt.name, dest)]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _scandir(directory: Path) -> list[os.DirEntry]:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        return sorted(entries, key=lambda e: e.name)
    return []


def _record_temp(name: str) -> bool:
    """A temp file of one of this tool's records (a killed rewrite of a SRC directory's SHA256SUMS)."""
    return is_temp_name(name) and any(name.startswith(f".{record}{TEMP_MARK}") for record in RECORDS)


def _walk_dir(group: Path, here: Path, dest: Path, files: dict[str, SourceFile], skipped: list[Problem],
              leftovers: list[Path]) -> None:
    try:
        entries = sorted(os.scandir(here), key=lambda e: e.name)
    except OSError as exc:
        skipped.append(Problem(str(here), "unreadable", exc.strerror or str(exc)))
        return
    for entry in entries:
        path = Path(entry.path)
        in_group = path.relative_to(group).as_posix()
        st = entry.stat(follow_symlinks=False)
        if entry.name in RECORDS and not stat.S_ISDIR(st.st_mode):
            continue  # a record of an earlier move or archive stays with its directory
        if entry.name == ".locks" and stat.S_ISDIR(st.st_mode):
            continue  # writer locks (this tool's, huggingface_hub's): moving one lets a second writer in
        if stat.S_ISLNK(st.st_mode):
            # Following it could archive (and delete) files outside SRC.
            skipped.append(Problem(str(path), "symlink", f"link to {os.readlink(path)} left in place, not followed"))
        elif stat.S_ISDIR(st.st_mode):
            _walk_dir(group, path, dest, files, skipped, leftovers)
        elif _record_temp(entry.name):
            leftovers.append(path)
        elif is_temp_name(entry.name):
            skipped.append(Problem(str(path), "temp", "an interrupted write's temp file, left in place"))
        elif stat.S_ISREG(st.st_mode):
            name = f"{group.name}/{in_group}"
            files[name] = _source_file(path, st, name, group, in_group, dest / group.name)
        else:
            skipped.append(Problem(str(path), "not_a_file", "a FIFO, socket or device, left in place"))


def _source_file(path: Path, st: os.stat_result, name: str, group: Path, in_group: str,
                 destination: Path) -> SourceFile:
    return SourceFile(path, name, group, in_group, str(destination), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                      stat.S_IMODE(st.st_mode), (st.st_dev, st.st_ino))


def check_targets(walked: Walked, dest: Path, named: list[Path], protected: tuple[str, ...]) -> None:
    """Refuse (exit 2) a DEST name that is its source file, through a link, a hard link or a bind
    mount, and a directory in DEST that leads into a SRC or the NAS."""
    for file in walked.files:
        target = dest / file.name
        if os.path.lexists(target) and (same_place(target, file.path) or resolved(target) == resolved(file.path)):
            raise BadInput(f"{target} is {file.path} itself (through a link or a mount); "
                           "archiving it would delete the only copy")
    for directory in sorted({_existing(dest / os.path.dirname(f.name)) for f in walked.files}):
        for place in (*map(str, named), *protected):
            if overlap(directory, place):
                raise BadInput(f"{directory} in DEST leads into {place}; archiving there would write into a "
                               "source")


def _existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


# ---------------------------------------------------------------- look at DEST, plan


def in_use(files: tuple[SourceFile, ...]) -> tuple[list[SourceFile], list[Problem]]:
    """Files no process on this host has open for writing, and a problem for each one that has:
    a log archived while its writer appended kept the first 12 of 40 lines."""
    busy = writers({f.inode for f in files})
    problems = [Problem(str(f.path), "in_use", f"open for writing by {_processes(busy[f.inode])}; "
                                               "a file still being written is not archived")
                for f in files if f.inode in busy]
    return [f for f in files if f.inode not in busy], problems


def _processes(pids: list[int]) -> str:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
                names.append(f"pid {pid} ({handle.read().strip()})")
        except OSError:
            names.append(f"pid {pid}")
    return ", ".join(names)


def look_at_dest(files: list[SourceFile], dest: Path) -> dict[str, DestLook]:
    """lstat every DEST name; a same-size regular file is hashed on both sides (DEST uncached)."""
    looks: dict[str, DestLook] = {}
    for file in files:
        st = _lstat(dest / file.name)
        if st is None:
            looks[file.name] = DestLook("absent")
        elif not stat.S_ISREG(st.st_mode):
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "other"
            looks[file.name] = DestLook(kind)
        elif st.st_size != file.size:
            looks[file.name] = DestLook("file", st.st_size)
        else:
            looks[file.name] = DestLook("file", st.st_size, _sha256(file.path, uncached=False),
                                        _sha256(dest / file.name, uncached=True), (st.st_dev, st.st_ino))
    return looks


def plan_step(file: SourceFile, look: DestLook) -> Step:
    """Copy to a free name; adopt a name that already holds the same bytes (same sha256 on both
    sides, by the one equality rule); refuse anything else, because overwriting an archived file
    with other content would destroy the only other copy of something."""
    if look.kind == "absent":
        return Step(file, "copy")
    if look.kind != "file":
        return Step(file, "refuse", f"DEST already has a {look.kind} named {file.name}")
    if look.size != file.size:
        return Step(file, "refuse", f"DEST/{file.name} exists with different content "
                                    f"({look.size} bytes there, {file.size} here)")
    verdict = judge(look.source, look.dest)
    if verdict is Verdict.MATCH:
        return Step(file, "adopt", "identical file already in DEST", look.source.value, look.dest_id)
    if verdict is Verdict.DIFFER:
        return Step(file, "refuse", f"DEST/{file.name} exists with different content "
                                    f"(sha256 {look.dest.value} there, {look.source.value} here)")
    reason = look.source.error or look.dest.error
    return Step(file, "refuse", f"could not compare with DEST/{file.name}: {reason}")


def preflight(steps: list[Step], dest: Path) -> None:
    needed = sum(s.file.size for s in steps if s.action == "copy")
    free = free_bytes(dest)
    if needed > free:
        raise CannotRun(f"not enough space on {dest}: need {format_size(needed)}, free {format_size(free)} "
                        f"(short by {format_size(needed - free)})")


def refuse_unusable_records(walked: Walked, dest: Path) -> None:
    """Exit 3 before anything is copied when a record this run writes is a symlink (the writes would
    replace the link, but a link planted there is an attack or a mistake worth stopping for), or
    anything else that is not a regular file (a FIFO would block the read of the record)."""
    paths = [dest / SUMS_NAME, dest / JOURNAL_NAME, *(g / MOVED_NAME for g in {f.group for f in walked.files}),
             *(d / SUMS_NAME for d in _record_dirs(walked))]
    for path in paths:
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise CannotRun(f"{path} is a symlink to {os.readlink(path)}; refusing to write a record through it")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise CannotRun(f"{path} is not a regular file; refusing to use it as a record")


def _record_dirs(walked: Walked) -> set[Path]:
    """The source directories whose SHA256SUMS this run may rewrite."""
    return {d for f in walked.files for d in _between(f.path.parent, f.group)}


def _between(directory: Path, group: Path) -> list[Path]:
    """`directory` and its parents up to `group`, both included: where a SHA256SUMS may list a
    file of `directory`, and what a move out of it may empty."""
    dirs = [directory]
    while dirs[-1] != group and dirs[-1] != dirs[-1].parent:
        dirs.append(dirs[-1].parent)
    return dirs


# ---------------------------------------------------------------- move


class _Refused(Exception):
    """One file is not moved (or its source not deleted), for the reason named; the run goes on."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _sha256(path: Path, *, uncached: bool) -> Digest:
    try:
        reader = LocalReader(str(path), uncached=uncached, sequential=True)
    except OSError as exc:
        return Digest("sha256", None, None, f"{path}: {exc.strerror or exc}")
    with reader:
        return full_digest(reader, "sha256")


def _unchanged(file: SourceFile) -> None:
    """The source must still be what was walked (and hashed): a file rewritten in place during the
    copy would otherwise be deleted while its new content exists nowhere else. ctime too: a writer
    that restores the mtime (`touch -r`, rsync --inplace) still moves the ctime."""
    st = _lstat(file.path)
    if st is None or (st.st_size, st.st_mtime_ns, st.st_ctime_ns, (st.st_dev, st.st_ino)) != (
            file.size, file.mtime_ns, file.ctime_ns, file.inode):
        raise _Refused("changed", "the source changed while it was being archived; it was kept")


def _still_the_copy(file: SourceFile, target: Path, dest_id: tuple[int, int]) -> None:
    """DEST's name must still hold the verified copy, and the copy must not be the source itself."""
    now = file_id(target, follow=False)
    if now == file.inode or resolved(target) == resolved(file.path):
        raise _Refused("same_file", f"{target} is the source file itself; the source was kept")
    if now != dest_id:
        raise _Refused("dest_changed", f"{target} is no longer the verified copy; the source was kept")


def copy_verified(file: SourceFile, target: Path,
                  progress: Callable[[int], None] | None) -> tuple[str, tuple[int, int]]:
    """Copy `file` to `target`; return the sha256 both sides agree on and the copy's (st_dev, st_ino).

    The second hash reads the temp file back after fsync and POSIX_FADV_DONTNEED, so the
    destination's disk (or the archive server, over NFS) answers rather than our page cache.
    Only a match is renamed into place; the directory is fsynced once per batch, by the caller.
    """
    with LocalReader(str(file.path), uncached=False, sequential=True) as reader:
        hasher = hashlib.sha256()
        with atomic_file(target, mode=file.mode, size_hint=file.size, mtime_ns=file.mtime_ns,
                         sync_dir=False) as out:
            copy_into(reader, out, file.size, hasher, progress)
            _unchanged(file)
            os.fsync(out.fd)
            source = Digest("sha256", file.size, hasher.hexdigest())
            back = _sha256(out.temp, uncached=True)
            if judge(source, back) is not Verdict.MATCH:
                raise _Refused("mismatch", f"the copy read back from DEST does not match the source "
                                           f"(sha256 {back.value or back.error} != {source.value})")
            st = os.fstat(out.fd)
    return source.value, (st.st_dev, st.st_ino)


def _place(step: Step, dest: Path, progress) -> Placed:
    """Copy or adopt one file, checking at this moment that DEST's name is not the source."""
    file, target = step.file, dest / step.file.name
    _unchanged(file)
    if step.action == "adopt":
        _still_the_copy(file, target, step.dest_id)
        return Placed(file, target, step.sha256, "adopted", step.dest_id)
    if os.path.lexists(target):
        _still_the_copy(file, target, file_id(target, follow=False))  # same_file, if it is the source
        raise _Refused("collision", f"{target} appeared while archiving; nothing was overwritten")
    sha256, dest_id = copy_verified(file, target, progress)
    return Placed(file, target, sha256, "copied", dest_id)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def archive(sources: list[str], dest: str, *, protected: tuple[str, ...] = (), dry_run: bool = False,
            progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> ArchiveReport:
    started = time.monotonic()
    dest_dir = check_dest(dest, protected)
    named = named_sources(sources, dest_dir)
    walked = walk_sources(named, dest_dir)
    check_targets(walked, dest_dir, named, protected)
    report = ArchiveReport(str(dest_dir), skipped=list(walked.skipped), problems=list(walked.problems),
                           already_archived=list(walked.already_archived), dry_run=dry_run)
    if dry_run:
        return _dry_run(report, walked, dest_dir, started)
    with writer_lock(dest_dir / ARCHIVE_LOCK, f"archive {dest_dir}"), _engram_locks(walked):
        refuse_unusable_records(walked, dest_dir)
        for leftover in walked.leftovers:  # a killed run's; only this tool writes these names
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        files, busy = in_use(walked.files)
        report.problems.extend(busy)
        looks = look_at_dest(files, dest_dir)
        steps = [plan_step(f, looks[f.name]) for f in files]
        refused = [s for s in steps if s.action == "refuse"]
        if refused:
            # Nothing moves: a name clash usually means the wrong DEST, and a half-moved set
            # scattered over two archives is worse than none moved.
            report.problems.extend(Problem(str(s.file.path), "collision", s.detail) for s in refused)
            report.seconds = time.monotonic() - started
            return report
        preflight(steps, dest_dir)
        report.notes.extend(_same_filesystem_notes(walked, dest_dir))
        total = sum(s.file.size for s in steps if s.action == "copy")
        progress = progress_factory(total) if progress_factory and total else None
        # DEST itself too: a run killed while rewriting SHA256SUMS left its temp file there.
        for directory in sorted({dest_dir} | {(dest_dir / s.file.name).parent for s in steps}):
            ensure_dir(directory)
            sweep_temps(directory)  # left by a killed run; we hold the lock
        mover = _Mover(dest_dir, report)
        for batch in _batches(steps):
            mover.move(batch, progress)
        report.moved_txt = sorted(mover.moved_txt)
    report.seconds = time.monotonic() - started
    return report


def _dry_run(report: ArchiveReport, walked: Walked, dest_dir: Path, started: float) -> ArchiveReport:
    """The real run's checks and plan, from what is on disk now, with nothing written: no lock, no
    temp, no record, no leftover swept. Each file that would move is listed in `would_move`; what
    would stop the real run (a record that is a link, no space, no write access to DEST) ends this
    one the same way, and a source the real run could not delete is the same not_deleted problem."""
    refuse_unusable_records(walked, dest_dir)
    files, busy = in_use(walked.files)
    report.problems.extend(busy)
    looks = look_at_dest(files, dest_dir)
    steps = [plan_step(f, looks[f.name]) for f in files]
    refused = [s for s in steps if s.action == "refuse"]
    report.problems.extend(Problem(str(s.file.path), "collision", s.detail) for s in refused)
    if not refused:
        preflight(steps, dest_dir)
        for directory in sorted({dest_dir} | {(dest_dir / s.file.name).parent for s in steps}):
            check_writable(directory)  # the real run ends with exit 3 here too
        for step in steps:
            # The real run copies these and keeps the source, with a not_deleted problem (exit 1).
            try:
                check_writable(step.file.path.parent)
            except OSError as exc:
                report.problems.append(Problem(str(step.file.path), "not_deleted", (
                    f"would be copied and verified, but MOVED.txt could not be written in {step.file.path.parent} "
                    f"({exc.strerror}); the source would be kept")))
        report.would_move = [{"path": str(s.file.path), "to": str(dest_dir / s.file.name), "bytes": s.file.size,
                              "action": s.action, "reason": s.detail or "not in DEST"} for s in steps]
        report.notes.extend(_same_filesystem_notes(walked, dest_dir))
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _engram_locks(walked: Walked) -> Iterator[None]:
    """pack-engram's lock on every source directory that has one and whose records this run rewrites.

    pack-engram and archive both rewrite an engram_dir's SHA256SUMS (archive drops the moved shards'
    lines); under two different locks, a pack finishing during an archive lost the archive's edit,
    or the other way round. A directory never packed has no such lock file, and none is made there."""
    with contextlib.ExitStack() as held:
        for directory in sorted(_record_dirs(walked)):
            if os.path.lexists(directory / ENGRAM_LOCK):
                held.enter_context(writer_lock(directory / ENGRAM_LOCK, f"engram directory {directory}"))
        yield


def _batches(steps: list[Step]) -> Iterator[list[Step]]:
    """Consecutive steps of about BATCH_BYTES (a larger file is a batch of its own)."""
    batch, size = [], 0
    for step in steps:
        batch.append(step)
        size += step.file.size
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Mover:
    """Moves batches of files: copies first, then the records, then the deletes."""

    def __init__(self, dest: Path, report: ArchiveReport):
        self.dest = dest
        self.report = report
        self.host = socket.gethostname()
        self.moved_txt: set[str] = set()

    def _problem(self, path: Path, kind: str, detail: str) -> None:
        self.report.problems.append(Problem(str(path), kind, detail))

    def move(self, steps: list[Step], progress) -> None:
        placed = []
        for step in steps:
            try:
                placed.append(_place(step, self.dest, progress))
            except _Refused as exc:
                self._problem(step.file.path, exc.kind, exc.detail)
            except OSError as exc:
                kind = "changed" if isinstance(exc, SourceChanged) else "unreadable"
                self._problem(step.file.path, kind, exc.strerror or str(exc))
        for directory in {p.target.parent for p in placed if p.how == "copied"}:
            fsync_dir(directory)  # the renames are durable before SHA256SUMS names them
        placed = self._still_archivable(placed)
        if not placed:
            return
        # Records first, delete last: a kill in between leaves verified copies that say where they
        # came from, and the re-run adopts them.
        update_sums(self.dest / SUMS_NAME, {p.file.name: p.sha256 for p in placed})
        append_journal(self.dest / JOURNAL_NAME, [
            {"time": _now(), "host": self.host, "source": str(p.file.path), "dest": str(p.target),
             "name": p.file.name, "bytes": p.file.size, "sha256": p.sha256, "action": p.how,
             "verified": "sha256 of the source stream equals sha256 re-read from DEST"} for p in placed])
        moved = {p.file.path: {"source": str(p.file.path), "dest": str(p.target), "bytes": p.file.size,
                               "sha256": p.sha256, "action": p.how, "source_deleted": False} for p in placed}
        self.report.moved.extend(moved.values())
        for group in dict.fromkeys(p.file.group for p in placed):
            members = [p for p in placed if p.file.group == group]
            if self._record_in_source(group, members):
                for p in members:
                    moved[p.file.path]["source_deleted"] = self._delete(p)
        # The deletes, and the removals of the directories they emptied, are durable.
        for directory in {_existing(p.file.path.parent) for p in placed if moved[p.file.path]["source_deleted"]}:
            fsync_dir(directory)

    def _still_archivable(self, placed: list[Placed]) -> list[Placed]:
        """Drop the files that changed or were opened for writing while they were copied, with the
        copy this run made of them: a name left in DEST would collide with the finished file later."""
        busy = writers({p.file.inode for p in placed})
        kept = []
        for p in placed:
            try:
                if p.file.inode in busy:
                    raise _Refused("in_use", f"opened for writing by {_processes(busy[p.file.inode])} while it was "
                                             "being archived; it was kept")
                _unchanged(p.file)
                _still_the_copy(p.file, p.target, p.dest_id)
            except _Refused as exc:
                self._problem(p.file.path, exc.kind, exc.detail)
                if p.how == "copied" and file_id(p.target, follow=False) == p.dest_id:
                    with contextlib.suppress(OSError):
                        os.unlink(p.target)
                continue
            kept.append(p)
        return kept

    def _record_in_source(self, group: Path, members: list[Placed]) -> bool:
        """MOVED.txt gets a section, and every SHA256SUMS on the way up to `group` loses the lines of
        the files about to go. No record, no delete: a source never vanishes without saying where."""
        block = moved_block(destination=members[0].file.destination, sums=str(self.dest / SUMS_NAME),
                            host=self.host, time=_now(),
                            files=[(p.sha256, p.file.size, p.file.in_group, p.how) for p in members])
        gone = {os.path.normpath(p.file.path) for p in members}
        record = group / MOVED_NAME
        try:
            with moved_record(record) as append:
                append(block)
                self.moved_txt.add(str(record))
                for directory in sorted({d for p in members for d in _between(p.file.path.parent, group)}):
                    record = directory / SUMS_NAME
                    drop_from_sums(record, gone)
        except (OSError, CannotRun) as exc:
            reason = getattr(exc, "message", None) or exc.strerror or str(exc)
            for p in members:
                self._problem(p.file.path, "not_deleted", f"copied and verified, but {record.name} could not be "
                                                          f"written in {record.parent} ({reason}); the source was kept")
            return False
        return True

    def _delete(self, placed: Placed) -> bool:
        try:
            _unchanged(placed.file)
            _still_the_copy(placed.file, placed.target, placed.dest_id)
            os.unlink(placed.file.path)
        except _Refused as exc:
            self._problem(placed.file.path, exc.kind, exc.detail)
            return False
        except OSError as exc:
            self._problem(placed.file.path, "not_deleted",
                          f"copied and verified, but the source could not be deleted: {exc.strerror or exc}")
            return False
        # The directories it emptied go with it, at once: a kill between this and a prune at the
        # end left them to a re-run that cannot tell them from directories that were empty before.
        for directory in _between(placed.file.path.parent, placed.file.group)[:-1]:
            try:
                os.rmdir(directory)
            except OSError:
                break  # still holds something (or was never ours to remove)
        return True


def _same_filesystem_notes(walked: Walked, dest: Path) -> list[str]:
    dest_dev = os.stat(dest).st_dev
    same = sorted({str(f.group) for f in walked.files if f.inode[0] == dest_dev})
    return [f"{group} is on the same filesystem as {dest}: archiving there frees no space" for group in same]
