"""`stage archive SRC... DEST`: move files to an archive, SHA-256 checked on both sides.

walk (list SRC, read DEST's journal) -> look at DEST (hash same-size names on both sides)
-> plan (copy / adopt / refuse) -> preflight -> move, one file at a time:

    copy into a temp file in DEST, hashing the source stream on the way
    -> fsync, drop the temp file's cached pages, re-read it from DEST and hash again
    -> rename into place, only when both hashes match
    -> SHA256SUMS, archive.jsonl, MOVED.txt
    -> delete the source

A kill at any point leaves the source, or a complete and verified copy under its final name
in DEST (usually both). The re-run finds that copy, hashes both sides again, adopts it and
finishes the job. One file at a time, so space is freed as the run goes, and a kill costs at
most one file's re-read.

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
from typing import Callable

from stager.atomic import atomic_file, atomic_write_bytes, ensure_dir, fsync_dir, is_temp_name, sweep_temps
from stager.copier import copy_into
from stager.errors import BadInput, CannotRun
from stager.fingerprint import Digest, Verdict, full_digest, judge
from stager.hub import Problem
from stager.lock import writer_lock
from stager.mirror import free_bytes
from stager.records import MOVED_NAME, SUMS_NAME, append_journal, moved_block, read_journal, update_sums
from stager.source import LocalReader
from stager.units import format_size

JOURNAL_NAME = "archive.jsonl"
LOCK_NAME = ".stage-archive.lock"
DEST_RECORDS = (SUMS_NAME, JOURNAL_NAME, LOCK_NAME)

MOVED_HEADER = """\
# Files listed below were moved out of this directory by `stage archive`.
# Each was hashed (SHA-256) while it was copied; the copy was then re-read from the
# destination and hashed again, and the original was deleted only after both matched.
# Check the archive with:  cd <directory of the sums file> && sha256sum -c SHA256SUMS
"""


@dataclass(frozen=True)
class SourceFile:
    """One regular file to move, as seen by the walk."""

    path: Path  # absolute
    name: str  # "/"-separated path inside DEST: the SHA256SUMS name
    group: Path  # the directory whose MOVED.txt records the move
    in_group: str  # path relative to `group`, as MOVED.txt names it
    destination: str  # the directory in DEST that corresponds to `group`
    size: int
    mtime_ns: int
    mode: int
    inode: tuple[int, int]


@dataclass(frozen=True)
class Walked:
    files: tuple[SourceFile, ...]
    groups: tuple[Path, ...]  # SRC directories: pruned of emptied subdirectories afterwards
    skipped: tuple[Problem, ...]  # found inside a SRC directory and left in place
    problems: tuple[Problem, ...]  # named on the command line and not archivable
    already_archived: tuple[str, ...]  # SRC gone, and DEST's journal says it was moved there


@dataclass(frozen=True)
class DestLook:
    """What DEST holds under a file's name. Same-size files are hashed on both sides."""

    kind: str  # absent | file | dir | link | other
    size: int = 0
    source: Digest | None = None
    dest: Digest | None = None


@dataclass(frozen=True)
class Step:
    file: SourceFile
    action: str  # copy | adopt | refuse
    detail: str = ""
    sha256: str | None = None  # adopt: the hash both sides already agreed on


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

    def to_json(self) -> dict:
        return {
            "dest": self.dest,
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


# ---------------------------------------------------------------- walk


def check_dest(dest: str) -> Path:
    """DEST must already exist: an archive mount that is not mounted is an empty directory on the
    local disk, and creating DEST there would "archive" onto the disk being freed."""
    path = Path(os.path.abspath(dest))
    if not path.is_dir():
        raise BadInput(f"{path}: DEST is not an existing directory (create it on the archive host first)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise CannotRun(f"{path}: DEST is not writable")
    return path


def walk_sources(sources: list[str], dest: Path) -> Walked:
    """List what each SRC holds, without following a symlink anywhere."""
    journal = read_journal(dest / JOURNAL_NAME)
    files: list[SourceFile] = []
    groups: list[Path] = []
    skipped: list[Problem] = []
    problems: list[Problem] = []
    done: list[str] = []
    real_dest = os.path.realpath(dest)
    for src in _named_sources(sources, real_dest):
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
            _walk_dir(src, src, dest, files, skipped)
        elif stat.S_ISREG(st.st_mode):
            if src.name == MOVED_NAME:
                problems.append(Problem(str(src), "signpost", "MOVED.txt records an earlier move and stays in place"))
                continue
            files.append(_source_file(src, st, src.name, src.parent, src.name, dest))
        else:
            problems.append(Problem(str(src), "not_a_file", "a FIFO, socket or device cannot be archived"))
    return Walked(tuple(files), tuple(groups), tuple(skipped), tuple(problems), tuple(done))


def _named_sources(sources: list[str], real_dest: str) -> list[Path]:
    """Absolute SRC paths, refusing (exit 2) any that overlap each other or DEST, or that would land
    on the same DEST name: such a run would copy a file onto itself or over another one."""
    if not sources:
        raise BadInput("stage archive needs at least one SRC before DEST")
    named: list[Path] = []
    for text in sources:
        src = Path(os.path.abspath(text))
        if not src.name:
            raise BadInput(f"{text}: cannot archive the root directory")
        # The parent is resolved, the last component is not: a SRC that is a link stays a link.
        real = os.path.join(os.path.realpath(src.parent), src.name)
        if _within(real, real_dest) or _within(real_dest, real):
            raise BadInput(f"{src}: SRC and DEST {real_dest} overlap")
        if src.name in DEST_RECORDS:
            raise BadInput(f"{src}: its name would overwrite DEST's own {src.name}")
        for other in named:
            if other.name == src.name:
                raise BadInput(f"{other} and {src} would both be archived as {src.name}")
            if _within(str(src), str(other)) or _within(str(other), str(src)):
                raise BadInput(f"{other} and {src} overlap; name each file once")
        named.append(src)
    return named


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _walk_dir(group: Path, here: Path, dest: Path, files: list[SourceFile], skipped: list[Problem]) -> None:
    try:
        entries = sorted(os.scandir(here), key=lambda e: e.name)
    except OSError as exc:
        skipped.append(Problem(str(here), "unreadable", exc.strerror or str(exc)))
        return
    for entry in entries:
        path = Path(entry.path)
        in_group = path.relative_to(group).as_posix()
        st = entry.stat(follow_symlinks=False)
        if here == group and entry.name == MOVED_NAME:
            continue  # the signpost of this very directory
        if stat.S_ISLNK(st.st_mode):
            # Following it could archive (and delete) files outside SRC.
            skipped.append(Problem(str(path), "symlink", f"link to {os.readlink(path)} left in place, not followed"))
        elif stat.S_ISDIR(st.st_mode):
            _walk_dir(group, path, dest, files, skipped)
        elif is_temp_name(entry.name):
            skipped.append(Problem(str(path), "temp", "an interrupted write's temp file, left in place"))
        elif stat.S_ISREG(st.st_mode):
            files.append(_source_file(path, st, f"{group.name}/{in_group}", group, in_group, dest / group.name))
        else:
            skipped.append(Problem(str(path), "not_a_file", "a FIFO, socket or device, left in place"))


def _source_file(path: Path, st: os.stat_result, name: str, group: Path, in_group: str,
                 destination: Path) -> SourceFile:
    return SourceFile(path, name, group, in_group, str(destination), st.st_size, st.st_mtime_ns,
                      stat.S_IMODE(st.st_mode), (st.st_dev, st.st_ino))


# ---------------------------------------------------------------- look at DEST, plan


def look_at_dest(files: tuple[SourceFile, ...], dest: Path) -> dict[str, DestLook]:
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
                                        _sha256(dest / file.name, uncached=True))
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
        return Step(file, "adopt", "identical file already in DEST", look.source.value)
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


# ---------------------------------------------------------------- move


class _Mismatch(Exception):
    pass


def _sha256(path: Path, *, uncached: bool) -> Digest:
    try:
        reader = LocalReader(str(path), uncached=uncached, sequential=True)
    except OSError as exc:
        return Digest("sha256", None, None, f"{path}: {exc.strerror or exc}")
    with reader:
        return full_digest(reader, "sha256")


def _unchanged(file: SourceFile) -> None:
    """The source must still be what was walked (and hashed): a file rewritten in place during the
    copy would otherwise be deleted while its new content exists nowhere else."""
    st = _lstat(file.path)
    if st is None or (st.st_size, st.st_mtime_ns, (st.st_dev, st.st_ino)) != (file.size, file.mtime_ns, file.inode):
        raise _Mismatch("the source changed while it was being archived; it was not deleted")


def copy_verified(file: SourceFile, target: Path, progress: Callable[[int], None] | None) -> str:
    """Copy `file` to `target` and return the sha256 both sides agree on.

    The second hash reads the temp file back after fsync and POSIX_FADV_DONTNEED, so the
    destination's disk (or the archive server, over NFS) answers rather than our page cache.
    Only a match is renamed into place.
    """
    with LocalReader(str(file.path), uncached=False, sequential=True) as reader:
        hasher = hashlib.sha256()
        with atomic_file(target, mode=file.mode, size_hint=file.size, mtime_ns=file.mtime_ns) as out:
            copy_into(reader, out, file.size, hasher, progress)
            _unchanged(file)
            os.fsync(out.fd)
            source = Digest("sha256", file.size, hasher.hexdigest())
            back = _sha256(out.temp, uncached=True)
            if judge(source, back) is not Verdict.MATCH:
                raise _Mismatch(f"the copy read back from DEST does not match the source "
                                f"(sha256 {back.value or back.error} != {source.value})")
    return source.value


class MovedLog:
    """This run's section of each group's MOVED.txt, rewritten atomically after every file.

    What the file held before (earlier runs, or notes an operator wrote by hand) is kept verbatim
    above this run's section.
    """

    def __init__(self, dest: Path, host: str):
        self.sums = str(dest / SUMS_NAME)
        self.host = host
        self.before: dict[Path, str] = {}
        self.files: dict[Path, list[tuple[str, int, str, str]]] = {}

    def record(self, file: SourceFile, sha256: str, how: str) -> Path:
        path = file.group / MOVED_NAME
        if file.group not in self.before:
            try:
                self.before[file.group] = path.read_text(encoding="utf-8", errors="surrogateescape")
            except FileNotFoundError:
                self.before[file.group] = MOVED_HEADER
            self.files[file.group] = []
        self.files[file.group].append((sha256, file.size, file.in_group, how))
        block = moved_block(destination=file.destination, sums=self.sums, host=self.host, time=_now(),
                            files=self.files[file.group])
        before = self.before[file.group].rstrip("\n") + "\n\n"
        atomic_write_bytes(path, (before + block).encode("utf-8", errors="surrogateescape"))
        return path


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def archive(sources: list[str], dest: str, *,
            progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> ArchiveReport:
    started = time.monotonic()
    dest_dir = check_dest(dest)
    report = ArchiveReport(str(dest_dir))
    with writer_lock(dest_dir / LOCK_NAME, f"archive {dest_dir}"):
        _sweep_signpost_temps(sources)
        walked = walk_sources(sources, dest_dir)
        report.skipped.extend(walked.skipped)
        report.problems.extend(walked.problems)
        report.already_archived.extend(walked.already_archived)
        looks = look_at_dest(walked.files, dest_dir)
        steps = [plan_step(f, looks[f.name]) for f in walked.files]
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
        log = MovedLog(dest_dir, socket.gethostname())
        # DEST itself too: a run killed while rewriting SHA256SUMS left its temp file there.
        for directory in sorted({dest_dir} | {(dest_dir / s.file.name).parent for s in steps}):
            ensure_dir(directory)
            sweep_temps(directory)  # left by a killed run; we hold the lock
        for step in steps:
            moved = _move(step, dest_dir, log, progress, report)
            if moved:
                report.moved.append(moved)
        for group in walked.groups:
            _prune_empty_dirs(group)
        report.moved_txt = sorted({str(f.group / MOVED_NAME) for f in walked.files
                                   if f.group in log.files})
    report.seconds = time.monotonic() - started
    return report


def _move(step: Step, dest: Path, log: MovedLog, progress, report: ArchiveReport) -> dict | None:
    file = step.file
    target = dest / file.name
    try:
        if step.action == "copy":
            sha256, how = copy_verified(file, target, progress), "copied"
        else:
            _unchanged(file)
            sha256, how = step.sha256, "adopted"
    except _Mismatch as exc:
        report.problems.append(Problem(str(file.path), "mismatch", str(exc)))
        return None
    except OSError as exc:
        report.problems.append(Problem(str(file.path), "unreadable", exc.strerror or str(exc)))
        return None
    # Records first, delete last: a kill in between leaves a verified copy that says where it
    # came from, and the re-run adopts it.
    update_sums(dest / SUMS_NAME, {file.name: sha256})
    record = {"time": _now(), "host": socket.gethostname(), "source": str(file.path), "dest": str(target),
              "name": file.name, "bytes": file.size, "sha256": sha256, "action": how,
              "verified": "sha256 of the source stream equals sha256 re-read from DEST"}
    append_journal(dest / JOURNAL_NAME, record)
    moved = {"source": str(file.path), "dest": str(target), "bytes": file.size, "sha256": sha256, "action": how,
             "source_deleted": False}
    try:
        log.record(file, sha256, how)
    except (OSError, CannotRun) as exc:
        # No signpost, no delete: a source must never vanish without saying where it went.
        report.problems.append(Problem(str(file.group / MOVED_NAME), "not_deleted",
                                       f"copied and verified, but MOVED.txt could not be written "
                                       f"({getattr(exc, 'message', None) or exc}); the source was kept"))
        return moved
    try:
        _unchanged(file)
        os.unlink(file.path)
        moved["source_deleted"] = True
        fsync_dir(file.path.parent)
    except _Mismatch as exc:
        report.problems.append(Problem(str(file.path), "changed", str(exc)))
    except OSError as exc:
        report.problems.append(Problem(str(file.path), "not_deleted",
                                       f"copied and verified, but the source could not be deleted: {exc.strerror or exc}"))
    return moved


def _sweep_signpost_temps(sources: list[str]) -> None:
    """A run killed while rewriting a MOVED.txt left its temp file beside it, in SRC, where no
    temp sweep of DEST reaches; only this tool writes `.MOVED.txt.stage-*.tmp`."""
    for src in map(os.path.abspath, sources):
        group = src if os.path.isdir(src) and not os.path.islink(src) else os.path.dirname(src)
        with contextlib.suppress(OSError):
            for entry in os.scandir(group):
                if is_temp_name(entry.name) and entry.name.startswith(f".{MOVED_NAME}.stage-"):
                    os.unlink(entry.path)


def _prune_empty_dirs(group: Path) -> None:
    """Emptied subdirectories go; the SRC directory itself stays, holding MOVED.txt."""
    for here, _dirs, _files in os.walk(group, topdown=False):
        if Path(here) != group:
            with contextlib.suppress(OSError):
                os.rmdir(here)


def _same_filesystem_notes(walked: Walked, dest: Path) -> list[str]:
    dest_dev = os.stat(dest).st_dev
    same = sorted({str(f.group) for f in walked.files if f.inode[0] == dest_dev})
    return [f"{group} is on the same filesystem as {dest}: archiving there frees no space" for group in same]
