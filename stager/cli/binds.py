"""`stage binds --node NAME`: read-only mounts for a container, local first, NAS as the fallback."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import ManifestOpt, NodeOpt, app
from stager.cli import terminal


@app.command()
def binds(
    node: NodeOpt,
    format: Annotated[str, typer.Option("--format", help="docker (-v arguments, one per line) or json")] = "docker",
    container_hub: Annotated[Optional[str], typer.Option(
        "--container-hub", help="HF_HUB_CACHE inside the container [default: the node's hub path]")] = None,
    manifest: ManifestOpt = None,
) -> None:
    """Print the bind mounts that give a container the node's models, staged files first."""
    from stager import binds as core
    from stager.errors import BadInput
    from stager.manifest import load_manifest

    if format not in ("docker", "json"):
        raise BadInput(f"--format {format}: expected docker or json")
    result = core.node_binds(load_manifest(manifest), node, container_hub)
    if format == "json":
        terminal.emit_json(result.to_json())
    else:
        for bind in result.binds:
            typer.echo(bind.docker())
        terminal.say(f"{node}: {len(result.binds)} binds, {result.local} files local, "
                     f"{result.nas_fallback} from the NAS; set HF_HUB_CACHE={result.container_hub} in the container")
        terminal.print_problems(result.problems)
    terminal.exit_with(result.problems)
