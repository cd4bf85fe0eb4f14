"""`stage mirror --node NAME`: stage the node's models from the NAS into its local hub."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stager.cli.app import BwlimitOpt, DryRunOpt, FullOpt, JobsOpt, JsonOpt, ManifestOpt, NodeOpt, QuietOpt, SeedOpt, VerboseOpt, WaitOpt, app
from stager.cli import terminal


@app.command()
def mirror(
    node: NodeOpt,
    model: Annotated[Optional[list[str]], typer.Option("--model", metavar="REPO", help="Only this repo (repeatable)")] = None,
    dry_run: DryRunOpt = False,
    full: FullOpt = False,
    jobs: JobsOpt = None,
    json: JsonOpt = False,
    seed: SeedOpt = None,
    source: Annotated[Optional[str], typer.Option(
        "--source", metavar="PATH|URL", help="Stage from this hub (a path, or sftp://[user@]host[:port]/path of a peer) "
                                             "instead of the manifest's; verification still compares against the NAS "
                                             "when it answers")] = None,
    wait: WaitOpt = 0,
    bwlimit: BwlimitOpt = None,
    manifest: ManifestOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Mirror the node's models into its local hub, then verify them."""
    from stager.base.units import parse_rate
    from stager.mirror import pipeline as core
    from stager.base.text import known_as
    from stager.manifest import load_manifest

    job = core.node_job(load_manifest(manifest), node, model, jobs=jobs or core.default_jobs(), seed=seed,
                        source_override=source, bwlimit=parse_rate(bwlimit) if bwlimit else None)
    report = core.mirror(job, full=full, dry_run=dry_run, wait=wait, progress_factory=terminal.byte_progress(not json, "stage"))
    if json:
        terminal.emit_json(report.to_json())
    else:
        for item in sorted(report.would_copy, key=lambda item: item["name"]):
            terminal.report(f"  would copy {terminal.printable(known_as(item['name'], item['blob']))} "
                            f"({terminal.size(item['bytes'])}): {item['reason']}")
        verb = "would copy" if dry_run else "copied"
        terminal.report(f"{node}: {verb} {terminal.count(report.copied_files, 'file')} "
                        f"({terminal.size(report.copied_bytes)}), {terminal.count(report.entries, 'entry', 'entries')}, "
                        f"{len(report.excluded)} excluded, {terminal.count(len(report.problems), 'problem')} "
                        f"in {report.seconds:.1f}s")
        terminal.print_problems(report.problems, to_stdout=True)
        terminal.print_pending(report.pending)
    terminal.exit_with(report.problems)
