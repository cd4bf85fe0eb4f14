"""Receipts: `engram-l{L}-r{R}of{TP}.json` beside each shard, saying what it was packed from.

A receipt is written only after its shard was renamed into place, with the sha256 computed
from the bytes as they were written, so a receipt never describes bytes that are not there.
It is trusted as a record of the packing, never as proof of the bytes: the checks compare
the rows with the source and, in full, the sha256 with SHA256SUMS.
"""

from __future__ import annotations

import json
import time

from stager import __version__
from stager.base.atomic import atomic_write_bytes
from stager.engram.checkpoint import Checkpoint
from stager.engram.shard_format import ROW_BYTES, ShardSpec
from stager.base.small_files import read_regular

# Keys that must equal what this run would write; anything else (tool version, time) is history.
RECEIPT_KEYS = ("model", "commit", "source_file", "source_blob", "layer", "rank", "world", "layout",
                "lo", "hi", "rows", "total_rows", "row_bytes", "bytes")
_RECEIPT_LIMIT = 1024 * 1024


def receipt_for(spec: ShardSpec, checkpoint: Checkpoint, sha256: str) -> dict:
    table = checkpoint.tables[spec.layer]
    return {
        "format": "DSV1EN41",
        "model": checkpoint.repo_id,
        "commit": checkpoint.commit,
        "source_file": table.file,
        "source_blob": checkpoint.blobs[table.file],
        "weight_tensor": table.weight.name,
        "scale_tensor": table.scale.name,
        "layer": spec.layer,
        "rank": spec.rank,
        "world": spec.world,
        "layout": spec.layout,
        "lo": spec.lo,
        "hi": spec.hi,
        "rows": spec.rows,
        "total_rows": spec.total_rows,
        "row_bytes": ROW_BYTES,
        "bytes": spec.bytes,
        "sha256": sha256,
        "tool": "stager",
        "tool_version": __version__,
        "packed_from": checkpoint.origin,
        "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_receipt(spec: ShardSpec, checkpoint: Checkpoint, sha256: str) -> None:
    atomic_write_bytes(spec.receipt, (json.dumps(receipt_for(spec, checkpoint, sha256), indent=2) + "\n").encode())


def read_receipt(spec: ShardSpec) -> dict | None:
    """The receipt, or None if there is none that parses. A link at the receipt's name is not
    followed (it counts as no receipt, so the shard is repacked and the link replaced)."""
    try:
        receipt = json.loads(read_regular(spec.receipt, _RECEIPT_LIMIT).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return receipt if isinstance(receipt, dict) else None
