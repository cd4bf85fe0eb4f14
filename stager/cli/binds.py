"""`stage binds --node NAME`: read-only mounts for a container, local first, NAS as the fallback."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import JsonOpt, ManifestOpt, NodeOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def binds(
    node: NodeOpt,
    json: JsonOpt = False,
    format: Annotated[str, typer.Option("--format", metavar="docker|json",
                                        help="docker: -v arguments, one per line; json: the same as --json")] = "docker",
    container_hub: Annotated[Optional[str], typer.Option(
        "--container-hub", metavar="PATH", help="HF_HUB_CACHE inside the container [default: the node's hub path]")] = None,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Print the bind mounts that give a container the node's models, staged files first."""
    from stager.housekeeping import binds as core
    from stager.base.errors import BadInput
    from stager.manifest import load_manifest

    if format not in ("docker", "json"):
        raise BadInput(f"--format {format}: expected docker or json")
    result = core.node_binds(load_manifest(manifest), node, container_hub)
    if json or format == "json":
        terminal.emit_json(result.to_json())
    else:
        # stdout is `docker run $(stage binds ...)` input: only -v arguments there, the rest on stderr.
        for bind in result.binds:
            terminal.report(bind.docker())
        terminal.note(f"{node}: {terminal.count(len(result.binds), 'bind')}, {terminal.count(result.local, 'file')} "
                     f"local, {result.nas_fallback} from the NAS; set HF_HUB_CACHE={result.container_hub} in the container")
        terminal.print_problems(result.problems)
    terminal.exit_with(result.problems)
