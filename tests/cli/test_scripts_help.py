"""Every script under scripts/ answers `--help` with its usage, and does nothing else: no
"==SUPPRESS==" where argparse was asked to hide a subcommand (fleet_lab.py's reap, fleet_bench.py's
chain halves), and nothing written (make_demo_nas.py once built a demo in a directory named --help)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "scripts").rglob("*.py"))


def test_every_script_is_listed():
    assert {p.name for p in SCRIPTS} >= {"hubgen.py", "make_demo_nas.py", "bench.py", "fleet_bench.py", "fleet_lab.py",
                                          "fleet_sim.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_help_is_usage_and_nothing_else(script, tmp_path):
    for flag in ("--help", "-h"):
        result = subprocess.run([sys.executable, str(script), flag], cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: "), result.stdout
        assert "SUPPRESS" not in result.stdout, result.stdout
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
