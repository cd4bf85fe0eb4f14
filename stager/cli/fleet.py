"""`stage fleet mirror|verify|pack-engram|audit|prune`: the node-local command on every node, over Ray.

One subcommand each, so that each help lists only the options that apply to it: a single help
for all five listed `--until-free` under mirror, and then refused it there.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import FullOpt, JsonOpt, ManifestOpt, QuietOpt, TimeoutOpt, VerboseOpt, app, check_rate
from stager.cli import terminal

fleet_app = typer.Typer(
    no_args_is_help=True,
    help="Run a command on every node as Ray tasks; one table (or JSON object) on stdout, a line per node "
         "as it goes on a terminal's stderr; exit code = worst node's.")
app.add_typer(fleet_app, name="fleet")

NodesOpt = Annotated[Optional[str], typer.Option(
    "--nodes", metavar="NAME,NAME", help="Comma-separated node names [default: every node in the manifest]")]
AllowOpenOpt = Annotated[bool, typer.Option(
    "--allow-unauthenticated-cluster",
    help="Run on a Ray cluster that accepts requests without a token (anyone who reaches it runs code)")]


def _run(command: str, nodes: Optional[str], timeout: float, allow_unauthenticated: bool, json: bool,
         manifest: Optional[str], **options) -> None:
    from stager.fleet.driver import run_fleet
    from stager.fleet.report import notes, table
    from stager.manifest import load_manifest

    names = [name.strip() for name in nodes.split(",") if name.strip()] if nodes else None
    with terminal.live_lines(not json) as live:
        report = run_fleet(load_manifest(manifest), command, names, timeout=timeout,
                           allow_unauthenticated=allow_unauthenticated, show=live, warn=terminal.note, **options)
    for line in notes(report):
        terminal.say(line)
    if json:
        terminal.emit_json(report.to_json())
    else:
        for line in table(report, verbose=terminal.verbosity() >= terminal.VERBOSE):
            terminal.report(line)
    raise typer.Exit(report.exit_code)


@fleet_app.command("mirror")
def fleet_mirror(
    nodes: NodesOpt = None,
    timeout: TimeoutOpt = 3600,
    transport: Annotated[Optional[str], typer.Option(
        "--transport", metavar="broadcast|sftp|nas",
        help="How bytes several nodes need move: broadcast (default with 2+ node addresses), sftp (the peer "
             "tree), nas (every node reads its source)")] = None,
    fan_out: Annotated[bool, typer.Option(
        "--fan-out", help="One node from the NAS, the rest from staged peers over SFTP (--transport sftp)")] = False,
    ports: Annotated[Optional[str], typer.Option(
        "--ports", metavar="LOW-HIGH", help="--transport broadcast: TCP ports the relays listen on [default: any]")] = None,
    bwlimit: Annotated[Optional[str], typer.Option(
        "--bwlimit", metavar="RATE", callback=check_rate,
        help="Each node reads at most RATE from its source (the NAS, or its peer with --transport sftp), as "
             "stage mirror --bwlimit, and with the broadcast sends at most RATE to its peers")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="Check every byte against its content name (SHA-256 of an LFS blob, git's SHA-1 of a small "
                       "file), hashed once, by the node that reads it from the NAS")] = False,
    streams: Annotated[Optional[int], typer.Option(
        "--streams", metavar="K", min=1, max=64,
        help="The broadcast's connections per hop, each on a core of its own at either end [default: [fleet] "
             "streams, else each node's cores, at most 4]")] = None,
    allow_unauthenticated_cluster: AllowOpenOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Stage every node (stage mirror on each); bytes two or more nodes need leave the NAS once."""
    _run("mirror", nodes, timeout, allow_unauthenticated_cluster, json, manifest, transport=transport,
         fan_out=fan_out, ports=ports, bwlimit=bwlimit, full=full, streams=streams)


@fleet_app.command("verify")
def fleet_verify(
    nodes: NodesOpt = None,
    timeout: TimeoutOpt = 3600,
    full: FullOpt = False,
    subset: Annotated[Optional[str], typer.Option(
        "--subset", metavar="N/T", help="Check bucket N of T of the blobs on every node (see stage verify)")] = None,
    allow_unauthenticated_cluster: AllowOpenOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Verify every node (stage verify on each)."""
    _run("verify", nodes, timeout, allow_unauthenticated_cluster, json, manifest, full=full, subset=subset)


@fleet_app.command("pack-engram")
def fleet_pack_engram(
    nodes: NodesOpt = None,
    timeout: TimeoutOpt = 3600,
    allow_unauthenticated_cluster: AllowOpenOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Pack every node's Engram row shards (stage pack-engram on each, its manifest ranks)."""
    _run("pack-engram", nodes, timeout, allow_unauthenticated_cluster, json, manifest)


@fleet_app.command("audit")
def fleet_audit(
    nodes: NodesOpt = None,
    timeout: TimeoutOpt = 3600,
    allow_unauthenticated_cluster: AllowOpenOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Audit every node's disk space (stage audit on each)."""
    _run("audit", nodes, timeout, allow_unauthenticated_cluster, json, manifest)


@fleet_app.command("prune")
def fleet_prune(
    nodes: NodesOpt = None,
    timeout: TimeoutOpt = 3600,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", "-n", help="List what each node would remove, and remove nothing")] = False,
    until_free: Annotated[Optional[str], typer.Option(
        "--until-free", metavar="SIZE|reserve", help="Stop on each node once SIZE is free (see stage prune)")] = None,
    only: Annotated[Optional[list[str]], typer.Option(
        "--only", metavar="KIND", help="Remove only items of this kind (repeatable; see stage prune)")] = None,
    allow_unauthenticated_cluster: AllowOpenOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Prune every node (stage prune on each)."""
    from stager.fleet.options import PruneOptions

    _run("prune", nodes, timeout, allow_unauthenticated_cluster, json, manifest,
         prune=PruneOptions(dry_run, until_free, tuple(only or ())))
