"""Fixtures for the `stage prune` suites: a node with an old revision and an unlisted repo staged by
the real `stage mirror`, real mounts and real processes holding its files, and the guard every
prune test runs under: the NAS tree is byte-identical afterwards (paths, sha256, link targets)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file, write_manifest
from hubgen import Hub, random_safetensors
from reliability_support import needs_root

MODEL, OLD = "acme/Model", "acme/Old"
MODEL_DIR, OLD_DIR = "models--acme--Model", "models--acme--Old"
STAGE = [sys.executable, "-m", "stager"]


@dataclass
class Node:
    root: Path
    nas: Path
    hub: Path
    manifest: Path
    old: str  # the commit of acme/Model the manifest no longer wants
    new: str
    files: dict[str, dict[str, bytes]]  # commit -> snapshot path -> bytes (for the Hub endpoint)

    def stage(self, *args: str, timeout: float = 120):
        return run_stage(*args, "--node", "dgx1", "--manifest", self.manifest, timeout=timeout)

    def prune(self, *args: str):
        return self.stage("prune", "--json", *args)

    def kept_hashes(self) -> dict[str, str]:
        """sha256 of every file the wanted revision resolves to."""
        snap = self.hub / MODEL_DIR / "snapshots" / self.new
        return {str(p.relative_to(snap)): sha256_file(p) for p in sorted(snap.rglob("*")) if p.is_file()}

    @property
    def old_snapshot(self) -> Path:
        return self.hub / MODEL_DIR / "snapshots" / self.old


# ---------------------------------------------------------------- the NAS guard

_GUARDED: list[tuple[Path, dict[str, tuple]]] = []


def nas_state(root: Path) -> dict[str, tuple]:
    """Every path under `root`, never through a link: a directory, a link and its target, or a
    regular file and its sha256."""
    state: dict[str, tuple] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                state[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                state[rel] = ("dir",)
            else:
                state[rel] = ("file", sha256_file(Path(path)))
    return state


def guard(nas: Path) -> None:
    """Check at the end of the running test that `nas` is byte-identical to what it is now."""
    _GUARDED.append((nas, nas_state(nas)))


@pytest.fixture(autouse=True)
def nas_guard() -> Iterator[None]:
    """Every prune test: each guarded NAS tree is byte-identical at the end (imported by each module)."""
    _GUARDED.clear()
    yield
    for nas, before in _GUARDED:
        after = nas_state(nas)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, f"the NAS {nas} changed: {changed[:20]}"
    _GUARDED.clear()


# ---------------------------------------------------------------- the node


def build_node(root: Path, *, extra_files: int = 0) -> Node:
    """acme/Model staged at two commits (the first no longer wanted; one weight shared between
    them through the shared store), and acme/Old staged, then dropped from the node's models.
    `extra_files` gives the old revision that many more small files of its own. The NAS is
    guarded (nas_guard) from here on."""
    nas = Hub(root / "nas" / "hf" / "hub")
    hub = root / "nvme" / "hf" / "hub"
    shared = random_safetensors(1, 96 * 1024)
    files: dict[str, dict[str, bytes]] = {}

    def snapshot(repo: str, contents: dict[str, bytes], shared_paths: set[str]) -> str:
        snap = nas.repo(repo).snapshot()
        for path, data in contents.items():
            if path.endswith(".safetensors"):
                snap.add_lfs(path, data, shared=path in shared_paths)
            else:
                snap.add_git(path, data)
        snap.finish()
        files[snap.commit] = contents
        return snap.commit

    old_files = {"config.json": b'{"v": 1}', "model-00001-of-00002.safetensors": shared,
                 "model-00002-of-00002.safetensors": random_safetensors(2, 64 * 1024)}
    old_files.update({f"extra/part-{i:05d}.txt": b"old %d\n" % i for i in range(extra_files)})
    old = snapshot(MODEL, old_files, {"model-00001-of-00002.safetensors"})
    snapshot(OLD, {"config.json": b'{"old": true}', "model.safetensors": random_safetensors(3, 48 * 1024)},
             {"model.safetensors"})
    manifest = write_manifest(root / "cluster.toml", nas.root, hub, {MODEL: {}, OLD: {}})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    new = snapshot(MODEL, {"config.json": b'{"v": 2}', "model-00001-of-00002.safetensors": shared,
                           "model-00002-of-00002.safetensors": random_safetensors(4, 64 * 1024)},
                   {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    write_manifest(manifest, nas.root, hub, {MODEL: {}})
    assert (hub / MODEL_DIR / "snapshots" / old).is_dir() and (hub / OLD_DIR).is_dir()
    guard(nas.root)
    return Node(root, nas.root, hub, manifest, old, new, files)


def scan_clean(hub: Path) -> None:
    """huggingface_hub's own scanner, offline, in a process of its own: no warnings."""
    code = ("import sys\nfrom huggingface_hub import scan_cache_dir\n"
            "info = scan_cache_dir(sys.argv[1])\nassert not info.warnings, info.warnings\n")
    ran = subprocess.run([sys.executable, "-c", code, str(hub)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 0, ran.stderr


def verify_full(node: Node) -> None:
    ran = node.stage("verify", "--full", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    assert ran.json["ok"] == ran.json["checked"] > 0


def listed(items: list[dict]) -> list[tuple]:
    return [(i["path"], i["kind"], i["bytes"]) for i in items]


def tree_bytes(root: Path) -> dict[str, str]:
    """Path -> sha256 of every regular file under `root`, and link -> target, never through a link."""
    return {k: v[1] for k, v in nas_state(root).items() if v[0] != "dir"}


# ---------------------------------------------------------------- real mounts


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point))
    return points


def unmount_below(root: Path) -> None:
    """Lazily unmount every mount at or below `root`, deepest first, wherever a run moved it."""
    real = os.path.realpath(root)
    for point in sorted({p for p in _mount_points() if p == real or p.startswith(real + "/")},
                        key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@contextlib.contextmanager
def bound(source: Path, point: Path, *, cleanup: Path) -> Iterator[Path]:
    """`mount --bind source point` (creating the directory), and every mount under `cleanup`
    unmounted on the way out, even one a prune carried elsewhere."""
    needs_root()
    point.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "--bind", str(source), str(point)], check=True)
        yield point
    finally:
        unmount_below(cleanup)


# ---------------------------------------------------------------- real processes

HOLD_OPEN = "import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nprint('held', flush=True)\nsys.stdin.read()\n"

HOLD_MMAP = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
address = libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
# The descriptor is closed: only the mapping keeps the file in use, as an inference engine's does.
os.close(fd)
print("held", flush=True)
sys.stdin.read()
"""

HOLD_ROOT = ("import os, sys\nos.chroot(sys.argv[1])\nos.chdir('/')\nprint('held', flush=True)\n"
             "sys.stdin.read()\n")


@contextlib.contextmanager
def holding(*commands: list[str], cwd: Path | None = None) -> Iterator[list[subprocess.Popen]]:
    """Real processes, each started and ready ('held' on its stdout) before the body runs, and
    ended (stdin closed, then killed) after it."""
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd)
            procs.append(proc)
            assert proc.stdout.readline().strip() == "held"
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def python(code: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]
