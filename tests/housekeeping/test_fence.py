"""fence: a root's own filesystem and mount, on real mounts. A bind of a directory of the same
filesystem has the root's st_dev, so only the mount id tells it apart; a link or a mount put on
the way after a path was checked never redirects a removal."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from prune_fixtures import bound, nas_state
from reliability_support import needs_root, tmpfs
from stager.housekeeping.fence import Beyond, Fence, Tree, View


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A root with a directory and a file in it, and a NAS directory beside it on the same filesystem."""
    needs_root()
    root, nas = tmp_path / "root", tmp_path / "nas"
    (root / "repo" / "snap").mkdir(parents=True)
    (root / "repo" / "snap" / "config.json").write_text("{}")
    (nas / "data").mkdir(parents=True)
    for i in range(3):
        (nas / "data" / f"weight-{i}.bin").write_bytes(os.urandom(1024))
    return root, nas


def test_a_same_filesystem_bind_is_told_apart_by_its_mount_id_alone(layout, tmp_path: Path):
    root, nas = layout
    point = root / "repo" / "snap" / "original"
    with bound(nas / "data", point, cleanup=tmp_path):
        assert os.stat(point).st_dev == os.stat(root).st_dev  # st_dev alone cannot see it
        view = View(Fence.of(str(root)))
        assert [e.name for e in view.listing(str(root / "repo" / "snap"))] == ["config.json"]
        assert view.listing(str(point)) == []
        assert view.crossings[str(point)].shows == str(nas / "data")
        walked = [here for here, _dirs, _files in view.tree(str(root))]
        assert str(point) not in walked


def test_a_removal_walk_stops_at_a_mount_and_leaves_what_it_shows(layout, tmp_path: Path):
    """The walk that empties the trash: a mount met inside (one that appeared after every check)
    is left, with the directories above it; everything else goes; the NAS is byte-identical."""
    root, nas = layout
    before = nas_state(nas)
    point = root / "repo" / "snap" / "original"
    with bound(nas / "data", point, cleanup=tmp_path):
        tree = Tree(Fence.of(str(root)))
        try:
            left = tree.remove_tree(str(root / "repo"))
        finally:
            tree.close()
        assert left == [str(point)]
        assert sorted(p.name for p in (root / "repo" / "snap").iterdir()) == ["original"]
        assert nas_state(nas) == before


def test_a_removal_never_follows_a_link_or_enters_a_mount_put_on_its_way(layout, tmp_path: Path):
    """A directory on the way replaced by a link to the NAS: ELOOP, nothing removed. A directory on
    the way that became a mount: Beyond, nothing removed."""
    root, nas = layout
    before = nas_state(nas)
    os.rename(root / "repo" / "snap", root / "repo" / "snap.real")
    os.symlink(nas / "data", root / "repo" / "snap")
    tree = Tree(Fence.of(str(root)))
    with pytest.raises(OSError) as raised:
        tree.unlink(str(root / "repo" / "snap" / "weight-0.bin"))
    assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)
    tree.close()
    os.unlink(root / "repo" / "snap")
    os.rename(root / "repo" / "snap.real", root / "repo" / "snap")
    with bound(nas / "data", root / "repo" / "snap", cleanup=tmp_path):
        tree = Tree(Fence.of(str(root)))
        try:
            with pytest.raises(Beyond) as beyond:
                tree.unlink(str(root / "repo" / "snap" / "weight-0.bin"))
            assert beyond.value.crossing.point == str(root / "repo" / "snap")
        finally:
            tree.close()
    assert nas_state(nas) == before


def test_another_filesystem_inside_the_root_is_a_crossing_by_its_device(layout, tmp_path: Path):
    root, _nas = layout
    with tmpfs(root / "repo" / "scratch", 1 << 20) as scratch:
        (scratch / "keep.bin").write_bytes(b"x" * 100)
        view = View(Fence.of(str(root)))
        assert [e.name for e in view.listing(str(root / "repo"))] == ["snap"]
        assert str(scratch) in view.crossings
        tree = Tree(Fence.of(str(root)))
        try:
            assert tree.remove_tree(str(root / "repo")) == [str(scratch)]
        finally:
            tree.close()
        assert (scratch / "keep.bin").read_bytes() == b"x" * 100
