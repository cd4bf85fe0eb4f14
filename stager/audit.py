"""`stage audit --node NAME`: will the node's staging fit, and what could be reclaimed? Made for cron.

Exit codes follow the Nagios plugin convention, because monitoring wires this command in:
0 OK, 1 WARNING (less than 2x reserve would remain after staging, or a pending NAS revision idle
for longer than nas.pending_warn_after), 2 CRITICAL (needed + reserve does not fit), 3 UNKNOWN
(a path cannot be read, the NAS cannot be walked, the manifest is bad).
Each filesystem under nodes.X.hub and nodes.X.engram_dir is judged on its own (one that holds
both is counted once); the node's status is the worst of them.

Cheap by design, since it runs every 15 minutes on serving nodes:
- Weights still needed come from the mirror's own walk and plan (one rule for what staging would
  copy), with one difference: a local file of the right size is *presumed* correct instead of
  being fingerprinted against the NAS. The walk reads only NAS metadata (listings, links, refs),
  never file contents. Checking content is `stage verify`'s job.
- Engram shards: a shard of the expected size under its expected name is presumed done.
The estimate can therefore only err low when a right-sized file holds wrong bytes, which the
mirror's verify would catch and re-copy.

Running next to the writers: the audit only reads, and takes no lock (taking one, even for an
instant, would make a mirror starting in that instant exit 3 "locked"). A temp file's name and
mtime are not trusted to say whether it is abandoned: the mirror stamps a copy with the NAS's mtime
before its rename, so a live copy looks as old as its source. Its writer's lock is checked instead,
in the kernel's table (/proc/locks). An entry that vanishes between its listing and its lstat was
renamed or deleted by a writer, and is skipped.

Every line it prints is one line: names from the disk are escaped (text.printable), and a `|`
in the status text, which Nagios would take for the start of the perfdata, is shown as `\\x7c`.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from stager import __version__
from stager.atomic import atomic_write_bytes, is_temp_name
from stager.errors import StageError, describe_os_error
from stager.fingerprint import Verdict
from stager.hub import MAX_HOPS, Pending, Problem, format_duration, repo_dir_name
from stager.lock import ARCHIVE_LOCK, ENGRAM_LOCK, HUB_LOCK, PROC_LOCKS, LockTable
from stager.manifest import Manifest, load_manifest
from stager.mirror import node_job, walk
from stager.plan import LocalState, final_files, make_plan
from stager.small_files import read_regular
from stager.text import printable
from stager.units import format_size

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = ("OK", "WARNING", "CRITICAL", "UNKNOWN")
# A temp file untouched for this long may be interrupted; whether it is, the writer locks of the
# tree it lies in decide (stale_temps, guarding_locks).
STALE_SECONDS = 3600
TOP_RECLAIMABLE = 10
ORPHAN_KINDS = ("blob", "shared-blob", "shard", "temp")
REPO_KINDS = ("models", "datasets", "spaces")


def shown(text: str) -> str:
    """A name from the disk as a piece of one printed line (see text.printable)."""
    return printable(str(text))


@dataclass(frozen=True)
class Need:
    """Bytes still to stage for one model under one node path."""

    model: str
    root: str  # nodes.X.hub (weights) or nodes.X.engram_dir (shards)
    kind: str  # weights | engram
    bytes: int
    files: int


@dataclass(frozen=True)
class Filesystem:
    mount: str
    roots: tuple[str, ...]
    free: int
    total: int
    needed: int
    reserve: int

    @property
    def remaining(self) -> int:
        return self.free - self.needed

    @property
    def status(self) -> int:
        if self.needed + self.reserve > self.free:
            return CRITICAL
        if self.remaining < 2 * self.reserve:
            return WARNING
        return OK

    def why(self) -> str:
        mount = shown(self.mount)
        if self.status == CRITICAL:
            return (f"{mount}: needs {format_size(self.needed)} + reserve {format_size(self.reserve)}, "
                    f"free {format_size(self.free)} (short by {format_size(self.needed + self.reserve - self.free)})")
        if self.status == WARNING:
            return (f"{mount}: {format_size(self.remaining)} would remain after staging "
                    f"{format_size(self.needed)}, less than 2x reserve ({format_size(2 * self.reserve)})")
        return (f"{mount}: {format_size(self.remaining)} would remain after staging "
                f"{format_size(self.needed)} (reserve {format_size(self.reserve)})")

    def perfdata(self, label_suffix: str = "") -> str:
        """Nagios perfdata: free space with the thresholds as ranges (`N:` alerts below N, the
        plugin guidelines' form for a lower bound), then the bytes still needed."""
        return (f"'free{label_suffix}'={self.free}B;{self.needed + 2 * self.reserve}:;{self.needed + self.reserve}:;0;"
                f"{self.total} 'needed{label_suffix}'={self.needed}B;;;0;")

    def to_json(self) -> dict:
        return {"mount": self.mount, "paths": list(self.roots), "free_bytes": self.free, "total_bytes": self.total,
                "needed_bytes": self.needed, "reserve_bytes": self.reserve, "remaining_bytes": self.remaining,
                "status": STATUS_NAMES[self.status]}


@dataclass(frozen=True)
class Orphan:
    """Something on the node's disks that nothing staged needs, and the bytes removing it frees."""

    path: str
    kind: str  # blob | shared-blob | shard | temp | unlisted-repo
    bytes: int
    detail: str

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "bytes": self.bytes, "detail": self.detail}


@dataclass
class AuditReport:
    node: str
    reserve: int = 0
    filesystems: list[Filesystem] = field(default_factory=list)
    needs: list[Need] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)
    unlisted: list[Orphan] = field(default_factory=list)  # reclaimable, but not orphans: whole repos
    live_temps: list[Orphan] = field(default_factory=list)  # old-looking temp files a writer may still own
    problems: list[Problem] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # why the answer cannot be trusted
    pending: list[Pending] = field(default_factory=list)  # NAS revisions still downloading; the node stays put
    pending_warn_after: int = 6 * 3600  # nas.pending_warn_after: idle longer than this is a WARNING
    seconds: float = 0.0
    finished_at: float = 0.0
    prom: str | None = None

    @property
    def status(self) -> int:
        if self.unknown:
            return UNKNOWN
        # A download killed for good on the NAS would otherwise leave every node on its old
        # revision, healthy by every exit code, for ever.
        stalled = WARNING if self.overdue else OK
        return max([stalled, *(fs.status for fs in self.filesystems)])

    @property
    def overdue(self) -> list[Pending]:
        return [p for p in self.pending if p.idle_seconds > self.pending_warn_after]

    @property
    def reclaimable(self) -> list[Orphan]:
        return sorted(self.orphans + self.unlisted, key=lambda o: (-o.bytes, o.path))[:TOP_RECLAIMABLE]

    @property
    def reason(self) -> str:
        """One line: names from the disk and the command line are escaped."""
        if self.unknown:
            return "; ".join(shown(why) for why in self.unknown)
        worst = [fs for fs in self.filesystems if fs.status == self.status] or self.filesystems
        reason = "; ".join([*(self.pending_why(p) for p in self.overdue),
                            *(fs.why() for fs in worst),
                            *(self.pending_why(p) for p in self.pending if p not in self.overdue)]) or "nothing to check"
        top = self.reclaimable
        if self.status != OK and top:
            total = sum(o.bytes for o in self.orphans + self.unlisted)
            reason += f"; reclaimable {format_size(total)}, largest {shown(top[0].path)} ({format_size(top[0].bytes)})"
        return reason

    def pending_why(self, item: Pending) -> str:
        limit = format_duration(self.pending_warn_after)
        why = (f"{shown(item.repo_id)} {shown(item.revision)}: the NAS's {item.commit[:12]} is incomplete, "
               f"no progress for {format_duration(item.idle_seconds)}; the node stays on {item.serving[:12]}")
        if item.idle_seconds > self.pending_warn_after:
            return why + f" (over nas.pending_warn_after {limit}: finish or remove that download on the NAS)"
        return why

    @property
    def succeeded(self) -> bool:
        """The audit reached an answer; WARNING and CRITICAL are answers, UNKNOWN is not."""
        return self.status != UNKNOWN

    def perfdata(self) -> str:
        """One filesystem: 'free' and 'needed'. Several: each label ends with its mount point."""
        many = len(self.filesystems) > 1
        return " ".join(fs.perfdata(f" {_perf_label(fs.mount)}" if many else "") for fs in self.filesystems)

    def status_line(self) -> str:
        """`STAGE <STATUS>: <node>: <reason> | <perfdata>`, a Nagios plugin's first line. The text
        before the `|` never holds one of its own (a file name's is shown as `\\x7c`)."""
        text = f"STAGE {STATUS_NAMES[self.status]}: {shown(self.node)}: {self.reason}".replace("|", "\\x7c")
        perfdata = self.perfdata()
        return f"{text} | {perfdata}" if perfdata else text

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "status": STATUS_NAMES[self.status],
            "exit_code": self.status,
            "reason": self.reason,
            "fits": None if self.unknown else all(fs.status != CRITICAL for fs in self.filesystems),
            "reserve_bytes": self.reserve,
            "needed_bytes": sum(n.bytes for n in self.needs),
            "filesystems": [fs.to_json() for fs in self.filesystems],
            "needed": [{"model": n.model, "path": n.root, "kind": n.kind, "bytes": n.bytes, "files": n.files}
                       for n in self.needs],
            "orphans": [o.to_json() for o in self.orphans],
            "orphan_bytes": sum(o.bytes for o in self.orphans),
            "live_temps": [o.to_json() for o in self.live_temps],
            "reclaimable": [o.to_json() for o in self.reclaimable],
            "reclaimable_bytes": sum(o.bytes for o in self.orphans + self.unlisted),
            "problems": [p.to_json() for p in self.problems],
            "pending": [{**p.to_json(), "overdue": p.idle_seconds > self.pending_warn_after} for p in self.pending],
            "pending_warn_after_seconds": self.pending_warn_after,
            "estimate": "size-only",
            "prom": self.prom,
            "seconds": round(self.seconds, 3),
        }


# ---------------------------------------------------------------- needed bytes


def model_needs(manifest: Manifest, node: str, report: AuditReport) -> list[Need]:
    """The mirror's walk and plan, over size-only local states (see the module doc)."""
    job = node_job(manifest, node, None, jobs=1, seed=0)
    snapshots = walk(job)
    report.pending = [snap.pending for snap in snapshots if snap.pending]
    for snap in snapshots:
        report.problems.extend(snap.problems)
        for problem in snap.problems:
            if problem.kind in ("missing", "unreadable"):
                report.unknown.append(f"cannot tell what {snap.repo_id} needs: {problem.path}: {problem.detail}")
    finals = final_files(snapshots)
    local = {dest: _presumed_state(job.local_hub / dest, entry.size) for dest, (entry, _) in finals.items()}
    plan = make_plan(snapshots, local, {})
    needs = []
    for repo_id, _revision, _exclude in job.models:
        copies = [c for c in plan.copies if finals[c.dest][0].repo_id == repo_id]
        needs.append(Need(repo_id, str(job.local_hub), "weights", sum(c.size for c in copies), len(copies)))
    return needs


def _presumed_state(path: Path, size: int) -> LocalState:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return LocalState("absent")
    if not stat.S_ISREG(st.st_mode):
        return LocalState("other")
    verdict = Verdict.MATCH if st.st_size == size else None
    return LocalState("file", st.st_size, (st.st_dev, st.st_ino), verdict=verdict)


def engram_needs(manifest: Manifest, node: str) -> tuple[list[Need], list]:
    """(needs, expected shard specs). Shards are written whole under their final name, so a file of
    the expected size counts as done."""
    config = manifest.node(node)
    if manifest.engram is None or config.engram_dir is None:
        return [], []
    from stager.engram import expected_shards

    specs = list(expected_shards(manifest, node, rank=None))
    missing = [spec for spec in specs if _size_of(Path(config.engram_dir) / spec.path) != spec.bytes]
    need = Need(manifest.engram.model, config.engram_dir, "engram", sum(s.bytes for s in missing), len(missing))
    return [need], specs


def _size_of(path: Path) -> int | None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


# ---------------------------------------------------------------- filesystems


def filesystems(roots: list[str], needs: list[Need], reserve: int) -> list[Filesystem]:
    """One entry per filesystem, however many node paths it holds."""
    found: dict[int, dict] = {}
    for root in roots:
        probe = Path(root)
        while True:
            try:
                dev, vfs = os.stat(probe).st_dev, os.statvfs(probe)
                break
            except FileNotFoundError:  # not made yet (or just removed): measured where it will be made
                probe = probe.parent
        # Free for an unprivileged writer, as mirror.free_bytes (and shutil.disk_usage) count it.
        fs = found.setdefault(dev, {"mount": _mount_point(probe, dev), "roots": [], "free": vfs.f_bavail * vfs.f_frsize,
                                    "total": vfs.f_blocks * vfs.f_frsize})
        fs["roots"].append(root)
    return [Filesystem(fs["mount"], tuple(fs["roots"]), fs["free"], fs["total"],
                       sum(n.bytes for n in needs if n.root in fs["roots"]), reserve)
            for fs in found.values()]


def _mount_point(path: Path, dev: int) -> str:
    path = Path(os.path.realpath(path))
    while path.parent != path and os.stat(path.parent).st_dev == dev:
        path = path.parent
    return str(path)


# ---------------------------------------------------------------- orphans


def _lstat(path: str | Path) -> os.stat_result | None:
    """lstat, or None for an entry gone since it was listed. Mirrors, pack-engram and downloads
    rename and delete while the audit runs; one such entry used to make the whole audit UNKNOWN."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def hub_orphans(hub: Path, wanted: set[str]) -> tuple[list[Orphan], list[Orphan]]:
    """(orphans, unlisted repos). A blob is an orphan when no snapshot's link chain reaches it;
    a shared-store payload when no chain from any repo reaches it."""
    if not hub.is_dir():
        return [], []
    root = os.path.realpath(hub)
    repos = [e for e in _scandir(root) if e.is_dir(follow_symlinks=False) and e.name.split("--")[0] in REPO_KINDS
             and "--" in e.name]
    reached: set[str] = set()
    for repo in repos:
        for path in _files_under(os.path.join(repo.path, "snapshots")):
            _follow(path, reached)
    orphans = []
    for repo in repos:
        for blob in _scandir(os.path.join(repo.path, "blobs")):
            if blob.path in reached or _is_partial(blob.name):
                continue
            st = _lstat(blob.path)
            if st is None:
                continue
            detail = "no snapshot links to this blob"
            if stat.S_ISLNK(st.st_mode):
                try:
                    detail += f" (a link to {os.readlink(blob.path)})"
                except (FileNotFoundError, OSError):
                    pass  # replaced since the lstat; still a name no snapshot reaches
            orphans.append(Orphan(blob.path, "blob", st.st_size, detail))
    for bucket in _scandir(os.path.join(root, "blobs")):
        if not bucket.is_dir(follow_symlinks=False):
            continue
        for payload in _scandir(bucket.path):
            if payload.path in reached or payload.name.endswith(".refs") or _is_partial(payload.name):
                continue
            st = _lstat(payload.path)
            if st is not None:
                orphans.append(Orphan(payload.path, "shared-blob", st.st_size,
                                      "no repo blob that a snapshot uses links to this shared-store payload"))
    unlisted = [Orphan(repo.path, "unlisted-repo", _bytes_under(repo.path), "repo is not in this node's models")
                for repo in repos if repo.name not in wanted]
    return orphans, unlisted


def _follow(path: str, reached: set[str]) -> None:
    for _ in range(MAX_HOPS + 1):
        reached.add(path)
        try:
            target = os.readlink(path)
        except OSError:  # a regular file (EINVAL) or a dangling hop: the chain ends here
            return
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(path), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _files_under(path: str):
    for here, _dirs, files in os.walk(path):
        for name in files:
            yield os.path.join(here, name)
        for name in _dirs:
            if os.path.islink(os.path.join(here, name)):
                yield os.path.join(here, name)


def _bytes_under(path: str) -> int:
    total = 0
    for here, _dirs, files in os.walk(path):
        for name in files:
            st = _lstat(os.path.join(here, name))
            if st is not None and stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _is_partial(name: str) -> bool:
    return is_temp_name(name) or name.endswith((".partial", ".incomplete"))


def shard_orphans(engram_dir: Path, manifest: Manifest, specs: list) -> list[Orphan]:
    """Shards of another TP size, or of a layer the manifest's model does not have, each counted
    with its receipt. Shards of other ranks at the manifest's TP size are not orphans: a node may
    hold its peers' ranks on purpose (one 8-GPU node serving all of TP=8)."""
    from stager.engram.shard_format import parse_shard_name

    layers = {spec.layer for spec in specs}
    orphans = []
    for entry in _scandir(str(engram_dir)):
        parsed = parse_shard_name(entry.name)
        if parsed is None or not entry.is_file(follow_symlinks=False):
            continue
        layer, _rank, world = parsed
        if manifest.engram is None:
            why = "the manifest has no [engram] table"
        elif world != manifest.engram.world:
            why = f"TP{world} shard; the manifest's engram.world is {manifest.engram.world}"
        elif layers and layer not in layers:
            why = f"layer {layer} is not among the Engram layers staged for {manifest.engram.model} {sorted(layers)}"
        else:
            continue
        st = _lstat(entry.path)
        if st is None:
            continue
        receipt = Path(entry.path).with_suffix(".json")
        orphans.append(Orphan(entry.path, "shard", st.st_size + (_size_of(receipt) or 0), why))
    return orphans


# ---------------------------------------------------------------- live writers


def guarding_locks(path: str, hub: str, engram_dir: str | None) -> list[Path]:
    """The locks whose holder may be writing the temp file `path`: the mirror's for anything under
    the node hub, pack-engram's under engram_dir, an archive's for a DEST at or above its directory,
    and huggingface_hub's own download lock for a `blobs/*.incomplete`."""
    locks = []
    if _inside(path, hub):
        locks.append(Path(hub) / HUB_LOCK)
        repo_blobs = os.path.dirname(path)
        if path.endswith(".incomplete") and os.path.basename(repo_blobs) == "blobs" \
                and os.path.dirname(os.path.dirname(repo_blobs)) == hub.rstrip("/"):
            repo = os.path.basename(os.path.dirname(repo_blobs))
            locks.append(Path(hub) / ".locks" / repo / (os.path.basename(path)[:-len(".incomplete")] + ".lock"))
    if engram_dir and _inside(path, engram_dir):
        locks.append(Path(engram_dir) / ENGRAM_LOCK)
    directory = Path(os.path.dirname(path))
    locks.extend(d / ARCHIVE_LOCK for d in (directory, *directory.parents))
    return locks


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def stale_temps(hub: str, engram_dir: str | None, now: float) -> tuple[list[Orphan], list[Orphan]]:
    """(interrupted, live): this tool's temp files, `*.partial` and huggingface_hub's `*.incomplete`
    untouched for STALE_SECONDS, split by whether their writer is gone.

    Gone means: none of the locks that guard the file (guarding_locks) was held when the scan
    started, nor when it ended, and the file is still there, the same inode, after both. A writer
    that ran wholly during the scan has renamed or removed its temp files by then. When the lock
    table cannot tell, the file counts as live: a live copy called "interrupted" invites an `rm`
    under a running mirror, while a missed leftover only waits for the next audit."""
    hub = os.path.normpath(hub)
    engram_dir = os.path.normpath(engram_dir) if engram_dir else None
    before = LockTable.read()
    candidates: dict[str, tuple[os.stat_result, float]] = {}  # by path: engram_dir may lie in the hub
    for root in [hub] + ([engram_dir] if engram_dir else []):
        for here, _dirs, files in os.walk(root):
            for name in files:
                if not _is_partial(name):
                    continue
                path = os.path.join(here, name)
                st = _lstat(path)
                if st is not None and now - st.st_mtime > STALE_SECONDS:
                    candidates[path] = (st, now - st.st_mtime)
    after = LockTable.read()
    states: dict[Path, str | None] = {}  # lock -> why its writer may be live, None when free
    interrupted, live = [], []
    for path, (st, age) in sorted(candidates.items()):
        locks = guarding_locks(path, hub, engram_dir)
        for lock in locks:
            if lock not in states:
                states[lock] = _liveness(lock, before, after)
        why = next((states[lock] for lock in locks if states[lock]), None)
        again = _lstat(path)
        if again is None or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
            continue  # renamed into place or swept since the scan: it was live
        if why:
            live.append(Orphan(path, "temp", st.st_size, why))
        else:
            interrupted.append(Orphan(path, "temp", st.st_size, f"interrupted write, untouched for {age / 3600:.1f} h"))
    return interrupted, live


def _liveness(lock: Path, *tables: LockTable) -> str | None:
    """Why a writer under `lock` may be live (held in either table, or a table that cannot tell)."""
    for table in tables:
        state, pid = table.state(lock)
        if state == "held":
            return f"being written: pid {pid} holds {lock}"
    if any(table.state(lock)[0] == "unsure" for table in tables):
        return f"may be being written: cannot tell from {PROC_LOCKS} whether {lock} is held"
    return None


# ---------------------------------------------------------------- the audit


def audit_node(manifest: Manifest, node: str, report: AuditReport) -> None:
    """Fill `report`. Each part that fails makes the report UNKNOWN and names why; the rest still runs."""
    config = manifest.node(node)
    report.reserve = config.reserve
    report.pending_warn_after = manifest.nas.pending_warn_after
    roots = [config.hub] + ([config.engram_dir] if config.engram_dir else [])

    def guarded(what: str, step):
        try:
            return step()
        except StageError as exc:
            report.unknown.append(f"{what}: {exc.message}")
        except OSError as exc:
            report.unknown.append(f"{what}: cannot read {exc.filename or ''}: {exc.strerror or exc}")
        return None

    report.needs.extend(guarded("weights still needed", lambda: model_needs(manifest, node, report)) or [])
    needs, specs = guarded("Engram shards still needed", lambda: engram_needs(manifest, node)) or ([], [])
    report.needs.extend(needs)
    report.filesystems = guarded("free space", lambda: filesystems(roots, report.needs, config.reserve)) or []
    orphans, report.unlisted = guarded(
        "orphans in the hub", lambda: hub_orphans(Path(config.hub), {repo_dir_name(m) for m in config.models})) or ([], [])
    if config.engram_dir:
        orphans += guarded("orphan shards", lambda: shard_orphans(Path(config.engram_dir), manifest, specs)) or []
    temps, report.live_temps = guarded(
        "stale temp files", lambda: stale_temps(config.hub, config.engram_dir, time.time())) or ([], [])
    orphans += temps
    report.orphans = sorted(orphans, key=lambda o: (o.kind, o.path))


def run_audit(manifest_path: str | None, node: str, prom: str | None = None) -> AuditReport:
    """Never raises for what it finds: a bad manifest or an unreadable path is an UNKNOWN report,
    so cron and the textfile collector still get a status."""
    started = time.monotonic()
    report = AuditReport(node)
    try:
        manifest = load_manifest(manifest_path)
        manifest.node(node)
    except StageError as exc:
        report.unknown.append(exc.message)
    else:
        audit_node(manifest, node, report)
    report.seconds = time.monotonic() - started
    report.finished_at = time.time()
    if prom:
        try:
            text = prom_text(report, last_success=None if report.succeeded else previous_success(Path(prom), node))
            # atomic_write_bytes: an O_EXCL|O_NOFOLLOW temp file renamed over the name, so a link
            # planted at the textfile's name (or at its temp's) is replaced or refused, never followed.
            atomic_write_bytes(Path(prom), text.encode("utf-8", "backslashreplace"))
            report.prom = str(prom)
        except StageError as exc:
            report.unknown.append(f"cannot write {prom}: {exc.message}")
        except OSError as exc:  # the textfile directory's owner and mode, and the user that needs access
            report.unknown.append(f"cannot write {prom}: {describe_os_error(exc)}")
    return report


# ---------------------------------------------------------------- node_exporter textfile

# Metric names follow Prometheus's naming guide: base units as suffixes (`_bytes`, `_seconds`,
# `_timestamp_seconds` for Unix times), `_info` for a constant 1 that carries labels, and `_total`
# only for counters (the textfile has none: each run replaces it). Checked by
# tests/test_audit.py with prometheus_client's parser and `promtool check metrics`.
LAST_SUCCESS = "stage_last_success_timestamp_seconds"
TEXTFILE_LIMIT = 1 << 20  # our textfile is a few KiB; more is not ours


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    # Values from the disk are shown escaped first: the format needs UTF-8, and a name may not be.
    return "{" + ",".join(f'{key}="{escape(shown(value))}"' for key, value in labels.items()) + "}"


def previous_success(prom: Path, node: str) -> float | None:
    """The last success the textfile already carries, so that an UNKNOWN run keeps it (and the
    staleness alert keeps counting) instead of dropping the series. The textfile directory may be
    writable by node_exporter's group: the file is opened without following a link, without
    blocking on a FIFO, and read only if it is a regular file of a plausible size."""
    try:
        text = read_regular(prom, TEXTFILE_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    prefix = f"{LAST_SUCCESS}{_labels(command='audit', node=node)} "
    for line in text.splitlines():
        if line.startswith(prefix):
            try:
                return float(line[len(prefix):])
            except ValueError:
                return None
    return None


def prom_text(report: AuditReport, last_success: float | None = None) -> str:
    """Gauges in base units. Orphans are summed per kind (a label per file would let a directory
    of temp files explode the series count); the largest reclaimable items are listed by path.
    `last_success` is carried over from the previous textfile when this run is UNKNOWN."""
    node = report.node
    out: list[str] = []

    def gauge(name: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        out.extend(f"{name}{_labels(**labels)} {value}" for labels, value in samples)

    gauge("stage_build_info", "The stager version that wrote this file; always 1.",
          [({"node": node, "version": __version__}, 1)])
    if report.succeeded:
        last_success = round(report.finished_at, 3)
    if last_success is not None:
        gauge(LAST_SUCCESS, "Unix time a command last finished with an answer (audit: OK, WARNING or CRITICAL).",
              [({"command": "audit", "node": node}, last_success)])
    gauge("stage_audit_ok", "1 when the staging disk-space audit is OK, else 0.",
          [({"node": node}, int(report.status == OK))])
    gauge("stage_audit_status", "Nagios status of the audit: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.",
          [({"node": node}, report.status)])
    gauge("stage_audit_timestamp_seconds", "Unix time the audit finished.", [({"node": node}, round(report.finished_at, 3))])
    gauge("stage_audit_duration_seconds", "How long the audit took.", [({"node": node}, round(report.seconds, 3))])
    gauge("stage_reserve_bytes", "Free space that must remain after staging (nodes.X.reserve).",
          [({"node": node}, report.reserve)])
    for metric, help_text, attr in (
            ("stage_filesystem_free_bytes", "Free bytes for an unprivileged writer.", "free"),
            ("stage_filesystem_size_bytes", "Size of the filesystem.", "total"),
            ("stage_filesystem_needed_bytes", "Bytes still to stage onto the filesystem.", "needed"),
            ("stage_filesystem_remaining_bytes", "Free bytes left once staging finishes (free - needed).", "remaining")):
        gauge(metric, help_text, [({"node": node, "path": fs.mount}, getattr(fs, attr)) for fs in report.filesystems])
    gauge("stage_needed_bytes", "Bytes still to stage for a model under a node path (hub: weights, engram_dir: shards).",
          [({"node": node, "model": n.model, "path": n.root}, n.bytes) for n in report.needs])
    gauge("stage_orphan_bytes", "Bytes held by orphans of a kind (blob, shared-blob, shard, temp).",
          [({"node": node, "kind": kind}, sum(o.bytes for o in report.orphans if o.kind == kind)) for kind in ORPHAN_KINDS])
    gauge("stage_orphan_files", "Number of orphans of a kind.",
          [({"node": node, "kind": kind}, sum(1 for o in report.orphans if o.kind == kind)) for kind in ORPHAN_KINDS])
    gauge("stage_pending_idle_seconds", "Seconds a NAS download of the revision a model's ref names has shown no "
          "progress, while the node stays on the revision it serves.",
          [({"node": node, "model": p.repo_id, "revision": p.revision}, p.idle_seconds) for p in report.pending])
    gauge("stage_reclaimable_bytes", f"The {TOP_RECLAIMABLE} largest reclaimable items.",
          [({"node": node, "path": o.path, "kind": o.kind}, o.bytes) for o in report.reclaimable])
    return "\n".join(out) + "\n"


def details(report: AuditReport) -> list[str]:
    """Human-readable lines for stderr; the status line itself goes to stdout. One line each:
    every name from the disk or the manifest is escaped."""
    lines = []
    for fs in report.filesystems:
        lines.append(f"{shown(fs.mount)}: free {format_size(fs.free)} of {format_size(fs.total)}, "
                     f"needs {format_size(fs.needed)}, reserve {format_size(fs.reserve)} "
                     f"[{STATUS_NAMES[fs.status]}] ({', '.join(shown(r) for r in fs.roots)})")
    for need in report.needs:
        lines.append(f"  needs {format_size(need.bytes)} in {need.files} files: {shown(need.model)} "
                     f"({need.kind}, {shown(need.root)})")
    for orphan in report.orphans:
        lines.append(f"  orphan {orphan.kind:<12} {format_size(orphan.bytes):>11}  {shown(orphan.path)}: "
                     f"{shown(orphan.detail)}")
    for temp in report.live_temps:
        lines.append(f"  live temp    {format_size(temp.bytes):>11}  {shown(temp.path)}: {shown(temp.detail)}")
    if report.reclaimable:
        lines.append("largest reclaimable:")
        lines.extend(f"  {format_size(o.bytes):>11}  {shown(o.path)} ({o.kind})" for o in report.reclaimable)
    for problem in report.problems:
        lines.append(f"  {problem.kind:<16} {shown(problem.path)}: {shown(problem.detail)}")
    for item in report.pending:
        lines.append(f"  {'pending':<16} {report.pending_why(item)}")
    return lines


def _perf_label(mount: str) -> str:
    """A mount point as part of a perfdata label: no `=`, `|` or `'` (the plugin guidelines allow
    `''` for a quote, which some graphers mishandle), and on one line."""
    return shown(mount).replace("=", "_").replace("|", "_").replace("'", "_")
