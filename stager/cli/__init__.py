"""The `stage` command. Each subcommand lives in its own module and stays a few lines long:
parse, call the core, report."""

from stager.cli.app import app, main
from stager.cli import mirror, verify  # noqa: F401  (registers the commands)
from stager.cli import archive, audit, binds  # noqa: F401
from stager.cli import pack_engram, prune  # noqa: F401
from stager.cli import fleet  # noqa: F401

__all__ = ["app", "main"]
