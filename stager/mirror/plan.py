"""From a walked source and an observed local hub to a list of actions. Pure: no I/O here.

Local layout rule: every hop of a source chain that lies in the entry's own repo
directory or in the hub-level shared store keeps its hub-relative path locally.
Each kept hop becomes a *relative* symlink to the next kept hop, and the last one
a regular file holding the source's bytes. Hops elsewhere (another repo) are
skipped, so no staged path can resolve through the NAS or outside the local hub.
"""

from __future__ import annotations

import posixpath
from collections import defaultdict
from dataclasses import dataclass

from stager.mirror.fingerprint import Reference, Verdict, reference_for
from stager.base.text import known_as
from stager.mirror.hub import Entry, Problem, RepoSnapshot, is_shared_payload


@dataclass(frozen=True)
class CopyFile:
    """Copy the source file `source` to the local path `dest` (both hub-relative)."""

    dest: str
    source: str
    size: int
    mtime_ns: int
    reference: Reference
    reason: str  # "missing", "size differs", "sampled fingerprint differs", "wrong hardlink", ...
    name: str = ""  # the snapshot name of the first entry that ends in it (hub.snapshot_name)
    blob: str | None = None  # that entry's repo blob

    @property
    def known_as(self) -> str:
        return known_as(self.name, self.blob)


@dataclass(frozen=True)
class MakeLink:
    dest: str
    target: str  # relative link text
    reason: str


@dataclass(frozen=True)
class CopyMeta:
    """Small metadata file written byte-exact: refs, trees/<commit>.json, .no_exist, store manifests."""

    dest: str
    content: bytes


@dataclass(frozen=True)
class LocalState:
    """What the observer saw at one local path. `verdict` compares a local file with its source."""

    kind: str  # "file", "link", "dir", "other", "absent"
    size: int = 0
    inode: tuple[int, int] | None = None
    link_target: str | None = None
    verdict: Verdict | None = None
    content: bytes | None = None  # metadata files only


@dataclass(frozen=True)
class Plan:
    copies: tuple[CopyFile, ...]
    links: tuple[MakeLink, ...]
    metadata: tuple[CopyMeta, ...]
    refs: tuple[CopyMeta, ...]  # written last: a ref makes the snapshot visible to clients
    kept_files: int
    entries: int
    excluded: tuple[str, ...]
    problems: tuple[Problem, ...]

    @property
    def bytes_to_copy(self) -> int:
        return sum(copy.size for copy in self.copies)

    @property
    def writes(self) -> int:
        return len(self.copies) + len(self.links) + len(self.metadata) + len(self.refs)


def kept_hops(entry: Entry, repo_dir: str) -> tuple[str, ...]:
    """The hops of `entry` that exist locally (see module doc). Always starts with the entry itself."""
    kept = [hop for hop in entry.chain if hop.startswith(repo_dir + "/") or is_shared_payload(hop)]
    return tuple(kept)


def link_text(from_rel: str, to_rel: str) -> str:
    return posixpath.relpath(to_rel, posixpath.dirname(from_rel))


def final_files(snapshots: list[RepoSnapshot]) -> dict[str, tuple[Entry, Reference]]:
    """Local final path -> (an entry that ends there, its reference). First entry wins."""
    finals: dict[str, tuple[Entry, Reference]] = {}
    for snap in snapshots:
        for entry in snap.entries:
            dest = kept_hops(entry, snap.repo_dir)[-1]
            finals.setdefault(dest, (entry, reference_for(entry, snap.tree_listing)))
    return finals


def wanted_links(snapshots: list[RepoSnapshot]) -> dict[str, str]:
    links: dict[str, str] = {}
    for snap in snapshots:
        for entry in snap.entries:
            hops = kept_hops(entry, snap.repo_dir)
            for here, nxt in zip(hops, hops[1:]):
                links[here] = link_text(here, nxt)
    return links


def wanted_metadata(snapshots: list[RepoSnapshot], meta_content: dict[str, bytes]) -> tuple[list[CopyMeta], list[CopyMeta]]:
    """(metadata, refs): every metadata file with the bytes the observer read for it."""
    metadata: list[CopyMeta] = []
    refs: list[CopyMeta] = []
    for rel, content in sorted(meta_content.items()):
        is_ref = any(rel.startswith(f"{snap.repo_dir}/refs/") for snap in snapshots)
        (refs if is_ref else metadata).append(CopyMeta(rel, content))
    return metadata, refs


def make_plan(snapshots: list[RepoSnapshot], local: dict[str, LocalState], meta_content: dict[str, bytes],
              local_hub: str = "") -> Plan:
    """Decide what to copy, link, rewrite or leave alone.

    A local file is kept only when the comparison rule says MATCH. Files that share
    an inode while expecting different content (a size-only hardlink dedup once
    bound the wrong weight this way) are all re-copied, which splits the link.
    A directory standing where a file or link belongs is reported with its local path and
    left alone: it is the operator's, and renaming over it failed as an internal error.
    """
    finals = final_files(snapshots)
    wrong_links = _wrongly_shared(finals, local)
    copies: list[CopyFile] = []
    problems: list[Problem] = [p for s in snapshots for p in s.problems]
    kept = 0
    for dest, (entry, reference) in sorted(finals.items()):
        state = local.get(dest, LocalState("absent"))
        if state.kind == "dir":
            problems.append(_directory_in_the_way(local_hub, dest, "the file"))
            continue
        reason = _copy_reason(state, entry.size, dest in wrong_links)
        if reason is None:
            kept += 1
            continue
        copies.append(CopyFile(dest, entry.final, entry.size, entry.mtime_ns, reference, reason, entry.name,
                               entry.etag))
    links = []
    for dest, target in sorted(wanted_links(snapshots).items()):
        state = local.get(dest, LocalState("absent"))
        if state.kind == "dir":
            problems.append(_directory_in_the_way(local_hub, dest, "the link"))
        elif state.link_target != target:
            links.append(MakeLink(dest, target, "missing" if state.kind == "absent" else "points elsewhere"))
    metadata, refs = wanted_metadata(snapshots, meta_content)
    metadata = [m for m in metadata if local.get(m.dest, LocalState("absent")).content != m.content]
    refs = [r for r in refs if local.get(r.dest, LocalState("absent")).content != r.content]
    return Plan(
        copies=tuple(copies),
        links=tuple(links),
        metadata=tuple(metadata),
        refs=tuple(refs),
        kept_files=kept,
        entries=sum(len(s.entries) for s in snapshots),
        excluded=tuple(path for s in snapshots for path in s.excluded),
        problems=tuple(problems),
    )


def _directory_in_the_way(local_hub: str, dest: str, what: str) -> Problem:
    return Problem(posixpath.join(local_hub, dest), "local_conflict",
                   f"a directory stands where {what} belongs; remove it and run the mirror again")


def _copy_reason(state: LocalState, size: int, wrongly_shared: bool) -> str | None:
    if state.kind == "absent":
        return "missing"
    if state.kind != "file":
        return f"local path is a {state.kind}, not a file"
    if state.size != size:
        return "size differs"
    if wrongly_shared:
        return "hardlinked to a file with different content"
    if state.verdict is Verdict.MATCH:
        return None
    if state.verdict is Verdict.DIFFER:
        return "fingerprint differs from the source"
    return "could not check the local copy"


def _wrongly_shared(finals: dict[str, tuple[Entry, Reference]], local: dict[str, LocalState]) -> set[str]:
    by_inode: dict[tuple[int, int], list[str]] = defaultdict(list)
    for dest in finals:
        state = local.get(dest)
        if state is not None and state.kind == "file" and state.inode is not None:
            by_inode[state.inode].append(dest)
    wrong: set[str] = set()
    for dests in by_inode.values():
        references = {(finals[d][1].method, finals[d][1].value) for d in dests}
        # Sharing is only sound between names proven to hold the same content.
        if len(dests) > 1 and (len(references) > 1 or any(value is None for _, value in references)):
            wrong.update(dests)
    return wrong
