"""`stage fleet mirror` on the namespace lab (scripts/fleet_lab.py): real Ray nodes with token
auth in their own network namespaces, an sshd NAS in another, every link shaped with tc tbf.
Bytes are checked by SHA-256 against the NAS and by `stage fleet verify --full`; the NAS's bytes
are counted on its veth, not taken from the tool's report. And the lab leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_lab import MARK, NS_PREFIX, leftovers, present_runs, run
from fleet_lab_fixtures import (LAB_NODES, WIRE_OVERHEAD, assert_every_byte_right, lab, lab_missing,  # noqa: F401
                                mirror, sample_allowance)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fleet_lab.py"
pytestmark = pytest.mark.skipif(lab_missing() is not None, reason=lab_missing() or "")


# ---- today's transports: the baseline the broadcast is measured against ---------------------------

def test_direct_reads_share_the_nas_link_so_time_grows_with_n(lab):
    """Every node reads the NAS: the NAS's one shaped uplink carries N copies, so N nodes take
    about N times one node's time, and the NAS's veth counts N x S. (Shows the shaping is real.)"""
    data, nodes = lab.data_bytes, list(lab.nodes)
    one = mirror(lab, nodes=nodes[:1])
    assert one.code == 0, one.stderr
    assert_every_byte_right(lab, nodes[:1])
    every = mirror(lab)
    assert every.code == 0, every.stderr
    assert_every_byte_right(lab)
    link_seconds = data * 8 / (lab.config.rate_mbit * 1e6)
    assert one.seconds >= link_seconds, (one.seconds, link_seconds)
    assert every.seconds / one.seconds >= 0.6 * len(nodes), (every.seconds, one.seconds)
    assert len(nodes) * data <= every.nas_read <= every.nas_sent
    assert every.nas_sent <= WIRE_OVERHEAD * (len(nodes) * data + sample_allowance(lab, len(nodes)))
    assert every.report["copied_from"] == {lab.nas_url: len(nodes) * data}


def test_the_sftp_tree_reads_the_nas_once(lab):
    """--transport sftp (--fan-out): one node from the NAS, the others from staged peers' sshd in
    their namespaces; the NAS's veth carries S once plus each node's sampled check."""
    data, nodes = lab.data_bytes, list(lab.nodes)
    tree = mirror(lab, "--fan-out")
    assert tree.code == 0, tree.stderr
    assert_every_byte_right(lab)
    assert data <= tree.nas_sent <= WIRE_OVERHEAD * (data + sample_allowance(lab, len(nodes)))
    peers = {f"sftp://root@{m.address}{lab.staged_hub(m.name)}" for m in lab.nodes.values()}
    sources = {run["source"] for run in tree.report["nodes"].values()}
    assert lab.nas_url in sources and sources - {lab.nas_url} <= peers and len(sources) >= 2


# ---- the lab itself --------------------------------------------------------------------------------

def test_each_member_is_shaped_both_ways_and_sits_on_the_bridge_only(lab):
    for member in [lab.nas, *lab.nodes.values()]:
        outside = run(["tc", "qdisc", "show", "dev", member.host_link]).stdout
        inside = run(["tc", "-n", member.namespace, "qdisc", "show", "dev", "lab0"]).stdout
        for qdisc in (outside, inside):
            assert f"tbf" in qdisc and f"rate {int(member.rate_mbit)}Mbit" in qdisc, (member.name, qdisc)
        routes = run(["ip", "-n", member.namespace, "-4", "route", "show"]).stdout.strip().splitlines()
        assert len(routes) == 1 and routes[0].startswith("198.18.") and "default" not in routes[0], routes


def test_a_lab_up_killed_with_sigkill_leaves_nothing_behind(tmp_path):
    """kill -9 of `fleet_lab.py up`: its reaper sees the pipe close and removes the namespaces,
    links, qdiscs, processes and files of the run."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "up", "--nodes", "1", "--size", "2MiB", "--files", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the lab's description, once it is up
        assert line, proc.stderr.read()
        described = json.loads(line)
        run_id = described["run"]
        present = leftovers(run_id)
        assert present["namespaces"] and present["links"] and present["qdiscs"] and present["processes"]
        assert any(pid for pid in present["processes"])  # Ray's raylet, sshd, ...
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(leftovers(run_id).values()):
        time.sleep(0.5)
    assert not any(leftovers(run_id).values()), leftovers(run_id)


def test_down_sweeps_a_run_whose_owner_is_gone():
    """What a reaper could not remove (it was killed too): a namespace, a link on a bridge and a
    process marked with the run, and no record. `fleet_lab.py down` removes them; a live lab's
    run, with its owner alive, is kept."""
    run_id = "fe" + f"{os.getpid() % 256:02x}"
    namespace = f"{NS_PREFIX}{run_id}-dgx1"
    run(["ip", "netns", "add", namespace])
    sleeper = None
    try:
        run(["ip", "link", "add", f"sl{run_id}br", "type", "bridge"])
        run(["ip", "link", "add", f"sl{run_id}h1", "type", "veth", "peer", "name", "lab0", "netns", namespace])
        run(["tc", "qdisc", "add", "dev", f"sl{run_id}h1", "root", "tbf", "rate", "10mbit", "burst", "64k",
             "latency", "50ms"])
        sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "600"],
                                   env={**os.environ, MARK: run_id}, start_new_session=True)
        time.sleep(0.5)
        assert run_id in present_runs() and all(leftovers(run_id)[k] for k in ("namespaces", "links", "qdiscs"))
        swept = subprocess.run([sys.executable, str(SCRIPT), "down"], capture_output=True, text=True, timeout=60)
        assert swept.returncode == 0 and run_id in swept.stderr, swept.stderr
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not any(leftovers(run_id).values()), leftovers(run_id)
    finally:
        if sleeper and sleeper.poll() is None:
            sleeper.kill()
        run(["ip", "netns", "del", namespace], check=False)
        run(["ip", "link", "del", f"sl{run_id}br"], check=False)
