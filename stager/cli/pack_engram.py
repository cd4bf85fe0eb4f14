"""`stage pack-engram [--rank R]...`: pack the node's Engram row shards from its staged checkpoint."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import JsonOpt, ManifestOpt, OptionalNodeOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal
from stager.errors import StageError


@app.command("pack-engram")
def pack_engram(
    rank: Annotated[Optional[list[int]], typer.Option(
        "--rank", "-r", help="TP rank (repeatable) [default: nodes.X.ranks or nodes.X.rank, else every rank]")] = None,
    node: OptionalNodeOpt = None,
    world: Annotated[Optional[int], typer.Option("--world", help="TP size [default: engram.world]")] = None,
    layer: Annotated[Optional[list[int]], typer.Option("--layer", help="Only this layer (repeatable)")] = None,
    from_nas: Annotated[bool, typer.Option("--from-nas", help="Read rows from the NAS if the model is not staged")] = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Write engram-l{L}-r{R}of{TP}.bin shards for every rank of the node in one pass over each table,
    their receipts and SHA256SUMS; skip shards that match."""
    from stager import engram
    from stager.manifest import load_manifest

    loaded = load_manifest(manifest)
    try:
        name = engram.choose_node(loaded, node)
        report = engram.pack(loaded, name, ranks=rank, world=world, layers=layer, from_nas=from_nas,
                             progress_factory=terminal.byte_progress(not json, "pack-engram"))
    except StageError as exc:
        # The message names tensors and files from the checkpoint: a newline in one must not
        # make the one-line error two lines.
        raise type(exc)(terminal.printable(exc.message)) from None
    if json:
        terminal.emit_json(report.to_json())
        return
    show = terminal.printable
    for shard in report.shards:
        verb = "skipped" if shard.skipped else "packed "
        terminal.report(f"{verb} {show(str(shard.spec.path))} rows {shard.spec.lo}..{shard.spec.hi} "
                     f"({terminal.size(shard.spec.bytes)}): {show(shard.reason)}")
    terminal.report(f"{show(name)}: packed {terminal.size(report.packed_bytes)} from {show(report.source)} "
                 f"in {report.seconds:.1f}s")
