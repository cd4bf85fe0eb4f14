"""A NAS that is mid-download is not the node's fault: the node stays on the whole revision it
serves (hub.serving_commit), mirror and verify say which revision is pending and exit 0, and the
audit warns once a pending download has been idle for longer than nas.pending_warn_after."""

from __future__ import annotations

import os
from pathlib import Path

from stager.mirror.hub import repo_dir_name, serving_commit

REPO_ID = "acme/Flash-mini"
A, B = "a" * 40, "b" * 40


def node_repo(hub: Path, ref: str | None, snapshots: tuple[str, ...]) -> Path:
    repo = hub / repo_dir_name(REPO_ID)
    for commit in snapshots:
        (repo / "snapshots" / commit).mkdir(parents=True)
    if ref is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(ref)
    return repo


def test_serving_commit_is_what_an_offline_client_loads(tmp_path):
    hub = tmp_path / "hub"
    repo = node_repo(hub, A, (A, B))
    assert serving_commit(hub, REPO_ID, "main") == A  # the node's ref, not the newest snapshot
    assert serving_commit(hub, REPO_ID, B) == B  # a pinned commit is itself
    assert serving_commit(hub, REPO_ID, "c" * 40) is None  # pinned but not on the node
    assert serving_commit(hub, REPO_ID, "v1.0") is None  # no such ref
    (repo / "refs" / "main").write_text("not a commit")
    assert serving_commit(hub, REPO_ID, "main") is None
    (repo / "refs" / "main").write_text("c" * 40)  # a ref to a snapshot the node does not hold
    assert serving_commit(hub, REPO_ID, "main") is None
    (repo / "refs" / "main").unlink()
    os.mkfifo(repo / "refs" / "main")  # never waited on
    assert serving_commit(hub, REPO_ID, "main") is None
    assert serving_commit(tmp_path / "no-hub", REPO_ID, "main") is None


# ---- the whole path: hubgen's NAS mid-download, the real Slurm scripts, the audit -------------

import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from conftest import run_stage, sha256_file  # noqa: E402
from hubgen import Hub, random_safetensors  # noqa: E402
from slurm_fixtures import demo, loads_offline, slurmd_runs  # noqa: E402,F401  (demo is a fixture)

DRAFTER = "acme/Flash-drafter"
NEW = "d" * 40
NEW_WEIGHTS = random_safetensors(7, 3 * 1024 * 1024)


def start_nas_download(nas: Path) -> tuple[Path, list[Path]]:
    """What huggingface_hub leaves mid-download of a new main: the ref and the trees listing of NEW,
    its config linked, its weights still an `.incomplete` blob. Returns (the partial blob, every
    path the download wrote)."""
    snap = Hub(nas).repo(DRAFTER).snapshot(NEW)
    snap.add_git("config.json", b'{"architectures": ["DrafterForCausalLM"], "revision": "new"}')
    snap.files["model.safetensors"] = {"size": len(NEW_WEIGHTS), "lfs_size": len(NEW_WEIGHTS)}
    snap.finish()
    partial = snap.repo.dir / "blobs" / (hashlib_sha256(NEW_WEIGHTS) + ".1a2b3c4d.incomplete")
    partial.write_bytes(NEW_WEIGHTS[: len(NEW_WEIGHTS) // 2])
    repo = snap.repo.dir
    written = [repo / "refs" / "main", repo / "trees" / f"{NEW}.json", repo / "blobs", snap.dir,
               snap.dir / "config.json", partial]
    return partial, written


def hashlib_sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def age(paths: list[Path], seconds: float) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then), follow_symlinks=False)


def audit(manifest: Path) -> tuple[int, dict, str]:
    result = run_stage("audit", "--node", "dgx1", "--manifest", manifest, "--json")
    text = run_stage("audit", "--node", "dgx1", "--manifest", manifest)
    assert result.code == text.code and "Traceback" not in result.stderr + text.stderr, result.stderr
    return result.code, result.json, text.stdout


def assert_serves(demo: dict, commit: str) -> None:
    """Every file of the drafter's `commit` on the node holds the NAS's bytes of that commit, and
    huggingface_hub offline loads the drafter from there."""
    mine = demo["hub"] / "models--acme--Flash-drafter" / "snapshots" / commit
    theirs = demo["nas"] / "models--acme--Flash-drafter" / "snapshots" / commit
    names = sorted(p.name for p in theirs.iterdir())
    assert names == sorted(p.name for p in mine.iterdir()) and names
    assert all(sha256_file(mine / n) == sha256_file(theirs / n) for n in names)
    assert "model.safetensors" in loads_offline(demo["hub"])


def test_a_nas_mid_download_is_not_the_nodes_fault(demo):
    """The node is whole on the drafter's old main; the NAS's main moves to a revision it is still
    downloading. The node stays on the old one: the prolog and the epilog pass (they drained it
    before), verify and mirror exit 0 and name both revisions, the audit says so and warns once
    the download has shown no progress for longer than nas.pending_warn_after. Once the NAS's
    download completes, the next prolog stages it."""
    assert slurmd_runs("slurm-prolog.sh", demo).returncode == 0
    old = serving_commit(demo["hub"], DRAFTER, "main")
    partial, written = start_nas_download(demo["nas"])

    for script in ("slurm-prolog.sh", "slurm-epilog.sh"):
        result = slurmd_runs(script, demo)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert serving_commit(demo["hub"], DRAFTER, "main") == old
    assert_serves(demo, old)

    for command in ("mirror", "verify"):
        checked = run_stage(command, "--node", "dgx1", "--manifest", demo["manifest"], "--json")
        assert checked.code == 0 and checked.json["problems"] == [], checked.stdout + checked.stderr
        pending, = checked.json["pending"]
        assert {k: pending[k] for k in ("model", "revision", "pending_commit", "serving_commit")} == \
            {"model": DRAFTER, "revision": "main", "pending_commit": NEW, "serving_commit": old}
        assert "model.safetensors" in pending["detail"] and pending["idle_seconds"] < 600

    # A container launched meanwhile gets the revision the node serves, from local NVMe.
    binds = run_stage("binds", "--node", "dgx1", "--format", "json", "--manifest", demo["manifest"])
    assert binds.code == 0, binds.stdout + binds.stderr
    drafter, = [m for m in binds.json["models"] if m["model"] == DRAFTER]
    assert (drafter["commit"], drafter["mode"], drafter["nas_fallback"]) == (old, "repo", 0), drafter
    assert drafter["pending"]["pending_commit"] == NEW

    code, report, line = audit(demo["manifest"])
    assert code == 0 and report["status"] == "OK", line
    assert [(p["pending_commit"], p["overdue"]) for p in report["pending"]] == [(NEW, False)]
    assert report["pending_warn_after_seconds"] == 6 * 3600
    assert f"the node stays on {old[:12]}" in line and line.startswith("STAGE OK: dgx1: "), line

    age(written, 7 * 3600)  # the download died seven hours ago
    code, report, line = audit(demo["manifest"])
    assert code == 1 and report["status"] == "WARNING", line
    assert report["pending"][0]["overdue"] and report["pending"][0]["idle_seconds"] >= 7 * 3600
    assert line.startswith(f"STAGE WARNING: dgx1: {DRAFTER} main: the NAS's {NEW[:12]} is incomplete, "
                           "no progress for 7h00m"), line
    assert "over nas.pending_warn_after 6h00m" in line
    # Healthy all the while: a dead NAS download is the audit's warning, not a drained node.
    assert slurmd_runs("slurm-prolog.sh", demo).returncode == 0
    patient = demo["manifest"].read_text().replace("[nas]\n", '[nas]\npending_warn_after = "8h"\n', 1)
    demo["manifest"].write_text(patient)
    assert audit(demo["manifest"])[0] == 0

    # The NAS's download completes: the next prolog stages the new revision and moves the ref.
    partial.unlink()
    snap = Hub(demo["nas"]).repo(DRAFTER).snapshot(NEW)
    snap.add_lfs("model.safetensors", NEW_WEIGHTS, shared=True)
    result = slurmd_runs("slurm-prolog.sh", demo)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert serving_commit(demo["hub"], DRAFTER, "main") == NEW
    assert_serves(demo, NEW)
    after = run_stage("verify", "--node", "dgx1", "--manifest", demo["manifest"], "--full", "--json")
    assert after.code == 0 and after.json["pending"] == [], after.stdout
