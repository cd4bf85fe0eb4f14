"""What may be reclaimed on a node: the one rule behind `stage audit`'s reclaimable list and `stage prune`.

Trust model: the node's disk is read as it is now, every link read with readlink and every name
with lstat, never followed out of the node hub or engram_dir; the manifest (and the NAS ref it
names) says which revisions are wanted. A name that vanishes between its listing and its lstat
was moved by a writer and is left out. When in doubt an item is kept: a leaked blob waits for the
next run, a deleted one is gone.

The plan is a tuple of frozen `Item`s in the order prune carries them out, each with its `Step`s
in the order that keeps the hub whole after a kill at any point (docs/operations.md, "stage
prune"):

- `temp`: interrupted temp files (audit's live-writer rule from /proc/locks);
- `blob`: a repo blob no snapshot reaches; `shared-blob`: a shared-store payload no repo blob links to;
- `revision`: a snapshot of a listed model that the manifest does not want and no local ref names,
  with its trees json, its .no_exist markers and the blobs only unwanted snapshots reach;
- `shard`: an Engram shard of another TP size or layer, with its receipt and its SHA256SUMS line;
- `unlisted-repo`: a repo the node's models do not list, whole.

Never in the plan: a revision the manifest wants now (the NAS ref's commit, and the commit the
node's own ref names while the NAS one is pending), anything a kept snapshot reaches, anything
outside the node hub and engram_dir or beyond a mount inside them (the scan lists a directory only
on its root's own filesystem and mount: `fence.View`), and anything in use (`in_use.users`, and a
mount at, in or above what the item removes), which is listed instead. A shared-store payload goes with the last item that removes a repo blob linking to it,
and only under huggingface_hub's rule at the moment of deletion (`prune.sweep_payload`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from stager.base import identity
from stager.base.atomic import is_temp_name
from stager.mirror.hub import MAX_HOPS, SHA256_NAME
from stager.housekeeping.fence import Crossing, Entry, Fence, View, under
from stager.housekeeping.in_use import FileId, Use, users
from stager.base.lock import ARCHIVE_LOCK, ENGRAM_LOCK, HUB_LOCK, PROC_LOCKS, LockTable
from stager.mirror.records import SUMS_NAME, read_sums
from stager.base.small_files import read_regular

KINDS = ("temp", "blob", "shared-blob", "revision", "shard", "unlisted-repo")
ORPHAN_KINDS = ("blob", "shared-blob", "shard", "temp")
# The --until-free order: temps, then orphans, then old revisions and other-TP shards, then whole
# repos; oldest use first within each.
_TIER = {"temp": 0, "blob": 1, "shared-blob": 1, "revision": 2, "shard": 2, "unlisted-repo": 3}
REPO_KINDS = ("models", "datasets", "spaces")
# A temp file untouched for this long may be interrupted; whether it is, the writer locks of the
# tree it lies in decide (stale_temps, guarding_locks).
STALE_SECONDS = 3600
STORE = "blobs"
TRASH = ".locks/stage-prune-trash"  # huggingface_hub's scanner skips .locks/


@dataclass(frozen=True)
class Seen:
    """A path as the scan saw it: the executor acts on it only while it is still this."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    is_dir: bool = False

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> "Seen":
        return cls(path, st.st_dev, st.st_ino, st.st_size if stat.S_ISREG(st.st_mode) else 0, st.st_mtime_ns,
                   stat.S_ISDIR(st.st_mode))

    @property
    def id(self) -> FileId:
        return self.dev, self.ino


@dataclass(frozen=True)
class Step:
    """One removal. `action`: unlink (a file or link), trash (a directory, renamed out of the
    hub's view in one rename, then deleted), drop-sums (the item's line in `sums`), sweep (a
    shared-store payload, under huggingface_hub's rule). `bytes` is what it frees (regular files)."""

    action: str  # unlink | trash | drop-sums | sweep | refs (rewrite a kept payload's .refs)
    target: Seen
    bytes: int = 0
    sha256: str | None = None
    sums: str | None = None
    files: int = 0
    after: tuple[str, ...] = ()  # paths that must be gone first: the snapshots or repo blobs reaching it
    refs: str | None = None  # sweep: the payload's `.refs` manifest, which goes with it

    @property
    def paths(self) -> tuple[str, ...]:
        """What this step removes (a directory with everything in it)."""
        if self.action in ("unlink", "trash"):
            return (self.target.path,)
        if self.action == "sweep":
            return (self.target.path,) + ((self.refs,) if self.refs else ())
        return ()


@dataclass(frozen=True)
class Item:
    kind: str
    path: str
    bytes: int
    detail: str
    used: float  # when a process last read its files: the newest atime among them (see _use)
    steps: tuple[Step, ...] = ()
    # Files and directories it removes or reaches: open, mapped, a working or root directory, or
    # a mount's root there keeps the item.
    reaches: frozenset[FileId] = frozenset()
    device: int = 0  # the filesystem it gives space back on
    repo: str = ""  # the repo directory a revision or blob belongs to
    removes: frozenset[str] = frozenset()  # repo blobs (paths) this item takes away
    exposed_by: frozenset[FileId] = frozenset()  # directories above it a mount of which exposes it: repo, blobs/
    touches: frozenset[str] = frozenset()  # paths a mount at, in or above which keeps the item

    @property
    def files(self) -> int:
        return sum(s.files for s in self.steps)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path its steps remove, in their order (a directory with everything in it)."""
        return tuple(path for step in self.steps for path in step.paths)

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "bytes": self.bytes, "detail": self.detail}


@dataclass(frozen=True)
class InUse:
    item: Item
    uses: tuple[Use, ...]

    def to_json(self) -> dict:
        first = self.uses[0]
        return {**self.item.to_json(), "pid": first.pid, "command": first.command, "how": first.how,
                "users": [u.to_json() for u in self.uses]}

    def describe(self) -> str:
        """Every holder, in one line."""
        return "; ".join(u.describe() for u in self.uses)


@dataclass(frozen=True)
class Kept:
    """Something that looks reclaimable but is kept, and why."""

    path: str
    kind: str
    bytes: int
    detail: str

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "bytes": self.bytes, "detail": self.detail}


@dataclass(frozen=True)
class Plan:
    items: tuple[Item, ...]
    in_use: tuple[InUse, ...] = ()
    kept: tuple[Kept, ...] = ()  # items the rule keeps (a ref names them, .refs unreadable, ...)
    live_temps: tuple[Kept, ...] = ()
    notes: tuple[str, ...] = ()
    mounts: tuple[Crossing, ...] = ()  # mounts inside the node's paths: never entered

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items)


@dataclass(frozen=True)
class Wanted:
    """What the manifest wants of each listed repo directory: the commits to keep, or None when
    the NAS could not say (then every revision of that repo is kept)."""

    commits: dict[str, frozenset[str] | None] = field(default_factory=dict)
    why_unknown: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- small helpers


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_partial(name: str) -> bool:
    return is_temp_name(name) or name.endswith((".partial", ".incomplete"))


def _hf_in_flight(name: str) -> bool:
    """huggingface_hub's own helpers beside blobs and payloads: per-payload locks and the temporary
    links it renames into place while holding them. Never reclaimable: deleting a lock file that a
    download holds lets a second writer in."""
    return name.endswith((".lock", ".lock.soft", ".shared")) or (name.startswith(".") and name.endswith(".tmp"))


def _use(st: os.stat_result | None) -> float:
    """When a process last read the file: its atime (the --until-free order, oldest use first).

    Only a regular file has a use. A directory's atime moves whenever anything lists it (the
    audit, this very scan) and a link's whenever it is read: counting them made every scan mark
    every repo "used now", and after one `stage audit` prune chose the repo a process had just
    read over one idle for days. This tool's own reads keep files' atimes
    (small_files.open_keeping_atime)."""
    if st is None or not stat.S_ISREG(st.st_mode):
        return 0.0
    return st.st_atime


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


# ---------------------------------------------------------------- the hub


@dataclass
class _Snapshot:
    repo: str  # repo directory (absolute)
    commit: str
    seen: Seen
    hops: set[str]  # every path its entries' chains pass through, entries included
    finals: set[str]  # the regular files they end in
    dirs: list[Seen]
    real_files: list[Seen]
    used: float


def _beyond(view: View, path: str) -> bool:
    """`path` is outside the root, or at or below a mount inside it: not the node's to read."""
    return not under(path, view.fence.root) or any(under(path, point) for point in view.crossings)


def _follow(path: str, hops: set[str], finals: set[str], stats: dict[str, os.stat_result | None],
            view: View) -> None:
    """Every hop of the chain from `path`, read with lstat and readlink (each hop once per scan:
    thousands of entries reach the same few blobs). A hop outside the root or beyond a mount ends
    the chain there: what lies past it is not the node's."""
    for _ in range(MAX_HOPS + 1):
        hops.add(path)
        if _beyond(view, path):
            return
        if path not in stats:
            stats[path] = _lstat(path)
        st = stats[path]
        if st is None or not stat.S_ISLNK(st.st_mode):
            if st is not None and stat.S_ISREG(st.st_mode):
                finals.add(path)
            return  # a regular file, or a dangling hop: the chain ends here
        try:
            target = os.readlink(path)
        except OSError:
            return
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))


def _scan_snapshot(repo: str, entry: Entry, stats: dict, view: View) -> _Snapshot | None:
    st = entry.st
    if not stat.S_ISDIR(st.st_mode):
        return None
    hops: set[str] = set()
    finals: set[str] = set()
    dirs, real = [Seen.of(entry.path, st)], []
    used = 0.0  # the files its entries resolve to (_use): never its directories
    for _here, subdirs, files in view.tree(entry.path):
        for path, sub in subdirs:
            dirs.append(Seen.of(path, sub))
        for path, sub in files:
            stats[path] = sub
            if stat.S_ISREG(sub.st_mode):
                real.append(Seen.of(path, sub))
            _follow(path, hops, finals, stats, view)
    for final in finals:
        final_st = stats.get(final)
        if final_st is not None:
            used = max(used, _use(final_st))
    return _Snapshot(repo, entry.name, Seen.of(entry.path, st), hops, finals, dirs, real, used)


def _unseen(path: str) -> Seen:
    """A directory that is itself a mount point: never read through. Its identity matches nothing,
    so a step on it finds it changed and leaves it."""
    return Seen(path, 0, 0, 0, 0, True)


def _snapshots(repo: str, stats: dict, view: View) -> list[_Snapshot]:
    """The repo's snapshots; one that is a mount point is there, never entered."""
    parent = os.path.join(repo, "snapshots")
    snaps = [s for e in view.listing(parent) if (s := _scan_snapshot(repo, e, stats, view)) is not None]
    for mount in view.mounts_in(parent):
        snaps.append(_Snapshot(repo, os.path.basename(mount.point), _unseen(mount.point), {mount.point}, set(),
                               [], [], 0.0))
    return sorted(snaps, key=lambda s: s.commit)


def _local_refs(repo: str, view: View) -> dict[str, list[str]]:
    """commit -> the local refs naming it (nested ones such as refs/pr/1 too)."""
    named: dict[str, list[str]] = {}
    refs = os.path.join(repo, "refs")
    for _here, _dirs, files in view.tree(refs):
        for path, _st in files:
            try:
                text = read_regular(path, 128).decode("ascii", "replace").strip()
            except OSError:
                continue
            named.setdefault(text, []).append(os.path.relpath(path, refs))
    return named


def _repo_files(repo: str, stats: dict, view: View) -> tuple[list[str], list[str], float, int]:
    """(regular files, directories, newest use of its content, bytes) of a whole repo directory.

    Content is what a client loads: blobs/ and files in snapshots/. refs/ and trees/ are read by
    anything that only looks at the cache (`hf cache scan` reads every ref), which is not use."""
    files, dirs, used, size = [], [repo], 0.0, 0
    content = (os.path.join(repo, "blobs", ""), os.path.join(repo, "snapshots", ""))
    for _here, subdirs, names in view.tree(repo):
        dirs.extend(path for path, _st in subdirs)
        for path, st in names:
            stats[path] = st
            if stat.S_ISREG(st.st_mode):
                files.append(path)
                size += st.st_size
                if path.startswith(content):
                    used = max(used, _use(st))
    return files, dirs, used, size


def _blob_sha256(path: str) -> str | None:
    name = os.path.basename(path)
    return name if SHA256_NAME.match(name) else None


def _ids(paths: list[str]) -> frozenset[FileId]:
    """(st_dev, st_ino) of each existing path (lstat)."""
    found = set()
    for path in paths:
        st = _lstat(path)
        if st is not None:
            found.add((st.st_dev, st.st_ino))
    return frozenset(found)


@dataclass
class _HubScan:
    root: str
    items: list[Item] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    # What the attach stage needs: repo blobs no kept snapshot reaches, by the items whose
    # snapshots reach them; payloads no kept snapshot reaches, by the repo blobs linking to them.
    blob_reachers: dict[str, set[str]] = field(default_factory=dict)  # blob path -> revision item paths
    blob_stats: dict[str, os.stat_result] = field(default_factory=dict)
    payload_referrers: dict[str, set[str]] = field(default_factory=dict)  # payload path -> repo blobs linking to it
    payload_stats: dict[str, os.stat_result] = field(default_factory=dict)
    refs_unusable: dict[str, str] = field(default_factory=dict)
    crossings: dict[str, Crossing] = field(default_factory=dict)  # mounts inside the hub: never entered
    notes: list[str] = field(default_factory=list)


@dataclass
class _Judged:
    """The snapshots of the listed repos, judged: what kept ones reach, and the unwanted ones."""

    kept_hops: set[str] = field(default_factory=set)
    unwanted: list[_Snapshot] = field(default_factory=list)


def scan_hub(hub: str, wanted: Wanted, listed: set[str]) -> _HubScan:
    """Every repo, snapshot, repo blob and payload of the node hub on the hub's own mount, and the
    candidate items (revisions, unlisted repos, orphans) before the in-use check and the
    attachment of blobs. Mounts met inside the hub are recorded, never entered."""
    root = identity.resolved(hub)
    scan = _HubScan(root)
    view = _view(root)
    if view is None:
        return scan
    stats: dict[str, os.stat_result | None] = {}
    repos = [e for e in view.listing(root) if e.is_dir and _is_repo_name(e.name)]
    snaps = {repo.path: _snapshots(repo.path, stats, view) for repo in repos}
    judged = _judge_snapshots(scan, view, [r for r in repos if r.name in listed], snaps, wanted)
    _revision_items(scan, view, judged, stats)
    _unlisted_repo_items(scan, view, [r for r in repos if r.name not in listed], snaps, judged, stats)
    _mounted_repo_items(scan, view, listed)
    _repo_blobs(scan, view, repos, listed, judged)
    _payloads(scan, view, judged)
    scan.crossings = dict(view.crossings)
    return scan


def _is_repo_name(name: str) -> bool:
    return "--" in name and name.split("--")[0] in REPO_KINDS


def _judge_snapshots(scan: _HubScan, view: View, repos: list[Entry], snaps: dict[str, list[_Snapshot]],
                     wanted: Wanted) -> _Judged:
    """Each snapshot of a listed repo is kept (wanted, named by a local ref, or the manifest cannot
    say) or unwanted."""
    judged = _Judged()
    for repo in repos:
        snapshots_dir = os.path.join(repo.path, "snapshots")
        for point, mount in view.crossings.items():
            if under(snapshots_dir, point):
                scan.kept.append(Kept(snapshots_dir, "revision", 0, f"a mount at {point} (showing {mount.shows}): "
                                      "the repo's revisions and orphan blobs are not judged"))
        commits = wanted.commits.get(repo.name)
        named = _local_refs(repo.path, view)
        for snap in snaps[repo.path]:
            if commits is None:
                scan.kept.append(Kept(snap.seen.path, "revision", 0, wanted.why_unknown.get(
                    repo.name, "cannot tell which revisions the manifest wants")))
                judged.kept_hops |= snap.hops
            elif snap.commit in commits:
                judged.kept_hops |= snap.hops
            elif snap.commit in named:
                refs = ", ".join(f"refs/{r}" for r in sorted(named[snap.commit]))
                scan.kept.append(Kept(snap.seen.path, "revision", 0, f"named by {refs}; delete the ref to reclaim it"))
                judged.kept_hops |= snap.hops
            else:
                judged.unwanted.append(snap)
    return judged


def _revision_items(scan: _HubScan, view: View, judged: _Judged, stats: dict) -> None:
    """An item per unwanted snapshot: the snapshot, its trees json and .no_exist markers. Nothing
    of it may be what a kept snapshot reaches (a kept entry linking into an old snapshot's real
    file would dangle). A mount over any of them keeps the item (`touches`)."""
    for snap in judged.unwanted:
        own = {d.path for d in snap.dirs} | {f.path for f in snap.real_files}
        if any(h in judged.kept_hops for h in snap.hops if _inside(h, snap.seen.path)) or own & judged.kept_hops:
            scan.kept.append(Kept(snap.seen.path, "revision", 0, "a kept snapshot links into it"))
            judged.kept_hops |= snap.hops
            continue
        repo = snap.repo
        steps = [Step("trash", snap.seen, sum(f.size for f in snap.real_files), files=len(snap.real_files))]
        extras = (os.path.join(repo, ".no_exist", snap.commit), os.path.join(repo, "trees", f"{snap.commit}.json"))
        for extra in extras:
            st = None if _beyond(view, extra) else _lstat(extra)
            if st is None:
                continue
            if stat.S_ISDIR(st.st_mode):
                steps.append(Step("trash", Seen.of(extra, st)))
            else:
                steps.append(Step("unlink", Seen.of(extra, st), files=1 if stat.S_ISREG(st.st_mode) else 0))
        reaches = {f.id for f in snap.real_files} | {d.id for d in snap.dirs}
        reaches |= {(stats[f].st_dev, stats[f].st_ino) for f in snap.finals if stats.get(f) is not None}
        touches = {snap.seen.path, *extras} | {h for h in snap.hops if under(h, repo)}
        scan.items.append(Item("revision", snap.seen.path, steps[0].bytes,
                               f"revision {snap.commit} of {os.path.basename(repo)} is not wanted and no ref names it",
                               snap.used, tuple(steps), frozenset(reaches), snap.seen.dev, repo,
                               exposed_by=_ids([repo, os.path.join(repo, "snapshots"), os.path.join(repo, "blobs")]),
                               touches=frozenset(touches)))
        for hop in snap.hops:
            if os.path.dirname(hop) == os.path.join(repo, "blobs"):
                scan.blob_reachers.setdefault(hop, set()).add(snap.seen.path)


def _unlisted_repo_items(scan: _HubScan, view: View, repos: list[Entry], snaps: dict[str, list[_Snapshot]],
                         judged: _Judged, stats: dict) -> None:
    """Unlisted repos, whole, unless a kept snapshot links into them."""
    for repo in repos:
        if any(_inside(h, repo.path) for h in judged.kept_hops):
            scan.kept.append(Kept(repo.path, "unlisted-repo", 0, "a kept snapshot links into it"))
            continue
        files, dirs, used, size = _repo_files(repo.path, stats, view)
        reaches = set()
        for path in files + dirs:
            sub = stats.get(path) or _lstat(path)
            if sub is not None:
                reaches.add((sub.st_dev, sub.st_ino))
        for snap in snaps[repo.path]:
            reaches |= {(stats[f].st_dev, stats[f].st_ino) for f in snap.finals if stats.get(f) is not None}
            used = max(used, snap.used)
        blobs = {e.path for e in view.listing(os.path.join(repo.path, "blobs"))}
        scan.items.append(Item("unlisted-repo", repo.path, size, "repo is not in this node's models", used,
                               (Step("trash", Seen.of(repo.path, repo.st), size, files=len(files)),), frozenset(reaches),
                               repo.st.st_dev, repo.path, frozenset(blobs), touches=frozenset({repo.path})))


def _mounted_repo_items(scan: _HubScan, view: View, listed: set[str]) -> None:
    """An unlisted repo directory that is itself a mount point: an item, which the mount holds."""
    for mount in view.mounts_in(scan.root):
        name = os.path.basename(mount.point)
        if _is_repo_name(name) and name not in listed:
            scan.items.append(Item("unlisted-repo", mount.point, 0, "repo is not in this node's models", 0.0,
                                   (Step("trash", _unseen(mount.point)),), repo=mount.point,
                                   touches=frozenset({mount.point})))


def _repo_blobs(scan: _HubScan, view: View, repos: list[Entry], listed: set[str], judged: _Judged) -> None:
    """Repo blobs of listed repos that no snapshot reaches (orphans), and which repo blobs link to
    each payload. A repo whose snapshots/ a mount hides has no orphans: what reaches its blobs is
    not known. What a mounted directory inside a snapshot links to is the mount's, not the node's."""
    all_hops = judged.kept_hops | {h for s in judged.unwanted for h in s.hops}
    for repo in repos:
        blobs_dir = os.path.join(repo.path, "blobs")
        snapshots_hidden = any(under(os.path.join(repo.path, "snapshots"), point) for point in view.crossings)
        for blob in view.listing(blobs_dir):
            st = blob.st
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.path.normpath(os.path.join(blobs_dir, os.readlink(blob.path)))
                except OSError:
                    target = None
                if target and _is_payload_path(target, scan.root):
                    scan.payload_referrers.setdefault(target, set()).add(blob.path)
            if repo.name not in listed or is_partial(blob.name) or _hf_in_flight(blob.name) or snapshots_hidden:
                continue
            if blob.path in judged.kept_hops:
                continue
            scan.blob_stats[blob.path] = st
            if blob.path in all_hops:
                continue  # reached by an unwanted revision only: it goes with the last of them
            scan.items.append(_orphan_blob(scan.root, repo.path, blob))


def _hidden_blobs(root: str, crossings: dict[str, Crossing]) -> list[Crossing]:
    """Mounts that hide a repo's blobs/ (the repo directory, or its blobs/, is a mount point)."""
    hidden = []
    for point, crossing in sorted(crossings.items()):
        parts = os.path.relpath(point, root).split("/")
        if _is_repo_name(parts[0]) and (len(parts) == 1 or parts[1:] == ["blobs"]):
            hidden.append(crossing)
    return hidden


def _orphan_blob(root: str, repo: str, blob: Entry) -> Item:
    st = blob.st
    detail = "no snapshot links to this blob"
    if stat.S_ISLNK(st.st_mode):
        try:
            detail += f" (a link to {os.readlink(blob.path)})"
        except OSError:
            pass
    size = st.st_size if stat.S_ISREG(st.st_mode) else 0
    reaches = {(st.st_dev, st.st_ino)}
    used = _use(st)
    if stat.S_ISLNK(st.st_mode):
        final = _lstat(identity.resolved(blob.path)) if identity.inside(blob.path, root) else None
        if final is not None:
            reaches.add((final.st_dev, final.st_ino))
            used = _use(final)  # the payload it links to is what a reader read
    return Item("blob", blob.path, size, detail, used,
                (Step("unlink", Seen.of(blob.path, st), size, _blob_sha256(blob.path),
                      files=1 if size or stat.S_ISREG(st.st_mode) else 0),),
                frozenset(reaches), st.st_dev, repo, frozenset({blob.path}),
                exposed_by=_ids([repo, os.path.join(repo, "blobs")]), touches=frozenset({blob.path}))


def _payloads(scan: _HubScan, view: View, judged: _Judged) -> None:
    """Payloads of the shared store that no kept snapshot reaches. None while a mount hides some
    repo's blobs/: which repo blobs link to a payload is not known then."""
    hidden = _hidden_blobs(scan.root, view.crossings)
    if hidden:
        scan.notes.append(f"a mount at {hidden[0].point} (showing {hidden[0].shows}) hides a repo's blobs/: "
                          "shared-store payloads are not judged while it is there")
        return
    for bucket in view.listing(os.path.join(scan.root, STORE)):
        if not bucket.is_dir:
            continue
        for payload in view.listing(bucket.path):
            name = payload.name
            if name.endswith(".refs") or is_partial(name) or _hf_in_flight(name) or payload.path in judged.kept_hops:
                continue
            st = payload.st
            if not stat.S_ISREG(st.st_mode):
                continue
            problem = _refs_problem(payload.path + ".refs")
            if problem:
                scan.kept.append(Kept(payload.path, "shared-blob", st.st_size, problem))
                scan.refs_unusable[payload.path] = problem
                continue
            scan.payload_stats[payload.path] = st


def _is_payload_path(path: str, root: str) -> bool:
    rel = os.path.relpath(path, root)
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == STORE and not rel.startswith("..") and not parts[2].endswith(".refs")


def _refs_problem(refs: str) -> str | None:
    """Why a payload's `.refs` manifest cannot be trusted to say who uses it, or None. A missing
    one lists nobody (the scan has seen every repo blob of the node); one that is not a regular
    file, or cannot be read, makes the payload stay, as huggingface_hub's own GC leaks it."""
    try:
        read_regular(refs, 16 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"its manifest {os.path.basename(refs)} cannot be read ({exc.strerror or exc}); kept, as huggingface_hub's GC keeps it"
    return None


def _view(root: str) -> View | None:
    """The scan's look at `root` (resolved), or None when it is not a directory."""
    real = identity.resolved(root)
    try:
        return View(Fence.of(real))
    except (FileNotFoundError, NotADirectoryError):
        return None


# ---------------------------------------------------------------- engram_dir


def shard_items(engram_dir: str, world: int | None, layers: set[int], why_none: str | None) -> list[Item]:
    """Shards of another TP size, or of a layer the manifest's model does not have, each with its
    receipt and its SHA256SUMS line. Shards of other ranks at the manifest's TP size are kept: a
    node may hold its peers' ranks on purpose (one 8-GPU node serving all of TP=8)."""
    from stager.engram.shard_format import parse_shard_name

    items = []
    view = _view(engram_dir)
    if view is None:
        return items
    engram_dir = view.fence.root
    sums_path = os.path.join(engram_dir, SUMS_NAME)
    sums = None
    for entry in view.listing(engram_dir):
        parsed = parse_shard_name(entry.name)
        if parsed is None or not stat.S_ISREG(entry.st.st_mode):
            continue
        layer, _rank, tp = parsed
        if why_none is not None:
            why = why_none
        elif tp != world:
            why = f"TP{tp} shard; the manifest's engram.world is {world}"
        elif layers and layer not in layers:
            why = f"layer {layer} is not among the Engram layers staged {sorted(layers)}"
        else:
            continue
        st = _lstat(entry.path)
        if st is None:
            continue
        if sums is None:
            try:
                sums = read_sums(Path(sums_path))
            except Exception:  # noqa: BLE001 - a record that is a link: the line stays, the shard is still removable
                sums = {}
        steps = []
        digest = sums.get(entry.name)
        if digest is not None:
            steps.append(Step("drop-sums", Seen.of(entry.path, st), sums=sums_path))
        receipt = os.path.splitext(entry.path)[0] + ".json"
        receipt_st = _lstat(receipt)
        size = st.st_size
        if receipt_st is not None and stat.S_ISREG(receipt_st.st_mode):
            steps.append(Step("unlink", Seen.of(receipt, receipt_st), receipt_st.st_size, files=1))
            size += receipt_st.st_size
            if digest is None:
                digest = _receipt_sha256(receipt)
        steps.append(Step("unlink", Seen.of(entry.path, st), st.st_size, digest, files=1))
        items.append(Item("shard", entry.path, size, why, _use(st), tuple(steps), frozenset({(st.st_dev, st.st_ino)}),
                          st.st_dev, touches=frozenset(p for step in steps for p in step.paths)))
    return items


def _receipt_sha256(path: str) -> str | None:
    import json

    try:
        value = json.loads(read_regular(path, 1 << 20)).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- temp files


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


def stale_temps(hub: str, engram_dir: str | None, now: float, *, holder: int | None = None) -> tuple[list[Item], list[Kept]]:
    """(interrupted, live): this tool's temp files, `*.partial` and huggingface_hub's `*.incomplete`
    untouched for STALE_SECONDS, split by whether their writer is gone.

    Gone means: none of the locks that guard the file (guarding_locks) was held when the scan
    started, nor when it ended, and the file is still there, the same inode, after both. A writer
    that ran wholly during the scan has renamed or removed its temp files by then. When the lock
    table cannot tell, the file counts as live: a live copy called "interrupted" invites an `rm`
    under a running mirror, while a missed leftover only waits for the next audit. `holder` is
    this process when it holds the hub's and engram_dir's locks itself (stage prune): a lock
    held by it is no live writer, since nothing else can write there meanwhile."""
    hub = identity.resolved(hub)
    engram_dir = identity.resolved(engram_dir) if engram_dir else None
    before = LockTable.read()
    candidates: dict[str, tuple[os.stat_result, float]] = {}  # by path: engram_dir may lie in the hub
    for root in [hub] + ([engram_dir] if engram_dir else []):
        view = _view(root)
        for here, _dirs, files in view.tree(root) if view else ():
            if os.path.join(here, "x").startswith(os.path.join(hub, TRASH) + "/"):
                continue
            for path, st in files:
                if is_partial(os.path.basename(path)) and now - st.st_mtime > STALE_SECONDS:
                    candidates[path] = (st, now - st.st_mtime)
    after = LockTable.read()
    states: dict[Path, str | None] = {}
    interrupted, live = [], []
    for path, (st, age) in sorted(candidates.items()):
        locks = guarding_locks(path, hub, engram_dir)
        for lock in locks:
            if lock not in states:
                states[lock] = _liveness(lock, holder, before, after)
        why = next((states[lock] for lock in locks if states[lock]), None)
        again = _lstat(path)
        if again is None or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
            continue  # renamed into place or swept since the scan: it was live
        if why:
            live.append(Kept(path, "temp", st.st_size, why))
        else:
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            interrupted.append(Item("temp", path, size, f"interrupted write, untouched for {age / 3600:.1f} h",
                                    _use(st), (Step("unlink", Seen.of(path, st), size, files=1),),
                                    frozenset({(st.st_dev, st.st_ino)}), st.st_dev, touches=frozenset({path})))
    return interrupted, live


def _liveness(lock: Path, holder: int | None, *tables: LockTable) -> str | None:
    """Why a writer under `lock` may be live (held in either table, or a table that cannot tell)."""
    for table in tables:
        state, pid = table.state(lock)
        if state == "held" and pid != holder:
            return f"being written: pid {pid} holds {lock}"
    if any(table.state(lock)[0] == "unsure" for table in tables):
        return f"may be being written: cannot tell from {PROC_LOCKS} whether {lock} is held"
    return None


# ---------------------------------------------------------------- the plan


def _order(items: list[Item]) -> list[Item]:
    return sorted(items, key=lambda i: (_TIER[i.kind], i.kind != "temp", i.used, i.path))


def attach(scan: _HubScan, items: list[Item]) -> tuple[list[Item], list[Step]]:
    """Give each repo blob that only unwanted revisions reach, and each payload that only removed
    repo blobs link to, to the last item (in `items`' order) that takes away what reaches it: a
    blob goes only after every snapshot entry reaching it, a payload after every repo blob. Returns
    the items and the sweeps of payloads no repo blob links to at all."""
    position = {item.path: n for n, item in enumerate(items)}
    extra: dict[int, list[Step]] = {}
    removes: dict[int, set[str]] = {n: set(i.removes) for n, i in enumerate(items)}
    for blob, reachers in scan.blob_reachers.items():
        if any(r not in position for r in reachers):
            continue  # a reaching revision stays (in use, or not chosen): so does the blob
        st = scan.blob_stats.get(blob)
        if st is None:
            continue
        last = max(position[r] for r in reachers)
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        extra.setdefault(last, []).append(Step("unlink", Seen.of(blob, st), size, _blob_sha256(blob),
                                               files=1 if stat.S_ISREG(st.st_mode) else 0,
                                               after=tuple(sorted(reachers))))
        removes[last].add(blob)
    taken = {blob: n for n, blobs in removes.items() for blob in blobs}
    orphan_payloads = []
    for payload, st in sorted(scan.payload_stats.items()):
        referrers = scan.payload_referrers.get(payload, set())
        owners = [taken.get(blob) for blob in referrers]
        if referrers and any(o is None for o in owners):
            continue  # a repo blob that stays links to it
        refs = payload + ".refs"
        step = Step("sweep", Seen.of(payload, st), st.st_size, files=1, after=tuple(sorted(referrers)),
                    refs=refs if _lstat(refs) is not None else None)
        if referrers:
            extra.setdefault(max(owners), []).append(step)
        else:
            orphan_payloads.append(step)
    # A payload that stays while repo blobs linking to it go: its manifest is rewritten without
    # them, as huggingface_hub's GC rewrites it (never a reason to delete the payload).
    for payload, referrers in sorted(scan.payload_referrers.items()):
        if payload in scan.payload_stats:
            continue
        owners = [taken[blob] for blob in referrers if blob in taken]
        st = _lstat(payload) if owners else None
        if st is not None and stat.S_ISREG(st.st_mode):
            extra.setdefault(max(owners), []).append(Step("refs", Seen.of(payload, st)))
    out = []
    for n, item in enumerate(items):
        added = extra.get(n, [])
        if added:
            item = replace(item, steps=item.steps + tuple(added), bytes=item.bytes + sum(s.bytes for s in added),
                           removes=frozenset(removes[n]))
        out.append(item)
    return out, orphan_payloads


def make_plan(hub: str, engram_dir: str | None, wanted: Wanted, listed: set[str], *, world: int | None,
              layers: set[int], shards_why: str | None, now: float, only: tuple[str, ...] = (),
              holder: int | None = None, check_use: bool = True) -> Plan:
    """The frozen plan: candidates, minus what is in use, in the --until-free order, with each
    blob and payload given to the item that frees it. `only` keeps the items of those kinds."""
    scan = scan_hub(hub, wanted, listed)
    candidates = list(scan.items)
    if engram_dir:
        candidates += shard_items(engram_dir, world, layers, shards_why)
    temps, live = stale_temps(hub, engram_dir, now, holder=holder)
    candidates += temps
    payload_candidates = [Item("shared-blob", p, st.st_size, "no repo blob links to this shared-store payload",
                               _use(st), (), frozenset({(st.st_dev, st.st_ino)}), st.st_dev, touches=frozenset({p}))
                          for p, st in scan.payload_stats.items() if not scan.payload_referrers.get(p)]
    candidates += payload_candidates
    if only:
        candidates = [c for c in candidates if c.kind in only]
    roots = [hub] + ([engram_dir] if engram_dir else [])
    mounts = mounts_inside(roots, scan.crossings)
    busy: list[InUse] = []
    if check_use:
        candidates, busy = split_in_use(candidates, roots, mounts)
    chosen = _order([c for c in candidates if c.kind != "shared-blob"])
    items, orphan_payloads = attach(scan, chosen)
    allowed = {c.path for c in candidates if c.kind == "shared-blob"}
    for step in orphan_payloads:
        if step.target.path not in allowed:
            continue
        items.append(Item("shared-blob", step.target.path, step.bytes, "no repo blob links to this shared-store payload",
                          step.target.mtime_ns / 1e9, (step,), frozenset({step.target.id}), step.target.dev,
                          touches=frozenset(step.paths)))
    busy = _pinning(scan, chosen, busy)
    notes = tuple(f"{shown_path}: every revision kept: {why}" for shown_path, why in sorted(wanted.why_unknown.items()))
    return Plan(tuple(_order(items)), tuple(busy), tuple(scan.kept), tuple(live), notes + tuple(scan.notes),
                tuple(mounts.values()))


def _pinning(scan: _HubScan, chosen: list[Item], busy: list[InUse]) -> list[InUse]:
    """Each held item sized by what removing it beside the plan would free: its blobs and the
    payloads only it links to included (a held repo whose blobs link into the shared store is its
    payloads' size, not its links')."""
    if not busy:
        return busy
    planned = sum(i.bytes for i in attach(scan, chosen)[0])
    sized = []
    for held in busy:
        if held.item.kind != "shared-blob":
            with_it = sum(i.bytes for i in attach(scan, _order([*chosen, held.item]))[0])
            held = replace(held, item=replace(held.item, bytes=with_it - planned))
        sized.append(held)
    return sized


def mounts_inside(roots: list[str], found: dict[str, Crossing]) -> dict[str, Crossing]:
    """Every mount strictly inside the node's paths, by mount point: those a scan met (`found`)
    and those the mount table shows now. A root mounted inside another root is not one."""
    real = [identity.resolved(r) for r in roots]
    mounts = dict(found)
    for root in real:
        try:
            mounts.update(Fence.of(root).mounts_below())
        except (FileNotFoundError, NotADirectoryError):
            continue
    return {point: c for point, c in sorted(mounts.items()) if point not in real}


def devices_of(roots: list[str]) -> set[str]:
    found = set()
    for root in roots:
        device = identity.filesystem_device(root)
        if device:
            found.add(device)
    return found


def split_in_use(items: list[Item], roots: list[str], mounts: dict[str, Crossing]) -> tuple[list[Item], list[InUse]]:
    """(items nobody uses, the others with every holder): a process with a file or directory the
    item removes or reaches open, mapped, or as its working or root directory; a mount, in any
    mount namespace, of one of them or of a directory that exposes them (`Item.exposed_by`); and
    one of `mounts` (inside the node's paths) at, in or above a path the item touches."""
    ids = set().union(*(i.reaches for i in items)) if items else set()
    exposing = set().union(*(i.exposed_by for i in items)) if items else set()
    found = users(ids, exposing=exposing, devices=devices_of(roots))
    free, busy = [], []
    for item in items:
        uses = [u for file_id in sorted(item.reaches) for u in found.get(file_id, [])]
        uses += [u for file_id in sorted(item.exposed_by) for u in found.get(file_id, []) if u.mount is not None]
        uses += [Use(None, "", f"a mount at {c.point}", c.point, c.shows) for c in mounts.values()
                 if any(under(c.point, path) or under(path, c.point) for path in item.touches)]
        if uses:
            busy.append(InUse(item, tuple(dict.fromkeys(uses))))
        else:
            free.append(item)
    return free, busy


def wanted_from(snapshots, models: list[tuple[str, str]], hub: str) -> Wanted:
    """What the manifest wants of each listed repo: the commit the NAS ref names (pending or not),
    the commit the node serves (hub.serving_commit: the revision it stays on while the NAS one is
    pending), and a pinned commit as written. A model whose NAS walk gave no commit keeps every
    revision."""
    from stager.mirror.hub import repo_dir_name, serving_commit

    commits: dict[str, frozenset[str] | None] = {}
    why: dict[str, str] = {}
    by_repo = {s.repo_id: s for s in snapshots}
    for repo_id, revision in models:
        name = repo_dir_name(repo_id)
        snap = by_repo.get(repo_id)
        if snap is None or snap.commit is None:
            reason = next((p.detail for p in (snap.problems if snap else ())), "the NAS was not walked")
            commits[name] = None
            why[name] = f"cannot tell which revision the NAS wants ({reason})"
            continue
        keep = {snap.commit}
        if getattr(snap, "pending", None) is not None:
            keep |= {snap.pending.commit, snap.pending.serving}
        serving = serving_commit(Path(hub), repo_id, revision)
        if serving:
            keep.add(serving)
        commits[name] = frozenset(keep)
    return Wanted(commits, why)
