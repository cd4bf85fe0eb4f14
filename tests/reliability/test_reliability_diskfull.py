"""Disk full, for real: a small tmpfs as the node-local hub, and a filler process that takes the
space away while the mirror runs."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reliability_support import (MiB, assert_converged, assert_engram_converged, assert_engram_truthful,
                                 assert_hub_truthful, build_staging, expected_shards, needs_root, temp_files, tmpfs,
                                 untouched)

SHARDS = 10
# Above execute.SMALL_FILE: each shard takes its final name as soon as it is checked. Smaller
# files are published in batches, so a run stopped part-way would show none of them.
SHARD_BYTES = 5 * MiB

# Waits until a file matching one of the globs has landed under a final name, then takes every
# free byte of the filesystem with one fallocate (then writes, for filesystems that lack it).
FILLER = r"""
import errno, glob, os, sys, time
filler, patterns = sys.argv[1], sys.argv[2:]
os.nice(-10)  # root: get scheduled ahead of the run it races
print("ready", flush=True)
def landed():
    return any(os.path.isfile(p) and not os.path.basename(p).startswith(".")
               for pattern in patterns for p in glob.glob(pattern))
while not landed():
    time.sleep(0.001)
fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
st = os.statvfs(filler)
try:
    os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
except OSError:
    pass
chunk = b"\0" * (1 << 20)
try:
    while True:
        os.write(fd, chunk)
except OSError as exc:
    assert exc.errno == errno.ENOSPC
os.close(fd)
print("filled", flush=True)
"""


def run_with_filler(run, filler_path: Path, patterns: list[str], start_over) -> object:
    """`run()` while a filler takes all free space once the first file matching `patterns` lands.

    On a loaded machine the run can finish before the filler is scheduled; that attempt proves
    nothing, so `start_over()` resets and it is tried again (three attempts at most).
    """
    for _attempt in range(3):
        filler = subprocess.Popen([sys.executable, "-c", FILLER, str(filler_path), *patterns],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert filler.stdout.readline().strip() == "ready"
            result = run()
            assert filler.wait(timeout=30) == 0 and filler.stdout.readline().strip() == "filled"
        finally:
            filler.kill()
            filler.wait()
        if result.code != 0:
            return result
        os.unlink(filler_path)
        start_over()
    pytest.fail("the run finished before the filler could take the space, three times")


def assert_stopped_on_enospc(result, root: Path) -> None:
    """Exit 3, one line naming the file under `root` being written, and no temp file left."""
    assert result.code == 3, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"stage: error: no space left on device while writing (\S+)", message)
    assert match, message
    assert match.group(1).startswith(str(root) + "/"), "the message names the file being written"
    assert temp_files(root) == [], "a disk-full stop leaves no temp file behind"


@pytest.fixture
def small_disk(tmp_path):
    needs_root()
    mount = tmp_path / "nvme"
    staging = build_staging(tmp_path, shards=SHARDS, shard_bytes=SHARD_BYTES, local=mount / "hf" / "hub")
    needed = sum(p.stat().st_size for p in (staging.nas / "blobs").rglob("*") if p.is_file()) + sum(
        p.stat().st_size for p in staging.snapshot.repo.dir.rglob("*") if p.is_file() and not p.is_symlink())
    with tmpfs(mount, needed + 4 * MiB):
        yield staging, mount, needed


def clear(directory: Path) -> None:
    """Empty a mount point, keeping it."""
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def fill_up(path: Path) -> None:
    with open(path, "wb") as handle:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                handle.write(b"\0" * MiB)
                handle.flush()


def regular_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and ".locks" not in p.parts]


def test_preflight_refuses_and_copies_nothing(tmp_path):
    needs_root()
    mount = tmp_path / "nvme"
    staging = build_staging(tmp_path, shards=SHARDS, shard_bytes=SHARD_BYTES, local=mount / "hf" / "hub")
    with tmpfs(mount, 8 * MiB), untouched(staging.nas):
        result = staging.mirror()
        assert result.code == 3, result.stderr
        assert "Traceback" not in result.stderr
        message = result.stderr.strip().splitlines()[-1]
        weights = SHARDS * SHARD_BYTES // MiB  # and a config of a few bytes
        assert re.search(rf"not enough space on .*nvme/hf/hub: need {weights}\.\d\d MiB, free [0-9.]+ [KM]iB, "
                         r"reserve 0 B", message), message
        assert regular_files(mount) == [], "the preflight must refuse before any blob is written"
        assert temp_files(mount) == []


def test_preflight_counts_the_reserve(small_disk):
    staging, mount, needed = small_disk
    manifest = staging.manifest.read_text().replace('reserve = "0"', 'reserve = "8MiB"')
    staging.manifest.write_text(manifest)
    result = staging.mirror()
    assert result.code == 3 and "reserve 8.00 MiB" in result.stderr and "short by" in result.stderr
    assert regular_files(mount) == []


def test_space_taken_mid_run_stops_cleanly_and_the_rerun_converges(small_disk):
    staging, mount, _needed = small_disk
    with untouched(staging.nas):
        # One copy at a time: the filler strikes after the first blob, with blobs still to go. At
        # 30 MB/s it has a sixth of a second per blob to be scheduled; unthrottled, a loaded machine
        # let tmpfs take all of them first, three times in a row.
        result = run_with_filler(lambda: staging.mirror("--jobs", "1", "--bwlimit", "30M"), mount / "filler",
                                 [f"{staging.local}/blobs/*/*", f"{staging.local}/models--*/blobs/*"],
                                 lambda: shutil.rmtree(staging.local))
    assert_stopped_on_enospc(result, staging.local)
    check = assert_hub_truthful(staging.local, staging.nas, staging.snapshot)
    assert 1 <= check.files and not check.ref_present, "stopped part-way: some blobs landed, no ref yet"
    os.unlink(mount / "filler")
    assert_converged(staging)


def test_space_taken_mid_pack_stops_cleanly_and_the_rerun_converges(tmp_path):
    needs_root()
    staging = build_staging(tmp_path, shards=1, shard_bytes=MiB, engram={1: 20_011, 14: 20_021})
    assert staging.mirror().code == 0
    expected = expected_shards(staging)
    all_shards = sum(4096 + rows * 264 for rows in (20_011, 20_021))
    # Room for one shard twice: a shard that landed before its receipt could be written is
    # repacked beside itself (engram's preflight counts it), once the filler is gone.
    room = all_shards + all_shards // 3 + MiB
    with tmpfs(staging.engram_dir, room), untouched(staging.nas, staging.local, what="source"):
        result = run_with_filler(lambda: staging.stage("pack-engram", "--json"), staging.engram_dir / "filler",
                                 [f"{staging.engram_dir}/engram-*.bin"], lambda: clear(staging.engram_dir))
        assert_stopped_on_enospc(result, staging.engram_dir)
        (staging.engram_dir / "filler").unlink()
        assert_engram_truthful(staging.engram_dir, expected)
        assert_engram_converged(staging, expected)


def test_full_disk_with_nothing_to_copy_still_succeeds(small_disk):
    """A staged hub on a disk that has since filled up: the re-run has nothing to write, so it
    must pass, even with no lock file yet (the pid it records is a courtesy, not a requirement)."""
    staging, mount, _needed = small_disk
    assert staging.mirror().code == 0
    (staging.local / ".locks" / "stager.lock").unlink()
    fill_up(mount / "filler")
    result = staging.mirror()
    assert result.code == 0, result.stderr
    assert staging.verify_full().code == 0


def test_full_disk_first_run_says_not_enough_space(small_disk):
    staging, mount, _needed = small_disk
    fill_up(mount / "filler")
    result = staging.mirror()
    assert result.code == 3, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert "not enough space on" in result.stderr, result.stderr
    assert regular_files(mount / "hf") == []
