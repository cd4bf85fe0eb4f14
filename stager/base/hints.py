"""The commands this tool tells an operator to run next ("repair: stage mirror ...").

A hint is only worth printing if it can be pasted: one that dropped `--manifest` re-ran against
manifests/cluster.toml instead of the file the operator named, and one that offered `--from-nas`
to `stage verify` failed with "No such option". So every suggested command is built here, by
`command()`, with the manifest the running command read; the CLI records that manifest once,
when it parses `--manifest` (see cli/app.py). Options are passed by the caller and must be ones
the named subcommand accepts; tests/cli/test_cli_contract.py runs the printed hints to keep it so.
"""

from __future__ import annotations

import os
import shlex

MANIFEST_ENV = "STAGE_MANIFEST"  # the same variable manifest.resolve_manifest_path reads

_manifest: str | None = None


def use_manifest(path: str | os.PathLike | None) -> None:
    """Record the manifest named on the command line (None: not given)."""
    global _manifest
    _manifest = os.fspath(path) if path else None


def manifest_args() -> list[str]:
    """`--manifest PATH` when the command was given one, or $STAGE_MANIFEST is set; else nothing
    (the default manifests/cluster.toml is found again from the same directory)."""
    path = _manifest or os.environ.get(MANIFEST_ENV)
    return ["--manifest", path] if path else []


def command(subcommand: str, *args: object) -> str:
    """`stage SUBCOMMAND ARGS... [--manifest PATH]`, quoted for a POSIX shell."""
    return shlex.join(["stage", *subcommand.split(), *map(str, args), *manifest_args()])
