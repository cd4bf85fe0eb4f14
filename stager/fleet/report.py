"""What a fleet run found: one NodeRun per node, the FleetReport around them, and the table; and
a node's Progress as its part goes.

The table is the result, for stdout: one row per node with the columns of that command's own
node-local line (`stage mirror`: where from, files and bytes copied; `stage verify`: mode, what
against, ok of checked; `stage audit`: free, needed, reclaimable, its state; `stage prune`: what
it removed or would remove, the bytes, what is in use), each node's first problems under it, and
one closing count. What is not the result (a warning about the cluster) is `notes`, for stderr.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from stager.base.errors import EXIT_CANNOT_RUN, EXIT_OK
from stager.base.text import known_as, printable
from stager.base.units import format_size

if TYPE_CHECKING:
    from stager.fleet.choice import Choice

ALLOW_OPEN = "--allow-unauthenticated-cluster"
# What the node's "bytes" field holds for each command (verify moves no bytes; prune: bytes freed).
BYTES_KEY = {"mirror": "copied_bytes", "pack-engram": "packed_bytes", "audit": "needed_bytes", "prune": "freed_bytes"}
STATUS = {
    "audit": ("ok", "warning", "critical", "unknown"),  # Nagios, as `stage audit` exits
    "default": ("ok", "problems", "bad input", "cannot run"),
}
NAS = "NAS"  # how a row names the manifest's nas.hub


@dataclass(frozen=True)
class Progress:
    """A node's part as it goes: a broadcast node's from its agent, asked once a second (enough for
    the driver to tell a silent node from a slow one, and for the chain's laggard rule); a node
    running its node-local command from the byte counts that command writes (node.NodeCommand). For a live display
    per node. Bytes are data bytes the node has written and checked; a file counts once it has
    landed under its final name (the next run keeps it; a temp file it sweeps)."""

    # "plan", "broadcast" (its relay receives or serves), "mirror" (its closing mirror, or the
    # node-local mirror run as a task), "verify" (stage verify as a task), "done"
    phase: str
    done_bytes: int = 0
    total_bytes: int = 0  # of the shared files it has been handed so far
    landed_files: int = 0
    source: str | None = None  # where its next chunk comes from: "nas", a peer's name; None when not receiving
    session: int | None = None  # the broadcast session it receives, or last received
    chunks: int = 0  # chunks it holds of that session: the laggard rule counts whole chunks
    # Its own mirror (or verify) as it goes, in the bytes its progress bar counts: what it has
    # copied (hashed, checked) of what it found to copy (hash, check). `step` counts the bars the
    # command has started (a --full mirror hashes the node's files before it copies).
    copy_done: int = 0
    copy_total: int = 0
    step: int = 0
    # On the node's own clock (monotonic seconds): when these counts were read, and when the bytes
    # its phase counts (done_bytes while it receives, copy_done in its mirror) last grew; None
    # until they have. The live display takes a rate from the one to the other (live.py), and
    # they mean nothing off the node, so the JSON leaves them out.
    read_at: float = 0.0
    grew_at: float | None = None

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key not in ("read_at", "grew_at")}


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
    # Why the chain was reordered around it (None: it was not): it fell behind its upstream, went
    # silent while the node after it received little or nothing, was a head slower than the
    # links, or its relay died.
    moved_why: str | None = None
    # The CPU its relay's threads used (receive, check, write, serve), so that a relay's cost per
    # GB can be told apart from its node's process starts and walks; None without a relay.
    relay_cpu_seconds: float | None = None
    landed_files: int = 0  # files the broadcast landed (its own mirror's copies are in its report)
    sources: tuple[str, ...] = ()  # where its copied bytes came from: peers by name, NAS, another source

    @property
    def moved_to_tail(self) -> bool:
        return self.moved_why is not None

    def to_json(self) -> dict:
        return {"transport": self.transport, "peer_bytes": self.peer_bytes, "nas_bytes": self.nas_bytes,
                "sources": list(self.sources), "fallbacks": list(self.fallbacks),
                "bad_senders": list(self.bad_senders), "refused_connections": list(self.refused),
                "moved_to_tail": self.moved_to_tail, "moved_why": self.moved_why,
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
class Fallback:
    """Nodes that read from the NAS what their peers could have sent them, and why (no `address`
    in the manifest, their agent died, ...): said once on stderr as soon as their bytes are known,
    and in the JSON. `nas_bytes` is what they read from the NAS (or, said during the run, what
    their mirrors set out to copy); `extra_bytes` what that costs the NAS beyond one read of each
    byte: all of it for nodes whose peers get theirs elsewhere, all but the largest node's share
    when every node reads for itself (one read of the data is every transport's cost)."""

    nodes: tuple[str, ...]
    why: str
    nas_bytes: int | None = None
    extra_bytes: int | None = None

    def line(self) -> str:
        one = len(self.nodes) == 1
        cost = ("" if self.nas_bytes is None else
                f"; {format_size(self.nas_bytes)} from the NAS, {format_size(self.extra_bytes or 0)} more than one "
                "read of each byte")
        return (f"warning: {_names(self.nodes)} {'reads the NAS itself' if one else 'read the NAS themselves'}, not "
                f"{'its' if one else 'their'} peers: {self.why}{cost} (docs/fleet.md, \"Addresses and ports\")")

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "why": self.why, "nas_bytes": self.nas_bytes,
                "extra_bytes": self.extra_bytes}


def _names(nodes: tuple[str, ...]) -> str:
    return nodes[0] if len(nodes) == 1 else f"{', '.join(nodes[:-1])} and {nodes[-1]}"


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
    fallbacks: tuple[Fallback, ...] = ()  # mirror: nodes that read the NAS instead of their peers
    nas_hub: str | None = None  # the manifest's nas.hub: a row names it NAS

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
                "nas_fallback": [f.to_json() for f in self.fallbacks] if self.command == "mirror" else None,
                "choice": self.choice.to_json() if self.choice else None,
                "nodes": {run.node: {**run.to_json(), **row_fields(self.command, run)} for run in self.runs}}


def row_fields(command: str, run: NodeRun) -> dict:
    """A node's values in its row beyond NodeRun's own (its JSON carries them too): None where
    the node gave no report. The audit's free space is that of the node's tightest filesystem
    (the least left once staging and the reserve are counted), which sets its state."""
    report = run.report or {}
    if command == "mirror":
        landed = run.delivery.landed_files if run.delivery else 0
        return {"files": None if run.report is None and not landed else int(report.get("copied_files") or 0) + landed}
    if command == "verify":
        return {"mode": report.get("mode"), "against": report.get("verified_against"),
                "checked": report.get("checked"), "ok": report.get("ok")}
    if command == "audit":
        systems = [fs for fs in report.get("filesystems") or () if isinstance(fs, dict)]
        tightest = min(systems, key=lambda fs: fs.get("remaining_bytes", 0), default=None)
        return {"free_bytes": tightest.get("free_bytes") if tightest else None,
                "reclaimable_bytes": report.get("reclaimable_bytes"), "reason": report.get("reason")}
    if command == "prune":
        return {"dry_run": report.get("dry_run"),
                "removed": len(report["removed"]) if isinstance(report.get("removed"), list) else None,
                "in_use": len(report["in_use"]) if isinstance(report.get("in_use"), list) else None}
    return {}


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


def stalled(node: str, silent: float, last: Progress | None, command: str | None = None) -> NodeRun:
    """A node whose actor stopped answering (its processes stopped, its kernel hung): exit 3, as
    an unreachable node, with what it held at its last answer. Its hub is left as a killed run
    leaves it; its next run sweeps the temp files and keeps what landed. `command`: the node-local
    command its NodeCommand ran; None for a broadcast agent."""
    who = f"its stage {command}" if command else "its agent"
    if last is None:
        why = f"{who} never answered ({silent:.0f}s)"
    elif command:
        why = (f"{who} answered nothing for {silent:.0f}s; {format_size(last.copy_done)} of "
               f"{format_size(last.copy_total)} done ({last.phase})")
    else:
        held = f"{last.landed_files} files landed, {format_size(last.done_bytes)}"
        why = (f"its agent answered nothing for {silent:.0f}s during its {last.phase}; {held} of "
               f"{format_size(last.total_bytes)} received")
    return NodeRun(node, EXIT_CANNOT_RUN, "stalled", error=why, progress=last)


# ---- the table ------------------------------------------------------------------------------------


def _size(n) -> str:
    return "-" if n is None else format_size(int(n))


def _count(n) -> str:
    return "-" if n is None else str(n)


def _place(url: str | None, nas_hub: str | None) -> str:
    return "-" if not url else NAS if url == nas_hub else printable(url)


def _columns(report: FleetReport) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The command's own columns (between status and seconds) and each node's cells in them."""
    command = report.command
    fields = {run.node: row_fields(command, run) for run in report.runs}
    if command == "mirror":
        head = ("transport", "from", "files", "copied", "from NAS", "from peers")
        cells = []
        for run in report.runs:
            got = run.delivery
            if got is None:
                cells.append(("-", "-", _count(fields[run.node]["files"]), "-", "-", "-"))
                continue
            cells.append((got.transport, "+".join(got.sources) or "-", _count(fields[run.node]["files"]),
                          _size(got.nas_bytes + got.peer_bytes), _size(got.nas_bytes), _size(got.peer_bytes)))
        return head, cells
    if command == "verify":
        return ("mode", "against", "ok"), [
            (fields[run.node]["mode"] or "-", _place(fields[run.node]["against"], report.nas_hub),
             "-" if fields[run.node]["checked"] is None else f"{fields[run.node]['ok']}/{fields[run.node]['checked']}")
            for run in report.runs]
    if command == "audit":
        return ("free", "needed", "reclaimable"), [
            (_size(fields[run.node]["free_bytes"]), _size(run.bytes), _size(fields[run.node]["reclaimable_bytes"]))
            for run in report.runs]
    if command == "prune":
        dry = any(run.report and run.report.get("dry_run") for run in report.runs)
        return ("would remove" if dry else "removed", "bytes", "in use"), [
            (_count(fields[run.node]["removed"]), _size(run.bytes), _count(fields[run.node]["in_use"]))
            for run in report.runs]
    return ("bytes",), [(_size(run.bytes),) for run in report.runs]


def _detail(command: str, run: NodeRun) -> str:
    if run.error:
        return printable(run.error)
    report = run.report or {}
    if command == "audit" and report.get("reason"):
        return printable(str(report["reason"]))
    if command == "prune" and report.get("target_met") is False:
        return f"--until-free {report.get('until_free')} cannot be met without removing what is in use or wanted"
    return ""


def table(report: FleetReport, problems_per_node: int = 5, verbose: bool = False) -> list[str]:
    """The result: one row per node, each node's first problems, and a closing count. A mirror
    also names bad senders, fallbacks to the NAS and refused connections below the table;
    `verbose`, a prune lists every path each node removed (or would remove) and each item in use."""
    mirror = report.command == "mirror"
    head, cells = _columns(report)
    rows = [("node", "status", *head, "seconds", "problems", "detail")]
    for run, own in zip(report.runs, cells):
        rows.append((run.node, run.status, *own, "-" if run.seconds is None else f"{run.seconds:.1f}",
                     _count(run.problems), _detail(report.command, run)))
    columns = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(columns)]
    lines = [("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]).rstrip()
             for row in rows]
    for run in report.runs:
        for problem in ((run.report or {}).get("problems") or [])[:problems_per_node]:
            if isinstance(problem, dict):
                lines.append(f"  {run.node}: {_problem(problem)}")
        if verbose and report.command == "prune":
            lines.extend(f"  {run.node}: {line}" for line in _prune_paths(run.report or {}))
        got = run.delivery
        if got is None:
            continue
        if got.moved_to_tail:
            lines.append(f"  {run.node}: {got.moved_why}; it was moved to the tail of the chain")
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
        summary += "; copied " + ", ".join(f"{format_size(n)} from {_place(src, report.nas_hub)}"
                                           for src, n in copied.items())
    if mirror:
        summary += f"; {format_size(report.nas_bytes or 0)} read from the NAS ({report.transport})"
    if report.choice is not None:
        lines.extend(report.choice.lines())
    lines.append(f"fleet {report.command}: {summary} in {report.seconds:.1f}s (exit {report.exit_code})")
    return lines


def notes(report: FleetReport) -> list[str]:
    """What the operator should know beside the result, for stderr: the cluster's authentication
    when it is not a token's."""
    if report.cluster_auth != "token":
        return [f"warning: the Ray cluster's authentication is {report.cluster_auth} ({ALLOW_OPEN})"]
    return []


def _problem(problem: dict) -> str:
    """A node's problem as `stage <command>` names it: a snapshot file by the names people know
    it by, its path at the end."""
    kind, detail, path = problem.get("kind"), problem.get("detail"), problem.get("path")
    if problem.get("name"):
        return printable(f"{kind} {known_as(problem['name'], problem.get('blob'))}: {detail} ({path})")
    return printable(f"{kind} {path}: {detail}")


def _prune_paths(report: dict) -> list[str]:
    """-v: each item a node's prune removed (or would remove), with every further path it takes
    along, and each item kept because it is in use, with its first holder."""
    verb = "would remove" if report.get("dry_run") else "removed"
    lines = []
    for item in report.get("removed") or ():
        lines.append(printable(f"{verb} {item.get('kind')} {_size(item.get('bytes'))} {item.get('path')}"))
        lines.extend(printable(f"    + {path}") for path in item.get("paths") or () if path != item.get("path"))
    for busy in report.get("in_use") or ():
        holder = f"pid {busy['pid']} ({busy.get('command')})" if busy.get("pid") is not None else "this namespace"
        lines.append(printable(f"in use {busy.get('kind')} {_size(busy.get('bytes'))} {busy.get('path')}: "
                               f"{busy.get('how')}, {holder}"))
    return lines


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
