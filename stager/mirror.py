"""`stage mirror` and `stage verify` for one node: walk -> observe -> plan -> preflight -> execute -> verify."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stager.errors import BadInput, CannotRun
from stager.execute import execute
from stager.hub import Problem, RepoSnapshot, walk_repo
from stager.lock import writer_lock
from stager.manifest import Manifest
from stager.observe import DigestCache, observe
from stager.plan import Plan, make_plan
from stager.source import Source, open_source
from stager.units import format_size
from stager.verify import Subset, VerifyReport, verify_snapshots

LOCK_NAME = ".locks/stager.lock"  # huggingface_hub's scanner skips .locks/


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
        }


def node_job(manifest: Manifest, node: str, models: list[str] | None, *, jobs: int, seed: int | None,
             source_override: str | None = None) -> NodeJob:
    config = manifest.node(node)
    chosen = list(models) if models else list(config.models)
    for repo_id in chosen:
        if repo_id not in config.models:
            raise BadInput(f"{manifest.path}: nodes.{node}.models: {repo_id!r} is not staged on {node}")
    url = source_override or manifest.source_for(node)
    source = open_source(url, manifest.nas.aliases)
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
    )


def walk(job: NodeJob, source: Source | None = None) -> list[RepoSnapshot]:
    source = source or job.source
    return [walk_repo(source, repo_id, revision, list(exclude)) for repo_id, revision, exclude in job.models]


def reference_source(job: NodeJob) -> Source:
    """What verification compares against: the real NAS when the job stages from elsewhere and the
    NAS is reachable, else the job's own source. A peer's copy is only as good as the peer, so the
    NAS stays the reference whenever it answers."""
    if job.nas is None:
        return job.source
    try:
        return open_source(job.nas, job.aliases)
    except CannotRun:
        return job.source


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem that holds (or will hold) `path`."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def preflight(plan: Plan, job: NodeJob) -> None:
    needed = plan.bytes_to_copy
    free = free_bytes(job.local_hub)
    if free - needed < job.reserve:
        raise CannotRun(
            f"not enough space on {job.local_hub}: need {format_size(needed)}, free {format_size(free)}, "
            f"reserve {format_size(job.reserve)} (short by {format_size(needed + job.reserve - free)})")


def mirror(job: NodeJob, *, full: bool, dry_run: bool, progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> MirrorReport:
    started = time.monotonic()
    snapshots = walk(job)
    cache = DigestCache(job.source, job.seed)
    report = MirrorReport(dry_run=dry_run, source=job.source.url)
    if dry_run:
        plan = make_plan(snapshots, observe(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs).local
                         if job.local_hub.exists() else {}, {})
        return _summarize(report, plan, started)
    job.local_hub.mkdir(parents=True, exist_ok=True)
    with writer_lock(job.local_hub / LOCK_NAME, f"local hub {job.local_hub}"):
        seen = observe(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs)
        plan = make_plan(snapshots, seen.local, seen.meta_content)
        _summarize(report, plan, started)
        preflight(plan, job)
        progress = progress_factory(plan.bytes_to_copy) if progress_factory else None
        result = execute(plan, job.source, job.local_hub, cache, full=full, jobs=job.jobs, progress=progress)
        report.copied_files, report.copied_bytes = result.copied_files, result.copied_bytes
        report.problems.extend(result.problems)
        reference = reference_source(job)
        if reference is job.source:  # reuses the source digests read while copying
            report.verify = verify_snapshots(job.source, job.local_hub, snapshots, cache, full=full, jobs=job.jobs)
            report.verify.against = job.source.url
        else:
            report.verify = verify(job, full=full, subset=None, reference=reference)
        known = {p.path for p in report.problems}
        report.problems.extend(p for p in report.verify.problems if p.path not in known)
    report.seconds = time.monotonic() - started
    return report


def _summarize(report: MirrorReport, plan: Plan, started: float) -> MirrorReport:
    report.entries = plan.entries
    report.excluded = list(plan.excluded)
    report.problems = list(plan.problems)
    report.bytes_needed = plan.bytes_to_copy
    if report.dry_run:
        report.copied_files = len(plan.copies)
        report.copied_bytes = plan.bytes_to_copy
    report.seconds = time.monotonic() - started
    return report


def verify(job: NodeJob, *, full: bool, subset: Subset | None, reference: Source | None = None) -> VerifyReport:
    reference = reference or reference_source(job)
    snapshots = walk(job, reference)
    cache = DigestCache(reference, job.seed)
    report = verify_snapshots(reference, job.local_hub, snapshots, cache, full=full, subset=subset, jobs=job.jobs)
    report.problems[:0] = [p for s in snapshots for p in s.problems]
    report.against = reference.url
    if report.problems:
        report.repairs.append(f"stage mirror --node {job.node}{' --full' if full else ''}")
    return report


def default_jobs() -> int:
    """Enough parallel files to keep an NFS pipeline full, without thrashing a local disk."""
    return max(2, min(8, (os.cpu_count() or 2) * 2))
