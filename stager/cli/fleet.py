"""`stage fleet mirror|verify|pack-engram|audit|prune`: the node-local command on every node, over Ray."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from stager.cli.app import FullOpt, JsonOpt, ManifestOpt, QuietOpt, TimeoutOpt, VerboseOpt, app
from stager.cli import terminal


class FleetCommand(str, Enum):
    mirror = "mirror"
    verify = "verify"
    pack_engram = "pack-engram"
    audit = "audit"
    prune = "prune"


@app.command()
def fleet(
    command: Annotated[FleetCommand, typer.Argument(help="The node-local command to run on every node")],
    nodes: Annotated[Optional[str], typer.Option("--nodes", help="Comma-separated node names (default: every node in the manifest)")] = None,
    timeout: TimeoutOpt = 3600,
    fan_out: Annotated[bool, typer.Option("--fan-out", help="mirror: one node from the NAS, the rest from staged peers over SFTP (--transport sftp)")] = False,
    transport: Annotated[Optional[str], typer.Option(
        "--transport", help="mirror: how bytes several nodes need move: broadcast (default with 2+ node addresses), sftp (the peer tree), nas (every node reads its source)")] = None,
    ports: Annotated[Optional[str], typer.Option(
        "--ports", metavar="LOW-HIGH", help="mirror --transport broadcast: TCP ports the relays listen on (default: any)")] = None,
    full: FullOpt = False,
    subset: Annotated[Optional[str], typer.Option("--subset", help="verify: check bucket N of T (N/T) on every node")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", "-n", help="prune: list what each node would remove, and remove nothing")] = False,
    until_free: Annotated[Optional[str], typer.Option(
        "--until-free", metavar="SIZE|reserve", help="prune: stop on each node once SIZE is free (see stage prune)")] = None,
    only: Annotated[Optional[list[str]], typer.Option(
        "--only", metavar="KIND", help="prune: remove only items of this kind (repeatable; see stage prune)")] = None,
    allow_unauthenticated_cluster: Annotated[bool, typer.Option(
        "--allow-unauthenticated-cluster",
        help="Run on a Ray cluster that accepts requests without a token (anyone who reaches it runs code)")] = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Run a command on every node as Ray tasks; one table (or JSON object); exit code = worst node's."""
    from stager import fleet as core
    from stager.manifest import load_manifest

    names = [name.strip() for name in nodes.split(",") if name.strip()] if nodes else None
    prune = core.PruneOptions(dry_run, until_free, tuple(only or ()))
    report = core.run_fleet(load_manifest(manifest), command.value, names, timeout=timeout, fan_out=fan_out, transport=transport, ports=ports,
                            full=full, subset=subset, prune=prune, allow_unauthenticated=allow_unauthenticated_cluster)
    if json:
        terminal.emit_json(report.to_json())
    else:
        for line in core.table(report):
            terminal.say(line)
    raise typer.Exit(report.exit_code)
