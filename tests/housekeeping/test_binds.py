"""`stage binds`: the mount list is mounted for real (read-only binds, as docker makes them), and
huggingface_hub and safetensors load every file of the node's models through it, offline."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file
from hubgen import build_demo
from ops_fixtures import container_view, stage
from stager.mirror.hub import walk_repo
from stager.manifest import load_manifest
from stager.sources.local import LocalSource

FLASH, DRAFTER = "acme/Flash-3bpw", "acme/Flash-drafter"

# Runs inside the "container": HF_HUB_CACHE points at the container hub, nothing may go online.
LOADER = r"""
import hashlib, json, sys
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open
out = {}
for repo, files in json.loads(sys.argv[1]).items():
    folder = snapshot_download(repo)
    for name in files:
        path = hf_hub_download(repo, name)
        assert path.startswith(folder), (path, folder)
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        tensors = None
        if name.endswith(".safetensors"):
            with safe_open(path, "np") as f:
                tensors = sorted(f.keys())
                for key in tensors:
                    if ".engram." not in key:  # F8 tables: numpy has no such dtype; the header was parsed
                        f.get_tensor(key)
        out[f"{repo}/{name}"] = {"path": path, "sha256": digest, "tensors": tensors}
print(json.dumps(out))
"""


@pytest.fixture
def node(tmp_path: Path) -> dict:
    """The demo node with only Flash staged (its page15/ excluded); the drafter is not staged."""
    manifest = build_demo(tmp_path / "demo")
    stage(manifest, "mirror", "--model", FLASH)
    config = load_manifest(manifest)
    nas = LocalSource(config.nas.hub, config.nas.aliases)
    snapshots = {repo: walk_repo(nas, repo, "main", []) for repo in (FLASH, DRAFTER)}
    return {"manifest": manifest, "local": Path(config.nodes["dgx1"].hub), "nas": Path(config.nas.hub),
            "snapshots": snapshots, "container": tmp_path / "container" / "hf" / "hub"}


def binds(node, fmt: str = "json"):
    result = run_stage("binds", "--node", "dgx1", "--manifest", node["manifest"], "--format", fmt,
                       "--container-hub", node["container"])
    assert result.code == 0, result.stdout + result.stderr
    return result


def load_in_container(node, listing: dict) -> dict:
    env = {**os.environ, "HF_HUB_CACHE": str(node["container"]), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    result = subprocess.run([sys.executable, "-c", LOADER, json.dumps(listing)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def expected_sha256(node, entry) -> str:
    return sha256_file(node["nas"] / entry.final)


def test_partial_node_resolves_local_first_with_nas_fallback(node):
    report = binds(node).json
    flash, drafter = node["snapshots"][FLASH], node["snapshots"][DRAFTER]
    # Flash: all staged files local, the excluded page15/ entry from the NAS; the drafter wholly from the NAS.
    assert report["counts"] == {"local": len(flash.entries) - 1, "nas_fallback": 1 + len(drafter.entries),
                                "binds": len(report["binds"])}
    models = {m["model"]: m for m in report["models"]}
    assert models[FLASH]["excluded"] == ["page15/experts.safetensors"] and models[FLASH]["mode"] == "files"
    assert models[DRAFTER]["local"] == 0 and models[DRAFTER]["mode"] == "files"
    assert report["env"] == {"HF_HUB_CACHE": str(node["container"])}
    by_target = {b["target"]: b for b in report["binds"]}
    assert len(by_target) == len(report["binds"]), "two binds on one mount point"
    for repo, snap in node["snapshots"].items():
        for entry in snap.entries:
            bind = by_target[f"{node['container']}/{snap.snapshot_dir}/{entry.path}"]
            assert bind["read_only"] and bind["files"] == 1
            local = repo == FLASH and not entry.path.startswith("page15/")
            assert bind["origin"] == ("local" if local else "nas")
            assert Path(bind["source"]).is_relative_to(node["local"] if local else node["nas"])
            assert not Path(bind["source"]).is_symlink(), "a bind source is the resolved regular file"
    # The docker form carries the same mounts, one shell-safe `-v src:dst:ro` per line.
    docker = binds(node, "docker").stdout.splitlines()
    assert [shlex.split(line) for line in docker] == [
        ["-v", f"{b['source']}:{b['target']}:ro"] for b in report["binds"]]

    listing = {repo: [e.path for e in snap.entries] for repo, snap in node["snapshots"].items()}
    with container_view(report["binds"]):
        loaded = load_in_container(node, listing)
        for repo, snap in node["snapshots"].items():
            for entry in snap.entries:
                got = loaded[f"{repo}/{entry.path}"]
                assert got["sha256"] == expected_sha256(node, entry), entry.path
                source = by_target[got["path"]]["source"]
                assert os.stat(got["path"]).st_ino == os.stat(source).st_ino  # served by that very file
        with pytest.raises(OSError):
            Path(loaded[f"{FLASH}/config.json"]["path"]).write_bytes(b"{}")  # read-only inside
    assert loaded[f"{FLASH}/model-00001-of-00003.safetensors"]["tensors"]


def test_fully_staged_model_is_one_repo_bind(node):
    stage(node["manifest"], "mirror")
    report = binds(node).json
    models = {m["model"]: m for m in report["models"]}
    assert models[DRAFTER]["mode"] == "repo" and models[DRAFTER]["nas_fallback"] == 0
    assert models[FLASH]["mode"] == "files" and models[FLASH]["nas_fallback"] == 1  # page15/ stays on the NAS
    drafter_dir = node["snapshots"][DRAFTER].repo_dir
    targets = {b["target"]: b for b in report["binds"]}
    assert targets[f"{node['container']}/{drafter_dir}"]["source"] == str(node["local"] / drafter_dir)
    # Its weights link into the hub-level shared store, which is bound beside it.
    assert targets[f"{node['container']}/blobs"]["source"] == str(node["local"] / "blobs")
    assert not any(t.startswith(f"{node['container']}/{drafter_dir}/") for t in targets), "binds never nest"
    assert report["counts"]["nas_fallback"] == 1
    listing = {DRAFTER: [e.path for e in node["snapshots"][DRAFTER].entries]}
    with container_view(report["binds"]):
        loaded = load_in_container(node, listing)
    for entry in node["snapshots"][DRAFTER].entries:
        assert loaded[f"{DRAFTER}/{entry.path}"]["sha256"] == expected_sha256(node, entry)


def test_bad_arguments(node):
    bad = run_stage("binds", "--node", "dgx1", "--manifest", node["manifest"], "--format", "yaml")
    assert bad.code == 2 and "--format yaml" in bad.stderr
    relative = run_stage("binds", "--node", "dgx1", "--manifest", node["manifest"], "--container-hub", "hf/hub")
    assert relative.code == 2 and "absolute" in relative.stderr
    unknown = run_stage("binds", "--node", "nope", "--manifest", node["manifest"])
    assert unknown.code == 2 and "no such node" in unknown.stderr
