"""Every way a process holds a path keeps it from `stage prune`, and every holder is named.

Real holders only: a process standing in a revision (its working directory), one chrooted into a
repo, a bind of a revision in the test's own mount namespace, a container-like namespace that binds
only a repo's blobs/, and two processes holding one blob (one with a descriptor, one with a
mapping)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from prune_fixtures import (HOLD_MMAP, HOLD_OPEN, HOLD_ROOT, MODEL_DIR, OLD_DIR, Node, bound, build_node, holding,
                            python, scan_clean, tree_bytes)
from prune_fixtures import nas_guard  # noqa: F401 - autouse: the NAS is byte-identical after every test
from reliability_support import needs_root

STAND = "import sys\nprint('held', flush=True)\nsys.stdin.read()\n"


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return build_node(tmp_path)


def _held(result, path: Path) -> dict:
    assert result.code == 1, result.stdout + result.stderr
    [busy] = [u for u in result.json["in_use"] if u["path"] == str(path)]
    return busy


def _planned(node: Node) -> dict[str, int]:
    return {i["path"]: i["bytes"] for i in node.prune("--dry-run").json["removed"]}


def test_a_process_standing_in_a_revision_keeps_it(node: Node):
    """`cd <snapshot> && serve --model .`: the working directory holds the revision."""
    with holding(python(STAND), cwd=node.old_snapshot) as [proc]:
        result = node.prune()
        busy = _held(result, node.old_snapshot)
        assert [(u["pid"], u["how"]) for u in busy["users"]] == [(proc.pid, "working directory")]
        assert node.old_snapshot.is_dir() and os.readlink(f"/proc/{proc.pid}/cwd") == str(node.old_snapshot)
        assert [i["kind"] for i in result.json["removed"]] == ["unlisted-repo"]
    assert [i["path"] for i in node.prune().json["removed"]] == [str(node.old_snapshot)]
    scan_clean(node.hub)


def test_a_process_chrooted_into_a_repo_keeps_it(node: Node):
    """A process whose root directory is inside the unlisted repo holds that repo."""
    needs_root()
    [snapshot] = list((node.hub / OLD_DIR / "snapshots").iterdir())
    with holding(python(HOLD_ROOT, snapshot)) as [proc]:
        busy = _held(node.prune(), node.hub / OLD_DIR)
        assert (proc.pid, "root directory") in [(u["pid"], u["how"]) for u in busy["users"]]
        assert snapshot.is_dir()
    assert node.prune().code == 0 and not (node.hub / OLD_DIR).exists()


def test_a_bind_of_a_revision_in_prunes_own_namespace_keeps_it(node: Node, tmp_path: Path):
    """`mount --bind <snapshot> /srv/model` on the host itself: prune's own mount namespace is
    looked at too, and the files seen through the bind stay."""
    needs_root()
    with bound(node.old_snapshot, tmp_path / "srv" / "model", cleanup=tmp_path) as point:
        seen = tree_bytes(point)
        busy = _held(node.prune(), node.old_snapshot)
        assert [(u["pid"], u["how"], u["mount"]) for u in busy["users"]] == \
            [(None, f"bind-mounted at {point}", str(point))]
        assert tree_bytes(point) == seen and node.old_snapshot.is_dir()
    assert [i["path"] for i in node.prune().json["removed"]] == [str(node.old_snapshot)]


def test_a_container_binding_only_a_repos_blobs_keeps_what_would_leave_it(node: Node, tmp_path: Path):
    """A sleeper in its own mount namespace binds only the listed repo's blobs/: the old revision
    (whose blobs would go) is in use, with the sleeper's pid and its mount point."""
    needs_root()
    blobs = node.hub / MODEL_DIR / "blobs"
    target = tmp_path / "container" / "blobs"
    target.mkdir(parents=True)
    script = f"mount --bind {blobs} {target} && echo held && exec sleep 60"
    sleeper = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "held"
        assert str(target) not in Path("/proc/self/mountinfo").read_text()  # another namespace's mount
        before = tree_bytes(blobs)
        busy = _held(node.prune(), node.old_snapshot)
        assert [(u["pid"], u["how"]) for u in busy["users"]] == [(sleeper.pid, f"bind-mounted at {target}")]
        assert tree_bytes(blobs) == before
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert [i["path"] for i in node.prune().json["removed"]] == [str(node.old_snapshot)]


def test_two_processes_holding_one_blob_are_both_named_and_the_repo_reports_what_it_pins(node: Node):
    """One process has the unlisted repo's weight open, another maps it: both pids are named, in
    the JSON and on the text line; the repo's size is what removing it frees (its payload
    included), which the run after they end does free."""
    weight = next((node.hub / OLD_DIR / "snapshots").iterdir()) / "model.safetensors"
    planned = _planned(node)[str(node.hub / OLD_DIR)]
    assert planned > os.path.getsize(weight)  # the payload counts: it goes with the repo
    with holding(python(HOLD_OPEN, weight), python(HOLD_MMAP, weight)) as [opener, mapper]:
        result = node.prune()
        text = node.stage("prune", "--dry-run")
        busy = _held(result, node.hub / OLD_DIR)
        assert sorted((u["pid"], u["how"]) for u in busy["users"]) == \
            sorted([(opener.pid, "open"), (mapper.pid, "memory-mapped")])
        assert busy["bytes"] == planned
        assert text.code == 1 and f"pid {opener.pid}" in text.stdout and f"pid {mapper.pid}" in text.stdout, text.stdout
        assert weight.is_file()
    again = node.prune()
    assert [(i["path"], i["bytes"]) for i in again.json["removed"]] == [(str(node.hub / OLD_DIR), planned)]
    assert again.json["freed_bytes"] == planned
