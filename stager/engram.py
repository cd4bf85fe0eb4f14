"""Engram tables: geometry from the checkpoint, per-rank row shards, receipts, and verification.

A DeepSeek-V4 Engram table is two tensors per layer in one safetensors file:
`…layers.{L}.engram.embed.weight` (F8_E4M3, [rows, 256]) and `….scale`
(F8_E8M0, [rows, 8]).  The serving row store wants, per tensor-parallel rank, the
rows lo..hi-1 as one file of 264-byte rows (weight bytes, then scale bytes) after
a 4096-byte header, so that a row miss is one aligned pread on local NVMe instead
of two reads over NFS.

walk (geometry: index -> header -> config cross-check) -> plan (one rule: does
this shard match?) -> preflight -> pack (stream, hash while writing, atomic
rename) -> receipt + SHA256SUMS.  `stage verify` runs the same rule, sampled or
full.  docs/engram.md has the format, the partition and the receipt.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import socket
import stat
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from stager import __version__, hints
from stager.atomic import atomic_file, atomic_write_bytes, ensure_dir, fsync_dir, sweep_temps
from stager.errors import BadInput, CannotRun
from stager.hub import Entry, LinkError, Problem, is_excluded, repo_dir_name, resolve_chain, resolve_revision
from stager.identity import overlap
from stager.lock import writer_lock
from stager.manifest import Manifest
from stager.mirror import free_bytes
from stager.records import SUMS_NAME, read_sums, update_sums
from stager.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from stager.source import LocalReader, LocalSource, Source, open_source
from stager.units import format_size
from stager.verify import VerifyReport

MAGIC = 0x31344E4531565344  # b"DSV1EN41" as a little-endian u64
HEADER_BYTES = 4096
WEIGHT_BYTES = 256
SCALE_BYTES = 8
ROW_BYTES = WEIGHT_BYTES + SCALE_BYTES
WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F8_E8M0"
# 16384 rows per chunk: 4 MiB reads from the weight span (large enough for NFS with --from-nas),
# 4.1 MiB interleaved. Measured per GiB packed: 1024-row chunks cost 15% more CPU in per-chunk
# overhead; 4096 to 65536 rows were within noise. A multiple of 512 rows, so every chunk write
# after the 4 KiB header stays 4 KiB-aligned.
CHUNK_ROWS = 16384
FILL_AHEAD = 3  # chunks read and interleaved ahead of the consumer (3 x 8.3 MiB of buffers)
WRITEBACK_BYTES = 32 * 1024 * 1024  # start writeback every 32 MiB, so the closing fsync has little left
SAMPLE_ROWS = 64  # seeded rows per sampled check, plus both boundary rows
LOCK_NAME = ".locks/engram.lock"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
JSON_LIMIT = 64 * 1024 * 1024
# Any prefix (empty, "model.", "model.language_model.") before `layers.`.
_TENSOR = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.engram\.embed\.(?P<part>weight|scale)$")
_SHARD = re.compile(r"^engram-l(?P<layer>\d+)-r(?P<rank>\d+)of(?P<world>\d+)\.bin$")
# Receipt keys that must equal what this run would write; anything else (tool version, time) is history.
_RECEIPT_KEYS = ("model", "commit", "source_file", "source_blob", "layer", "rank", "world", "layout",
                 "lo", "hi", "rows", "total_rows", "row_bytes", "bytes")


# ---- the partition and the shard format ---------------------------------------------------------

def partition(rows: int, world: int, rank: int, layout: str = "floor",
              head_rows: tuple[int, ...] | list[int] | None = None) -> tuple[int, int]:
    """Rows [lo, hi) served by `rank` of `world`.

    floor: lo = rows*R//TP, hi = rows*(R+1)//TP, the split the serving engine computes.
    heads: whole hash heads per rank; rank R gets heads H*R//TP .. H*(R+1)//TP - 1 of
    the H heads (sizes in `head_rows`, summing to `rows`), so no head straddles two ranks.
    """
    if not 0 <= rank < world:
        raise BadInput(f"rank {rank} is outside 0..{world - 1} for TP={world}")
    if layout == "floor":
        return rows * rank // world, rows * (rank + 1) // world
    if layout != "heads":
        raise BadInput(f"unknown Engram layout {layout!r} (expected floor or heads)")
    heads = list(head_rows or ())
    if not heads or any(not isinstance(h, int) or isinstance(h, bool) or h <= 0 for h in heads):
        raise BadInput(f"layout heads needs engram_head_rows as positive integers, got {head_rows!r}")
    if sum(heads) != rows:
        raise BadInput(f"engram_head_rows sum to {sum(heads)} but the table has {rows} rows")
    if len(heads) < world:
        raise BadInput(f"{len(heads)} hash heads cannot give each of TP={world} ranks a whole head")
    bounds = [0]
    for size in heads:
        bounds.append(bounds[-1] + size)
    return bounds[len(heads) * rank // world], bounds[len(heads) * (rank + 1) // world]


def shard_name(layer: int, rank: int, world: int) -> str:
    return f"engram-l{layer}-r{rank}of{world}.bin"


def parse_shard_name(name: str) -> tuple[int, int, int] | None:
    """(layer, rank, world) of a shard file name, None for anything else."""
    match = _SHARD.fullmatch(name)  # fullmatch: `$` would also accept the name followed by a newline
    return (int(match["layer"]), int(match["rank"]), int(match["world"])) if match else None


def shard_header(layer: int, lo: int, hi: int, total_rows: int) -> bytes:
    return struct.pack("<6Q", MAGIC, layer, lo, hi, total_rows, ROW_BYTES).ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True)
class ShardSpec:
    """One shard as the chosen layout wants it."""

    path: Path
    layer: int
    rank: int
    world: int
    lo: int
    hi: int
    bytes: int
    total_rows: int
    layout: str

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def receipt(self) -> Path:
        return self.path.with_suffix(".json")

    def header(self) -> bytes:
        return shard_header(self.layer, self.lo, self.hi, self.total_rows)

    def to_json(self) -> dict:
        return {"path": str(self.path), "layer": self.layer, "rank": self.rank, "world": self.world,
                "lo": self.lo, "hi": self.hi, "bytes": self.bytes}


def _describe_header(raw: bytes, spec: ShardSpec) -> str | None:
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


# ---- geometry: where each layer's rows are in the checkpoint ------------------------------------

@dataclass(frozen=True)
class EngramTable:
    layer: int
    rows: int
    file: str  # snapshot-relative safetensors file holding both tensors
    weight: TensorInfo
    scale: TensorInfo


@dataclass(frozen=True)
class Checkpoint:
    """The Engram geometry of one model revision, and the source its rows are read from."""

    repo_id: str
    commit: str
    origin: str  # "local hub /nvme/hf/hub" or "NAS <url>", for messages
    source: Source
    snap_dir: str
    finals: dict[str, str]  # safetensors file -> hub-relative final regular file
    blobs: dict[str, str | None]  # safetensors file -> its repo blob name (sha256 of an LFS file)
    tables: dict[int, EngramTable]
    config_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)  # config.json's engram_head_rows
    needs: tuple[str, ...] = ()  # snapshot files the geometry was read from (index, safetensors files)

    def open(self, file: str):
        try:
            return self.source.open(self.finals[file], uncached=False)
        except OSError as exc:
            raise CannotRun(f"{self.source.display(self.finals[file])}: cannot open: {exc.strerror or exc}") from None

    def head_rows(self, layer: int, manifest_rows: list[int] | None) -> tuple[int, ...] | None:
        """Head sizes for a layer: the manifest's list (one list for every layer), else config.json's."""
        return tuple(manifest_rows) if manifest_rows else self.config_heads.get(layer)


class _NotStaged(Exception):
    """The snapshot (or a file the geometry needs) is not on this source."""


class _Absent(_NotStaged):
    """A file the index names is not in the snapshot: on a staged copy, not staged yet; on the
    source itself (`complete=True`), a broken checkpoint."""


def _resolve(source: Source, snap_dir: str, name: str, *, required: bool) -> Entry | None:
    rel = f"{snap_dir}/{name}"
    st = source.lstat(rel)
    if st is None:
        if required:
            raise _Absent(f"{source.display(rel)} is not there")
        return None
    try:
        chain, final = resolve_chain(source, rel)
    except LinkError as exc:
        raise _NotStaged(f"{source.display(rel)}: {exc.detail}") from None
    return Entry("", name, chain, final.size, final.mtime_ns)


def _read_json(source: Source, snap_dir: str, name: str) -> object | None:
    entry = _resolve(source, snap_dir, name, required=False)
    if entry is None:
        return None
    where = source.display(entry.rel)
    if entry.size > JSON_LIMIT:
        raise BadInput(f"{where}: {entry.size} bytes is too large for a JSON file")
    try:
        return json.loads(source.read_small(entry.final, entry.size + 1), object_pairs_hook=_JsonObject)
    except OSError as exc:
        raise _NotStaged(f"{where}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{where}: not valid JSON: {exc}") from None


class _JsonObject(dict):
    """A JSON object that remembers the keys it held twice (json.loads keeps the last silently)."""

    def __init__(self, pairs: list[tuple[str, object]]):
        super().__init__(pairs)
        seen: set[str] = set()
        self.repeated = [key for key, _ in pairs if key in seen or seen.add(key)]


def _engram_names(source: Source, snap_dir: str, exclude: list[str]) -> tuple[dict[str, str], bool]:
    """(tensor name -> safetensors file for every Engram tensor the checkpoint declares, whether an
    index declared them)."""
    index = _read_json(source, snap_dir, INDEX_NAME)
    if index is None and is_excluded(INDEX_NAME, exclude):
        # Not a single-file checkpoint: an index the mirror was told to leave on the NAS.
        raise _NotStaged(f"{source.display(f'{snap_dir}/{INDEX_NAME}')} is excluded")
    if index is None:
        # A single-file checkpoint has no index; its header is the listing.
        header = _header(source, snap_dir, SINGLE_FILE)[1]
        return {name: SINGLE_FILE for name in header.tensors if _TENSOR.fullmatch(name)}, False
    where = source.display(f"{snap_dir}/{INDEX_NAME}")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise BadInput(f"{where}: weight_map is not an object of tensor name -> file name")
    for name, file in weight_map.items():
        if _TENSOR.fullmatch(name) and (file.startswith("/") or ".." in file.split("/")):
            raise BadInput(f"{where}: weight_map.{name}: {file!r} leaves the snapshot")
    return {name: file for name, file in weight_map.items() if _TENSOR.fullmatch(name)}, True


def _header(source: Source, snap_dir: str, file: str) -> tuple[Entry, SafetensorsHeader]:
    entry = _resolve(source, snap_dir, file, required=True)
    try:
        reader = source.open(entry.final, uncached=False)
    except OSError as exc:
        raise _NotStaged(f"{source.display(entry.rel)}: {exc.strerror or exc}") from None
    try:
        return entry, read_header(reader, source.display(entry.rel))
    except OSError as exc:
        raise _NotStaged(f"{source.display(entry.rel)}: {exc.strerror or exc}") from None
    finally:
        reader.close()


def load_checkpoint(source: Source, repo_id: str, revision: str, origin: str, *,
                    complete: bool = False, exclude: list[str] = ()) -> Checkpoint:
    """Find every Engram table of `repo_id`@`revision` on `source` and validate it. Raises _NotStaged.

    `complete`: `source` is where the checkpoint comes from, not a staged copy of it, so a file
    the index names and the snapshot lacks is a broken checkpoint (exit 2), not one still to stage.
    `exclude`: the model's patterns, when `source` is a staged copy that lacks what they match."""
    repo_dir = repo_dir_name(repo_id)
    commit = resolve_revision(source, repo_dir, revision)
    snap_dir = f"{repo_dir}/snapshots/{commit}"
    st = source.lstat(snap_dir) if commit else None
    if st is None or st.kind != "dir":
        raise _NotStaged(f"{repo_id}@{revision} has no snapshot in {origin}")
    names, indexed = _engram_names(source, snap_dir, list(exclude))
    layers: dict[int, dict[str, str]] = {}
    prefixes: dict[int, str] = {}
    for name in names:
        match = _TENSOR.fullmatch(name)
        layer = int(match["layer"])
        if prefixes.setdefault(layer, match["prefix"]) != match["prefix"]:
            raise BadInput(f"{source.display(snap_dir)}: layer {layer} has Engram tensors under two prefixes "
                           f"({prefixes[layer]!r} and {match['prefix']!r})")
        layers.setdefault(layer, {})[match["part"]] = name
    if not layers:
        raise BadInput(f"{source.display(snap_dir)}: {repo_id} has no layers.*.engram.embed.weight tensors")
    finals: dict[str, str] = {}
    blobs: dict[str, str | None] = {}
    headers: dict[str, SafetensorsHeader] = {}
    tables: dict[int, EngramTable] = {}
    for layer, parts in sorted(layers.items()):
        for part in ("weight", "scale"):
            if part not in parts:
                raise BadInput(f"{source.display(snap_dir)}: {prefixes[layer]}layers.{layer}.engram.embed.{part} "
                               f"is missing (the other half of layer {layer}'s table is there)")
        file = names[parts["weight"]]
        if names[parts["scale"]] != file:
            raise BadInput(f"{source.display(snap_dir)}: {parts['weight']} is in {file} but {parts['scale']} is in "
                           f"{names[parts['scale']]}; both must be in one file")
        if file not in headers:
            try:
                entry, headers[file] = _header(source, snap_dir, file)
            except _Absent as exc:
                if not (complete and indexed):
                    raise
                raise BadInput(f"{source.display(f'{snap_dir}/{INDEX_NAME}')}: weight_map names {file} for "
                               f"{parts['weight']}, which the snapshot does not have ({exc})") from None
            finals[file], blobs[file] = entry.final, entry.etag
        tables[layer] = _table(layer, file, headers[file], parts["weight"], parts["scale"])
    config = _read_json(source, snap_dir, "config.json")
    config = config if isinstance(config, dict) else {}
    where = source.display(f"{snap_dir}/config.json")
    _cross_check(where, config, tables)
    needs = ((INDEX_NAME,) if indexed else ()) + tuple(sorted(finals))
    return Checkpoint(repo_id, commit, origin, source, snap_dir, finals, blobs, tables,
                      _config_heads(where, config, sorted(tables)), needs)


def _table(layer: int, file: str, header: SafetensorsHeader, weight_name: str, scale_name: str) -> EngramTable:
    weight, scale = header.tensor(weight_name), header.tensor(scale_name)
    for tensor, dtype, width in ((weight, WEIGHT_DTYPE, WEIGHT_BYTES), (scale, SCALE_DTYPE, SCALE_BYTES)):
        if tensor.dtype != dtype:
            raise BadInput(f"{header.file}: tensor {tensor.name}: dtype {tensor.dtype}, expected {dtype}")
        if len(tensor.shape) != 2 or tensor.shape[1] != width or tensor.shape[0] == 0:
            raise BadInput(f"{header.file}: tensor {tensor.name}: shape {list(tensor.shape)}, expected [rows, {width}]")
    if weight.shape[0] != scale.shape[0]:
        raise BadInput(f"{header.file}: tensor {scale.name} has {scale.shape[0]} rows but {weight.name} has "
                       f"{weight.shape[0]}")
    return EngramTable(layer, weight.shape[0], file, weight, scale)


def _cross_check(where: str, config: dict, tables: dict[int, EngramTable]) -> None:
    ids = config.get("engram_layer_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadInput(f"{where}: engram_layer_ids is not a list of integers: {ids!r}")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise BadInput(f"{where}: engram_layer_ids lists layer {repeated[0]} more than once")
    if sorted(set(ids)) != sorted(tables):
        raise BadInput(f"{where}: engram_layer_ids {sorted(set(ids))} disagree with the checkpoint's Engram "
                       f"tensors for layers {sorted(tables)}")


def _config_heads(where: str, config: dict, layers: list[int]) -> dict[int, tuple[int, ...]]:
    """config.json `engram_head_rows`: one list for every layer, a list of lists in
    `engram_layer_ids` order, or an object {"<layer>": list}."""
    rows = config.get("engram_head_rows")
    if rows is None:
        return {}
    if isinstance(rows, list) and all(isinstance(r, int) for r in rows):
        return {layer: tuple(rows) for layer in layers}
    if isinstance(rows, list) and isinstance(config.get("engram_layer_ids"), list) \
            and len(rows) == len(config["engram_layer_ids"]) and all(isinstance(r, list) for r in rows):
        return {layer: tuple(r) for layer, r in zip(config["engram_layer_ids"], rows)}
    if isinstance(rows, dict) and all(isinstance(v, list) for v in rows.values()):
        return _heads_by_layer(where, rows)
    raise BadInput(f"{where}: engram_head_rows is neither a list of head sizes, a list of such lists in "
                   f"engram_layer_ids order, nor an object of layer -> list")


def _heads_by_layer(where: str, rows: dict) -> dict[int, tuple[int, ...]]:
    """{"<layer>": [sizes]}: a key must be a layer number, once. "1" and "01" both parse as layer 1;
    keeping either silently would pack with head sizes the operator may not have meant."""
    for key in getattr(rows, "repeated", ()):
        raise BadInput(f"{where}: engram_head_rows.{key}: the key appears twice")
    heads: dict[int, tuple[int, ...]] = {}
    spelled: dict[int, str] = {}
    for key, sizes in rows.items():
        if not re.fullmatch(r"[0-9]+", key):
            raise BadInput(f"{where}: engram_head_rows.{key!r}: not a layer number")
        layer = int(key)
        if layer in spelled:
            raise BadInput(f"{where}: engram_head_rows.{key!r}: layer {layer} is also given as {spelled[layer]!r}")
        spelled[layer], heads[layer] = key, tuple(sizes)
    return heads


def open_checkpoint(manifest: Manifest, node_name: str, *, from_nas: bool) -> Checkpoint:
    """The `[engram].model` geometry, read from the node's staged snapshot; from the NAS only if
    `from_nas` and the snapshot is not staged (bulk reads over NFS are what packing exists to avoid).

    When the staged snapshot cannot give the geometry, the NAS's is read (headers only, a few KiB)
    to tell a checkpoint that can never be packed (exit 2: its index names a file the snapshot does
    not have, or the model's `exclude` keeps a file the geometry needs off this node) from one that
    is just not staged yet (exit 3)."""
    engram = _engram_config(manifest)
    node = manifest.node(node_name)
    model = manifest.models[engram.model]
    local_hub = Path(node.hub)
    try:
        if not local_hub.is_dir():
            raise _NotStaged(f"local hub {local_hub} does not exist")
        return load_checkpoint(LocalSource(str(local_hub)), engram.model, model.revision, f"local hub {local_hub}",
                               exclude=model.exclude)
    except _NotStaged as exc:
        not_staged = CannotRun(f"{engram.model} is not staged on {node_name}: {exc} "
                               f"(run `{hints.command('mirror', '--node', node_name)}` first, or read the NAS: "
                               f"`{hints.command('pack-engram', '--node', node_name, '--from-nas')}`)")
    url = manifest.source_for(node_name)
    try:
        checkpoint = load_checkpoint(open_source(url, manifest.nas.aliases), engram.model, model.revision,
                                     f"NAS {url}", complete=True)
    except (_NotStaged, CannotRun) as exc:
        if from_nas:
            raise CannotRun(f"{engram.model} cannot be read from the NAS: {exc}") from None
        raise not_staged from None
    if from_nas:
        return checkpoint
    for name in checkpoint.needs:
        pattern = next((p for p in model.exclude if is_excluded(name, [p])), None)
        if pattern is not None:
            raise BadInput(f'{manifest.path}: models."{engram.model}".exclude: {pattern!r} keeps {name} off the '
                           f"node, and the Engram geometry is read from it (stop excluding it, or pass --from-nas)")
    raise not_staged


def _engram_config(manifest: Manifest):
    if manifest.engram is None:
        raise BadInput(f"{manifest.path}: engram: no [engram] table in the manifest")
    return manifest.engram


def _target(manifest: Manifest, node_name: str, world: int | None, ranks: list[int] | None):
    """(engram config, node config, TP size), refusing what cannot be packed before any file is read."""
    engram = _engram_config(manifest)
    node = manifest.node(node_name)
    if node.engram_dir is None:
        raise BadInput(f"{manifest.path}: nodes.{node_name}.engram_dir: not set, so there is nowhere to pack to")
    world = engram.world if world is None else world
    if world < 1:
        raise BadInput(f"--world {world}: the TP size must be at least 1")
    for rank in ranks or ():
        if not 0 <= rank < world:
            raise BadInput(f"--rank {rank} is outside 0..{world - 1} for TP={world}")
    return engram, node, world


# ---- which shards a node needs ------------------------------------------------------------------

def shard_specs(manifest: Manifest, node_name: str, checkpoint: Checkpoint, *, ranks: list[int] | None = None,
                world: int | None = None, layers: list[int] | None = None) -> list[ShardSpec]:
    """The shards for these ranks and layers. Defaults: the manifest's world, the node's `rank`
    (every rank when the node has none: one 8-GPU node serving all of TP=8), the manifest's layers
    (every layer in the checkpoint when it names none)."""
    engram, node, world = _target(manifest, node_name, world, ranks)
    if ranks is None:
        ranks = [node.rank] if node.rank is not None else list(range(world))
    if layers is None:
        layers = list(engram.layers) if engram.layers else sorted(checkpoint.tables)
    specs = []
    for layer in layers:
        if layer not in checkpoint.tables:
            raise BadInput(f"{manifest.path}: engram.layers / --layer: layer {layer}: {checkpoint.repo_id} has "
                           f"Engram tables for layers {sorted(checkpoint.tables)} only")
        table = checkpoint.tables[layer]
        heads = checkpoint.head_rows(layer, engram.engram_head_rows) if engram.layout == "heads" else None
        for rank in ranks:
            try:
                lo, hi = partition(table.rows, world, rank, engram.layout, heads)
            except BadInput as exc:
                raise BadInput(f"{manifest.path}: engram: layer {layer}: {exc.message}") from None
            specs.append(ShardSpec(Path(node.engram_dir) / shard_name(layer, rank, world), layer, rank, world,
                                   lo, hi, HEADER_BYTES + (hi - lo) * ROW_BYTES, table.rows, engram.layout))
    return specs


def expected_shards(manifest: Manifest, node_name: str, rank: int | None = None) -> list[ShardSpec]:
    """The shards `node_name` should hold: its rank (every rank if it has none), the manifest's world
    and layers. Empty when the manifest has no [engram] or the node no engram_dir. The geometry is
    read from the staged snapshot, else from the NAS (headers only: a few KiB)."""
    if manifest.engram is None or manifest.node(node_name).engram_dir is None:
        return []
    checkpoint = open_checkpoint(manifest, node_name, from_nas=True)
    return shard_specs(manifest, node_name, checkpoint, ranks=None if rank is None else [rank])


# ---- streaming rows -----------------------------------------------------------------------------

class _Slot:
    """Reused buffers for one chunk: allocated once per shard, whatever the table size."""

    def __init__(self):
        self.weight = np.empty((CHUNK_ROWS, WEIGHT_BYTES), np.uint8)
        self.scale = np.empty((CHUNK_ROWS, SCALE_BYTES), np.uint8)
        self.rows = np.empty((CHUNK_ROWS, ROW_BYTES), np.uint8)


def _read_exact(reader, view: memoryview, offset: int, where: str) -> None:
    """Fill `view` from `offset`: preadv straight into the buffer on a local file, pread elsewhere."""
    fd = getattr(reader, "fd", None)
    done = 0
    try:
        while done < len(view):
            if fd is not None:
                got = os.preadv(fd, [view[done:]], offset + done)
            else:
                data = reader.pread(len(view) - done, offset + done)
                got = len(data)
                view[done:done + got] = data
            if got == 0:
                raise CannotRun(f"{where}: ended at byte {offset + done}; the file changed while it was read")
            done += got
    except OSError as exc:
        raise CannotRun(f"{where}: read failed at byte {offset + done}: {exc.strerror or exc}") from None


def _fill(reader, table: EngramTable, slot: _Slot, start: int, count: int, where: str) -> memoryview:
    weight, scale, rows = slot.weight[:count], slot.scale[:count], slot.rows[:count]
    _read_exact(reader, memoryview(weight).cast("B"), table.weight.start + start * WEIGHT_BYTES, where)
    _read_exact(reader, memoryview(scale).cast("B"), table.scale.start + start * SCALE_BYTES, where)
    rows[:, :WEIGHT_BYTES] = weight
    rows[:, WEIGHT_BYTES:] = scale
    return memoryview(rows).cast("B")


def stream_rows(reader, table: EngramTable, lo: int, hi: int, where: str,
                consume: Callable[[memoryview, int], None]) -> None:
    """Call `consume(rows, first_row)` with the interleaved rows lo..hi-1, in order, in chunks.

    A filler thread reads and interleaves up to FILL_AHEAD chunks ahead into a ring of
    reused slots while the caller consumes the oldest; a slot is refilled only after
    `consume` returned for it. Positioned reads and numpy copies release the GIL.
    """
    starts = range(lo, hi, CHUNK_ROWS)
    slots = [_Slot() for _ in range(min(FILL_AHEAD, len(starts)))]

    def fill(i: int):
        return filler.submit(_fill, reader, table, slots[i % len(slots)], starts[i],
                             min(CHUNK_ROWS, hi - starts[i]), where)

    with ThreadPoolExecutor(1, thread_name_prefix="engram-fill") as filler:
        pending = deque(fill(i) for i in range(len(slots)))
        try:
            for i, start in enumerate(starts):
                consume(pending.popleft().result(), start)
                if i + len(slots) < len(starts):
                    pending.append(fill(i + len(slots)))
        finally:
            for future in pending:
                future.cancel()


# ---- the one rule: does a shard on disk match? --------------------------------------------------

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


def read_receipt(spec: ShardSpec) -> dict | None:
    try:
        receipt = json.loads(spec.receipt.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return receipt if isinstance(receipt, dict) else None


def check_shard(spec: ShardSpec, checkpoint: Checkpoint, sums: dict[str, str], *, seed: int,
                full: bool = False) -> str | None:
    """Why the shard on disk does not match what this layout and source would write; None if it does.

    The one rule, for both "repack?" and "verified": the exact size; the header
    (never adopt a shard whose lo/hi disagree with the chosen layout); a receipt whose
    model, commit, source blob, layer, rank, TP, layout, rows and bytes equal this run's;
    a SHA256SUMS entry equal to the receipt's sha256; then the rows against the source:
    a seeded sample plus both boundary rows, or (full) every byte re-derived and the
    file's sha256 against SHA256SUMS.  The tool version is not compared: the format is
    versioned by its magic, and a newer tool has no reason to rewrite identical bytes.
    """
    try:
        st = os.lstat(spec.path)
    except FileNotFoundError:
        return "not packed yet"
    if not stat.S_ISREG(st.st_mode):
        # A link could point at the NAS copy, which is exactly what packing exists to avoid.
        return "not a regular file"
    size = st.st_size
    if size != spec.bytes:
        return f"size {size} != {spec.bytes} (truncated, or from another layout)"
    with open(spec.path, "rb") as shard:
        problem = _describe_header(shard.read(HEADER_BYTES), spec)
    if problem:
        return problem
    receipt = read_receipt(spec)
    if receipt is None:
        return f"no readable receipt {spec.receipt.name}"
    wanted = receipt_for(spec, checkpoint, "")
    for key in _RECEIPT_KEYS:
        if receipt.get(key) != wanted[key]:
            return f"receipt {key} {receipt.get(key)!r} != {wanted[key]!r}"
    listed = sums.get(spec.path.name)
    if listed != receipt.get("sha256"):
        return f"{SUMS_NAME} {'has no entry' if listed is None else 'entry differs from the receipt'}"
    reader = checkpoint.open(checkpoint.tables[spec.layer].file)
    try:
        if full:
            return _full_check(spec, checkpoint, reader, listed)
        return _sampled_check(spec, checkpoint, reader, seed)
    finally:
        reader.close()


def sample_rows(lo: int, hi: int, seed: int, layer: int) -> list[int]:
    """Both boundary rows and SAMPLE_ROWS seeded rows of [lo, hi), sorted (none for an empty shard:
    a table with fewer rows than TP leaves some floor ranks a header and no rows)."""
    if hi <= lo:
        return []
    rng = random.Random(f"{seed}:{layer}:{lo}:{hi}")
    picks = {lo, hi - 1} | {rng.randrange(lo, hi) for _ in range(min(SAMPLE_ROWS, hi - lo))}
    return sorted(picks)


def _sampled_check(spec: ShardSpec, checkpoint: Checkpoint, reader, seed: int) -> str | None:
    table = checkpoint.tables[spec.layer]
    where = checkpoint.source.display(checkpoint.finals[table.file])
    theirs = bytearray(ROW_BYTES)
    view = memoryview(theirs)
    with LocalReader(str(spec.path), uncached=False) as shard:
        for row in sample_rows(spec.lo, spec.hi, seed, spec.layer):
            _read_exact(reader, view[:WEIGHT_BYTES], table.weight.start + row * WEIGHT_BYTES, where)
            _read_exact(reader, view[WEIGHT_BYTES:], table.scale.start + row * SCALE_BYTES, where)
            if shard.pread(ROW_BYTES, HEADER_BYTES + (row - spec.lo) * ROW_BYTES) != theirs:
                return f"row {row} differs from the source"
    return None


def _full_check(spec: ShardSpec, checkpoint: Checkpoint, reader, listed: str) -> str | None:
    """Re-derive every row from the source and compare it with the shard, hashing the shard as it is read."""
    table = checkpoint.tables[spec.layer]
    hasher = hashlib.sha256()
    buffer = np.empty(CHUNK_ROWS * ROW_BYTES, np.uint8)
    first_bad: list[int] = []
    with LocalReader(str(spec.path), uncached=False) as shard:
        hasher.update(shard.pread(HEADER_BYTES, 0))

        def compare(rows: memoryview, first_row: int) -> None:
            mine = buffer[:len(rows)]
            _read_exact(shard, memoryview(mine), HEADER_BYTES + (first_row - spec.lo) * ROW_BYTES, str(spec.path))
            hasher.update(mine)
            if not first_bad:
                derived = np.frombuffer(rows, np.uint8)
                if not np.array_equal(mine, derived):
                    bad = np.flatnonzero((mine != derived).reshape(-1, ROW_BYTES).any(axis=1))[0]
                    first_bad.append(first_row + int(bad))

        stream_rows(reader, table, spec.lo, spec.hi, checkpoint.source.display(checkpoint.finals[table.file]),
                    compare)
    if first_bad:
        return f"row {first_bad[0]} differs from a full re-derivation from the source"
    digest = hasher.hexdigest()
    return None if digest == listed else f"sha256 {digest} differs from {SUMS_NAME} ({listed})"


# ---- pack ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedShard:
    spec: ShardSpec
    sha256: str
    skipped: bool
    reason: str  # why it was (re)packed, or "up to date"

    def to_json(self) -> dict:
        return {**self.spec.to_json(), "sha256": self.sha256, "skipped": self.skipped, "reason": self.reason}


@dataclass
class PackReport:
    node: str
    source: str
    shards: list[PackedShard] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def packed_bytes(self) -> int:
        return sum(s.spec.bytes for s in self.shards if not s.skipped)

    def to_json(self) -> dict:
        return {"node": self.node, "source": self.source, "shards": [s.to_json() for s in self.shards],
                "packed_bytes": self.packed_bytes, "seconds": round(self.seconds, 3)}


def choose_node(manifest: Manifest, node: str | None) -> str:
    """`--node`, else the manifest node named like this host, else the only node with an engram_dir."""
    if node:
        manifest.node(node)
        return node
    host = socket.gethostname().split(".")[0]
    if host in manifest.nodes:
        return host
    candidates = [name for name, config in manifest.nodes.items() if config.engram_dir]
    if len(candidates) == 1:
        return candidates[0]
    raise BadInput(f"{manifest.path}: pass --node (this host {host!r} is not a node, and "
                   f"{len(candidates)} nodes have an engram_dir)")


def pack(manifest: Manifest, node_name: str, *, rank: int | None = None, world: int | None = None,
         layers: list[int] | None = None, from_nas: bool = False,
         progress_factory: Callable[[int], Callable[[int], None]] | None = None) -> PackReport:
    started = time.monotonic()
    _engram, node, _world = _target(manifest, node_name, world, None if rank is None else [rank])
    refuse_engram_dir_on_nas(manifest, node_name)
    checkpoint = open_checkpoint(manifest, node_name, from_nas=from_nas)
    specs = shard_specs(manifest, node_name, checkpoint, ranks=None if rank is None else [rank], world=world,
                        layers=list(dict.fromkeys(layers)) if layers else None)
    engram_dir = Path(node.engram_dir)
    report = PackReport(node_name, checkpoint.origin)
    ensure_dir(engram_dir)
    with writer_lock(engram_dir / LOCK_NAME, f"engram directory {engram_dir}"):
        sweep_temps(engram_dir)  # a killed pack leaves a hidden temp as large as the shard
        sums = read_sums(engram_dir / SUMS_NAME)
        seed = secrets.randbits(32)
        plan, restored = _plan(specs, checkpoint, sums, seed)
        todo = [(spec, reason) for spec, reason in plan if reason is not None]
        _preflight(engram_dir, sum(spec.bytes for spec, _ in todo), node.reserve)
        progress = progress_factory(sum(spec.bytes for spec, _ in todo)) if progress_factory and todo else None
        packed: dict[str, str] = dict(restored)
        try:
            for spec, reason in plan:
                if reason is None:
                    report.shards.append(PackedShard(spec, read_receipt(spec)["sha256"], True, "up to date"))
                    continue
                digest = _pack_shard(spec, checkpoint, progress)
                atomic_write_bytes(spec.receipt, (json.dumps(receipt_for(spec, checkpoint, digest), indent=2)
                                                  + "\n").encode())
                packed[spec.path.name] = digest
                report.shards.append(PackedShard(spec, digest, False, reason))
        finally:
            # Once per run, also when a later shard failed: the shards renamed into place so far
            # are complete and their receipts written, so their lines are true.
            if packed:
                update_sums(engram_dir / SUMS_NAME, packed)
    report.seconds = time.monotonic() - started
    return report


def _plan(specs: list[ShardSpec], checkpoint: Checkpoint, sums: dict[str, str],
          seed: int) -> tuple[list[tuple[ShardSpec, str | None]], dict[str, str]]:
    """(spec, why it needs packing or None) for every shard, and the SHA256SUMS lines to restore.

    SHA256SUMS is written once, at the end of a run, so a run killed after some shards were
    renamed into place leaves shards and receipts that SHA256SUMS does not list yet. Such a
    shard is judged by the same rule with its receipt's sha256 standing in for the missing
    line (the receipt is written only after the shard's rename, from the bytes as written);
    if it passes, the line is restored instead of repacking the shard."""
    plan, restored = [], {}
    for spec in specs:
        receipt = read_receipt(spec) if spec.path.name not in sums else None
        digest = receipt.get("sha256") if receipt else None
        if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
            reason = check_shard(spec, checkpoint, {**sums, spec.path.name: digest}, seed=seed)
            if reason is None:
                restored[spec.path.name] = digest
        else:
            reason = check_shard(spec, checkpoint, sums, seed=seed)
        plan.append((spec, reason))
    return plan, restored


def refuse_engram_dir_on_nas(manifest: Manifest, node_name: str) -> None:
    """Exit 2 if the node's engram_dir is, lies inside or holds the NAS hub, the node's source or
    an alias target, however spelled.

    Checked here, when the directory is about to be written, by identity (resolved path, inode,
    bind mounts): the manifest validator compares spellings, and an engram_dir that was a symlink
    into a NAS repo passed it, after which shards, receipts and SHA256SUMS were written on the NAS."""
    node = manifest.node(node_name)
    places = [("the NAS hub", manifest.nas.hub), ("the node's source", node.source)]
    places += [(f"the target of NAS alias {prefix}", target) for prefix, target in manifest.nas.aliases.items()]
    for what, place in places:
        if not place or ("://" in place and not place.startswith("file://")):
            continue  # a remote hub is not a path on this host
        place = place.removeprefix("file://")
        # realpath first: it resolves `link/..` as the kernel does (the link, then its parent),
        # where a lexical normalisation drops both and names another directory.
        shown = os.path.realpath(node.engram_dir)
        if overlap(shown, os.path.realpath(place)):
            via = f" (resolves to {shown})" if shown != node.engram_dir else ""
            raise BadInput(f"{manifest.path}: nodes.{node_name}.engram_dir: {node.engram_dir}{via} overlaps {what} "
                           f"{place}, which this tool never writes")


def _preflight(engram_dir: Path, needed: int, reserve: int) -> None:
    """The new shard is written beside the old one until the rename, so every byte counts as needed."""
    free = free_bytes(engram_dir)
    if free - needed < reserve:
        raise CannotRun(f"not enough space on {engram_dir}: need {format_size(needed)}, free {format_size(free)}, "
                        f"reserve {format_size(reserve)} (short by {format_size(needed + reserve - free)})")


def _pack_shard(spec: ShardSpec, checkpoint: Checkpoint, progress: Callable[[int], None] | None) -> str:
    """Write one shard atomically and return its sha256, computed from the bytes as they are written."""
    if spec.path.is_dir() and not spec.path.is_symlink():
        raise CannotRun(f"{spec.path} is a directory; move it away so the shard can be written")
    # The old receipt goes first: a crash from here on leaves no receipt, so the next run repacks.
    spec.receipt.unlink(missing_ok=True)
    fsync_dir(spec.path.parent)
    table = checkpoint.tables[spec.layer]
    where = checkpoint.source.display(checkpoint.finals[table.file])
    reader = checkpoint.open(table.file)
    hasher = hashlib.sha256()
    try:
        with atomic_file(spec.path, size_hint=spec.bytes) as out, \
                ThreadPoolExecutor(1, thread_name_prefix="engram-hash") as hash_pool:
            header = spec.header()
            hasher.update(header)
            out.write(header)
            if progress:
                progress(HEADER_BYTES)  # the bar's total is whole shards, headers included
            flushed, written = [0], [HEADER_BYTES]

            def write(rows: memoryview, _first_row: int) -> None:
                hashing = hash_pool.submit(hasher.update, rows)
                out.write(rows)
                written[0] += len(rows)
                if written[0] - flushed[0] >= WRITEBACK_BYTES:
                    # DONTNEED on dirty pages queues their writeback now: without it the closing
                    # fsync waited for the whole shard (0.5 s per GiB here), with it for the last 32 MiB.
                    os.posix_fadvise(out.fd, flushed[0], written[0] - flushed[0], os.POSIX_FADV_DONTNEED)
                    flushed[0] = written[0]
                hashing.result()
                if progress:
                    progress(len(rows))

            stream_rows(reader, table, spec.lo, spec.hi, where, write)
    finally:
        reader.close()
    return hasher.hexdigest()


# ---- verify -------------------------------------------------------------------------------------

def verify_engram(manifest: Manifest, node_name: str, *, full: bool, seed: int | None) -> VerifyReport:
    """Check the node's expected shards, and every other shard of the current TP size in its
    engram_dir, with `check_shard` against the staged snapshot. Problems name the shard."""
    seed = secrets.randbits(32) if seed is None else seed
    report = VerifyReport("full" if full else "sampled", None if full else seed)
    engram_dir = Path(manifest.node(node_name).engram_dir or "")
    try:
        checkpoint = open_checkpoint(manifest, node_name, from_nas=False)
        specs = shard_specs(manifest, node_name, checkpoint)
        on_disk = _present(engram_dir, manifest.engram.world, {s.layer for s in specs})
        others = sorted({rank for _layer, rank in on_disk} - {s.rank for s in specs})
        if others:
            specs += [s for s in shard_specs(manifest, node_name, checkpoint, ranks=others)
                      if (s.layer, s.rank) in on_disk]
    except (BadInput, CannotRun) as exc:
        report.checked += 1
        report.problems.append(Problem(str(engram_dir), "could_not_check", exc.message))
        return report
    sums = read_sums(engram_dir / SUMS_NAME)
    for spec in specs:
        report.checked += 1
        try:
            reason = check_shard(spec, checkpoint, sums, seed=seed, full=full)
        except CannotRun as exc:
            report.problems.append(Problem(str(spec.path), "could_not_check", exc.message))
            continue
        if reason is None:
            report.ok += 1
        else:
            kind = "missing" if reason == "not packed yet" else "mismatch"
            repair = hints.command("pack-engram", "--node", node_name, "--rank", spec.rank)
            report.problems.append(Problem(str(spec.path), kind, f"{reason} (repair: {repair})"))
            if repair not in report.repairs:
                report.repairs.append(repair)
    return report


def _present(engram_dir: Path, world: int, layers: set[int]) -> set[tuple[int, int]]:
    """(layer, rank) of the shards of this TP size and these layers found in `engram_dir`."""
    found = set()
    try:
        names = os.listdir(engram_dir)
    except OSError:
        return found
    for name in names:
        parsed = parse_shard_name(name)
        if parsed and parsed[2] == world and parsed[0] in layers and parsed[1] < world:
            found.add(parsed[:2])
    return found
