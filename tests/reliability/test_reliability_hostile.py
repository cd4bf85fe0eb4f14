"""Hostile input: a NAS tree built to escape, loop, hang or crash the tool, and malformed manifests
and checkpoints. Each gets a clear error or a reported problem (kind + path): never a traceback,
never a hang, never a byte from outside the hub staged, never a file written outside the roots."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import time
from pathlib import Path

import pytest

from reliability_support import (MiB, assert_hub_truthful, build_staging, fs_listing, random_safetensors, run_json,
                                 run_stage, sha256_file, untouched, write_manifest)
from hubgen import Hub

HOSTILE = "acme/Hostile"
HOPS = 10_000
ALIAS = "/volume1/hf/hub"
WEIRD_NAMES = ["with space.json", "new\nline.json", os.fsdecode(b"bad-\xff\xfe-utf8.json")]
SECRET = b"outside the hub: must never be staged\n"


@pytest.fixture
def hostile(tmp_path):
    """A NAS whose one model holds three good files and every trap, plus an `outside` directory
    that the traps point at."""
    outside = tmp_path / "outside"
    (outside / "snaps").mkdir(parents=True)
    (outside / "secret.bin").write_bytes(SECRET)
    nas = Hub(tmp_path / "nas" / "hf" / "hub")
    snap = nas.repo(HOSTILE).snapshot()
    snap.add_git("config.json", b'{"architectures": ["X"]}')
    snap.add_lfs("model.safetensors", random_safetensors(1, MiB), shared=True)
    snap.add_lfs("aliased.safetensors", random_safetensors(2, MiB // 2), shared=True, absolute_via=ALIAS)
    for i, name in enumerate(WEIRD_NAMES):
        snap.add_git(name, json.dumps({"name": name, "i": i}).encode())
    repo = snap.repo.dir
    up = "../" * 5  # from snapshots/<commit>/ past the hub root
    traps = {
        "escape-relative": f"{up}outside/secret.bin",
        "escape-absolute": str(outside / "secret.bin"),
        "absolute-outside-aliases": "/volume9/hf/hub/blobs/secret.bin",
        "alias-then-dotdot": f"{ALIAS}/../../../{outside.relative_to('/')}/secret.bin",
        "through-dir-link": "../../blobs/outside-dir/secret.bin",
        "dir-link-escape": str(outside),
        "loop-a": "loop-b",
        "loop-b": "loop-a",
        "self": "self",
        "dangling": "../../blobs/" + "0" * 64,
        os.fsdecode(b"dangling-\xff-name"): "../../blobs/" + "1" * 64,
        "dangling\nnewline": "../../blobs/" + "2" * 64,
        "long-chain": "../../hops/0",
        "blob-is-dir": "../../blobs/" + "d" * 64,
        "blob-is-fifo": "../../blobs/" + "f" * 64,
    }
    for name, target in traps.items():
        snap.add_raw_link(name, target)
    os.symlink(str(outside), repo / "blobs" / "outside-dir")
    (repo / "blobs" / ("d" * 64)).mkdir()
    os.mkfifo(repo / "blobs" / ("f" * 64))
    os.mkfifo(snap.dir / "fifo-in-snapshot")
    hops = repo / "hops"
    hops.mkdir()
    for i in range(HOPS):
        os.symlink(str(i + 1) if i + 1 < HOPS else "../blobs/" + snap.sha256["model.safetensors"], hops / str(i))
    snap.finish()
    # Metadata traps: a ref that is a FIFO, a ref that is a link out of the hub.
    os.mkfifo(repo / "refs" / "fifo")
    os.symlink(str(outside / "secret.bin"), repo / "refs" / "linked")
    local = tmp_path / "nvme" / "hf" / "hub"
    manifest = write_manifest(tmp_path / "cluster.toml", nas.root, local, {HOSTILE: {}}, aliases={ALIAS: str(nas.root)})
    return {"tmp": tmp_path, "nas": nas.root, "local": local, "manifest": manifest, "snap": snap,
            "outside": outside, "traps": traps}


EXPECTED_KINDS = {
    "escape-relative": "escape", "escape-absolute": "escape", "absolute-outside-aliases": "escape",
    "alias-then-dotdot": "escape", "through-dir-link": "escape", "dir-link-escape": "escape",
    "loop-a": "loop", "loop-b": "loop", "self": "loop", "long-chain": "loop", "dangling": "dangling",
    os.fsdecode(b"dangling-\xff-name"): "dangling", "dangling\nnewline": "dangling",
    "blob-is-dir": "not_a_file", "blob-is-fifo": "not_a_file", "fifo-in-snapshot": "not_a_file",
}


def stage(env, *args, timeout: float = 60):
    started = time.monotonic()
    result = run_stage(*args, "--node", "dgx1", "--manifest", env["manifest"], timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr
    return result, time.monotonic() - started


def assert_nothing_from_outside(local: Path) -> None:
    real = os.path.realpath(local)
    for directory, _dirs, files in os.walk(local):
        for name in files:
            path = os.path.join(directory, name)
            assert os.path.realpath(path).startswith(real + "/"), f"{path} resolves outside the hub"
            if os.path.isfile(path):
                assert Path(path).read_bytes() != SECRET, f"{path} holds a file from outside the hub"


def test_every_trap_is_a_named_problem_and_the_rest_stages(hostile):
    hostile["local"].mkdir(parents=True)  # the configured root; everything else must stay as it is
    around = fs_listing(hostile["tmp"], skip=(hostile["local"],))
    with untouched(hostile["nas"]), untouched(hostile["outside"], what="outside"):
        result, seconds = stage(hostile, "mirror", "--json")
    assert seconds < 30, "a hostile tree must not slow the walk to a crawl"
    assert result.code == 1, result.stderr
    report = run_json(result)
    traps = [p for p in report["problems"] if p["kind"] != "ref_not_moved"]
    found = {Path(os.fsencode(p["path"]).decode(errors="surrogateescape")).name: p["kind"] for p in traps}
    assert found == EXPECTED_KINDS, found
    for problem in report["problems"]:
        assert problem["detail"], problem
    # The good files, weird names included, are staged byte-exact.
    staged = hostile["local"] / hostile["snap"].dir.relative_to(hostile["nas"])
    for name in ["config.json", "model.safetensors", "aliased.safetensors", *WEIRD_NAMES]:
        assert sha256_file(staged / name) == hostile["snap"].sha256[name], name
    assert not any((staged / trap).exists() or (staged / trap).is_symlink() for trap in EXPECTED_KINDS)
    assert_nothing_from_outside(hostile["local"])
    assert fs_listing(hostile["tmp"], skip=(hostile["local"],)) == around, "nothing written outside the local hub"
    # A refs/ FIFO and a refs/ link out of the hub are metadata traps: never read, never staged;
    # and refs/main stays off a snapshot whose entries are not all staged.
    refs = hostile["local"] / hostile["snap"].repo.dir.name / "refs"
    assert not refs.exists() or os.listdir(refs) == []
    assert [p["path"] for p in report["problems"] if p["kind"] == "ref_not_moved"] == [str(refs / "main")]


def test_json_report_is_strict_json_with_non_utf8_names(hostile):
    result, _ = stage(hostile, "mirror", "--json")
    stdout = result.stdout.encode()
    stdout.decode("utf-8", errors="strict")  # the bytes on stdout are UTF-8
    paths = [p["path"] for p in json.loads(result.stdout)["problems"]]
    # A non-UTF-8 byte travels as a \udcXX escape (U+DC00 + byte), which os.fsencode turns back
    # into the exact name on disk.
    assert "dangling-\\udcff-name" in result.stdout
    assert any(os.fsencode(p).endswith(b"/dangling-\xff-name") and os.path.islink(os.fsencode(p)) for p in paths)
    verify, _ = stage(hostile, "verify", "--json")
    assert verify.code == 1 and json.loads(verify.stdout)["problems"]
    # jq is a strict parser operators pipe this into.
    jq = subprocess.run(["jq", "-e", ".problems | length"], input=result.stdout, capture_output=True, text=True)
    assert jq.returncode == 0 and int(jq.stdout) == len(EXPECTED_KINDS) + 1, jq.stderr  # and ref_not_moved


def test_human_report_names_every_problem_on_one_line(hostile):
    result, _ = stage(hostile, "mirror")
    assert result.code == 1
    lines = result.stdout.splitlines()  # the report is the result: stdout
    # The summary, one line per trap, and one for the ref that did not move.
    assert len(lines) == 1 + len(EXPECTED_KINDS) + 1, "a newline in a name must not split a problem's line"
    for name, kind in EXPECTED_KINDS.items():
        shown = name.encode("unicode_escape").decode()  # newline as \n, byte 0xff as \udcff
        assert any(line.split()[0] == kind and f"/{shown}: " in line for line in lines[1:]), (shown, lines)


def test_rerun_and_verify_are_stable_on_a_hostile_tree(hostile):
    first, _ = stage(hostile, "mirror", "--json")
    again, _ = stage(hostile, "mirror", "--json")
    assert again.code == 1 and run_json(again)["copied_files"] == 0
    assert run_json(again)["problems"] == run_json(first)["problems"]
    full, _ = stage(hostile, "verify", "--full", "--json")
    kinds = {p["kind"] for p in run_json(full)["problems"]}
    assert full.code == 1 and kinds <= {*EXPECTED_KINDS.values(), "missing"}, kinds  # "missing": refs/main


# ---------------------------------------------------------------- hostile directory layout

@pytest.mark.parametrize("folder, kind", [("snapshots", "escape"), ("trees", "escape"), (".no_exist", "escape"),
                                          ("refs", "missing")])
def test_a_repo_directory_linked_outside_the_hub_is_never_followed(tmp_path, folder, kind):
    """lstat follows links in the directory part, so `snapshots/` (or `trees/`, `.no_exist/`,
    `refs/`) linked out of the hub would stage outside files; each is a problem instead."""
    staging = build_staging(tmp_path, shards=1, shard_bytes=MiB)
    outside = tmp_path / "outside"
    repo = staging.snapshot.repo.dir
    os.rename(repo / folder, outside)
    os.symlink(str(outside), repo / folder)
    (outside / staging.snapshot.commit).mkdir(exist_ok=True)
    (outside / staging.snapshot.commit / "secret.bin").write_bytes(SECRET)
    with untouched(staging.nas), untouched(outside, what="outside"):
        result = staging.mirror()
    assert "Traceback" not in result.stderr
    assert result.code == 1, result.stderr + result.stdout
    problem, = [p for p in run_json(result)["problems"] if p["kind"] != "ref_not_moved"]
    assert problem["kind"] == kind and f"/{folder}" in problem["path"], problem
    assert not (staging.local / repo.name / folder).exists()
    assert_nothing_from_outside(staging.local)


# ---------------------------------------------------------------- hostile manifests

MANIFEST_CASES = {
    "repo id with traversal": ('[nas]\nhub = "{nas}"\n[models."../../etc"]\n[nodes.dgx1]\nhub = "{local}"\n'
                               'models = ["../../etc"]\n', "../../etc"),
    "owner traversal": ('[nas]\nhub = "{nas}"\n[models."acme/../../etc"]\n[nodes.dgx1]\nhub = "{local}"\n'
                        'models = ["acme/../../etc"]\n', "acme/../../etc"),
    "revision traversal": ('[nas]\nhub = "{nas}"\n[models."acme/W"]\nrevision = "../../../etc"\n'
                           '[nodes.dgx1]\nhub = "{local}"\nmodels = ["acme/W"]\n', "revision"),
    "not toml": ("[nas\nhub = \n", "not valid TOML"),
    "binary": ("\x00\x01\x02\xff", "cluster.toml"),
    "wrong type": ('[nas]\nhub = 3\n[nodes.dgx1]\nhub = "{local}"\n', "nas.hub"),
    "unknown key": ('[nas]\nhub = "{nas}"\nhubb = "x"\n[nodes.dgx1]\nhub = "{local}"\n', "nas.hubb"),
    "missing nas": ('[nodes.dgx1]\nhub = "{local}"\n', "nas"),
    "relative node hub": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "relative/hub"\n', "nodes.dgx1.hub"),
    "negative reserve": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "{local}"\nreserve = -5\n', "reserve"),
    "absurd reserve": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "{local}"\nreserve = "12 parsecs"\n', "reserve"),
    "local hub is the NAS": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "{nas}"\n', "nodes.dgx1.hub"),
    "local hub inside the NAS": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "{nas}/local"\n', "nodes.dgx1.hub"),
    "NAS inside the local hub": ('[nas]\nhub = "{nas}"\n[nodes.dgx1]\nhub = "{parent}"\n', "nodes.dgx1.hub"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_malformed_manifest_exits_2_naming_the_key(tmp_path, case):
    staging = build_staging(tmp_path, shards=1, shard_bytes=MiB)
    body, named = MANIFEST_CASES[case]
    staging.manifest.write_bytes(body.format(nas=staging.nas, local=staging.local, parent=staging.nas.parent)
                                 .encode("latin-1"))
    around = fs_listing(tmp_path)
    with untouched(staging.nas):
        for command in (["mirror"], ["verify"]):
            result = run_stage(*command, "--node", "dgx1", "--manifest", staging.manifest)
            assert result.code == 2, (command, result.stderr)
            assert "Traceback" not in result.stderr
            line, = result.stderr.strip().splitlines()
            assert line.startswith("stage: error: ") and str(staging.manifest) in line and named in line, line
    assert fs_listing(tmp_path) == around


# ---------------------------------------------------------------- hostile checkpoints

def hostile_header(kind: str) -> bytes:
    if kind == "truncated":
        return b"\x10\x00\x00"
    if kind == "length 2**63":
        return struct.pack("<Q", 2**63) + b"{}" + bytes(64)
    if kind == "not an object":
        body = b'["layers.1.engram.embed.weight"]'
        return struct.pack("<Q", len(body)) + body
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "length 2**63", "not an object"])
def test_hostile_safetensors_header_exits_2_for_pack_engram(tmp_path, kind):
    nas = Hub(tmp_path / "nas" / "hf" / "hub")
    snap = nas.repo(HOSTILE).snapshot()
    snap.add_lfs("model-engram.safetensors", hostile_header(kind), shared=False)
    names = {f"model.layers.1.engram.embed.{part}": "model-engram.safetensors" for part in ("weight", "scale")}
    snap.add_git("model.safetensors.index.json", json.dumps({"weight_map": names}).encode())
    snap.add_git("config.json", b'{"engram_layer_ids": [1]}')
    snap.finish()
    local, engram_dir = tmp_path / "nvme" / "hf" / "hub", tmp_path / "nvme" / "engram"
    manifest = write_manifest(tmp_path / "cluster.toml", nas.root, local, {HOSTILE: {}},
                              extra=f'engram_dir = "{engram_dir}"\n\n[engram]\nmodel = "{HOSTILE}"\nworld = 2\n')
    mirrored = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert mirrored.code == 0 and "Traceback" not in mirrored.stderr, mirrored.stderr
    around = fs_listing(tmp_path)
    for extra in ([], ["--from-nas"]):
        result = run_stage("pack-engram", "--node", "dgx1", "--manifest", manifest, "--json", *extra, timeout=30)
        assert result.code == 2, result.stderr
        assert "Traceback" not in result.stderr
        line, = result.stderr.strip().splitlines()
        assert "model-engram.safetensors" in line, line
    assert fs_listing(tmp_path) == around, "a hostile header stops pack-engram before it writes anything"
    assert_hub_truthful(local, nas.root)


# ---------------------------------------------------------------- hostile archive sources

def test_archive_of_a_hostile_directory(tmp_path):
    """FIFOs and links are left in place (never opened, never followed); names with newlines and
    non-UTF-8 bytes are archived and listed so that `sha256sum -c` checks them."""
    src, dest, outside = tmp_path / "old" / "tp2", tmp_path / "archive", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(SECRET)
    src.mkdir(parents=True)
    dest.mkdir()
    names = ["plain.bin", "with space.bin", "new\nline.bin", os.fsdecode(b"bad-\xff.bin"), "back\\slash.bin"]
    for i, name in enumerate(names):
        (src / name).write_bytes(bytes([i]) * 1000)
    os.mkfifo(src / "fifo")
    os.symlink(str(outside / "secret.bin"), src / "link-out")
    os.symlink(str(outside), src / "dir-link-out")
    with untouched(outside, what="outside"):
        result = run_stage("archive", str(src), str(dest), "--json", timeout=30)
    assert "Traceback" not in result.stderr
    assert result.code == 0, result.stderr + result.stdout
    report = run_json(result)
    assert {Path(p["path"]).name: p["kind"] for p in report["skipped"]} == {
        "fifo": "not_a_file", "link-out": "symlink", "dir-link-out": "symlink"}
    for i, name in enumerate(names):
        assert (dest / "tp2" / name).read_bytes() == bytes([i]) * 1000
        assert not (src / name).exists()
    assert os.path.islink(src / "link-out") and stat.S_ISFIFO(os.lstat(src / "fifo").st_mode)
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=dest, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(b": OK") == len(names)
    assert not any(p.read_bytes() == SECRET for p in dest.rglob("*") if p.is_file())

