"""Concurrency: one writer per hub (a second mirror refuses with a lock message), and a reader of
the hub during a mirror sees each file complete or not at all."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from reliability_support import (MiB, assert_converged, assert_hub_truthful, build_staging, temp_files,
                                 tree_state, untouched)

LOCK = ".locks/stager.lock"


@pytest.fixture
def staging(tmp_path):
    return build_staging(tmp_path, shards=8, shard_bytes=8 * MiB)


def lock_holder(staging) -> int | None:
    """Who holds the hub's lock, from the kernel's table (the lock file holds no pid)."""
    from stager.base.lock import LockTable

    state, pid = LockTable.read().state(staging.local / LOCK)
    return pid if state == "held" else None


def test_second_mirror_refuses_while_the_first_holds_the_lock(staging):
    with untouched(staging.nas):
        first = subprocess.Popen(staging.command("mirror", "--json"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while lock_holder(staging) != first.pid and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        # Frozen while it holds the lock, however fast this machine copies: the overlap is certain.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            assert lock_holder(staging) == first.pid, "the first mirror never took the lock"
            second = staging.mirror()
        finally:
            os.kill(first.pid, signal.SIGCONT)
        _out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert "Traceback" not in second.stderr
    assert second.code == 3, second.stderr + second.stdout
    line, = second.stderr.strip().splitlines()
    assert f"locked by another stage process (pid {first.pid})" in line and str(staging.local / LOCK) in line
    assert_converged(staging)


def test_two_mirrors_started_together_never_interleave(staging):
    with untouched(staging.nas):
        runs = [subprocess.Popen(staging.command("mirror", "--json"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 3]), results
    for code, err in results:
        assert "Traceback" not in err
        if code == 3:
            assert "locked by another stage process" in err
    assert_converged(staging)


def test_a_held_lock_refuses_before_anything_is_written(staging):
    (staging.local / ".locks").mkdir(parents=True)
    fd = os.open(staging.local / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        before = tree_state(staging.local)
        result = staging.mirror()
        # The holder is this process, as the kernel's lock table says; not what the file claims.
        assert result.code == 3 and f"(pid {os.getpid()})" in result.stderr, result.stderr
        assert "4242" not in result.stderr
        assert tree_state(staging.local) == before
    finally:
        os.close(fd)
    assert staging.mirror().code == 0, "the kernel drops the lock with its holder: no stale lock"


def test_a_reader_during_mirrors_never_sees_a_partial_file(staging):
    entries = {staging.local / staging.snapshot.dir.relative_to(staging.nas) / path: sha
               for path, sha in staging.snapshot.sha256.items()}
    seen = {"complete": 0, "absent": 0}
    wrong: list[str] = []
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            for path, sha in entries.items():
                try:
                    with open(path, "rb") as handle:
                        digest = hashlib.file_digest(handle, "sha256").hexdigest()
                except FileNotFoundError:
                    seen["absent"] += 1
                    continue
                seen["complete"] += 1
                if digest != sha:
                    wrong.append(f"{path}: {digest}")
            time.sleep(0.001)  # leave the mirror its share of the two cores

    reader = threading.Thread(target=read_loop, daemon=True)
    reader.start()
    try:
        with untouched(staging.nas):
            for _ in range(3):
                shutil.rmtree(staging.local, ignore_errors=True)
                result = staging.mirror("--jobs", "2")
                assert result.code == 0, result.stderr
    finally:
        stop.set()
        reader.join(timeout=60)
    print(seen)
    assert wrong == [], wrong
    assert seen["complete"] > 0 and seen["absent"] > 0, seen
    assert temp_files(staging.local) == []
    assert_hub_truthful(staging.local, staging.nas, staging.snapshot)
