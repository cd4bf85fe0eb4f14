"""Engram row shards: per-rank files of a DeepSeek-V4 Engram table, packed onto local NVMe and verified.

The serving row store wants, per tensor-parallel rank, rows lo..hi-1 of each Engram layer as one
file of 264-byte rows after a 4096-byte header, so that a row miss is one aligned pread on local
NVMe instead of two reads over NFS. docs/engram.md has the format, the partition and the receipt.

Where each part lives:

    shard_format.py  a shard on disk: name pattern, header, row offsets, ShardSpec
                     (used by the packer, the checks, the disk audit)
    checkpoint.py    geometry: which file and byte span hold each layer's table
    layouts.py       which rows each rank serves: the floor and heads partitions
    node_shards.py   which shards a node holds (ranks, TP size, layers); refusals before any read
    row_stream.py    a table's rows in order, read into reused buffers and interleaved
    receipts.py      the JSON receipt beside each shard
    checks.py        the one rule ("repack?" and "verified"), sampled or full; `stage verify`'s part
    packer.py        `stage pack-engram`: lock, plan, preflight, one pass per layer, SHA256SUMS once

Names are imported from here lazily, so `from stager.engram.shard_format import ...` (the audit)
does not load numpy or the packer.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ShardSpec": "shard_format", "parse_shard_name": "shard_format", "shard_name": "shard_format",
    "shard_header": "shard_format",
    "Checkpoint": "checkpoint", "EngramTable": "checkpoint", "load_checkpoint": "checkpoint",
    "open_checkpoint": "checkpoint",
    "partition": "layouts",
    "choose_node": "node_shards", "expected_shards": "node_shards", "shard_specs": "node_shards",
    "refuse_engram_dir_on_nas": "node_shards",
    "receipt_for": "receipts", "read_receipt": "receipts",
    "check_shard": "checks", "sample_rows": "checks", "verify_engram": "checks",
    "PackReport": "packer", "PackedShard": "packer", "pack": "packer", "pack_rows": "packer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stager.engram' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stager.engram.{_EXPORTS[name]}"), name)
