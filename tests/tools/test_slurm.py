"""The Slurm prolog/epilog pair (scripts/ops/slurm-prolog.sh, scripts/ops/slurm-epilog.sh), run the way
slurmd runs them: as root, with no search path and only Slurm's own variables, the settings in
their environment file. Each case ends in bytes: the staged files hashed against the NAS, and
the node's cache loaded by huggingface_hub offline and safetensors."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import sha256_file
from reliability_support import assert_hub_truthful, holding
from slurm_fixtures import SCRIPTS, demo, loads_offline, slurmd_runs  # noqa: F401  (demo is a fixture)

DRAFTER_BLOBS = "models--acme--Flash-drafter/blobs"


def assert_staged(demo: dict) -> None:
    check = assert_hub_truthful(demo["hub"], demo["nas"])
    assert check.files > 0 and check.temps == 0
    assert set(loads_offline(demo["hub"])) == {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors", "model.safetensors"}


def test_the_prolog_stages_a_bare_node_and_lets_the_job_run(demo):
    result = slurmd_runs("slurm-prolog.sh", demo)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""
    assert_staged(demo)


def test_the_prolog_waits_for_a_mirror_already_writing_the_hub(demo):
    """cron's `stage mirror` holds the hub as a job starts: the prolog waits for it, then stages,
    instead of draining a healthy node with exit 3 ("locked")."""
    lock = demo["hub"] / ".locks" / "stager.lock"
    with holding(lock) as holder:
        release = threading.Timer(2.0, holder.stdin.close)
        release.start()
        result = slurmd_runs("slurm-prolog.sh", demo)
        release.join()
    assert result.returncode == 0, result.stderr
    assert_staged(demo)


def test_a_prolog_that_cannot_stage_drains_the_node_naming_why(demo):
    """The NAS is not mounted: exit 3, so slurmd drains the node and requeues the job; the line
    slurmd logs says which job, which node, and what stage said."""
    demo["nas"].rename(demo["nas"].with_name("hub.unmounted"))
    demo["nas"].mkdir()
    result = slurmd_runs("slurm-prolog.sh", demo)
    assert result.returncode == 3, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("stage-prolog: job 4242 on dgx1: stage mirror exit 3 (could not run): ")
    assert "empty: not mounted?" in line and line.endswith("the node drains")
    # An operator who prefers serving the last whole snapshot during a NAS outage says so.
    tolerant = slurmd_runs("slurm-prolog.sh", demo, STAGE_TOLERATE="3")
    assert tolerant.returncode == 0 and "tolerated" in tolerant.stderr, tolerant.stderr


def test_a_prolog_given_up_waiting_drains(demo):
    lock = demo["hub"] / ".locks" / "stager.lock"
    with holding(lock) as holder:
        result = slurmd_runs("slurm-prolog.sh", demo, STAGE_WAIT="1")
    assert result.returncode == 3, result.stderr
    assert f"locked by another stage process (pid {holder.pid}) after 1 s" in result.stderr


def test_the_epilog_repairs_what_a_job_overwrote(demo):
    """A job wrote into the cache it was given (same size, other bytes): the epilog's verify sees
    it, the mirror puts the NAS's bytes back, and the node stays in service."""
    assert slurmd_runs("slurm-prolog.sh", demo).returncode == 0
    blob = next(p for p in (demo["hub"] / DRAFTER_BLOBS).iterdir() if p.stat().st_size > 1 << 20)
    good = sha256_file(blob)
    with open(blob, "r+b") as handle:
        handle.write(b"\0" * 4096)
    result = slurmd_runs("slurm-epilog.sh", demo)
    assert result.returncode == 0, result.stderr
    assert "stage verify exit 1 (problems found)" in result.stderr and "repairing" in result.stderr
    assert sha256_file(blob) == good
    assert_staged(demo)
    assert slurmd_runs("slurm-epilog.sh", demo).stderr == ""  # clean: nothing to say


def test_an_epilog_that_cannot_repair_drains(demo):
    """A job left a directory of its own where a weight belongs: the mirror never deletes what it
    did not write, so the node cannot be made whole and drains (exit 1) for a person to look at."""
    assert slurmd_runs("slurm-prolog.sh", demo).returncode == 0
    weight = next((demo["hub"] / "models--acme--Flash-drafter" / "snapshots").glob("*/model.safetensors"))
    weight.unlink()
    weight.mkdir()
    (weight / "job-output.bin").write_bytes(b"a job's own file")
    result = slurmd_runs("slurm-epilog.sh", demo)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("stage-epilog: job 4242 on dgx1: stage mirror exit 1 (problems found): ")
    assert last.endswith("the node drains") and (weight / "job-output.bin").read_bytes() == b"a job's own file"


def tree(root: Path) -> list[tuple[str, int, int]]:
    """Every path under `root` with its inode and mtime: what "nothing was written" is checked on."""
    return sorted((str(p), p.lstat().st_ino, p.lstat().st_mtime_ns) for p in [root, *root.rglob("*")])


def test_a_node_the_manifest_does_not_list_has_nothing_to_stage(demo):
    """A mixed cluster: Prolog= and Epilog= run on every node, also on a CPU node the manifest
    does not list. Both exit 0 with one line and stage nothing (they drained it, exit 2, and the
    epilog went on to "repair" it)."""
    root = demo["manifest"].parent
    before = tree(root)
    for script, role in (("slurm-prolog.sh", "stage-prolog"), ("slurm-epilog.sh", "stage-epilog")):
        result = slurmd_runs(script, demo, node="cpu17")
        assert result.returncode == 0, result.stderr
        assert result.stderr.splitlines() == [
            f"{role}: job 4242 on cpu17: not in {demo['manifest']}, nothing to stage"], result.stderr
    assert tree(root) == before  # no hub, no lock, no log: no mirror ran
    # A manifest that is broken is still exit 2 (every node fails alike), not "nothing to stage".
    demo["manifest"].write_text(demo["manifest"].read_text() + "\n[nodes.cpu17]\nhub = 'relative'\n")
    broken = slurmd_runs("slurm-prolog.sh", demo, node="cpu17")
    assert broken.returncode == 2 and "the node drains" in broken.stderr, broken.stderr


def test_scripts_units_and_cron_share_one_configuration_directory():
    """The Slurm scripts, the systemd units and the cron file name their manifest in /etc/stager/
    (they once split between /etc/stager/ and /etc/stage/, so one of them read no manifest)."""
    import re

    named = {}
    for path in sorted(SCRIPTS.iterdir()):
        if path.suffix in (".sh", ".service", ".timer", ".cron"):
            for place in re.findall(r"/etc/stage[a-z]*/", path.read_text()):
                named.setdefault(place, []).append(path.name)
    assert set(named) == {"/etc/stager/"}, named
    for name in ("slurm-common.sh", "stage-mirror.service", "stage-audit.service", "stage-audit.cron"):
        assert "/etc/stager/cluster.toml" in (SCRIPTS / name).read_text(), name


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e9", "86401", "2.5", "30s", "999999999999999999999"])
def test_a_stage_wait_that_is_not_whole_seconds_fails_the_prolog_with_one_line(demo, value):
    """`STAGE_WAIT=inf` (or nan) reached `stage mirror --wait`, which waited on a held hub for ever:
    slurmd's job hung with it. The bad setting is one line naming it, exit 2, and the node drains."""
    conf = demo["conf"].with_name("slurm-bad.env")
    conf.write_text(demo["conf"].read_text() + f"STAGE_WAIT={value}\n")
    env = {"SLURMD_NODENAME": "dgx1", "SLURM_JOB_ID": "4242", "STAGE_SLURM_CONF": str(conf)}
    with holding(demo["hub"] / ".locks" / "stager.lock"):
        for script in ("slurm-prolog.sh", "slurm-epilog.sh"):
            result = subprocess.run(["/bin/bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True,
                                    timeout=30)
            assert result.returncode == 2, result.stderr
            line, = result.stderr.strip().splitlines()
            assert f"STAGE_WAIT={value} in {conf}" in line and line.endswith("the node drains"), line
    assert not (demo["hub"] / "models--acme--Flash-3bpw").exists(), "no mirror ran"


def test_a_slurm_env_file_that_is_a_fifo_fails_the_prolog_at_once(demo):
    """Sourcing a FIFO waits for a writer for ever."""
    fifo = demo["conf"].with_name("slurm-fifo.env")
    os.mkfifo(fifo)
    env = {"SLURMD_NODENAME": "dgx1", "SLURM_JOB_ID": "4242", "STAGE_SLURM_CONF": str(fifo)}
    result = subprocess.run(["/bin/bash", str(SCRIPTS / "slurm-prolog.sh")], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line == f"stage-prolog: {fifo}: not a regular file; the node drains"
