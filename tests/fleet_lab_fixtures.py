"""The namespace lab (scripts/lab/fleet_lab.py) as a pytest fixture, and what the lab tests measure:
the real `stage fleet` CLI driven against it, the NAS's bytes from its veth's counters and from
sftp-server's own log, and every staged byte checked by SHA-256 against the NAS's files.

CI runs it small (3 nodes, 100 Mbit/s, 48 MiB); STAGE_LAB_NODES, STAGE_LAB_RATE and STAGE_LAB_MIB
make it bigger."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import sha256_file
from fleet_lab import Lab, LabConfig, LinkCounters, leftovers

MiB = 1024 * 1024
LAB_NODES = int(os.environ.get("STAGE_LAB_NODES", "3"))
LAB_RATE = float(os.environ.get("STAGE_LAB_RATE", "100"))
LAB_MIB = int(os.environ.get("STAGE_LAB_MIB", "48"))
LAB_FILES = 6
# What each node's sampled checks may read back from the NAS per file, with the walk's metadata:
# measured on the lab as 2.0 MiB per 8 MiB shard per node for a direct mirror (docs/fleet-lab.md).
SAMPLE_BYTES_PER_FILE = 2 * MiB + 128 * 1024
# The wire around the SFTP payload: SSH framing, TCP/IP/Ethernet headers (measured: 1.3 %).
WIRE_OVERHEAD = 1.03
_CLOSE = re.compile(r'^close "(.*)" bytes read (\d+) written (\d+)$')


def lab_missing() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root"
    for tool in ("ip", "tc", "sshd", "ssh-keygen"):
        if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} is not installed"
    return None


@pytest.fixture(scope="module")
def lab():
    """A lab of LAB_NODES nodes at LAB_RATE Mbit/s with LAB_MIB MiB on its NAS, for the module.
    After it is removed, nothing of it may remain: no namespace, link, qdisc, process or file."""
    missing = lab_missing()
    if missing:
        pytest.skip(missing)
    with Lab(LabConfig(nodes=LAB_NODES, rate_mbit=LAB_RATE, size=LAB_MIB * MiB, files=LAB_FILES)) as running:
        run_id = running.run_id
        # The reference: the NAS's own files, hashed here, not what hubgen says it wrote.
        snapshot = running.nas_hub / running.snapshot_dir
        running.sha256 = {rel: sha256_file(snapshot / rel) for rel in running.sha256}
        yield running
    left = leftovers(run_id)
    assert not any(left.values()), f"lab {run_id} left behind {left}"


@dataclass
class FleetRun:
    code: int
    report: dict | None
    stderr: str
    seconds: float
    nas: LinkCounters  # what crossed the NAS's link during the run
    nas_read: int  # what sftp-server read from the NAS hub's files during the run

    @property
    def nas_sent(self) -> int:
        return self.nas.rx_bytes


def sftp_bytes_read(lab: Lab) -> int:
    total = 0
    prefix = str(lab.nas_hub) + "/"
    for line in lab.sftp_log.read_text().splitlines():
        match = _CLOSE.match(line)
        if match and match.group(1).startswith(prefix):
            total += int(match.group(2))
    return total


def fleet(lab: Lab, *args: str, manifest: Path | None = None, timeout: float = 240) -> FleetRun:
    """`stage fleet ARGS --json --manifest M` from the root namespace, as an operator runs it."""
    argv = [sys.executable, "-m", "stager", "fleet", *args, "--json", "--manifest", str(manifest or lab.manifest)]
    before, read_before, started = lab.counters(), sftp_bytes_read(lab), time.monotonic()
    proc = subprocess.run(argv, env=lab.driver_env(), capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - started
    assert "Traceback" not in proc.stderr, proc.stderr
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = None
    return FleetRun(proc.returncode, report, proc.stderr, seconds, lab.counters() - before,
                    sftp_bytes_read(lab) - read_before)


def mirror(lab: Lab, *args: str, nodes: list[str] | None = None, **kwargs) -> FleetRun:
    """A fleet mirror onto empty node hubs."""
    lab.wipe_hubs()
    selected = ("--nodes", ",".join(nodes)) if nodes else ()
    return fleet(lab, "mirror", *selected, *args, **kwargs)


def assert_every_byte_right(lab: Lab, nodes: list[str] | None = None) -> None:
    """Every file of the snapshot on every node has the NAS file's SHA-256, and `stage fleet
    verify --full` (every blob hashed against its content name) passes on every node."""
    nodes = nodes or list(lab.nodes)
    for node in nodes:
        assert lab.staged_digests(node) == lab.sha256, node
    verified = fleet(lab, "verify", "--full", "--nodes", ",".join(nodes))
    assert verified.code == 0, (verified.stderr, verified.report)
    for node in nodes:
        report = verified.report["nodes"][node]["report"]
        assert report["mode"] == "full" and report["problems"] == [] and report["ok"] == report["checked"] > 0, node


def sample_allowance(nodes: int) -> int:
    """What the nodes' closing sampled checks may read from the NAS, at most."""
    return nodes * (LAB_FILES + 1) * SAMPLE_BYTES_PER_FILE


def broadcast_sample_allowance(nodes: int) -> int:
    """What a broadcast's checks may read from the NAS, at most: the head's two samples of each
    shard (before its read, and fresh after), and each node's own copy of the small files. The
    other nodes check the shards against the head's keyed sample, in the landing check and in
    their closing mirror alike, and read no sample of them."""
    return LAB_FILES * SAMPLE_BYTES_PER_FILE + nodes * SAMPLE_BYTES_PER_FILE
