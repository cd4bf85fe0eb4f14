"""A ref is a 40-hex commit (hub.read_ref): a NAS ref ending in one line end stages, and the
node's copy is written bare, as huggingface_hub writes it and reads it (it never strips); any
other text is refused naming the ref. Checked with huggingface_hub itself loading the node hub
offline, in a process of its own, and the bytes hashed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_stage, write_manifest
from hubgen import Hub, random_safetensors
from stager.mirror.hub import repo_dir_name

MODEL = "acme/Refs"
REPO_DIR = repo_dir_name(MODEL)


def nas_revision(nas: Hub, seed: int, ref_text: str | None) -> tuple[str, dict[str, str]]:
    """A new commit of MODEL on the NAS; `ref_text` (with {c} for the commit) is written to
    refs/main as is. Returns the commit and path -> sha256 of its files."""
    snap = nas.repo(MODEL).snapshot()
    snap.add_git("config.json", json.dumps({"seed": seed}).encode())
    snap.add_lfs("model.safetensors", random_safetensors(seed, 64 * 1024))
    snap.finish(ref=None)
    if ref_text is not None:
        (snap.repo.dir / "refs").mkdir(exist_ok=True)
        (snap.repo.dir / "refs" / "main").write_bytes(ref_text.format(c=snap.commit).encode())
    return snap.commit, dict(snap.sha256)


def offline_load(hub: Path) -> dict[str, str]:
    """path -> sha256 of what huggingface_hub loads for MODEL@main from the node hub, offline:
    snapshot_download and hf_hub_download, each in a process of its own."""
    code = (
        "import hashlib, json, os, sys\n"
        "from huggingface_hub import hf_hub_download, snapshot_download\n"
        "hub, repo = sys.argv[1:]\n"
        "root = snapshot_download(repo, cache_dir=hub, local_files_only=True)\n"
        "out = {}\n"
        "for d, _, names in os.walk(root):\n"
        "    for n in names:\n"
        "        p = os.path.join(d, n)\n"
        "        out[os.path.relpath(p, root)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
        "one = hf_hub_download(repo, 'model.safetensors', cache_dir=hub, local_files_only=True)\n"
        "assert hashlib.sha256(open(one, 'rb').read()).hexdigest() == out['model.safetensors']\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(hub), MODEL], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stage(manifest: Path, *args: str):
    return run_stage(*args, "--node", "dgx1", "--manifest", manifest, "--json")


@pytest.fixture
def site(tmp_path: Path):
    nas = Hub(tmp_path / "nas" / "hf" / "hub")
    hub = tmp_path / "nvme" / "hf" / "hub"
    return nas, hub, write_manifest(tmp_path / "cluster.toml", nas.root, hub, {MODEL: {}})


def test_the_ref_rule(tmp_path):
    """40 lowercase hex and at most one line end. What the rule is built on is checked against the
    installed huggingface_hub: it writes the commit alone."""
    from stager.mirror.hub import BadRef, read_ref

    commit = "0123456789abcdef0123456789abcdef01234567"
    for text in (commit, commit + "\n", commit + "\r\n"):
        assert read_ref(text.encode(), "refs/main") == commit
    for text in (commit + "\n\n", commit + " ", commit + " \n", " " + commit, commit + "\r", commit.upper(),
                 commit[:-1], commit + "8", "main", "", commit + "\nextra"):
        with pytest.raises(BadRef, match="^/nas/refs/main holds .*not a 40-hex commit"):
            read_ref(text.encode(), "/nas/refs/main")
    code = ("import sys\n"
            "from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision\n"
            "_cache_commit_hash_for_specific_revision(sys.argv[1], 'main', sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path), commit], check=True)
    assert (tmp_path / "refs" / "main").read_bytes() == commit.encode()


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_a_nas_ref_with_a_line_end_is_staged_bare_and_loads_offline(site, line_end):
    nas, hub, manifest = site
    commit, files = nas_revision(nas, 1, "{c}" + line_end)
    mirrored = stage(manifest, "mirror")
    assert mirrored.code == 0, mirrored.stdout + mirrored.stderr
    assert (hub / REPO_DIR / "refs" / "main").read_bytes() == commit.encode()  # bare, as huggingface_hub writes it
    assert offline_load(hub) == files
    verified = stage(manifest, "verify", "--full")
    assert verified.code == 0 and verified.json["ok"] == verified.json["checked"] == 4, verified.stdout  # 2 files, the ref, trees


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_a_node_on_an_older_commit_moves_when_the_nas_ref_has_a_line_end(site, line_end):
    nas, hub, manifest = site
    old, old_files = nas_revision(nas, 1, "{c}")
    assert stage(manifest, "mirror").code == 0
    assert offline_load(hub) == old_files
    new, new_files = nas_revision(nas, 2, "{c}" + line_end)
    mirrored = stage(manifest, "mirror")
    assert mirrored.code == 0, mirrored.stdout + mirrored.stderr
    assert (hub / REPO_DIR / "refs" / "main").read_bytes() == new.encode()
    assert offline_load(hub) == new_files != old_files
    assert stage(manifest, "verify").code == 0


def test_verify_reports_a_node_ref_that_is_not_bare_and_mirror_rewrites_it(site):
    nas, hub, manifest = site
    commit, files = nas_revision(nas, 1, "{c}\n")
    assert stage(manifest, "mirror").code == 0
    ref = hub / REPO_DIR / "refs" / "main"
    ref.write_bytes(commit.encode() + b"\n")  # what `echo` leaves: huggingface_hub cannot resolve it
    verified = stage(manifest, "verify")
    assert verified.code == 1
    [problem] = verified.json["problems"]
    assert problem["path"] == str(ref) and problem["kind"] == "mismatch" and "line end" in problem["detail"]
    assert stage(manifest, "mirror").code == 0
    assert ref.read_bytes() == commit.encode() and offline_load(hub) == files
    other = "f" * 40
    ref.write_text(other)
    verified = stage(manifest, "verify")
    assert verified.code == 1 and verified.json["problems"][0]["detail"] == f"names {other}; the node should be on {commit}"


def test_a_node_ref_with_a_line_end_is_checked_while_the_nas_downloads_a_new_revision(site):
    """The node stays on the revision it serves (hub.serving_commit) while the NAS's new one is
    incomplete; its own ref is still checked, and written bare, so clients can load it."""
    nas, hub, manifest = site
    served, files = nas_revision(nas, 1, "{c}")
    assert stage(manifest, "mirror").code == 0
    snap = nas.repo(MODEL).snapshot()  # a download killed half-way: ref and listing, no weights yet
    snap.files["model.safetensors"] = {"size": 1 << 20, "lfs_size": 1 << 20}
    snap.finish()
    (snap.repo.dir / "blobs" / ("e" * 64 + ".incomplete")).write_bytes(b"\0" * 4096)
    ref = hub / REPO_DIR / "refs" / "main"
    ref.write_bytes(served.encode() + b"\r\n")
    verified = stage(manifest, "verify")
    assert verified.code == 1 and verified.json["pending"][0]["serving_commit"] == served
    assert [(p["path"], p["kind"]) for p in verified.json["problems"]] == [(str(ref), "mismatch")]
    mirrored = stage(manifest, "mirror")
    assert mirrored.code == 0, mirrored.stdout
    assert ref.read_bytes() == served.encode() and offline_load(hub) == files
    assert stage(manifest, "verify").code == 0


@pytest.mark.parametrize("text", ["not a commit\n", "{c} \n", "{c}\n\n", "{C}"])
def test_a_nas_ref_that_is_not_a_commit_is_refused_naming_it(site, text):
    nas, hub, manifest = site
    commit, files = nas_revision(nas, 1, "{c}")
    assert stage(manifest, "mirror").code == 0
    ref = nas.repo(MODEL).dir / "refs" / "main"
    ref.write_text(text.format(c=nas_revision(nas, 2, None)[0], C=commit.upper()))
    for command in ("mirror", "verify"):
        ran = stage(manifest, command)
        assert ran.code == 1, ran.stdout + ran.stderr
        [problem] = ran.json["problems"]
        assert problem["path"] == str(ref) and problem["kind"] == "bad_ref", problem
        assert problem["detail"].startswith(f"{ref} holds ") and "not a 40-hex commit" in problem["detail"]
    assert (hub / REPO_DIR / "refs" / "main").read_bytes() == commit.encode()  # the node stays where it was
    assert offline_load(hub) == files
    with pytest.raises(subprocess.CalledProcessError):  # huggingface_hub cannot load the NAS either
        subprocess.run([sys.executable, "-c", "import sys\nfrom huggingface_hub import snapshot_download\n"
                        "snapshot_download(sys.argv[2], cache_dir=sys.argv[1], local_files_only=True)",
                        str(nas.root), MODEL], check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

