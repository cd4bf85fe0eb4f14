"""Checkpoint geometry: where each layer's Engram table lies in a model revision's safetensors files.

A DeepSeek-V4 Engram table is two tensors per layer in one safetensors file:
`<prefix>layers.{L}.engram.embed.weight` (F8_E4M3, [rows, 256]) and `….scale` (F8_E8M0,
[rows, 8]). The geometry is derived, never hard-coded: the index's weight_map names the
tensors, each file's header (parsed without trusting it, stager/mirror/safetensors_header.py) gives
dtype, shape and byte span, and config.json's `engram_layer_ids` is cross-checked.

Trust: the staged snapshot is read first and believed only as far as it parses. When it cannot
give the geometry, the NAS's is read (headers only) to tell a checkpoint that can never be
packed (exit 2) from one not staged yet (exit 3).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from stager.base import hints
from stager.engram.shard_format import SCALE_BYTES, SCALE_DTYPE, WEIGHT_BYTES, WEIGHT_DTYPE
from stager.base.errors import BadInput, CannotRun
from stager.mirror.hub import BadRef, Entry, LinkError, is_excluded, repo_dir_name, resolve_chain, resolve_revision
from stager.manifest import Manifest
from stager.mirror.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from stager.sources import open_source
from stager.sources.base import Source
from stager.sources.local import LocalSource

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
JSON_LIMIT = 64 * 1024 * 1024
# Any prefix (empty, "model.", "model.language_model.") before `layers.`.
_TENSOR = re.compile(r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.engram\.embed\.(?P<part>weight|scale)")


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

    def open(self, file: str, *, sequential: bool = False):
        """`sequential` for a pass over whole spans (packing, a full check): a local file is then
        also read with O_DIRECT wherever offsets and lengths allow (stager/engram/row_stream.py)."""
        try:
            return self.source.open(self.finals[file], uncached=False, sequential=sequential)
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
    try:
        commit = resolve_revision(source, repo_dir, revision)
    except BadRef as exc:
        raise _NotStaged(str(exc)) from None
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
    engram = engram_config(manifest)
    node = manifest.node(node_name)
    model = manifest.models[engram.model]
    local_hub = Path(node.hub)
    try:
        if not local_hub.is_dir():
            raise _NotStaged(f"local hub {local_hub} does not exist")
        return load_checkpoint(LocalSource(str(local_hub), keep_atime=True), engram.model, model.revision,
                               f"local hub {local_hub}", exclude=model.exclude)
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
                           f"node, and the Engram geometry is read from it (stop excluding it, or pack from the "
                           f"NAS: `{hints.command('pack-engram', '--node', node_name, '--from-nas')}`)")
    raise not_staged



def engram_config(manifest: Manifest):
    if manifest.engram is None:
        raise BadInput(f"{manifest.path}: engram: no [engram] table in the manifest")
    return manifest.engram
