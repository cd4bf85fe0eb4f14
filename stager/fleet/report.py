"""What a fleet run found: one NodeRun per node, the FleetReport around them, and the table; and
a node's Progress as its part goes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from stager.base.errors import EXIT_CANNOT_RUN, EXIT_OK
from stager.base.units import format_size

if TYPE_CHECKING:
    from stager.fleet.choice import Choice

ALLOW_OPEN = "--allow-unauthenticated-cluster"
# What the table's "bytes" column shows for each command (verify moves no bytes; prune: bytes freed).
BYTES_KEY = {"mirror": "copied_bytes", "pack-engram": "packed_bytes", "audit": "needed_bytes", "prune": "freed_bytes"}
STATUS = {
    "audit": ("ok", "warning", "critical", "unknown"),  # Nagios, as `stage audit` exits
    "default": ("ok", "problems", "bad input", "cannot run"),
}


@dataclass(frozen=True)
class Progress:
    """A broadcast node's part as it goes, from its agent, asked once a second: enough for the
    driver to tell a silent node from a slow one, for the chain's laggard rule, and for a live
    per-node display. Bytes are data bytes the node has written and checked; a file counts once it
    has landed under its final name (the next run keeps it; a temp file it sweeps)."""

    phase: str  # "plan", "broadcast" (its relay receives or serves), "mirror" (its closing mirror), "done"
    done_bytes: int = 0
    total_bytes: int = 0  # of the shared files it has been handed so far
    landed_files: int = 0
    source: str | None = None  # where its next chunk comes from: "nas", a peer's name; None when not receiving
    session: int | None = None  # the broadcast session it receives, or last received
    chunks: int = 0  # chunks it holds of that session: the laggard rule counts whole chunks

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Delivery:
    """Where a mirrored node's bytes came from, whatever the transport: data bytes from peers and
    from the NAS (sampled checks not counted), what fell back to the NAS and why, the peers whose
    chunks failed the run's key, and the connections its relay refused: counted by address, the
    addresses refused most first, every other address together last (address None), each
    {address, connections, why: {reason: connections}} (gate.Refusals.summary)."""

    transport: str
    peer_bytes: int = 0
    nas_bytes: int = 0
    fallbacks: tuple[dict, ...] = ()
    bad_senders: tuple[str, ...] = ()
    refused: tuple[dict, ...] = ()
    moved_to_tail: bool = False  # it fell behind its upstream, and the chain was reordered around it
    # The CPU its relay's threads used (receive, check, write, serve), so that a relay's cost per
    # GB can be told apart from its node's process starts and walks; None without a relay.
    relay_cpu_seconds: float | None = None

    def to_json(self) -> dict:
        return {"transport": self.transport, "peer_bytes": self.peer_bytes, "nas_bytes": self.nas_bytes,
                "fallbacks": list(self.fallbacks), "bad_senders": list(self.bad_senders),
                "refused_connections": list(self.refused), "moved_to_tail": self.moved_to_tail,
                "relay_cpu_seconds": self.relay_cpu_seconds}


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
    delivery: Delivery | None = None  # mirror only
    progress: Progress | None = None  # a stalled node: its last answer, what it held when it went silent

    def to_json(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "bytes": self.bytes,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "problems": self.problems,
                "source": self.source, "host": self.host, "error": self.error,
                **(self.delivery.to_json() if self.delivery else {}),
                "progress": self.progress.to_json() if self.progress else None, "report": self.report}


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
    transport: str | None = None  # mirror: "broadcast", "sftp" or "nas"
    choice: Choice | None = None  # mirror, told no transport: per group, the broadcast or direct reads, and why

    @property
    def nas_bytes(self) -> int | None:
        """Data bytes the whole fleet read from the NAS (mirror), sampled checks not counted."""
        if self.command != "mirror":
            return None
        return sum(run.delivery.nas_bytes for run in self.runs if run.delivery)

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
                "copied_from": self.copied_from, "transport": self.transport, "nas_bytes": self.nas_bytes,
                "choice": self.choice.to_json() if self.choice else None,
                "nodes": {run.node: run.to_json() for run in self.runs}}


def from_answer(command: str, node: str, out: dict, source: str | None, timeout: float) -> NodeRun:
    """The node's run from its node-local command's answer ({code, stdout (its JSON), stderr,
    seconds, host, timed_out}: node.run_on_node's, and an agent's): its exit code and report as
    the node-local contract has them, the last line it wrote on stderr as the error. An exit code
    outside the contract, or a signal, is `cannot run`."""
    stderr_lines = [line for line in out["stderr"].splitlines() if line.strip()]
    error = stderr_lines[-1][:500] if stderr_lines else None
    if out["timed_out"]:
        return NodeRun(node, EXIT_CANNOT_RUN, "timed out", seconds=out["seconds"], source=source, host=out["host"],
                       error=f"killed at the fleet deadline ({timeout:g}s)")
    code = out["code"]
    if code < 0 or code > EXIT_CANNOT_RUN:
        error = f"stage {command} ended with {'signal ' + str(-code) if code < 0 else 'exit ' + str(code)}"
        code = EXIT_CANNOT_RUN
    try:
        report = json.loads(out["stdout"]) if out["stdout"].strip() else None
    except ValueError:
        report, error = None, error or "the node-local command printed something other than JSON"
    if not isinstance(report, dict):
        report = None
    problems = report.get("problems") if report else None
    names = STATUS.get(command, STATUS["default"])
    return NodeRun(
        node, code, names[code], report=report, seconds=out["seconds"],
        source=((report or {}).get("source") or source) if command == "mirror" else source,
        host=out["host"], error=error if code != EXIT_OK else None,
        bytes=(report or {}).get(BYTES_KEY[command]) if command in BYTES_KEY else None,
        problems=len(problems) if isinstance(problems, list) else None)


def unreachable(node: str, why: str, source: str | None = None) -> NodeRun:
    return NodeRun(node, EXIT_CANNOT_RUN, "unreachable", source=source, error=why)


def stalled(node: str, silent: float, last: Progress | None) -> NodeRun:
    """A node whose agent stopped answering (its processes stopped, its kernel hung): exit 3, as
    an unreachable node, with what it held at its last answer. Its hub is left as a killed run
    leaves it; its next run sweeps the temp files and keeps what landed."""
    if last is None:
        why = f"its agent never answered ({silent:.0f}s)"
    else:
        held = f"{last.landed_files} files landed, {format_size(last.done_bytes)}"
        why = (f"its agent answered nothing for {silent:.0f}s during its {last.phase}; {held} of "
               f"{format_size(last.total_bytes)} received")
    return NodeRun(node, EXIT_CANNOT_RUN, "stalled", error=why, progress=last)



def _refused_lines(refused: tuple[dict, ...], shown: int) -> list[str]:
    """The first `shown` addresses a relay refused, with their reasons; the rest in one line."""
    lines = []
    for entry in refused[:shown]:
        where = entry.get("address") or "other addresses"
        reasons = "; ".join(f"{count}: {why}" for why, count in (entry.get("why") or {}).items())
        lines.append(f"refused {_connections(entry.get('connections', 0))} from {where} ({reasons})")
    rest = sum(entry.get("connections", 0) for entry in refused[shown:])
    if rest:
        lines.append(f"refused {_connections(rest, 'more ')} from other addresses")
    return lines


def _connections(count: int, more: str = "") -> str:
    return f"{count} {more}broadcast connection{'' if count == 1 else 's'}"


def table(report: FleetReport, problems_per_node: int = 5) -> list[str]:
    """The per-node table, each node's first problems, and a closing count. A mirror shows where
    each node's bytes came from instead of one byte count, and names bad senders, fallbacks to
    the NAS and refused connections below the table."""
    mirror = report.command == "mirror"
    head = ("transport", "from NAS", "from peers") if mirror else ("bytes",)
    rows = [("node", "status", *head, "seconds", "problems", "detail")]
    for run in report.runs:
        detail = run.error or (f"from {run.source}" if run.source else "")
        if mirror:
            got = run.delivery
            moved = (got.transport, format_size(got.nas_bytes), format_size(got.peer_bytes)) if got else ("-",) * 3
        else:
            moved = ("-" if run.bytes is None else format_size(run.bytes),)
        rows.append((run.node, run.status, *moved, "-" if run.seconds is None else f"{run.seconds:.1f}",
                     "-" if run.problems is None else str(run.problems), detail))
    columns = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(columns)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    for run in report.runs:
        for problem in ((run.report or {}).get("problems") or [])[:problems_per_node]:
            if isinstance(problem, dict):
                lines.append(f"  {run.node}: {problem.get('kind')} {problem.get('path')}: {problem.get('detail')}")
        got = run.delivery
        if got is None:
            continue
        if got.moved_to_tail:
            lines.append(f"  {run.node}: fell behind its upstream and was moved to the tail of the chain")
        if got.bad_senders:
            lines.append(f"  {run.node}: refused chunks that failed the run's key from {', '.join(got.bad_senders)}"
                         " and fetched them again")
        for fallback in got.fallbacks[:problems_per_node]:
            lines.append(f"  {run.node}: fell back to the NAS for {fallback.get('path') or 'every shared file'}: "
                         f"{fallback.get('why')}")
        lines.extend(f"  {run.node}: {line}" for line in _refused_lines(got.refused, problems_per_node))
    counts: dict[str, int] = {}
    for run in report.runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    copied = report.copied_from
    if copied:
        summary += "; copied " + ", ".join(f"{format_size(n)} from {src}" for src, n in copied.items())
    if mirror:
        summary += f"; {format_size(report.nas_bytes or 0)} read from the NAS ({report.transport})"
    if report.choice is not None:
        lines.extend(report.choice.lines())
    if report.cluster_auth != "token":
        lines.append(f"warning: the Ray cluster's authentication is {report.cluster_auth} ({ALLOW_OPEN})")
    lines.append(f"fleet {report.command}: {summary} in {report.seconds:.1f}s (exit {report.exit_code})")
    return lines
