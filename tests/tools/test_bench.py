"""scripts/lab/bench.py end to end on a tiny hub: every workload runs, every peer is there, ratios and CPU per
byte are computed; and the measuring itself: rounds rotate their order, CPU covers the whole process tree."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = ("rsync", "rclone", "b3sum")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", REPO / "scripts" / "lab" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_quick_bench_reports_every_workload_peer_and_ratio(tmp_path: Path):
    missing = [peer for peer in PEERS if shutil.which(peer) is None]
    if missing and not os.environ.get("CI"):
        pytest.skip(f"peers not installed: {', '.join(missing)} (scripts/test.sh installs them)")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "lab" / "bench.py"), "--quick", "--size", "3MiB", "--engram-size", "1MiB",
         "--small-files", "60", "--reps", "1", "--warmup", "0", "--no-install",
         "--keep", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    table = (out / "bench.md").read_text()

    h = "h: sha256 pass (hashlib)"
    commands = {w["name"]: w["results"] for w in report["workloads"]}
    expected = {
        "cold_mirror": ["stage mirror", "cp -rL && sync", "rsync -aL && sync", "rclone copy -L && sync", h],
        "cold_mirror_full": ["stage mirror --full", "cp -rL && sync", "cp -rL && sync && sha256sum",
                             "rsync -aL && sync && sha256sum", "rclone copy -L && sync && rclone check", h],
        "warm_rerun": ["stage mirror", "rsync -aL (no-op)", "rclone copy -L (no-op)"],
        "verify": ["stage verify", "stage verify --full", "sha256sum -c", "b3sum -c", "cp -rL && sync", h],
        "pack_engram": ["stage pack-engram --rank 0", "cp && sync", h],
        "pack_engram_node": ["stage pack-engram (8 ranks)", "cp of the 8 ranks' bytes && sync", h],
        "small_files": ["stage mirror --jobs 1", "stage mirror", "cp -rL && sync"],
    }
    assert set(commands) == set(expected)
    per_byte = {w["name"] for w in report["workloads"] if w["data_bytes"]}
    assert per_byte == {"cold_mirror", "cold_mirror_full", "verify", "pack_engram", "pack_engram_node"}
    for workload, names in expected.items():
        assert list(commands[workload]) == names, workload
        for name in names:
            row = commands[workload][name]
            assert len(row["runs"]) == 1 and row["wall_s"]["median"] > 0
            assert row["wall_s"]["min"] <= row["wall_s"]["median"] <= row["wall_s"]["max"]
            assert row["wall_ratio"]["median"] > 0 and row["peak_rss_mib"] > 0
            assert row["cpu_s"]["median"] > 0
            assert row["cpu_s"]["median"] == pytest.approx(row["user_s"]["median"] + row["sys_s"]["median"], abs=2e-3)
            if workload in per_byte:
                assert row["cpu_s_per_gb"]["median"] > 0 and row["cpu_per_h"]["median"] > 0
            else:
                assert row["cpu_s_per_gb"] is None and row["cpu_per_h"] is None
            assert f"| {name}" in table or f"| **{name}**" in table
    # The baseline's ratios are 1 by definition, h's against itself too; ours report their own in-tool seconds.
    assert commands["cold_mirror"]["cp -rL && sync"]["wall_ratio"]["median"] == 1.0
    assert commands["cold_mirror"]["cp -rL && sync"]["cpu_ratio"]["median"] == 1.0
    assert commands["pack_engram_node"][h]["cpu_per_h"]["median"] == 1.0
    assert commands["cold_mirror"]["stage mirror"]["tool_s"]["median"] > 0
    # Cold runs drop the page cache where they may, and the table says which it was; the load is reported.
    dropped = report["page_cache_dropped"]
    assert ("dropped before every cold run" if dropped else "NOT dropped") in table
    assert report["load1"]["min"] <= report["load1"]["max"] and "load average" in table

    # Every target has a measured value and a verdict; the table lists each one, the among them.
    names = [t["target"] for t in report["targets"]]
    for wanted in ("CPU: sampled mirror / h", "CPU: mirror --full / h", "CPU: verify --full / h",
                   "CPU: pack-engram, one rank / h", "CPU: pack-engram, 8 ranks / h",
                   "wall: cold mirror / cp -rL && sync", "wall: pack-engram, one rank / cp && sync",
                   "wall: pack-engram, 8 ranks / cp of their bytes && sync"):
        assert wanted in names
    for target in report["targets"]:
        assert target["value"] is not None and target["met"] in (True, False), target
        assert f"| {target['target']} |" in table

    # What the bench timed was a real copy: the staged big model's LFS files hash to the sha256 the
    # NAS's trees/<commit>.json lists, and the pack-engram shards have their documented sizes.
    data = tmp_path / "work" / "data"
    trees = list((data / "nas" / "hf" / "hub" / "models--bench--big-model" / "trees").glob("*.json"))
    listing = json.loads(trees[0].read_text())["files"]
    snapshot = data / "nvme" / "big" / "hf" / "hub" / "models--bench--big-model" / "snapshots" / trees[0].stem
    lfs = {path: meta["lfs_sha256"] for path, meta in listing.items() if "lfs_sha256" in meta}
    assert len(lfs) == 12
    sums = "".join(f"{sha}  {path}\n" for path, sha in lfs.items())
    check = subprocess.run(["sha256sum", "--quiet", "-c", "-"], input=sums, cwd=snapshot, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    shards = data / "nvme" / "engram" / "shards"
    assert (shards / "engram-l1-r0of8.bin").stat().st_size == report["data"]["engram_shard_bytes"]
    assert sum((shards / f"engram-l1-r{r}of8.bin").stat().st_size for r in range(8)) \
        == report["data"]["engram_all_bytes"]
    check = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=shards, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_rounds_rotate_which_command_runs_first_and_cpu_covers_the_process_tree():
    bench = load_bench()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.15: pass"
    commands = [
        bench.Command("a", ["true"]),
        # CPU burnt by a grandchild (sh -> python) counts: wait4 covers every descendant waited for.
        bench.Command("b", f"{shlex.quote(sys.executable)} -c {shlex.quote(burn)}"),
        bench.Command("c", ["true"]),
    ]
    workload = bench.Workload("w", "w", commands, baseline="a", data_bytes=10**9, cold=False)
    bench.measure(workload, reps=3, warmup=0, can_drop=False, pause=0)

    assert [r["order"] for r in workload.rounds] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(len(r["load1"]) == 3 for r in workload.rounds)
    burnt = workload.results["b"]
    assert len(burnt["runs"]) == 3 and burnt["cpu_s"]["min"] >= 0.14
    assert burnt["cpu_s_per_gb"]["median"] == pytest.approx(burnt["cpu_s"]["median"], abs=1e-3)  # 1 GB moved
    assert workload.results["a"]["wall_ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}


def test_compare_runs_another_stage_in_the_same_rounds(tmp_path: Path):
    """--compare STAGE: each of our commands gets a twin running that executable, in the same
    rounds, and the report names the commit it ran from."""
    stage = Path(sys.executable).with_name("stage")
    if not stage.exists():
        pytest.skip("no `stage` console script beside this interpreter")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "lab" / "bench.py"), "--quick", "--size", "3MiB", "--engram-size", "1MiB",
         "--small-files", "10", "--reps", "2", "--warmup", "0", "--no-install", "--only", "cold_mirror",
         "--compare", str(stage), "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    (workload,) = report["workloads"]
    assert list(workload["results"])[:2] == ["stage mirror", "stage mirror [compare]"]
    twin = workload["results"]["stage mirror [compare]"]
    assert twin["wall_ratio"]["median"] > 0 and twin["cpu_per_h"]["median"] > 0
    assert all("stage mirror [compare]" in r["order"] for r in workload["rounds"])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert report["compared"] == f"{stage} at {head.strip()}"
    assert "'[compare]' rows:" in (out / "bench.md").read_text()
