"""`stage mirror`: every trap the hand-written mirror scripts fell into, against real files and clients."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_stage, sha256_file, write_manifest
from hubgen import Hub, random_safetensors
from stager.mirror.fingerprint import safetensors_head, sample_spans

FLASH = "acme/Flash-3bpw"
DRAFTER = "acme/Flash-drafter"
MiB = 1024 * 1024


def same_size_pair(seed: int, size: int) -> tuple[bytes, bytes]:
    """Two safetensors files of identical size (and header) whose bytes differ."""
    a = random_safetensors(seed, size)
    b = random_safetensors(seed + 1, size)
    assert len(a) == len(b) and a != b
    return a, b


@pytest.fixture
def trap_nas(tmp_path: Path, nas_hub: Hub, local_hub: Path):
    """A NAS hub with every trap: shared-store two-hop links, an absolute aliased link, a real file,
    same-size different shards, nested paths, an excluded folder, nested refs and junk."""
    snap = nas_hub.repo(FLASH).snapshot()
    snap.add_git("config.json", b'{"architectures": ["DeepseekV4ForCausalLM"], "engram_layer_ids": []}')
    snap.add_lfs("model-00001-of-00004.safetensors", random_safetensors(1, 3 * MiB), shared=True)
    snap.add_lfs("model-00002-of-00004.safetensors", random_safetensors(2, 2 * MiB), shared=True,
                 absolute_via="/volume1/hf/hub")
    a, b = same_size_pair(3, 2 * MiB)
    snap.add_lfs("model-00003-of-00004.safetensors", a, shared=False)
    snap.add_lfs("model-00004-of-00004.safetensors", b, shared=False)
    snap.add_lfs("nested/deeper/adapter.safetensors", random_safetensors(5, MiB // 2), shared=True)
    snap.add_real("tokenizer.json", b'{"model": {"type": "BPE"}, "added_tokens": []}')
    snap.add_lfs("page15/experts.safetensors", random_safetensors(15, MiB), shared=False)
    snap.finish(no_exist=("generation_config.json",))
    (snap.repo.dir / "refs" / "refs" / "pr").mkdir(parents=True)
    (snap.repo.dir / "refs" / "refs" / "pr" / "1").write_text(snap.commit)
    # Junk a mirror must never copy.
    (snap.dir / "model-00005-of-00004.safetensors.incomplete").write_bytes(b"partial")
    (snap.repo.dir / "blobs" / ("0" * 64 + ".incomplete")).write_bytes(b"partial")
    (nas_hub.root / ".locks" / snap.repo.dir.name).mkdir(parents=True)
    (nas_hub.root / ".locks" / snap.repo.dir.name / "x.lock").write_bytes(b"")
    drafter = nas_hub.repo(DRAFTER).snapshot()
    drafter.add_git("config.json", b'{"architectures": ["Drafter"]}')
    drafter.add_lfs("model.safetensors", random_safetensors(99, MiB), shared=True)
    drafter.finish()
    manifest = write_manifest(tmp_path / "cluster.toml", nas_hub.root, local_hub,
                              {FLASH: {"exclude": ["page15/**"]}, DRAFTER: {}},
                              aliases={"/volume1/hf/hub": str(nas_hub.root)})
    return {"manifest": manifest, "nas": nas_hub.root, "local": local_hub, "flash": snap, "drafter": drafter}


def mirror(env, *extra) -> dict:
    result = run_stage("mirror", "--node", "dgx1", "--manifest", env["manifest"], "--json", *extra)
    assert result.code == 0, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    return result.json


def staged_entries(local: Path) -> list[Path]:
    return sorted(p for p in local.glob("models--*/snapshots/*/**/*") if p.is_symlink() or p.is_file())


def expected_sha256(env, staged: Path) -> str:
    """The NAS content's sha256, from what the fixture wrote (the NAS's absolute alias links do
    not resolve on this machine, which is the point of `nas.aliases`)."""
    repo, _, _commit, *path = staged.relative_to(env["local"]).parts
    snap = env["flash"] if repo == env["flash"].repo.dir.name else env["drafter"]
    return snap.sha256["/".join(path)]


def test_staged_tree_is_self_contained_and_byte_identical(trap_nas):
    report = mirror(trap_nas)
    local = trap_nas["local"]
    entries = staged_entries(local)
    assert len(entries) == report["entries"] == 9
    real_local = os.path.realpath(local)
    for entry in entries:
        # Every hop is a relative link that stays inside the local hub...
        hop = entry
        while hop.is_symlink():
            target = os.readlink(hop)
            assert not os.path.isabs(target), f"{hop} -> {target}"
            hop = Path(os.path.normpath(hop.parent / target))
            assert str(hop).startswith(str(local)), f"{entry} leaves the local hub at {hop}"
        # ...ending in a local regular file with the NAS's bytes.
        assert hop.is_file() and not hop.is_symlink()
        assert os.path.realpath(entry).startswith(real_local + "/")
        assert sha256_file(entry) == expected_sha256(trap_nas, entry)
    assert report["copied_bytes"] == sum(os.path.getsize(e) for e in entries)


def test_shared_store_is_reproduced_with_marker_and_manifests(trap_nas):
    mirror(trap_nas)
    local, nas = trap_nas["local"], trap_nas["nas"]
    assert (local / "blobs" / ".huggingface-shared-blobs").read_bytes() == b"1\n"
    payloads = [p for p in (local / "blobs").glob("??/*") if not p.name.endswith(".refs")]
    assert len(payloads) == 4  # shards 1, 2 (absolute alias), the nested adapter, and the drafter
    for payload in payloads:
        assert payload.is_file() and not payload.is_symlink()
        refs = payload.with_name(payload.name + ".refs")
        assert refs.read_bytes() == (nas / refs.relative_to(local)).read_bytes()


def test_loads_offline_with_huggingface_hub_and_safetensors(trap_nas):
    mirror(trap_nas)
    code = f"""
import warnings, json, sys
warnings.simplefilter("error")
from huggingface_hub import snapshot_download, hf_hub_download, scan_cache_dir
from safetensors import safe_open
info = scan_cache_dir()
assert not info.warnings, info.warnings
assert {{r.repo_id for r in info.repos}} == {{"{FLASH}", "{DRAFTER}"}}
path = snapshot_download("{FLASH}", ignore_patterns=["page15/**"])
shard = hf_hub_download("{FLASH}", "model-00002-of-00004.safetensors")
nested = hf_hub_download("{FLASH}", "nested/deeper/adapter.safetensors")
drafter = hf_hub_download("{DRAFTER}", "model.safetensors")
out = {{}}
for f in (shard, nested, drafter):
    with safe_open(f, "np") as st:
        out[f] = {{k: st.get_tensor(k).tobytes().hex()[:64] for k in st.keys()}}
print(json.dumps({{"snapshot": path, "tensors": out}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(trap_nas["local"]), "HF_HOME": str(trap_nas["local"].parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert loaded["snapshot"].startswith(str(trap_nas["local"]))
    from safetensors import safe_open

    for path, tensors in loaded["tensors"].items():
        assert path.startswith(str(trap_nas["local"]))
        # Compare with the NAS copy, reached through its final regular file in the NAS hub.
        nas_file = trap_nas["nas"] / Path(os.path.realpath(path)).relative_to(os.path.realpath(trap_nas["local"]))
        with safe_open(nas_file, "np") as st:
            assert tensors == {k: st.get_tensor(k).tobytes().hex()[:64] for k in st.keys()}


def test_excluded_entries_are_not_created_and_are_reported(trap_nas):
    report = mirror(trap_nas)
    assert report["excluded"] == ["page15/experts.safetensors"]
    snapshot = trap_nas["local"] / trap_nas["flash"].dir.relative_to(trap_nas["nas"])
    assert not os.path.lexists(snapshot / "page15")
    excluded_sha = trap_nas["flash"].files["page15/experts.safetensors"]["lfs_sha256"]
    assert not list(trap_nas["local"].rglob(excluded_sha))
    # Offline, the cached trees listing marks the snapshot incomplete unless the same patterns are ignored.
    code = f"""
from huggingface_hub import snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError
try:
    snapshot_download("{FLASH}")
    raise SystemExit("complete?")
except IncompleteSnapshotError:
    pass
print(snapshot_download("{FLASH}", ignore_patterns=["page15/**"]))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(trap_nas["local"])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_real_file_in_snapshot_is_copied_as_a_file(trap_nas):
    mirror(trap_nas)
    staged = trap_nas["local"] / trap_nas["flash"].dir.relative_to(trap_nas["nas"]) / "tokenizer.json"
    assert staged.is_file() and not staged.is_symlink()
    assert staged.read_bytes() == (trap_nas["flash"].dir / "tokenizer.json").read_bytes()


def _final(env, path: str) -> Path:
    entry = env["local"] / env["flash"].dir.relative_to(env["nas"]) / path
    return Path(os.path.realpath(entry))


@pytest.mark.parametrize("damage", ["zeros", "other_weight"])
def test_stale_same_size_local_file_with_newer_mtime_is_recopied(trap_nas, damage):
    mirror(trap_nas)
    target = _final(trap_nas, "model-00003-of-00004.safetensors")
    good = sha256_file(target)
    size = target.stat().st_size
    if damage == "zeros":  # a preallocated partial copy
        target.write_bytes(b"\0" * size)
    else:  # another file's content, same size
        target.write_bytes(_final(trap_nas, "model-00004-of-00004.safetensors").read_bytes())
    os.utime(target, (target.stat().st_atime + 3600, target.stat().st_mtime + 3600))
    report = mirror(trap_nas)
    assert report["copied_files"] == 1
    assert sha256_file(target) == good


def test_second_run_copies_nothing_and_rewrites_nothing(trap_nas):
    mirror(trap_nas)
    local = trap_nas["local"]
    before = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in local.rglob("*") if p.name != "stager.lock"}
    report = mirror(trap_nas)
    assert (report["copied_files"], report["copied_bytes"], report["problems"]) == (0, 0, [])
    after = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in local.rglob("*") if p.name != "stager.lock"}
    assert before == after


def test_wrong_hardlink_between_different_weights_is_split(trap_nas):
    """Two same-size shards that differ only outside the sampled regions, wrongly hardlinked."""
    snap = trap_nas["flash"]
    seed = 7
    a = bytearray(random_safetensors(40, 2 * MiB))
    head = safetensors_head(bytes(a[:9]), len(a))
    spans = sample_spans(len(a), seed, head)
    hole = next(off for off in range(head, len(a) - 4096, 4096)
                if all(not (s <= off < s + n or s <= off + 4096 <= s + n) for s, n in spans))
    b = bytearray(a)
    b[hole:hole + 16] = bytes(x ^ 0xFF for x in b[hole:hole + 16])
    snap.add_lfs("twin-a.safetensors", bytes(a), shared=False)
    snap.add_lfs("twin-b.safetensors", bytes(b), shared=False)
    snap.finish(trees=False)
    mirror(trap_nas, "--seed", str(seed))
    fa, fb = _final(trap_nas, "twin-a.safetensors"), _final(trap_nas, "twin-b.safetensors")
    # What a size-only dedup did in the field: bind both names to one inode.
    fb.unlink()
    os.link(fa, fb)
    assert fa.stat().st_ino == fb.stat().st_ino
    report = mirror(trap_nas, "--seed", str(seed))
    assert report["copied_files"] == 2
    assert fa.stat().st_ino != fb.stat().st_ino
    assert (fa.read_bytes(), fb.read_bytes()) == (bytes(a), bytes(b))


def test_same_size_different_weights_are_never_linked(trap_nas):
    mirror(trap_nas)
    f3, f4 = _final(trap_nas, "model-00003-of-00004.safetensors"), _final(trap_nas, "model-00004-of-00004.safetensors")
    assert f3.stat().st_size == f4.stat().st_size
    assert f3.stat().st_ino != f4.stat().st_ino and f3.stat().st_nlink == f4.stat().st_nlink == 1
    assert sha256_file(f3) != sha256_file(f4)


def test_local_snapshot_link_still_pointing_at_the_nas_is_replaced(trap_nas):
    snap = trap_nas["flash"]
    name = "model-00001-of-00004.safetensors"
    stale = trap_nas["local"] / snap.dir.relative_to(trap_nas["nas"]) / name
    stale.parent.mkdir(parents=True)
    os.symlink(os.path.realpath(snap.dir / name), stale)  # an old script's absolute link into the NAS
    report = mirror(trap_nas)
    assert report["problems"] == []
    assert not os.path.isabs(os.readlink(stale))
    assert os.path.realpath(stale).startswith(os.path.realpath(trap_nas["local"]) + "/")
    assert sha256_file(stale) == sha256_file(snap.dir / name)


def test_hf_metadata_is_byte_exact_and_junk_is_left_behind(trap_nas):
    mirror(trap_nas)
    local, nas, snap = trap_nas["local"], trap_nas["nas"], trap_nas["flash"]
    repo = snap.repo.dir.relative_to(nas)
    for ref in ("refs/main", "refs/refs/pr/1"):
        assert (local / repo / ref).read_bytes() == snap.commit.encode()  # 40 hex, no newline
    tree = f"trees/{snap.commit}.json"
    assert (local / repo / tree).read_bytes() == (nas / repo / tree).read_bytes()
    assert (local / repo / ".no_exist" / snap.commit / "generation_config.json").is_file()
    assert not list(local.rglob("*.incomplete"))
    assert [p.name for p in (local / ".locks").rglob("*") if p.is_file()] == ["stager.lock"]
    for entry in staged_entries(local):
        final = Path(os.path.realpath(entry))
        nas_final = nas / final.relative_to(local)  # same hub-relative place on the NAS
        assert final.stat().st_mtime_ns == nas_final.stat().st_mtime_ns, entry


def test_space_preflight_refuses_before_copying(trap_nas, tmp_path):
    manifest = trap_nas["manifest"]
    manifest.write_text(manifest.read_text().replace('reserve = "0"', 'reserve = "100000TiB"'))
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 3
    assert "need" in result.stderr and "free" in result.stderr and "reserve" in result.stderr
    assert "GiB" in result.stderr or "TiB" in result.stderr
    assert "Traceback" not in result.stderr
    assert not [p for p in trap_nas["local"].rglob("*") if p.is_file() and p.name != "stager.lock"]


def test_second_writer_refuses_with_a_lock_message(trap_nas):
    lock = trap_nas["local"] / ".locks" / "stager.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        result = run_stage("mirror", "--node", "dgx1", "--manifest", trap_nas["manifest"])
    # The holder is named from the kernel's lock table (this process), never from the file's text.
    assert result.code == 3
    assert "locked" in result.stderr and f"pid {os.getpid()}" in result.stderr and "4242" not in result.stderr
    assert not list(trap_nas["local"].glob("models--*"))


def test_escaping_dangling_and_looping_links_are_problems_and_the_rest_stages(trap_nas, tmp_path):
    snap = trap_nas["flash"]
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not a weight")
    snap.add_raw_link("escape-relative.bin", "../../../../../../secret.bin")
    snap.add_raw_link("escape-absolute.bin", str(outside))
    snap.add_raw_link("dangling.bin", "../../blobs/" + "f" * 64)
    snap.add_raw_link("loop-a.bin", "loop-b.bin")
    snap.add_raw_link("loop-b.bin", "loop-a.bin")
    result = run_stage("mirror", "--node", "dgx1", "--manifest", trap_nas["manifest"], "--json")
    assert result.code == 1, result.stderr
    kinds = {Path(p["path"]).name: p["kind"] for p in result.json["problems"] if p["kind"] != "ref_not_moved"}
    assert kinds == {"escape-relative.bin": "escape", "escape-absolute.bin": "escape",
                     "dangling.bin": "dangling", "loop-a.bin": "loop", "loop-b.bin": "loop"}
    assert result.json["entries"] == 9
    # The rest stages, but no ref moves onto a snapshot that is not whole on the node.
    unmoved = [p["path"] for p in result.json["problems"] if p["kind"] == "ref_not_moved"]
    assert unmoved and all(not Path(p).exists() for p in unmoved)
    assert not [p for p in (trap_nas["local"] / "models--acme--Flash-3bpw").glob("refs/**/*") if p.is_file()]
    assert not list(trap_nas["local"].rglob("secret.bin"))
    assert not [p for p in trap_nas["local"].rglob("*") if p.is_file() and p.read_bytes() == b"not a weight"]


def test_dry_run_writes_nothing(trap_nas):
    result = run_stage("mirror", "--node", "dgx1", "--manifest", trap_nas["manifest"], "--dry-run", "--json")
    assert result.code == 0, result.stderr
    assert result.json["dry_run"] is True and result.json["copied_files"] == 9
    assert not trap_nas["local"].exists()


def test_json_contract_and_quiet_stdout(trap_nas):
    result = run_stage("mirror", "--node", "dgx1", "--manifest", trap_nas["manifest"], "--json")
    data = json.loads(result.stdout)  # exactly one object, nothing else on stdout
    assert {"copied_files", "copied_bytes", "entries", "excluded", "problems", "seconds"} <= set(data)
    assert isinstance(data["seconds"], float)
    assert "%|" not in result.stderr  # no progress bar when not on a terminal
    verify = run_stage("verify", "--node", "dgx1", "--manifest", trap_nas["manifest"], "--json")
    assert verify.code == 0 and {"checked", "ok", "problems"} <= set(verify.json)
    assert verify.json["checked"] == verify.json["ok"] > 0


def test_progress_bar_on_a_terminal(trap_nas):
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "stager", "mirror", "--node", "dgx1", "--manifest",
                             str(trap_nas["manifest"])], stdout=child, stderr=child, env={**os.environ, "COLUMNS": "100"})
    os.close(child)
    output = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=120) == 0
    text = output.decode(errors="replace")
    assert "B/s" in text and "100%" in text, text


def test_manifest_from_env_and_default_path(trap_nas, tmp_path):
    result = run_stage("mirror", "--node", "dgx1", "--json", env={"STAGE_MANIFEST": str(trap_nas["manifest"])})
    assert result.code == 0, result.stderr
    workdir = tmp_path / "work"
    (workdir / "manifests").mkdir(parents=True)
    (workdir / "manifests" / "cluster.toml").write_text(trap_nas["manifest"].read_text())
    result = run_stage("verify", "--node", "dgx1", "--json", cwd=workdir, env={"STAGE_MANIFEST": ""})
    assert result.code == 0, result.stderr


@pytest.mark.parametrize("body, key", [
    ('[nas]\nhub = "/x"\nsurprise = 1\n', "nas.surprise"),
    ('[nas]\nhub = "/x"\n[nodes.dgx1]\nhub = "/y"\nreserve = "plenty"\n', "nodes.dgx1.reserve"),
    ('[nas]\nhub = "/x"\n[nodes.dgx1]\nhub = "/y"\nmodels = ["a/b"]\n', "nodes.dgx1.models"),
    ('[nas]\nhub = 7\n', "nas.hub"),
    ('[nas]\nhub = "/x"\n[models."../../etc"]\n', "models"),
    ('[nas\nhub = "/x"\n', "TOML"),
    ('[nas]\nhub = "/x"\n[nodes.dgx1]\nhub = "relative/path"\n', "nodes.dgx1.hub"),
])
def test_bad_manifest_exits_2_naming_file_and_key(tmp_path, body, key):
    manifest = tmp_path / "bad.toml"
    manifest.write_text(body)
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 2
    assert str(manifest) in result.stderr and key in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unknown_node_and_model_exit_2(trap_nas):
    result = run_stage("mirror", "--node", "dgx9", "--manifest", trap_nas["manifest"])
    assert result.code == 2 and "dgx9" in result.stderr
    result = run_stage("mirror", "--node", "dgx1", "--model", "acme/nope", "--manifest", trap_nas["manifest"])
    assert result.code == 2 and "acme/nope" in result.stderr


def test_unreachable_nas_exits_3(trap_nas, tmp_path):
    manifest = trap_nas["manifest"]
    manifest.write_text(manifest.read_text().replace(str(trap_nas["nas"]), str(tmp_path / "gone")))
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 3 and "not reachable" in result.stderr


def test_model_filter_stages_only_that_model(trap_nas):
    report = mirror(trap_nas, "--model", DRAFTER)
    assert report["entries"] == 2
    assert not list(trap_nas["local"].glob("models--acme--Flash-3bpw"))


def test_python_dash_m_entry_point(trap_nas):
    proc = subprocess.run([sys.executable, "-m", "stager", "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "mirror" in proc.stdout
