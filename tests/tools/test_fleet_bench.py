"""scripts/lab/fleet_bench.py's summary of the lab's runs, on the runs of a real results file
(docs/results/fleet-lab-1mib.json): medians, ratios and the one-stream baseline."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fleet_bench import markdown, summarize

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "fleet-lab-1mib.json"


def test_the_summary_is_medians_over_the_runs_and_ratios_to_one_node_and_to_one_stream():
    results = json.loads(RESULTS.read_text())
    summary = summarize(results)
    assert summary == results["summary"]  # the file holds the summary of its own runs
    seconds = {(run["transport"], run["n"]): [] for run in results["runs"] if not run.get("killed")}
    for run in results["runs"]:
        if not run.get("killed"):
            seconds[(run["transport"], run["n"])].append(run["seconds"])
    stream = summary["stream"]["1"]["seconds"]
    assert stream == round(statistics.median(seconds[("stream", 1)]), 2)
    for (transport, n), values in seconds.items():
        entry = summary[transport][str(n)]
        assert entry["runs"] == len(values) == 3
        assert entry["seconds"] == round(statistics.median(values), 2)
        assert entry["t_over_stream"] == round(entry["seconds"] / stream, 3)
        assert entry["t_over_t1"] == round(entry["seconds"] / summary[transport]["1"]["seconds"], 3)
    assert "stream" not in {key for key, by_n in summary.items() if set(by_n) != {"1"}}  # one node only
    killed = summary["broadcast (one node killed)"]["8"]
    assert killed["runs"] == 3 and set(killed) >= {"seconds", "t_over_stream"} and "survivor_seconds" not in killed
    table = markdown(results).splitlines()
    # Every column says what it holds: T and T / (S/R) per transport; the costs by name.
    assert table[0] == ("| nodes N | " + " | ".join(f"{key}: T (T / (S/R))" for key in (
        "broadcast", "chain", "stream", "nas", "sftp", "broadcast (one node killed)")) + " |")
    assert table[2].startswith("| 1 | 25.1 s (1.17) | 22.6 s (1.05) | 22.8 s (1.06) |")
    costs = table[table.index("") + 1:]
    assert costs[0] == ("| transport (lowest-highest over N) | NAS bytes sent / S | CPU per GB received, per node "
                        "| a relay's own CPU per GB received |")
    assert costs[2] == "| broadcast | 1.02-1.03 | 2.2 s-4.1 s | 0.89 s-1.01 s |"
    # A results file saved before summaries were: summarized when printed.
    del results["summary"]
    assert markdown(results).splitlines() == table
