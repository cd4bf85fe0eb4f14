"""The verification ladder: structure, then sizes, then content (sampled, or full).

Every staged entry must be a chain of relative links inside the local hub ending
in a regular file whose content matches the source (sampled) or the strongest
reference hash (full).  Results are typed problems; the CLI picks the exit code.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import xxhash

from stager.base import identity
from stager.mirror.fingerprint import Verdict, judge, reference_for
from stager.mirror.hub import BadRef, Entry, Pending, Problem, RepoSnapshot, read_ref
from stager.mirror.observe import META_LIMIT, DigestCache, expected_digest, local_digest
from stager.mirror.plan import kept_hops
from stager.base.small_files import read_regular
from stager.base.text import known_as
from stager.base.workers import worker_pool


log = logging.getLogger(__name__)  # `stage -v`: a line per file whose content was checked

# How a problem says the NAS's own copy is wrong (shared with the mirror): no mirror can repair it.
NAS_FILE_BAD = "the NAS file is bad and mirroring again cannot fix it; download it again on the NAS"


@dataclass(frozen=True)
class Subset:
    """`--subset N/T`: the N-th of T deterministic buckets. N is taken modulo T, so 0-based
    and 1-based cron expressions both cover every bucket in T runs."""

    index: int
    total: int

    @classmethod
    def parse(cls, text: str) -> "Subset":
        try:
            index, total = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"--subset expects N/T such as 3/7, got {text!r}") from None
        if total < 1 or index < 0 or index > total:
            raise ValueError(f"--subset {text}: expected 0 <= N <= T and T >= 1")
        return cls(index % total, total)

    def contains(self, blob: str) -> bool:
        return xxhash.xxh64_intdigest(blob.encode()) % self.total == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.total}"


@dataclass
class VerifyReport:
    mode: str
    seed: int | None
    checked: int = 0
    ok: int = 0
    content_checked: int = 0  # entries whose bytes were compared (all, or the subset's)
    problems: list[Problem] = field(default_factory=list)
    links_ok: int = 0
    excluded: list[str] = field(default_factory=list)
    reread: list[str] = field(default_factory=list)  # matched on the second read: flaky source
    repairs: list[str] = field(default_factory=list)  # the exact commands that fix the problems found
    subset: str | None = None
    against: str | None = None  # the source the content was compared with: the NAS, or a peer
    notes: list[str] = field(default_factory=list)  # what the operator should know to read the result
    pending: list[Pending] = field(default_factory=list)  # NAS revisions still downloading; the node stays put

    def count(self, kind: str) -> int:
        return sum(1 for p in self.problems if p.kind == kind)

    def merge(self, other: "VerifyReport") -> None:
        self.checked += other.checked
        self.ok += other.ok
        self.content_checked += other.content_checked
        self.problems.extend(other.problems)
        self.links_ok += other.links_ok
        self.excluded.extend(other.excluded)
        self.reread.extend(other.reread)
        self.repairs.extend(r for r in other.repairs if r not in self.repairs)
        self.notes.extend(other.notes)
        self.pending.extend(other.pending)

    def to_json(self) -> dict:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "content_checked": self.content_checked,
            "problems": [p.to_json() for p in self.problems],
            "mode": self.mode,
            "seed": self.seed,
            "subset": self.subset,
            "links_ok": self.links_ok,
            "dangling": self.count("dangling"),
            "remote": self.count("remote"),
            "mismatches": self.count("mismatch"),
            "missing": self.count("missing"),
            "could_not_check": self.count("could_not_check"),
            "excluded": self.excluded,
            "matched_on_reread": self.reread,
            "repair": self.repairs,
            "verified_against": self.against,
            "notes": self.notes,
            "pending": [p.to_json() for p in self.pending],
        }


def check_local_chain(local_hub: Path, entry_rel: str, realpath=identity.resolved,
                      sources: tuple[str, ...] = ()) -> tuple[str | None, Problem | None, int]:
    """Follow the staged entry's links. Returns (final hub-relative file, problem, links followed).

    The final file counts as local only if its real directory is in the node hub and in none of
    `sources` (the NAS and its aliases): a node `blobs/` linked or bind-mounted into the NAS once
    passed as "ok" and "local". `realpath` may be a memo for one pass over many entries."""
    root = realpath(local_hub)
    current = entry_rel
    links = 0
    for _ in range(41):
        path = local_hub / current
        st, target = identity.look(path)
        if st is None:
            kind = "missing" if current == entry_rel else "dangling"
            return None, Problem(str(local_hub / entry_rel), kind,
                                 "not staged" if kind == "missing" else f"link target {path} does not exist"), links
        if stat.S_ISREG(st.st_mode):
            where = _escape_from(realpath(path.parent), root, sources)
            if where:
                return None, Problem(str(local_hub / entry_rel), "remote", f"{path} {where}"), links
            return current, None, links
        if not stat.S_ISLNK(st.st_mode):
            return None, Problem(str(path), "not_a_file", "expected a regular file or a link"), links
        resolved = os.path.normpath(os.path.join(realpath(path.parent), target))
        if os.path.isabs(target) or not (resolved + "/").startswith(root + "/"):
            return None, Problem(str(local_hub / entry_rel), "remote",
                                 f"link {path} -> {target} resolves outside the local hub"), links
        current = os.path.relpath(resolved, root)
        links += 1
    return None, Problem(str(local_hub / entry_rel), "loop", "more than 40 link hops"), links


# Many entries share a few directories; each pass clears it, since links may change between runs.
_escape_from = functools.lru_cache(maxsize=4096)(identity.escape_from)


def verify_snapshots(source, local_hub: Path, snapshots: list[RepoSnapshot], cache: DigestCache, *,
                     full: bool, subset: Subset | None = None, jobs: int = 4,
                     sources: tuple[str, ...] = (),
                     progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> VerifyReport:
    """Structure (every entry, whatever the subset), then content (the subset's entries only)."""
    report = VerifyReport("full" if full else "sampled", None if full else cache.seed,
                          subset=str(subset) if subset else None)
    work: list[tuple[Entry, RepoSnapshot, str]] = []
    realpath = functools.lru_cache(maxsize=None)(identity.resolved)  # this pass only: links may change later
    _escape_from.cache_clear()
    for snap in snapshots:
        report.excluded.extend(snap.excluded)
        for entry in snap.entries:
            final, problem, links = check_local_chain(local_hub, entry.rel, realpath, sources)
            report.checked += 1
            if problem is not None:
                report.problems.append(problem.about(entry.name, entry.etag))
                continue
            report.links_ok += links
            if subset is None or subset.contains(kept_hops(entry, snap.repo_dir)[-1]):
                work.append((entry, snap, final))
            else:
                report.ok += 1  # structure checked; content is another subset's turn
        report.checked += _check_metadata(source, local_hub, snap, report)

    progress = progress_factory(sum(entry.size for entry, _, _ in work)) if progress_factory else None

    def content(item):
        entry, snap, final = item
        outcome = _check_content(local_hub, entry, snap, final, cache, full, progress if full else None)
        if progress and not full:
            progress(entry.size)
        return item, outcome

    report.content_checked += len(work)
    with worker_pool(jobs, "stage-verify", "checks") as pool:
        for (entry, _snap, _final), (problem, reread) in pool.map(content, work):
            if problem is not None:
                report.problems.append(problem.about(entry.name, entry.etag))
            else:
                report.ok += 1
                if log.isEnabledFor(logging.INFO):
                    log.info("ok %s (%s)", known_as(entry.name, entry.etag), report.mode)
            if reread:
                report.reread.append(str(local_hub / entry.rel))
    return report


def _check_content(local_hub: Path, entry: Entry, snap: RepoSnapshot, final: str, cache: DigestCache,
                   full: bool, on_bytes: Callable[[int], None] | None = None) -> tuple[Problem | None, bool]:
    path = local_hub / final
    reference = reference_for(entry, snap.tree_listing)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:  # removed since its structure was checked
        return Problem(str(local_hub / entry.rel), "missing", "not staged"), False
    if size != entry.size:
        return Problem(str(local_hub / entry.rel), "mismatch", f"size {size} != source size {entry.size}"), False
    method = reference.method if full else f"sampled:{cache.seed}"
    mine = cache.written(path, method) or local_digest(path, reference, cache.seed, full, on_bytes)
    verdict = judge(mine, expected_digest(cache, entry.final, reference, full))
    if verdict is Verdict.DIFFER:
        # A mismatch is read again from both sides before it is believed (flaky NFS reads happen).
        _drop_cache(path)
        again = judge(local_digest(path, reference, cache.seed, full),
                      expected_digest(cache, entry.final, reference, full, fresh=True))
        if again is Verdict.MATCH:
            return None, True
        if full and reference.value is not None and _source_is_bad(cache, entry, reference):
            return Problem(str(local_hub / entry.rel), "mismatch",
                           f"{reference.method} differs from the {reference.origin}, and so does the NAS copy: "
                           f"{NAS_FILE_BAD}"), False
        method = reference.method if full else "sampled xxh3-128"
        return Problem(str(local_hub / entry.rel), "mismatch",
                       f"{method} differs from the {reference.origin if full else 'source'}"), False
    if verdict is Verdict.UNCHECKED:
        return Problem(str(local_hub / entry.rel), "could_not_check",
                       "no reference hash could be read for this file"), False
    return None, False


def _source_is_bad(cache: DigestCache, entry: Entry, reference) -> bool:
    """Whether the NAS copy itself fails its own name: read only once a local mismatch is certain."""
    theirs = cache.full(entry.final, reference.method, fresh=True)
    return theirs.value is not None and theirs.value != reference.value


def _check_metadata(source, local_hub: Path, snap: RepoSnapshot, report: VerifyReport) -> int:
    """Refs must hold the commit the walk read, bare (as huggingface_hub writes and reads them);
    trees must be byte-identical to the source's."""
    checked = 0
    for rel in snap.metadata:
        if "/.no_exist/" in rel:
            continue
        checked += 1
        try:
            mine = read_regular(local_hub / rel, META_LIMIT, follow=True)
        except FileNotFoundError:
            report.problems.append(Problem(str(local_hub / rel), "missing", "metadata file not staged"))
            continue
        except OSError as exc:  # a directory, a FIFO: never waited on
            report.problems.append(Problem(str(local_hub / rel), "not_a_file", exc.strerror or str(exc)))
            continue
        is_ref = rel.startswith(f"{snap.repo_dir}/refs/")
        theirs = snap.commit.encode() if is_ref else source.read_small(rel, len(mine) + 1)
        if mine != theirs:
            detail = _ref_differs(mine, snap.commit, local_hub / rel) if is_ref else "differs from the source copy"
            report.problems.append(Problem(str(local_hub / rel), "mismatch", detail))
        else:
            report.ok += 1
    return checked


def _ref_differs(mine: bytes, commit: str, path: Path) -> str:
    """Why the node's ref is not the bare commit the walk read (hub.read_ref's rule)."""
    try:
        names = read_ref(mine, str(path))
    except BadRef as exc:
        return f"{exc}; it should name {commit}"
    if names == commit:
        # huggingface_hub reads a ref as it is: "<commit>\n" names a snapshot directory that does not exist.
        return f"names {commit} with a line end after it, which huggingface_hub cannot resolve offline"
    return f"names {names}; the node should be on {commit}"


def _drop_cache(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)  # a FIFO never blocks
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

