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
from stager.base import hints, identity
from stager.housekeeping import reclaim
from stager.base.atomic import atomic_write_bytes
from stager.base.errors import StageError, describe_os_error
from stager.mirror.fingerprint import Verdict
from stager.mirror.hub import Pending, Problem, format_duration, repo_dir_name
from stager.manifest import MANIFEST_ENV, Manifest, default_in_use, load_manifest
from stager.mirror.pipeline import node_job, walk
from stager.mirror.plan import LocalState, final_files, make_plan
from stager.base.small_files import read_regular
from stager.base.text import printable
from stager.base.units import format_size

PRUNE_JOURNAL = ".locks/stage-journal.jsonl"  # the node's journal; huggingface_hub's scanner skips .locks/

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = ("OK", "WARNING", "CRITICAL", "UNKNOWN")
TOP_RECLAIMABLE = 10
ORPHAN_KINDS = reclaim.ORPHAN_KINDS
ARCHIVE_PLACEHOLDER = "ARCHIVE_DIR"  # where the operator keeps old shards: the archive host's mount


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


@dataclass
class AuditReport:
    node: str
    reserve: int = 0
    filesystems: list[Filesystem] = field(default_factory=list)
    needs: list[Need] = field(default_factory=list)
    plan: reclaim.Plan = field(default_factory=lambda: reclaim.Plan(()))  # what `stage prune` would remove
    snapshots: list = field(default_factory=list)  # the NAS walk: which revisions the manifest wants
    pruned_total: int = 0  # bytes `stage prune` has removed from the node, over all runs (its journal)
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
    def orphans(self) -> list[reclaim.Item]:
        return sorted((i for i in self.plan.items if i.kind in ORPHAN_KINDS), key=lambda o: (o.kind, o.path))

    @property
    def live_temps(self) -> tuple[reclaim.Kept, ...]:
        return self.plan.live_temps

    @property
    def reclaimable(self) -> list[reclaim.Item]:
        return sorted(self.plan.items, key=lambda o: (-o.bytes, o.path))[:TOP_RECLAIMABLE]

    def prune_command(self) -> str | None:
        """The `stage prune` that removes what the audit lists (the same rule, run under the lock)."""
        return hints.command("prune", "--node", self.node) if self.plan.items else None

    def archive_command(self) -> str | None:
        """Shards are derived data (pack-engram rebuilds them); archiving keeps them instead."""
        shards = [i.path for i in self.plan.items if i.kind == "shard"]
        return hints.command("archive", *shards, ARCHIVE_PLACEHOLDER) if shards else None

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
            total = self.plan.bytes
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
            "reclaimable_bytes": self.plan.bytes,
            "reclaim": [o.to_json() for o in self.plan.items],
            "in_use": [u.to_json() for u in self.plan.in_use],
            "kept": [k.to_json() for k in self.plan.kept],
            "prune_command": self.prune_command(),
            "archive_command": self.archive_command(),
            "pruned_bytes_total": self.pruned_total,
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
    report.snapshots = snapshots
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
    path = Path(identity.resolved(path))
    while path.parent != path and os.stat(path.parent).st_dev == dev:
        path = path.parent
    return str(path)


# ---------------------------------------------------------------- the audit


def audit_node(manifest: Manifest, node: str, report: AuditReport, *, only: tuple[str, ...] = (),
               holder: int | None = None) -> None:
    """Fill `report`. Each part that fails makes the report UNKNOWN and names why; the rest still runs.
    `only` and `holder` are stage prune's: the kinds it was asked for, and itself as the holder of
    the writer locks (reclaim.stale_temps)."""
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
    report.plan = guarded("what could be reclaimed", lambda: reclaim_plan(manifest, node, report, specs, only=only,
                                                                             holder=holder)) \
        or reclaim.Plan(())
    report.pruned_total = guarded("the prune journal", lambda: pruned_total(Path(config.hub))) or 0


def reclaim_plan(manifest: Manifest, node: str, report: AuditReport, specs: list | None, *,
                 only: tuple[str, ...] = (), holder: int | None = None) -> reclaim.Plan:
    """The one reclaim rule (reclaim.make_plan) over what this audit found: the revisions its NAS
    walk and the node's refs say are wanted, and the Engram layers it expects."""
    config = manifest.node(node)
    models = [(m, manifest.models[m].revision) for m in config.models]
    wanted = reclaim.wanted_from(report.snapshots, models, config.hub)
    engram = manifest.engram
    return reclaim.make_plan(
        config.hub, config.engram_dir, wanted, {repo_dir_name(m) for m in config.models},
        world=engram.world if engram else None, layers={spec.layer for spec in specs or ()},
        shards_why=None if engram else "the manifest has no [engram] table", now=time.time(), only=only,
        holder=holder)


def pruned_total(hub: Path) -> int:
    """The counter `stage_pruned_bytes_total`: the running total the node's journal carries in
    its last committed prune batch (a journal lives as long as the hub, across reboots and runs)."""
    from stager.mirror.records import journal_tail

    committed, _pending = journal_tail(hub / PRUNE_JOURNAL)
    return int((committed or {}).get("pruned_bytes_total") or 0)


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
    default = default_in_use()
    if default is not None:  # no --manifest, no $STAGE_MANIFEST: say which file the answer is about
        report.unknown = [m if str(default) in m else f"{m} (manifest: {default}, the default: no --manifest or "
                          f"${MANIFEST_ENV})" for m in report.unknown]
    return report


# ---------------------------------------------------------------- node_exporter textfile

# Metric names follow Prometheus's naming guide: base units as suffixes (`_bytes`, `_seconds`,
# `_timestamp_seconds` for Unix times), `_info` for a constant 1 that carries labels, and `_total`
# only for counters (the textfile has none: each run replaces it). Checked by
# tests/housekeeping/test_audit.py with prometheus_client's parser and `promtool check metrics`.
LAST_SUCCESS = "stage_last_success_timestamp_seconds"
PRUNED_TOTAL = "stage_pruned_bytes_total"
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
    gauge("stage_in_use_bytes", "Bytes stage prune may not remove now: reclaimable items held (open, mapped, a "
          "working or root directory, mounted).",
          [({"node": node}, sum(u.item.bytes for u in report.plan.in_use))])
    # A counter, though each run replaces the file: its value is the running total the node's
    # journal carries, so it only grows, across runs, reboots and a lost textfile.
    out.append(f"# HELP {PRUNED_TOTAL} Bytes stage prune has removed from the node, over all runs (the node's journal).")
    out.append(f"# TYPE {PRUNED_TOTAL} counter")
    out.append(f"{PRUNED_TOTAL}{_labels(node=node)} {report.pruned_total}")
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
    for item in report.plan.items:
        if item.kind not in ORPHAN_KINDS:
            lines.append(f"  {item.kind:<19} {format_size(item.bytes):>11}  {shown(item.path)}: {shown(item.detail)}")
    for temp in report.live_temps:
        lines.append(f"  live temp    {format_size(temp.bytes):>11}  {shown(temp.path)}: {shown(temp.detail)}")
    for busy in report.plan.in_use:
        lines.append(f"  in use       {format_size(busy.item.bytes):>11}  {shown(busy.item.path)} ({busy.item.kind}): "
                     f"{shown(busy.describe())}")
    if report.reclaimable:
        lines.append("largest reclaimable:")
        lines.extend(f"  {format_size(o.bytes):>11}  {shown(o.path)} ({o.kind})" for o in report.reclaimable)
    if report.prune_command():
        lines.append(f"reclaim {format_size(report.plan.bytes)} with: {shown(report.prune_command())}")
    if report.archive_command():
        lines.append("shards are derived data (pack-engram rebuilds them); to keep them instead: "
                     f"{shown(report.archive_command())}")
    for problem in report.problems:
        lines.append(f"  {problem.kind:<16} {shown(problem.path)}: {shown(problem.detail)}")
    for item in report.pending:
        lines.append(f"  {'pending':<16} {report.pending_why(item)}")
    return lines


def _perf_label(mount: str) -> str:
    """A mount point as part of a perfdata label: no `=`, `|` or `'` (the plugin guidelines allow
    `''` for a quote, which some graphers mishandle), and on one line."""
    return shown(mount).replace("=", "_").replace("|", "_").replace("'", "_")
