"""What a fleet run found: one NodeRun per node, the FleetReport around them, and the table."""

from __future__ import annotations

from dataclasses import dataclass

from stager.errors import EXIT_CANNOT_RUN, EXIT_OK
from stager.units import format_size

ALLOW_OPEN = "--allow-unauthenticated-cluster"
# What the table's "bytes" column shows for each command (verify moves no bytes; prune: bytes freed).
BYTES_KEY = {"mirror": "copied_bytes", "pack-engram": "packed_bytes", "audit": "needed_bytes", "prune": "freed_bytes"}
STATUS = {
    "audit": ("ok", "warning", "critical", "unknown"),  # Nagios, as `stage audit` exits
    "default": ("ok", "problems", "bad input", "cannot run"),
}



@dataclass(frozen=True)
class NodeRun:
    """One node's outcome: its node-local exit code and JSON report, or why there is none."""

    node: str
    exit_code: int
    status: str
    report: dict | None = None
    seconds: float | None = None
    source: str | None = None  # mirror: where the node copied from
    host: str | None = None
    error: str | None = None
    bytes: int | None = None
    problems: int | None = None

    def to_json(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "bytes": self.bytes,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "problems": self.problems,
                "source": self.source, "host": self.host, "error": self.error, "report": self.report}


@dataclass(frozen=True)
class FleetReport:
    command: str
    runs: tuple[NodeRun, ...]
    seconds: float
    fan_out: bool
    ray_address: str
    # "token": the cluster refused a request without one; "disabled": it answered one, and the run
    # went ahead under --allow-unauthenticated-cluster; "unchecked": the check had no clear answer.
    cluster_auth: str = "token"

    @property
    def exit_code(self) -> int:
        return max((run.exit_code for run in self.runs), default=EXIT_OK)

    @property
    def copied_from(self) -> dict[str, int] | None:
        """Bytes copied per source: with --fan-out the NAS's share is one copy of the data."""
        if self.command != "mirror":
            return None
        totals: dict[str, int] = {}
        for run in self.runs:
            if run.report and run.source:
                totals[run.source] = totals.get(run.source, 0) + int(run.report.get("copied_bytes") or 0)
        return totals

    def to_json(self) -> dict:
        return {"command": self.command, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
                "fan_out": self.fan_out, "ray_address": self.ray_address, "cluster_auth": self.cluster_auth,
                "copied_from": self.copied_from,
                "nodes": {run.node: run.to_json() for run in self.runs}}


def unreachable(node: str, why: str, source: str | None = None) -> NodeRun:
    return NodeRun(node, EXIT_CANNOT_RUN, "unreachable", source=source, error=why)



def table(report: FleetReport, problems_per_node: int = 5) -> list[str]:
    """The per-node table, each node's first problems, and a closing count."""
    rows = [("node", "status", "bytes", "seconds", "problems", "detail")]
    for run in report.runs:
        detail = run.error or (f"from {run.source}" if run.source else "")
        rows.append((run.node, run.status, "-" if run.bytes is None else format_size(run.bytes),
                     "-" if run.seconds is None else f"{run.seconds:.1f}",
                     "-" if run.problems is None else str(run.problems), detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5] for row in rows]
    for run in report.runs:
        for problem in ((run.report or {}).get("problems") or [])[:problems_per_node]:
            if isinstance(problem, dict):
                lines.append(f"  {run.node}: {problem.get('kind')} {problem.get('path')}: {problem.get('detail')}")
    counts: dict[str, int] = {}
    for run in report.runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    copied = report.copied_from
    if copied:
        summary += "; copied " + ", ".join(f"{format_size(n)} from {src}" for src, n in copied.items())
    if report.cluster_auth != "token":
        lines.append(f"warning: the Ray cluster's authentication is {report.cluster_auth} ({ALLOW_OPEN})")
    lines.append(f"fleet {report.command}: {summary} in {report.seconds:.1f}s (exit {report.exit_code})")
    return lines

