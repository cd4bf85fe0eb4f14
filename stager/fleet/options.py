"""What `stage fleet` is told, checked once on the driver before any node is asked anything, so that
a typo is one exit 2 rather than one per node: the transport, the relays' ports, and the options
each node's command takes from the fleet command's."""

from __future__ import annotations

from dataclasses import dataclass

from stager.base.errors import BadInput
from stager.manifest import Manifest

TRANSPORTS = ("broadcast", "sftp", "nas")


@dataclass(frozen=True)
class PruneOptions:
    """`stage fleet prune`'s options for each node's `stage prune`."""

    dry_run: bool = False
    until_free: str | None = None
    only: tuple[str, ...] = ()


def choose_transport(manifest: Manifest, command: str, names: list[str], fan_out: bool,
                     transport: str | None) -> str | None:
    """The transport a mirror uses (None for the other commands). --fan-out is --transport sftp.
    By default the broadcast, when two or more of the nodes have an address to take it on; else
    every node reads its own source."""
    option = "--fan-out" if fan_out else "--transport"
    if (fan_out or transport) and command != "mirror":
        raise BadInput(f"{option} applies to `stage fleet mirror` only, not {command}")
    if fan_out and transport not in (None, "sftp"):
        raise BadInput(f"--fan-out is --transport sftp; it cannot be combined with --transport {transport}")
    if transport is not None and transport not in TRANSPORTS:
        raise BadInput(f"--transport expects one of {', '.join(TRANSPORTS)}, got {transport!r}")
    chosen = "sftp" if fan_out else transport
    addressed = [name for name in names if manifest.nodes[name].address]
    if chosen == "sftp" and not addressed:
        raise BadInput(f"{manifest.path}: {option} needs nodes.<name>.address = \"[user@]host[:port]\" "
                       f"on the nodes that serve their peers")
    if chosen == "broadcast" and len(addressed) < 2:
        raise BadInput(f"{manifest.path}: --transport broadcast needs nodes.<name>.address = \"[user@]host[:port]\" "
                       f"on at least two of the nodes (the broadcast listens on its host)")
    if command != "mirror":
        return None
    return chosen or ("broadcast" if len(addressed) >= 2 else "nas")


@dataclass(frozen=True)
class BroadcastOptions:
    """What the broadcast's agents are told, checked once on the driver: the ports their relays may
    listen on, their streams per hop, --full, and --bwlimit in bytes per second (agent.NodeAgent)."""

    ports: tuple[int, int] | None = None
    streams: int | None = None
    full: bool = False
    bwlimit: int | None = None


def broadcast_options(transport: str | None, ports: str | None, streams: int | None, full: bool,
                      bwlimit: str | None) -> BroadcastOptions:
    """--ports and --streams apply to the broadcast only; --full and --bwlimit to every mirror
    (mirror_options, verify_options), the broadcast's agents included."""
    port_range = parse_ports(ports)
    if port_range and transport != "broadcast":
        raise BadInput("--ports applies to the broadcast transport only (stage fleet mirror)")
    if streams is not None and transport != "broadcast":
        raise BadInput("--streams applies to the broadcast transport only (stage fleet mirror)")
    from stager.base.units import parse_rate

    return BroadcastOptions(port_range, streams, full, parse_rate(bwlimit) if bwlimit is not None else None)


def parse_ports(ports: str | None) -> tuple[int, int] | None:
    """--ports LOW-HIGH: the TCP ports a relay may listen on (the first free one is taken)."""
    if ports is None:
        return None
    low, _, high = ports.partition("-")
    try:
        chosen = (int(low), int(high or low))
    except ValueError:
        chosen = (0, -1)
    if not 1 <= chosen[0] <= chosen[1] <= 65535:
        raise BadInput(f"--ports expects LOW-HIGH such as 41000-41099, got {ports!r}")
    return chosen


def mirror_options(command: str, bwlimit: str | None) -> tuple[str, ...]:
    """`--bwlimit RATE` for each node's `stage mirror`: each node reads at most RATE from its
    sources. A broadcast node's agent takes the same option (BroadcastOptions): RATE for
    what it reads from the NAS, and RATE for what its relay sends its peers."""
    if bwlimit is None:
        return ()
    if command != "mirror":
        raise BadInput(f"--bwlimit applies to `stage fleet mirror` only, not {command}")
    return "--bwlimit", bwlimit


def verify_options(command: str, full: bool, subset: str | None) -> tuple[str, ...]:
    """`--full` and `--subset N/T` for each node's `stage verify`, checked once here so a typo is
    one exit 2 rather than one per node; and `--full` for each node's `stage mirror` (every byte
    checked against its content name; the broadcast's agents are told it in BroadcastOptions)."""
    if not full and subset is None:
        return ()
    if command == "mirror" and subset is None:
        return ("--full",)
    if command != "verify":
        raise BadInput(f"--full and --subset apply to `stage fleet verify` only, not {command}")
    from stager.mirror.verify import Subset

    try:
        chosen = Subset.parse(subset) if subset is not None else None
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return (("--full",) if full else ()) + (("--subset", subset) if chosen else ())


def prune_options(command: str, prune: PruneOptions) -> tuple[str, ...]:
    """`--dry-run`, `--until-free` and `--only` for each node's `stage prune`, checked once here."""
    if prune == PruneOptions():
        return ()
    if command != "prune":
        raise BadInput(f"--dry-run, --until-free and --only apply to `stage fleet prune` only, not {command}")
    from stager.housekeeping.prune import check_kinds, parse_until_free

    parse_until_free(prune.until_free)
    check_kinds(prune.only)
    return ((("--dry-run",) if prune.dry_run else ())
            + (("--until-free", prune.until_free) if prune.until_free is not None else ())
            + tuple(option for kind in prune.only for option in ("--only", kind)))
