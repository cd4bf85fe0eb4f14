"""`stage prune`: what the audit lists, removed in a crash-safe order, never what is in use.

Real components throughout: hubs built on disk by hubgen and staged by the real `stage mirror`,
a process holding a real mmap, a real bind mount in a separate mount namespace (`unshare -m`), a
real flock held by another process, real kill -9, huggingface_hub's own `scan_cache_dir` and the
`hf cache verify` CLI against a local Hub endpoint (tests/hub_mock.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, open_files, sha256_file, write_manifest
from hub_mock import HubMock
from prune_fixtures import (HOLD_MMAP, MODEL, MODEL_DIR, OLD_DIR, STAGE, Node, build_node, guard, listed,
                            scan_clean, verify_full)
from prune_fixtures import nas_guard  # noqa: F401 - autouse: the NAS is byte-identical after every test
from reliability_support import kill_at, needs_root, tmpfs, tree_state, untouched


def hf_verify(node: Node, hub_mock: HubMock) -> None:
    """`hf cache verify` of the wanted revision against a Hub endpoint serving the same commit."""
    mock_commit = hub_mock.commit(MODEL, node.files[node.new], ref=None)
    hub_mock.repos[MODEL].refs[node.new] = mock_commit  # the endpoint knows the commit by its hubgen name
    ran = subprocess.run([str(Path(sys.executable).with_name("hf")), "cache", "verify", MODEL, "--revision", node.new,
                          "--cache-dir", str(node.hub), "--fail-on-missing-files", "--fail-on-extra-files"],
                         capture_output=True, text=True,
                         env={**os.environ, "HF_ENDPOINT": hub_mock.url, "HF_HUB_DISABLE_XET": "1",
                              "HF_HUB_DISABLE_TELEMETRY": "1"}, timeout=60)
    assert ran.returncode == 0 and "All checksums match" in ran.stdout, ran.stdout + ran.stderr


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return build_node(tmp_path)


def test_prune_removes_exactly_what_the_audit_and_the_dry_run_list(node: Node):
    kept = node.kept_hashes()
    audit = node.stage("audit", "--json")
    assert audit.code == 0, audit.stdout + audit.stderr
    planned = listed(audit.json["reclaim"])
    kinds = {kind for _path, kind, _bytes in planned}
    assert kinds == {"revision", "unlisted-repo"}, planned
    assert audit.json["prune_command"] == f"stage prune --node dgx1 --manifest {node.manifest}"
    human = node.stage("audit")
    assert f"with: {audit.json['prune_command']}" in human.stderr

    with untouched(node.nas):
        dry = node.prune("--dry-run")
        assert dry.code == 0, dry.stdout + dry.stderr
        assert dry.json["dry_run"] is True and listed(dry.json["removed"]) == planned
        assert (node.hub / MODEL_DIR / "snapshots" / node.old).is_dir()  # a dry run removes nothing
        real = node.prune()
    assert real.code == 0, real.stdout + real.stderr
    assert listed(real.json["removed"]) == planned

    model = node.hub / MODEL_DIR
    assert not (model / "snapshots" / node.old).exists() and not (model / "trees" / f"{node.old}.json").exists()
    assert not (node.hub / OLD_DIR).exists()
    # Only blobs the wanted revision reaches are left, and the payload both revisions shared stays.
    reached = {os.path.realpath(p) for p in (model / "snapshots" / node.new).rglob("*") if p.is_file()}
    left = {str(p) for p in (node.hub / "blobs").rglob("*") if p.is_file() and p.suffix not in (".refs", ".lock")
            and p.name != ".huggingface-shared-blobs"}
    left |= {os.path.realpath(p) for p in (model / "blobs").iterdir()}
    assert left == reached
    for refs in (node.hub / "blobs").rglob("*.refs"):  # each manifest lists exactly the repo blobs linking to it
        for line in refs.read_text().splitlines():
            assert os.path.realpath(node.hub / line) == str(refs.with_suffix(""))
    assert node.kept_hashes() == kept
    scan_clean(node.hub)
    verify_full(node)

    journal = [json.loads(line) for line in (node.hub / ".locks" / "stage-journal.jsonl").read_text().splitlines()]
    removals = [r for r in journal if r["event"] == "remove"]
    assert {r["item"] for r in removals} == {path for path, _kind, _bytes in planned}
    repo_blobs = [r for r in removals if Path(r["path"]).parent.name == "blobs"
                  and Path(r["path"]).parent.parent.name.startswith("models--")]
    assert repo_blobs and all(r["sha256"] == Path(r["path"]).name for r in repo_blobs if len(Path(r["path"]).name) == 64)
    freed = real.json["freed_bytes"]
    assert freed == sum(b for _p, _k, b in planned) > 0 and journal[-1]["pruned_bytes_total"] == freed

    # Nothing left to do; the counter survives the next run and lands in the audit's textfile.
    again = node.prune()
    assert again.code == 0 and again.json["removed"] == [] and again.json["pruned_bytes_total"] == freed
    prom = node.root / "stage.prom"
    assert node.stage("audit", "--prom", str(prom)).code == 0
    assert f'stage_pruned_bytes_total{{node="dgx1"}} {freed}' in prom.read_text()


def test_a_mapped_blob_keeps_its_revision_in_use(node: Node):
    """A process maps a weight of the unwanted revision through its snapshot path (a symlink to the
    blob) and closes the file: the revision is listed in_use with that pid and command, and stays."""
    old_weight = node.hub / MODEL_DIR / "snapshots" / node.old / "model-00002-of-00002.safetensors"
    blob = Path(os.path.realpath(old_weight))
    digest = sha256_file(blob)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_MMAP, str(old_weight)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not any(f"/{blob.name}" in path for path in open_files(holder.pid))  # mapped, not open
        audit = node.stage("audit", "--json")
        result = node.prune()
        assert result.code == 1, result.stdout + result.stderr
        [busy] = result.json["in_use"]
        assert busy["path"] == str(old_weight.parent) and busy["kind"] == "revision"
        assert busy["pid"] == holder.pid and "HOLD" not in busy["command"] and "python" in busy["command"]
        assert busy["how"] == "memory-mapped"
        assert [i["path"] for i in audit.json["in_use"]] == [busy["path"]]  # the audit saw it too
        assert busy["path"] not in [i["path"] for i in audit.json["reclaim"]]
        assert sha256_file(blob) == digest and (old_weight.parent).is_dir()
        assert [i["kind"] for i in result.json["removed"]] == ["unlisted-repo"]
        scan_clean(node.hub)
    finally:
        holder.communicate("", timeout=10)
    again = node.prune()
    assert again.code == 0 and [i["path"] for i in again.json["removed"]] == [str(old_weight.parent)]
    assert not blob.exists()


def test_a_bind_mount_in_another_mount_namespace_keeps_a_repo_in_use(node: Node, tmp_path: Path):
    """A sleeper in its own mount namespace (`unshare -m`, as a container runtime makes one) bind-mounts a
    weight of the unlisted repo: that repo is in_use, named with the sleeper's pid, and stays whole."""
    needs_root()
    weight = node.hub / OLD_DIR / "snapshots"
    [snapshot] = list(weight.iterdir())
    payload = Path(os.path.realpath(snapshot / "model.safetensors"))
    target = tmp_path / "container" / "model.safetensors"
    target.parent.mkdir()
    target.touch()
    script = f"mount --bind {payload} {target} && echo ready && exec sleep 60"
    sleeper = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        assert str(target) not in Path("/proc/self/mountinfo").read_text()  # not visible here: another namespace
        result = node.prune()
        assert result.code == 1, result.stdout + result.stderr
        [busy] = result.json["in_use"]
        assert busy["path"] == str(node.hub / OLD_DIR) and busy["pid"] == sleeper.pid and "sleep" in busy["command"]
        assert busy["how"] == f"bind-mounted at {target}"
        assert payload.is_file() and (snapshot / "model.safetensors").is_file()
        assert [i["kind"] for i in result.json["removed"]] == ["revision"]
        scan_clean(node.hub)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert node.prune().code == 0 and not (node.hub / OLD_DIR).exists() and not payload.exists()


def test_live_temps_and_held_locks_are_left_alone(node: Node):
    """A stale-looking `.incomplete` whose huggingface_hub download lock another process holds is
    live and stays; one without a writer goes. While another process holds the hub's writer lock,
    prune refuses (exit 3) and removes nothing."""
    blobs = node.hub / MODEL_DIR / "blobs"
    old = time.time() - 7200
    live, dead = blobs / ("a" * 64 + ".incomplete"), blobs / f".{'b' * 64}.stage-0123abcd.tmp"
    for path in (live, dead):
        path.write_bytes(b"partial" * 1000)
        os.utime(path, (old, old))
    download_lock = node.hub / ".locks" / MODEL_DIR / ("a" * 64 + ".lock")
    download_lock.parent.mkdir(parents=True, exist_ok=True)
    hold = "import fcntl, sys\nf = open(sys.argv[1], 'w')\nfcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()\n"
    for lock in (node.hub / ".locks" / "stager.lock", download_lock):
        holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            before = tree_state(node.hub)
            result = node.prune()
            if lock.name == "stager.lock":
                assert result.code == 3 and "is locked by another stage process" in result.json["error"], result.stdout
                assert tree_state(node.hub) == before
                continue
            assert result.code == 0, result.stdout + result.stderr
            assert live.exists() and not dead.exists()
            assert [t["path"] for t in result.json["live_temps"]] == [str(live)]
            assert f"pid {holder.pid}" in result.json["live_temps"][0]["detail"]
        finally:
            holder.communicate("", timeout=10)


def test_links_into_the_nas_are_removed_never_followed(node: Node):
    """An unlisted repo whose blobs are absolute links to NAS files, an orphan repo blob linking to
    the NAS, and a repo directory that is itself a link to a NAS repo: the links go, the NAS and
    everything the links point at stay byte for byte."""
    nas_repo = node.nas / OLD_DIR
    nas_file = Path(os.path.realpath(next((nas_repo / "snapshots").iterdir()) / "model.safetensors"))
    evil = node.hub / "models--evil--Links"
    (evil / "snapshots" / ("e" * 40)).mkdir(parents=True)
    (evil / "blobs").mkdir()
    os.symlink(nas_file, evil / "blobs" / ("f" * 64))
    os.symlink(f"../../blobs/{'f' * 64}", evil / "snapshots" / ("e" * 40) / "model.safetensors")
    os.symlink(nas_repo, evil / "snapshots" / ("e" * 40) / "whole-repo")
    os.symlink(nas_file, node.hub / MODEL_DIR / "blobs" / ("d" * 64))
    os.symlink(nas_repo, node.hub / "models--evil--Dirlink")
    with untouched(node.nas):
        result = node.prune()
    assert result.code == 0, result.stdout + result.stderr
    removed = {i["path"]: i["kind"] for i in result.json["removed"]}
    assert removed[str(evil)] == "unlisted-repo" and removed[str(node.hub / MODEL_DIR / "blobs" / ("d" * 64))] == "blob"
    assert str(node.hub / "models--evil--Dirlink") not in removed  # a link, not a repo of the node: never entered
    assert os.path.islink(node.hub / "models--evil--Dirlink") and nas_file.is_file()
    assert not evil.exists()


def test_until_free_stops_at_its_target_and_says_how_far_it_got(tmp_path: Path):
    """On a real 64 MiB tmpfs: a target one item away removes the oldest-used item first and stops;
    a target beyond what may be removed removes everything allowed, says so, and exits 1."""
    needs_root()
    with tmpfs(tmp_path / "nvme", 64 * 1024 * 1024):
        node = build_node(tmp_path)
        plan = node.stage("audit", "--json").json["reclaim"]
        assert [i["kind"] for i in plan] == ["revision", "unlisted-repo"]  # old revisions before whole repos
        vfs = os.statvfs(tmp_path / "nvme")
        free = vfs.f_bavail * vfs.f_frsize
        dry = node.prune("--until-free", str(free + 1), "--dry-run")
        assert [i["path"] for i in dry.json["removed"]] == [plan[0]["path"]], dry.stdout
        one = node.prune("--until-free", str(free + 1))
        assert one.code == 0, one.stdout + one.stderr
        assert [i["path"] for i in one.json["removed"]] == [plan[0]["path"]]
        assert [i["path"] for i in one.json["left"]] == [plan[1]["path"]] and one.json["target_met"] is True
        assert (node.hub / OLD_DIR).is_dir()
        # The shipped cron line, as written: with a reserve one byte beyond the free space, it
        # removes the next item and stops there.
        vfs = os.statvfs(tmp_path / "nvme")
        write_manifest(node.manifest, node.nas, node.hub, {MODEL: {}}, reserve=str(vfs.f_bavail * vfs.f_frsize + 1))
        [line] = [l[2:] for l in (REPO / "scripts" / "ops" / "stage-audit.cron").read_text().splitlines()
                  if l.startswith("# 7-59/15 ")]
        command = line.split(None, 6)[6]
        assert "prune" in command and "--until-free reserve" in command
        command = (command.replace("/usr/local/bin/stage", str(Path(sys.executable).with_name("stage")))
                   .replace('"$(hostname -s)"', "dgx1").replace("/var/log/stage-prune.log", str(tmp_path / "prune.log"))
                   .replace("/run/stage-audit.lock", str(tmp_path / "audit.lock")))
        ran = subprocess.run(["sh", "-c", command], env={**os.environ, "STAGE_MANIFEST": str(node.manifest)})
        assert ran.returncode == 0, (tmp_path / "prune.log").read_text()
        assert not (node.hub / OLD_DIR).exists() and "removed unlisted-repo" in (tmp_path / "prune.log").read_text()
        too_far = node.prune("--until-free", "1G")
        assert too_far.code == 1 and too_far.json["target_met"] is False and too_far.json["removed"] == []
        text = node.stage("prune", "--until-free", "1G")
        assert "the target cannot be met" in text.stdout and text.code == 1
        scan_clean(node.hub)
        verify_full(node)


def test_kill_at_random_points_then_a_rerun_leaves_a_clean_hub(tmp_path: Path):
    """kill -9 at random moments of a prune that deletes a few thousand files; after each, the hub
    scans clean; a re-run finishes the job; `hf cache verify`, scan_cache_dir and `stage verify
    --full` accept the result, and every byte of the wanted revision is still there."""
    template = build_node(tmp_path / "template", extra_files=800)
    kept = template.kept_hashes()
    planned = template.stage("audit", "--json").json["reclaimable_bytes"]
    rng = random.Random(1234)
    codes = []
    with HubMock() as hub_mock:
        for trial in range(3):
            root = tmp_path / f"trial{trial}"
            shutil.copytree(template.root, root, symlinks=True)
            node = Node(root, root / "nas" / "hf" / "hub", root / "nvme" / "hf" / "hub", root / "cluster.toml",
                        template.old, template.new, template.files)
            node.manifest.write_text(template.manifest.read_text().replace(str(template.root), str(root)))
            guard(node.nas)
            command = [*STAGE, "prune", "--node", "dgx1", "--json", "--manifest", str(node.manifest)]
            old_snapshot = node.hub / MODEL_DIR / "snapshots" / node.old
            started = lambda: (node.hub / ".locks" / "stage-journal.jsonl").exists()  # noqa: E731
            code, err = kill_at(command, rng.uniform(0.0, 0.2), after=started)
            codes.append(code)
            assert "Traceback" not in err, err
            scan_clean(node.hub)
            rerun = node.prune()
            assert rerun.code == 0, rerun.stdout + rerun.stderr
            assert not old_snapshot.exists() and not (node.hub / OLD_DIR).exists()
            assert not (node.hub / ".locks" / "stage-prune-trash").exists() or \
                not any((node.hub / ".locks" / "stage-prune-trash").iterdir())
            assert node.kept_hashes() == kept
            scan_clean(node.hub)
            verify_full(node)
            hf_verify(node, hub_mock)
            # The journal counted every removed byte once, killed run or not.
            journal = [json.loads(l) for l in (node.hub / ".locks" / "stage-journal.jsonl").read_text().splitlines()]
            assert journal[-1]["pruned_bytes_total"] == planned, (code, journal[-3:])
    assert -9 in codes, codes  # at least one kill landed while the prune was at work
