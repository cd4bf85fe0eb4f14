"""`stage audit` next to running writers, with real processes: a writer's lock held by another
process (and by a real `stage mirror`, frozen mid-copy), files renamed and deleted while the audit
lists them, and the kernel's lock table hidden from the audit."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_stage
from hubgen import build_demo
from reliability_support import MiB, build_staging, holding, needs_root, temp_files

TWO_DAYS = 48 * 3600  # taken from the clock when a file is aged: the module may run minutes after it is imported
FLASH_BLOBS = "models--acme--Flash-3bpw/blobs"

@pytest.fixture
def demo(tmp_path: Path) -> dict:
    root = tmp_path / "demo"
    manifest = build_demo(root)
    text = manifest.read_text()
    manifest.write_text(re.sub(r'(?m)^reserve = ".*"$', 'reserve = "1MiB"', text))
    hub, engram = root / "nvme" / "hf" / "hub", root / "nvme" / "engram"
    (hub / FLASH_BLOBS).mkdir(parents=True)
    engram.mkdir(parents=True)
    return {"root": root, "manifest": manifest, "hub": hub, "engram": engram}


def audit(manifest: Path, *extra: str):
    result = run_stage("audit", "--node", "dgx1", "--manifest", manifest, "--json", *extra)
    assert result.code != 3 and "Traceback" not in result.stderr, result.stdout + result.stderr
    return result.json


def old_temp(path: Path, size: int = 4096) -> Path:
    """A temp file as a writer leaves it just before its rename: complete, with the NAS's old mtime."""
    path.write_bytes(b"\0" * size)
    aged = time.time() - TWO_DAYS
    os.utime(path, (aged, aged))
    return path


def temps(report: dict) -> dict[str, str]:
    return {o["path"]: o["detail"] for o in report["orphans"] if o["kind"] == "temp"}


def writer_case(demo: dict, writer: str) -> tuple[Path, Path]:
    """(the writer's lock, a temp file of that writer with an old mtime)."""
    hub, engram = demo["hub"], demo["engram"]
    if writer == "mirror":
        return hub / ".locks" / "stager.lock", old_temp(hub / FLASH_BLOBS / f".{'f' * 64}.stage-0123abcd.tmp")
    if writer == "pack-engram":
        return engram / ".locks" / "engram.lock", old_temp(engram / ".engram-l1-r0of3.bin.stage-89abcdef.tmp")
    if writer == "huggingface_hub":  # a download stalled for two days, its process still alive
        return (hub / ".locks" / "models--acme--Flash-3bpw" / f"{'e' * 64}.lock",
                old_temp(hub / FLASH_BLOBS / f"{'e' * 64}.incomplete"))
    # `stage archive /old/engram <root>/nvme` copies into <root>/nvme/engram, under its own lock in DEST.
    return demo["root"] / "nvme" / ".stage-archive.lock", old_temp(engram / ".engram-l1-r0of2.bin.stage-0badcafe.tmp")


@pytest.mark.parametrize("writer", ["mirror", "pack-engram", "archive", "huggingface_hub"])
def test_a_live_writers_temp_file_is_not_interrupted_until_the_writer_exits(demo, writer):
    lock, temp = writer_case(demo, writer)
    with holding(lock) as holder:
        during = audit(demo["manifest"])
        assert str(temp) not in temps(during)
        [live] = [t for t in during["live_temps"] if t["path"] == str(temp)]
        assert live["detail"] == f"being written: pid {holder.pid} holds {lock}" and live["bytes"] == 4096
        assert str(temp) not in {o["path"] for o in during["reclaimable"]}
        # The audit did not take the lock: the holder still has it, and nobody waited on it.
        assert (lock.read_text().strip(), holder.poll()) == (str(holder.pid), None)
    after = audit(demo["manifest"])
    assert temps(after)[str(temp)] == "interrupted write, untouched for 48.0 h"
    assert after["live_temps"] == []


def wait_stopped(pid: int) -> None:
    """SIGSTOP is delivered to each thread on its way back from the kernel: wait until all are 'T'."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                states.append(Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop")


def test_a_frozen_real_mirror_keeps_its_temp_files_until_it_is_killed(tmp_path):
    """A real `stage mirror`, stopped with SIGSTOP while its copies are in flight; its temp files
    are given an mtime two days old, as the mirror stamps the NAS's mtime before each rename.
    Then kill -9, which leaves them behind for real."""
    staging = build_staging(tmp_path, shards=6, shard_bytes=8 * MiB)
    mirror = subprocess.Popen(staging.command("mirror"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not temp_files(staging.local) and mirror.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(mirror.pid, signal.SIGSTOP)
        wait_stopped(mirror.pid)
        in_flight = temp_files(staging.local)
        assert in_flight, "the mirror finished before a copy was seen in flight"
        for path in in_flight:
            aged = time.time() - TWO_DAYS
            os.utime(path, (aged, aged))
        during = audit(staging.manifest)
        assert temps(during) == {}
        lock = staging.local / ".locks" / "stager.lock"
        assert {t["path"]: t["detail"] for t in during["live_temps"]} == \
            {path: f"being written: pid {mirror.pid} holds {lock}" for path in in_flight}
    finally:
        os.kill(mirror.pid, signal.SIGKILL)
        mirror.wait(timeout=30)
    after = audit(staging.manifest)
    assert temps(after) == {path: "interrupted write, untouched for 48.0 h" for path in in_flight}
    assert after["orphan_bytes"] >= sum(os.lstat(p).st_size for p in in_flight)


def test_a_lock_table_that_cannot_tell_keeps_temp_files_live(demo):
    """/proc/locks hidden behind an empty file (a private mount namespace): the table no longer
    shows even the audit's own probe lock, so no temp file is called interrupted."""
    needs_root()
    if not shutil.which("unshare"):
        pytest.skip("needs unshare (util-linux)")
    _lock, temp = writer_case(demo, "mirror")
    empty = demo["root"] / "empty"
    empty.write_text("")
    stage = [sys.executable, "-m", "stager", "audit", "--node", "dgx1", "--manifest", str(demo["manifest"]), "--json"]
    script = f'mount --bind "{empty}" /proc/locks && exec "$@"'
    hidden = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *stage],
                            capture_output=True, text=True, timeout=120)
    assert "Traceback" not in hidden.stderr and hidden.returncode != 3, hidden.stdout + hidden.stderr
    report = __import__("json").loads(hidden.stdout)
    assert str(temp) not in temps(report)
    [live] = report["live_temps"]
    assert live["path"] == str(temp) and "cannot tell from /proc/locks" in live["detail"]
    # The same tree, with the real table: nobody holds the lock, so it is an interrupted write.
    assert str(temp) in temps(audit(demo["manifest"]))


@pytest.mark.parametrize("command", ["audit", "verify"])
def test_the_audit_takes_no_lock(demo, command):
    """Every flock the audit's (or verify's) process makes, recorded: only its anonymous probe, never
    a writer's lock file (taking one, even briefly, could make a mirror starting then exit 3 "locked")."""
    lock, _temp = writer_case(demo, "mirror")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    log = demo["root"] / "flocks.log"
    wrapper = (
        "import fcntl, os, sys\n"
        "real, log_path = fcntl.flock, sys.argv[1]\n"
        "def flock(fd, op):\n"
        "    with open(log_path, 'a') as log:\n"
        "        log.write(os.readlink(f'/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}') + '\\n')\n"
        "    return real(fd, op)\n"
        "fcntl.flock = flock\n"
        "sys.argv = ['stage'] + sys.argv[2:]\n"
        "from stager.cli import main\n"
        "main()\n")
    ran = subprocess.run([sys.executable, "-c", wrapper, str(log), command, "--node", "dgx1", "--manifest",
                          str(demo["manifest"])], capture_output=True, text=True, timeout=120)
    assert ran.returncode in (0, 1, 2), ran.stdout + ran.stderr
    taken = log.read_text().splitlines() if log.exists() else []
    assert taken and all(path.startswith("/memfd:stage-lock-probe") for path in taken), taken


CHURN = r"""
import os, sys, time
hub, engram, stop = sys.argv[1:4]
old = time.time() - 48 * 3600
blobs = os.path.join(hub, "models--acme--Flash-3bpw", "blobs")
shared = os.path.join(hub, "blobs", "cd")
gone = os.path.join(hub, "models--acme--Gone", "blobs")
rounds = 0
while not os.path.exists(stop):
    made = []
    os.makedirs(shared, exist_ok=True)
    os.makedirs(gone, exist_ok=True)
    for i in range(60):
        for path in (os.path.join(blobs, "%08x%056x" % (rounds, i)),
                     os.path.join(blobs, ".%056x.stage-%08x.tmp" % (i, rounds & 0xffffffff)),
                     os.path.join(blobs, "%064x" % i) + ".incomplete",
                     os.path.join(shared, "cd%062x" % i),
                     os.path.join(gone, "%064x" % i),
                     os.path.join(engram, "engram-l%d-r0of2.bin" % i),
                     os.path.join(engram, ".engram-l%d-r0of3.bin.stage-%08x.tmp" % (i, rounds & 0xffffffff))):
            with open(path, "wb") as out:
                out.write(b"x" * 512)
            os.utime(path, (old, old))
            made.append(path)
        link = os.path.join(blobs, "link%060x" % i)
        os.symlink("../../blobs/cd/cd%062x" % i, link)
        made.append(link)
    for path in made:
        os.unlink(path)
    os.rmdir(gone)
    os.rmdir(os.path.dirname(gone))
    rounds += 1
    if rounds == 1:
        open(stop + ".churning", "w").close()
print(rounds)
"""


def test_entries_vanishing_during_the_scan_are_skipped(demo):
    """A process creates and deletes files as fast as it can in every place the audit lists
    (repo blobs, links, the shared store, a whole repo, temp files, Engram shards) while the audit
    runs again and again: never UNKNOWN, never a traceback."""
    stop = demo["root"] / "stop"
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(demo["hub"]), str(demo["engram"]), str(stop)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = []
    try:
        # The audits start once the churn has gone round once, so that every one of them runs into it.
        deadline = time.monotonic() + 60
        while not (demo["root"] / "stop.churning").exists() and churn.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(12):
            results.append(run_stage("audit", "--node", "dgx1", "--manifest", demo["manifest"]))
    finally:
        stop.touch()
        out, err = churn.communicate(timeout=60)
    assert churn.returncode == 0 and int(out) >= 2, err
    for result in results:
        assert "Traceback" not in result.stderr, result.stderr
        assert result.code != 3, result.stdout + result.stderr
        [status] = result.stdout.splitlines()
        assert re.match(r"STAGE (OK|WARNING|CRITICAL): dgx1: ", status), status


@pytest.mark.parametrize("writer", ["mirror", "pack-engram", "archive"])
def test_the_locks_the_audit_checks_are_the_writers_own(demo, writer):
    """While a process holds the lock the audit checks for a writer, that real writer refuses
    with exit 3 naming the same lock file: the audit and the writers agree on the names."""
    lock, _temp = writer_case(demo, writer)
    manifest = ["--node", "dgx1", "--manifest", str(demo["manifest"])]
    if writer == "archive":
        source = demo["root"] / "old" / "engram"
        source.mkdir(parents=True)
        (source / "engram-l1-r0of2.bin").write_bytes(b"x" * 1000)
        command = ["archive", str(source), str(demo["root"] / "nvme")]
    else:
        command = [writer, *(["--rank", "0", "--from-nas"] if writer == "pack-engram" else []), *manifest]
    with holding(lock) as holder:
        refused = run_stage(*command)
    assert refused.code == 3, refused.stdout + refused.stderr
    assert f"locked by another stage process (pid {holder.pid})" in refused.stderr
    assert str(lock) in refused.stderr
