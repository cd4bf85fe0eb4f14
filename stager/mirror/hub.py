"""Hugging Face hub cache layout, and the read-only walk of one repo revision on a source.

Layout (huggingface_hub 1.x/2.x):
    <hub>/models--<owner>--<name>/refs/<ref>               40-hex commit, no newline (see read_ref)
    <hub>/models--<owner>--<name>/snapshots/<commit>/<path> link -> ../../blobs/<etag>
    <hub>/models--<owner>--<name>/blobs/<etag>              file, or link into the shared store
    <hub>/models--<owner>--<name>/trees/<commit>.json       file listing (sizes, sha256)
    <hub>/models--<owner>--<name>/.no_exist/<commit>/<path> empty marker of a missing file
    <hub>/blobs/.huggingface-shared-blobs                   "1\n": marks the shared store
    <hub>/blobs/<2 hex>/<xet hash>[.refs]                    shared payload and its referrers

The walk follows every link hop to the final regular file, and records the hops
as hub-relative paths. Following only the first hop is the bug this tool exists
to avoid: a copied `../../blobs/<etag>` link whose blob is itself a link into
the NAS-level shared store leaves the weights resolving through the NAS.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import posixpath
import re
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from stager.base.atomic import is_temp_name
from stager.base.errors import CannotRun
from stager.base.small_files import read_regular_head
from stager.base.text import printable
from stager.sources.base import Source, Stat

SHARED_STORE = "blobs"
SHARED_MARKER = "blobs/.huggingface-shared-blobs"
# `\Z`, not `$`: `$` also matches before a trailing newline, so "<sha>\n" passed for a commit.
COMMIT = re.compile(r"^[0-9a-f]{40}\Z")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
GIT_SHA1_NAME = re.compile(r"^[0-9a-f]{40}$")
# huggingface_hub names payloads blobs/<2 hex>/<64-hex xet hash>; any file two levels under the
# hub-level blobs/ is treated as the shared store, so an older or foreign naming still stays shared.
_SHARED_PAYLOAD = re.compile(r"^blobs/[^/]+/[^/]+$")
# The kernel gives up after 40 links (ELOOP); so do we, which also bounds hostile chains.
MAX_HOPS = 40
_LINK_ERRNOS = {errno.ELOOP: "loop", errno.ENOTDIR: "dangling"}
_HUB_DIR = re.compile(r"^((models|datasets|spaces)--.+|blobs)$")


def repo_dir_name(repo_id: str, repo_type: str = "model") -> str:
    return f"{repo_type}s--{repo_id.replace('/', '--')}"


def is_shared_payload(rel: str) -> bool:
    return bool(_SHARED_PAYLOAD.match(rel)) and not rel.endswith(".refs")


@dataclass(frozen=True)
class Problem:
    """Something that could not be staged or verified. `path` names the offending file; a problem
    with one snapshot entry also carries the names people know it by (`snapshot_name`)."""

    path: str
    kind: str  # escape | dangling | loop | not_a_file | unreadable | missing | mismatch | remote | ...
    detail: str
    name: str | None = None  # acme/Flash-3bpw@c24c615/model-00003-of-00017.safetensors
    blob: str | None = None  # the repo blob the entry links to (its sha256 or git sha1), when known

    def to_json(self) -> dict:
        named = {"name": self.name, "blob": self.blob} if self.name else {}
        return {"path": self.path, "kind": self.kind, "detail": self.detail, **named}

    def about(self, name: str, blob: str | None) -> "Problem":
        """This problem, named after the snapshot entry it concerns."""
        return replace(self, name=name, blob=blob)


def snapshot_name(repo_id: str, snapshot_rel: str) -> str:
    """How people name a snapshot file: repo id, 7-hex short commit, path in the snapshot
    (`acme/Flash-3bpw@c24c615/model-00003-of-00017.safetensors`), from its hub-relative path
    `models--acme--Flash-3bpw/snapshots/<commit>/<path>`. A hub path tells nothing by itself:
    its blob's name is a hash, and the same blob serves several repos."""
    _repo_dir, _snapshots, commit, path = snapshot_rel.split("/", 3)
    return f"{repo_id}@{commit[:7]}/{path}"


@dataclass(frozen=True)
class Entry:
    """One file of a snapshot, resolved on the source to its final regular file.

    `chain` holds the hub-relative path of every hop: the snapshot entry first,
    the final regular file last (a real file in a snapshot has a chain of one).
    """

    repo_id: str
    path: str  # snapshot-relative, e.g. "page15/model-00002.safetensors"
    chain: tuple[str, ...]
    size: int
    mtime_ns: int

    @property
    def rel(self) -> str:
        return self.chain[0]

    @property
    def final(self) -> str:
        return self.chain[-1]

    @property
    def name(self) -> str:
        """The name people know it by (snapshot_name)."""
        return snapshot_name(self.repo_id, self.rel)

    @property
    def etag(self) -> str | None:
        """The repo blob name this entry resolves through: its sha256 (LFS) or git sha1."""
        for hop in self.chain[1:]:
            parent, name = posixpath.split(hop)
            if parent.endswith("/blobs") and parent.count("/") == 1:
                return name
        return None


@dataclass(frozen=True)
class RepoSnapshot:
    """What one repo revision looks like on the source: the result of the walk."""

    repo_id: str
    revision: str
    repo_dir: str
    commit: str | None
    entries: tuple[Entry, ...] = ()
    excluded: tuple[str, ...] = ()
    metadata: tuple[str, ...] = ()  # refs, trees/<commit>.json, .no_exist markers: copied byte-exact
    problems: tuple[Problem, ...] = ()
    tree_listing: dict = field(default_factory=dict, compare=False, hash=False)
    # Set when this is the node's own revision, walked because the NAS's ref names one still downloading.
    pending: "Pending | None" = None

    @property
    def snapshot_dir(self) -> str:
        return f"{self.repo_dir}/snapshots/{self.commit}"


@dataclass(frozen=True)
class Pending:
    """A revision the NAS's ref names that the NAS has not finished downloading (a walk of it
    found it `incomplete`), while the node serves a whole earlier one and stays on it.

    `idle_seconds` is how long the NAS has shown no progress on that download: now minus the
    newest mtime among the NAS's ref, trees/<commit>.json, snapshots/<commit>/ (and its entries),
    the repo's blobs/ directory and its `.incomplete` files. A running download rewrites its
    `.incomplete` file and adds blobs and links, so the figure stays small; a download killed for
    good leaves it growing, and the audit warns once it exceeds nas.pending_warn_after. Read from
    the NAS itself, every node (and every audit) sees the same figure without keeping a record."""

    repo_id: str
    revision: str  # the manifest's branch or tag, e.g. "main"
    commit: str  # what the NAS's ref names, not whole on the NAS yet
    serving: str  # the commit the node stays on (serving_commit)
    detail: str  # why the NAS's snapshot is not whole
    idle_seconds: int

    def to_json(self) -> dict:
        return {"model": self.repo_id, "revision": self.revision, "pending_commit": self.commit,
                "serving_commit": self.serving, "idle_seconds": self.idle_seconds, "detail": self.detail}

    def describe(self) -> str:
        return (f"{self.repo_id} {self.revision}: the NAS names {self.commit}, still incomplete there "
                f"(no progress for {format_duration(self.idle_seconds)}); the node stays on {self.serving}")


def format_duration(seconds: int) -> str:
    """"45s", "12m", "3h05m", "2d04h": how long a download has been idle, at a glance."""
    if seconds < 60:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def is_excluded(path: str, patterns: list[str]) -> bool:
    """huggingface_hub's ignore_patterns rule (fnmatch, a trailing "/" means the whole folder),
    so that offline snapshot_download(ignore_patterns=exclude) agrees with what was staged."""
    for pattern in patterns:
        if pattern.endswith("/"):
            pattern += "*"
        if fnmatch.fnmatch(path, pattern):
            return True
    return False


class LinkError(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def resolve_chain(source: Source, rel: str) -> tuple[tuple[str, ...], Stat]:
    """Follow `rel` link by link to a regular file inside the hub.

    Returns the hops (hub-relative) and the final file's Stat. Raises LinkError
    with kind escape (leaves the hub, after alias mapping), dangling, loop
    (a cycle or more than MAX_HOPS links) or not_a_file.
    """
    hops = [rel]
    current = rel
    seen = {rel}
    while True:
        try:
            st = source.lstat(current)
        except OSError as exc:
            # A directory part that loops (a -> a/a) or is a file: the kernel's ELOOP and ENOTDIR.
            if exc.errno not in _LINK_ERRNOS:
                raise
            raise LinkError(_LINK_ERRNOS[exc.errno], f"{source.display(current)}: {exc.strerror}") from None
        if st is None:
            raise LinkError("dangling", f"link target {source.display(current)} does not exist")
        if st.kind == "file":
            return tuple(hops), st
        if st.kind != "link":
            raise LinkError("not_a_file", f"{source.display(current)} is a {'directory' if st.kind == 'dir' else 'special file'}, not a regular file")
        if len(hops) > MAX_HOPS:
            raise LinkError("loop", f"more than {MAX_HOPS} link hops")
        target = source.readlink(current)
        if os.path.isabs(target):
            if ".." in target.split("/"):
                raise LinkError("escape", f"absolute link to {target} climbs with '..'; only plain paths are followed")
            nxt = source.absolute_to_rel(target)
            if nxt is None:
                raise LinkError("escape", f"absolute link to {target} is outside the NAS hub and its aliases")
            parent, name = posixpath.split(nxt)
        else:
            joined = posixpath.normpath(posixpath.join(posixpath.dirname(current), target))
            if joined == ".." or joined.startswith("../"):
                raise LinkError("escape", f"relative link {target!r} leaves the NAS hub")
            # The directory part goes to canonical_dir unnormalized: like the kernel, it resolves a
            # link before the ".." after it. Collapsing "d/.." first staged the link's own directory's
            # file where a client opening the NAS path reads the one beside d's target.
            parent = posixpath.join(posixpath.dirname(current), posixpath.dirname(target))
            name = posixpath.basename(target)
        if name in ("", ".", ".."):
            raise LinkError("not_a_file", f"link target {target!r} names a directory, not a regular file")
        real_parent = source.canonical_dir(parent)
        if real_parent is None:
            raise LinkError("escape", f"link target {target!r} resolves outside the NAS hub through a directory link")
        nxt = posixpath.join(real_parent, name) if real_parent else name
        if nxt in seen:
            raise LinkError("loop", f"link cycle through {source.display(nxt)}")
        seen.add(nxt)
        hops.append(nxt)
        current = nxt


REF_LIMIT = 128  # a ref is 40 bytes and a line end; reading more only shows what else it holds


class BadRef(ValueError):
    """A ref whose text is not a commit (read_ref's rule); the message names the ref's path."""


def read_ref(raw: bytes, where: str) -> str:
    """The one rule for a ref's text, on the NAS and on the node: 40 lowercase hex digits,
    optionally followed by exactly one line end (`\n` or `\r\n`), which is dropped. Anything
    else (spaces, two line ends, upper case, a short or long hash) raises BadRef naming `where`.

    huggingface_hub writes a ref bare and reads it as it is (no strip): a NAS ref someone wrote
    with `echo` or a Windows editor resolved here, was compared raw when published, and never
    reached the node, while mirror and verify both said 0. The node's ref is always written bare."""
    text = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
    commit = text.decode("ascii", errors="replace")
    if not COMMIT.fullmatch(commit):
        shown = printable(raw[:48].decode("ascii", errors="replace")) + ("..." if len(raw) > 48 else "")
        raise BadRef(f"{where} holds {shown!r}, not a 40-hex commit")
    return commit


def nas_ref(source: Source, rel: str) -> str:
    """The commit the source's ref at hub-relative `rel` names. Raises OSError, or BadRef."""
    return read_ref(source.read_small(rel, REF_LIMIT), source.display(rel))


def node_ref(path: Path) -> str:
    """The commit the node's ref at `path` names. Raises OSError (never blocks on a FIFO planted
    at the name: small_files), or BadRef."""
    return read_ref(read_regular_head(path, REF_LIMIT, follow=True), str(path))


def resolve_revision(source: Source, repo_dir: str, revision: str) -> str | None:
    """A 40-hex commit is taken as is; a branch or tag is read from refs/ (read_ref's rule).
    None when there is no such ref; BadRef when there is one that names no commit."""
    if COMMIT.fullmatch(revision):
        return revision
    ref = f"{repo_dir}/refs/{revision}"
    st = source.lstat(ref)
    if st is None or st.kind != "file" or _moved_by_dir_link(source, posixpath.dirname(ref)):
        return None
    return nas_ref(source, ref)


def serving_commit(local_hub: Path, repo_id: str, revision: str) -> str | None:
    """The commit a node hub serves for `revision` of `repo_id`, or None when it serves none.

    The one rule for "which local revision is the node's": mirror and verify stay on it while the
    NAS's ref names a revision the NAS has not finished downloading, the audit reports it, and
    prune never removes it. It is what an offline huggingface_hub client loads: a 40-hex
    revision is itself, a branch or tag is the commit the node's own refs/<revision> names; in
    both cases only if that snapshot directory is a real directory in the node hub. Refs are
    written last and only onto a snapshot whole on the node (execute.publish_refs), so the
    commit named here was whole when it was staged; whether it still is, verify says."""
    repo = Path(local_hub) / repo_dir_name(repo_id)
    if COMMIT.fullmatch(revision):
        commit = revision
    else:
        try:
            commit = node_ref(repo / "refs" / revision)
        except (OSError, BadRef):
            return None
    try:
        is_dir = stat.S_ISDIR(os.lstat(repo / "snapshots" / commit).st_mode)
    except OSError:
        return None
    return commit if is_dir else None


def walk_for_node(source: Source, local_hub: Path, repo_id: str, revision: str, exclude: list[str],
                  now: float | None = None) -> RepoSnapshot:
    """The revision a node must hold: what the NAS's ref names (walk_repo), unless the NAS has not
    finished downloading it and the node serves a whole earlier revision (serving_commit). Then
    that earlier revision is walked on the NAS instead, and its snapshot carries a `Pending`.

    A NAS mid-download is not the node's fault: reporting it as a problem (exit 1) had the Slurm
    prolog drain every node of the cluster while each was whole on the revision it serves. A node
    that serves no whole revision still gets the `incomplete` problem. Once the NAS's download is
    whole, the next walk names it, and the mirror stages it and moves the node's ref."""
    snap = walk_repo(source, repo_id, revision, exclude)
    unfinished = next((p for p in snap.problems if p.kind == "incomplete"), None)
    if unfinished is None or COMMIT.fullmatch(revision):
        return snap
    serving = serving_commit(local_hub, repo_id, revision)
    if serving is None or serving == snap.commit:
        return snap
    # The .incomplete blobs in the repo belong to the pending download, not to the node's revision.
    older = walk_repo(source, repo_id, serving, exclude, in_flight_elsewhere=True)
    if any(p.kind in ("incomplete", "missing") for p in older.problems):
        return snap
    idle = max(0, int((time.time() if now is None else now) - _download_activity_ns(source, snap) / 1e9))
    # The node's own ref stays on `serving`, and is still checked (and rewritten bare) as staged
    # metadata: a ref with a line end was taken as serving, while clients could not load it.
    ref = f"{older.repo_dir}/refs/{revision}"
    metadata = older.metadata if ref in older.metadata else (ref, *older.metadata)
    return replace(older, revision=revision, metadata=metadata,
                   pending=Pending(repo_id, revision, snap.commit, serving, unfinished.detail, idle))


def _download_activity_ns(source: Source, snap: RepoSnapshot) -> int:
    """The newest mtime of anything the NAS's download of `snap.commit` writes (see Pending)."""
    repo_dir, commit = snap.repo_dir, snap.commit
    places = [f"{repo_dir}/refs/{snap.revision}", f"{repo_dir}/trees/{commit}.json", f"{repo_dir}/blobs",
              f"{repo_dir}/snapshots/{commit}", *(f"{repo_dir}/{rel}" for rel in _downloads_in_flight(source, repo_dir))]
    with_entries = places + [f"{repo_dir}/snapshots/{commit}/{path}" for path in _entries_of(source, snap)]
    newest = 0
    for rel in with_entries:
        try:
            st = source.lstat(rel)
        except OSError:
            continue
        if st is not None:
            newest = max(newest, st.mtime_ns)
    return newest


def _entries_of(source: Source, snap: RepoSnapshot) -> list[str]:
    snap_dir = f"{snap.repo_dir}/snapshots/{snap.commit}"
    try:
        if (source.lstat(snap_dir) or Stat("none", 0, 0, 0)).kind != "dir":
            return []
    except OSError:
        return []
    return [path for path, _kind in _walk_snapshot(source, snap_dir, [])]


def walk_repo(source: Source, repo_id: str, revision: str, exclude: list[str], *,
              in_flight_elsewhere: bool = False) -> RepoSnapshot:
    """Read one repo revision from the source. Never raises for a bad entry: problems are collected.

    `in_flight_elsewhere`: the repo's `.incomplete` blobs are known to belong to another revision
    (walk_for_node's pending one), so they do not make this one's snapshot incomplete."""
    repo_dir = repo_dir_name(repo_id)
    base = RepoSnapshot(repo_id, revision, repo_dir, None)
    st = source.lstat(repo_dir)
    if st is None or st.kind != "dir":
        return _with(base, problems=(Problem(source.display(repo_dir), "missing", f"{repo_id} is not in the NAS hub"),))
    try:
        commit = resolve_revision(source, repo_dir, revision)
    except BadRef as exc:
        # Not "no snapshot": the ref is there and says nothing a client could load.
        return _with(base, problems=(Problem(source.display(f"{repo_dir}/refs/{revision}"), "bad_ref",
                                             f"{exc}; huggingface_hub cannot resolve {revision!r} either: "
                                             "write the commit alone into it on the NAS"),))
    snap_dir = f"{repo_dir}/snapshots/{commit}"
    if commit is None or (source.lstat(snap_dir) or Stat("none", 0, 0, 0)).kind != "dir":
        in_flight = [] if commit is None or in_flight_elsewhere else _downloads_in_flight(source, repo_dir)
        listing = _tree_listing(source, repo_dir, commit) if commit is not None else {}
        if in_flight or listing:
            # huggingface_hub writes the ref (and the trees listing) before the first file, and
            # makes the snapshot directory when it links that file: killed during the first
            # download, it leaves a ref to a snapshot that does not exist yet.
            absent = missing_from_snapshot(set(), listing, set(), exclude)
            return _with(base, commit=commit, problems=(Problem(
                source.display(snap_dir), "incomplete", incomplete_detail(commit, absent, in_flight)),))
        return _with(base, problems=(Problem(source.display(f"{repo_dir}/refs/{revision}"), "missing",
                                             f"revision {revision!r} of {repo_id} has no snapshot on the NAS"),))
    moved = _moved_by_dir_link(source, snap_dir)
    if moved:
        return _with(base, commit=commit, problems=(moved,))
    entries: list[Entry] = []
    excluded: list[str] = []
    problems: list[Problem] = []
    seen: list[str] = []
    for path, kind in _walk_snapshot(source, snap_dir, problems):
        seen.append(path)
        if is_excluded(path, exclude):
            excluded.append(path)
            continue
        rel = f"{snap_dir}/{path}"
        try:
            if kind == "other":
                raise LinkError("not_a_file", f"{source.display(rel)} is a special file, not a regular file")
            chain, final = resolve_chain(source, rel)
        except LinkError as exc:  # the chain is broken: no blob to name
            problems.append(Problem(source.display(rel), exc.kind, exc.detail, snapshot_name(repo_id, rel)))
            continue
        except OSError as exc:
            problems.append(Problem(source.display(rel), "unreadable", exc.strerror or str(exc),
                                    snapshot_name(repo_id, rel)))
            continue
        entries.append(Entry(repo_id, path, chain, final.size, final.mtime_ns))
    _refuse_senseless_exclude(repo_id, snap_dir, entries, excluded, exclude, len(seen))
    listing = _tree_listing(source, repo_dir, commit)
    index_names = _index_names(source, snap_dir, seen)
    absent = missing_from_snapshot(set(seen), listing, index_names, exclude)
    in_flight = [] if in_flight_elsewhere else _downloads_in_flight(source, repo_dir)
    if absent or (in_flight and not listing and not index_names):
        # huggingface_hub writes the ref and trees/<commit>.json before the files: following such a
        # ref moved a serving node onto a snapshot it could not load. hf_hub_download, file by
        # file, writes no listing at all; then a download in flight is the only sign, and is
        # taken as one. Nothing of such a snapshot is staged.
        problem = Problem(source.display(snap_dir), "incomplete", incomplete_detail(commit, absent, in_flight))
        return _with(base, commit=commit, excluded=tuple(excluded), problems=(*problems, problem))
    metadata = _metadata(source, repo_dir, commit, problems)
    return RepoSnapshot(repo_id, revision, repo_dir, commit, tuple(entries), tuple(excluded),
                        tuple(metadata), tuple(problems), listing)


class ExcludeError(ValueError):
    """`exclude` patterns that cannot mean what they say (the manifest is at fault, exit 2)."""


def _refuse_senseless_exclude(repo_id: str, snap_dir: str, entries: list[Entry], excluded: list[str],
                              exclude: list[str], walked: int) -> None:
    """Rule: an excluded entry stays on the NAS, so no staged entry may need it.

    An entry linking through an excluded one was once staged anyway while the report still
    called it excluded; patterns that leave nothing staged once produced a ref and a trees json
    without a snapshot, which huggingface_hub's scanner calls a corrupted cache."""
    if excluded and len(excluded) == walked:
        raise ExcludeError(f"{exclude} excludes every entry of {repo_id}'s snapshot; "
                           f"remove {repo_id} from the node's models instead")
    gone = {f"{snap_dir}/{path}": path for path in excluded}
    for entry in entries:
        for hop in entry.chain[1:]:
            if hop in gone:
                raise ExcludeError(f"{entry.path} links through {gone[hop]}, which {exclude} excludes; "
                                   "exclude both or neither")


def missing_from_snapshot(present: set[str], listing: dict, index_names: set[str], exclude: list[str]) -> list[str]:
    """Files the commit is known to hold but the snapshot lacks (excluded ones are not wanted).

    Known from trees/<commit>.json and from every safetensors index in the snapshot; both are
    written by huggingface_hub before the files themselves. Rule shared by mirror and verify."""
    wanted = set(listing) | index_names
    return sorted(name for name in wanted if name not in present and not is_excluded(name, exclude))


def incomplete_detail(commit: str, absent: list[str], in_flight: list[str]) -> str:
    cause = (f"a download still running or killed on the NAS ({', '.join(in_flight[:3])} present)" if in_flight
             else "a download still running or killed on the NAS, or files deleted from it")
    if not absent:
        return (f"snapshot {commit} has no file listing (trees json or safetensors index) while {cause}; "
                "the node stays on the revision it has. If that download is dead, delete its .incomplete file")
    shown = ", ".join(absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
    return (f"snapshot {commit} lacks {len(absent)} listed file{'s' if len(absent) != 1 else ''} ({shown}): "
            f"{cause}; the node stays on the revision it has. If the NAS holds part of this repo on purpose, "
            "add the absent files to the model's exclude")


def _index_names(source: Source, snap_dir: str, paths: list[str]) -> set[str]:
    """Weight files named by the snapshot's safetensors indexes (paths relative to the snapshot)."""
    names: set[str] = set()
    for path in paths:
        if not path.endswith(".safetensors.index.json"):
            continue
        try:
            data = json.loads(source.read_small(f"{snap_dir}/{path}", 64 * 1024 * 1024))
        except (OSError, ValueError):
            continue
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        folder = posixpath.dirname(path)
        if isinstance(weight_map, dict):
            names.update(posixpath.normpath(posixpath.join(folder, v)) for v in weight_map.values()
                         if isinstance(v, str) and v and not v.startswith("/") and ".." not in v.split("/"))
    return names


def _downloads_in_flight(source: Source, repo_dir: str) -> list[str]:
    try:
        return [f"blobs/{n}" for n in source.listdir(f"{repo_dir}/blobs") if n.endswith(".incomplete")]
    except OSError:
        return []


def require_hub(source: Source, repo_ids: list[str]) -> None:
    """Exit 3 when the source is not a hub at all: an unmounted NFS mount point is an empty
    directory, and reading it as "no such model" (exit 1) hid that the NAS was gone.

    Empty, or none of the wanted repos and no `<type>s--*` directory or `blobs/`: not a hub."""
    try:
        names = source.listdir("")
    except OSError as exc:
        raise CannotRun(f"NAS hub {source.display('')} cannot be listed: {exc.strerror or exc}") from None
    if not names:
        raise CannotRun(f"NAS hub {source.display('')} is empty: not mounted?")
    if any(repo_dir_name(r) in names for r in repo_ids):
        return
    if not any(_HUB_DIR.match(name) for name in names):
        raise CannotRun(f"NAS hub {source.display('')} holds no hub cache (no models--*, datasets--* or blobs/): "
                        "not mounted, or the wrong path?")


def _moved_by_dir_link(source: Source, rel_dir: str) -> Problem | None:
    """A problem if a directory on the way to `rel_dir` is a link: lstat follows such a link, so a
    `snapshots/` or `trees/` linked out of the hub would otherwise have outside files staged."""
    real = source.canonical_dir(rel_dir)
    if real == rel_dir:
        return None
    if real is None:
        return Problem(source.display(rel_dir), "escape", "reached through a directory link that leaves the NAS hub")
    return Problem(source.display(rel_dir), "dir_link",
                   f"reached through a directory link to {source.display(real)}; only the hub's own layout is staged")


def _with(base: RepoSnapshot, **changes) -> RepoSnapshot:
    return replace(base, **changes)


def _walk_snapshot(source: Source, snap_dir: str, problems: list[Problem], prefix: str = ""):
    """Yield (snapshot-relative path, kind) for every non-directory under the snapshot."""
    here = f"{snap_dir}/{prefix}".rstrip("/")
    try:
        names = source.listdir(here)
    except OSError as exc:
        problems.append(Problem(source.display(here), "unreadable", exc.strerror or str(exc)))
        return
    for name in names:
        if _is_junk(name):
            continue
        path = f"{prefix}{name}"
        st = source.lstat(f"{snap_dir}/{path}")
        if st is None:
            continue
        if st.kind == "dir":
            yield from _walk_snapshot(source, snap_dir, problems, f"{path}/")
        else:
            yield path, st.kind


def _is_junk(name: str) -> bool:
    """Lock files, interrupted downloads and temp files are never staged."""
    return name.endswith((".incomplete", ".lock")) or is_temp_name(name)


def _metadata(source: Source, repo_dir: str, commit: str, problems: list[Problem]) -> list[str]:
    """refs pointing at the staged commit, its trees/<commit>.json and its .no_exist markers.

    Refs to other commits are left behind: huggingface_hub's scanner reports a
    ref to a snapshot that is not in the cache as a corrupted repo.
    """
    found: list[str] = []
    for rel in _files_under(source, f"{repo_dir}/refs", problems):
        try:
            names = nas_ref(source, rel)
        except BadRef:
            continue  # names no commit: left behind like a ref to another commit (the walked ref is checked)
        if names == commit:
            found.append(rel)
    if _trees_in_place(source, repo_dir, problems):
        rel = f"{repo_dir}/trees/{commit}.json"
        st = source.lstat(rel)
        if st is not None and st.kind == "file":
            found.append(rel)
    found.extend(_files_under(source, f"{repo_dir}/.no_exist/{commit}", problems))
    return found


def _trees_in_place(source: Source, repo_dir: str, problems: list[Problem] | None = None) -> bool:
    if source.lstat(f"{repo_dir}/trees") is None:
        return False
    moved = _moved_by_dir_link(source, f"{repo_dir}/trees")
    if moved and problems is not None:
        problems.append(moved)
    return moved is None


def _files_under(source: Source, rel_dir: str, problems: list[Problem]) -> list[str]:
    st = source.lstat(rel_dir)
    if st is None:
        return []
    moved = _moved_by_dir_link(source, rel_dir)
    if moved:
        problems.append(moved)
    if moved or st.kind != "dir":
        return []
    out = []
    for name in source.listdir(rel_dir):
        if _is_junk(name):
            continue
        rel = f"{rel_dir}/{name}"
        child = source.lstat(rel)
        if child is None:
            continue
        if child.kind == "dir":
            out.extend(_files_under(source, rel, problems))
        elif child.kind == "file":
            out.append(rel)
    return out


def _tree_listing(source: Source, repo_dir: str, commit: str) -> dict:
    """`trees/<commit>.json` files map, used as a reference hash for real files."""
    rel = f"{repo_dir}/trees/{commit}.json"
    st = source.lstat(rel)
    if st is None or st.kind != "file" or st.size > 64 * 1024 * 1024 or not _trees_in_place(source, repo_dir):
        return {}
    try:
        data = json.loads(source.read_small(rel, st.size))
        files = data.get("files") if isinstance(data, dict) else None
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError):
        return {}
