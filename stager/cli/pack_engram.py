"""`stage pack-engram [--rank R]...`: pack the node's Engram row shards from its staged checkpoint."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import DryRunOpt, JsonOpt, LayerOpt, ManifestOpt, OptionalNodeOpt, QuietOpt, RankOpt, VerboseOpt, WorldOpt, app
from stager.cli import terminal
from stager.base.errors import StageError


@app.command("pack-engram")
def pack_engram(
    rank: RankOpt = None,
    node: OptionalNodeOpt = None,
    world: WorldOpt = None,
    layer: LayerOpt = None,
    from_nas: Annotated[bool, typer.Option("--from-nas", help="Read rows from the NAS if the model is not staged")] = False,
    full: Annotated[bool, typer.Option("--full", help="Re-derive every row and hash every shard before calling it "
                                                       "up to date; repack those that differ")] = False,
    dry_run: DryRunOpt = False,
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
        report = engram.pack(loaded, name, ranks=rank, world=world, layers=layer, from_nas=from_nas, full=full,
                             dry_run=dry_run,
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
        verb = "skipped" if shard.skipped else "would pack" if dry_run else "packed "
        terminal.report(f"{verb} {show(str(shard.spec.path))} rows {shard.spec.lo}..{shard.spec.hi} "
                     f"({terminal.size(shard.spec.bytes)}): {show(shard.reason)}")
    terminal.report(f"{show(name)}: {'would pack' if dry_run else 'packed'} {terminal.size(report.packed_bytes)} "
                    f"from {show(report.source)} in {report.seconds:.1f}s{'; nothing was changed' if dry_run else ''}")
