"""Which shards a node holds (stager/engram/node_shards.py): its ranks, the TP size, the layers,
and the refusals made before anything is read or written, among them an engram_dir on the NAS
however it is spelled (a real symlink, `..`, a relative hub, an alias target, a real bind mount).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import run_stage
from engram_fixtures import build, pack, tree
from stager.engram import expected_shards, partition
from stager.manifest import load_manifest

@pytest.mark.parametrize("args", [("--rank", 3), ("--rank", 2, "--world", 2)])
def test_rank_outside_the_world_exits_2(tmp_path, args):
    env = build(tmp_path, stage=False)
    err = pack(env, *args, code=2)["stderr"]
    assert err.startswith("stage: error: --rank") and "outside 0.." in err
    assert not env["dir"].exists()


def test_a_negative_rank_is_refused_by_the_option_itself(tmp_path):
    # No manifest's TP size can make a negative rank valid: the option's own range names it.
    env = build(tmp_path, stage=False)
    err = pack(env, "--rank", -1, code=2)["stderr"]
    assert "'--rank'" in err and "-1 is not in the range 0<=x<=4095" in err
    assert not env["dir"].exists()


def test_expected_shards_and_partition(tmp_path):
    env = build(tmp_path, rank=1, rows={1: 1_003, 14: 2_011})
    manifest = load_manifest(env["manifest"])
    specs = expected_shards(manifest, "dgx1")
    assert [(s.path.name, s.lo, s.hi, s.bytes) for s in specs] == [
        ("engram-l1-r1of3.bin", 334, 668, 4096 + 334 * 264), ("engram-l14-r1of3.bin", 670, 1340, 4096 + 670 * 264)]
    assert len(expected_shards(manifest, "dgx1", rank=0)) == 2
    for rows in (1, 2, 7, 384_006_168, 384_016_682):
        for world in (1, 2, 3, 8):
            ranges = [partition(rows, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_layers_from_the_manifest_and_the_command_line(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, extra_engram="layers = [14]\n")
    assert [s["layer"] for s in pack(env, "--rank", 0)["shards"]] == [14]
    assert [s["layer"] for s in pack(env, "--rank", 0, "--layer", 1, "--layer", 1)["shards"]] == [1]
    err = pack(env, "--rank", 0, "--layer", 5, code=2)["stderr"]
    assert "layer 5" in err and "layers [1, 14] only" in err


NAS_SPELLINGS = ["symlink to a NAS repo", "inside a symlinked NAS repo", "dot-dot through a link",
                 "relative NAS hub", "alias target", "bind mount of a NAS repo"]


@pytest.mark.parametrize("spelling", NAS_SPELLINGS)
def test_an_engram_dir_on_the_nas_is_refused_before_anything_is_written(tmp_path, spelling):
    if spelling.startswith("bind") and os.geteuid() != 0:
        pytest.skip("mount --bind needs root")
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    repo = env["nas"] / "models--acme--Flash-3bpw"
    nvme = tmp_path / "nvme"
    alias = tmp_path / "volume1-shared"
    alias.mkdir()
    (alias / "README").write_text("NAS share, mounted here\n")
    text = env["manifest"].read_text()
    cwd, mounted = None, None
    if spelling == "symlink to a NAS repo":
        os.symlink(repo, nvme / "engram-link")
        engram_dir = str(nvme / "engram-link")
    elif spelling == "inside a symlinked NAS repo":
        os.symlink(repo, nvme / "engram-link")
        engram_dir = str(nvme / "engram-link" / "engram")
    elif spelling == "dot-dot through a link":
        os.symlink(repo / "snapshots", nvme / "hop")
        engram_dir = f"{nvme}/hop/../engram"  # a string compare sees {nvme}/engram
    elif spelling == "relative NAS hub":
        text = text.replace(f'hub = "{env["nas"]}"', f'hub = "{env["nas"].relative_to(tmp_path)}"', 1)
        engram_dir, cwd = str(env["nas"] / "engram"), tmp_path
    elif spelling == "alias target":
        text = text.replace("[nas]\n", f'[nas]\naliases = {{ "/volume1/shared" = "{alias}" }}\n', 1)
        engram_dir = str(alias / "engram")
    else:
        engram_dir = str(env["dir"])
        env["dir"].mkdir()
        subprocess.run(["mount", "--bind", str(repo), engram_dir], check=True)
        mounted = engram_dir
    env["manifest"].write_text(text.replace(f'engram_dir = "{env["dir"]}"', f'engram_dir = "{engram_dir}"'))
    before = {"nas": tree(env["nas"]), "alias": tree(alias)}
    try:
        result = run_stage("pack-engram", "--node", "dgx1", "--manifest", env["manifest"].resolve(), "--rank", "0",
                           "--json", cwd=cwd)
        assert result.code == 2, result.stderr + result.stdout
        line, = result.stderr.splitlines()
        assert "nodes.dgx1.engram_dir" in line and engram_dir in line, line
        assert {"nas": tree(env["nas"]), "alias": tree(alias)} == before
    finally:
        if mounted:
            subprocess.run(["umount", mounted], check=True)
    assert not [p for p in tmp_path.rglob("*") if re.fullmatch(r"engram-l\d+-r\d+of\d+\.(bin|json)|SHA256SUMS", p.name)]


def test_an_engram_dir_through_a_link_to_another_disk_is_used(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    (tmp_path / "nvme1").mkdir()
    os.symlink(tmp_path / "nvme1", tmp_path / "nvme" / "engram")
    shards = pack(env, "--rank", 0)["shards"]
    assert {Path(s["path"]).name for s in shards} == {"engram-l1-r0of3.bin", "engram-l14-r0of3.bin"}
    assert (tmp_path / "nvme1" / "engram-l1-r0of3.bin").is_file()


@pytest.mark.parametrize("node,named", [
    ("rank = 1\nranks = [0, 1]\n", "nodes.dgx1: rank and ranks are both set"),
    ("ranks = [0, 3]\n", "nodes.dgx1.ranks: rank 3 is outside 0..2 for TP=3"),
    ("ranks = [1, 1]\n", "nodes.dgx1.ranks: rank 1 listed more than once"),
    ("ranks = []\n", "nodes.dgx1.ranks: an empty list serves no rank"),
    ("rank = 4\n", "nodes.dgx1.rank: rank 4 is outside 0..2 for TP=3"),
])
@pytest.mark.parametrize("command", ["pack-engram", "verify"])
def test_node_ranks_that_make_no_sense_exit_2_naming_the_key(tmp_path, node, named, command):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, stage=command == "verify")
    text = env["manifest"].read_text()
    env["manifest"].write_text(text.replace(f'engram_dir = "{env["dir"]}"\n', f'engram_dir = "{env["dir"]}"\n{node}'))
    result = run_stage(command, "--node", "dgx1", "--manifest", env["manifest"], "--json")
    assert result.code == 2, result.stdout + result.stderr
    line, = result.stderr.splitlines()
    assert named in line, line
    assert json.loads(result.stdout) == {"error": line.removeprefix("stage: error: "), "exit_code": 2}
    assert not env["dir"].exists()


def test_expected_shards_cover_every_rank_of_the_node(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, ranks=[2, 0], world=3)
    specs = expected_shards(load_manifest(env["manifest"]), "dgx1")
    assert [(s.layer, s.rank, s.lo, s.hi) for s in specs] == [
        (1, 0, 0, 334), (1, 2, 668, 1_003), (14, 0, 0, 670), (14, 2, 1_340, 2_011)]
    assert [s.rank for s in expected_shards(load_manifest(env["manifest"]), "dgx1", rank=1)] == [1, 1]


def test_fleet_runs_every_rank_of_a_node(tmp_path):
    from stager.fleet.node import node_argv

    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, ranks=[0, 1, 2], stage=False)
    argv = node_argv(load_manifest(env["manifest"]), "pack-engram", "dgx1")
    assert argv[argv.index("--rank"):] == ["--rank", "0", "--rank", "1", "--rank", "2"]
    assert "--rank" not in node_argv(load_manifest(env["manifest"]), "verify", "dgx1")
