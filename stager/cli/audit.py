"""`stage audit --node NAME`: disk-space audit for cron, with Nagios exit codes."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import JsonOpt, ManifestOpt, NodeOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def audit(
    node: NodeOpt,
    prom: Annotated[Optional[str], typer.Option("--prom", help="Also write a node_exporter textfile (atomically)")] = None,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Will staging fit? Free space, bytes still needed, orphans. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN."""
    from stager.housekeeping import audit as core

    report = core.run_audit(manifest, node, prom)
    if json:
        terminal.emit_json(report.to_json())
    else:
        for line in core.details(report):
            terminal.note(line)
        typer.echo(report.status_line())
    raise typer.Exit(report.status)
