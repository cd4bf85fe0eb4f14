"""`stage prune` never crosses a mount: real `mount --bind`s of NAS directories into the node hub.

An operator binds a NAS directory into a node snapshot (as `stage binds` suggests for excluded
paths); a prune once renamed that snapshot into its trash and deleted the NAS's files through the
mount. Here each mount is made for real, in the test's own mount namespace, and the NAS is hashed
whole before and after (prune_fixtures.nas_guard)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prune_fixtures import (MODEL_DIR, OLD_DIR, Node, bound, build_node, listed, nas_state, scan_clean,
                            tree_bytes, unmount_below)
from prune_fixtures import nas_guard  # noqa: F401 - autouse: the NAS is byte-identical after every test
from reliability_support import needs_root, tmpfs


@pytest.fixture
def node(tmp_path: Path) -> Node:
    needs_root()
    return build_node(tmp_path)


def _store_bucket(hub: Path) -> Path:
    return next(p for p in sorted((hub / "blobs").iterdir()) if p.is_dir())


# (case, where the NAS directory is mounted in the node hub, which NAS directory, the item it
# holds, whether the mount hides some of the item's own files)
HELD = [
    ("old revision", lambda n: n.old_snapshot / "original", lambda n: n.nas / MODEL_DIR / "blobs",
     lambda n: n.old_snapshot, False),
    ("unlisted repo, a new directory", lambda n: n.hub / OLD_DIR / "original", lambda n: n.nas / OLD_DIR,
     lambda n: n.hub / OLD_DIR, False),
    ("unlisted repo, on its blobs/", lambda n: n.hub / OLD_DIR / "blobs", lambda n: n.nas / OLD_DIR / "blobs",
     lambda n: n.hub / OLD_DIR, True),
]


@pytest.mark.parametrize("case, point_of, source_of, item_of, hides", HELD, ids=[c[0] for c in HELD])
def test_a_nas_mount_inside_an_item_keeps_it_and_nothing_is_removed_through_it(node: Node, tmp_path: Path, case,
                                                                                point_of, source_of, item_of, hides):
    """The item with the mount inside is in use, named with the mount and what it shows; its size
    is its own bytes (what it pins on the node, its blobs included), never the NAS's; the other
    items go; the NAS is byte-identical; once the mount is gone the next run removes the item and
    frees the bytes the held report gave (a mount over the item's own blobs/ hides those: less)."""
    point, source, item = point_of(node), source_of(node), item_of(node)
    plain = listed(node.prune("--dry-run").json["removed"])
    planned_bytes = {path: size for path, _kind, size in plain}
    with bound(source, point, cleanup=tmp_path):
        seen = tree_bytes(point)
        assert seen  # the NAS's files, seen through the mount
        dry = node.prune("--dry-run")
        real = node.prune()
        text = node.stage("prune", "--dry-run")
        assert tree_bytes(point) == seen and tree_bytes(source) == seen
    for result in (dry, real):
        assert result.code == 1, result.stdout + result.stderr
        [busy] = result.json["in_use"]
        assert busy["path"] == str(item)
        [use] = busy["users"]
        assert use["pid"] is None and use["mount"] == str(point) and use["shows"] == str(source), use
        if hides:
            assert 0 < busy["bytes"] < planned_bytes[str(item)]
        else:
            assert busy["bytes"] == planned_bytes[str(item)]
        assert [i["path"] for i in result.json["removed"]] == [p for p, _k, _b in plain if p != str(item)]
        assert {m["point"]: m["shows"] for m in result.json["mounts"]} == {str(point): str(source)}
        assert result.json["problems"] == []
    assert text.code == 1 and f"mount at {point}" in text.stdout and str(source) in text.stdout, text.stdout
    assert item.is_dir() and not os.path.ismount(point)
    scan_clean(node.hub)
    again = node.prune()
    assert again.code == 0, again.stdout + again.stderr
    assert listed(again.json["removed"]) == [(str(item), next(k for p, k, _b in plain if p == str(item)),
                                              planned_bytes[str(item)])]
    assert not item.exists()
    scan_clean(node.hub)


# (case, where the NAS directory is mounted, which NAS directory): no item is below it.
BESIDE = [
    ("the wanted revision (stage binds' advice for excluded paths)",
     lambda n: n.hub / MODEL_DIR / "snapshots" / n.new / "original", lambda n: n.nas / MODEL_DIR / "blobs"),
    ("a listed repo's blobs/", lambda n: n.hub / MODEL_DIR / "blobs" / "original", lambda n: n.nas / MODEL_DIR / "blobs"),
    ("the shared store", lambda n: n.hub / "blobs" / "zz", lambda n: _store_bucket(n.nas)),
]


@pytest.mark.parametrize("case, point_of, source_of", BESIDE, ids=["wanted revision", "a listed repo's blobs/",
                                                                  "the shared store"])
def test_a_nas_mount_beside_the_items_is_listed_and_never_read_as_the_nodes(node: Node, tmp_path: Path, case, point_of,
                                                                           source_of):
    """NAS files mounted into the wanted revision, a repo's blobs/ or the shared store are not the
    node's (orphan blobs, payloads, what a snapshot reaches): the plan is what it is without the
    mount, the mount is listed, the NAS is byte-identical."""
    point, source = point_of(node), source_of(node)
    plain = listed(node.prune("--dry-run").json["removed"])
    with bound(source, point, cleanup=tmp_path):
        seen = tree_bytes(point)
        assert seen
        audit = node.stage("audit", "--json")
        dry = node.prune("--dry-run")
        real = node.prune()
        assert tree_bytes(point) == seen and tree_bytes(source) == seen
    for result in (dry, real):
        assert result.code == 0, result.stdout + result.stderr
        assert listed(result.json["removed"]) == plain
        assert result.json["in_use"] == [] and result.json["problems"] == []
        assert {m["point"]: m["shows"] for m in result.json["mounts"]} == {str(point): str(source)}
    assert listed(audit.json["reclaim"]) == plain
    point.rmdir()  # the mount point the test made
    scan_clean(node.hub)


def test_a_mount_of_another_filesystem_inside_a_revision_keeps_it(node: Node, tmp_path: Path):
    """The NAS on a filesystem of its own (a tmpfs here), bound into the old revision: held the same
    way, and nothing on that filesystem is touched."""
    with tmpfs(tmp_path / "nas2", 16 << 20) as nas2:
        (nas2 / "original").mkdir()
        for i in range(3):
            (nas2 / "original" / f"weights-{i}.bin").write_bytes(os.urandom(4096))
        before = nas_state(nas2)
        point = node.old_snapshot / "original"
        with bound(nas2 / "original", point, cleanup=node.hub):
            result = node.prune()
        assert result.code == 1, result.stdout + result.stderr
        [busy] = result.json["in_use"]
        assert busy["path"] == str(node.old_snapshot)
        assert [(u["mount"], u["shows"]) for u in busy["users"]] == [(str(point), str(nas2 / "original"))]
        assert [i["kind"] for i in result.json["removed"]] == ["unlisted-repo"]
        assert nas_state(nas2) == before  # checked while it is mounted: the guard runs after the unmount


def test_a_repo_directory_that_is_a_mount_is_never_entered(node: Node, tmp_path: Path):
    """A NAS repo bound over the node's unlisted repo directory itself: in use (the mount is the
    item), never renamed, never walked."""
    item = node.hub / OLD_DIR
    with bound(node.nas / OLD_DIR, item, cleanup=tmp_path):
        result = node.prune()
        assert result.code == 1, result.stdout + result.stderr
        [busy] = result.json["in_use"]
        assert busy["path"] == str(item)
        assert [(u["mount"], u["shows"]) for u in busy["users"]] == [(str(item), str(node.nas / OLD_DIR))]
    unmount_below(tmp_path)
    assert (item / "snapshots").is_dir()


def test_a_trash_left_with_a_mount_inside_is_emptied_around_it(node: Node, tmp_path: Path):
    """A killed run (or an older prune) left a directory in the trash with a NAS bind inside: the
    next run empties the trash around the mount, never through it, says so (exit 1), and still
    carries out its plan; once the mount is gone the trash empties."""
    plain = listed(node.prune("--dry-run").json["removed"])
    left = node.hub / ".locks" / "stage-prune-trash" / f"42-{node.old}"
    (left / "docs").mkdir(parents=True)
    (left / "docs" / "README.md").write_text("old\n")
    point = left / "original"
    with bound(node.nas / MODEL_DIR / "blobs", point, cleanup=tmp_path):
        seen = tree_bytes(point)
        result = node.prune()
        assert tree_bytes(point) == seen
    assert result.code == 1, result.stdout + result.stderr
    [problem] = result.json["problems"]
    assert problem["kind"] == "mount" and problem["path"] == str(left) and str(point) in problem["detail"]
    assert listed(result.json["removed"]) == plain
    assert sorted(p.name for p in left.iterdir()) == ["original"]  # the mount point, and nothing else
    again = node.prune()
    assert again.code == 0 and again.json["problems"] == [], again.stdout
    assert not any((node.hub / ".locks" / "stage-prune-trash").iterdir())
    scan_clean(node.hub)
