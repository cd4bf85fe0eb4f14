"""kill -9 at seeded random points: a killed run never leaves a wrong byte under a final name,
and the next run converges to a result that passes `stage verify --full`."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from reliability_support import (STAGE, MiB, assert_converged, assert_engram_converged, assert_engram_truthful,
                                 assert_hub_truthful, build_staging, calibrate, copying, expected_shards, kill_at,
                                 random_safetensors, sha256_file, temp_files, untouched, Timing)

TRIALS = 20  # kills per command, in TRIALS // 2 episodes
# The kills must reach copies in flight this often, or a test proves nothing. How many do depends
# on the machine's pace of the moment (a resumed run has little left to write, and a kill drawn
# from a fresh run's window often comes after it ends: one CI run reached 2 in 20, with 10 runs
# finished first), so episodes go on, up to MAX_TRIALS kills, until that many have.
MID_WRITE = 3
MAX_TRIALS = 40
# Row counts TP=3 does not divide; a few MiB per shard, so a shard is in flight for a while.
ENGRAM_ROWS = {1: 40_009, 14: 30_011}


def kill_trials(command: list[str], written: Path, *, seed: int, reset: Callable[[], None],
                check: Callable[[], None], converge: Callable[[], None]) -> Counter:
    """SIGKILL `command` TRIALS times (more, up to MAX_TRIALS, until MID_WRITE kills have reached
    copies in flight) at seeded random points and `check()` what every kill left.

    Each episode starts from `reset()`: a first kill, a second kill of the run that resumes from
    what the first left (a killed resume must be as safe as a killed start), then `converge()`.
    First kills alternate between anywhere in a whole run and within the writing phase (counted
    from the first temp file under `written`); second kills are in the writing phase. So copies in
    flight are hit whatever the machine's speed, and the trials stay bounded in time.
    """
    # The shortest of three runs: one run timed during a burst of other work on the machine once
    # put most kills after the end, and the trials then reached too few copies in flight.
    timings = []
    for _ in range(3):
        reset()
        timings.append(calibrate(command, written))
    timing = Timing(min(t.total for t in timings), min(t.writing for t in timings))
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    trial = 0
    while trial < TRIALS or trial % 2 or (outcomes["killed mid-write"] < MID_WRITE and trial < MAX_TRIALS):
        if trial % 2 == 0:
            reset()
        if trial % 4 == 0:
            code, stderr = kill_at(command, rng.uniform(0.05, 1.0) * timing.total)
        else:
            code, stderr = kill_at(command, rng.uniform(0.0, 1.0) * timing.writing, after=copying(written))
        assert code in (0, -9), f"trial {trial}: exit {code}: {stderr}"
        assert "Traceback" not in stderr
        outcomes["finished" if code == 0 else "killed mid-write" if copying(written)() else "killed"] += 1
        check()
        if trial % 2 == 1:
            converge()
        trial += 1
    return outcomes


@pytest.fixture
def staging(tmp_path):
    # Several MiB per shard, so a copy is in flight for a measurable while.
    return build_staging(tmp_path, shards=10, shard_bytes=2 * MiB)


def test_mirror_killed_at_random_points(staging):
    with untouched(staging.nas):
        outcomes = kill_trials(
            staging.command("mirror", "--json"), staging.local, seed=6001,
            reset=lambda: shutil.rmtree(staging.local, ignore_errors=True),
            check=lambda: assert_hub_truthful(staging.local, staging.nas, staging.snapshot),
            converge=lambda: assert_converged(staging))
    print(dict(outcomes))
    # The kills must reach copies in flight, or this test proves nothing.
    assert outcomes["killed mid-write"] >= MID_WRITE, outcomes


def test_small_file_mirror_killed_at_random_points(tmp_path):
    """Small files are made durable in batches (one syncfs, then the renames): a kill at any point
    of a run of 400 of them, first or resumed, leaves every final-named file holding the NAS's bytes,
    and the next run converges."""
    staging = build_staging(tmp_path, shards=1, shard_bytes=MiB, small_files=400)
    with untouched(staging.nas):
        outcomes = kill_trials(
            staging.command("mirror", "--json"), staging.local, seed=6004,
            reset=lambda: shutil.rmtree(staging.local, ignore_errors=True),
            check=lambda: assert_hub_truthful(staging.local, staging.nas, staging.snapshot),
            converge=lambda: assert_converged(staging))
    print(dict(outcomes))
    assert outcomes["killed mid-write"] >= MID_WRITE, outcomes


# ---------------------------------------------------------------- stage pack-engram

@pytest.fixture
def engram(tmp_path):
    staging = build_staging(tmp_path, shards=1, shard_bytes=MiB, engram=ENGRAM_ROWS)
    assert staging.mirror().code == 0
    return staging, expected_shards(staging)


def test_pack_engram_killed_at_random_points(engram):
    staging, expected = engram
    with untouched(staging.nas, staging.local, what="source"):
        outcomes = kill_trials(
            staging.command("pack-engram", "--json"), staging.engram_dir, seed=6002,
            reset=lambda: shutil.rmtree(staging.engram_dir, ignore_errors=True),
            check=lambda: assert_engram_truthful(staging.engram_dir, expected),
            converge=lambda: assert_engram_converged(staging, expected))
    print(dict(outcomes))
    assert outcomes["killed mid-write"] >= MID_WRITE, outcomes


# ---------------------------------------------------------------- stage archive

ARCHIVED = {f"engram-l1-r{rank}of2.bin": 3 * MiB + rank for rank in range(2)} | {
    f"engram-l14-r{rank}of2.bin": 2 * MiB + 7 * rank for rank in range(2)} | {"notes/README": 1000}


@pytest.fixture
def archive_env(tmp_path):
    src = tmp_path / "nvme" / "old" / "tp2"
    dest = tmp_path / "archive"
    contents = {name: random_safetensors(i + 50, size)[:size] for i, (name, size) in enumerate(ARCHIVED.items())}
    return src, dest, contents


def lay_out(src: Path, dest: Path, contents: dict[str, bytes]) -> None:
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name, data in contents.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)


def assert_archive_truthful(src: Path, dest: Path, contents: dict[str, bytes]) -> None:
    """Every file has at least one complete copy; whatever exists under a final name is exact, and
    SHA256SUMS lists only names that DEST holds with exactly that hash."""
    for name, data in contents.items():
        copies = [path for path in (src / name, dest / src.name / name) if path.exists()]
        assert copies, f"{name}: neither the source nor the archive holds it"
        for path in copies:
            assert path.read_bytes() == data, f"{path}: wrong bytes under a final name"
    sums = dest / "SHA256SUMS"
    if sums.exists():
        for line in sums.read_text().splitlines():
            digest, listed = line.split("  ", 1)
            assert sha256_file(dest / listed) == digest == hashlib.sha256(contents[listed.split("/", 1)[1]]).hexdigest()


def assert_archive_converged(command: list[str], src: Path, dest: Path, contents: dict[str, bytes]) -> None:
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stderr
    assert "Traceback" not in rerun.stderr
    assert sorted(p.name for p in src.rglob("*")) == ["MOVED.txt"], "every source is deleted, the signpost stays"
    for name, data in contents.items():
        assert (dest / src.name / name).read_bytes() == data
    sums = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=dest, capture_output=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    moved = (src / "MOVED.txt").read_text()
    for name, data in contents.items():
        assert f"{hashlib.sha256(data).hexdigest()}  {len(data)}  " in moved and name in moved
    assert temp_files(dest) == []


def test_archive_killed_at_random_points(archive_env):
    src, dest, contents = archive_env
    command = [*STAGE, "archive", str(src), str(dest), "--json"]
    outcomes = kill_trials(
        command, dest, seed=6003,
        reset=lambda: lay_out(src, dest, contents),
        check=lambda: assert_archive_truthful(src, dest, contents),
        converge=lambda: assert_archive_converged(command, src, dest, contents))
    print(dict(outcomes))
    assert outcomes["killed mid-write"] >= MID_WRITE, outcomes


def test_what_a_kill_leaves_in_any_directory_is_swept_by_the_rerun(staging):
    """The state a kill leaves, placed in every directory a mirror writes: a final name missing and
    its temp file beside it (for a regular file, a link, refs, trees, .no_exist, shared-store
    manifests). The random trials hit most of these; this covers each one every time."""
    assert staging.mirror().code == 0
    planted = []
    for directory, _dirs, names in os.walk(staging.local):
        if ".locks" in directory or not names:
            continue
        name = sorted(names)[0]
        os.unlink(os.path.join(directory, name))
        temp = os.path.join(directory, f".{name}.stage-0badc0de.tmp")
        with open(temp, "wb") as handle:
            handle.write(b"half a copy")
        planted.append(temp)
    assert len(planted) >= 7, planted
    with untouched(staging.nas):
        assert_converged(staging)
