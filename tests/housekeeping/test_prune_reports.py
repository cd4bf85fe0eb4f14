"""One answer per `stage prune` report: the text, the JSON and the exit code agree, and a dry run
names every path the real run removes, shared-store payloads included."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hubgen import Hub, random_safetensors
from prune_fixtures import MODEL_DIR, Node, build_node, scan_clean
from prune_fixtures import nas_guard  # noqa: F401 - autouse: the NAS is byte-identical after every test
from reliability_support import needs_root, tmpfs


def _free(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def test_until_free_gives_one_answer_in_text_json_and_exit_code(tmp_path: Path):
    """On a real 64 MiB tmpfs: a target the plan reaches is met everywhere (text `(met)`, every
    `targets[].met`, `target_met`, exit 0); one it cannot reach is not met everywhere (exit 1), in
    the dry run and in the real run alike."""
    needs_root()
    with tmpfs(tmp_path / "nvme", 64 * 1024 * 1024):
        node = build_node(tmp_path)
        for reachable, args in ((True, ("--dry-run",)), (False, ("--dry-run",)), (True, ()), (False, ())):
            goal = str(_free(tmp_path / "nvme") + 1) if reachable else "1G"
            result = node.prune("--until-free", goal, *args)
            text = node.stage("prune", "--until-free", goal, *args)  # after a real run: met, or not, all the same
            assert result.code == (0 if reachable else 1), result.stdout + result.stderr
            assert result.json["target_met"] is reachable
            assert [t["met"] for t in result.json["targets"]] == [reachable]
            [target] = result.json["targets"]
            assert (target["free_after_bytes"] >= target["want_free_bytes"]) is reachable
            assert text.code == result.code
            assert ("(met)" in text.stdout) is reachable and ("NOT met" in text.stdout) is not reachable, text.stdout
        scan_clean(node.hub)


def _named(text: str) -> set[str]:
    """The paths a prune's text names as removed: each item line's path and each `+ PATH` under it."""
    named = set()
    for line in text.splitlines():
        if re.match(r"^  (would remove|removed) ", line):
            named.add(line.split("  ")[-1].strip())
        elif line.startswith("      + "):
            named.add(line[len("      + "):].strip())
    return named


def _entries(root: Path) -> set[str]:
    found = set()
    for directory, dirs, files in os.walk(root):
        if os.path.relpath(directory, root).split(os.sep)[0] == ".locks":
            continue
        found.update(os.path.join(directory, name) for name in dirs + files)
    return found


def test_a_dry_run_names_every_path_the_run_removes_shared_payloads_included(tmp_path: Path):
    """An orphan repo blob that links to a shared-store payload only it references: the dry run's
    text names the link, the payload and its `.refs`, as its JSON does; the real run removes exactly
    the paths the dry run named (and what lies under the directories among them), nothing else."""
    node: Node = build_node(tmp_path)
    hub = Hub(node.hub)
    data = random_safetensors(7, 32 * 1024)
    xet = hub.store(data)
    payload = node.hub / "blobs" / xet[:2] / xet
    blob = node.hub / MODEL_DIR / "blobs" / ("e" * 64)
    os.symlink(f"../../blobs/{xet[:2]}/{xet}", blob)
    hub.add_store_ref(xet, f"{MODEL_DIR}/blobs/{blob.name}")

    dry_text = node.stage("prune", "--dry-run")
    dry = node.prune("--dry-run")
    assert dry_text.code == dry.code == 0, dry_text.stdout + dry_text.stderr
    named = _named(dry_text.stdout)
    assert {str(blob), str(payload), f"{payload}.refs"} <= named, dry_text.stdout
    assert named == {p for item in dry.json["removed"] for p in item["paths"]}

    before = _entries(node.hub)
    real_text = node.stage("prune")
    assert real_text.code == 0, real_text.stdout + real_text.stderr
    gone = before - _entries(node.hub)
    assert named <= gone
    assert all(any(g == n or g.startswith(n + "/") for n in named) for g in gone), sorted(gone - named)
    assert _named(real_text.stdout) == named
    scan_clean(node.hub)
