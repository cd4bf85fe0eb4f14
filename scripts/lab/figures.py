#!/usr/bin/env python3
"""Draw the docs' figures from the raw results in docs/results/, as SVG files in docs/figures/.

    python scripts/lab/figures.py              # rewrite docs/figures/*.svg
    python scripts/lab/figures.py --out DIR    # write them elsewhere (the test compares the two)

The output is byte-for-byte reproducible from the committed results: no dates, fixed element ids, and
a pinned matplotlib (the `figures` extra), so a figure that no longer matches its data fails a test
instead of going stale. matplotlib is needed here only, never by `stage` itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_sim  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
FIGURES = REPO / "docs" / "figures"
LAB = "fleet-lab-1mib.json"  # the latest lab rounds: 512 MiB, 200 Mbit/s, N = 1-8
BENCH = "bench-results.json"
TRANSPORT_NAMES = {"broadcast": "broadcast", "chain": "plain chain (no checks)", "nas": "direct NAS reads",
                   "sftp": "SFTP peer tree", "stream": "one SSH stream"}
SIM_NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _pyplot():
    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams.update({"svg.hashsalt": "stager", "svg.fonttype": "path", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Write without a date or a creator line, so that the same data gives the same bytes."""
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return path


def lab_time_against_n(plt, out: Path) -> Path:
    """Left: the lab's medians, each transport against N. Right: the simulator at cluster scale, as
    docs/fleet-lab.md's table runs it (`fleet_sim.py predict --size 700GB --files 160 --cpu-per-gb 2.5`),
    to N = 1,024 at 25 GbE with a 1 GB/s NAS."""
    results = json.loads((RESULTS / LAB).read_text())
    fig, (lab, sim) = plt.subplots(1, 2, figsize=(9, 3.6))
    for transport, by_n in results["summary"].items():
        ns = sorted(int(n) for n in by_n)
        lab.plot(ns, [by_n[str(n)]["seconds"] for n in ns], marker="o", label=TRANSPORT_NAMES.get(transport, transport))
    lab.set(xlabel="nodes", ylabel="seconds (median of 3)", title="Lab: 512 MiB over 200 Mbit/s links", xscale="log",
            xticks=[1, 2, 4, 8], xticklabels=["1", "2", "4", "8"])
    lab.minorticks_off()
    lab.legend(fontsize=7)
    rows = fleet_sim.predict(SIM_NODES, [25.0], [1.0], 700e9, 160, 2.5, 1.0, fleet_sim.Overheads())
    for column, name in (("direct", "direct NAS reads"), ("sftp", "SFTP peer tree"),
                         ("broadcast", "broadcast, Python relay"), ("native", "broadcast, relay costs no CPU")):
        sim.plot([r["n"] for r in rows], [r[column] for r in rows], marker=".", label=name)
    sim.set(xlabel="nodes", ylabel="seconds", title="Simulator: 700 GB, 25 GbE, 1 GB/s NAS", xscale="log",
            yscale="log")
    sim.legend(fontsize=7)
    return _save(plt, fig, out / "fleet-time-vs-n.svg")


def lab_cpu_per_gb(plt, out: Path) -> Path:
    """CPU seconds per GB a node spends, per transport and N, from the same lab rounds."""
    summary = json.loads((RESULTS / LAB).read_text())["summary"]
    transports = [t for t in summary if any(v.get("cpu_s_per_gb") is not None for v in summary[t].values())]
    ns = sorted({int(n) for t in transports for n in summary[t]})
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(transports)
    for i, transport in enumerate(transports):
        values = [summary[transport].get(str(n), {}).get("cpu_s_per_gb") or 0.0 for n in ns]
        ax.bar([k + i * width for k in range(len(ns))], values, width, label=TRANSPORT_NAMES.get(transport, transport))
    ax.set_xticks([k + width * (len(transports) - 1) / 2 for k in range(len(ns))], [f"N = {n}" for n in ns])
    ax.set(ylabel="CPU s per GB per node", title="Lab: CPU per GB staged")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "fleet-cpu-per-gb.svg")


def bench_ratios(plt, out: Path) -> Path:
    """Each workload's median wall time of every command, over its baseline's (cp for the copies)."""
    bench = json.loads((RESULTS / BENCH).read_text())
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels, positions, offset = [], [], 0.0
    for workload in bench["workloads"]:
        results = workload["results"]
        base = results[workload["baseline"]]["wall_s"]["median"]
        for command, result in results.items():
            ax.barh(offset, result["wall_s"]["median"] / base, color="C0" if result.get("ours") else "C7")
            labels.append(f"{workload['title']}: {command}")
            positions.append(offset)
            offset += 1
        offset += 0.5  # a gap between workloads
    ax.set_yticks(positions, labels, fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set(xlabel="wall time over the workload's baseline (medians of 5, same rounds; stager in blue)",
           title="Bench: stager beside cp, rsync and rclone")
    return _save(plt, fig, out / "bench-ratios.svg")


def draw(out: Path) -> list[Path]:
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    return [lab_time_against_n(plt, out), lab_cpu_per_gb(plt, out), bench_ratios(plt, out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURES, help="where the SVG files go (default: docs/figures)")
    args = parser.parse_args(argv)
    for path in draw(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
