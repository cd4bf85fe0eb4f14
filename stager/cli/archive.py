"""`stage archive SRC... DEST`: move files to an archive, SHA-256 checked on both sides."""

from __future__ import annotations

from typing import Annotated

import typer

from stager.cli.app import DryRunOpt, JsonOpt, ManifestOpt, QuietOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def archive(
    paths: Annotated[list[str], typer.Argument(metavar="SRC... DEST", help="Files or directories, then the archive directory")],
    dry_run: DryRunOpt = False,
    json: JsonOpt = False,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Copy SRC files to DEST, hash both sides, record SHA256SUMS and MOVED.txt, then delete the sources.

    The manifest is optional: when one is found, a DEST on its NAS hub or alias targets is refused."""
    from stager.housekeeping import archive as core
    from stager.base.errors import BadInput, StageError

    if len(paths) < 2:
        raise BadInput("stage archive needs at least one SRC and a DEST")
    try:
        report = core.archive(paths[:-1], paths[-1], protected=core.protected_places(manifest), dry_run=dry_run,
                              progress_factory=terminal.byte_progress(not json, "archive"))
    except StageError as exc:
        # The message names files, and a newline in a file name must not split the one error line.
        raise type(exc)(terminal.printable(exc.message)) from None
    if json:
        terminal.emit_json(report.to_json())
    else:
        summary = report.to_json()
        for item in report.would_move:
            terminal.report(f"  would {'copy' if item['action'] == 'copy' else 'adopt'} "
                            f"{terminal.printable(item['path'])} -> {terminal.printable(item['to'])} "
                            f"({terminal.size(item['bytes'])}), then delete the source: {item['reason']}")
        if dry_run:
            adopted = sum(1 for item in report.would_move if item["action"] == "adopt")
            terminal.report(f"archive: would move {terminal.count(len(report.would_move), 'file')} "
                            f"({terminal.size(sum(item['bytes'] for item in report.would_move))}; {adopted} adopted) "
                            f"to {terminal.printable(report.dest)}, {len(report.skipped)} skipped, "
                            f"{terminal.count(len(report.problems), 'problem')}; nothing was changed")
        else:
            terminal.report(f"archive: moved {summary['moved_files']} files ({terminal.size(summary['moved_bytes'])}; "
                            f"{summary['adopted_files']} adopted) to {terminal.printable(report.dest)}, "
                            f"{len(report.skipped)} skipped, {len(report.problems)} problems in {report.seconds:.1f}s")
        for note in report.notes:
            terminal.report(f"  note: {terminal.printable(note)}")
        terminal.print_problems(report.skipped, to_stdout=True)
        terminal.print_problems(report.problems, to_stdout=True)
    terminal.exit_with(report.problems)
