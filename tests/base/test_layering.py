"""The packages of stager/ form layers, and every import points down (README, "Where the code lives").

Read from the source with `ast`, imports inside functions included: a lazy import that points up is
still a circle waiting to happen.
"""

from __future__ import annotations

import ast
from pathlib import Path

STAGER = Path(__file__).resolve().parents[2] / "stager"
# Lower layers first; a module may import from its own layer or any layer below it.
LAYERS = [{"base"}, {"sources", "manifest"}, {"mirror"}, {"engram"}, {"housekeeping"}, {"fleet"}, {"cli"}]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def room(module: str) -> str | None:
    """The top-level package (or module) of stager a dotted name lives in; None for stager itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "stager" else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "stager" else [f"stager.{a.name}" for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_every_room_is_a_known_layer():
    rooms = {p.stem if p.is_file() else p.name for p in STAGER.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith("__")}
    assert rooms == set(RANK), "a new package or module needs its place in LAYERS and in the README's map"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in STAGER.rglob("*.py"):
        here = room("stager." + ".".join(path.relative_to(STAGER).with_suffix("").parts))
        if here not in RANK:  # stager/__init__ and __main__ (`python -m stager`) stand above every layer
            continue
        for line, name in imports_of(path):
            there = room(name)
            if there is not None and there in RANK and RANK[there] > RANK[here]:
                upward.append(f"{path.relative_to(STAGER.parent)}:{line} imports {name}")
    assert not upward, "\n".join(upward)
