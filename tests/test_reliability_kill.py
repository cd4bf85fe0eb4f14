"""kill -9 at seeded random points: a killed run never leaves a wrong byte under a final name,
and the next run converges to a result that passes `stage verify --full`."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from reliability_support import (MiB, assert_converged, assert_hub_truthful, build_staging, calibrate, copying,
                                 kill_at, untouched)

TRIALS = 20


def kill_trials(command: list[str], written: Path, *, seed: int, reset: Callable[[], None],
                check: Callable[[], None], converge: Callable[[], None]) -> Counter:
    """Run `command` TRIALS times from `reset()`, SIGKILL it at a seeded random point, `check()` what
    the kill left, then `converge()`. Even trials die anywhere in a whole run; odd ones within the
    writing phase (counted from the first temp file under `written`), so copies in flight are hit
    every time whatever the machine's speed."""
    reset()
    timing = calibrate(command, written)
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    for trial in range(TRIALS):
        reset()
        if trial % 2 == 0:
            code, stderr = kill_at(command, rng.uniform(0.05, 1.0) * timing.total)
        else:
            code, stderr = kill_at(command, rng.uniform(0.0, 0.6) * timing.busy, after=copying(written))
        assert code in (0, -9), f"trial {trial}: exit {code}: {stderr}"
        assert "Traceback" not in stderr
        outcomes["finished" if code == 0 else "killed mid-write" if copying(written)() else "killed"] += 1
        check()
        converge()
    return outcomes


@pytest.fixture
def staging(tmp_path):
    # Several MiB per shard, so a copy is in flight for a measurable while.
    return build_staging(tmp_path, shards=5, shard_bytes=4 * MiB)


def test_mirror_killed_at_random_points(staging):
    import shutil

    with untouched(staging.nas):
        outcomes = kill_trials(
            staging.command("mirror", "--json"), staging.local, seed=6001,
            reset=lambda: shutil.rmtree(staging.local, ignore_errors=True),
            check=lambda: assert_hub_truthful(staging.local, staging.nas, staging.snapshot),
            converge=lambda: assert_converged(staging))
    print(dict(outcomes))
    # The kills must reach copies in flight, or this test proves nothing.
    assert outcomes["killed mid-write"] >= 3, outcomes
