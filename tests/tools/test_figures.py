"""The docs' figures are drawn from the committed results: regenerating them changes no byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "docs" / "figures"


def test_every_figure_is_regenerated_from_the_committed_results_without_differences(tmp_path):
    drawn = subprocess.run([sys.executable, str(REPO / "scripts" / "lab" / "figures.py"), "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stderr
    fresh = sorted(p.name for p in tmp_path.glob("*.svg"))
    assert fresh == sorted(p.name for p in FIGURES.glob("*.svg")), "a figure is drawn but not committed, or the reverse"
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (FIGURES / name).read_bytes(), \
            f"docs/figures/{name} is stale: run python scripts/lab/figures.py"


def test_every_figure_is_shown_in_the_docs():
    docs = "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    for svg in FIGURES.glob("*.svg"):
        assert f"figures/{svg.name}" in docs, f"docs/figures/{svg.name} is in no page"
