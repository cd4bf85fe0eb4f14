"""`stage prune --node NAME`: remove what `stage audit` lists as reclaimable, and nothing else.

The plan is the audit's own (reclaim.make_plan), made while this command holds the node hub's
writer lock (and engram_dir's, pack-engram's), so no mirror or pack-engram writes meanwhile. The
executor is the only writer; each step acts only on the file or directory the scan saw, the same
(st_dev, st_ino), size and mtime, re-checked at the moment of deletion, and every batch of items is
checked again for use (open, mapped, a working or root directory, mounted in any namespace, a
mount inside it) just before it starts. A changed item is skipped and reported.

Never across a mount: every removal goes through directory descriptors opened from the node's
root down, each on the root's own filesystem and mount (fence.Tree); a directory is renamed into
the trash only when no mount lies at or below it, and the trash is emptied by a walk that never
enters another mount. A mount found on the way leaves what lies past it in place, and says so.

Crash safety: a kill -9 at any point leaves a hub that huggingface_hub scans without warnings.
- A directory (a snapshot, a whole repo, .no_exist/<commit>) leaves the hub's view in one rename,
  into `.locks/stage-prune-trash/` (the scanner skips .locks/), and is deleted there; a re-run
  deletes what a killed run left in the trash. So no ref ever names a missing snapshot and no
  repo loses its snapshots/ directory while it still exists.
- A blob goes only after every snapshot entry that reaches it, a shared-store payload only after
  every repo blob that links to it, and then as huggingface_hub 2.4's GC does (sweep_payload).
- An Engram shard's SHA256SUMS line goes first, then its receipt, then the shard: `sha256sum -c`
  never meets a line for a missing file.

Records: every removal is written to the node's journal (`<hub>/.locks/stage-journal.jsonl`)
before it is made (one fsync per batch), and a commit record with the running total after the
batch. A re-run finds a batch without its commit and counts what is gone of it, so the total
(`stage_pruned_bytes_total`) counts each removed byte once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from stager.base import hints, identity
from stager.housekeeping import reclaim
from stager.housekeeping.fence import Beyond, Crossing, Fence, Tree, under
from stager.mirror import store_modes
from stager.base.atomic import atomic_write_bytes, ensure_real_dir, fsync_dir
from stager.base.errors import BadInput, CannotRun
from stager.mirror.hub import Problem
from stager.base.lock import ENGRAM_LOCK, HUB_LOCK, writer_lock
from stager.manifest import load_manifest
from stager.mirror.records import append_journal, drop_from_sums, journal_tail
from stager.base.small_files import read_regular
from stager.base.units import format_size, parse_size

BATCH_STEPS = 4096  # steps journaled with one fsync, and checked for use with one look at /proc
SWEEP_LOCK_WAIT = 10.0  # seconds to wait for huggingface_hub's per-payload lock, as its own GC does
RESERVE = "reserve"


@dataclass
class PruneReport:
    node: str
    dry_run: bool = False
    removed: list[reclaim.Item] = field(default_factory=list)
    in_use: list[reclaim.InUse] = field(default_factory=list)
    kept: list[reclaim.Kept] = field(default_factory=list)
    live_temps: list[reclaim.Kept] = field(default_factory=list)
    left: list[reclaim.Item] = field(default_factory=list)  # not needed: the target was met first
    freed: dict[str, int] = field(default_factory=dict)  # item path -> bytes its steps freed (a real run)
    gone: dict[str, list[str]] = field(default_factory=dict)  # item path -> the paths its steps removed (a real run)
    mounts: list[Crossing] = field(default_factory=list)  # mounts inside the node's paths: never entered
    problems: list[Problem] = field(default_factory=list)  # changed since the scan, could not be removed
    notes: list[str] = field(default_factory=list)
    until_free: str | None = None
    targets: list[dict] = field(default_factory=list)
    target_met: bool | None = None
    recovered_bytes: int = 0
    pruned_total: int = 0
    journal: str = ""
    seconds: float = 0.0

    def bytes_of(self, item: reclaim.Item) -> int:
        return self.freed.get(item.path, item.bytes)

    def paths_of(self, item: reclaim.Item) -> list[str]:
        """What removing the item takes away (a dry run: what it would), shared-store payloads included."""
        return self.gone.get(item.path, list(item.paths))

    @property
    def freed_bytes(self) -> int:
        return sum(self.bytes_of(i) for i in self.removed)

    def archive_command(self) -> str | None:
        shards = [i.path for i in self.removed if i.kind == "shard"]
        from stager.housekeeping.audit import ARCHIVE_PLACEHOLDER

        return hints.command("archive", *shards, ARCHIVE_PLACEHOLDER) if shards else None

    @property
    def exit_code(self) -> int:
        if self.problems or self.target_met is False:
            return 1
        if self.until_free is None and self.in_use:
            return 1
        return 0

    def to_json(self) -> dict:
        return {
            "node": self.node, "dry_run": self.dry_run,
            "removed": [{**i.to_json(), "bytes": self.bytes_of(i), "files": i.files, "paths": self.paths_of(i)}
                        for i in self.removed],
            "removed_files": sum(i.files for i in self.removed), "freed_bytes": self.freed_bytes,
            "in_use": [u.to_json() for u in self.in_use], "kept": [k.to_json() for k in self.kept],
            "live_temps": [k.to_json() for k in self.live_temps],
            "left": [i.to_json() for i in self.left], "mounts": [m.to_json() for m in self.mounts],
            "problems": [p.to_json() for p in self.problems], "notes": self.notes,
            "until_free": self.until_free, "targets": self.targets, "target_met": self.target_met,
            "archive_command": self.archive_command(), "recovered_bytes": self.recovered_bytes,
            "pruned_bytes_total": self.pruned_total, "journal": self.journal, "seconds": round(self.seconds, 3),
        }


# ---------------------------------------------------------------- targets


@dataclass
class _Target:
    mount: str
    probe: str  # a path on the filesystem, for statvfs
    device: int
    want_free: int
    free_before: int = 0
    free_after: int = 0
    estimated: bool = False  # free_after is free_before plus the sizes of the items (a dry run)

    def free(self) -> int:
        vfs = os.statvfs(self.probe)
        return vfs.f_bavail * vfs.f_frsize

    def met(self) -> bool:
        """Measured now: the real run stops on this."""
        return self.free() >= self.want_free

    @property
    def reached(self) -> bool:
        """The one answer the report gives: the text, `met`, `target_met` and the exit code."""
        return self.free_after >= self.want_free

    def to_json(self) -> dict:
        return {"mount": self.mount, "want_free_bytes": self.want_free, "free_before_bytes": self.free_before,
                "free_after_bytes": self.free_after, "estimated": self.estimated, "met": self.reached}


def parse_until_free(value: str | None) -> str | int | None:
    if value is None:
        return None
    if value == RESERVE:
        return RESERVE
    try:
        return parse_size(value)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"--until-free: {exc}; expected a size such as 200G, or 'reserve'") from None


def _targets(audit_report, goal: str | int) -> list[_Target]:
    """One target per filesystem of the node's paths: `goal` bytes free, or (reserve) what staging
    still needs there plus the node's reserve."""
    if goal == RESERVE and audit_report.unknown:
        raise CannotRun("--until-free reserve needs to know what staging still needs: "
                        + "; ".join(audit_report.unknown))
    targets = []
    for fs in audit_report.filesystems:
        probe = fs.roots[0]
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        want = fs.needed + fs.reserve if goal == RESERVE else int(goal)
        targets.append(_Target(fs.mount, probe, os.stat(probe).st_dev, want))
    return targets


# ---------------------------------------------------------------- the run


def check_kinds(only: tuple[str, ...]) -> None:
    bad = [k for k in only if k not in reclaim.KINDS]
    if bad:
        raise BadInput(f"--only: {', '.join(bad)} is not a kind ({', '.join(reclaim.KINDS)})")


def run_prune(manifest_path: str | None, node: str, *, dry_run: bool, until_free: str | None,
              only: tuple[str, ...]) -> PruneReport:
    from stager.housekeeping import audit

    started = time.monotonic()
    goal = parse_until_free(until_free)
    check_kinds(only)
    manifest = load_manifest(manifest_path)
    config = manifest.node(node)
    for key, dest in (("hub", config.hub), ("engram_dir", config.engram_dir)):
        if dest:
            manifest.refuse_source_overlap(f"nodes.{node}.{key}", dest)
    hub = Path(config.hub)
    engram_dir = Path(config.engram_dir) if config.engram_dir else None
    for root in (hub, engram_dir):
        if root is not None and root.is_dir():
            Fence.of(identity.resolved(root))  # exit 3, dry run or not, where /proc cannot tell a mount
    report = PruneReport(node, dry_run=dry_run, until_free=until_free, journal=str(hub / audit.PRUNE_JOURNAL))
    with contextlib.ExitStack() as locks:
        if not dry_run and hub.is_dir():
            locks.enter_context(writer_lock(hub / HUB_LOCK, f"local hub {hub}"))
            if engram_dir is not None and engram_dir.is_dir():
                locks.enter_context(writer_lock(engram_dir / ENGRAM_LOCK, f"engram_dir {engram_dir}"))
            report.recovered_bytes = _finish_killed_run(hub, Path(report.journal), report)
        seen = audit.AuditReport(node)
        audit.audit_node(manifest, node, seen, only=only, holder=None if dry_run else os.getpid())
        report.notes.extend(f"cannot tell: {why}" for why in seen.unknown)
        plan = seen.plan
        report.notes.extend(plan.notes)
        report.kept, report.live_temps = list(plan.kept), list(plan.live_temps)
        report.in_use.extend(plan.in_use)
        report.mounts = list(plan.mounts)
        targets = _targets(seen, goal) if goal is not None else []
        for target in targets:
            target.free_before = target.free_after = target.free()
        if dry_run:
            _simulate(plan, targets, report)
        else:
            _Executor(hub, engram_dir, Path(report.journal), report, targets).run(plan)
        _measure(targets, report)
        committed, _ = journal_tail(Path(report.journal))
        report.pruned_total = int((committed or {}).get("pruned_bytes_total") or 0)
    report.seconds = time.monotonic() - started
    return report


def _measure(targets: list[_Target], report: PruneReport) -> None:
    """Free space after the run: measured, or in a dry run what the items it lists would give
    back. `target_met` is decided from the same figures the text and `targets` show."""
    for target in targets:
        if report.dry_run:
            target.free_after = target.free_before + sum(i.bytes for i in report.removed if i.device == target.device)
            target.estimated = True
        else:
            target.free_after = target.free()
    report.targets = [t.to_json() for t in targets]
    if targets:
        report.target_met = all(t.reached for t in targets)


def _simulate(plan: reclaim.Plan, targets: list[_Target], report: PruneReport) -> None:
    """--dry-run: the items the real run would take, in its order; with --until-free, counted by
    their sizes against the free space now (the real run measures free space after each item)."""
    freed: dict[int, int] = {}
    for n, item in enumerate(plan.items):
        if targets and all(t.free_before + freed.get(t.device, 0) >= t.want_free for t in targets):
            report.left.extend(plan.items[n:])
            return
        target = next((t for t in targets if t.device == item.device), None)
        if targets and (target is None or target.free_before + freed.get(item.device, 0) >= target.want_free):
            report.left.append(item)
            continue
        report.removed.append(item)
        freed[item.device] = freed.get(item.device, 0) + item.bytes


def _finish_killed_run(hub: Path, journal: Path, report: PruneReport) -> int:
    """Empty the trash a killed run left, and commit the batch it journaled without a commit:
    what of it is gone was removed, and is counted once."""
    root = identity.resolved(hub)
    trash = os.path.join(root, reclaim.TRASH)
    if os.path.isdir(trash) and not os.path.islink(trash):
        tree = Tree(Fence.of(root))
        try:
            for name in sorted(os.listdir(trash)):
                _empty(tree, os.path.join(trash, name), report)
        except Beyond as exc:
            report.problems.append(Problem(trash, "mount", f"{exc}; the trash is left as it is"))
        finally:
            tree.close()
    committed, pending = journal_tail(journal)
    removals = [r for r in pending if r.get("event") == "remove"]
    if not removals:
        return 0
    gone = [r for r in removals if _gone(r)]
    recovered = sum(int(r.get("bytes") or 0) for r in gone)
    total = int((committed or {}).get("pruned_bytes_total") or 0) + recovered
    append_journal(journal, [{"event": "removed", "time": _now(), "host": socket.gethostname(), "recovered": True,
                              "removed": len(gone), "bytes": recovered, "pruned_bytes_total": total}])
    return recovered


def _empty(tree: Tree, place: str, report: PruneReport) -> None:
    """Delete what the trash holds at `place`, never entering a mount; a mount found there is left
    with the directories above it, and reported."""
    left = tree.remove_tree(place)
    if left:
        shown = tree.fence.crossing_at(left[0])
        report.problems.append(Problem(place, "mount", f"a mount at {shown.point} (showing {shown.shows}) is inside "
                                       f"it: never entered; {len(left)} mount point(s) and the directories above "
                                       "them are left in the trash for the operator"))


def _gone(record: dict) -> bool:
    try:
        st = os.lstat(record["path"])
    except (FileNotFoundError, NotADirectoryError):
        return True
    except (OSError, KeyError, TypeError):
        return False
    return (st.st_dev, st.st_ino) != (record.get("dev"), record.get("ino"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class _Changed(Exception):
    """The thing a step acts on is not what the scan saw: skip it, report it."""


class _Waits(Exception):
    """A blob or payload whose reacher stayed (in use, or changed): it waits for a later run."""


class _Journal:
    """The node's prune journal: intents before a batch, a commit with the running total after."""

    def __init__(self, path: Path):
        self.path = path
        committed, _ = journal_tail(path)
        self.total = int((committed or {}).get("pruned_bytes_total") or 0)

    def intend(self, items: list[reclaim.Item]) -> None:
        """Before a batch: one record per step that removes something, so a kill leaves a trail."""
        records = []
        for item in items:
            for step in item.steps:
                if step.action == "drop-sums":
                    continue
                records.append({"event": "remove", "time": _now(), "kind": item.kind, "item": item.path,
                                "path": step.target.path, "action": step.action, "bytes": step.bytes,
                                "files": step.files, "sha256": step.sha256, "dev": step.target.dev,
                                "ino": step.target.ino})
        if records:
            ensure_real_dir(self.path.parent)
            append_journal(self.path, records)

    def commit(self, items: int, freed: int) -> None:
        self.total += freed
        append_journal(self.path, [{"event": "removed", "time": _now(), "host": socket.gethostname(),
                                    "removed": items, "bytes": freed, "pruned_bytes_total": self.total}])


class _Executor:
    """The order of a real run: batches of items, each checked for use just before it starts and
    journaled, stopping once the --until-free targets are met."""

    def __init__(self, hub: Path, engram_dir: Path | None, journal: Path, report: PruneReport,
                 targets: list[_Target]):
        self.roots = [str(hub)] + ([str(engram_dir)] if engram_dir else [])
        self.journal = _Journal(journal)
        self.report = report
        self.targets = targets
        self.remover = _Remover(identity.resolved(hub), identity.resolved(engram_dir) if engram_dir else None, report)

    def run(self, plan: reclaim.Plan) -> None:
        items = list(plan.items)
        found = {m.point: m for m in plan.mounts}
        start = 0
        while start < len(items):
            end = _batch_end(items, start)
            # In use now? Checked again for every batch, just before it starts, against the mount
            # table as it is now too.
            free, busy = reclaim.split_in_use(items[start:end], self.roots, reclaim.mounts_inside(self.roots, found))
            self.report.in_use.extend(busy)
            if self._stop():
                self.report.left.extend(free + items[end:])
                return
            self.journal.intend(free)
            done_bytes, done_items = 0, 0
            try:
                for k, item in enumerate(free):
                    if self._stop():
                        self.report.left.extend(free[k:] + items[end:])
                        return
                    if self.targets and self._target_of(item) is None:
                        self.report.left.append(item)
                        continue
                    freed = self.remover.item(item)
                    if freed is not None:
                        self.report.removed.append(item)
                        self.report.freed[item.path] = freed
                        done_bytes += freed
                        done_items += 1
            finally:
                self.remover.flush()
                self.journal.commit(done_items, done_bytes)
            start = end

    def _stop(self) -> bool:
        """With --until-free: every filesystem has its free space (measured, not estimated)."""
        return bool(self.targets) and all(t.met() for t in self.targets)

    def _target_of(self, item: reclaim.Item) -> _Target | None:
        """The unmet target on the item's filesystem (items on a filesystem already free enough wait)."""
        return next((t for t in self.targets if t.device == item.device and not t.met()), None)


def _batch_end(items: list[reclaim.Item], start: int) -> int:
    """The end of the batch starting at `start`: at least one item, at most BATCH_STEPS steps."""
    end, steps = start, 0
    while end < len(items) and (end == start or steps + len(items[end].steps) <= BATCH_STEPS):
        steps += len(items[end].steps)
        end += 1
    return end


class _Remover:
    """One item's steps on disk, each through the descriptors of a fence.Tree of the root the path
    lies in: nothing is removed through a link swapped in on the way or across a mount."""

    def __init__(self, hub: str, engram_dir: str | None, report: PruneReport):
        self.hub = hub
        self.fences = {root: Fence.of(root) for root in [hub] + ([engram_dir] if engram_dir else [])
                       if os.path.isdir(root)}
        self.report = report
        self.trees: dict[str, Tree] = {}
        self.dirty: set[str] = set()  # directories with unlinks not yet fsynced

    def item(self, item: reclaim.Item) -> int | None:
        """Carry out the item's steps in order; None when its first step found it changed (nothing
        was removed). A later step that finds its file changed is skipped alone."""
        freed, gone = 0, []
        try:
            for index, step in enumerate(item.steps):
                try:
                    freed += self._step(step)
                    gone.extend(step.paths)
                except _Waits as exc:
                    self.report.notes.append(f"{step.target.path}: {exc}; it goes with a later run")
                    continue
                except (_Changed, Beyond, OSError) as exc:
                    self.report.problems.append(_problem(step, item, exc))
                    if index == 0 or step.action == "drop-sums":
                        return None
        finally:
            for tree in self.trees.values():
                tree.close()
        self.report.gone[item.path] = gone
        return freed

    def _tree(self, path: str) -> Tree:
        root = max((r for r in self.fences if under(path, r)), key=len, default=None)
        if root is None:
            raise _Changed(f"it no longer lies in the node's paths {sorted(self.fences)}")
        if root not in self.trees:
            self.trees[root] = Tree(self.fences[root])
        return self.trees[root]

    def _step(self, step: reclaim.Step) -> int:
        target = step.target
        staying = next((p for p in step.after if os.path.lexists(p)), None)
        if staying is not None:
            raise _Waits(f"still reached through {staying}, which stays")
        tree = self._tree(target.path)
        self._still(tree, target)
        if step.action != "unlink":
            self.flush()  # what this step relies on being gone is gone on disk too
        if step.action == "drop-sums":
            drop_from_sums(Path(step.sums), {os.path.normpath(target.path)})
            return 0
        if step.action == "unlink":
            tree.unlink(target.path)
            self.dirty.add(os.path.dirname(target.path))
            return step.bytes
        if step.action == "trash":
            self._trash(tree, target)
            return step.bytes
        if step.action in ("sweep", "refs"):
            freed = sweep_payload(Path(target.path), Path(self.hub), tree, target, may_delete=step.action == "sweep")
            if step.action == "sweep" and not freed:
                raise _Waits("a repo blob links to it again")
            return freed
        raise ValueError(step.action)

    @staticmethod
    def _still(tree: Tree, seen: reclaim.Seen) -> None:
        """The path is still what the scan saw, reached from the root through no link and no mount."""
        try:
            st = tree.lstat(seen.path)
        except (FileNotFoundError, NotADirectoryError):
            raise _Changed("gone since the scan") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Changed("a directory on its way is now a link") from None
            raise
        if (st.st_dev, st.st_ino) != (seen.dev, seen.ino):
            raise _Changed("replaced since the scan")
        if stat.S_ISREG(st.st_mode) and st.st_size != seen.size:
            raise _Changed(f"size changed since the scan ({seen.size} -> {st.st_size})")
        if st.st_mtime_ns != seen.mtime_ns:
            raise _Changed("modified since the scan")

    def flush(self) -> None:
        """One fsync per directory of a run of unlinks, before anything that relies on them."""
        for directory in sorted(self.dirty):
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(Path(directory))
        self.dirty.clear()

    def _trash(self, tree: Tree, seen: reclaim.Seen) -> None:
        """Rename the directory out of the hub's view in one step, then delete it there. Never
        with a mount at or below it: a rename carries a mount along, and the deletion would then
        empty whatever it shows."""
        inside = [c for point, c in tree.fence.mounts_below().items() if under(point, seen.path)]
        if inside:
            raise Beyond(inside[0])
        tree.dir(seen.path)  # the directory itself is on the root's mount (Beyond otherwise)
        trash = os.path.join(self.hub, reclaim.TRASH)
        trash_tree = self._tree(trash)
        trash_tree.ensure_dir(os.path.dirname(trash))
        trash_tree.ensure_dir(trash)
        place = f"{seen.ino}-{os.path.basename(seen.path)}"
        try:
            tree.rename(seen.path, trash, place)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EBUSY):
                raise _Changed("a mount point (or on another filesystem): left for the operator") from None
            raise
        tree.fsync(os.path.dirname(seen.path))
        _empty(trash_tree, os.path.join(trash, place), self.report)


def _problem(step: reclaim.Step, item: reclaim.Item, exc: Exception) -> Problem:
    if isinstance(exc, _Changed):
        return Problem(step.target.path, "changed", f"{exc}; left in place ({item.kind} {item.path})")
    if isinstance(exc, Beyond):
        return Problem(step.target.path, "mount", f"{exc}; left in place ({item.kind} {item.path})")
    return Problem(step.target.path, "local_error", f"cannot remove: {getattr(exc, 'strerror', None) or exc}; "
                                                    "left in place")


# ---------------------------------------------------------------- the shared store


def sweep_payload(payload: Path, hub: Path, tree: Tree, seen: reclaim.Seen | None = None, *,
                  may_delete: bool = True) -> int:
    """Remove one shared-store payload the way huggingface_hub 2.4's GC (sweep_shared_blob) does:
    under its per-payload lock (`<hash>.lock`, the flock huggingface_hub's downloads take before
    they link to a payload), read `<hash>.refs`; the references that count are its lines that are
    repo blobs still linking to this payload. If any is left, the manifest is rewritten with
    exactly those and the payload stays; if none, the payload goes, then its manifest. A manifest
    that cannot be read keeps the payload. `may_delete=False` only rewrites the manifest (a payload a
    kept snapshot reaches: a manifest that misses a referrer must not make it go). The lock, the
    payload and the manifest are reached through the bucket's descriptor in `tree`. Returns the
    bytes freed."""
    bucket = tree.dir(str(payload.parent))
    lock = payload.name + ".lock"
    refs = payload.with_name(payload.name + ".refs")
    # Non-blocking: opening a FIFO at the lock's name for writing would wait for a reader for ever.
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666, dir_fd=bucket)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Changed(f"{lock} is not a regular file")
        deadline = time.monotonic() + SWEEP_LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _Changed(f"a download holds {lock}") from None
                time.sleep(0.05)
        if seen is not None:
            st = os.stat(payload.name, dir_fd=bucket, follow_symlinks=False)
            if (st.st_dev, st.st_ino, st.st_size) != (seen.dev, seen.ino, seen.size):
                raise _Changed("replaced since the scan")
        try:
            lines = read_regular(refs, 16 << 20).decode("utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeError) as exc:
            raise _Changed(f"{refs.name} cannot be read ({exc}); kept, as huggingface_hub's GC keeps it") from None
        still = sorted({line for line in lines if _links_to(hub, line, payload)})
        if still:
            text = "".join(f"{line}\n" for line in still).encode()
            if text != "".join(f"{line}\n" for line in lines).encode():
                atomic_write_bytes(refs, text, chmod=store_modes.file_mode(hub, f"{reclaim.STORE}/x/{refs.name}"))
            return 0
        if not may_delete:
            return 0
        size = os.stat(payload.name, dir_fd=bucket, follow_symlinks=False).st_size
        os.unlink(payload.name, dir_fd=bucket)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(refs.name, dir_fd=bucket)
        os.fsync(bucket)
        return size
    finally:
        os.close(fd)


def _links_to(hub: Path, line: str, payload: Path) -> bool:
    """A `.refs` line that names a repo blob (`<repo dir>/blobs/<name>`) which is a link to `payload`."""
    parts = line.split("/")
    if len(parts) != 3 or parts[1] != "blobs" or "--" not in parts[0] or ".." in parts or line.startswith("/"):
        return False
    blob = hub / line
    try:
        target = os.readlink(blob)
    except OSError:
        return False
    return os.path.normpath(os.path.join(blob.parent, target)) == os.path.normpath(payload)


def text_lines(report: PruneReport) -> list[str]:
    """The human report: one line per item, then one `+ PATH` line per further path it removes
    (its trees json, blobs, shared-store payloads and their manifests), one line per item in use
    naming every holder, per mount inside the node's paths, per problem, per target, a summary,
    and the archive hint."""
    from stager.housekeeping.audit import shown

    verb = "would remove" if report.dry_run else "removed"
    lines = []
    for item in report.removed:
        lines.append(f"  {verb} {item.kind:<13} {format_size(report.bytes_of(item)):>11}  {shown(item.path)}")
        lines.extend(f"      + {shown(path)}" for path in report.paths_of(item) if path != item.path)
    for busy in report.in_use:
        lines.append(f"  in_use {busy.item.kind:<13} {format_size(busy.item.bytes):>11}  {shown(busy.item.path)}: "
                     f"{shown(busy.describe())}")
    for mount in report.mounts:
        lines.append(f"  mount  {shown(mount.point)}: shows {shown(mount.shows)}; never entered")
    for problem in report.problems:
        lines.append(f"  {problem.kind:<16} {shown(problem.path)}: {shown(problem.detail)}")
    for target in report.targets:
        lines.append(f"  {shown(target['mount'])}: free {format_size(target['free_before_bytes'])} -> "
                     f"{format_size(target['free_after_bytes'])}, target {format_size(target['want_free_bytes'])}"
                     f" ({'met' if target['met'] else 'NOT met'})")
    summary = (f"{report.node}: {verb} {len(report.removed)} items ({format_size(report.freed_bytes)}), "
               f"{len(report.in_use)} in use, {len(report.problems)} problems")
    if report.target_met is False:
        summary += ("; the target cannot be met without removing what is in use or wanted "
                    f"(freed {format_size(report.freed_bytes)})")
    lines.append(summary)
    if report.archive_command():
        lines.append("note: shards are derived data (pack-engram rebuilds them); to keep them instead run "
                     f"{shown(report.archive_command())} before pruning")
    lines.extend(f"note: {shown(note)}" for note in report.notes)
    return lines

