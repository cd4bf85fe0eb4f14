"""`stage mirror` and `stage verify` for one node: walk -> observe -> plan -> preflight -> execute -> verify."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from stager.base import hints
from stager.base.atomic import check_writable, nearest_existing
from stager.base.errors import BadInput, CannotRun
from stager.mirror.execute import execute, publish_refs
from stager.mirror.hub import ExcludeError, Pending, Problem, RepoSnapshot, require_hub, walk_for_node
from stager.base.lock import HUB_LOCK, PROC_LOCKS, LockTable, writer_lock
from stager.manifest import Manifest
from stager.mirror.observe import DigestCache, observe
from stager.mirror.plan import Plan, make_plan
from stager.sources import open_source
from stager.sources.base import Source
from stager.sources.throttle import Throttle
from stager.base.units import format_size
from stager.mirror.verify import NAS_FILE_BAD, Subset, VerifyReport, verify_snapshots

log = logging.getLogger(__name__)  # `stage -vv`: what the run decided, step by step


@dataclass(frozen=True)
class NodeJob:
    """Everything one node's run needs, resolved from the manifest and the command line."""

    node: str
    source: Source
    local_hub: Path
    reserve: int
    models: tuple[tuple[str, str, tuple[str, ...]], ...]  # (repo_id, revision, exclude)
    seed: int
    jobs: int
    # The real NAS when `source` is something else (a peer): verification compares against it if reachable.
    nas: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    manifest: str = ""  # where the job came from, for messages that name a manifest key
    never_write: tuple[str, ...] = ()  # local spellings of every source (see source_roots)
    # --bwlimit: the one rate for all the run reads from its source and from the NAS (sources/throttle.py).
    throttle: Throttle | None = None


@dataclass
class MirrorReport:
    copied_files: int = 0
    copied_bytes: int = 0
    entries: int = 0
    excluded: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False
    bytes_needed: int = 0
    source: str = ""
    verify: VerifyReport | None = None
    # --dry-run: {path, source, bytes, reason, name, blob, reference: {method, value, origin}} per copy
    would_copy: list[dict] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)  # NAS revisions still downloading; the node stays put

    def to_json(self) -> dict:
        return {
            "copied_files": self.copied_files,
            "copied_bytes": self.copied_bytes,
            "entries": self.entries,
            "excluded": self.excluded,
            "problems": [p.to_json() for p in self.problems],
            "seconds": round(self.seconds, 3),
            "dry_run": self.dry_run,
            "bytes_needed": self.bytes_needed,
            "source": self.source,
            "verify": self.verify.to_json() if self.verify else None,
            "would_copy": self.would_copy,
            "pending": [p.to_json() for p in self.pending],
        }


def node_job(manifest: Manifest, node: str, models: list[str] | None, *, jobs: int, seed: int | None,
             source_override: str | None = None, bwlimit: int | None = None) -> NodeJob:
    """`bwlimit`: bytes per second for everything the run reads from its sources, None for no limit."""
    config = manifest.node(node)
    chosen = list(models) if models else list(config.models)
    for repo_id in chosen:
        if repo_id not in config.models:
            raise BadInput(f"{manifest.path}: nodes.{node}.models: {repo_id!r} is not staged on {node}")
    url = source_override or manifest.source_for(node)
    manifest.refuse_source_overlap(f"nodes.{node}.hub", config.hub, [url])
    throttle = Throttle(bwlimit) if bwlimit else None
    source = open_source(url, manifest.nas.aliases, throttle)
    return NodeJob(
        node=node,
        source=source,
        local_hub=Path(config.hub),
        reserve=config.reserve,
        models=tuple((r, manifest.models[r].revision, tuple(manifest.models[r].exclude)) for r in chosen),
        seed=secrets.randbits(32) if seed is None else seed,
        jobs=jobs,
        nas=None if url == manifest.nas.hub else manifest.nas.hub,
        aliases=dict(manifest.nas.aliases),
        manifest=manifest.path,
        never_write=tuple(manifest.local_sources([url])),
        throttle=throttle,
    )


def walk(job: NodeJob, source: Source | None = None) -> list[RepoSnapshot]:
    """Each repo's ref is read once here; everything after stages the commit it named."""
    source = source or job.source
    require_hub(source, [repo_id for repo_id, _, _ in job.models])
    snapshots = []
    for repo_id, revision, exclude in job.models:
        try:
            snapshots.append(walk_for_node(source, job.local_hub, repo_id, revision, list(exclude)))
        except ExcludeError as exc:
            raise BadInput(f"{job.manifest}: models.\"{repo_id}\".exclude: {exc}") from None
    return snapshots


def reference_source(job: NodeJob) -> Source:
    """What verification compares against: the real NAS when the job stages from elsewhere and the
    NAS is reachable, else the job's own source. A peer's copy is only as good as the peer, so the
    NAS stays the reference whenever it answers."""
    if job.nas is None:
        return job.source
    try:
        return open_source(job.nas, job.aliases, job.throttle)
    except CannotRun:
        return job.source


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem that holds (or will hold) `path`."""
    return shutil.disk_usage(nearest_existing(path)).free


def preflight(plan: Plan, job: NodeJob) -> None:
    needed = plan.bytes_to_copy
    free = free_bytes(job.local_hub)
    if free - needed < job.reserve:
        raise CannotRun(
            f"not enough space on {job.local_hub}: need {format_size(needed)}, free {format_size(free)}, "
            f"reserve {format_size(job.reserve)} (short by {format_size(needed + job.reserve - free)})")


def mirror(job: NodeJob, *, full: bool, dry_run: bool, wait: float = 0,
           progress_factory: Callable[[int], Callable[[int], None]] | None = None,
           digests: DigestCache | None = None) -> MirrorReport:
    """`digests`: the source digests of a longer run on this node (a fleet node's agent, whose
    relay has just checked the files it landed against the NAS with the same seed), so the
    closing verify reuses them instead of sampling the NAS again. Its seed must be the job's."""
    started = time.monotonic()
    snapshots = walk(job)
    if digests is not None and digests.seed != job.seed:
        raise ValueError("the shared digests were taken with another seed than the job's")
    cache = digests or DigestCache(job.source, job.seed)
    report = MirrorReport(dry_run=dry_run, source=job.source.url)
    if dry_run:
        # The real run's plan, so that what it would write (and refuse) is counted alike.
        seen = observe(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs, sources=job.never_write)
        plan = make_plan(snapshots, seen.local, seen.meta_content, str(job.local_hub))
        _summarize(report, plan, snapshots, started)
        # What the real run would meet before its first write ends the dry run the same way.
        if _read_only(job.local_hub):
            if plan.writes:
                raise CannotRun(_read_only_message(job, plan))
        else:
            check_writable(job.local_hub)
        preflight(plan, job)
        return report
    with _hub_lock(job, wait) as (writable, waited):
        if waited:  # time has passed, and the NAS's refs may have moved: stage what they name now
            snapshots = walk(job)
        seen = observe(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs,
                       sources=job.never_write, progress_factory=progress_factory)
        plan = make_plan(snapshots, seen.local, seen.meta_content, str(job.local_hub))
        log.debug("plan: %d copies (%s), %d links, %d metadata files, %d refs, %d problems", len(plan.copies),
                  format_size(plan.bytes_to_copy), len(plan.links), len(plan.metadata), len(plan.refs),
                  len(plan.problems))
        _summarize(report, plan, snapshots, started)
        if not writable and plan.writes:
            raise CannotRun(_read_only_message(job, plan))
        preflight(plan, job)
        progress = progress_factory(plan.bytes_to_copy) if progress_factory else None
        result = execute(plan, job.source, job.local_hub, cache, full=full, jobs=job.jobs, progress=progress,
                         never_write=job.never_write)
        report.copied_files, report.copied_bytes = result.copied_files, result.copied_bytes
        report.problems.extend(result.problems)
        # The ref goes last, and only onto a snapshot that is whole on the node.
        report.problems.extend(publish_refs(plan, snapshots, job.local_hub, result.failed, job.never_write))
        reference = reference_source(job)
        if reference is job.source:  # reuses the source digests read while copying
            report.verify = verify_snapshots(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs,
                                             sources=job.never_write)
            report.verify.against = job.source.url
        else:
            report.verify = verify(job, full=full, subset=None, reference=reference)
        known = {p.path for p in report.problems}
        report.problems.extend(p for p in report.verify.problems if p.path not in known)
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _hub_lock(job: NodeJob, wait: float) -> Iterator[tuple[bool, bool]]:
    """The writer lock, yielding (True, whether it waited for another holder); on a read-only node
    hub no lock (nothing can change it there) and (False, False), so a hub with nothing to write
    still verifies."""
    if _read_only(job.local_hub):
        yield False, False
        return
    try:
        job.local_hub.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise  # the CLI names the directory, its owner and the user who needs access
    except OSError as exc:
        raise CannotRun(f"node hub {job.local_hub} cannot be created: {exc.strerror}") from None
    with writer_lock(job.local_hub / HUB_LOCK, f"local hub {job.local_hub}", wait=wait) as waited:
        log.debug("holding the writer lock %s%s", job.local_hub / HUB_LOCK, " after waiting" if waited else "")
        yield True, waited


def _read_only_message(job: NodeJob, plan: Plan) -> str:
    return f"node hub {job.local_hub} is on a read-only filesystem and {plan.writes} files need writing"


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(nearest_existing(path)).f_flag & os.ST_RDONLY)



def _summarize(report: MirrorReport, plan: Plan, snapshots: list[RepoSnapshot], started: float) -> MirrorReport:
    report.pending = [s.pending for s in snapshots if s.pending]
    report.entries = plan.entries
    report.excluded = list(plan.excluded)
    report.problems = list(plan.problems)
    report.bytes_needed = plan.bytes_to_copy
    if report.dry_run:
        report.copied_files = len(plan.copies)
        report.copied_bytes = plan.bytes_to_copy
        report.would_copy = [{"path": c.dest, "source": c.source, "bytes": c.size, "reason": c.reason,
                              "name": c.name, "blob": c.blob, "reference": asdict(c.reference)} for c in plan.copies]
    report.seconds = time.monotonic() - started
    return report


def verify(job: NodeJob, *, full: bool, subset: Subset | None, reference: Source | None = None,
           progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> VerifyReport:
    reference = reference or reference_source(job)
    writers = _writer_at_work(job.local_hub)  # before the walk: a mirror that ends during it still shows
    snapshots = walk(job, reference)
    cache = DigestCache(reference, job.seed)
    report = verify_snapshots(reference, job.local_hub, snapshots, cache, full=full, subset=subset, jobs=job.jobs,
                              sources=job.never_write, progress_factory=progress_factory)
    report.problems[:0] = [p for s in snapshots for p in s.problems]
    report.pending = [s.pending for s in snapshots if s.pending]
    report.against = reference.url
    if any(_mirror_repairs(p, job.local_hub) for p in report.problems):
        # The mirror re-checks with the check that found the damage: --full, or the same seed. A
        # repair with a fresh seed sampled other spans, called the damaged file matching, and exited
        # 0 with nothing copied while the verify that printed it kept failing.
        check = ["--full"] if full else ["--seed", job.seed]
        report.repairs.append(hints.command("mirror", "--node", job.node, *check))
    report.notes.extend(writers)
    return report


def _writer_at_work(local_hub: Path) -> list[str]:
    """A note when another process holds the hub's writer lock: a verify run beside a mirror
    (a launcher's gate while cron mirrors a moved ref) sees that mirror's work half done. The lock
    is read from the kernel's table, never taken: taking it would make the mirror refuse."""
    lock = local_hub / HUB_LOCK
    state, pid = LockTable.read().state(lock)
    if state == "unsure" and os.path.lexists(lock):
        return [f"cannot tell from {PROC_LOCKS} whether a stage mirror is writing {local_hub} now; if one is, "
                "what it has not finished shows as problems"]
    if state != "held" or pid == os.getpid():
        return []
    return [f"a stage mirror (pid {pid}) is writing {local_hub} now: what it has not finished shows as "
            "problems; verify again once it ends"]


def _mirror_repairs(problem: Problem, local_hub: Path) -> bool:
    """Whether mirroring again can fix it: a problem on the node, not one of the NAS's own (a
    NAS-side trap, an unfinished snapshot, a NAS file that fails its own name)."""
    on_node = problem.path == str(local_hub) or problem.path.startswith(str(local_hub).rstrip("/") + "/")
    return on_node and NAS_FILE_BAD not in problem.detail


def default_jobs() -> int:
    """Enough parallel files to keep an NFS pipeline full, without thrashing a local disk."""
    return max(2, min(8, (os.cpu_count() or 2) * 2))
