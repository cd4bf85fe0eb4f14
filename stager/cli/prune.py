"""`stage prune --node NAME`: remove what `stage audit` lists as reclaimable, never what is in use."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import DryRunOpt, JsonOpt, ManifestOpt, NodeOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def prune(
    node: NodeOpt,
    dry_run: DryRunOpt = False,
    until_free: Annotated[Optional[str], typer.Option(
        "--until-free", metavar="SIZE|reserve",
        help="Stop once SIZE is free on each of the node's filesystems ('reserve': once staging fits with the "
             "node's reserve); exit 1 if that cannot be reached")] = None,
    only: Annotated[Optional[list[str]], typer.Option(
        "--only", metavar="KIND",
        help="Remove only items of this kind (repeatable): temp, blob, shared-blob, revision, shard, unlisted-repo")] = None,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Give disk space back: interrupted temps, orphans, revisions and repos the manifest no longer wants, other-TP shards."""
    from stager.housekeeping import prune as core

    report = core.run_prune(manifest, node, dry_run=dry_run, until_free=until_free, only=tuple(only or ()))
    if json:
        terminal.emit_json(report.to_json())
    else:
        lines = core.text_lines(report)
        for line in lines:
            (terminal.note if line.startswith("note: ") else terminal.report)(line)
    raise typer.Exit(report.exit_code)
