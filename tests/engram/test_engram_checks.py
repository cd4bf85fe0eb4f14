"""The one rule and `stage verify`'s Engram part (stager/engram/checks.py): sampled and full checks
find a flipped byte and name the shard; every rank a node serves is covered."""

from __future__ import annotations

from pathlib import Path

from engram_fixtures import build, flip, pack, verify

def test_verify_sampled_and_full_find_a_flipped_byte_naming_the_shard(tmp_path):
    env = build(tmp_path, rank=1)
    shards = {s["layer"]: Path(s["path"]) for s in pack(env)["shards"]}
    code, report = verify(env)
    assert code == 0 and report["ok"] == report["checked"], report
    code, report = verify(env, "--full")
    assert code == 0, report
    # Sampled: a boundary row is always among the rows compared with the source.
    boundary = shards[14]
    flip(boundary, boundary.stat().st_size - 3)
    code, report = verify(env, "--seed", 7)
    assert code == 1
    assert [(p["path"], p["kind"]) for p in report["problems"]] == [(str(boundary), "mismatch")]
    assert f"row {9_973 * 2 // 3 - 1} differs from the source" in report["problems"][0]["detail"]
    # Full: a byte in the middle of a shard (row lo + 20000 of layer 1).
    middle = shards[1]
    flip(middle, 4096 + 20_000 * 264 + 17)
    code, report = verify(env, "--full")
    assert code == 1
    problems = {p["path"]: p["detail"] for p in report["problems"]}
    assert set(problems) == {str(boundary), str(middle)}
    assert f"row {70_001 // 3 + 20_000} differs from a full re-derivation" in problems[str(middle)]
    # The pack's own check sees the boundary row and repacks that shard.
    again = {s["layer"]: s for s in pack(env)["shards"]}
    assert not again[14]["skipped"] and "differs from the source" in again[14]["reason"]


def test_verify_full_catches_a_shard_that_disagrees_with_sha256sums(tmp_path):
    env = build(tmp_path, rank=0, rows={1: 1_003, 14: 2_011})
    pack(env)
    sums = env["dir"] / "SHA256SUMS"
    sums.write_text(sums.read_text().replace("engram-l1-r0of3.bin", "other.bin"))
    code, report = verify(env)
    assert code == 1 and "SHA256SUMS has no entry" in report["problems"][0]["detail"]
    assert report["problems"][0]["path"].endswith("engram-l1-r0of3.bin")


def test_verify_reports_missing_shards_for_the_nodes_rank(tmp_path):
    env = build(tmp_path, rank=2, rows={1: 1_003, 14: 2_011})
    code, report = verify(env)
    assert code == 1
    assert sorted((Path(p["path"]).name, p["kind"]) for p in report["problems"]) == [
        ("engram-l1-r2of3.bin", "missing"), ("engram-l14-r2of3.bin", "missing")]


def test_verify_covers_every_rank_of_the_node_and_repairs_them_in_one_command(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, ranks=[0, 2])
    code, report = verify(env)
    assert code == 1 and sorted((Path(p["path"]).name, p["kind"]) for p in report["problems"]) == [
        ("engram-l1-r0of3.bin", "missing"), ("engram-l1-r2of3.bin", "missing"),
        ("engram-l14-r0of3.bin", "missing"), ("engram-l14-r2of3.bin", "missing")]
    assert len(report["repair"]) == 1 and "--rank 0 --rank 2" in report["repair"][0], report["repair"]
    shards = {(s["layer"], s["rank"]): Path(s["path"]) for s in pack(env)["shards"]}
    assert set(shards) == {(1, 0), (1, 2), (14, 0), (14, 2)}
    code, report = verify(env, "--full")
    assert code == 0 and report["ok"] == report["checked"], report
    flip(shards[(14, 2)], 4096 + 5)  # row lo of rank 2: a boundary row, always sampled
    code, report = verify(env, "--seed", 3)
    assert code == 1 and [Path(p["path"]).name for p in report["problems"]] == ["engram-l14-r2of3.bin"]
    assert "row 1340 differs from the source" in report["problems"][0]["detail"]
    repair, = report["repair"]
    assert "--rank 2" in repair and "--rank 0" not in repair, repair
