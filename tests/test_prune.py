"""`stage prune`: what the audit lists, removed in a crash-safe order, never what is in use.

Real components throughout: hubs built on disk by hubgen and staged by the real `stage mirror`,
a process holding a real mmap, a real bind mount in a separate mount namespace (`unshare -m`), a
real flock held by another process, real kill -9, huggingface_hub's own `scan_cache_dir` and the
`hf cache verify` CLI against a local Hub endpoint (tests/hub_mock.py)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file, write_manifest
from hub_mock import HubMock
from hubgen import Hub, random_safetensors
from reliability_support import kill_at, needs_root, tmpfs, tree_state, untouched

MODEL, OLD = "acme/Model", "acme/Old"
MODEL_DIR, OLD_DIR = "models--acme--Model", "models--acme--Old"
STAGE = [sys.executable, "-m", "stager"]


@dataclass
class Node:
    root: Path
    nas: Path
    hub: Path
    manifest: Path
    old: str  # the commit of acme/Model the manifest no longer wants
    new: str
    files: dict[str, dict[str, bytes]]  # commit -> snapshot path -> bytes (for the Hub endpoint)

    def stage(self, *args: str, timeout: float = 120):
        return run_stage(*args, "--node", "dgx1", "--manifest", self.manifest, timeout=timeout)

    def prune(self, *args: str):
        return self.stage("prune", "--json", *args)

    def kept_hashes(self) -> dict[str, str]:
        """sha256 of every file the wanted revision resolves to."""
        snap = self.hub / MODEL_DIR / "snapshots" / self.new
        return {str(p.relative_to(snap)): sha256_file(p) for p in sorted(snap.rglob("*")) if p.is_file()}


def build_node(root: Path, *, extra_files: int = 0) -> Node:
    """acme/Model staged at two commits (the first no longer wanted; one weight shared between
    them through the shared store), and acme/Old staged, then dropped from the node's models.
    `extra_files` gives the old revision that many more small files of its own."""
    nas = Hub(root / "nas" / "hf" / "hub")
    hub = root / "nvme" / "hf" / "hub"
    shared = random_safetensors(1, 96 * 1024)
    files: dict[str, dict[str, bytes]] = {}

    def snapshot(repo: str, contents: dict[str, bytes], shared_paths: set[str]) -> str:
        snap = nas.repo(repo).snapshot()
        for path, data in contents.items():
            if path.endswith(".safetensors"):
                snap.add_lfs(path, data, shared=path in shared_paths)
            else:
                snap.add_git(path, data)
        snap.finish()
        files[snap.commit] = contents
        return snap.commit

    old_files = {"config.json": b'{"v": 1}', "model-00001-of-00002.safetensors": shared,
                 "model-00002-of-00002.safetensors": random_safetensors(2, 64 * 1024)}
    old_files.update({f"extra/part-{i:05d}.txt": b"old %d\n" % i for i in range(extra_files)})
    old = snapshot(MODEL, old_files, {"model-00001-of-00002.safetensors"})
    snapshot(OLD, {"config.json": b'{"old": true}', "model.safetensors": random_safetensors(3, 48 * 1024)},
             {"model.safetensors"})
    manifest = write_manifest(root / "cluster.toml", nas.root, hub, {MODEL: {}, OLD: {}})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    new = snapshot(MODEL, {"config.json": b'{"v": 2}', "model-00001-of-00002.safetensors": shared,
                           "model-00002-of-00002.safetensors": random_safetensors(4, 64 * 1024)},
                   {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    write_manifest(manifest, nas.root, hub, {MODEL: {}})
    assert (hub / MODEL_DIR / "snapshots" / old).is_dir() and (hub / OLD_DIR).is_dir()
    return Node(root, nas.root, hub, manifest, old, new, files)


def scan_clean(hub: Path) -> None:
    """huggingface_hub's own scanner, offline, in a process of its own: no warnings."""
    code = ("import sys\nfrom huggingface_hub import scan_cache_dir\n"
            "info = scan_cache_dir(sys.argv[1])\nassert not info.warnings, info.warnings\n")
    ran = subprocess.run([sys.executable, "-c", code, str(hub)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 0, ran.stderr


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


def verify_full(node: Node) -> None:
    ran = node.stage("verify", "--full", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    assert ran.json["ok"] == ran.json["checked"] > 0


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return build_node(tmp_path)


def listed(items: list[dict]) -> list[tuple]:
    return [(i["path"], i["kind"], i["bytes"]) for i in items]


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
