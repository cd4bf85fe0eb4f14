"""Shared pieces of the Engram suites: a NAS with an Engram checkpoint, the real CLI, and
references computed here, independently of stager.engram.

The references share nothing with the code under test: tensors are read with the
`safetensors` library or by offsets parsed here from the JSON header, rows interleaved with
numpy, partitions computed from their written definition, shard headers packed and parsed with
struct. SHA256SUMS is checked by coreutils' `sha256sum -c` as a real subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
from pathlib import Path

import numpy as np
import safetensors

from conftest import run_stage, write_manifest
from hubgen import Hub, add_engram_checkpoint
from stager.mirror import pipeline as mirror_core
from stager.manifest import load_manifest

FLASH = "acme/Flash-3bpw"


MAGIC = b"DSV1EN41"


GiB = 1024 ** 3


def build(tmp_path: Path, *, layers=(1, 14), rows=None, prefix="model.", world=3, layout=None, heads=None,
          manifest_heads=None, rank: int | None = None, ranks: list[int] | None = None, reserve="0", stage=True,
          extra_engram="", exclude: list[str] | None = None, engram_dir: Path | None = None,
          leading_bytes: int = 0) -> dict:
    """A NAS with an Engram checkpoint, a manifest for node dgx1, and (stage=True) the model mirrored."""
    rows = rows or {1: 70_001, 14: 9_973}  # layer 1 spans several 16 Ki-row chunks; neither divides by 3
    nas = Hub(tmp_path / "nas" / "hf" / "hub")
    info = add_engram_checkpoint(nas, FLASH, layers=layers, rows=rows, prefix=prefix, heads=heads,
                                 leading_bytes=leading_bytes)
    local = tmp_path / "nvme" / "hf" / "hub"
    engram_dir = engram_dir or tmp_path / "nvme" / "engram"
    node = f"engram_dir = {json.dumps(str(engram_dir))}\n" + (f"rank = {rank}\n" if rank is not None else "")
    node += f"ranks = {json.dumps(ranks)}\n" if ranks is not None else ""
    table = f'\n[engram]\nmodel = "{FLASH}"\nworld = {world}\n'
    if layout:
        table += f'layout = "{layout}"\n'
    if manifest_heads:
        table += f"engram_head_rows = {json.dumps(manifest_heads)}\n"
    manifest = write_manifest(tmp_path / "cluster.toml", nas.root, local, {FLASH: {"exclude": exclude}},
                              reserve=reserve, extra=node + table + extra_engram)
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


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


def rewrite_index(env, weight_map_changes: dict[str, str]) -> None:
    index_path = env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "model.safetensors.index.json"
    target = Path(os.path.realpath(index_path))
    index = json.loads(target.read_text())
    index["weight_map"].update(weight_map_changes)
    os.chmod(target, 0o644)
    target.write_text(json.dumps(index))


def source_tables(source: Path) -> dict[str, tuple[int, list[int]]]:
    """tensor name -> (absolute offset, shape), parsed here from the safetensors header."""
    with open(source, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: (8 + length + t["data_offsets"][0], t["shape"]) for name, t in header.items()
            if name != "__metadata__"}


def independent_bounds(rows: int, world: int, layout: str = "floor",
                       heads: list[int] | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of every rank, from the written definition (floor: rows*R//TP; heads: whole heads,
    rank R taking heads H*R//TP .. H*(R+1)//TP - 1)."""
    if layout == "floor":
        return [(rows * r // world, rows * (r + 1) // world) for r in range(world)]
    starts = np.concatenate([[0], np.cumsum(heads)]).tolist()
    return [(starts[len(heads) * r // world], starts[len(heads) * (r + 1) // world]) for r in range(world)]


def independent_shard(source: Path, prefix: str, layer: int, lo: int, hi: int) -> bytes:
    """One shard's bytes, packed here: header fields by struct, rows np.hstack'ed from the spans."""
    tables = source_tables(source)
    (w_at, (rows, w_width)), (s_at, (_, s_width)) = (tables[f"{prefix}layers.{layer}.engram.embed.{part}"]
                                                    for part in ("weight", "scale"))
    assert (w_width, s_width) == (256, 8)
    with open(source, "rb") as handle:
        handle.seek(w_at + lo * 256)
        w = np.frombuffer(handle.read((hi - lo) * 256), np.uint8).reshape(hi - lo, 256)
        handle.seek(s_at + lo * 8)
        s = np.frombuffer(handle.read((hi - lo) * 8), np.uint8).reshape(hi - lo, 8)
    head = struct.pack("<6Q", 0x31344E4531565344, layer, lo, hi, rows, 264) + bytes(4096 - 48)
    return head + np.hstack([w, s]).tobytes()


def sha256sum_check(directory: Path, expected_ok: int) -> None:
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=directory, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == expected_ok, check.stdout + check.stderr
