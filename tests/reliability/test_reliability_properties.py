"""Property tests: the link resolver over random trees of links, and the Engram row partition."""

from __future__ import annotations

import itertools
import os
import stat
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings, strategies as st

from stager.engram import partition
from stager.mirror.hub import LinkError, resolve_chain
from stager.sources.local import LocalSource

NAMES = ("a", "b", "c")
KINDS = {"escape", "dangling", "loop", "not_a_file"}

# ---------------------------------------------------------------- the link resolver

component = st.sampled_from(NAMES + ("..", "."))
rel_path = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)
relative_target = st.lists(component, min_size=1, max_size=5).map("/".join)
# Absolute targets: inside the root, or in the `outside` directory next to it.
absolute_target = st.tuples(st.sampled_from(("ROOT", "OUTSIDE")), st.lists(component, min_size=0, max_size=3))
node = st.tuples(rel_path, st.sampled_from(("file", "dir", "link", "link", "link")),
                 st.one_of(relative_target, absolute_target))


def build_tree(base: Path, nodes: list) -> tuple[Path, list[str]]:
    """Create the nodes under base/root whose parent is a real directory (the walk reaches entries
    only through real directories); the `outside` directory next to the root holds a file and a
    directory of every name."""
    base = Path(os.path.realpath(base))
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    for name in NAMES:
        (outside / name).mkdir()
        (outside / name / name).write_bytes(b"outside")
    made = []
    for path, kind, target in nodes:
        where = root / path
        if os.path.lexists(where) or not where.parent.is_dir() or os.path.realpath(where.parent) != str(where.parent):
            continue
        if kind == "file":
            where.write_bytes(path.encode())
        elif kind == "dir":
            where.mkdir()
        else:
            if isinstance(target, tuple):
                top, parts = target
                target = "/".join([str(root if top == "ROOT" else outside), *parts])
            os.symlink(target, where)
        made.append(path)
    return root, made


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node, min_size=1, max_size=14))
# Found by this test: a directory part that loops (ELOOP escaped the resolver as an OSError) ...
@example([("a", "link", "a/a")])
# ... and "b/.." collapsed lexically: the kernel reads a/c (b -> a/b, then ..), the resolver read c.
@example([("a", "dir", ""), ("a/b", "dir", ""), ("b", "link", "a/b"), ("c", "file", ""), ("a/c", "file", ""),
          ("a/a", "link", "../b/../c")])
def test_resolver_stays_inside_the_root_and_agrees_with_the_kernel(nodes):
    with tempfile.TemporaryDirectory() as base:
        root, made = build_tree(Path(base), nodes)
        real_root = os.path.realpath(root)
        source = LocalSource(str(root))
        for start in made:
            try:
                chain, final = resolve_chain(source, start)
            except LinkError as exc:
                assert exc.kind in KINDS, exc.kind
                continue
            assert chain[0] == start and final.kind == "file"
            for hop in chain:
                assert inside(os.path.realpath(root / os.path.dirname(hop)), real_root), (chain, hop)
            last = root / chain[-1]
            assert stat.S_ISREG(os.lstat(last).st_mode) and inside(os.path.realpath(last), real_root)
            # The file staged is the file a client opening the same path on the NAS would read.
            assert os.path.realpath(root / start) == os.path.realpath(last), (start, chain)


# ---------------------------------------------------------------- the Engram partition

def assert_tiles(ranges: list[tuple[int, int]], rows: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    for (lo, hi), (next_lo, _) in itertools.pairwise(ranges):
        assert lo <= hi == next_lo


@settings(max_examples=500, deadline=None)
@given(rows=st.integers(min_value=0, max_value=10**12), world=st.integers(min_value=1, max_value=512))
def test_floor_partition_tiles_the_rows_exactly(rows, world):
    ranges = [partition(rows, world, rank) for rank in range(world)]
    assert_tiles(ranges, rows)
    sizes = {hi - lo for lo, hi in ranges}
    assert max(sizes) - min(sizes) <= 1, "floor spreads rows within one of each other"


@settings(max_examples=300, deadline=None)
@given(heads=st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=64), data=st.data())
def test_heads_partition_tiles_the_rows_with_whole_heads(heads, data):
    world = data.draw(st.integers(min_value=1, max_value=len(heads)))
    rows = sum(heads)
    ranges = [partition(rows, world, rank, "heads", heads) for rank in range(world)]
    assert_tiles(ranges, rows)
    bounds = set(itertools.accumulate(heads, initial=0))
    assert all(lo in bounds and hi in bounds for lo, hi in ranges), "no head straddles two ranks"
    assert all(hi > lo for lo, hi in ranges), "every rank gets at least one whole head"
