"""`stage archive SRC... DEST`: move files to an archive, SHA-256 checked on both sides."""

from __future__ import annotations

from typing import Annotated

import typer

from stager.cli.app import JsonOpt, ManifestOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def archive(
    paths: Annotated[list[str], typer.Argument(metavar="SRC... DEST", help="Files or directories, then the archive directory")],
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Copy SRC files to DEST, hash both sides, record SHA256SUMS and MOVED.txt, then delete the sources.

    The manifest is optional: when one is found, a DEST on its NAS hub or alias targets is refused."""
    from stager import archive as core
    from stager.errors import BadInput, StageError

    if len(paths) < 2:
        raise BadInput("stage archive needs at least one SRC and a DEST")
    try:
        report = core.archive(paths[:-1], paths[-1], protected=core.protected_places(manifest),
                              progress_factory=terminal.byte_progress(not json, "archive"))
    except StageError as exc:
        # The message names files, and a newline in a file name must not split the one error line.
        raise type(exc)(terminal.printable(exc.message)) from None
    if json:
        terminal.emit_json(report.to_json())
    else:
        summary = report.to_json()
        terminal.report(f"archive: moved {summary['moved_files']} files ({terminal.size(summary['moved_bytes'])}; "
                     f"{summary['adopted_files']} adopted) to {terminal.printable(report.dest)}, "
                     f"{len(report.skipped)} skipped, {len(report.problems)} problems in {report.seconds:.1f}s")
        for note in report.notes:
            terminal.report(f"  note: {terminal.printable(note)}")
        terminal.print_problems(report.skipped, to_stdout=True)
        terminal.print_problems(report.problems, to_stdout=True)
    terminal.exit_with(report.problems)
