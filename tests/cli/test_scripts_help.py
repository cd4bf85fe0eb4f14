"""Every script under scripts/ answers `--help` with its usage, and does nothing else: no
"==SUPPRESS==" where argparse was asked to hide a subcommand (fleet_lab.py's reap, fleet_bench.py's
chain halves), and nothing written (make_demo_nas.py once built a demo in a directory named --help)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "scripts").rglob("*.py"))


def test_help_is_usage_and_nothing_else(tmp_path):
    assert {p.name for p in SCRIPTS} >= {"hubgen.py", "make_demo_nas.py", "bench.py", "fleet_bench.py", "fleet_lab.py",
                                          "fleet_sim.py"}
    wrong = {}
    for script in SCRIPTS:
        for flag in ("--help", "-h"):
            where = tmp_path / f"{script.stem}{flag}"
            where.mkdir()
            result = subprocess.run([sys.executable, str(script), flag], cwd=where, capture_output=True, text=True,
                                    timeout=120)
            left = sorted(p.name for p in where.iterdir())
            if result.returncode or not result.stdout.startswith("usage: ") or "SUPPRESS" in result.stdout or left:
                wrong[f"{script.relative_to(REPO)} {flag}"] = (result.returncode, result.stdout[-300:],
                                                               result.stderr[-300:], left)
    assert not wrong, wrong
