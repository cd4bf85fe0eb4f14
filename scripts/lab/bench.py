#!/usr/bin/env python3
"""Benchmark `stage` against cp, rsync, rclone, sha256sum and b3sum on the same data, in the same run.

    python scripts/lab/bench.py                      # 2 GiB hub, Engram TP=8 x 0.5 GiB, 5 rounds after a warm-up
    python scripts/lab/bench.py --size 16GiB --reps 7
    python scripts/lab/bench.py --quick              # small smoke run: tiny data, 1 round, no settling pause

Wall time on a shared virtual disk moves with the order of the runs and with what the host
still has to write back, so every workload runs its commands in rounds whose order is rotated
by one each round (A B C, B C A, C A B, ...), and before every run the disk is let settle:
`sync`, the page cache dropped (cold runs), a wait until /proc/meminfo's Dirty + Writeback is
under 16 MiB, then a pause (--settle).  Each command is reported as the median and the min-max
of its rounds, and as a ratio to the plain-copy peer of the same round (median of the per-round
ratios).

CPU is user + system seconds of the command's whole process tree, from wait4() on the child
(descendants that were waited for included), per GB (10^9 bytes) moved.  It is compared with
cp + sync of the same bytes and with h: one in-process SHA-256 pass over the same bytes
(`python -c`, hashlib, 8 MiB O_DIRECT reads into a page-aligned buffer, so it is the hash's user
CPU and almost no system time), run as one more command of the same rounds.  CPU spent by
kernel threads on a command's behalf (kswapd, writeback workers) is charged to no process; the
JSON records kswapd0's CPU and the whole machine's busy CPU during each run beside it.  Peak RSS
is GNU time's %M (the largest process of the tree).  Results: JSON and a Markdown table in
--out (default: the work directory).  See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hubgen  # noqa: E402

GIB = 1024**3
MIB = 1024**2
GB = 1000**3
# Debian packages the peers (and the RSS meter) come from, by the command each provides.
PEER_PACKAGES = {"rsync": "rsync", "rclone": "rclone", "b3sum": "b3sum", "sha256sum": "coreutils",
                 "/usr/bin/time": "time"}
GNU_TIME = "/usr/bin/time"
MAIN_MODEL = "bench/big-model"
SMALL_MODEL = "bench/small-files"
ENGRAM_MODEL = "bench/engram-model"
# ~12 blobs of mixed sizes, as fractions of the hub size: a large first shard down to a few small ones.
BLOB_WEIGHTS = (24, 16, 12, 10, 8, 8, 6, 5, 4, 3, 2, 2)
SETTLED_DIRTY_KIB = 16 * 1024  # Dirty + Writeback under this counts as settled
SETTLE_TIMEOUT_S = 30.0
H_NAME = "h: sha256 pass (hashlib)"

# h: one SHA-256 pass over the named files (directories walked, links followed), in this process.
# O_DIRECT reads into a page-aligned buffer keep the page cache's copies out of it, so what it
# costs is the hash; a file that refuses O_DIRECT is read through the page cache.  Prints the bytes.
HASH_PASS = r"""
import errno, hashlib, mmap, os, sys
CHUNK = 8 << 20
view = memoryview(mmap.mmap(-1, CHUNK))
def files(paths):
    for p in paths:
        if os.path.isdir(p):
            for d, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    yield os.path.join(d, n)
        else:
            yield p
total = 0
for path in files(sys.argv[1:]):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        size, done, h = os.fstat(fd).st_size, 0, hashlib.sha256()
        while done < size:
            try:
                got = os.preadv(fd, [view], done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
                continue
            if got == 0:
                sys.exit(f"{path} ended at {done} of {size} bytes")
            h.update(view[:got])
            done += got
        total += done
    finally:
        os.close(fd)
print(total)
"""


def say(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- set-up


def ensure_peers(install: bool) -> dict[str, bool]:
    """Which peer commands exist; as root with apt-get, install the missing ones first (and say so)."""
    missing = [cmd for cmd in PEER_PACKAGES if shutil.which(cmd) is None]
    if missing and install and os.geteuid() == 0 and shutil.which("apt-get"):
        packages = sorted({PEER_PACKAGES[cmd] for cmd in missing})
        say(f"installing {', '.join(packages)} from Debian (apt-get) for the peer commands")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", *packages], env=env, check=False,
                       stdout=subprocess.DEVNULL)
    found = {cmd: shutil.which(cmd) is not None for cmd in PEER_PACKAGES}
    for cmd, ok in found.items():
        if not ok and cmd == GNU_TIME:
            say(f"{GNU_TIME} is not installed: peak RSS comes from wait4 and is at least this script's own")
        elif not ok:
            say(f"{cmd} is not installed: its rows are skipped")
    return found


def drop_caches() -> bool:
    """Write back dirty pages and empty the page cache. False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def dirty_kib() -> int:
    """Dirty + Writeback of /proc/meminfo: bytes the kernel still owes the disk."""
    total = 0
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("Dirty", "Writeback"):
                total += int(rest.split()[0])
    return total


def settle(drop: bool, pause: float) -> float:
    """Let the disk settle before a run: sync, drop the page cache (cold runs), wait until
    Dirty + Writeback is near zero (at most 30 s), then pause. Returns the seconds it waited.
    Without it, one run's writeback was still being paid by the next one."""
    started = time.monotonic()
    os.sync()
    if drop:
        drop_caches()
    while dirty_kib() > SETTLED_DIRTY_KIB and time.monotonic() - started < SETTLE_TIMEOUT_S:
        time.sleep(0.1)
    if pause > 0:
        time.sleep(pause)
    return time.monotonic() - started


def kswapd_seconds() -> float:
    """CPU seconds kswapd has used so far (every node's), charged to no command."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("kswapd"):
                fields = (comm.parent / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, ValueError, IndexError):
            continue
    return total


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every core, every process, kernel threads)."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def stage_argv() -> list[str]:
    """The `stage` an operator runs: the console script next to this interpreter, else `-m stager`."""
    script = Path(sys.executable).with_name("stage")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stager"]


def machine() -> dict:
    with open("/proc/meminfo") as handle:
        mem_kib = int(handle.readline().split()[1])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return {"nproc": os.cpu_count(), "cpu": cpu, "sha_ni": " sha_ni" in flags, "memory_gib": round(mem_kib / MIB, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def code_under_test() -> str:
    """The commit `stage` ran from, with `+changes` when stager/ differs from it: figures belong to a version."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    return f"{commit}+changes" if commit and git("status", "--porcelain", "--", "stager") else commit or "unknown"


def filesystem_of(path: Path) -> str:
    out = subprocess.run(["df", "--output=source,fstype,size", "-h", str(path)], capture_output=True, text=True,
                         check=False).stdout.splitlines()
    return " ".join(out[-1].split()) if len(out) > 1 else "unknown"


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Dataset:
    root: Path
    manifest: Path
    nas: Path
    snapshot: Path  # the big model's snapshot on the NAS: what cp/rsync/rclone copy
    small_snapshot: Path
    local: dict[str, Path]  # node -> local hub
    hub_bytes: int
    blobs: int
    small_files: int
    engram: dict  # the Engram table and the shards pack-engram writes from it


def build_dataset(root: Path, size: int, engram_rank_bytes: int, engram_world: int, small_files: int) -> Dataset:
    nas = root / "nas" / "hf" / "hub"
    hub = hubgen.Hub(nas)
    big = hub.repo(MAIN_MODEL).snapshot()
    big.add_git("config.json", json.dumps({"architectures": ["BenchForCausalLM"]}).encode())
    big.add_git("generation_config.json", b'{"do_sample": false}')
    big.add_real("tokenizer.json", hubgen.pseudo_random(7, 2 * MIB))  # a real file, as old tools left them
    big.add_real("tokenizer_config.json", b'{"model_max_length": 65536}')
    total = sum(BLOB_WEIGHTS)
    index = {"metadata": {}, "weight_map": {}}
    for i, weight in enumerate(BLOB_WEIGHTS, 1):
        name = f"model-{i:05d}-of-{len(BLOB_WEIGHTS):05d}.safetensors"
        blob_size, chunks = hubgen.streamed_safetensors(i, max(4096, size * weight // total))
        # Half the blobs live in the hub-level shared store (repo blob -> ../../blobs/xx/<xet>).
        big.add_lfs_stream(name, blob_size, chunks, shared=i % 2 == 1)
        index["weight_map"][f"model.layers.{i}.weight"] = name
    big.add_git("model.safetensors.index.json", json.dumps(index).encode())
    big.finish(no_exist=("chat_template.jinja",))

    small = hub.repo(SMALL_MODEL).snapshot()
    for i in range(small_files):
        # 1-64 KiB: tokenizer pieces, configs, per-expert metadata; some as LFS, most as git blobs.
        data = hubgen.pseudo_random(10_000 + i, 1024 * (1 + (i * 37) % 64))
        path = f"part{i // 100:02d}/file-{i:04d}.bin"
        if i % 10 == 0:
            small.add_lfs(path, data, shared=False)
        else:
            small.add_git(path, data)
    small.finish()

    local = {name: root / "nvme" / name / "hf" / "hub" for name in ("big", "small", "engram")}
    engram = _engram_checkpoint(hub, engram_rank_bytes, engram_world, root / "nvme" / "engram" / "shards")
    manifest = root / "cluster.toml"
    text = f'[nas]\nhub = "{nas}"\n\n'
    for repo_id in (MAIN_MODEL, SMALL_MODEL, ENGRAM_MODEL):
        text += f'[models."{repo_id}"]\nrevision = "main"\n\n'
    text += f'[nodes.big]\nhub = "{local["big"]}"\nmodels = ["{MAIN_MODEL}"]\n\n'
    text += f'[nodes.small]\nhub = "{local["small"]}"\nmodels = ["{SMALL_MODEL}"]\n\n'
    # One node serving every rank of the TP size, as an 8-GPU node serving TP=8 does.
    text += (f'[nodes.engram]\nhub = "{local["engram"]}"\nmodels = ["{ENGRAM_MODEL}"]\n'
             f'engram_dir = "{engram["dir"]}"\nranks = {list(range(engram_world))}\n\n'
             f'[engram]\nmodel = "{ENGRAM_MODEL}"\nworld = {engram_world}\n')
    manifest.write_text(text)
    return Dataset(root, manifest, nas, big.dir, small.dir, local, _tree_bytes(big.dir), len(BLOB_WEIGHTS),
                   small_files, engram)


def _engram_checkpoint(hub: hubgen.Hub, rank_bytes: int, world: int, shard_dir: Path) -> dict:
    """An Engram checkpoint whose table (one layer) is `world` ranks of about `rank_bytes` each."""
    row_bytes = hubgen.ENGRAM_WEIGHT_BYTES + hubgen.ENGRAM_SCALE_BYTES
    rows = max(world, rank_bytes * world // row_bytes) | 1  # odd: the ranks differ by a row
    hubgen.add_engram_checkpoint(hub, ENGRAM_MODEL, layers=(1,), rows=rows, streamed=True)
    # The floor partition (docs/engram.md): rank R holds rows R*rows//world .. (R+1)*rows//world - 1.
    shard_bytes = [4096 + ((r + 1) * rows // world - r * rows // world) * row_bytes for r in range(world)]
    return {"dir": shard_dir, "world": world, "rows": rows, "shard_bytes": shard_bytes}


def _tree_bytes(snapshot: Path) -> int:
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())


def _fill(path: Path, size: int, seed: int) -> None:
    """A file of exactly `size` pseudo-random bytes, written in 8 MiB pieces, unless it already is one."""
    if path.exists() and path.stat().st_size == size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _, chunks = hubgen.streamed_safetensors(seed, size)
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
    os.truncate(path, size)


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Command:
    name: str
    argv: list[str] | str  # a string runs under `sh -c` (peers chained with `&& sync`)
    prepare: Callable[[], None] | None = None  # untimed, before every run
    ours: bool = False
    hash_pass: bool = False  # h: prints the bytes it hashed


@dataclass(frozen=True)
class Run:
    wall_s: float
    user_s: float
    sys_s: float
    peak_kib: int
    reported_s: float | None  # the tool's own `seconds` (--json)
    stdout: bytes
    kswapd_s: float = 0.0
    busy_s: float = 0.0

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


@dataclass
class Workload:
    name: str
    title: str
    commands: list[Command]
    baseline: str  # the plain-copy peer every ratio is taken against
    data_bytes: int | None = None  # bytes each command moves (or hashes): the GB of CPU s/GB
    cold: bool = True
    setup: Callable[[], None] | None = None  # untimed, once before the first round
    teardown: Callable[[], None] | None = None  # once after the last round: frees the peers' copies
    results: dict[str, dict] = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)


def run_once(command: Command) -> Run:
    """One run: wall seconds, CPU of its process tree, peak RSS and what the tool reported.
    Fails loudly: a benchmark of a failed copy is a lie."""
    argv = ["sh", "-c", command.argv] if isinstance(command.argv, str) else command.argv
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as rss:
        # GNU time forks the command from its own small image: a child forked from this Python
        # process starts with this process's RSS as its high-water mark, which hid every peer's.
        meter = [GNU_TIME, "-f", "%M", "-o", rss.name] if os.path.exists(GNU_TIME) else []
        kswapd, busy = kswapd_seconds(), busy_seconds()
        started = time.perf_counter()
        proc = subprocess.Popen([*meter, *argv], stdout=out, stderr=err)
        # wait4's usage covers the child and every descendant it waited for (GNU time waits for the
        # command, sh for cp and sync, xargs for sha256sum), threads included.
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        kswapd, busy = kswapd_seconds() - kswapd, busy_seconds() - busy
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read().decode(errors="replace")
        lines = rss.read().split()
        # GNU time's %M: the largest RSS of the command and every descendant it waited for.
        peak = int(lines[-1]) if meter and lines and lines[-1].isdigit() else usage.ru_maxrss
    if proc.returncode != 0:
        raise SystemExit(f"bench: {command.name} failed (exit {proc.returncode}): {stderr.strip()[-2000:]}")
    try:
        reported = json.loads(stdout).get("seconds") if command.ours else None
    except ValueError:
        reported = None
    return Run(seconds, usage.ru_utime, usage.ru_stime, peak, reported, stdout, kswapd, busy)


def measure(workload: Workload, reps: int, warmup: int, can_drop: bool, pause: float) -> None:
    """Rounds of every command, the order rotated by one each round, the disk settled before each run."""
    if workload.setup:
        workload.setup()
    names = [c.name for c in workload.commands]
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for round_no in range(warmup + reps):
        shift = (round_no - warmup) % len(workload.commands)  # timed round 1 runs the commands as listed
        order = workload.commands[shift:] + workload.commands[:shift]
        timed = round_no >= warmup
        label = f"round {round_no - warmup + 1}/{reps}" if timed else "warm-up"
        loads = []
        for command in order:
            if command.prepare:
                command.prepare()
            settle(workload.cold and can_drop, pause)
            loads.append(os.getloadavg()[0])
            run = run_once(command)
            if command.hash_pass and workload.data_bytes is not None:
                hashed = int(run.stdout.split()[-1])
                if hashed != workload.data_bytes:
                    raise SystemExit(f"bench: {command.name} hashed {hashed} bytes, not the workload's "
                                     f"{workload.data_bytes}")
            say(f"{workload.name}: {command.name}: {run.wall_s:.3f}s wall, {run.user_s:.2f}+{run.sys_s:.2f}s CPU, "
                f"{run.peak_kib / 1024:.0f} MiB ({label})")
            if timed:
                runs[command.name].append(run)
        if timed:
            workload.rounds.append({"order": [c.name for c in order], "load1": [round(x, 2) for x in loads]})
    if workload.teardown:
        workload.teardown()
    workload.results = summarise(workload, runs)


def _spread(values: list[float], digits: int = 4) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def summarise(workload: Workload, runs: dict[str, list[Run]]) -> dict[str, dict]:
    """Medians with min-max; ratios are the median of the per-round ratios (the two commands of a
    ratio ran in the same round, a few seconds apart)."""
    base = runs[workload.baseline]
    h = next((runs[c.name] for c in workload.commands if c.hash_pass), None)
    per_gb = GB / workload.data_bytes if workload.data_bytes else None
    results = {}
    for command in workload.commands:
        mine = runs[command.name]

        def ratio(key: Callable[[Run], float], against: list[Run]) -> dict | None:
            pairs = [key(a) / key(b) for a, b in zip(mine, against) if key(b) > 0]
            return _spread(pairs, 3) if pairs else None

        row = {
            "command": command.argv if isinstance(command.argv, str) else shlex.join(command.argv),
            "ours": command.ours,
            "runs": [{"wall_s": round(r.wall_s, 4), "user_s": round(r.user_s, 3), "sys_s": round(r.sys_s, 3),
                      "peak_rss_mib": round(r.peak_kib / 1024, 1), "kswapd_s": round(r.kswapd_s, 2),
                      "machine_busy_s": round(r.busy_s, 2)} for r in mine],
            "wall_s": _spread([r.wall_s for r in mine]),
            "cpu_s": _spread([r.cpu_s for r in mine], 3),
            "user_s": _spread([r.user_s for r in mine], 3),
            "sys_s": _spread([r.sys_s for r in mine], 3),
            "cpu_s_per_gb": _spread([r.cpu_s * per_gb for r in mine], 3) if per_gb else None,
            "kswapd_s": _spread([r.kswapd_s for r in mine], 2),
            "machine_busy_s": _spread([r.busy_s for r in mine], 2),
            "wall_ratio": ratio(lambda r: r.wall_s, base),
            "cpu_ratio": ratio(lambda r: r.cpu_s, base),
            "cpu_per_h": ratio(lambda r: r.cpu_s, h) if h else None,
            "peak_rss_mib": round(max(r.peak_kib for r in mine) / 1024, 1),
            # The tool's own `seconds` (--json): the wall time less interpreter start-up and imports.
            "tool_s": _spread([r.reported_s for r in mine]) if all(r.reported_s is not None for r in mine) else None,
        }
        results[command.name] = row
    return results


# ---------------------------------------------------------------- workloads


def hash_pass(*paths: Path) -> Command:
    return Command(H_NAME, [sys.executable, "-c", HASH_PASS, *map(str, paths)], hash_pass=True)


def workloads(ds: Dataset, peers: dict[str, bool]) -> list[Workload]:
    def stage(*args: str) -> list[str]:
        return [*stage_argv(), *args, "--manifest", str(ds.manifest)]

    out = ds.root / "peers"
    snap = shlex.quote(str(ds.snapshot))
    small_snap = shlex.quote(str(ds.small_snapshot))

    def fresh(*paths: Path) -> Callable[[], None]:
        def prepare() -> None:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
            out.mkdir(parents=True, exist_ok=True)
        return prepare

    def dest(name: str) -> str:
        return shlex.quote(str(out / name))

    def drop_peers() -> None:
        shutil.rmtree(out, ignore_errors=True)

    sha_all = "find {d} -type f -print0 | xargs -0 sha256sum > /dev/null"
    copy_peers = [
        ("cp -rL && sync", f"cp -rL {snap} {dest('cp')} && sync", "cp", True),
        ("rsync -aL && sync", f"rsync -aL {snap}/ {dest('rsync')}/ && sync", "rsync", peers["rsync"]),
        ("rclone copy -L && sync", f"rclone copy -L --config /dev/null {snap} {dest('rclone')} && sync",
         "rclone", peers["rclone"]),
    ]
    big_hub = ds.local["big"]
    result = [
        Workload("cold_mirror", "Cold mirror, sampled verify", [
            Command("stage mirror", stage("mirror", "--node", "big", "--json"), fresh(big_hub), ours=True),
            *[Command(name, cmd, fresh(out / d)) for name, cmd, d, ok in copy_peers if ok],
            hash_pass(ds.snapshot),
        ], baseline="cp -rL && sync", data_bytes=ds.hub_bytes, teardown=drop_peers),
        Workload("cold_mirror_full", "Cold mirror, --full (sha256 of every byte)", [
            Command("stage mirror --full", stage("mirror", "--node", "big", "--full", "--json"), fresh(big_hub),
                    ours=True),
            Command("cp -rL && sync", copy_peers[0][1], fresh(out / "cp")),
            Command("cp -rL && sync && sha256sum", f"{copy_peers[0][1]} && {sha_all.format(d=dest('cp'))}",
                    fresh(out / "cp")),
            *([Command("rsync -aL && sync && sha256sum", f"{copy_peers[1][1]} && {sha_all.format(d=dest('rsync'))}",
                       fresh(out / "rsync"))] if peers["rsync"] else []),
            *([Command("rclone copy -L && sync && rclone check",
                       f"{copy_peers[2][1]} && rclone check -L --config /dev/null {snap} {dest('rclone')}",
                       fresh(out / "rclone"))] if peers["rclone"] else []),
            hash_pass(ds.snapshot),
        ], baseline="cp -rL && sync", data_bytes=ds.hub_bytes, teardown=drop_peers),
        # Nothing to do: each destination is filled once, untimed, by the same command. Page cache left warm.
        Workload("warm_rerun", "Warm re-run, nothing to copy", [
            _filled_once(Command("stage mirror", stage("mirror", "--node", "big", "--json"), ours=True),
                         big_hub / ds.snapshot.relative_to(ds.nas)),
            *([_filled_once(Command("rsync -aL (no-op)", f"rsync -aL {snap}/ {dest('rsync-warm')}/"),
                            out / "rsync-warm")] if peers["rsync"] else []),
            *([_filled_once(Command("rclone copy -L (no-op)",
                                    f"rclone copy -L --config /dev/null {snap} {dest('rclone-warm')}"),
                            out / "rclone-warm")] if peers["rclone"] else []),
        ], baseline="stage mirror", cold=False, teardown=drop_peers),
    ]
    result.append(_verify_workload(ds, stage, peers, out))
    result += _engram_workloads(ds, stage)
    small_hub = ds.local["small"]
    result.append(Workload("small_files", f"{ds.small_files} small files", [
        Command("stage mirror --jobs 1", stage("mirror", "--node", "small", "--jobs", "1", "--json"), fresh(small_hub),
                ours=True),
        Command("stage mirror", stage("mirror", "--node", "small", "--json"), fresh(small_hub), ours=True),
        Command("cp -rL && sync", f"cp -rL {small_snap} {dest('small-cp')} && sync", fresh(out / "small-cp")),
    ], baseline="cp -rL && sync", teardown=drop_peers))
    return result


COMPARED = " [compare]"


def with_compared(workload: Workload, stage: str) -> Workload:
    """`workload` with a twin of each of our commands right after it, running `stage` instead: a
    before/after pair measured in the same rounds, seconds apart, under the same load."""
    ours = len(stage_argv())
    commands = []
    for command in workload.commands:
        commands.append(command)
        if command.ours:
            commands.append(replace(command, name=command.name + COMPARED, argv=[stage, *command.argv[ours:]]))
    return replace(workload, commands=commands)


def compared_code(stage: Path) -> str:
    """The commit the --compare `stage` runs from: the checkout its interpreter imports stager from."""
    python = stage.with_name("python")
    try:
        where = subprocess.run([str(python), "-c", "import stager, os; print(os.path.dirname(stager.__file__))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{stage} (commit unknown)"
    return f"{stage} at {commit}"


def _filled_once(command: Command, filled: Path) -> Command:
    """`command`, preceded (untimed) by one run of itself where `filled` does not exist yet."""
    def prepare() -> None:
        if not filled.exists():
            filled.parent.mkdir(parents=True, exist_ok=True)
            run_once(command)
    return replace(command, prepare=prepare)


def _verify_workload(ds: Dataset, stage: Callable[..., list[str]], peers: dict[str, bool], out: Path) -> Workload:
    """`stage verify` over the staged big model, the coreutils/b3sum checks of the same files, and
    cp of the same bytes from the NAS."""
    snapshot = ds.local["big"] / ds.snapshot.relative_to(ds.nas)
    sums = ds.root / "SHA256SUMS"
    b3sums = ds.root / "B3SUMS"
    copy = out / "verify-cp"

    def sums_ready() -> None:
        if not snapshot.is_dir():  # run alone (--only verify): stage the model first, untimed
            run_once(Command("stage mirror", stage("mirror", "--node", "big")))
        if not sums.exists():
            names = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
            for tool, path in (("sha256sum", sums), ("b3sum", b3sums)):
                if shutil.which(tool):
                    text = subprocess.run([tool, "--", *names], cwd=snapshot, capture_output=True, text=True,
                                          check=True).stdout
                    path.write_text(text)

    def fresh_copy() -> None:
        shutil.rmtree(copy, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)

    at = shlex.quote(str(snapshot))
    return Workload("verify", "Verify the staged model", [
        Command("stage verify", stage("verify", "--node", "big"), ours=True),
        Command("stage verify --full", stage("verify", "--node", "big", "--full"), ours=True),
        Command("sha256sum -c", f"cd {at} && sha256sum --quiet -c {shlex.quote(str(sums))}"),
        *([Command("b3sum -c", f"cd {at} && b3sum --quiet -c {shlex.quote(str(b3sums))}")] if peers["b3sum"] else []),
        Command("cp -rL && sync", f"cp -rL {shlex.quote(str(ds.snapshot))} {shlex.quote(str(copy))} && sync",
                fresh_copy),
        hash_pass(snapshot),
    ], baseline="cp -rL && sync", data_bytes=ds.hub_bytes, setup=sums_ready,
        teardown=lambda: shutil.rmtree(copy, ignore_errors=True))


def _engram_workloads(ds: Dataset, stage: Callable[..., list[str]]) -> list[Workload]:
    """pack-engram of rank 0, and of every rank of the node in one run, each against cp && sync of
    files of the very sizes of the shards it writes, and h over those files."""
    shard_dir = Path(ds.engram["dir"])
    sizes = ds.engram["shard_bytes"]
    sources = ds.root / "nvme" / "engram-sized"  # one file per rank, each of its shard's size
    copies = ds.root / "nvme" / "engram-cp"
    names = [f"r{rank}.bin" for rank in range(len(sizes))]

    def sources_ready() -> None:
        for rank, (name, size) in enumerate(zip(names, sizes)):
            _fill(sources / name, size, 900 + rank)

    def fresh_shards() -> None:
        shutil.rmtree(shard_dir, ignore_errors=True)

    def fresh_copies() -> None:
        shutil.rmtree(copies, ignore_errors=True)
        copies.mkdir(parents=True)

    def drop_copies() -> None:
        shutil.rmtree(copies, ignore_errors=True)

    one = shlex.quote(str(sources / names[0]))
    world = len(sizes)
    return [
        Workload("pack_engram", "pack-engram, one rank", [
            Command("stage pack-engram --rank 0", stage("pack-engram", "--node", "engram", "--rank", "0", "--json"),
                    fresh_shards, ours=True),
            Command("cp && sync", f"cp {one} {shlex.quote(str(copies / names[0]))} && sync", fresh_copies),
            hash_pass(sources / names[0]),
        ], baseline="cp && sync", data_bytes=sizes[0], setup=sources_ready, teardown=drop_copies),
        Workload("pack_engram_node", f"pack-engram, all {world} ranks of the node", [
            Command(f"stage pack-engram ({world} ranks)", stage("pack-engram", "--node", "engram", "--json"),
                    fresh_shards, ours=True),
            Command(f"cp of the {world} ranks' bytes && sync",
                    f"cp {' '.join(shlex.quote(str(sources / n)) for n in names)} {shlex.quote(str(copies))} && sync",
                    fresh_copies),
            hash_pass(*(sources / n for n in names)),
        ], baseline=f"cp of the {world} ranks' bytes && sync", data_bytes=sum(sizes), setup=sources_ready,
            teardown=drop_copies),
    ]


# ---------------------------------------------------------------- targets and report


def targets(results: dict[str, Workload], world: int) -> list[dict]:
    def row(workload: str, command: str | None) -> dict | None:
        w = results.get(workload)
        if w is None:
            return None
        if command is None:  # the workload's own `stage` row (pack-engram names carry the rank count)
            command = next((name for name, r in w.results.items() if r["ours"]), None)
        return w.results.get(command)

    def paired(workload: str, command: str | None, key: str) -> float | None:
        r = row(workload, command)
        return r[key]["median"] if r and r.get(key) else None

    def across(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        x, y = row(*a), row(*b)
        return round(x["wall_s"]["median"] / y["wall_s"]["median"], 3) if x and y and y["wall_s"]["median"] else None

    def rss(*pairs: tuple[str, str]) -> float | None:
        values = [r["peak_rss_mib"] for r in (row(*p) for p in pairs) if r]
        return max(values) if values else None

    rows = [
        # CPU per byte: user + sys of the command against one in-process SHA-256 pass, h. The default
        # mirror copies around the page cache and hashes nothing in full: well under one hash pass.
        ("CPU: sampled mirror / h", paired("cold_mirror", "stage mirror", "cpu_per_h"), "<=", 0.5),
        ("CPU: mirror --full / h", paired("cold_mirror_full", "stage mirror --full", "cpu_per_h"), "<=", 1.5),
        ("CPU: verify --full / h", paired("verify", "stage verify --full", "cpu_per_h"), "<=", 1.3),
        ("CPU: pack-engram, one rank / h", paired("pack_engram", None, "cpu_per_h"), "<=", 2.2),
        (f"CPU: pack-engram, {world} ranks / h", paired("pack_engram_node", None, "cpu_per_h"), "<=", 2.0),
        # Wall time, against cp + sync of the same bytes in the same round.
        ("wall: cold mirror / cp -rL && sync", paired("cold_mirror", "stage mirror", "wall_ratio"), "<=", 1.0),
        ("wall: cold mirror --full / cp -rL && sync", paired("cold_mirror_full", "stage mirror --full", "wall_ratio"),
         "<=", 1.25),
        ("wall: pack-engram, one rank / cp && sync", paired("pack_engram", None, "wall_ratio"), "<=", 1.3),
        (f"wall: pack-engram, {world} ranks / cp of their bytes && sync",
         paired("pack_engram_node", None, "wall_ratio"), "<=", 1.3),
        ("wall: cold mirror / rsync -aL && sync",
         across(("cold_mirror", "stage mirror"), ("cold_mirror", "rsync -aL && sync")), "<", 1.0),
        ("wall: cold mirror / rclone copy -L && sync",
         across(("cold_mirror", "stage mirror"), ("cold_mirror", "rclone copy -L && sync")), "<", 1.0),
        ("wall: warm re-run / cold mirror", across(("warm_rerun", "stage mirror"), ("cold_mirror", "stage mirror")),
         "<=", 0.02),
        ("wall: verify --full / sha256sum -c", across(("verify", "stage verify --full"), ("verify", "sha256sum -c")),
         "<=", 0.25),
        ("wall: small files, default --jobs / cp -rL && sync", paired("small_files", "stage mirror", "wall_ratio"),
         "<=", 2.0),
        ("wall: small files, default --jobs / --jobs 1",
         across(("small_files", "stage mirror"), ("small_files", "stage mirror --jobs 1")), "<=", 1.0),
        ("pack-engram peak RSS (MiB)", rss(("pack_engram", None), ("pack_engram_node", None)), "<=", 256),
        ("mirror peak RSS (MiB)", rss(("cold_mirror", "stage mirror"), ("cold_mirror_full", "stage mirror --full"),
                                      ("warm_rerun", "stage mirror"), ("small_files", "stage mirror"),
                                      ("small_files", "stage mirror --jobs 1")), "<=", 256),
    ]
    out = []
    for name, got, op, limit in rows:
        met = None if got is None else (got <= limit if op == "<=" else got < limit)
        out.append({"target": name, "value": got, "limit": f"{op} {limit}", "met": met})
    return out


def _load_summary(report_workloads: list[Workload]) -> dict | None:
    loads = [x for w in report_workloads for r in w.rounds for x in r["load1"]]
    return _spread(loads, 2) if loads else None


def markdown(report: dict) -> str:
    data = report["data"]
    load = report.get("load1")
    lines = [
        f"Hub: {data['hub_gib']} GiB in {data['blobs']} blobs ({data['hub_bytes'] / GB:.2f} GB); Engram: "
        f"{data['engram_rows']:,} rows, TP={data['engram_world']}, rank 0 {data['engram_shard_bytes'] / GB:.3f} GB, "
        f"all ranks {data['engram_all_bytes'] / GB:.3f} GB.",
        f"Code: {report['code']}"
        + (f"; '{COMPARED.strip()}' rows: {report['compared']}" if report.get("compared") else "")
        + f". {report['reps']} timed rounds after {report['warmup']} warm-up, "
        f"the order rotated each round; "
        f"before each run: sync, page cache "
        f"{'dropped before every cold run' if report['page_cache_dropped'] else 'NOT dropped (not root)'}, "
        f"Dirty+Writeback under {SETTLED_DIRTY_KIB // 1024} MiB, {report['settle_s']} s pause.",
        "1-minute load average before the runs: " + (
            f"median {load['median']}, {load['min']}-{load['max']}." if load else "n/a."),
        "Medians (min-max over the rounds). Ratios: median of the per-round ratios. "
        "CPU: user + sys of the process tree, per GB (10^9 bytes) moved; h: one in-process SHA-256 pass.",
        "",
        "| workload | command | wall s | wall × base | CPU s (user / sys) | CPU s/GB | CPU × base | CPU × h "
        "| peak RSS MiB | in-tool s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def spread(s: dict | None, fmt: str = ".2f") -> str:
        return "" if s is None else f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    def median(s: dict | None, fmt: str = ".2f") -> str:
        return "" if s is None else f"{s['median']:{fmt}}"

    for w in report["workloads"]:
        for name, r in w["results"].items():
            mark = f"**{name}**" if r["ours"] else name
            base = " (base)" if name == w["baseline"] else ""
            cpu = f"{r['cpu_s']['median']:.2f} ({r['user_s']['median']:.2f} / {r['sys_s']['median']:.2f})"
            lines.append(
                f"| {w['title']} | {mark}{base} | {spread(r['wall_s'])} | {spread(r['wall_ratio'])} | {cpu} "
                f"| {spread(r['cpu_s_per_gb'])} | {median(r['cpu_ratio'])} | {spread(r['cpu_per_h'])} "
                f"| {r['peak_rss_mib']:.0f} | {median(r['tool_s'], '.3f')} |")
    lines += ["", "| target | measured | limit | met |", "|---|---:|---:|---|"]
    for t in report["targets"]:
        shown = "n/a" if t["value"] is None else f"{t['value']}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {shown} | {t['limit']} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default=None, help="hub size of the big model (default 2GiB; --quick: 24MiB)")
    parser.add_argument("--engram-size", default=None,
                        help="bytes of one rank's Engram shard (default 0.5GiB; --quick: 1MiB)")
    parser.add_argument("--engram-world", type=int, default=8, help="TP size of the Engram table; the node "
                        "serves every rank (default 8)")
    parser.add_argument("--small-files", type=int, default=1000, help="files in the small-files model")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per workload (default 5; --quick: 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds to pause before each run, after the sync (default 1; --quick: 0)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a new dir in /tmp)")
    parser.add_argument("--out", type=Path, default=None, help="where bench.json and bench.md go (default: workdir)")
    parser.add_argument("--only", action="append", help="run only this workload (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument("--no-install", action="store_true", help="never apt-get the peers")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--compare", type=Path, default=None, metavar="STAGE",
                        help="another `stage` executable (e.g. an older checkout's venv/bin/stage): each of our "
                             "commands also runs with it, in the same rounds, as '<command> [compare]'")
    args = parser.parse_args(argv)

    from stager.base.units import format_size, parse_size

    size = parse_size(args.size or ("24MiB" if args.quick else "2GiB"))
    engram_bytes = parse_size(args.engram_size or ("1MiB" if args.quick else "512MiB"))
    reps = args.reps or (1 if args.quick else 5)
    warmup = args.warmup
    pause = args.settle if args.settle is not None else (0.0 if args.quick else 1.0)
    if not args.quick and (reps < 5 or warmup < 1):
        parser.error("outside --quick: at least 5 timed rounds (--reps) after at least 1 warm-up (--warmup)")
    if args.engram_world < 1:
        parser.error("--engram-world must be at least 1")
    workdir = args.workdir or Path(f"/tmp/stage-bench-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or workdir
    out_dir.mkdir(parents=True, exist_ok=True)

    peers = ensure_peers(install=not args.no_install)
    can_drop = drop_caches()
    if not can_drop:
        say("cannot write /proc/sys/vm/drop_caches (not root?): cold runs may read from the page cache")
    say(f"building a {format_size(size)} hub, an Engram table of {args.engram_world} x {format_size(engram_bytes)} "
        f"and {args.small_files} small files in {workdir}")
    started = time.monotonic()
    try:
        ds = build_dataset(workdir / "data", size, engram_bytes, args.engram_world, args.small_files)
        say(f"data ready in {time.monotonic() - started:.1f}s")
        # pack-engram reads the node's staged snapshot: stage it once, untimed.
        run_once(Command("stage engram model", [*stage_argv(), "mirror", "--node", "engram", "--manifest",
                                                str(ds.manifest)]))
        chosen = [w for w in workloads(ds, peers) if not args.only or w.name in args.only]
        if args.compare:
            chosen = [with_compared(w, str(args.compare)) for w in chosen]
        load_before = os.getloadavg()
        code = code_under_test()
        for workload in chosen:
            measure(workload, reps, warmup, can_drop, pause)
        code_at_end = code_under_test()
        report = {
            "machine": {**machine(), "filesystem": filesystem_of(workdir)},
            # Each run imports stager as it is at that moment: a commit landing mid-run shows here.
            "code": code if code_at_end == code else f"{code} at the start, {code_at_end} at the end",
            "command": shlex.join([Path(sys.executable).name, "scripts/lab/bench.py", *(argv or sys.argv[1:])]),
            **({"compared": compared_code(args.compare)} if args.compare else {}),
            "reps": reps,
            "warmup": warmup,
            "order": "rotated by one command each round",
            "settle_s": pause,
            "page_cache_dropped": can_drop,
            "load1": _load_summary(chosen),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "peers_installed": peers,
            "h": "python -c: hashlib.sha256 over 8 MiB O_DIRECT reads into a page-aligned buffer",
            "data": {"hub_bytes": ds.hub_bytes, "hub_gib": round(ds.hub_bytes / GIB, 2), "blobs": ds.blobs,
                     "small_files": ds.small_files, "engram_rows": ds.engram["rows"],
                     "engram_world": ds.engram["world"], "engram_shard_bytes": ds.engram["shard_bytes"][0],
                     "engram_all_bytes": sum(ds.engram["shard_bytes"])},
            "workloads": [{"name": w.name, "title": w.title, "baseline": w.baseline, "cold": w.cold,
                           "data_bytes": w.data_bytes, "rounds": w.rounds, "results": w.results} for w in chosen],
            "targets": targets({w.name: w for w in chosen}, ds.engram["world"]),
        }
    finally:
        if not args.keep:
            shutil.rmtree(workdir / "data", ignore_errors=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "bench.md").write_text(markdown(report))
    print(markdown(report))
    say(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
