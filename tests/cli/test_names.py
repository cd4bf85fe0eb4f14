"""Names people know: the mirror's and verify's -v lines, `--dry-run` lines and problem lines
name a file as `acme/Flash-3bpw@5248d7d/model-00002-of-00003.safetensors` (repo id, 7-hex short
commit, path in the snapshot) with its blob after it, never by a blob path alone (a hash under
blobs/, shared by several repos). Read from the demo NAS's real runs (scripts/make_demo_nas.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STAGE = [str(BIN / "stage")] if (BIN / "stage").exists() else [sys.executable, "-m", "stager"]
LINE = re.compile(r"^(?P<name>\S+?)(?: blob (?P<blob>[0-9a-f]{40}|[0-9a-f]{64}))?(?P<rest> .*)$")


def stage(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*STAGE, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture
def demo(tmp_path) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_demo_nas.py"), str(tmp_path / "demo")], check=True,
                   capture_output=True)
    return tmp_path / "demo" / "cluster.toml"


def snapshot_names(nas: Path) -> dict[str, str | None]:
    """Every staged entry of the demo (page15/ is excluded) by the name people know it by, with
    the repo blob its snapshot link names (None for a real file in the snapshot)."""
    names = {}
    for repo_dir in sorted(nas.glob("models--*")):
        repo_id = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        commit = (repo_dir / "refs" / "main").read_text()
        snap = repo_dir / "snapshots" / commit
        for entry in sorted(p for p in snap.rglob("*") if p.is_symlink() or p.is_file()):
            rel = entry.relative_to(snap).as_posix()
            if not rel.startswith("page15/"):
                names[f"{repo_id}@{commit[:7]}/{rel}"] = os.path.basename(os.readlink(entry)) if entry.is_symlink() else None
    return names


def named(lines: list[str], prefix: str) -> dict[str, str | None]:
    found = {}
    for line in lines:
        if line.startswith(prefix):
            match = LINE.match(line.removeprefix(prefix))
            assert match, line
            found[match["name"]] = match["blob"]
    return found


def test_dry_run_and_verbose_lines_name_snapshot_files(demo):
    nas = demo.parent / "nas" / "hf" / "hub"
    expected = snapshot_names(nas)
    assert "acme/Flash-3bpw@5248d7d/model-00002-of-00003.safetensors" in expected  # hubgen's fixed commit
    assert len(expected) == 9 and expected["acme/Flash-3bpw@5248d7d/tokenizer.json"] is None
    dry = stage("mirror", "--node", "dgx1", "--dry-run", "--manifest", demo)
    assert dry.returncode == 0, dry.stderr
    assert named(dry.stdout.splitlines(), "  would copy ") == expected, dry.stdout
    data = json.loads(stage("mirror", "--node", "dgx1", "--dry-run", "--json", "--manifest", demo).stdout)
    assert {item["name"]: item["blob"] for item in data["would_copy"]} == expected

    loud = stage("mirror", "--node", "dgx1", "-v", "--manifest", demo)
    assert loud.returncode == 0, loud.stderr
    assert named(loud.stderr.splitlines(), "copied ") == expected, loud.stderr
    assert named(loud.stderr.splitlines(), "ok ") == expected, loud.stderr  # the closing verify
    # The blob printed is the file's: an LFS blob's name is the SHA-256 of the staged bytes.
    hub = demo.parent / "nvme" / "hf" / "hub"
    weight = next(hub.glob("models--acme--Flash-3bpw/snapshots/*/model-00002-of-00003.safetensors"))
    assert hashlib.sha256(weight.read_bytes()).hexdigest() == expected[
        "acme/Flash-3bpw@5248d7d/model-00002-of-00003.safetensors"]
    verify = stage("verify", "--node", "dgx1", "-v", "--manifest", demo)
    assert named(verify.stderr.splitlines(), "ok ") == expected, verify.stderr


def test_problem_lines_lead_with_the_snapshot_name_and_end_with_the_path(demo):
    assert stage("mirror", "--node", "dgx1", "--manifest", demo).returncode == 0
    hub = demo.parent / "nvme" / "hf" / "hub"
    weight = next(hub.glob("models--acme--Flash-3bpw/snapshots/*/model-00002-of-00003.safetensors"))
    blob = os.path.basename(os.readlink(weight))
    final = Path(os.path.realpath(weight))
    final.chmod(0o644)
    with open(final, "r+b") as handle:
        handle.seek(100)
        handle.write(b"XXXX")
    (next(hub.glob("models--acme--Flash-3bpw/snapshots/*/tokenizer.json"))).unlink()
    result = stage("verify", "--node", "dgx1", "--manifest", demo)
    assert result.returncode == 1
    problems = [line.split(None, 1) for line in result.stdout.splitlines() if line.startswith("  ")]
    assert {kind for kind, _ in problems} == {"mismatch", "missing"}, result.stdout
    by_kind = dict(problems)
    assert by_kind["mismatch"] == (f"acme/Flash-3bpw@5248d7d/model-00002-of-00003.safetensors blob {blob}: "
                                   f"sampled xxh3-128 differs from the source ({weight})")
    assert by_kind["missing"] == (f"acme/Flash-3bpw@5248d7d/tokenizer.json: not staged "
                                  f"({weight.parent / 'tokenizer.json'})")
    listed = json.loads(stage("verify", "--node", "dgx1", "--json", "--manifest", demo).stdout)["problems"]
    assert {(p["kind"], p["name"], p["blob"], p["path"]) for p in listed} == {
        ("mismatch", "acme/Flash-3bpw@5248d7d/model-00002-of-00003.safetensors", blob, str(weight)),
        ("missing", "acme/Flash-3bpw@5248d7d/tokenizer.json", None, str(weight.parent / "tokenizer.json"))}


def test_nas_side_problems_name_the_entry_too(demo):
    """A NAS link that leads nowhere (the walk) and a NAS blob whose bytes fail its name (the copy,
    --full): both named as the snapshot has them, the NAS path at the end."""
    nas = demo.parent / "nas" / "hf" / "hub"
    drafter = next(nas.glob("models--acme--Flash-drafter/snapshots/*"))
    os.symlink("../../blobs/" + "0" * 64, drafter / "broken.safetensors")
    flash = next(nas.glob("models--acme--Flash-3bpw/snapshots/*"))
    blob = os.path.basename(os.readlink(flash / "model-00001-of-00003.safetensors"))
    payload = Path(os.path.realpath(flash / "model-00001-of-00003.safetensors"))
    spoiled = bytearray(payload.read_bytes())
    spoiled[-1] ^= 0xFF
    payload.chmod(0o644)
    payload.write_bytes(bytes(spoiled))
    result = stage("mirror", "--node", "dgx1", "--full", "--manifest", demo)
    assert result.returncode == 1, result.stderr
    lines = [line.split(None, 1) for line in result.stdout.splitlines() if line.startswith("  ")]
    dangling = [text for kind, text in lines if kind == "dangling"]
    assert len(dangling) == 1 and dangling[0].startswith("acme/Flash-drafter@8b8d836/broken.safetensors: ")
    assert dangling[0].endswith(f"({drafter / 'broken.safetensors'})"), dangling
    mismatch = [text for kind, text in lines if kind == "mismatch"]
    assert mismatch and mismatch[0].startswith(
        f"acme/Flash-3bpw@5248d7d/model-00001-of-00003.safetensors blob {blob}: "), result.stdout
    assert mismatch[0].endswith(f"({payload})"), mismatch
