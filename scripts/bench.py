#!/usr/bin/env python3
"""Benchmark `stage` against cp, rsync, rclone, sha256sum and b3sum on the same data, in the same run.

    python scripts/bench.py                      # 4 GiB hub, 3 timed runs after a warm-up
    python scripts/bench.py --size 16GiB --reps 5
    python scripts/bench.py --quick              # small smoke run: tiny data, 1 timed run

Every workload runs its commands interleaved (A B C A B C ...), so a noisy neighbour
slows all of them alike; what counts is the ratio to the plain-copy peer measured in
the same run.  Cold runs start from an empty destination with the page cache dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`).  Peak RSS comes from wait4() on each
command (the largest process of its tree).  Results: JSON and a Markdown table in
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hubgen  # noqa: E402

GIB = 1024**3
MIB = 1024**2
# Debian packages the peers (and the RSS meter) come from, by the command each provides.
PEER_PACKAGES = {"rsync": "rsync", "rclone": "rclone", "b3sum": "b3sum", "sha256sum": "coreutils",
                 "/usr/bin/time": "time"}
GNU_TIME = "/usr/bin/time"
MAIN_MODEL = "bench/big-model"
SMALL_MODEL = "bench/small-files"
ENGRAM_MODEL = "bench/engram-model"
# ~12 blobs of mixed sizes, as fractions of the hub size: a large first shard down to a few small ones.
BLOB_WEIGHTS = (24, 16, 12, 10, 8, 8, 6, 5, 4, 3, 2, 2)


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


def stage_argv() -> list[str]:
    """The `stage` an operator runs: the console script next to this interpreter, else `-m stager`."""
    script = Path(sys.executable).with_name("stage")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stager"]


def machine() -> dict:
    def first_line(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    with open("/proc/meminfo") as handle:
        mem_kib = int(handle.readline().split()[1])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {"nproc": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kib / MIB, 1),
            "kernel": platform.release(), "python": platform.python_version()}


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
    engram: dict  # the Engram table and the shard pack-engram writes from it


def build_dataset(root: Path, size: int, engram_rank_bytes: int, small_files: int) -> Dataset:
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
    engram = _engram_checkpoint(hub, engram_rank_bytes, root / "nvme" / "engram" / "shards")
    manifest = root / "cluster.toml"
    text = f'[nas]\nhub = "{nas}"\n\n'
    for repo_id in (MAIN_MODEL, SMALL_MODEL, ENGRAM_MODEL):
        text += f'[models."{repo_id}"]\nrevision = "main"\n\n'
    text += f'[nodes.big]\nhub = "{local["big"]}"\nmodels = ["{MAIN_MODEL}"]\n\n'
    text += f'[nodes.small]\nhub = "{local["small"]}"\nmodels = ["{SMALL_MODEL}"]\n\n'
    text += (f'[nodes.engram]\nhub = "{local["engram"]}"\nmodels = ["{ENGRAM_MODEL}"]\n'
             f'engram_dir = "{engram["dir"]}"\nrank = 0\n\n'
             f'[engram]\nmodel = "{ENGRAM_MODEL}"\nworld = {engram["world"]}\n')
    manifest.write_text(text)
    return Dataset(root, manifest, nas, big.dir, small.dir, local, _tree_bytes(big.dir), len(BLOB_WEIGHTS),
                   small_files, engram)


def _engram_checkpoint(hub: hubgen.Hub, rank_bytes: int, shard_dir: Path) -> dict:
    """An Engram checkpoint whose table (one layer) is 2 ranks of `rank_bytes` each, in its own shard."""
    world, row_bytes = 2, hubgen.ENGRAM_WEIGHT_BYTES + hubgen.ENGRAM_SCALE_BYTES
    rows = max(world, rank_bytes * world // row_bytes) | 1  # odd: the ranks differ by one row
    hubgen.add_engram_checkpoint(hub, ENGRAM_MODEL, layers=(1,), rows=rows, streamed=True)
    hi = rows // world  # rank 0 of the floor partition: rows 0..hi-1
    return {"dir": shard_dir, "world": world, "rows": rows, "shard_bytes": 4096 + hi * row_bytes}


def _tree_bytes(snapshot: Path) -> int:
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Command:
    name: str
    argv: list[str] | str  # a string runs under `sh -c` (peers chained with `&& sync`)
    prepare: Callable[[], None] | None = None  # untimed, before every run
    ours: bool = False


@dataclass
class Workload:
    name: str
    title: str
    commands: list[Command]
    baseline: str  # the plain-copy (or plain-hash) peer every ratio is taken against
    cold: bool = True
    results: dict[str, dict] = field(default_factory=dict)


def run_once(command: Command) -> tuple[float, int, float | None]:
    """Wall seconds, peak RSS (KiB) and the seconds the tool itself reported (`--json`), if any.
    Fails loudly: a benchmark of a failed copy is a lie."""
    argv = ["sh", "-c", command.argv] if isinstance(command.argv, str) else command.argv
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as rss:
        # GNU time forks the command from its own small image: a child forked from this Python
        # process starts with this process's RSS as its high-water mark, which hid every peer's.
        meter = [GNU_TIME, "-f", "%M", "-o", rss.name] if os.path.exists(GNU_TIME) else []
        started = time.perf_counter()
        proc = subprocess.Popen([*meter, *argv], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
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
    return seconds, peak, reported


def measure(workload: Workload, reps: int, warmup: int, can_drop: bool) -> None:
    times: dict[str, list[float]] = {c.name: [] for c in workload.commands}
    inside: dict[str, list[float]] = {c.name: [] for c in workload.commands}
    rss: dict[str, int] = {c.name: 0 for c in workload.commands}
    for rep in range(warmup + reps):
        for command in workload.commands:  # interleaved: A B C, A B C, ...
            if command.prepare:
                command.prepare()
            if workload.cold and can_drop:
                drop_caches()
            seconds, peak, reported = run_once(command)
            label = "warm-up" if rep < warmup else f"run {rep - warmup + 1}/{reps}"
            say(f"{workload.name}: {command.name}: {seconds:.3f}s, {peak / 1024:.0f} MiB ({label})")
            if rep >= warmup:
                times[command.name].append(seconds)
                if reported is not None:
                    inside[command.name].append(reported)
            rss[command.name] = max(rss[command.name], peak)
    base = statistics.median(times[workload.baseline])
    for command in workload.commands:
        runs = times[command.name]
        median = statistics.median(runs)
        workload.results[command.name] = {
            "command": command.argv if isinstance(command.argv, str) else shlex.join(command.argv),
            "ours": command.ours,
            "runs": [round(t, 4) for t in runs],
            "median_s": round(median, 4),
            "min_s": round(min(runs), 4),
            "max_s": round(max(runs), 4),
            "ratio": round(median / base, 3) if base > 0 else None,
            "peak_rss_mib": round(rss[command.name] / 1024, 1),
            # The tool's own `seconds` (--json): the wall time less interpreter start-up and imports.
            "tool_median_s": round(statistics.median(inside[command.name]), 4) if inside[command.name] else None,
        }


# ---------------------------------------------------------------- workloads


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
        ], baseline="cp -rL && sync"),
        Workload("cold_mirror_full", "Cold mirror, --full (sha256 of every byte)", [
            Command("stage mirror --full", stage("mirror", "--node", "big", "--full", "--json"), fresh(big_hub), ours=True),
            Command("cp -rL && sync", copy_peers[0][1], fresh(out / "cp")),
            Command("cp -rL && sync && sha256sum", f"{copy_peers[0][1]} && {sha_all.format(d=dest('cp'))}",
                    fresh(out / "cp")),
            *([Command("rsync -aL && sync && sha256sum", f"{copy_peers[1][1]} && {sha_all.format(d=dest('rsync'))}",
                       fresh(out / "rsync"))] if peers["rsync"] else []),
            *([Command("rclone copy -L && sync && rclone check",
                       f"{copy_peers[2][1]} && rclone check -L --config /dev/null {snap} {dest('rclone')}",
                       fresh(out / "rclone"))] if peers["rclone"] else []),
        ], baseline="cp -rL && sync"),
        # Nothing to do: each destination is filled once, untimed, by the same command. Page cache left warm.
        Workload("warm_rerun", "Warm re-run, nothing to copy", [
            _filled_once(Command("stage mirror", stage("mirror", "--node", "big", "--json"), ours=True),
                         big_hub / ds.snapshot.relative_to(ds.nas)),
            *([_filled_once(Command("rsync -aL (no-op)", f"rsync -aL {snap}/ {dest('rsync-warm')}/"),
                            out / "rsync-warm")] if peers["rsync"] else []),
            *([_filled_once(Command("rclone copy -L (no-op)",
                                    f"rclone copy -L --config /dev/null {snap} {dest('rclone-warm')}"),
                            out / "rclone-warm")] if peers["rclone"] else []),
        ], baseline="stage mirror", cold=False),
    ]
    result.append(_verify_workload(ds, stage, peers))
    result.append(_engram_workload(ds, stage))
    small_hub = ds.local["small"]
    result.append(Workload("small_files", f"{ds.small_files} small files", [
        Command("stage mirror --jobs 1", stage("mirror", "--node", "small", "--jobs", "1", "--json"), fresh(small_hub),
                ours=True),
        Command("stage mirror", stage("mirror", "--node", "small", "--json"), fresh(small_hub), ours=True),
        Command("cp -rL && sync", f"cp -rL {small_snap} {dest('small-cp')} && sync", fresh(out / "small-cp")),
    ], baseline="cp -rL && sync"))
    return result


def _filled_once(command: Command, filled: Path) -> Command:
    """`command`, preceded (untimed) by one run of itself where `filled` does not exist yet."""
    def prepare() -> None:
        if not filled.exists():
            filled.parent.mkdir(parents=True, exist_ok=True)
            run_once(command)
    return replace(command, prepare=prepare)


def _verify_workload(ds: Dataset, stage: Callable[..., list[str]], peers: dict[str, bool]) -> Workload:
    """`stage verify` over the staged big model, and the coreutils/b3sum checks of the same files."""
    snapshot = ds.local["big"] / ds.snapshot.relative_to(ds.nas)
    sums = ds.root / "SHA256SUMS"
    b3sums = ds.root / "B3SUMS"

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

    at = shlex.quote(str(snapshot))
    return Workload("verify", "Verify the staged model", [
        Command("stage verify", stage("verify", "--node", "big"), sums_ready, ours=True),
        Command("stage verify --full", stage("verify", "--node", "big", "--full"), ours=True),
        Command("sha256sum -c", f"cd {at} && sha256sum --quiet -c {shlex.quote(str(sums))}"),
        *([Command("b3sum -c", f"cd {at} && b3sum --quiet -c {shlex.quote(str(b3sums))}")] if peers["b3sum"] else []),
    ], baseline="sha256sum -c")


def _engram_workload(ds: Dataset, stage: Callable[..., list[str]]) -> Workload:
    shard_dir = Path(ds.engram["dir"])
    same_size = ds.root / "nvme" / "shard-sized.bin"
    copy = shard_dir.parent / "cp-of-shard.bin"

    def fresh_shards() -> None:
        shutil.rmtree(shard_dir, ignore_errors=True)

    def fresh_copy() -> None:
        if not same_size.exists() or same_size.stat().st_size != ds.engram["shard_bytes"]:
            _, chunks = hubgen.streamed_safetensors(99, ds.engram["shard_bytes"])
            with open(same_size, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
            os.truncate(same_size, ds.engram["shard_bytes"])
        copy.unlink(missing_ok=True)

    return Workload("pack_engram", "pack-engram, one rank", [
        Command("stage pack-engram", stage("pack-engram", "--node", "engram", "--rank", "0", "--json"), fresh_shards,
                ours=True),
        Command("cp && sync", f"cp {shlex.quote(str(same_size))} {shlex.quote(str(copy))} && sync", fresh_copy),
    ], baseline="cp && sync")


# ---------------------------------------------------------------- targets and report


def targets(results: dict[str, Workload]) -> list[dict]:
    def value(workload: str, command: str, key: str = "median_s") -> float | None:
        w = results.get(workload)
        return w.results.get(command, {}).get(key) if w else None

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        x, y = value(*a), value(*b)
        return round(x / y, 3) if x is not None and y else None

    rows = [
        ("cold mirror / cp -rL && sync", ratio(("cold_mirror", "stage mirror"), ("cold_mirror", "cp -rL && sync")),
         "<=", 1.10),
        ("cold mirror / rsync -aL && sync", ratio(("cold_mirror", "stage mirror"), ("cold_mirror", "rsync -aL && sync")),
         "<", 1.0),
        ("cold mirror / rclone copy -L && sync",
         ratio(("cold_mirror", "stage mirror"), ("cold_mirror", "rclone copy -L && sync")), "<", 1.0),
        ("cold mirror --full / cp -rL && sync",
         ratio(("cold_mirror_full", "stage mirror --full"), ("cold_mirror_full", "cp -rL && sync")), "<=", 1.25),
        ("warm re-run / cold mirror", ratio(("warm_rerun", "stage mirror"), ("cold_mirror", "stage mirror")),
         "<=", 0.02),
        ("verify --full / sha256sum -c", ratio(("verify", "stage verify --full"), ("verify", "sha256sum -c")),
         "<=", 0.25),
        ("pack-engram / cp of the shard's bytes", ratio(("pack_engram", "stage pack-engram"), ("pack_engram", "cp && sync")),
         "<=", 1.3),
        ("pack-engram peak RSS (MiB)", value("pack_engram", "stage pack-engram", "peak_rss_mib"), "<=", 256),
        ("mirror peak RSS (MiB)", max((v for v in (value(w, c, "peak_rss_mib") for w, c in (
            ("cold_mirror", "stage mirror"), ("cold_mirror_full", "stage mirror --full"),
            ("warm_rerun", "stage mirror"), ("small_files", "stage mirror"), ("small_files", "stage mirror --jobs 1")))
            if v is not None), default=None), "<=", 256),
        ("small files, default --jobs / cp -rL && sync",
         ratio(("small_files", "stage mirror"), ("small_files", "cp -rL && sync")), "<", 3.0),
        ("small files, default --jobs / --jobs 1",
         ratio(("small_files", "stage mirror"), ("small_files", "stage mirror --jobs 1")), "<=", 1.0),
    ]
    out = []
    for name, got, op, limit in rows:
        met = None if got is None else (got <= limit if op == "<=" else got < limit)
        out.append({"target": name, "value": got, "limit": f"{op} {limit}", "met": met})
    return out


def markdown(report: dict) -> str:
    lines = [f"Hub: {report['data']['hub_gib']} GiB in {report['data']['blobs']} blobs; "
             f"{report['reps']} timed runs after {report['warmup']} warm-up, interleaved; "
             f"page cache {'dropped before every cold run' if report['page_cache_dropped'] else 'NOT dropped (not root)'}.",
             "", "| workload | command | median s | min-max s | ratio | peak RSS MiB | in-tool s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for w in report["workloads"]:
        for name, r in w["results"].items():
            mark = f"**{name}**" if r["ours"] else name
            base = " (base)" if name == w["baseline"] else ""
            lines.append(f"| {w['title']} | {mark}{base} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} "
                         f"| {r['ratio']:.2f} | {r['peak_rss_mib']:.0f} "
                         f"| {'' if r['tool_median_s'] is None else format(r['tool_median_s'], '.3f')} |")
    lines += ["", "| target | measured | limit | met |", "|---|---:|---:|---|"]
    for t in report["targets"]:
        shown = "n/a" if t["value"] is None else f"{t['value']}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {shown} | {t['limit']} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default=None, help="hub size of the big model (default 4GiB; --quick: 24MiB)")
    parser.add_argument("--engram-size", default=None, help="bytes of one rank's Engram shard (default 1.1GiB)")
    parser.add_argument("--small-files", type=int, default=1000, help="files in the small-files model")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per command (default 3; --quick: 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a new dir in /tmp)")
    parser.add_argument("--out", type=Path, default=None, help="where bench.json and bench.md go (default: workdir)")
    parser.add_argument("--only", action="append", help="run only this workload (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument("--no-install", action="store_true", help="never apt-get the peers")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args(argv)

    from stager.units import format_size, parse_size

    size = parse_size(args.size or ("24MiB" if args.quick else "4GiB"))
    engram_bytes = parse_size(args.engram_size or ("4MiB" if args.quick else "1.1GiB"))
    reps = args.reps or (1 if args.quick else 3)
    warmup = args.warmup
    if not args.quick and (reps < 3 or warmup < 1):
        parser.error("outside --quick: at least 3 timed runs (--reps) after at least 1 warm-up (--warmup)")
    workdir = args.workdir or Path(f"/tmp/stage-bench-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or workdir
    out_dir.mkdir(parents=True, exist_ok=True)

    peers = ensure_peers(install=not args.no_install)
    can_drop = drop_caches()
    if not can_drop:
        say("cannot write /proc/sys/vm/drop_caches (not root?): cold runs may read from the page cache")
    say(f"building a {format_size(size)} hub and {args.small_files} small files in {workdir}")
    started = time.monotonic()
    try:
        ds = build_dataset(workdir / "data", size, engram_bytes, args.small_files)
        say(f"data ready in {time.monotonic() - started:.1f}s")
        # pack-engram reads the node's staged snapshot: stage it once, untimed.
        run_once(Command("stage engram model", [*stage_argv(), "mirror", "--node", "engram", "--manifest",
                                                str(ds.manifest)]))
        chosen = [w for w in workloads(ds, peers) if not args.only or w.name in args.only]
        for workload in chosen:
            measure(workload, reps, warmup, can_drop)
        report = {
            "machine": {**machine(), "filesystem": filesystem_of(workdir)},
            "command": shlex.join([Path(sys.executable).name, "scripts/bench.py", *(argv or sys.argv[1:])]),
            "reps": reps,
            "warmup": warmup,
            "page_cache_dropped": can_drop,
            "peers_installed": peers,
            "data": {"hub_bytes": ds.hub_bytes, "hub_gib": round(ds.hub_bytes / GIB, 2), "blobs": ds.blobs,
                     "small_files": ds.small_files,
                     "engram_shard_bytes": ds.engram["shard_bytes"]},
            "workloads": [{"name": w.name, "title": w.title, "baseline": w.baseline, "cold": w.cold,
                           "results": w.results} for w in chosen],
            "targets": targets({w.name: w for w in chosen}),
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
