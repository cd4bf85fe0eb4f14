"""`stage pack-engram` and Engram verification, against real checkpoints, real shards and real tools.

The reference for every shard is computed here independently: the tensors are read
with the `safetensors` library and interleaved with numpy, the shard headers are
parsed with struct, and SHA256SUMS is checked by coreutils' `sha256sum -c`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors

from conftest import run_stage, write_manifest
from hubgen import Hub, add_engram_checkpoint
from reliability_support import engram_reference
from stager import mirror as mirror_core
from stager.engram import expected_shards, partition
from stager.manifest import load_manifest

FLASH = "acme/Flash-3bpw"
MAGIC = b"DSV1EN41"
GiB = 1024 ** 3


def build(tmp_path: Path, *, layers=(1, 14), rows=None, prefix="model.", world=3, layout=None, heads=None,
          manifest_heads=None, rank: int | None = None, reserve="0", stage=True, extra_engram="",
          exclude: list[str] | None = None, engram_dir: Path | None = None) -> dict:
    """A NAS with an Engram checkpoint, a manifest for node dgx1, and (stage=True) the model mirrored."""
    rows = rows or {1: 70_001, 14: 9_973}  # layer 1 spans two 64 Ki-row chunks; neither divides by 3
    nas = Hub(tmp_path / "nas" / "hf" / "hub")
    info = add_engram_checkpoint(nas, FLASH, layers=layers, rows=rows, prefix=prefix, heads=heads)
    local = tmp_path / "nvme" / "hf" / "hub"
    engram_dir = engram_dir or tmp_path / "nvme" / "engram"
    node = f"engram_dir = {json.dumps(str(engram_dir))}\n" + (f"rank = {rank}\n" if rank is not None else "")
    table = f'\n[engram]\nmodel = "{FLASH}"\nworld = {world}\n'
    if layout:
        table += f'layout = "{layout}"\n'
    if manifest_heads:
        table += f"engram_head_rows = {json.dumps(manifest_heads)}\n"
    manifest = write_manifest(tmp_path / "cluster.toml", nas.root, local, {FLASH: {"exclude": exclude}}, reserve=reserve,
                              extra=node + table + extra_engram)
    if stage:
        job = mirror_core.node_job(load_manifest(manifest), "dgx1", None, jobs=2, seed=1)
        assert not mirror_core.mirror(job, full=False, dry_run=False).problems
    return {"manifest": manifest, "nas": nas.root, "local": local, "dir": engram_dir, "info": info, "world": world,
            "source": local / info.snapshot.dir.relative_to(nas.root) / info.file}


def pack(env, *args, code=0) -> dict:
    result = run_stage("pack-engram", "--node", "dgx1", "--manifest", env["manifest"], "--json", *map(str, args))
    assert result.code == code, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    return result.json if code == 0 else {"stderr": result.stderr}


def verify(env, *args) -> tuple[int, dict]:
    result = run_stage("verify", "--node", "dgx1", "--manifest", env["manifest"], "--json", *map(str, args))
    assert "Traceback" not in result.stderr, result.stderr
    return result.code, result.json


def reference(source: Path, prefix: str, layer: int) -> bytes:
    """The interleaved table, independently: tensors read by the safetensors library, np.hstack'ed."""
    tensors = dict(safetensors.deserialize(source.read_bytes()))
    weight = tensors[f"{prefix}layers.{layer}.engram.embed.weight"]
    scale = tensors[f"{prefix}layers.{layer}.engram.embed.scale"]
    assert (weight["dtype"], scale["dtype"]) == ("F8_E4M3", "F8_E8M0")
    rows = weight["shape"][0]
    assert weight["shape"] == [rows, 256] and scale["shape"] == [rows, 8]
    w = np.frombuffer(bytes(weight["data"]), np.uint8).reshape(rows, 256)
    s = np.frombuffer(bytes(scale["data"]), np.uint8).reshape(rows, 8)
    return np.hstack([w, s]).tobytes()


def parse_shard(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    assert data[:8] == MAGIC
    magic, layer, lo, hi, total, row_bytes = struct.unpack("<6Q", data[:48])
    assert magic == 0x31344E4531565344 and row_bytes == 264
    assert data[48:4096] == bytes(4096 - 48), "header padding must be zero"
    body = data[4096:]
    assert len(body) == (hi - lo) * 264
    return {"layer": layer, "lo": lo, "hi": hi, "total": total}, body


def stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_every_rank_concatenates_to_the_source_table(tmp_path):
    env = build(tmp_path)
    shards = []
    for rank in range(3):
        shards += pack(env, "--rank", rank)["shards"]
    source_sha = hashlib.sha256(env["source"].read_bytes()).hexdigest()
    for layer, rows in {1: 70_001, 14: 9_973}.items():
        expected = reference(env["source"], "model.", layer)
        bodies = []
        for rank in range(3):
            path = env["dir"] / f"engram-l{layer}-r{rank}of3.bin"
            header, body = parse_shard(path)
            lo, hi = rows * rank // 3, rows * (rank + 1) // 3
            assert header == {"layer": layer, "lo": lo, "hi": hi, "total": rows}
            bodies.append(body)
            listed = next(s for s in shards if s["path"] == str(path))
            assert listed == {"path": str(path), "layer": layer, "rank": rank, "world": 3, "lo": lo, "hi": hi,
                              "bytes": 4096 + (hi - lo) * 264, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                              "skipped": False, "reason": "not packed yet"}
            receipt = json.loads(path.with_suffix(".json").read_text())
            assert receipt["model"] == FLASH and receipt["commit"] == env["info"].snapshot.commit
            assert receipt["source_file"] == "model-engram.safetensors" and receipt["source_blob"] == source_sha
            assert (receipt["layer"], receipt["rank"], receipt["world"], receipt["layout"]) == (layer, rank, 3, "floor")
            assert (receipt["lo"], receipt["hi"], receipt["rows"]) == (lo, hi, hi - lo)
            assert receipt["bytes"] == path.stat().st_size and receipt["sha256"] == listed["sha256"]
            assert receipt["tool_version"]
        assert b"".join(bodies) == expected
    # SHA256SUMS kept every rank's entries across the three runs, and coreutils agrees with it.
    sums = (env["dir"] / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == 6
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=env["dir"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 6, check.stdout + check.stderr
    assert not [p for p in env["dir"].iterdir() if ".stage-" in p.name]


@pytest.mark.parametrize("prefix,world", [("", 4), ("model.language_model.", 5)])
def test_prefix_variants_and_world_override(tmp_path, prefix, world):
    env = build(tmp_path, prefix=prefix, rows={1: 1_003, 14: 2_011})
    bodies = {1: [], 14: []}
    # The node has no `rank`: every rank of the (overridden) TP size is packed, in rank order.
    shards = pack(env, "--world", world)["shards"]
    assert [(s["layer"], s["rank"]) for s in shards] == [(layer, r) for layer in (1, 14) for r in range(world)]
    for shard in shards:
        header, body = parse_shard(Path(shard["path"]))
        assert Path(shard["path"]).name == f"engram-l{shard['layer']}-r{shard['rank']}of{world}.bin"
        bodies[header["layer"]].append(body)
    for layer in (1, 14):
        assert b"".join(bodies[layer]) == reference(env["source"], prefix, layer)


def test_rerun_is_a_noop(tmp_path):
    env = build(tmp_path, rank=1)
    first = pack(env)
    assert [s["skipped"] for s in first["shards"]] == [False, False] and {s["rank"] for s in first["shards"]} == {1}
    files = [Path(s["path"]) for s in first["shards"]]
    before = {p: stamp(p) for p in files + [p.with_suffix(".json") for p in files] + [env["dir"] / "SHA256SUMS"]}
    time.sleep(0.02)
    second = pack(env)
    assert [(s["skipped"], s["reason"]) for s in second["shards"]] == [(True, "up to date")] * 2
    assert [s["sha256"] for s in second["shards"]] == [s["sha256"] for s in first["shards"]]
    assert {p: stamp(p) for p in before} == before


def test_truncated_and_foreign_layout_shards_are_repacked(tmp_path):
    env = build(tmp_path)
    first = {s["layer"]: s for s in pack(env, "--rank", 1)["shards"]}
    truncated, foreign = Path(first[1]["path"]), Path(first[14]["path"])
    with open(truncated, "r+b") as handle:
        handle.truncate(truncated.stat().st_size - 100)
    # Same size and receipt, but the header claims rows shifted by one: another layout's shard.
    header, _ = parse_shard(foreign)
    with open(foreign, "r+b") as handle:
        handle.seek(16)
        handle.write(struct.pack("<QQ", header["lo"] + 1, header["hi"] + 1))
    again = {s["layer"]: s for s in pack(env, "--rank", 1)["shards"]}
    assert not again[1]["skipped"] and "size" in again[1]["reason"]
    assert not again[14]["skipped"] and "disagree with the floor layout" in again[14]["reason"]
    for layer in (1, 14):
        assert again[layer]["sha256"] == first[layer]["sha256"]
        assert hashlib.sha256(Path(again[layer]["path"]).read_bytes()).hexdigest() == first[layer]["sha256"]
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=env["dir"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_layout_change_repacks_and_stale_receipt_is_named(tmp_path):
    env = build(tmp_path, heads=[[300, 500, 203], [700, 1000, 311]], rows={1: 1_003, 14: 2_011})
    pack(env, "--rank", 1)
    text = env["manifest"].read_text().replace("world = 3\n", 'world = 3\nlayout = "heads"\n')
    env["manifest"].write_text(text)
    shards = {s["layer"]: s for s in pack(env, "--rank", 1)["shards"]}
    assert (shards[1]["lo"], shards[1]["hi"]) == (300, 800) and (shards[14]["lo"], shards[14]["hi"]) == (700, 1700)
    assert all(not s["skipped"] for s in shards.values())
    for layer, shard in shards.items():
        header, _ = parse_shard(Path(shard["path"]))
        assert (header["lo"], header["hi"]) == (shard["lo"], shard["hi"])
        assert json.loads(Path(shard["path"]).with_suffix(".json").read_text())["layout"] == "heads"


def test_heads_layout_tiles_the_table_with_whole_heads(tmp_path):
    heads = [250, 251, 250, 252]
    env = build(tmp_path, rows={1: 1_003, 14: 1_003}, layout="heads", manifest_heads=heads, world=3)
    bodies = {1: [], 14: []}
    bounds = [0, 250, 501, 751, 1003]
    for rank in range(3):
        for shard in pack(env, "--rank", rank)["shards"]:
            header, body = parse_shard(Path(shard["path"]))
            assert header["lo"] in bounds and header["hi"] in bounds, "a head straddles two ranks"
            assert (header["lo"], header["hi"]) == (bounds[4 * rank // 3], bounds[4 * (rank + 1) // 3])
            bodies[header["layer"]].append(body)
    for layer in (1, 14):
        assert b"".join(bodies[layer]) == reference(env["source"], "model.", layer)


def test_heads_sizes_that_do_not_sum_to_the_rows_exit_2(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 1_003}, layout="heads", manifest_heads=[500, 500], world=2)
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "engram_head_rows sum to 1000 but the table has 1003 rows" in err and "layer 1" in err


@pytest.mark.parametrize("args", [("--rank", 3), ("--rank", -1), ("--rank", 2, "--world", 2)])
def test_rank_outside_the_world_exits_2(tmp_path, args):
    env = build(tmp_path, stage=False)
    err = pack(env, *args, code=2)["stderr"]
    assert err.startswith("stage: error: --rank") and "outside 0.." in err
    assert not env["dir"].exists()


def corrupt(env, data: bytes) -> None:
    """Replace the staged safetensors file's bytes (the local copy the pack reads)."""
    target = Path(os.path.realpath(env["source"]))
    os.chmod(target, 0o644)
    target.write_bytes(data)


def engram_header(rows: int, **override) -> dict:
    tensors = {}
    offset = 0
    for layer in (1, 14):
        for part, dtype, width in (("weight", "F8_E4M3", 256), ("scale", "F8_E8M0", 8)):
            tensors[f"model.layers.{layer}.engram.embed.{part}"] = {
                "dtype": dtype, "shape": [rows, width], "data_offsets": [offset, offset + rows * width]}
            offset += rows * width
    for name, changes in override.items():
        tensors[name.replace("__", ".")].update(changes)
    return tensors


def with_header(header: object, data_bytes: int) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(data_bytes)


W1 = "model.layers.1.engram.embed.weight"


@pytest.mark.parametrize("data,message", [
    (struct.pack("<Q", 2 ** 63) + b"{}", "header length 9223372036854775808 is impossible"),
    (b"\x10\x00\x00", "truncated safetensors header"),
    (struct.pack("<Q", 64) + b'{"a": 1', "header length 64 is impossible for a 15-byte file"),
    (with_header([1, 2, 3], 0), "safetensors header is a JSON list, expected an object"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"data_offsets": [0, 10 * 256 + 10**6]}}),
                 10 * 264 * 2), f"tensor {W1}: F8_E4M3 [10, 256] needs 2560 bytes"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"dtype": "F16", "shape": [10, 128]}}),
                 10 * 264 * 2), f"tensor {W1}: dtype F16, expected F8_E4M3"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"dtype": "F9"}}), 10 * 264 * 2),
     f"tensor {W1}: unknown dtype 'F9'"),
])
def test_corrupt_safetensors_header_exits_2_naming_the_file_and_tensor(tmp_path, data, message):
    env = build(tmp_path, rows={1: 10, 14: 10})
    corrupt(env, data)
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert message in err, err
    assert "model-engram.safetensors" in err and err.count("\n") == 1
    assert not list(env["dir"].glob("*.bin"))


def test_span_past_eof_names_the_tensor(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    header = engram_header(10)
    corrupt(env, with_header(header, 10 * 264 * 2 - 1))  # the last tensor's span runs one byte past the end
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "tensor model.layers.14.engram.embed.scale: data ends at byte" in err and "past the end" in err


def test_config_layer_ids_are_cross_checked(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    config = env["local"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "config.json"
    target = Path(os.path.realpath(config))
    target.write_text(json.dumps({"engram_layer_ids": [1, 2]}))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "config.json: engram_layer_ids [1, 2] disagree" in err and "[1, 14]" in err


def test_not_staged_exits_3_and_from_nas_reads_the_nas_without_writing_it(tmp_path):
    env = build(tmp_path, stage=False, rows={1: 1_003, 14: 2_011})
    err = pack(env, "--rank", 0, code=3)["stderr"]
    assert f"{FLASH} is not staged on dgx1" in err and "--from-nas" in err
    before = sorted((str(p), p.lstat().st_mtime_ns, p.lstat().st_size) for p in env["nas"].rglob("*"))
    shards = pack(env, "--rank", 0, "--from-nas")["shards"]
    assert sorted((str(p), p.lstat().st_mtime_ns, p.lstat().st_size) for p in env["nas"].rglob("*")) == before
    nas_file = env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / env["info"].file
    for shard in shards:
        _, body = parse_shard(Path(shard["path"]))
        rows = {1: 1_003, 14: 2_011}[shard["layer"]]
        assert body == reference(nas_file, "model.", shard["layer"])[:rows // 3 * 264]
        assert "NAS" in json.loads(Path(shard["path"]).with_suffix(".json").read_text())["packed_from"]


def test_space_preflight_exits_3_before_writing(tmp_path):
    env = build(tmp_path)
    text = env["manifest"].read_text()
    env["manifest"].write_text(text.replace('reserve = "0"', 'reserve = "1000TiB"'))
    err = pack(env, "--rank", 0, code=3)["stderr"]
    assert "not enough space on" in err and str(env["dir"]) in err and "reserve 1000.00 TiB" in err
    assert not [p for p in env["dir"].iterdir() if p.is_file()]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_space_preflight_on_a_real_small_filesystem(tmp_path):
    env = build(tmp_path)  # rank 0's two shards need 6.72 MiB
    env["dir"].mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(env["dir"])], check=True)
    try:
        err = pack(env, "--rank", 0, code=3)["stderr"]
        assert "not enough space on" in err and "need 6.72 MiB, free 4.00 MiB" in err
        assert [p.name for p in env["dir"].rglob("*") if p.is_file()] == ["engram.lock"]
    finally:
        subprocess.run(["umount", str(env["dir"])], check=True)


def test_a_second_writer_is_refused_and_temps_are_swept(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    (env["dir"] / ".locks").mkdir(parents=True)
    leftover = env["dir"] / ".engram-l1-r0of3.bin.stage-0123abcd.tmp"
    leftover.write_bytes(b"x" * 4096)
    fd = os.open(env["dir"] / ".locks" / "engram.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        err = pack(env, "--rank", 0, code=3)["stderr"]
        assert "is locked by another stage process" in err
    finally:
        os.close(fd)
    pack(env, "--rank", 0)
    assert not leftover.exists()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


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


def test_demo_packs_after_mirror(tmp_path):
    from hubgen import build_demo

    manifest = build_demo(tmp_path / "demo")
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    result = run_stage("pack-engram", "--rank", "2", "--manifest", manifest)
    assert result.code == 0, result.stderr
    engram_dir = tmp_path / "demo" / "nvme" / "engram"
    assert sorted(p.name for p in engram_dir.glob("*.bin")) == ["engram-l1-r2of3.bin", "engram-l14-r2of3.bin"]
    assert run_stage("verify", "--node", "dgx1", "--manifest", manifest).code == 1  # rank 0 (the node's) is missing
    assert run_stage("pack-engram", "--manifest", manifest).code == 0
    assert run_stage("verify", "--node", "dgx1", "--manifest", manifest, "--full").code == 0


# ---- memory: a table larger than 1 GiB ------------------------------------------------------------

RSS_PROBE = """
import resource, subprocess, sys, time
started = time.monotonic()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.monotonic() - started)
sys.stderr.write(proc.stderr)
"""


def streamed_reference_sha256(source: Path, layer: int, lo: int, hi: int, header: bytes) -> str:
    """The shard's sha256 computed independently: offsets from the JSON header, rows hstack'ed in chunks."""
    with open(source, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        tensors = json.loads(handle.read(length))
        base = 8 + length
        weight = tensors[f"model.layers.{layer}.engram.embed.weight"]["data_offsets"][0] + base
        scale = tensors[f"model.layers.{layer}.engram.embed.scale"]["data_offsets"][0] + base
        digest = hashlib.sha256(header)
        step = 1 << 18
        for start in range(lo, hi, step):
            count = min(step, hi - start)
            handle.seek(weight + start * 256)
            w = np.frombuffer(handle.read(count * 256), np.uint8).reshape(count, 256)
            handle.seek(scale + start * 8)
            s = np.frombuffer(handle.read(count * 8), np.uint8).reshape(count, 8)
            digest.update(np.hstack([w, s]).tobytes())
    return digest.hexdigest()


def test_peak_rss_stays_bounded_on_a_table_over_1_gib(tmp_path):
    rows = (GiB + 64 * 1024 * 1024) // 264 + 7  # 1.06 GiB of rows in one layer; TP=1 packs it all
    root = tmp_path / "big"
    hub = Hub(root / "hub")
    info = add_engram_checkpoint(hub, FLASH, layers=(1,), rows=rows, shared=False)
    source = info.snapshot.dir / info.file
    assert source.stat().st_size > GiB
    manifest = write_manifest(root / "cluster.toml", root / "nas-unused", hub.root, {FLASH: {}},
                              extra=f'engram_dir = "{root / "engram"}"\nrank = 0\n\n[engram]\nmodel = "{FLASH}"\nworld = 1\n')
    try:
        probe = subprocess.run([sys.executable, "-c", RSS_PROBE, sys.executable, "-m", "stager", "pack-engram",
                                "--manifest", str(manifest), "--json"], capture_output=True, text=True, timeout=300)
        code, maxrss_kib, seconds = probe.stdout.split()
        assert code == "0", probe.stderr
        assert int(maxrss_kib) < 256 * 1024, f"peak RSS {int(maxrss_kib) // 1024} MiB"
        shard = root / "engram" / "engram-l1-r0of1.bin"
        assert shard.stat().st_size == 4096 + rows * 264 > GiB
        expected = streamed_reference_sha256(source, 1, 0, rows, struct.pack("<6Q", 0x31344E4531565344, 1, 0, rows,
                                                                             rows, 264).ljust(4096, b"\0"))
        listed = (root / "engram" / "SHA256SUMS").read_text().split()[0]
        assert listed == expected
        print(f"packed {shard.stat().st_size / GiB:.2f} GiB in {float(seconds):.1f}s, peak RSS "
              f"{int(maxrss_kib) // 1024} MiB")
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)



def test_more_ranks_than_rows_gives_empty_shards_that_verify(tmp_path):
    env = build(tmp_path, rows={1: 2, 14: 3}, world=4)
    shards = pack(env)["shards"]
    assert [(s["layer"], s["lo"], s["hi"]) for s in shards] == [
        (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 1, 2), (14, 0, 0), (14, 0, 1), (14, 1, 2), (14, 2, 3)]
    for layer in (1, 14):
        bodies = [parse_shard(Path(s["path"]))[1] for s in shards if s["layer"] == layer]
        assert b"".join(bodies) == reference(env["source"], "model.", layer)
    assert all(s["skipped"] for s in pack(env)["shards"])
    code, report = verify(env, "--full")
    assert code == 0 and report["ok"] == report["checked"], report


def run_on_pty(*args: str) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal (util-linux `script`), as in a shell."""
    command = shlex.join([sys.executable, "-m", "stager", *args])
    proc = subprocess.run(["script", "-qefc", command, "/dev/null"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})
    return proc.returncode, proc.stdout


def test_progress_bar_in_bytes_on_a_terminal_only_without_json(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    code, text = run_on_pty("pack-engram", "--rank", "0", "--node", "dgx1", "--manifest", str(env["manifest"]))
    assert code == 0 and "pack-engram" in text and "100%" in text and "B/s" in text, text
    assert "packed  " in text and "engram-l14-r0of3.bin" in text
    shutil.rmtree(env["dir"])
    code, text = run_on_pty("pack-engram", "--rank", "0", "--node", "dgx1", "--manifest", str(env["manifest"]), "--json")
    assert code == 0 and "B/s" not in text and "%|" not in text
    assert json.loads(text.strip())["shards"][0]["skipped"] is False


def test_layers_from_the_manifest_and_the_command_line(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, extra_engram="layers = [14]\n")
    assert [s["layer"] for s in pack(env, "--rank", 0)["shards"]] == [14]
    assert [s["layer"] for s in pack(env, "--rank", 0, "--layer", 1, "--layer", 1)["shards"]] == [1]
    err = pack(env, "--rank", 0, "--layer", 5, code=2)["stderr"]
    assert "layer 5" in err and "layers [1, 14] only" in err


def test_a_linked_shard_is_replaced_by_a_real_file(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    shards = pack(env, "--rank", 0)["shards"]
    real = Path(shards[0]["path"])
    elsewhere = tmp_path / "elsewhere.bin"
    os.replace(real, elsewhere)
    os.symlink(elsewhere, real)
    again = pack(env, "--rank", 0)["shards"]
    assert again[0]["reason"] == "not a regular file" and not real.is_symlink()
    assert real.read_bytes() == elsewhere.read_bytes()


# ---- the engram_dir is never on the NAS, however it is spelled ----------------------------------

def tree(root: Path) -> dict[str, tuple]:
    """Every name under `root`, links not followed: a file's sha256, a link's target, a directory."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                found[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif stat.S_ISDIR(mode):
                found[str(path.relative_to(root))] = ("dir",)
            else:
                found[str(path.relative_to(root))] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


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


# ---- writes never follow a link ------------------------------------------------------------------

@pytest.mark.parametrize("planted", ["engram-l1-r0of3.bin", "engram-l14-r0of3.json", "SHA256SUMS",
                                     ".engram-l14-r0of3.bin.stage-0badf00d.tmp"])
def test_a_link_planted_at_a_name_pack_writes_is_never_written_through(tmp_path, planted):
    """Run as root: the target of a planted link must keep its bytes. Pack either refuses (exit 3,
    naming the link) or replaces the link with a real file of the right bytes."""
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    pack(env, "--rank", 0)
    victims = tmp_path / "victims"
    victims.mkdir()
    victim = victims / "etc-shadow"
    victim.write_bytes(b"root must not write this\n")
    (env["dir"] / planted).unlink(missing_ok=True)
    os.symlink(victim, env["dir"] / planted)
    before = tree(victims)
    result = run_stage("pack-engram", "--node", "dgx1", "--manifest", env["manifest"], "--rank", "0", "--json")
    assert tree(victims) == before
    if result.code != 0:
        assert result.code == 3 and f"{env['dir'] / planted} is a symlink" in result.stderr, result.stderr
        return
    assert not (env["dir"] / planted).is_symlink()
    for name in ("engram-l1-r0of3.bin", "engram-l1-r0of3.json", "engram-l14-r0of3.bin", "engram-l14-r0of3.json",
                 "SHA256SUMS"):
        assert stat.S_ISREG((env["dir"] / name).lstat().st_mode), name
    for layer, rows in ((1, 1_003), (14, 2_011)):
        assert (env["dir"] / f"engram-l{layer}-r0of3.bin").read_bytes() == engram_reference(env["source"], layer, 0,
                                                                                            rows // 3)
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=env["dir"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 2, check.stdout + check.stderr


@pytest.mark.parametrize("plant", ["lock file", "lock directory"])
def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, plant):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011})
    victim = tmp_path / "victims"
    victim.mkdir()
    (victim / "engram.lock").write_bytes(b"precious\n")
    (env["dir"]).mkdir(parents=True)
    if plant == "lock file":
        (env["dir"] / ".locks").mkdir()
        os.symlink(victim / "engram.lock", env["dir"] / ".locks" / "engram.lock")
    else:
        os.symlink(victim, env["dir"] / ".locks")
    before = tree(victim)
    err = pack(env, "--rank", 0, code=3)["stderr"]
    assert "symlink" in err and ".locks" in err, err
    assert tree(victim) == before
    assert not list(env["dir"].glob("engram-*"))


# ---- SHA256SUMS: once per run ---------------------------------------------------------------------

def test_sha256sums_is_rewritten_once_per_run_and_restored_after_a_kill(tmp_path, monkeypatch):
    from stager import engram

    env = build(tmp_path, rows={1: 70_001, 14: 9_973})
    renamed: list[str] = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        renamed.append(os.path.basename(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    report = engram.pack(load_manifest(env["manifest"]), "dgx1")  # every rank: 6 shards
    assert len(report.shards) == 6 and not any(s.skipped for s in report.shards)
    assert renamed.count("SHA256SUMS") == 1, renamed
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=env["dir"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 6, check.stdout + check.stderr
    for shard in report.shards:
        assert shard.spec.path.read_bytes() == engram_reference(env["source"], shard.spec.layer, shard.spec.lo,
                                                                 shard.spec.hi)
    # A run killed after its renames and receipts, before SHA256SUMS: the shards are kept, the lines restored.
    listed = (env["dir"] / "SHA256SUMS").read_bytes()
    (env["dir"] / "SHA256SUMS").unlink()
    stamps = {s.spec.path: stamp(s.spec.path) for s in report.shards}
    renamed.clear()
    again = engram.pack(load_manifest(env["manifest"]), "dgx1")
    assert all(s.skipped for s in again.shards) and {p: stamp(p) for p in stamps} == stamps
    assert renamed == ["SHA256SUMS"] and (env["dir"] / "SHA256SUMS").read_bytes() == listed
    renamed.clear()
    engram.pack(load_manifest(env["manifest"]), "dgx1")
    assert renamed == []  # nothing to restore, nothing rewritten


# ---- input that makes no sense is refused up front -------------------------------------------------

@pytest.mark.parametrize("pattern,named", [("model.safetensors.index.json", "model.safetensors.index.json"),
                                           ("*.json", "model.safetensors.index.json"),
                                           ("model-engram.*", "model-engram.safetensors")])
def test_an_exclude_that_keeps_the_checkpoint_off_the_node_exits_2(tmp_path, pattern, named):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, exclude=[pattern])
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert f'models."{FLASH}".exclude: {pattern!r} keeps {named} off the node' in line, line
    assert "not staged" not in line
    assert not env["dir"].exists()
    # The NAS copy is readable, so --from-nas packs what the exclude keeps off the node.
    shards = pack(env, "--rank", 0, "--from-nas")["shards"]
    assert [parse_shard(Path(s["path"]))[1] for s in shards] == [
        reference(env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / env["info"].file, "model.", layer)
        [:rows // 3 * 264] for layer, rows in ((1, 1_003), (14, 2_011))]


def rewrite_index(env, weight_map_changes: dict[str, str]) -> None:
    index_path = env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "model.safetensors.index.json"
    target = Path(os.path.realpath(index_path))
    index = json.loads(target.read_text())
    index["weight_map"].update(weight_map_changes)
    os.chmod(target, 0o644)
    target.write_text(json.dumps(index))


@pytest.mark.parametrize("extra", [[], ["--from-nas"]])
def test_an_index_naming_a_file_the_snapshot_lacks_exits_2(tmp_path, extra):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, stage=False)
    rewrite_index(env, {f"model.layers.14.engram.embed.{part}": "model-00002-of-00002.safetensors"
                        for part in ("weight", "scale")})
    err = pack(env, "--rank", 0, *extra, code=2)["stderr"]
    line, = err.splitlines()
    assert "model.safetensors.index.json: weight_map names model-00002-of-00002.safetensors" in line, line
    assert "which the snapshot does not have" in line and "not staged" not in line
    assert not env["dir"].exists()


def test_a_name_with_a_newline_stays_on_one_line(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, stage=False)
    rewrite_index(env, {f"model.layers.14.engram.embed.{part}": "bad\nname.safetensors" for part in ("weight", "scale")})
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert "weight_map names bad\\nname.safetensors" in line, line


def test_pack_output_escapes_control_characters_in_names(tmp_path):
    engram_dir = tmp_path / "nvme" / "eng\nram\tdir"
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, engram_dir=engram_dir)
    result = run_stage("pack-engram", "--node", "dgx1", "--manifest", env["manifest"], "--rank", "0")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("packed ") for line in lines[:2]), lines
    assert "eng\\nram\\tdir/engram-l1-r0of3.bin" in lines[0]
    assert (engram_dir / "engram-l1-r0of3.bin").read_bytes() == engram_reference(env["source"], 1, 0, 1_003 // 3)


def test_overlapping_data_offsets_exit_2_naming_the_tensor(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    w14 = "model.layers.14.engram.embed.weight"
    header = engram_header(10, **{w14.replace(".", "__"): {"data_offsets": [0, 2560]}})  # on top of layer 1's weight
    corrupt(env, with_header(header, 10 * 264 * 2))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert f"model-engram.safetensors: tensor {w14}: data_offsets [0, 2560] overlap tensor {W1}" in line, line
    assert not list(env["dir"].glob("*.bin"))


@pytest.mark.parametrize("case", ["gap", "bytes after the data"])
def test_data_offsets_safetensors_refuses_exit_2(tmp_path, case):
    env = build(tmp_path, rows={1: 10, 14: 10})
    header, data = engram_header(10), 10 * 264 * 2
    s14 = "model.layers.14.engram.embed.scale"
    if case == "gap":
        header[s14]["data_offsets"] = [5280, 5360]  # 80 bytes after layer 14's weight ends at 5200
        data = 5360
        message = f"tensor {s14}: data_offsets [5280, 5360] leave a gap of 80 bytes after tensor"
    else:
        data += 8
        message = "8 bytes after the tensor data"
    corrupt(env, with_header(header, data))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert message in line and "model-engram.safetensors" in line, line
    assert not list(env["dir"].glob("*.bin"))


@pytest.mark.parametrize("heads,named", [
    ('{"1": [500, 503], "01": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'01': layer 1 is also given as '1'"),
    ('{"1": [500, 503], "1": [501, 502], "14": [1000, 1011]}', "engram_head_rows.1: the key appears twice"),
    ('{"\\u0661": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'\u0661': not a layer number"),
    ('{"1.0": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'1.0': not a layer number"),
])
def test_engram_head_rows_keys_must_be_layer_numbers_once(tmp_path, heads, named):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, layout="heads")
    config = env["local"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "config.json"
    target = Path(os.path.realpath(config))
    os.chmod(target, 0o644)
    target.write_text('{"engram_layer_ids": [1, 14], "engram_head_rows": ' + heads + "}")
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert "config.json: " + named in line, line
    assert not env["dir"].exists()
