"""The typer app, the options every command shares, and the one place that ends a command."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from stager.errors import EXIT_CANNOT_RUN, StageError

app = typer.Typer(
    name="stage",
    help="Stage model weights and Engram row shards onto node-local NVMe, verified.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts show "[default: ...]" literally
)

ManifestOpt = Annotated[
    Optional[str],
    typer.Option("--manifest", "-m", help="Manifest path [default: $STAGE_MANIFEST or manifests/cluster.toml]"),
]
NodeOpt = Annotated[str, typer.Option("--node", "-n", help="Node name from the manifest's [nodes] table")]
OptionalNodeOpt = Annotated[Optional[str], typer.Option("--node", "-n", help="Node name from the manifest's [nodes] table")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout")]
FullOpt = Annotated[bool, typer.Option("--full", help="Hash every byte against the strongest reference")]
JobsOpt = Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, max=64, help="Files copied or checked in parallel")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for the sampled regions [default: random, reported]")]


def main() -> None:
    """Entry point: every StageError becomes one line on stderr and its documented exit code."""
    try:
        app()
    except StageError as exc:
        print(f"stage: error: {exc.message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("stage: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if os.environ.get("STAGE_DEBUG"):
            raise
        print(f"stage: internal error: {type(exc).__name__}: {exc} (set STAGE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        sys.exit(EXIT_CANNOT_RUN)
