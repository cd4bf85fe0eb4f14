"""`stage binds --node NAME`: the read-only mounts that give a container the node's models.

The container sees a hub cache at `--container-hub` (default: the node's own hub path, so
HF_HUB_CACHE is the same inside and out), with the same layout as any hub:

- A model staged whole (every entry local, nothing excluded, its ref local) is one bind of its
  local repo directory, plus one bind of the hub-level shared store if its links go through it.
  Inside, it is an ordinary hub repo: links, blobs, refs, trees.
- Any other model is composed file by file: its ref and `trees/<commit>.json`, then one bind
  per snapshot file, from the local hub when staged there, else from the NAS. Each source is the *resolved* regular file,
  so the container never follows a link (NAS links may be absolute, or lead into a shared store
  that is not mounted), and the file looks like a real file in the snapshot.

Binds never nest: a file bind inside a read-only directory bind cannot get its mount point
(EROFS), and inside a writable one it would make the mount point on the node's hub. So a model
is either one repo bind or all file binds.

"Staged locally" is judged as `stage verify` judges structure: a chain of relative links inside
the local hub ending in a regular file, of the NAS file's size. Content is not re-hashed at
container start; `stage mirror` verified it when staging, `stage verify` checks it on demand.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from stager.base.errors import BadInput, CannotRun
from stager.mirror.hub import COMMIT, Problem, RepoSnapshot, is_excluded, is_shared_payload, require_hub, walk_for_node
from stager.manifest import Manifest
from stager.sources import open_source
from stager.sources.local import LocalSource
from stager.base.small_files import read_regular
from stager.mirror.verify import check_local_chain

SHARED_STORE = "blobs"


@dataclass(frozen=True)
class Bind:
    source: str
    target: str
    origin: str  # local | nas
    model: str
    files: int  # snapshot files this bind serves (0 for a ref)

    def docker(self) -> str:
        return f"-v {shlex.quote(f'{self.source}:{self.target}:ro')}"

    def to_json(self) -> dict:
        return {"source": self.source, "target": self.target, "read_only": True, "origin": self.origin,
                "model": self.model, "files": self.files}


@dataclass
class BindList:
    node: str
    container_hub: str
    binds: list[Bind] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def local(self) -> int:
        return sum(m["local"] for m in self.models)

    @property
    def nas_fallback(self) -> int:
        return sum(m["nas_fallback"] for m in self.models)

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "container_hub": self.container_hub,
            "env": {"HF_HUB_CACHE": self.container_hub},
            "counts": {"local": self.local, "nas_fallback": self.nas_fallback, "binds": len(self.binds)},
            "models": self.models,
            "binds": [b.to_json() for b in self.binds],
            "problems": [p.to_json() for p in self.problems],
        }


def _local_final(local_hub: Path, entry_rel: str, size: int, sources: tuple[str, ...]) -> str | None:
    """The local regular file a staged entry resolves to, or None if it is not staged there
    (a file reached through a directory link or mount into the NAS is not)."""
    final, problem, _links = check_local_chain(local_hub, entry_rel, sources=sources)
    if problem is not None or final is None:
        return None
    try:
        return final if os.path.getsize(local_hub / final) == size else None
    except OSError:
        return None


def _local_ref_ok(local_hub: Path, snap: RepoSnapshot) -> bool:
    if COMMIT.match(snap.revision):
        return True
    try:
        return read_regular(local_hub / snap.repo_dir / "refs" / snap.revision, 64, follow=True) == snap.commit.encode()
    except OSError:
        return False


def model_binds(nas: LocalSource, local_hub: Path, container_hub: str, repo_id: str, revision: str,
                exclude: list[str], out: BindList, sources: tuple[str, ...] = ()) -> None:
    # Walked without excludes: excluded entries need their NAS files resolved too.
    # While the NAS downloads a new revision, the container gets the one the node serves.
    snap = walk_for_node(nas, local_hub, repo_id, revision, [])
    out.problems.extend(snap.problems)
    summary = {"model": repo_id, "commit": snap.commit, "mode": "files", "local": 0, "nas_fallback": 0,
               "excluded": [], "pending": snap.pending.to_json() if snap.pending else None}
    out.models.append(summary)
    if snap.commit is None:
        return
    placed: list[tuple[str, str, str]] = []  # (origin, source, target) per snapshot file
    shared = False
    for entry in snap.entries:
        target = f"{container_hub}/{snap.snapshot_dir}/{entry.path}"
        excluded = is_excluded(entry.path, exclude)
        final = None if excluded else _local_final(local_hub, entry.rel, entry.size, sources)
        if excluded:
            summary["excluded"].append(entry.path)
        if final is not None:
            placed.append(("local", str(local_hub / final), target))
            shared = shared or is_shared_payload(final)
        else:
            placed.append(("nas", nas.path(entry.final), target))
    summary["local"] = sum(1 for origin, _, _ in placed if origin == "local")
    summary["nas_fallback"] = len(placed) - summary["local"]
    whole = summary["nas_fallback"] == 0 and not snap.problems and _local_ref_ok(local_hub, snap)
    if whole:
        summary["mode"] = "repo"
        out.binds.append(Bind(str(local_hub / snap.repo_dir), f"{container_hub}/{snap.repo_dir}", "local",
                              repo_id, len(placed)))
        if shared and not any(b.target == f"{container_hub}/{SHARED_STORE}" for b in out.binds):
            out.binds.append(Bind(str(local_hub / SHARED_STORE), f"{container_hub}/{SHARED_STORE}", "local", "", 0))
        return
    # The ref resolves the revision offline; the trees listing lets huggingface_hub tell a
    # complete snapshot from a partial one (every listed file is bound, excluded ones from the NAS).
    if not COMMIT.match(revision):
        out.binds.append(_metadata_bind(nas, local_hub, container_hub, f"{snap.repo_dir}/refs/{revision}",
                                        _local_ref_ok(local_hub, snap), repo_id))
    trees = f"{snap.repo_dir}/trees/{snap.commit}.json"
    local_trees = (local_hub / trees).is_file()
    if local_trees or nas.lstat(trees) is not None:
        out.binds.append(_metadata_bind(nas, local_hub, container_hub, trees, local_trees, repo_id))
    out.binds.extend(Bind(source, target, origin, repo_id, 1) for origin, source, target in placed)


def _metadata_bind(nas: LocalSource, local_hub: Path, container_hub: str, rel: str, local_ok: bool,
                   repo_id: str) -> Bind:
    if local_ok:
        return Bind(str(local_hub / rel), f"{container_hub}/{rel}", "local", repo_id, 0)
    return Bind(nas.path(rel), f"{container_hub}/{rel}", "nas", repo_id, 0)


def node_binds(manifest: Manifest, node: str, container_hub: str | None) -> BindList:
    config = manifest.node(node)
    hub = os.path.normpath(container_hub or config.hub)
    if not os.path.isabs(hub):
        raise BadInput(f"--container-hub {container_hub}: expected an absolute path")
    source = open_source(manifest.nas.hub, manifest.nas.aliases)
    if not isinstance(source, LocalSource):
        raise CannotRun(f"nas.hub {manifest.nas.hub}: a container can only fall back to a NAS mounted at a path")
    require_hub(source, list(config.models))
    out = BindList(node, hub)
    local_hub = Path(config.hub)
    sources = tuple(manifest.local_sources())
    for repo_id in config.models:
        model = manifest.models[repo_id]
        model_binds(source, local_hub, hub, repo_id, model.revision, list(model.exclude), out, sources)
    for bind in out.binds:
        # docker's -v splits on ':'; such a path cannot be expressed and is reported, not mangled.
        if ":" in bind.source or ":" in bind.target:
            out.problems.append(Problem(bind.source, "unmountable", "a path with ':' cannot be given to docker -v"))
    out.binds = [b for b in out.binds if ":" not in b.source and ":" not in b.target]
    return out
