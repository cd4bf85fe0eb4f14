"""`stage pack-engram` end to end (stager/engram/packer.py): real checkpoints, real shards, real tools.

Every shard is compared with one packed here independently (engram_fixtures), SHA256SUMS is
checked by `sha256sum -c`, and faults (a full tmpfs, a held lock, planted links) are real.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
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

from conftest import run_stage, write_manifest
from engram_fixtures import (FLASH, GiB, build, independent_bounds, independent_shard, pack, parse_shard, reference,
                             sha256sum_check, source_tables, stamp, tree, verify)
from hubgen import Hub, add_engram_checkpoint
from reliability_support import engram_reference, needs_root, ramfs, tmpfs
from stager.manifest import load_manifest

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


def test_pack_output_escapes_control_characters_in_names(tmp_path):
    engram_dir = tmp_path / "nvme" / "eng\nram\tdir"
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, engram_dir=engram_dir)
    result = run_stage("pack-engram", "--node", "dgx1", "--manifest", env["manifest"], "--rank", "0")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("packed ") for line in lines[:2]), lines
    assert "eng\\nram\\tdir/engram-l1-r0of3.bin" in lines[0]
    assert (engram_dir / "engram-l1-r0of3.bin").read_bytes() == engram_reference(env["source"], 1, 0, 1_003 // 3)


# ---- every rank of a node in one pass ---------------------------------------------------------------

def source_reads(monkeypatch, source: Path) -> list[tuple[int, int]]:
    """(offset, bytes) of every positioned read of `source` made in this process from now on."""
    reads: list[tuple[int, int]] = []
    real_preadv, real_pread = os.preadv, os.pread
    target = os.stat(source)

    def is_source(fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)

    def preadv(fd, buffers, offset, *args):
        got = real_preadv(fd, buffers, offset, *args)
        if is_source(fd):
            reads.append((offset, got))
        return got

    def pread(fd, length, offset):
        data = real_pread(fd, length, offset)
        if is_source(fd):
            reads.append((offset, len(data)))
        return data

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    return reads


@pytest.mark.parametrize("layout,heads", [("floor", None), ("heads", [9_000, 11_001, 8_000, 12_000, 10_000,
                                                                       10_000, 10_000, 10_000])])
def test_a_node_with_ranks_packs_all_of_them_from_one_read_of_each_table(tmp_path, monkeypatch, layout, heads):
    from stager import engram

    rows = {1: 80_001, 14: 9_973}
    env = build(tmp_path, rows=rows, world=8, ranks=list(range(8)), layout=layout,
                heads=[heads, [1_246] * 7 + [1_251]] if heads else None)
    reads = source_reads(monkeypatch, env["source"])
    report = engram.pack(load_manifest(env["manifest"]), "dgx1")
    monkeypatch.undo()
    assert [(s.spec.layer, s.spec.rank) for s in report.shards] == [(layer, r) for layer in (1, 14) for r in range(8)]
    # Every shard equals the one packed independently, and coreutils agrees with SHA256SUMS.
    for layer, count in rows.items():
        layer_heads = None if heads is None else heads if layer == 1 else [1_246] * 7 + [1_251]
        for rank, (lo, hi) in enumerate(independent_bounds(count, 8, layout, layer_heads)):
            path = env["dir"] / f"engram-l{layer}-r{rank}of8.bin"
            assert path.read_bytes() == independent_shard(env["source"], "model.", layer, lo, hi), path.name
            receipt = json.loads(path.with_suffix(".json").read_text())
            assert (receipt["rank"], receipt["lo"], receipt["hi"]) == (rank, lo, hi)
            assert receipt["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    sha256sum_check(env["dir"], 16)
    # Each table was read once, front to back: the reads of each weight or scale span follow one
    # another without a gap, and end at the span's end. An O_DIRECT read takes the whole 4 KiB
    # blocks holding the rows it is for, so two reads in a row share at most one block, and a
    # read's padding may reach into the next span: a read is for the span that holds its middle
    # byte (every read here is over 8 KiB, its padding under 4 KiB at either end), and only its
    # part inside that span counts.
    for name, (start, shape) in source_tables(env["source"]).items():
        end = start + shape[0] * shape[1]
        inside = [(max(offset, start), min(offset + size, end)) for offset, size in reads
                  if start <= offset + size // 2 < end]
        position = start
        for first, last in inside:
            assert position - 4096 <= first <= position, \
                f"{name}: read from {first - start}, after the previous read ended at {position - start}"
            position = max(position, last)
        assert position == end, name


def test_repeated_rank_options_pack_those_ranks_in_one_pass(tmp_path):
    env = build(tmp_path, rows={1: 70_001, 14: 9_973}, world=5)
    shards = pack(env, "--rank", 3, "--rank", 0, "--rank", 3)["shards"]
    assert [(s["layer"], s["rank"]) for s in shards] == [(1, 0), (1, 3), (14, 0), (14, 3)]
    for shard in shards:
        rows = {1: 70_001, 14: 9_973}[shard["layer"]]
        lo, hi = independent_bounds(rows, 5)[shard["rank"]]
        assert Path(shard["path"]).read_bytes() == independent_shard(env["source"], "model.", shard["layer"], lo, hi)
    sha256sum_check(env["dir"], 4)


def test_preflight_counts_every_rank_of_the_run(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, ranks=[0, 1, 2])
    env["manifest"].write_text(env["manifest"].read_text().replace('reserve = "0"', 'reserve = "1000TiB"'))
    err = pack(env, code=3)["stderr"]
    need = sum(4096 + (hi - lo) * 264 for rows in (1_003, 2_011) for lo, hi in independent_bounds(rows, 3))
    assert f"need {need / 1024:.2f} KiB" in err, err
    assert not list(env["dir"].glob("engram-*"))


def test_a_kill_in_a_multi_rank_pass_keeps_the_shards_already_in_place(tmp_path):
    """SIGKILL while rank 2 of 3 is being written: ranks 0 and 1 are complete under their names with
    their receipts; the re-run keeps them, packs the rest, and SHA256SUMS lists all six."""
    env = build(tmp_path, rows={1: 400_003, 14: 9_973}, ranks=[0, 1, 2])
    command = [sys.executable, "-m", "stager", "pack-engram", "--node", "dgx1", "--manifest", str(env["manifest"])]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = env["dir"] / "engram-l1-r1of3.json"
    deadline = time.monotonic() + 60
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    kept = {p.name: stamp(p) for p in env["dir"].glob("engram-*.bin") if p.with_suffix(".json").exists()}
    assert {"engram-l1-r0of3.bin", "engram-l1-r1of3.bin"} <= set(kept)
    again = {Path(s["path"]).name: s for s in pack(env)["shards"]}
    for name, before in kept.items():
        assert again[name]["skipped"] and stamp(env["dir"] / name) == before, name
    for layer, rows in ((1, 400_003), (14, 9_973)):
        for rank, (lo, hi) in enumerate(independent_bounds(rows, 3)):
            path = env["dir"] / f"engram-l{layer}-r{rank}of3.bin"
            assert path.read_bytes() == independent_shard(env["source"], "model.", layer, lo, hi)
    sha256sum_check(env["dir"], 6)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_shards_on_a_memory_filesystem_get_the_same_bytes(tmp_path):
    """Shards written to a tmpfs: O_DIRECT where the kernel allows it there (6.x does), buffered
    where it refuses it (older kernels). ramfs, which always refuses it, reports no free space, so
    the preflight stops a pack there before any write."""
    env = build(tmp_path, rows={1: 70_001, 14: 9_973}, ranks=[0, 1, 2])
    with tmpfs(env["dir"], 64 << 20):
        pack(env)
        for layer, rows in ((1, 70_001), (14, 9_973)):
            for rank, (lo, hi) in enumerate(independent_bounds(rows, 3)):
                path = env["dir"] / f"engram-l{layer}-r{rank}of3.bin"
                assert path.read_bytes() == independent_shard(env["source"], "model.", layer, lo, hi)
        sha256sum_check(env["dir"], 6)


# ---- the table read with O_DIRECT, from wherever its spans start ------------------------------------

ODD_LEAD = 12_345  # bytes of another tensor before the Engram ones: every span starts 1 past a multiple of 8


def build_unaligned(tmp_path: Path) -> tuple[dict, Path]:
    """Two layers packed for TP=5 from a checkpoint whose every span starts off 8- and 4 KiB-alignment,
    and whose end is inside a block, so the last read of the last span runs past the end of the file."""
    env = build(tmp_path, rows={1: 70_001, 14: 9_973}, world=5, ranks=list(range(5)), leading_bytes=ODD_LEAD)
    source = Path(os.path.realpath(env["source"]))
    starts = [at for name, (at, _shape) in source_tables(source).items() if ".engram." in name]
    assert len(starts) == 4 and all(at % 8 for at in starts) and source.stat().st_size % 4096
    return env, source


def assert_shards_match_the_source(env, source: Path) -> None:
    for layer, rows in ((1, 70_001), (14, 9_973)):
        for rank, (lo, hi) in enumerate(independent_bounds(rows, 5)):
            path = env["dir"] / f"engram-l{layer}-r{rank}of5.bin"
            assert path.read_bytes() == independent_shard(source, "model.", layer, lo, hi), path.name
    sha256sum_check(env["dir"], 10)


def cached_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now, as util-linux `fincore` counts them (mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def filesystem_type(path: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_table_at_an_odd_offset_is_read_around_the_page_cache_byte_for_byte(tmp_path):
    """On a disk the table is read with O_DIRECT: each span of a chunk as the whole 4 KiB blocks
    that hold it, its rows taken from inside them. The spans start 1 byte past a multiple of 8 and
    the ranks' boundaries put chunks at many other offsets in their blocks; the rows are
    pseudo-random, so a slice off by any number of bytes, or by a block, gives other shards."""
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory: no disk to read around the page cache from")
    env, source = build_unaligned(tmp_path)
    fd = os.open(source, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the mirror's copy left it cached
    finally:
        os.close(fd)
    assert cached_bytes(source) == 0
    pack(env)
    # Only the header read by the geometry (and the kernel's read-ahead after it) went through
    # the page cache: 21 MB of rows went from the disk straight to the chunk buffers.
    assert cached_bytes(source) < 1024 * 1024 < source.stat().st_size // 16
    assert_shards_match_the_source(env, source)
    # The probe does see a buffered read of the same file.
    source.read_bytes()
    assert cached_bytes(source) > source.stat().st_size // 2
    code, report = verify(env, "--full")  # the full check re-derives every row the same way
    assert code == 0 and report["ok"] == report["checked"], report


@pytest.mark.parametrize("filesystem", ["tmpfs", "ramfs"])
def test_a_table_on_a_memory_filesystem_packs_the_same_bytes(tmp_path, filesystem):
    """ramfs refuses O_DIRECT at open (EINVAL), so the table is read through the page cache, the
    wanted bytes from their own offsets. tmpfs refuses it too on older kernels; newer ones take
    it, and a "direct" read of tmpfs is a copy from its own pages. Either way: the same shards."""
    needs_root()
    env, _ = build_unaligned(tmp_path)
    memory = tmp_path / filesystem
    mount = tmpfs(memory, 256 * 1024 * 1024) if filesystem == "tmpfs" else ramfs(memory)
    with mount:
        subprocess.run(["cp", "-a", str(env["local"]), str(memory / "hub")], check=True)
        manifest = env["manifest"].read_text()
        env["manifest"].write_text(manifest.replace(f'hub = "{env["local"]}"', f'hub = "{memory / "hub"}"'))
        source = Path(os.path.realpath(memory / "hub" / env["source"].relative_to(env["local"])))
        assert filesystem_type(source) == filesystem
        if filesystem == "ramfs":
            with pytest.raises(OSError) as refused:
                os.close(os.open(source, os.O_RDONLY | os.O_DIRECT))
            assert refused.value.errno == errno.EINVAL
        pack(env)
        assert_shards_match_the_source(env, source)
        code, report = verify(env, "--full")
        assert code == 0 and report["ok"] == report["checked"], report


def test_a_table_cut_short_after_its_header_was_read_is_refused(tmp_path):
    """The geometry was read, then the file lost its last bytes: the read of the last rank's
    rows comes back short of them (at a block boundary or inside a block) and the pass stops
    with the byte where the file ended, instead of packing what the blocks held."""
    from stager.engram.checkpoint import open_checkpoint
    from stager.engram.node_shards import shard_specs
    from stager.engram.packer import pack_rows
    from stager.base.errors import CannotRun

    env, source = build_unaligned(tmp_path)
    checkpoint = open_checkpoint(load_manifest(env["manifest"]), "dgx1", from_nas=False)
    last = [spec for spec in shard_specs(load_manifest(env["manifest"]), "dgx1", checkpoint) if spec.layer == 14][-1]
    boundary = (source.stat().st_size - 5_000) // 4096 * 4096  # inside the last span, like boundary + 1000
    for cut in (boundary + 1_000, boundary):
        os.truncate(source, cut)
        with pytest.raises(CannotRun, match=f"ended at byte {cut}; the file changed while it was read"):
            pack_rows(checkpoint, last, [(last.lo, last.hi)], tmp_path / "partial.bin")
