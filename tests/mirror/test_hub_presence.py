"""A NAS that is not there is "cannot run" (exit 3), not "problems found": an unmounted NFS
mount point is an empty directory, and every command agrees on that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_stage, write_manifest
from hubgen import Hub, random_safetensors

MODEL = "acme/Weights"


def _commands(manifest: Path) -> list[list[str]]:
    base = ["--node", "dgx1", "--manifest", str(manifest)]
    return [["mirror", *base], ["verify", *base], ["verify", "--full", *base], ["binds", *base]]


@pytest.mark.parametrize("state", ["empty", "not-a-hub"])
def test_a_nas_that_is_not_a_hub_exits_3_and_says_why(tmp_path, state):
    nas = tmp_path / "mnt" / "nas"
    nas.mkdir(parents=True)
    if state == "not-a-hub":
        (nas / "lost+found").mkdir()
        (nas / "README").write_text("mount the NAS here")
    manifest = write_manifest(tmp_path / "m.toml", nas, tmp_path / "nvme", {MODEL: {}})
    for command in _commands(manifest):
        result = run_stage(*command)
        assert result.code == 3, (command, result.stdout, result.stderr)
        assert str(nas) in result.stderr and "not mounted" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "nvme").exists()  # nothing was written for a NAS that is not there


def test_a_hub_without_this_model_is_a_problem_not_a_missing_nas(tmp_path):
    hub = Hub(tmp_path / "nas")
    snap = hub.repo("acme/Other").snapshot()
    snap.add_lfs("model.safetensors", random_safetensors(1, 1024))
    snap.finish()
    manifest = write_manifest(tmp_path / "m.toml", hub.root, tmp_path / "nvme", {MODEL: {}})
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert result.code == 1
    assert [p["kind"] for p in json.loads(result.stdout)["problems"]] == ["missing"]
