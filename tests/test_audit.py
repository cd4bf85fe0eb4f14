"""`stage audit`: Nagios exit codes provoked on a real tmpfs, orphans planted for real, and the
node_exporter textfile read back with prometheus_client's own parser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, run_stage
from hubgen import build_demo, pseudo_random
from ops_fixtures import MiB, needs_root, stage, tmpfs

FLASH_DIR = "models--acme--Flash-3bpw"


@pytest.fixture
def demo(tmp_path: Path):
    """The demo cluster with the node's disk (hub and engram_dir) on a 64 MiB tmpfs."""
    needs_root()
    root = tmp_path / "demo"
    manifest = build_demo(root)
    with tmpfs(root / "nvme", 64 * MiB):
        yield {"root": root, "manifest": manifest, "hub": root / "nvme" / "hf" / "hub",
               "engram": root / "nvme" / "engram", "prom": tmp_path / "textfile" / "stage.prom"}


def set_reserve(manifest: Path, reserve: str) -> None:
    text = manifest.read_text()
    manifest.write_text(re.sub(r'(?m)^reserve = ".*"$', f'reserve = "{reserve}"', text))


def audit(demo, *extra: str):
    demo["prom"].parent.mkdir(exist_ok=True)
    return run_stage("audit", "--node", "dgx1", "--manifest", demo["manifest"], "--prom", demo["prom"], *extra)


def metrics(path: Path) -> dict[tuple, float]:
    """(name, sorted labels) -> value, through prometheus_client's text parser."""
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        assert family.type == "gauge" and family.name.startswith("stage_")
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def fill(path: Path, size: int) -> None:
    with open(path, "wb") as out:
        for i in range(0, size, MiB):
            out.write(pseudo_random(i, min(MiB, size - i)))


def test_exit_codes_follow_real_free_space(demo):
    """OK, then WARNING, then CRITICAL as a filler takes the tmpfs's space; the figures agree with
    what the mirror and the packer would write."""
    set_reserve(demo["manifest"], "8MiB")
    ok = audit(demo, "--json")
    assert ok.code == 0, ok.stdout + ok.stderr
    report = ok.json
    weights = sum(n["bytes"] for n in report["needed"] if n["kind"] == "weights")
    engram = sum(n["bytes"] for n in report["needed"] if n["kind"] == "engram")
    dry = run_stage("mirror", "--node", "dgx1", "--manifest", demo["manifest"], "--dry-run", "--json")
    assert weights == dry.json["bytes_needed"] > 0
    [fs] = report["filesystems"]
    assert fs["mount"] == str(demo["root"] / "nvme") and fs["total_bytes"] == 64 * MiB
    assert sorted(fs["paths"]) == sorted([str(demo["hub"]), str(demo["engram"])])  # one filesystem, counted once
    assert fs["needed_bytes"] == weights + engram == report["needed_bytes"]
    needed = report["needed_bytes"]

    # WARNING: needed + reserve fits, but less than 2 x reserve would remain.
    fill(demo["root"] / "nvme" / "filler", 64 * MiB - (needed + 12 * MiB))
    warning = audit(demo)
    assert warning.code == 1, warning.stdout + warning.stderr
    last = warning.stdout.strip().splitlines()[-1]
    assert last.startswith("STAGE WARNING: dgx1: ") and "less than 2x reserve (16.00 MiB)" in last
    assert metrics(demo["prom"])[("stage_audit_ok", (("node", "dgx1"),))] == 0

    # CRITICAL: needed + reserve no longer fits.
    fill(demo["root"] / "nvme" / "filler", 64 * MiB - (needed + 4 * MiB))
    critical = audit(demo, "--json")
    assert critical.code == 2
    assert critical.json["status"] == "CRITICAL" and critical.json["fits"] is False
    assert "short by" in critical.json["reason"]
    free = critical.json["filesystems"][0]["free_bytes"]
    assert needed + 8 * MiB > free >= needed

    # Staging the real bytes after freeing space: nothing is needed any more.
    os.unlink(demo["root"] / "nvme" / "filler")
    stage(demo["manifest"], "mirror")
    packed = stage(demo["manifest"], "pack-engram", "--rank", "0", "--json").json
    assert sum(s["bytes"] for s in packed["shards"]) == engram
    done = audit(demo, "--json")
    assert done.code == 0 and done.json["needed_bytes"] == 0
    values = metrics(demo["prom"])
    assert values[("stage_audit_ok", (("node", "dgx1"),))] == 1
    assert values[("stage_filesystem_needed_bytes", (("node", "dgx1"), ("path", fs["mount"])))] == 0


def test_unknown_for_a_bad_manifest_and_an_unreachable_nas(demo):
    manifest = demo["manifest"]
    original = manifest.read_text()
    manifest.write_text(original.replace('reserve = "64MiB"', 'reserve = "64MiB"\nreserv = "1GiB"'))
    bad = audit(demo)
    assert bad.code == 3, bad.stdout + bad.stderr
    last = bad.stdout.strip().splitlines()[-1]
    assert last.startswith("STAGE UNKNOWN: dgx1: ") and "nodes.dgx1.reserv: unknown key" in last
    assert "Traceback" not in bad.stderr
    values = metrics(demo["prom"])
    assert values[("stage_audit_ok", (("node", "dgx1"),))] == 0
    assert values[("stage_audit_status", (("node", "dgx1"),))] == 3

    manifest.write_text(original)
    nas = demo["root"] / "nas"
    nas.rename(demo["root"] / "nas-away")
    try:
        gone = audit(demo, "--json")
    finally:
        (demo["root"] / "nas-away").rename(nas)
    assert gone.code == 3 and gone.json["status"] == "UNKNOWN" and gone.json["fits"] is None
    assert "not reachable" in gone.json["reason"]

    unknown_node = run_stage("audit", "--node", "dgx9", "--manifest", manifest)
    assert unknown_node.code == 3 and "nodes.dgx9: no such node" in unknown_node.stdout.strip().splitlines()[-1]


def test_unreadable_engram_geometry_is_unknown(demo):
    """A checkpoint index that cannot be used: the shards' size cannot be known, so neither can the answer."""
    snapshot = next((demo["root"] / "nas" / "hf" / "hub" / FLASH_DIR / "snapshots").iterdir())
    index = snapshot / "model.safetensors.index.json"
    blob = index.resolve()
    saved = blob.read_bytes()
    blob.write_bytes(b'{"weight_map": ["not", "an", "object"]}')
    try:
        result = audit(demo, "--json")
    finally:
        blob.write_bytes(saved)
    assert result.code == 3
    assert "Engram shards still needed" in result.json["reason"] and "weight_map" in result.json["reason"]


def test_orphans_found_with_sizes_and_exported(demo):
    set_reserve(demo["manifest"], "4MiB")
    stage(demo["manifest"], "mirror")
    stage(demo["manifest"], "pack-engram", "--rank", "0")
    hub, engram = demo["hub"], demo["engram"]
    two_hours_ago = time.time() - 7200
    planted = {}

    def plant(path: Path, size: int, kind: str | None, *, age: float | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pseudo_random(size, size))
        if age is not None:
            os.utime(path, (age, age))
        if kind:
            planted[str(path)] = (kind, size)

    # A repo blob no snapshot links to, and a shared-store payload nothing links to.
    plant(hub / FLASH_DIR / "blobs" / ("e" * 64), 1 * MiB, "blob")
    plant(hub / "blobs" / "ab" / ("ab" + "0" * 62), MiB // 2, "shared-blob")
    # Shards of another TP size (with its receipt) and of a layer the model does not have.
    plant(engram / "engram-l1-r0of2.bin", 3 * MiB, None)
    plant(engram / "engram-l1-r0of2.json", 700, None)
    planted[str(engram / "engram-l1-r0of2.bin")] = ("shard", 3 * MiB + 700)
    plant(engram / "engram-l7-r0of3.bin", 200_000, "shard")
    # Another rank at the manifest's TP size is kept on purpose: not an orphan.
    plant(engram / "engram-l1-r1of3.bin", 100_000, None)
    # Stale interrupted writes (2 h old) are orphans; a fresh one may still have a live writer.
    plant(engram / "engram-l14-r0of3.bin.partial", 300_000, "temp", age=two_hours_ago)
    plant(hub / FLASH_DIR / "blobs" / f".{'f' * 64}.stage-0123abcd.tmp", 40_000, "temp", age=two_hours_ago)
    plant(engram / "engram-l1-r2of3.bin.partial", 50_000, None, age=time.time() - 600)
    before = {str(p): os.lstat(p).st_mtime_ns for p in (demo["root"] / "nvme").rglob("*")}

    result = audit(demo, "--json")
    assert result.code == 0, result.stdout + result.stderr
    report = result.json
    found = {o["path"]: (o["kind"], o["bytes"]) for o in report["orphans"]}
    assert found == planted
    assert report["orphan_bytes"] == sum(size for _, size in planted.values())
    details = {o["path"]: o["detail"] for o in report["orphans"]}
    assert "TP2 shard" in details[str(engram / "engram-l1-r0of2.bin")]
    assert "layer 7" in details[str(engram / "engram-l7-r0of3.bin")]
    # Largest reclaimable first.
    assert report["reclaimable"][0]["path"] == str(engram / "engram-l1-r0of2.bin")
    assert [o["bytes"] for o in report["reclaimable"]] == sorted((o["bytes"] for o in report["reclaimable"]), reverse=True)
    # The audit only reads: nothing under the node's disk changed.
    assert {str(p): os.lstat(p).st_mtime_ns for p in (demo["root"] / "nvme").rglob("*")} == before

    values = metrics(demo["prom"])
    node = ("node", "dgx1")
    assert values[("stage_orphan_bytes", (("kind", "blob"), node))] == MiB
    assert values[("stage_orphan_bytes", (("kind", "shard"), node))] == 3 * MiB + 700 + 200_000
    assert values[("stage_orphan_files", (("kind", "temp"), node))] == 2
    assert values[("stage_reclaimable_bytes", (("kind", "shard"), node, ("path", str(engram / "engram-l1-r0of2.bin"))))] \
        == 3 * MiB + 700
    assert values[("stage_needed_bytes", (("model", "acme/Flash-3bpw"), node, ("path", str(hub))))] == 0
    assert values[("stage_reserve_bytes", (node,))] == 4 * MiB
    fs_free = values[("stage_filesystem_free_bytes", (node, ("path", str(demo["root"] / "nvme"))))]
    assert fs_free == os.statvfs(demo["root"] / "nvme").f_bavail * os.statvfs(demo["root"] / "nvme").f_frsize
    # Written atomically: no temp file left beside the textfile.
    assert [p.name for p in demo["prom"].parent.iterdir()] == ["stage.prom"]


def test_human_output_ends_with_the_status_line(demo):
    set_reserve(demo["manifest"], "4MiB")
    result = run_stage("audit", "--node", "dgx1", "--manifest", demo["manifest"])
    assert result.code == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[-1].startswith("STAGE OK: dgx1: ")
    assert "needs" in result.stderr


def test_shipped_schedules_run_the_audit(demo, tmp_path):
    """The crontab line and the systemd pair: every 15 minutes, and their command works as written."""
    set_reserve(demo["manifest"], "4MiB")
    scripts = REPO / "scripts"
    [line] = [l for l in (scripts / "stage-audit.cron").read_text().splitlines() if l and l[0] in "*0123456789"]
    minute, hour, dom, month, dow, user, command = line.split(None, 6)
    assert (minute, hour, dom, month, dow, user) == ("*/15", "*", "*", "*", "*", "root")
    stage_bin = str(Path(sys.executable).with_name("stage"))
    cron_command = (command.replace("/usr/local/bin/stage", stage_bin).replace('"$(hostname -s)"', "dgx1")
                    .replace("/var/lib/node_exporter/textfile_collector/stage.prom", str(demo["prom"]))
                    .replace("/var/log/stage-audit.log", str(tmp_path / "audit.log"))
                    .replace("/run/stage-audit.lock", str(tmp_path / "audit.lock")))
    demo["prom"].parent.mkdir(exist_ok=True)
    ran = subprocess.run(["sh", "-c", cron_command], env={**os.environ, "STAGE_MANIFEST": str(demo["manifest"])})
    assert ran.returncode == 0
    assert (tmp_path / "audit.log").read_text().strip().splitlines()[-1].startswith("STAGE OK: dgx1:")
    assert metrics(demo["prom"])[("stage_audit_ok", (("node", "dgx1"),))] == 1

    timer = (scripts / "stage-audit.timer").read_text()
    assert "OnCalendar=*:0/15" in timer
    service = (scripts / "stage-audit.service").read_text()
    assert "ExecStart=/usr/local/bin/stage audit --node ${STAGE_NODE} --prom ${STAGE_PROM}" in service
    if shutil.which("systemd-analyze"):
        units = tmp_path / "units"
        units.mkdir()
        (units / "stage-audit.service").write_text(service.replace("/usr/local/bin/stage", stage_bin))
        (units / "stage-audit.timer").write_text(timer)
        verify = subprocess.run(["systemd-analyze", "verify", "--man=no", str(units / "stage-audit.service"),
                                 str(units / "stage-audit.timer")], capture_output=True, text=True)
        assert verify.returncode == 0, verify.stderr
        calendar = subprocess.run(["systemd-analyze", "calendar", "--iterations=2", "*:0/15"],
                                  capture_output=True, text=True, check=True).stdout
        assert "*-*-* *:00/15:00" in calendar
