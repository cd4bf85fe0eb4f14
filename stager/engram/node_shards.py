"""Which shards a node holds: its ranks, the TP size and the layers, as `ShardSpec`s.

Everything here is decided from the manifest, the command line and the checkpoint geometry,
before a row is read: a rank outside the TP size, `rank` and `ranks` both set, or an
engram_dir on the NAS exit 2 here, not halfway through a pack.
"""

from __future__ import annotations

import socket
from pathlib import Path

from stager.engram.checkpoint import Checkpoint, engram_config, open_checkpoint
from stager.engram.layouts import partition
from stager.engram.shard_format import ShardSpec
from stager.base.errors import BadInput
from stager.manifest import Manifest


def node_ranks(manifest: Manifest, node_name: str, world: int) -> list[int]:
    """The ranks a node packs and verifies by default, in order: `ranks`, else `rank`, else every
    rank of the TP size (one 8-GPU node serving all of TP=8)."""
    node = manifest.node(node_name)
    key = "ranks" if node.ranks is not None else "rank"
    ranks = node.engram_ranks if node.engram_ranks is not None else list(range(world))
    for rank in ranks:
        if not 0 <= rank < world:
            raise BadInput(f"{manifest.path}: nodes.{node_name}.{key}: rank {rank} is outside 0..{world - 1} "
                           f"for TP={world}")
    return sorted(ranks)


def target(manifest: Manifest, node_name: str, world: int | None,
           ranks: list[int] | None) -> tuple[object, object, int, list[int]]:
    """(engram config, node config, TP size, ranks), refusing what cannot be packed before any file is read.
    `ranks` are the command line's (`--rank`, repeatable); None: the node's."""
    engram = engram_config(manifest)
    node = manifest.node(node_name)
    if node.engram_dir is None:
        raise BadInput(f"{manifest.path}: nodes.{node_name}.engram_dir: not set, so there is nowhere to pack to")
    world = engram.world if world is None else world
    if world < 1:
        raise BadInput(f"--world {world}: the TP size must be at least 1")
    for rank in ranks or ():
        if not 0 <= rank < world:
            raise BadInput(f"--rank {rank} is outside 0..{world - 1} for TP={world}")
    ranks = sorted(set(ranks)) if ranks else node_ranks(manifest, node_name, world)
    return engram, node, world, ranks


def shard_specs(manifest: Manifest, node_name: str, checkpoint: Checkpoint, *, ranks: list[int] | None = None,
                world: int | None = None, layers: list[int] | None = None) -> list[ShardSpec]:
    """The shards for these ranks and layers, by layer then rank (rank order is row order).
    Defaults: the manifest's world, the node's ranks, the manifest's layers (every layer in the
    checkpoint when it names none)."""
    engram, node, world, ranks = target(manifest, node_name, world, ranks)
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
            specs.append(ShardSpec.make(Path(node.engram_dir), layer, rank, world, lo, hi, table.rows, engram.layout))
    return specs


def expected_shards(manifest: Manifest, node_name: str, rank: int | None = None) -> list[ShardSpec]:
    """The shards `node_name` should hold: `rank`, else the node's ranks, for the manifest's world
    and layers. Empty when the manifest has no [engram] or the node no engram_dir. The geometry is
    read from the staged snapshot, else from the NAS (headers only: a few KiB)."""
    if manifest.engram is None or manifest.node(node_name).engram_dir is None:
        return []
    checkpoint = open_checkpoint(manifest, node_name, from_nas=True)
    return shard_specs(manifest, node_name, checkpoint, ranks=None if rank is None else [rank])


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


def refuse_engram_dir_on_nas(manifest: Manifest, node_name: str) -> None:
    """Exit 2 if the node's engram_dir is, lies inside or holds the NAS hub, the node's source or
    an alias target, however spelled: checked by identity when the directory is about to be
    written (an engram_dir linked into a NAS repo once got shards, receipts and SHA256SUMS)."""
    node = manifest.node(node_name)
    manifest.refuse_source_overlap(f"nodes.{node_name}.engram_dir", node.engram_dir,
                                   [node.source] if node.source else [])
