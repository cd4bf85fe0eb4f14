"""Shared machinery for the reliability suites: real faults (kill -9, tmpfs, read-only binds, a
writer holding its lock), a byte-level picture of a tree and of what huggingface_hub loads from it
offline, and the invariants every fault must leave intact.

The promise under test: never a wrong byte under a final name, never a write to the
NAS, never a file from outside the hub staged, and a re-run always converges.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import Result, run_stage, sha256_file, write_manifest
from hubgen import Hub, Snapshot, add_engram_checkpoint, pseudo_random, random_safetensors
from stager.base.atomic import is_temp_name

MiB = 1024 * 1024
MODEL = "acme/Weights"
STAGE = [sys.executable, "-m", "stager"]
LOCK_DIR = ".locks"


def needs_root() -> None:
    """mount(2) needs root; CI runs as root, so these suites run there."""
    if os.geteuid() != 0:
        pytest.skip("needs root for mount")


# ---------------------------------------------------------------- fixtures on disk

@dataclass
class Staging:
    """A NAS hub with one model, a manifest, and the node-local hub it stages into."""

    root: Path
    nas: Path
    local: Path
    manifest: Path
    snapshot: Snapshot
    engram_dir: Path

    def stage(self, *args: str, timeout: float = 60) -> Result:
        return run_stage(*args, "--node", "dgx1", "--manifest", self.manifest, timeout=timeout)

    def mirror(self, *args: str, timeout: float = 60) -> Result:
        return self.stage("mirror", "--json", *args, timeout=timeout)

    def verify_full(self) -> Result:
        return self.stage("verify", "--full", "--json")

    def command(self, *args: str) -> list[str]:
        return [*STAGE, *args, "--node", "dgx1", "--manifest", str(self.manifest)]


ENGRAM_WORLD = 3


def build_staging(root: Path, *, shards: int, shard_bytes: int, local: Path | None = None,
                  engram: dict[int, int] | None = None, small_files: int = 0) -> Staging:
    """A model of `shards` safetensors shards (alternating shared-store two-hop links and plain
    repo blobs), a git-blob config and a real file inside the snapshot. `engram` ({layer: rows})
    adds an Engram table packed for TP=ENGRAM_WORLD into <root>/nvme/engram. `small_files` adds
    that many files of 1-64 KiB in directories of 50, git blobs with one in ten an LFS blob."""
    nas = root / "nas" / "hf" / "hub"
    local = local or root / "nvme" / "hf" / "hub"
    engram_dir = root / "nvme" / "engram"
    snap = Hub(nas).repo(MODEL).snapshot()
    extra = ""
    if engram:
        add_engram_checkpoint(snap, layers=tuple(engram), rows=engram)  # writes config.json and the index
        extra = f'engram_dir = "{engram_dir}"\n\n[engram]\nmodel = "{MODEL}"\nworld = {ENGRAM_WORLD}\n'
    else:
        snap.add_git("config.json", b'{"architectures": ["DeepseekV4ForCausalLM"]}')
    for i in range(shards):
        snap.add_lfs(f"model-{i + 1:05d}-of-{shards:05d}.safetensors", random_safetensors(i + 1, shard_bytes),
                     shared=i % 2 == 0)
    for i in range(small_files):
        data = pseudo_random(1000 + i, 1024 * (1 + (i * 37) % 64))
        path = f"parts/{i // 50:02d}/piece-{i:04d}.bin"
        if i % 10 == 0:
            snap.add_lfs(path, data, shared=False)
        else:
            snap.add_git(path, data)
    snap.add_real("tokenizer.json", b'{"model": {"type": "BPE"}, "added_tokens": []}')
    snap.finish(no_exist=("generation_config.json",))
    manifest = write_manifest(root / "cluster.toml", nas, local, {MODEL: {}}, extra=extra)
    return Staging(root, nas, local, manifest, snap, engram_dir)


# ---------------------------------------------------------------- Engram shards, independently

def engram_reference(source: Path, layer: int, lo: int, hi: int) -> bytes:
    """A shard's bytes, derived here without stager: header fields packed by hand, rows interleaved
    from the safetensors spans read by offset."""
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    start = 8 + length
    weight = header[f"model.layers.{layer}.engram.embed.weight"]
    scale = header[f"model.layers.{layer}.engram.embed.scale"]
    rows = weight["shape"][0]
    w = np.frombuffer(data, np.uint8, rows * 256, start + weight["data_offsets"][0]).reshape(rows, 256)
    s = np.frombuffer(data, np.uint8, rows * 8, start + scale["data_offsets"][0]).reshape(rows, 8)
    head = struct.pack("<6Q", 0x31344E4531565344, layer, lo, hi, rows, 264).ljust(4096, b"\0")
    return head + np.hstack([w[lo:hi], s[lo:hi]]).tobytes()


def expected_shards(staging: Staging) -> dict[str, str]:
    """sha256 of every shard of the staged Engram table for TP=ENGRAM_WORLD, from engram_reference."""
    source = staging.local / staging.snapshot.dir.relative_to(staging.nas) / "model-engram.safetensors"
    with open(source, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    expected = {}
    for name, tensor in header.items():
        if name.endswith(".engram.embed.weight"):
            layer, rows = int(name.split(".")[2]), tensor["shape"][0]
            for rank in range(ENGRAM_WORLD):
                lo, hi = rows * rank // ENGRAM_WORLD, rows * (rank + 1) // ENGRAM_WORLD
                shard = engram_reference(source, layer, lo, hi)
                expected[f"engram-l{layer}-r{rank}of{ENGRAM_WORLD}.bin"] = hashlib.sha256(shard).hexdigest()
    return expected


def assert_engram_truthful(directory: Path, expected: dict[str, str]) -> None:
    """Shards absent or byte-exact; a receipt or a SHA256SUMS line only ever names the right hash."""
    if not directory.exists():
        return
    for name in os.listdir(directory):
        path = directory / name
        if is_temp_name(name) or name == ".locks":
            continue
        if name in expected:
            assert sha256_file(path) == expected[name], f"{name}: wrong bytes under the final name"
        elif name.endswith(".json"):
            receipt = json.loads(path.read_text())
            assert receipt["sha256"] == expected[path.with_suffix(".bin").name], f"{name} names a wrong hash"
        elif name == "SHA256SUMS":
            for line in path.read_text().splitlines():
                digest, listed = line.split("  ", 1)
                assert expected[listed] == digest, f"SHA256SUMS names a wrong hash for {listed}"
        else:
            raise AssertionError(f"unexpected file {path}")


def assert_engram_converged(staging, expected: dict[str, str]) -> None:
    rerun = staging.stage("pack-engram", "--json")
    assert rerun.code == 0, rerun.stderr
    assert {Path(s["path"]).name for s in run_json(rerun)["shards"]} == set(expected)
    full = staging.verify_full()
    assert full.code == 0, full.stderr + full.stdout
    directory = staging.engram_dir
    sums = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=directory, capture_output=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    assert temp_files(directory) == []
    assert_engram_truthful(directory, expected)


def run_json(result: Result) -> dict:
    assert "Traceback" not in result.stderr, result.stderr
    return result.json


def assert_converged(staging: Staging) -> None:
    """A re-run succeeds, a full verify passes, and nothing temporary is left behind."""
    rerun = staging.mirror()
    assert rerun.code == 0, rerun.stderr + rerun.stdout
    full = staging.verify_full()
    assert full.code == 0, full.stderr + full.stdout
    report = run_json(full)
    assert report["ok"] == report["checked"] > 0 and not report["problems"]
    assert temp_files(staging.local) == [], temp_files(staging.local)
    assert_hub_truthful(staging.local, staging.nas, staging.snapshot)


# ---------------------------------------------------------------- what a tree looks like

def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (root included): type, size, mtime_ns, mode, link target and
    content hash. Two equal states mean nothing was written, touched, chmodded or renamed."""
    state: dict[str, tuple] = {}

    def record(path: str) -> None:
        st = os.lstat(path)
        rel = os.path.relpath(path, root)
        if stat.S_ISLNK(st.st_mode):
            state[rel] = ("link", st.st_mtime_ns, st.st_mode, os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            state[rel] = ("file", st.st_size, st.st_mtime_ns, st.st_mode, sha256_file(Path(path)))
        elif stat.S_ISDIR(st.st_mode):
            state[rel] = ("dir", st.st_mtime_ns, st.st_mode)
        else:  # FIFOs and sockets: never opened, a read could block
            state[rel] = ("other", st.st_mtime_ns, st.st_mode)

    record(str(root))
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            record(os.path.join(directory, name))
    return state


def assert_same_state(before: dict[str, tuple], after: dict[str, tuple], what: str) -> None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{what} changed: " + ", ".join(
        f"{k}: {before.get(k)} -> {after.get(k)}" for k in changed[:10])


@contextlib.contextmanager
def untouched(*roots: Path, what: str = "NAS") -> Iterator[None]:
    """Assert that nothing under `roots` changes while the body runs."""
    before = [tree_state(root) for root in roots]
    yield
    for root, state in zip(roots, before):
        assert_same_state(state, tree_state(root), f"{what} {root}")


def temp_files(root: Path) -> list[str]:
    found = []
    for directory, _dirs, files in os.walk(root):
        found.extend(os.path.join(directory, name) for name in files if is_temp_name(name))
    return sorted(found)


@dataclass(frozen=True)
class HubCheck:
    files: int  # regular files under final names, each byte-identical to the NAS
    links: int
    temps: int  # temp files a killed run left (never under a final name)
    ref_present: bool


def assert_hub_truthful(local: Path, nas: Path, snap: Snapshot | None = None) -> HubCheck:
    """Every file under a final name in the local hub holds exactly the NAS's bytes for the
    same hub path; every link is relative, stays in the hub and ends in such a file; and a ref
    exists only once every entry of its snapshot is staged."""
    files = links = temps = 0
    if not local.exists():
        return HubCheck(0, 0, 0, False)
    real_local = os.path.realpath(local)
    for directory, dirs, names in os.walk(local):
        if os.path.samefile(directory, local) and LOCK_DIR in dirs:
            dirs.remove(LOCK_DIR)
        for name in names + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, local)
            if is_temp_name(name):
                temps += 1
                continue
            if os.path.islink(path):
                target = os.readlink(path)
                assert not os.path.isabs(target), f"{rel} -> {target} is absolute"
                resolved = os.path.realpath(path)
                assert resolved.startswith(real_local + "/"), f"{rel} resolves outside the local hub: {resolved}"
                assert os.path.isfile(resolved), f"{rel} -> {target} does not end in a file"
                links += 1
                continue
            assert sha256_file(Path(path)) == nas_sha256(nas / rel), f"{rel}: bytes differ from the NAS"
            files += 1
    ref_present = False
    if snap is not None:
        ref = local / snap.repo.dir.name / "refs" / "main"
        ref_present = ref.exists()
        if ref_present:
            for path, sha in snap.sha256.items():
                staged = local / snap.repo.dir.name / "snapshots" / snap.commit / path
                assert staged.exists(), f"refs/main was written before {path} was staged"
                assert sha256_file(staged) == sha
    return HubCheck(files, links, temps, ref_present)


def offline_load(local: Path, revision: str = "main") -> dict[str, str]:
    """What huggingface_hub itself reads from the node cache, offline: path -> sha256."""
    code = (
        "import hashlib, json, os, sys\n"
        "from huggingface_hub import snapshot_download\n"
        f"root = snapshot_download({MODEL!r}, revision={revision!r}, cache_dir=sys.argv[1])\n"
        "out = {}\n"
        "for d, _, names in os.walk(root):\n"
        "    for n in names:\n"
        "        p = os.path.join(d, n)\n"
        "        out[os.path.relpath(p, root)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(local)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


_NAS_HASHES: dict[tuple, str] = {}


def nas_sha256(path: Path) -> str:
    """sha256 of a NAS file, remembered per (inode, size, mtime): trials hash the same NAS many times."""
    st = os.stat(path)
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _NAS_HASHES:
        _NAS_HASHES[key] = sha256_file(path)
    return _NAS_HASHES[key]


def fs_listing(*roots: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Names, types and sizes around the configured roots: a write outside them shows up here."""
    listing: dict[str, tuple] = {}
    skipped = {os.path.realpath(p) for p in skip}
    for root in roots:
        for directory, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(directory, d)) not in skipped]
            for name in dirs + files:
                path = os.path.join(directory, name)
                st = os.lstat(path)
                listing[path] = (stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return listing


# ---------------------------------------------------------------- real faults

@contextlib.contextmanager
def _mounted(mount_args: list[str], mountpoint: Path) -> Iterator[Path]:
    """`mount *mount_args mountpoint`; unmounted on the way out whatever happened."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *mount_args, str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        _umount(mountpoint)


def tmpfs(mountpoint: Path, size: int) -> contextlib.AbstractContextManager[Path]:
    """A real tmpfs of `size` bytes."""
    return _mounted(["-t", "tmpfs", "-o", f"size={size}", "tmpfs"], mountpoint)


def ramfs(mountpoint: Path) -> contextlib.AbstractContextManager[Path]:
    """A real ramfs: page-cache pages only, no size limit, and no O_DIRECT (refused at open with
    EINVAL, where this kernel's tmpfs accepts it)."""
    return _mounted(["-t", "ramfs", "ramfs"], mountpoint)


def bind(source: Path, mountpoint: Path) -> contextlib.AbstractContextManager[Path]:
    """`source` mounted again at `mountpoint` with `mount --bind`."""
    needs_root()
    return _mounted(["--bind", str(source)], mountpoint)


@contextlib.contextmanager
def read_only_bind(source: Path, mountpoint: Path) -> Iterator[Path]:
    """`source` seen read-only at `mountpoint` (bind, then remount the bind read-only)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(mountpoint)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mountpoint)], check=True)
        yield mountpoint
    finally:
        _umount(mountpoint)


def _umount(mountpoint: Path) -> None:
    if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)  # a straggler still has it open


def kill_at(command: list[str], delay: float, *, after=None) -> tuple[int, str]:
    """Start the real CLI and SIGKILL it `delay` seconds later, counted from start or, with
    `after`, from the moment `after()` first holds (polled every 2 ms). Returns (exit status,
    stderr); -9 means it was killed, anything else that it finished first."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while after is not None and proc.poll() is None and not after():
            time.sleep(0.002)
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
    _out, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode(errors="replace")


def copying(root: Path):
    """A trigger for kill_at: a temp file exists under `root`, so a copy is in flight."""
    return lambda: bool(temp_files(root))


# Holds an exclusive flock on argv[1], as lock.writer_lock does, until its stdin closes.
HOLDER = r"""
import fcntl, os, sys
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, f"{os.getpid()}\n".encode())
print("locked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def holding(lock: Path) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@dataclass(frozen=True)
class Timing:
    total: float  # seconds from start to exit
    writing: float  # seconds from the first temp file seen to the last one (writes in flight)


def calibrate(command: list[str], written: Path) -> Timing:
    """Time one uninterrupted run (it must succeed): the windows kill delays are drawn from.
    Measured, not assumed, because CI machines differ and share their cores."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = last = None
    while proc.poll() is None:
        if temp_files(written):
            first, last = first or time.monotonic(), time.monotonic()
        time.sleep(0.002)
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr.read().decode(errors="replace")
    return Timing(ended - started, max(0.01, (last or ended) - (first or started)))
