"""The DSV1EN41 shard format: file name, 4096-byte header, 264-byte rows, and `ShardSpec`.

The one description of a shard on disk. The packer writes it, the checks and `stage verify`
read it, the disk audit names files by it; none of them spells the name pattern, the header
layout or a row offset on its own. Nothing here reads a checkpoint or a manifest.

    bytes 0-47    six little-endian u64: MAGIC, layer, lo, hi, total_rows, row_bytes (264)
    bytes 48-4095 zero
    4096 + 264*(r - lo)   row r: 256 weight bytes (F8_E4M3), then 8 scale bytes (F8_E8M0)

Every offset is a Python int: a 384 M-row table is 101 GB, past any 32-bit size.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x31344E4531565344  # b"DSV1EN41" as a little-endian u64
HEADER_BYTES = 4096
WEIGHT_BYTES = 256
SCALE_BYTES = 8
ROW_BYTES = WEIGHT_BYTES + SCALE_BYTES
WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F8_E8M0"
_NAME = re.compile(r"engram-l(?P<layer>\d+)-r(?P<rank>\d+)of(?P<world>\d+)\.bin")


def shard_name(layer: int, rank: int, world: int) -> str:
    return f"engram-l{layer}-r{rank}of{world}.bin"


def parse_shard_name(name: str) -> tuple[int, int, int] | None:
    """(layer, rank, world) of a shard file name, None for anything else."""
    match = _NAME.fullmatch(name)  # fullmatch: `$` would also accept the name followed by a newline
    return (int(match["layer"]), int(match["rank"]), int(match["world"])) if match else None


def shard_header(layer: int, lo: int, hi: int, total_rows: int) -> bytes:
    return struct.pack("<6Q", MAGIC, layer, lo, hi, total_rows, ROW_BYTES).ljust(HEADER_BYTES, b"\0")


def shard_bytes(lo: int, hi: int) -> int:
    return HEADER_BYTES + (hi - lo) * ROW_BYTES


@dataclass(frozen=True)
class ShardSpec:
    """One shard as the chosen layout wants it: rows [lo, hi) of `layer`'s table, for `rank` of `world`."""

    path: Path
    layer: int
    rank: int
    world: int
    lo: int
    hi: int
    bytes: int
    total_rows: int
    layout: str

    @classmethod
    def make(cls, directory: Path, layer: int, rank: int, world: int, lo: int, hi: int, total_rows: int,
             layout: str) -> "ShardSpec":
        return cls(Path(directory) / shard_name(layer, rank, world), layer, rank, world, lo, hi,
                   shard_bytes(lo, hi), total_rows, layout)

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def receipt(self) -> Path:
        return self.path.with_suffix(".json")

    def header(self) -> bytes:
        return shard_header(self.layer, self.lo, self.hi, self.total_rows)

    def offset(self, row: int) -> int:
        """Where table row `row` starts in this shard's file."""
        return HEADER_BYTES + (row - self.lo) * ROW_BYTES

    def to_json(self) -> dict:
        return {"path": str(self.path), "layer": self.layer, "rank": self.rank, "world": self.world,
                "lo": self.lo, "hi": self.hi, "bytes": self.bytes}


def describe_header(raw: bytes, spec: ShardSpec) -> str | None:
    """Why a shard's header is not the one `spec` needs (None: it is)."""
    if raw == spec.header():
        return None
    if len(raw) < HEADER_BYTES:
        return f"header is {len(raw)} bytes, expected {HEADER_BYTES}"
    magic, layer, lo, hi, total, row_bytes = struct.unpack_from("<6Q", raw)
    if magic != MAGIC:
        return "not a DSV1EN41 shard header"
    if (layer, total, row_bytes) != (spec.layer, spec.total_rows, ROW_BYTES):
        return (f"header says layer {layer}, {total} rows of {row_bytes} bytes; expected layer {spec.layer}, "
                f"{spec.total_rows} rows of {ROW_BYTES}")
    if (lo, hi) != (spec.lo, spec.hi):
        return f"header rows {lo}..{hi} disagree with the {spec.layout} layout's {spec.lo}..{spec.hi}"
    return "header padding is not zero"
