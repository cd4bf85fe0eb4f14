"""`stage audit`: Nagios exit codes provoked on a real tmpfs, orphans planted for real, and the
node_exporter textfile read back with prometheus_client's own parser and linted by promtool."""

from __future__ import annotations

import itertools
import json
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
        # Gauges, and the one counter whose total the node's journal carries across runs.
        assert family.name.startswith("stage_")
        assert family.type == "gauge" or (family.type, family.name) == ("counter", "stage_pruned_bytes")
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.geteuid() != 0:
            pytest.skip("needs promtool (Debian package prometheus)")
        pytest.fail("promtool not found: install the Debian package prometheus (scripts/test.sh does)")
    return found


# The plugin guidelines' perfdata: 'label'=value[UOM];[warn];[crit];[min];[max]
PERF = re.compile(r"'(?P<label>[^'=]+)'=(?P<value>-?\d+)(?P<uom>B);(?P<warn>[^;]*);(?P<crit>[^;]*);"
                  r"(?P<min>-?\d*);(?P<max>-?\d*)(?: |$)")


def perfdata(status_line: str) -> dict[str, dict]:
    """The perfdata after the one `|` of a Nagios status line, checked against the grammar."""
    text, sep, data = status_line.partition("|")
    assert sep and "|" not in data, status_line
    found = {m["label"]: m.groupdict() for m in PERF.finditer(data.strip())}
    assert " ".join(m.group(0).strip() for m in PERF.finditer(data.strip())) == data.strip(), data
    return found


def alerts(value: int, spec: str) -> bool:
    """Nagios threshold ranges: `N` alerts outside 0..N, `N:` below N, `~:N` above N, `A:B`
    outside A..B, and a leading `@` inverts."""
    if not spec:
        return False
    inside = spec.startswith("@")
    spec = spec.lstrip("@")
    low, colon, high = spec.partition(":")
    if not colon:
        low, high = "0", spec
    lo = float("-inf") if low == "~" else float(low or 0)
    hi = float(high) if high else float("inf")
    within = lo <= value <= hi
    return within if inside else not within


def perf_status(status_line: str) -> int:
    """The status a Nagios reader would derive from the 'free' perfdata alone."""
    free = perfdata(status_line)["free"]
    value = int(free["value"])
    return 2 if alerts(value, free["crit"]) else 1 if alerts(value, free["warn"]) else 0


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
    # The perfdata carries the same judgement: 'free' against needed + 2 x reserve and needed + reserve.
    perf = perfdata(last)
    free = int(perf["free"]["value"])
    assert perf["free"]["warn"] == f"{needed + 16 * MiB}:" and perf["free"]["crit"] == f"{needed + 8 * MiB}:"
    assert (perf["free"]["min"], perf["free"]["max"]) == ("0", str(64 * MiB))
    assert int(perf["needed"]["value"]) == needed and perf_status(last) == 1
    assert free == metrics(demo["prom"])[("stage_filesystem_free_bytes", (("node", "dgx1"), ("path", fs["mount"])))]

    # CRITICAL: needed + reserve no longer fits.
    fill(demo["root"] / "nvme" / "filler", 64 * MiB - (needed + 4 * MiB))
    critical = audit(demo, "--json")
    assert critical.code == 2
    assert critical.json["status"] == "CRITICAL" and critical.json["fits"] is False
    assert "short by" in critical.json["reason"]
    free = critical.json["filesystems"][0]["free_bytes"]
    assert needed + 8 * MiB > free >= needed
    assert perf_status(audit(demo).stdout.strip()) == 2

    # Staging the real bytes after freeing space: nothing is needed any more.
    os.unlink(demo["root"] / "nvme" / "filler")
    stage(demo["manifest"], "mirror")
    packed = stage(demo["manifest"], "pack-engram", "--rank", "0", "--json").json
    assert sum(s["bytes"] for s in packed["shards"]) == engram
    done = audit(demo, "--json")
    assert done.code == 0 and done.json["needed_bytes"] == 0
    assert perf_status(audit(demo).stdout.strip()) == 0
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
    assert set(perfdata(lines[0])) == {"free", "needed"} and perf_status(lines[0]) == 0


def test_shipped_schedules_run_the_audit(demo, tmp_path):
    """The crontab line and the systemd pair: every 15 minutes, and their command works as written."""
    set_reserve(demo["manifest"], "4MiB")
    scripts = REPO / "scripts" / "ops"
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


# ---------------------------------------------------------------- one line, links, conventions


def test_a_file_name_cannot_forge_a_status_line(demo):
    """An orphan named with a newline, a `|` and a fake status, and one that is not UTF-8 with a
    terminal escape: the status line stays the one line of stdout, the perfdata stays the only
    text after a `|`, and the textfile still parses."""
    set_reserve(demo["manifest"], "60MiB")
    blobs = demo["hub"] / FLASH_DIR / "blobs"
    blobs.mkdir(parents=True)
    forged = blobs / "big|'free'=1B;;;0;1\nSTAGE OK: dgx1: all good"
    forged.write_bytes(pseudo_random(1, 4 * MiB))
    escape = os.fsencode(blobs) + b"/\xff\x1b[2J-not-utf8\r"
    with open(escape, "wb") as out:
        out.write(pseudo_random(2, MiB))

    result = audit(demo)
    assert result.code == 2, result.stdout + result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith("STAGE CRITICAL: dgx1: ") and "\r" not in line
    assert f"largest {blobs}/big\\x7c'free'=1B;;;0;1\\nSTAGE OK: dgx1: all good (4.00 MiB) | " in line
    assert set(perfdata(line)) == {"free", "needed"} and perf_status(line) == 2
    for text in (result.stdout, result.stderr):
        assert "\x1b" not in text and "\r" not in text
        assert not [l for l in text.splitlines()[1:] if l.startswith("STAGE")]
    assert f"{blobs}/\\udcff\\x1b[2J-not-utf8\\r: no snapshot links to this blob" in result.stderr

    values = metrics(demo["prom"])
    reclaimable = {dict(labels)["path"] for name, labels in values if name == "stage_reclaimable_bytes"}
    assert {f"{blobs}/big|'free'=1B;;;0;1\\nSTAGE OK: dgx1: all good", f"{blobs}/\\udcff\\x1b[2J-not-utf8\\r"} \
        <= reclaimable
    as_json = audit(demo, "--json").json  # JSON keeps the real names, escaped by JSON itself
    assert {str(forged), os.fsdecode(escape)} <= {o["path"] for o in as_json["orphans"]}
    assert "\n" not in as_json["reason"]


def test_the_textfile_is_never_written_through_a_link(demo, tmp_path, monkeypatch):
    """A link planted at the textfile's name, or at the name of its temp file, pointing at a file
    root must not write: the link is replaced or refused, and the victim keeps its bytes."""
    set_reserve(demo["manifest"], "4MiB")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    demo["prom"].parent.mkdir()
    demo["prom"].symlink_to(victim)
    result = audit(demo)
    assert result.code == 0, result.stdout + result.stderr
    assert victim.read_bytes() == b"precious\n"
    assert not demo["prom"].is_symlink() and metrics(demo["prom"])[("stage_audit_ok", (("node", "dgx1"),))] == 1

    # An UNKNOWN run reads the old textfile for the last success: never through a link either.
    forged = tmp_path / "forged"
    forged.write_text('stage_last_success_timestamp_seconds{command="audit",node="dgx1"} 42\n')
    demo["prom"].unlink()
    demo["prom"].symlink_to(forged)
    manifest = demo["manifest"]
    good = manifest.read_text()
    manifest.write_text(good + "\nbogus = 1\n")
    unknown = audit(demo)
    assert unknown.code == 3
    assert not [key for key in metrics(demo["prom"]) if key[0] == "stage_last_success_timestamp_seconds"]
    assert forged.read_text().endswith(" 42\n") and not demo["prom"].is_symlink()
    manifest.write_text(good)

    # The temp file's name, made predictable here, taken by a link: the link is neither followed
    # nor deleted (it is not ours), another temp name is used, and the textfile is written.
    from stager.base import atomic
    from stager.housekeeping import audit as core

    monkeypatch.setattr(atomic, "_temp_numbers", itertools.count(0x5EED))
    temp = demo["prom"].with_name(".stage.prom.stage-00005eed.tmp")
    temp.symlink_to(victim)
    report = core.run_audit(str(manifest), "dgx1", str(demo["prom"]))
    assert report.status == core.OK, report.reason
    assert victim.read_bytes() == b"precious\n" and temp.is_symlink() and os.readlink(temp) == str(victim)
    assert metrics(demo["prom"])[("stage_audit_ok", (("node", "dgx1"),))] == 1


def test_metric_names_follow_the_conventions(demo):
    """Every family in the textfile, through prometheus_client's parser: base-unit suffixes at the
    end, `_total` only on counters, `_info` worth 1, documented in docs/operations.md; and
    `promtool check metrics` (Prometheus's own lint) has nothing to say."""
    set_reserve(demo["manifest"], "4MiB")
    assert audit(demo).code == 0
    text = demo["prom"].read_text()
    families = list(text_string_to_metric_families(text))
    documented = set(re.findall(r"^\| `(stage_[a-z_]+)` \|", (REPO / "docs" / "operations.md").read_text(), re.M))
    names = set()
    for family in families:
        names.add(family.name + ("_total" if family.type == "counter" else ""))  # as exposed and documented
        assert re.fullmatch(r"stage_[a-z][a-z0-9]*(_[a-z0-9]+)*", family.name), family.name
        assert family.documentation, family.name
        assert family.type in ("gauge", "counter", "info")
        for unit in ("bytes", "seconds"):
            if unit in family.name.split("_"):
                assert family.name.endswith(f"_{unit}"), f"{family.name}: the unit goes last"
        assert not re.search(r"_(byte|kb|mb|gb|kib|mib|gib|ms|millis|milliseconds|minutes|hours|count|sum|bucket)$",
                             family.name), family.name
        samples = {sample.name for sample in family.samples}
        if family.type == "counter":
            assert samples <= {f"{family.name}_total"}
        else:
            assert not family.name.endswith("_total") and samples <= {family.name}
        if "timestamp" in family.name or "Unix time" in family.documentation:
            assert family.name.endswith("_timestamp_seconds"), family.name
    assert names == documented
    values = metrics(demo["prom"])
    [(build, build_value)] = [(dict(k[1]), v) for k, v in values.items() if k[0] == "stage_build_info"]
    from stager import __version__

    assert build == {"node": "dgx1", "version": __version__} and build_value == 1
    finished = values[("stage_audit_timestamp_seconds", (("node", "dgx1"),))]
    assert values[("stage_last_success_timestamp_seconds", (("command", "audit"), ("node", "dgx1")))] == finished
    assert abs(finished - time.time()) < 120

    lint = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0 and lint.stdout.strip() == lint.stderr.strip() == "", lint.stdout + lint.stderr


def test_an_unknown_run_keeps_the_last_success(demo):
    set_reserve(demo["manifest"], "4MiB")
    assert audit(demo).code == 0
    key = ("stage_last_success_timestamp_seconds", (("command", "audit"), ("node", "dgx1")))
    success = metrics(demo["prom"])[key]
    manifest = demo["manifest"]
    good = manifest.read_text()
    manifest.write_text(good + "\nbogus = 1\n")
    time.sleep(0.01)
    assert audit(demo).code == 3
    values = metrics(demo["prom"])
    assert values[("stage_audit_status", (("node", "dgx1"),))] == 3
    assert values[key] == success < values[("stage_audit_timestamp_seconds", (("node", "dgx1"),))]
    # No earlier textfile, no earlier success: the series is absent rather than invented.
    demo["prom"].unlink()
    assert audit(demo).code == 3
    assert key not in metrics(demo["prom"])
    manifest.write_text(good)
    assert audit(demo).code == 0 and metrics(demo["prom"])[key] > success


def test_shipped_alert_rules_pass_promtool(tmp_path):
    """`promtool check rules` on the shipped file, then `promtool test rules` on its expressions
    (annotations dropped: promtool compares them verbatim, and `check rules` has parsed them)."""
    yaml = pytest.importorskip("yaml")
    tool = promtool()
    rules = REPO / "scripts" / "ops" / "stage-alerts.rules.yml"
    check = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check.stdout + check.stderr

    shipped = yaml.safe_load(rules.read_text())
    for group in shipped["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    bare = tmp_path / "rules.json"
    bare.write_text(json.dumps(shipped))
    target = {"instance": "n1:9100", "job": "node", "node": "dgx1"}

    def series(name: str, values: str, **labels: str) -> dict:
        merged = {**target, **labels}
        return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(merged.items())) + "}",
                "values": values}

    def fired(alert: str, at: str, labels: dict | None) -> dict:
        expected = [] if labels is None else [{"exp_labels": {**target, **labels}}]
        return {"eval_time": at, "alertname": alert, "exp_alerts": expected}

    tests = {"rule_files": [str(bare)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",
         "input_series": [series("stage_audit_status", "0x10 1x70 2x30"),
                          # The audit succeeded at t=0 and every run after t=30m ended UNKNOWN.
                          series("stage_last_success_timestamp_seconds", "0+60x30 1800x90", command="audit"),
                          series("stage_reserve_bytes", "100x120"),
                          series("stage_filesystem_free_bytes", "500x60 50x60", path="/nvme")],
         "alert_rule_test": [
             fired("StageAuditWarning", "40m", None),  # WARNING for 30 minutes: not yet
             fired("StageAuditWarning", "75m", {"severity": "warning"}),
             fired("StageAuditCritical", "90m", None),
             fired("StageAuditCritical", "105m", {"severity": "critical"}),
             fired("StageAuditLastSuccessStale", "95m", None),  # stale since 91m, for 10m: not yet
             fired("StageAuditLastSuccessStale", "110m", {"severity": "warning", "command": "audit"}),
             fired("StageFreeBelowReserve", "55m", None),
             fired("StageFreeBelowReserve", "75m", {"severity": "critical", "path": "/nvme"}),
         ]}]}
    spec = tmp_path / "tests.json"
    spec.write_text(json.dumps(tests))
    ran = subprocess.run([tool, "test", "rules", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0 and "SUCCESS" in ran.stdout, ran.stdout + ran.stderr


def test_perfdata_names_each_filesystem(demo):
    """engram_dir on a filesystem of its own: one 'free' and one 'needed' per mount point, each
    with its own thresholds, agreeing with the JSON figures."""
    set_reserve(demo["manifest"], "4MiB")
    with tmpfs(demo["engram"], 16 * MiB):
        [line] = audit(demo).stdout.splitlines()
        report = audit(demo, "--json").json
    perf = perfdata(line)
    assert len(report["filesystems"]) == 2
    assert set(perf) == {f"{what} {fs['mount']}" for fs in report["filesystems"] for what in ("free", "needed")}
    for fs in report["filesystems"]:
        free, needed = perf[f"free {fs['mount']}"], perf[f"needed {fs['mount']}"]
        assert (int(free["value"]), int(needed["value"]), int(free["max"])) == \
            (fs["free_bytes"], fs["needed_bytes"], fs["total_bytes"])
        assert free["crit"] == f"{fs['needed_bytes'] + 4 * MiB}:" and free["warn"] == f"{fs['needed_bytes'] + 8 * MiB}:"
