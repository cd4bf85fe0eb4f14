"""`stage verify --node NAME`: the verification ladder over the node's staged files."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import FullOpt, JobsOpt, JsonOpt, ManifestOpt, NodeOpt, QuietOpt, SeedOpt, VerboseOpt, app
from stager.cli import terminal


@app.command()
def verify(
    node: NodeOpt,
    full: FullOpt = False,
    subset: Annotated[Optional[str], typer.Option(
        "--subset", metavar="N/T", help="Check only bucket N of T of the blobs (a nightly rotating scrub; "
                                        "structure is still checked for every entry)")] = None,
    jobs: JobsOpt = None,
    json: JsonOpt = False,
    seed: SeedOpt = None,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check that every staged file is local, linked correctly, and matches the source."""
    from stager.mirror import pipeline as core
    from stager.base.errors import BadInput
    from stager.manifest import load_manifest
    from stager.mirror.verify import Subset

    try:
        chosen = Subset.parse(subset) if subset else None
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    loaded = load_manifest(manifest)
    job = core.node_job(loaded, node, None, jobs=jobs or core.default_jobs(), seed=seed)
    report = core.verify(job, full=full, subset=chosen, progress_factory=terminal.byte_progress(not json, "verify"))
    if loaded.engram is not None and loaded.node(node).engram_dir:
        from stager.engram import verify_engram  # numpy and the shard code, only where shards are

        report.merge(verify_engram(loaded, node, full=full, seed=job.seed))
    if json:
        terminal.emit_json(report.to_json())
    else:
        terminal.report(f"{node}: {report.mode} verify against {report.against}: {report.ok}/{report.checked} ok, "
                        f"{terminal.count(len(report.problems), 'problem')}")
        terminal.print_problems(report.problems, to_stdout=True)
        terminal.print_pending(report.pending)
        for command in report.repairs:
            terminal.report(f"repair: {command}")
        for note in report.notes:
            terminal.note(f"note: {terminal.printable(note)}")
    terminal.exit_with(report.problems)
