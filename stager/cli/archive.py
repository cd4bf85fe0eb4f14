"""`stage archive SRC... DEST`: move files to an archive, SHA-256 checked on both sides."""

from __future__ import annotations

from typing import Annotated

import typer

from stager.cli.app import JsonOpt, app
from stager.cli import terminal


@app.command()
def archive(
    paths: Annotated[list[str], typer.Argument(metavar="SRC... DEST", help="Files or directories, then the archive directory")],
    json: JsonOpt = False,
) -> None:
    """Copy SRC files to DEST, hash both sides, record SHA256SUMS and MOVED.txt, then delete the sources."""
    from stager import archive as core
    from stager.errors import BadInput

    if len(paths) < 2:
        raise BadInput("stage archive needs at least one SRC and a DEST")
    report = core.archive(paths[:-1], paths[-1], progress_factory=terminal.byte_progress(not json, "archive"))
    if json:
        terminal.emit_json(report.to_json())
    else:
        summary = report.to_json()
        terminal.say(f"archive: moved {summary['moved_files']} files ({terminal.size(summary['moved_bytes'])}; "
                     f"{summary['adopted_files']} adopted) to {report.dest}, {len(report.skipped)} skipped, "
                     f"{len(report.problems)} problems in {report.seconds:.1f}s")
        for note in report.notes:
            terminal.say(f"  note: {note}")
        terminal.print_problems(report.skipped)
        terminal.print_problems(report.problems)
    terminal.exit_with(report.problems)
