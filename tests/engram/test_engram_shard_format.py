"""The shard format (stager/engram/shard_format.py) against the format written down in docs/engram.md,
packed and parsed here with struct."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from stager.engram.shard_format import HEADER_BYTES, ROW_BYTES, ShardSpec, describe_header, parse_shard_name, shard_name


def test_header_bytes_are_the_documented_layout():
    spec = ShardSpec.make(Path("/e"), 14, 7, 8, 336_014_596, 384_016_682, 384_016_682, "floor")
    raw = spec.header()
    assert len(raw) == 4096 and raw[:8] == b"DSV1EN41" and raw[48:] == bytes(4096 - 48)
    assert struct.unpack("<6Q", raw[:48]) == (0x31344E4531565344, 14, 336_014_596, 384_016_682, 384_016_682, 264)
    assert describe_header(raw, spec) is None


def test_sizes_and_offsets_past_32_bits():
    lo, hi = 384_016_682 * 7 // 8, 384_016_682
    spec = ShardSpec.make(Path("/e"), 1, 7, 8, lo, hi, hi, "floor")
    assert (lo, hi - lo) == (336_014_596, 48_002_086)
    assert spec.bytes == 12_672_554_800  # 4096 + 48,002,086 x 264
    assert spec.bytes > 2 ** 33 and spec.offset(hi - 1) == spec.bytes - 264
    assert spec.offset(lo) == HEADER_BYTES and ROW_BYTES == 264


@pytest.mark.parametrize("name,parsed", [
    ("engram-l1-r0of3.bin", (1, 0, 3)), ("engram-l14-r7of8.bin", (14, 7, 8)),
    ("engram-l1-r0of3.bin\n", None), ("engram-l1-r0of3.json", None), ("xengram-l1-r0of3.bin", None),
    ("engram-l1-r0of3.bin.stage-0123abcd.tmp", None), ("engram-l-r0of3.bin", None),
])
def test_shard_names(name, parsed):
    assert parse_shard_name(name) == parsed
    if parsed:
        assert shard_name(*parsed) == name


def test_a_header_from_another_layout_is_named():
    spec = ShardSpec.make(Path("/e"), 1, 1, 3, 334, 668, 1_003, "heads")
    other = ShardSpec.make(Path("/e"), 1, 1, 3, 300, 800, 1_003, "floor").header()
    assert describe_header(other, spec) == "header rows 300..800 disagree with the heads layout's 334..668"
    assert describe_header(b"\0" * 4096, spec) == "not a DSV1EN41 shard header"
    assert describe_header(spec.header()[:100], spec) == "header is 100 bytes, expected 4096"
