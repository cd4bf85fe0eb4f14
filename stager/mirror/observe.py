"""Read-only look at the local hub and the source before planning.

This is where "never trust size or mtime" is enforced: a local file of the right
size is kept only if its fingerprint matches the source's (sampled, or full with
--full).  NFS attributes go stale; a local blob with the right size and a newer
mtime has been seen holding zeros from a preallocated partial copy.
"""

from __future__ import annotations

import functools
import os
import stat as stat_module
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stager.base import identity
from stager.mirror.fingerprint import Digest, Reference, full_digest, judge, sampled_digest
from stager.mirror.hub import SHARED_MARKER, RepoSnapshot, is_shared_payload
from stager.mirror.plan import LocalState, final_files, kept_hops, wanted_links
from stager.sources.base import Source
from stager.sources.local import LocalReader
from stager.base.small_files import read_regular
from stager.base.workers import worker_pool

META_LIMIT = 64 * 1024 * 1024


class DigestCache:
    """Source-side digests computed in this run, so the closing verify does not re-read the NAS."""

    def __init__(self, source: Source, seed: int):
        self.source = source
        self.seed = seed
        self._digests: dict[tuple[str, str], Digest] = {}
        self._written: dict[str, tuple[tuple[int, int, int, int], Digest]] = {}
        self._lock = threading.Lock()

    def sampled(self, rel: str, *, fresh: bool = False) -> Digest:
        return self._digest(rel, f"sampled:{self.seed}", lambda reader: sampled_digest(reader, self.seed), fresh)

    def full(self, rel: str, method: str, *, fresh: bool = False) -> Digest:
        return self._digest(rel, method, lambda reader: full_digest(reader, method), fresh)

    def _digest(self, rel: str, method: str, compute, fresh: bool) -> Digest:
        """The source's digest by `method`, computed once per run unless `fresh` (a re-read)."""
        key = (rel, method)
        with self._lock:
            if not fresh and key in self._digests:
                return self._digests[key]
        try:
            reader = self.source.open(rel, uncached=True, sequential=not method.startswith("sampled"))
        except OSError as exc:
            return Digest(method, None, None, exc.strerror or str(exc))
        try:
            digest = compute(reader)
        finally:
            reader.close()
        self.remember(rel, digest)
        return digest

    def known(self, rel: str, method: str) -> Digest | None:
        """The source's digest by `method` if this run has it already; never reads."""
        with self._lock:
            return self._digests.get((rel, method))

    def remember(self, rel: str, digest: Digest) -> None:
        if digest.value is not None:
            with self._lock:
                self._digests[(rel, digest.method)] = digest

    def remember_written(self, path: Path, digest: Digest, identity: tuple[int, int, int, int]) -> None:
        """The digest of the bytes this run wrote at local `path` (dev, inode, size, mtime_ns),
        taken during the copy and matched against the source before the rename."""
        with self._lock:
            self._written[str(path)] = (identity, digest)

    def written(self, path: Path, method: str) -> Digest | None:
        """That digest again, if `path` is still the very file written (same inode, size and mtime).

        The closing verify of a mirror uses it instead of reading the file a second time:
        re-hashing made --full cost twice the copy, and re-sampling 1,000 small files cost a
        disk read each.  `stage verify` never has it: it always reads."""
        with self._lock:
            key, digest = self._written.get(str(path), (None, None))
        if digest is None or digest.method != method or _identity(path) != key:
            return None
        return digest


def expected_digest(cache: DigestCache, source_rel: str, reference: Reference, full: bool, *,
                    fresh: bool = False) -> Digest:
    """What a correct local copy must hash to, by the method the ladder rung uses."""
    if not full:
        return cache.sampled(source_rel, fresh=fresh)
    if reference.value is not None:
        return Digest(reference.method, None, reference.value)
    return cache.full(source_rel, reference.method, fresh=fresh)


def local_digest(path: Path, reference: Reference, seed: int, full: bool,
                 on_bytes: Callable[[int], None] | None = None) -> Digest:
    try:
        reader = LocalReader(str(path), uncached=False, direct=full)
    except OSError as exc:
        return Digest(reference.method if full else f"sampled:{seed}", None, None, exc.strerror or str(exc))
    try:
        return full_digest(reader, reference.method, on_bytes) if full else sampled_digest(reader, seed)
    finally:
        reader.close()


@dataclass(frozen=True)
class Observation:
    local: dict[str, LocalState]
    meta_content: dict[str, bytes]


def observe(source: Source, local_hub: Path, snapshots: list[RepoSnapshot], cache: DigestCache,
            *, full: bool, jobs: int, sources: tuple[str, ...] = (),
            progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> Observation:
    """`progress_factory` gets a bar for the bytes of local files hashed in full (a warm
    `mirror --full` re-reads every staged byte before it knows what to copy)."""
    local: dict[str, LocalState] = {}
    finals = final_files(snapshots)
    progress = progress_factory(sum(e.size for e, _ in finals.values())) if full and progress_factory else None
    root = identity.resolved(local_hub)
    elsewhere = functools.lru_cache(maxsize=None)(lambda real_dir: identity.escape_from(real_dir, root, sources))

    def look_at_final(dest: str) -> tuple[str, LocalState]:
        entry, reference = finals[dest]
        state = _lstat(local_hub / dest)
        if state.kind == "file" and elsewhere(identity.resolved((local_hub / dest).parent)):
            # Reached through a directory link or mount into the NAS: the NAS's own file, never kept.
            return dest, LocalState("remote")
        if state.kind == "file" and state.size == entry.size:
            # A file this run has just landed and checked (a fleet node's relay, in the same
            # process) is not read again: with --full that was a second hash of every byte.
            written = cache.written(local_hub / dest, reference.method if full else f"sampled:{cache.seed}")
            if written is not None and progress:
                progress(entry.size)
            mine = written or local_digest(local_hub / dest, reference, cache.seed, full, progress)
            theirs = expected_digest(cache, entry.final, reference, full)
            state = LocalState("file", state.size, state.inode, verdict=judge(mine, theirs))
        elif progress:
            progress(entry.size)  # nothing to hash here: the bar still ends at its total
        return dest, state

    with worker_pool(jobs, "stage-observe", "checks") as pool:
        local.update(pool.map(look_at_final, sorted(finals)))
    for dest in wanted_links(snapshots):
        local[dest] = _lstat(local_hub / dest)
    meta_content = _metadata_content(source, snapshots, local_hub)
    for rel in meta_content:
        state = _lstat(local_hub / rel)
        if state.kind == "file" and state.size <= META_LIMIT:
            try:
                state = LocalState("file", state.size, state.inode, content=read_regular(local_hub / rel))
            except FileNotFoundError:  # deleted since the lstat: plan it as absent
                state = LocalState("absent")
            except OSError:  # no longer a regular file: not ours to overwrite
                state = LocalState("other")
        local[rel] = state
    return Observation(local, meta_content)


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _lstat(path: Path) -> LocalState:
    st, target = identity.look(path)
    if st is None:
        return LocalState("absent")
    if target is not None:
        return LocalState("link", link_target=target)
    if stat_module.S_ISREG(st.st_mode):
        return LocalState("file", st.st_size, (st.st_dev, st.st_ino))
    return LocalState("dir" if stat_module.S_ISDIR(st.st_mode) else "other")


def _manifest_lines(path: Path) -> list[str]:
    try:
        return read_regular(path, META_LIMIT).decode(errors="replace").splitlines()
    except OSError:
        return []


def _links_to(local_hub: Path, name: str, payload: str) -> bool:
    """True when the node's repo blob `name` is a link to the shared `payload`."""
    if name.count("/") != 2 or ".." in name.split("/"):
        return False
    try:
        target = os.readlink(local_hub / name)
    except OSError:
        return False
    return os.path.normpath(os.path.join(os.path.dirname(name), target)) == payload


def _metadata_content(source: Source, snapshots: list[RepoSnapshot], local_hub: Path) -> dict[str, bytes]:
    """Bytes of every metadata file to stage: refs, trees, .no_exist, and the shared-store records."""
    content: dict[str, bytes] = {}
    for snap in snapshots:
        for rel in snap.metadata:
            # A ref holds the commit the walk read it as: reading it again here once staged a commit
            # whose snapshot was never walked, when the NAS ref moved in between.
            is_ref = rel.startswith(f"{snap.repo_dir}/refs/")
            content[rel] = snap.commit.encode() if is_ref else source.read_small(rel, META_LIMIT)
    referrers: dict[str, set[str]] = {}
    for snap in snapshots:
        for entry in snap.entries:
            hops = kept_hops(entry, snap.repo_dir)
            for here, nxt in zip(hops, hops[1:]):
                if is_shared_payload(nxt):
                    referrers.setdefault(nxt, set()).add(here)
    for payload, names in referrers.items():
        # The node's manifest lists exactly the node's repo blobs that link to the payload: this
        # run's, plus those already on the node (another manifest's models). Copying the NAS text
        # listed repos the node never had, and wrote over huggingface_hub's own GC rewrite.
        manifest = f"{payload}.refs"
        on_node = {name for name in _manifest_lines(local_hub / manifest) if _links_to(local_hub, name, payload)}
        wanted = on_node | {name for name in names if name.count("/") == 2}
        content[manifest] = "".join(f"{name}\n" for name in sorted(wanted)).encode()
    if referrers:
        st = source.lstat(SHARED_MARKER)
        # Without the marker, huggingface_hub's scanner reports the root `blobs/` as a corrupted repo.
        content[SHARED_MARKER] = source.read_small(SHARED_MARKER, 64) if st is not None and st.kind == "file" else b"1\n"
    return content

