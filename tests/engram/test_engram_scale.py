"""The field's table size without the disk: 384,016,682 rows x 264 B (101 GB) in a sparse file.

A safetensors header and `truncate` make the source; real bytes are written only where rows are
read (the boundary rows of every rank, one rank's first and last chunks). The packer's own read
and write path (`pack_rows`) writes those rows at their offsets in sparse shards of full size, and
everything is checked against offsets computed here from the written definitions. Runs in
seconds; the files take a few MiB of disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np

from conftest import write_manifest
from engram_fixtures import independent_bounds
from stager.engram.checkpoint import open_checkpoint
from stager.engram.checks import SAMPLE_ROWS, check_shard
from stager.engram.node_shards import shard_specs
from stager.engram.packer import pack_rows
from stager.engram.receipts import write_receipt
from stager.engram.row_stream import CHUNK_ROWS
from stager.manifest import load_manifest

ROWS = 384_016_682  # one layer of the field's table
WORLD = 8
LAYER = 3
MODEL = "acme/Field-scale"
MiB = 1024 * 1024


def sparse_checkpoint(root: Path) -> tuple[Path, Path, dict[str, int]]:
    """(hub, safetensors file, absolute start of each span): a hub snapshot whose Engram file is
    a header followed by a 101 GB hole."""
    commit = "5" * 40
    repo = root / "hub" / "models--acme--Field-scale"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    header, offset = {}, 0
    for part, dtype, width in (("weight", "F8_E4M3", 256), ("scale", "F8_E8M0", 8)):
        header[f"model.layers.{LAYER}.engram.embed.{part}"] = {
            "dtype": dtype, "shape": [ROWS, width], "data_offsets": [offset, offset + ROWS * width]}
        offset += ROWS * width
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    source = snap / "model-engram.safetensors"
    source.write_bytes(struct.pack("<Q", len(text)) + text)
    os.truncate(source, 8 + len(text) + offset)
    index = {"weight_map": {name: source.name for name in header}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    (snap / "config.json").write_text(json.dumps({"engram_layer_ids": [LAYER]}))
    return root / "hub", source, {"weight": 8 + len(text), "scale": 8 + len(text) + ROWS * 256}


def vm_bytes(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB$", status, re.MULTILINE).group(1)) * 1024


def fill(source: Path, spans: dict[str, int], lo: int, hi: int, seed: int) -> None:
    """Real bytes for rows [lo, hi) of both spans."""
    rng = np.random.default_rng(seed)
    fd = os.open(source, os.O_WRONLY)
    try:
        os.pwrite(fd, rng.bytes((hi - lo) * 256), spans["weight"] + lo * 256)
        os.pwrite(fd, rng.bytes((hi - lo) * 8), spans["scale"] + lo * 8)
    finally:
        os.close(fd)


def source_rows(source: Path, spans: dict[str, int], lo: int, hi: int) -> bytes:
    """Rows [lo, hi) interleaved, read here by offset."""
    fd = os.open(source, os.O_RDONLY)
    try:
        w = np.frombuffer(os.pread(fd, (hi - lo) * 256, spans["weight"] + lo * 256), np.uint8).reshape(-1, 256)
        s = np.frombuffer(os.pread(fd, (hi - lo) * 8, spans["scale"] + lo * 8), np.uint8).reshape(-1, 8)
    finally:
        os.close(fd)
    return np.hstack([w, s]).tobytes()


def shard_rows(path: Path, shard_lo: int, lo: int, hi: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(4096 + (lo - shard_lo) * 264)
        return handle.read((hi - lo) * 264)


def test_a_field_sized_table_packs_at_64_bit_offsets_in_bounded_memory(tmp_path, monkeypatch):
    root = tmp_path / "field"
    try:
        hub, source, spans = sparse_checkpoint(root)
        assert source.stat().st_size > 100 * 10 ** 9 > source.stat().st_blocks * 512
        bounds = independent_bounds(ROWS, WORLD)
        packed = 5
        lo, hi = bounds[packed]
        first, last = (lo, lo + CHUNK_ROWS), (hi - CHUNK_ROWS, hi)
        for seed, (a, b) in enumerate([first, last] + [(r_lo, r_lo + 1) for r_lo, _ in bounds]
                                      + [(r_hi - 1, r_hi) for _, r_hi in bounds]):
            fill(source, spans, a, b, seed)
        engram_dir = root / "engram"
        engram_dir.mkdir()
        manifest = load_manifest(write_manifest(
            root / "cluster.toml", root / "nas", hub, {MODEL: {}},
            extra=f'engram_dir = "{engram_dir}"\n\n[engram]\nmodel = "{MODEL}"\nworld = {WORLD}\n'))

        # The process's resident high-water mark, reset here (clear_refs 5): it counts the chunk
        # buffers, which are mmap'd (page-aligned for O_DIRECT) and so invisible to tracemalloc.
        Path("/proc/self/clear_refs").write_text("5")
        resident = vm_bytes("VmRSS")
        checkpoint = open_checkpoint(manifest, "dgx1", from_nas=False)
        specs = shard_specs(manifest, "dgx1", checkpoint)
        pack_rows(checkpoint, specs[packed], [first, last], engram_dir / "partial.bin")
        for spec in specs:
            pack_rows(checkpoint, spec, [(spec.lo, spec.lo + 1), (spec.hi - 1, spec.hi)],
                      engram_dir / f"boundary-r{spec.rank}.bin")
        peak = vm_bytes("VmHWM") - resident
        # The pipeline's reused chunk buffers (two here, for two chunks; three at most), 8.3 MiB
        # each, and nothing that grows with the rows: one byte per row would be 366 MiB.
        assert 8 * MiB < peak < 40 * MiB, f"peak {peak / MiB:.1f} MiB"

        # Partition boundaries and sizes, computed here: every rank's range, past 2**32 bytes.
        assert [(s.rank, s.lo, s.hi) for s in specs] == [(r, a, b) for r, (a, b) in enumerate(bounds)]
        assert bounds[0][0] == 0 and bounds[-1][1] == ROWS
        for spec in specs:
            size = 4096 + (spec.hi - spec.lo) * 264
            assert spec.bytes == size > 2 ** 33
            path = engram_dir / f"boundary-r{spec.rank}.bin"
            assert path.stat().st_size == size
            with open(path, "rb") as handle:
                fields = struct.unpack("<6Q", handle.read(48))
            assert fields == (0x31344E4531565344, LAYER, spec.lo, spec.hi, ROWS, 264)
            for row in (spec.lo, spec.hi - 1):  # the boundary rows, byte for byte
                expected = source_rows(source, spans, row, row + 1)
                assert expected != bytes(264) and shard_rows(path, spec.lo, row, row + 1) == expected, (spec.rank, row)
        # One rank's first and last chunks, packed for real at their 64-bit offsets.
        partial = engram_dir / "partial.bin"
        assert partial.stat().st_size == specs[packed].bytes and partial.stat().st_blocks * 512 < 64 * MiB
        for a, b in (first, last):
            assert shard_rows(partial, lo, a, b) == source_rows(source, spans, a, b)

        # Sampled verify reads the same bounded number of rows, whatever the shard's size.
        spec = specs[packed]
        os.replace(partial, spec.path)
        write_receipt(spec, checkpoint, "ab" * 32)
        sums = {spec.path.name: "ab" * 32}
        read = [0]
        real_preadv, real_pread = os.preadv, os.pread

        def preadv(fd, buffers, offset, *args):
            got = real_preadv(fd, buffers, offset, *args)
            read[0] += got
            return got

        def pread(fd, length, offset):
            data = real_pread(fd, length, offset)
            read[0] += len(data)
            return data

        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "pread", pread)
        for seed in (1, 2, 3):
            read[0] = 0
            assert check_shard(spec, checkpoint, sums, seed=seed) is None
            assert 0 < read[0] <= 4096 + (SAMPLE_ROWS + 2) * 264 * 2, read[0]
        monkeypatch.undo()
        with open(spec.path, "r+b") as handle:  # a flipped byte in the last row is found
            handle.seek(spec.offset(spec.hi - 1) + 100)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 1]))
        assert check_shard(spec, checkpoint, sums, seed=1) == f"row {spec.hi - 1} differs from the source"
    finally:
        shutil.rmtree(root, ignore_errors=True)
