"""Every lock message names the lock's real holder, from the kernel's lock table (/proc/locks), or
says that it cannot tell; never a pid read from the lock file, which outlives its writer. The
case that showed it: the file names a pid that has died while another live process holds the
flock; a refused mirror named the dead one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import run_stage
from hubgen import build_demo
from stager.base import lock as lock_module
from stager.base.errors import CannotRun
from stager.base.lock import writer_lock

# Takes the flock, then writes a dead process's pid into the file, as an older run's leftover would.
HOLDER = r"""
import fcntl, os, sys
path, dead = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(path), exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.write(fd, f"{dead}\n".encode())
print("locked", flush=True)
sys.stdin.read()
"""


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def held_by_another(lock: Path) -> Iterator[tuple[int, int]]:
    """(the live holder's pid, the dead pid written in the file)."""
    dead = dead_pid()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(dead)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock.read_text().strip() == str(dead)
        yield proc.pid, dead
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("locks") / "demo"
    manifest = build_demo(root)
    return {"manifest": manifest, "hub": root / "nvme" / "hf" / "hub", "engram": root / "nvme" / "engram",
            "root": root}


def assert_names(stderr: str, holder: int, dead: int) -> None:
    assert f"pid {holder}" in stderr, stderr
    assert f"pid {dead}" not in stderr, stderr


@pytest.mark.parametrize("extra", [(), ("--wait", "1")], ids=["refused", "waited"])
def test_a_refused_mirror_names_the_live_holder(demo, extra):
    lock = demo["hub"] / ".locks" / "stager.lock"
    with held_by_another(lock) as (holder, dead):
        refused = run_stage("mirror", "--node", "dgx1", "--manifest", demo["manifest"], *extra)
        noted = run_stage("verify", "--node", "dgx1", "--manifest", demo["manifest"])
    assert refused.code == 3, refused.stderr
    assert_names(refused.stderr, holder, dead)
    assert f"locked by another stage process (pid {holder}){' after 1 s' if extra else ''}; lock file {lock}" \
        in refused.stderr
    assert f"note: a stage mirror (pid {holder}) is writing" in noted.stderr
    assert_names(noted.stderr, holder, dead)


def test_pack_engram_and_archive_name_the_live_holder(demo, tmp_path):
    lock = demo["engram"] / ".locks" / "engram.lock"
    with held_by_another(lock) as (holder, dead):
        refused = run_stage("pack-engram", "--node", "dgx1", "--from-nas", "--manifest", demo["manifest"])
    assert refused.code == 3, refused.stderr
    assert_names(refused.stderr, holder, dead)
    source, dest = tmp_path / "old", tmp_path / "archive"
    source.mkdir()
    (source / "engram-l1-r0of2.bin").write_bytes(b"old shard")
    with held_by_another(dest / ".stage-archive.lock") as (holder, dead):
        refused = run_stage("archive", source / "engram-l1-r0of2.bin", dest)
    assert refused.code == 3, refused.stderr
    assert_names(refused.stderr, holder, dead)
    assert (source / "engram-l1-r0of2.bin").read_bytes() == b"old shard"


def test_a_lock_table_that_cannot_tell_says_so(tmp_path, monkeypatch):
    """Where /proc/locks lists nothing (an emulated /proc), the refusal says it cannot name the
    holder instead of inventing one."""
    empty = tmp_path / "locks"
    empty.write_text("")
    monkeypatch.setattr(lock_module, "PROC_LOCKS", str(empty))
    lock = tmp_path / "hub" / ".locks" / "stager.lock"
    with held_by_another(lock) as (holder, dead):
        with pytest.raises(CannotRun) as refused:
            with writer_lock(lock, "local hub x"):
                pass
    assert str(refused.value) == f"local hub x is locked by another process, which {empty} cannot name here; " \
                                 f"lock file {lock}"
