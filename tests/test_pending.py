"""A NAS that is mid-download is not the node's fault: the node stays on the whole revision it
serves (hub.serving_commit), mirror and verify say which revision is pending and exit 0, and the
audit warns once a pending download has been idle for longer than nas.pending_warn_after."""

from __future__ import annotations

import os
from pathlib import Path

from stager.hub import repo_dir_name, serving_commit

REPO_ID = "acme/Flash-mini"
A, B = "a" * 40, "b" * 40


def node_repo(hub: Path, ref: str | None, snapshots: tuple[str, ...]) -> Path:
    repo = hub / repo_dir_name(REPO_ID)
    for commit in snapshots:
        (repo / "snapshots" / commit).mkdir(parents=True)
    if ref is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(ref)
    return repo


def test_serving_commit_is_what_an_offline_client_loads(tmp_path):
    hub = tmp_path / "hub"
    repo = node_repo(hub, A, (A, B))
    assert serving_commit(hub, REPO_ID, "main") == A  # the node's ref, not the newest snapshot
    assert serving_commit(hub, REPO_ID, B) == B  # a pinned commit is itself
    assert serving_commit(hub, REPO_ID, "c" * 40) is None  # pinned but not on the node
    assert serving_commit(hub, REPO_ID, "v1.0") is None  # no such ref
    (repo / "refs" / "main").write_text("not a commit")
    assert serving_commit(hub, REPO_ID, "main") is None
    (repo / "refs" / "main").write_text("c" * 40)  # a ref to a snapshot the node does not hold
    assert serving_commit(hub, REPO_ID, "main") is None
    (repo / "refs" / "main").unlink()
    os.mkfifo(repo / "refs" / "main")  # never waited on
    assert serving_commit(hub, REPO_ID, "main") is None
    assert serving_commit(tmp_path / "no-hub", REPO_ID, "main") is None
