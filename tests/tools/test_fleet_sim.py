"""scripts/lab/fleet_sim.py: the model of direct reads, the SFTP tree and the pipelined broadcast,
checked against the lab's own measurements (docs/results/fleet-lab-measurements.json, written by
scripts/lab/fleet_bench.py) and against what each transport must do as N, stragglers and failures
change."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fleet_sim import GB, Cluster, Overheads, chain_rate, check, fit, predict, simulate

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "docs" / "results" / "fleet-lab-measurements.json"
MiB = 1024 * 1024
LAB = dict(size=256 * MiB, files=6, link=25e6, nas=25e6)  # 200 Mbit/s, as the lab was measured


# The points the model misses by more than 15 %, and why (docs/fleet-lab.md, "The simulator"):
# - the tree at N = 4 (measured 88-98 s, model 77 s): its transfers' CPU per GB grows with how
#   many run at once on the lab's two shared cores (17 s at N = 1, 24 s at N = 4), which the
#   model holds constant;
# - the plain chain at 512 MiB, N >= 2 (33-34 s, model 24-27 s): the bench's baseline writes
#   through the page cache, and with two or more nodes writing 512 MiB each the writeback
#   throttles it (a step of 10 s from N = 1 to 2, then flat), which the model does not know.
KNOWN_OFF = {
    "fleet-lab-measurements.json": {("sftp", 4): 0.20},
    "fleet-lab-latest.json": {("chain", 2): 0.30, ("chain", 4): 0.25, ("chain", 8): 0.25},
    "fleet-lab-gcm.json": {("chain", 2): 0.25, ("chain", 4): 0.35, ("chain", 8): 0.35},
    "fleet-lab-4mib.json": {("chain", 2): 0.35, ("chain", 4): 0.35, ("chain", 8): 0.35},
    "fleet-lab-compare.json": {},
    "fleet-lab-1mib.json": {("chain", 4): 0.35, ("chain", 8): 0.35},
}
# What each file measured: the transports and node counts the check must cover.
COVERS = {"fleet-lab-measurements.json": {"nas", "sftp", "chain"}, "fleet-lab-latest.json": {"nas", "broadcast", "chain"},
          "fleet-lab-gcm.json": {"broadcast", "chain"}, "fleet-lab-4mib.json": {"broadcast", "chain"},
          "fleet-lab-compare.json": {"nas", "sftp", "broadcast"},
          "fleet-lab-1mib.json": {"nas", "sftp", "broadcast", "chain"}}


@pytest.mark.parametrize("name", sorted(KNOWN_OFF))
def test_the_model_reproduces_the_labs_times_within_15_percent(name):
    """Fitted on the N = 1 and 2 runs; every transport at every N <= 8 the lab measured: the
    256 MiB runs of direct reads, the tree and the plain chain, and the 512 MiB runs of the
    broadcast beside direct reads and the plain chain."""
    results = json.loads((REPO / "docs" / "results" / name).read_text())
    rows = check(results)
    assert {row["transport"] for row in rows} >= COVERS[name]
    assert {row["n"] for row in rows} >= {1, 2, 4, 8}
    off = [row for row in rows if abs(row["error"]) > KNOWN_OFF[name].get((row["transport"], row["n"]), 0.15)]
    assert not off, off


def test_the_check_command_exits_1_when_the_model_is_off(tmp_path):
    results = json.loads(MEASURED.read_text())
    for run in results["runs"]:
        if run["transport"] == "nas" and run["n"] == 8:
            run["seconds"] /= 2  # a lab whose NAS link was not shared would be twice as fast
    doctored = tmp_path / "doctored.json"
    doctored.write_text(json.dumps(results))
    script = REPO / "scripts" / "lab" / "fleet_sim.py"
    bad = subprocess.run([sys.executable, str(script), "check", str(doctored)], capture_output=True, text=True)
    assert bad.returncode == 1
    row = next(json.loads(line) for line in bad.stdout.splitlines() if '"nas", "n": 8' in line)
    assert row["within"] is False and row["error"] > 0.5


def test_direct_grows_with_n_and_the_broadcast_does_not():
    over = Overheads(startup={t: 0.0 for t in ("nas", "sftp", "broadcast", "chain")}, transfer_overhead=0.0,
                     sample_per_file=0.0)
    one, eight = Cluster(n=1, **LAB), Cluster(n=8, **LAB)
    assert simulate("nas", eight, over).seconds == pytest.approx(8 * simulate("nas", one, over).seconds, rel=0.01)
    assert simulate("sftp", eight, over).seconds == pytest.approx(4 * simulate("sftp", one, over).seconds, rel=0.01)
    flat = simulate("broadcast", eight, over).seconds / simulate("broadcast", one, over).seconds
    assert flat == pytest.approx(1 + 7 * 8 * MiB / LAB["size"], rel=0.01)  # seven more hops of one chunk
    assert simulate("broadcast", eight, over).nas_bytes == LAB["size"]


def test_a_straggler_holds_no_one_back_and_a_dead_node_costs_those_behind_it_the_detection():
    over = Overheads()
    clean = simulate("broadcast", Cluster(n=8, **LAB), over)
    slow = simulate("broadcast", Cluster(n=8, stragglers=((3, LAB["link"] / 4),), **LAB), over)
    others = [t for i, t in enumerate(slow.per_node) if i != 3]
    assert max(others) <= 1.01 * clean.seconds and slow.per_node[3] >= 4 * LAB["size"] / LAB["link"]
    dead = simulate("broadcast", Cluster(n=8, killed=(3, 0.5), **LAB), over)
    assert len(dead.per_node) == 7 and dead.seconds == pytest.approx(clean.seconds + over.detect, abs=0.5)


def test_the_relay_cpu_becomes_the_limit_on_fast_links():
    """3 CPU s per GB on one core moves 0.33 GB/s: below a 25 GbE link (3.1 GB/s)."""
    cluster = Cluster(n=64, size=700 * GB, files=160, link=25e9 / 8, nas=10 * GB, cpu_per_gb=3.0)
    assert simulate("broadcast", cluster).limit == "relay CPU"
    assert simulate("broadcast", Cluster(n=64, size=700 * GB, files=160, link=25e9 / 8, nas=10 * GB,
                                         cpu_per_gb=3.0, relay_cores=16)).limit == "link"


def test_fit_uses_only_the_runs_of_one_and_two_nodes():
    results = json.loads(MEASURED.read_text())
    fitted = fit(results)
    for run in results["runs"]:
        if run["n"] > 2:
            run["seconds"] *= 3
    assert fit(results) == fitted


def test_k_streams_move_k_times_one_up_to_the_nodes_cores():
    """A relay of K streams at 0.8 CPU s per GB each: K / 0.8 GB/s, never more cores than the node has."""
    fast = dict(n=8, size=700 * GB, files=160, link=400e9 / 8, nas=10 * GB, cpu_per_gb=0.8)
    rates = [chain_rate(Cluster(relay_cores=k, **fast), list(range(8)))[0] for k in (1, 2, 4)]
    assert rates == pytest.approx([1.25 * GB, 2.5 * GB, 5 * GB])
    assert chain_rate(Cluster(relay_cores=16, node_cores=4, **fast), list(range(8)))[0] == pytest.approx(5 * GB)


GRID = [(n, link, nas) for n in (2, 8, 64, 1024) for link in (25, 100, 400) for nas in (1, 3, 10)]


def test_the_chosen_transport_is_never_above_direct_reads_nor_the_broadcast():
    rows = predict([2, 8, 64, 1024], [25, 100, 400], [1, 3, 10], 700 * GB, 160, 0.8, None, Overheads(), node_cores=64)
    assert len(rows) == len(GRID)
    for row in rows:
        assert row["chosen"] <= min(row["direct"], row["broadcast"]) + 0.1, row
        assert row["chosen_transport"] == ("nas" if row["direct"] < row["broadcast"] else "broadcast"), row
    # A NAS faster than the links flips the choice to direct reads (2 nodes on 25 GbE, 10 GB/s).
    flipped = next(r for r in rows if (r["n"], r["link_gbe"], r["nas_gbps"]) == (2, 25, 10))
    assert flipped["chosen_transport"] == "nas"


def test_with_the_cores_for_it_the_chosen_transport_runs_at_90_percent_of_nas_link_and_disk():
    """K chosen for the bound (at most the node's 64 cores): every row at >= 90 % of
    min(NAS, link, disk), N up to 1,024; the cores it keeps busy are the rate times 0.8 s/GB."""
    rows = predict([2, 8, 64, 1024], [25, 100, 400], [1, 3, 10], 700 * GB, 160, 0.8, None,
                   replace(Overheads(), startup={t: 0.0 for t in ("nas", "sftp", "broadcast", "chain")}),
                   node_cores=64, disk=6 * GB)
    for row in rows:
        assert row["of_bound"] >= 0.9, row
        bound = min(row["nas_gbps"], row["link_gbe"] / 8, 6)
        if row["chosen_transport"] == "broadcast":
            assert row["chosen_cores"] == pytest.approx(0.8 * bound * row["of_bound"], rel=0.05), row
