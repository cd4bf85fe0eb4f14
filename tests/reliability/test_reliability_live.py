"""The states a live cluster passes through: aliased destinations, a NAS ref that moves, a NAS
snapshot still downloading, sources rewritten during the copy, read-only and conflicting local
trees. Real symlinks, real bind mounts, real concurrent processes; bytes are asserted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import open_files, run_stage, sha256_file, source_writer, write_manifest
from hubgen import Hub, random_safetensors
from reliability_support import (MODEL, STAGE, MiB, Staging, assert_hub_truthful, bind, build_staging, holding,
                                 needs_root, offline_load, read_only_bind, run_json, temp_files, tree_state,
                                 untouched)


@pytest.fixture
def staging(tmp_path: Path) -> Staging:
    return build_staging(tmp_path, shards=3, shard_bytes=2 * MiB)


def _manifest_for(staging: Staging, local: Path | str, nas: Path | str | None = None) -> Path:
    return write_manifest(staging.root / "aliased.toml", Path(nas or staging.nas), Path(local), {MODEL: {}})


# ---------------------------------------------------------------- 1. identity, not path strings

@pytest.mark.parametrize("spelling", ["symlink", "dotdot", "link-then-dotdot", "bind", "relative-nas"])
def test_node_hub_that_is_the_nas_however_spelled_is_refused(staging, tmp_path, spelling):
    """A node hub that is a symlink to the NAS passed the string check; the mirror then wrote its
    lock into the NAS and rewrote a NAS link."""
    if spelling == "bind":
        needs_root()
    staging.mirror()  # something in the NAS-facing tree to compare, and a real layout
    nas_before = tree_state(staging.nas)
    context = contextlib.nullcontext()
    nas = staging.nas
    if spelling == "symlink":
        local = tmp_path / "nvme-link"
        local.symlink_to(staging.nas)
    elif spelling == "dotdot":
        local = Path(str(staging.nas.parent / "x" / ".." / staging.nas.name))
        (staging.nas.parent / "x").mkdir()
    elif spelling == "link-then-dotdot":  # the kernel resolves hop before "..": this is the NAS's own cache/
        (tmp_path / "nvme" / "hop").symlink_to(staging.nas / "models--acme--Weights")
        local = Path(f"{tmp_path}/nvme/hop/../cache")
    elif spelling == "bind":
        local = tmp_path / "bound" / "hub"
        context = bind(staging.nas, local)
    else:
        local = staging.nas / "models--acme--Weights" / "cache"
        nas = os.path.relpath(staging.nas, tmp_path)
    manifest = _manifest_for(staging, local, nas)
    with context:
        for command in (["mirror"], ["mirror", "--full"]):
            result = run_stage(*command, "--node", "dgx1", "--manifest", manifest, cwd=tmp_path)
            assert result.code == 2, result.stderr
            line = result.stderr.strip()
            assert "nodes.dgx1.hub" in line and str(manifest) in line and "\n" not in line
    assert tree_state(staging.nas) == nas_before


def test_node_blobs_directory_linked_into_the_nas_is_remote_and_never_written(staging):
    assert staging.mirror().code == 0
    repo_blobs = staging.local / "models--acme--Weights" / "blobs"
    nas_blobs = staging.nas / "models--acme--Weights" / "blobs"
    for child in repo_blobs.iterdir():
        child.unlink()
    repo_blobs.rmdir()
    repo_blobs.symlink_to(nas_blobs)
    verify = run_json(staging.stage("verify", "--json"))
    remote = [p for p in verify["problems"] if p["kind"] == "remote"]
    assert remote and verify["remote"] == len(remote)
    assert all("outside the local hub" in p["detail"] for p in remote)
    with untouched(staging.nas):
        mirror = staging.mirror()
    assert mirror.code == 3 and "refusing to write through a link" in mirror.stderr
    assert str(repo_blobs) in mirror.stderr and "Traceback" not in mirror.stderr
    binds = run_stage("binds", "--node", "dgx1", "--manifest", staging.manifest, "--json")
    assert all(not b["source"].startswith(str(repo_blobs)) for b in json.loads(binds.stdout)["binds"]
               if b["origin"] == "local")


def test_node_blobs_bind_mounted_from_the_nas_is_remote(staging):
    needs_root()
    assert staging.mirror().code == 0
    repo_blobs = staging.local / "models--acme--Weights" / "blobs"
    with bind(staging.nas / "models--acme--Weights" / "blobs", repo_blobs):
        verify = run_json(staging.stage("verify", "--json"))
        assert verify["remote"] > 0
        assert any("lies in the source" in p["detail"] for p in verify["problems"])
        with untouched(staging.nas):
            mirror = staging.mirror()
        assert mirror.code == 3 and "lies in the source" in mirror.stderr


@pytest.mark.parametrize("lock", [".locks/stager.lock", ".locks"])
def test_a_planted_link_at_the_lock_never_writes_its_target(staging, tmp_path, lock):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "stager.lock").write_bytes(b"precious")
    staging.local.mkdir(parents=True)
    planted = staging.local / lock
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(victim / "stager.lock" if lock.endswith(".lock") else victim)
    result = staging.mirror()
    assert result.code == 3 and "symlink" in result.stderr and "Traceback" not in result.stderr
    assert (victim / "stager.lock").read_bytes() == b"precious"
    assert sorted(p.name for p in victim.iterdir()) == ["stager.lock"]


# ---------------------------------------------------------------- 3. one consistent snapshot per run

def test_a_ref_moved_during_the_run_never_leaves_the_node_on_an_unstaged_commit(tmp_path):
    """The walk and the observer each read refs/main; a ref moved in between named a commit
    whose snapshot was never staged, and the mirror exited 0."""
    nas = Hub(tmp_path / "nas")
    repo = nas.repo(MODEL)
    commits = []
    for seed in (1, 2, 3):
        snap = repo.snapshot()
        for i in range(120):  # many local files to sample: the observer takes a while
            snap.add_lfs(f"part-{i:03d}.bin", random_safetensors(i, 64 * 1024), shared=False)
        snap.add_lfs("model.safetensors", random_safetensors(1000 + seed, 256 * 1024), shared=False)
        snap.finish(ref="main")
        commits.append(snap)
    ref = repo.dir / "refs" / "main"
    local = tmp_path / "nvme"
    manifest = write_manifest(tmp_path / "m.toml", nas.root, local, {MODEL: {}})
    ref.write_text(commits[0].commit)
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    ref.write_text(commits[1].commit)
    lock = local / ".locks" / "stager.lock"
    lock.unlink()
    mover = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "lock, ref, commit = sys.argv[1:]\n"
        "deadline = time.time() + 30\n"
        "while not os.path.exists(lock) and time.time() < deadline: time.sleep(0.0005)\n"
        "open(ref + '.tmp', 'w').write(commit); os.replace(ref + '.tmp', ref)\n"),
        str(lock), str(ref), commits[2].commit])
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    mover.wait(timeout=30)
    assert "Traceback" not in result.stderr
    node_ref = (local / repo.dir.name / "refs" / "main").read_text()
    assert node_ref in (commits[0].commit, commits[1].commit)  # never the commit moved to mid-run
    staged = offline_load(local)
    expected = next(c for c in commits if c.commit == node_ref).sha256
    assert staged == expected


def test_a_failed_copy_keeps_the_ref_where_it_was(staging):
    assert staging.mirror().code == 0
    old = staging.snapshot
    new = Hub(staging.nas).repo(MODEL).snapshot()
    new.add_lfs("model-00001-of-00001.safetensors", random_safetensors(77, 1 * MiB), shared=False)
    unreadable = new.add_real("tokenizer.json", b'{"model": {"type": "BPE"}}')
    new.finish(ref="main")
    os.chmod(unreadable, 0)
    if os.geteuid() == 0:  # root reads through mode 0: make it unreadable for real, a FIFO never opens as a file
        unreadable.unlink()
        os.mkfifo(unreadable)
    result = staging.mirror()
    assert result.code == 1
    ref = staging.local / "models--acme--Weights" / "refs" / "main"
    assert ref.read_text() == old.commit
    assert any(p["kind"] == "ref_not_moved" and p["path"] == str(ref) for p in result.json["problems"])
    assert offline_load(staging.local) == old.sha256


# ---------------------------------------------------------------- 4. a NAS snapshot that is not whole

def _half_downloaded(staging: Staging) -> tuple[str, list[str]]:
    """What a killed `hf download` leaves: refs/main and trees/<commit>.json first, then some files,
    and an `.incomplete` blob beside them."""
    repo = Hub(staging.nas).repo(MODEL)
    snap = repo.snapshot()
    snap.add_git("config.json", b'{"architectures": ["DeepseekV4ForCausalLM"], "v": 2}')
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        snap.add_lfs(name, random_safetensors(50 + i, 1 * MiB), shared=False)
    index = {"metadata": {}, "weight_map": {f"t{i}": n for i, n in enumerate(names)}}
    snap.add_git("model.safetensors.index.json", json.dumps(index).encode())
    snap.finish(ref="main")
    missing = names[1:]
    for name in missing:
        link = snap.dir / name
        blob = link.resolve()
        link.unlink()
        os.replace(blob, blob.with_name(blob.name + ".incomplete"))
    return snap.commit, missing


def test_a_half_downloaded_nas_snapshot_keeps_a_serving_node_where_it_was(staging):
    assert staging.mirror().code == 0
    serving = staging.snapshot
    commit, missing = _half_downloaded(staging)
    # The NAS mid-download is not the node's fault: it is whole on the serving commit, exit 0.
    result = staging.mirror("--full")
    assert result.code == 0 and result.json["problems"] == [], result.stdout
    pending, = result.json["pending"]
    assert (pending["pending_commit"], pending["serving_commit"]) == (commit, serving.commit)
    assert all(name in pending["detail"] for name in missing) and ".incomplete" in pending["detail"]
    assert (staging.local / "models--acme--Weights" / "refs" / "main").read_text() == serving.commit
    assert not (staging.local / "models--acme--Weights" / "snapshots" / commit).exists()
    assert offline_load(staging.local) == serving.sha256
    for args in ((), ("--full",)):
        verify = staging.stage("verify", "--json", *args)
        assert verify.code == 0 and verify.json["problems"] == [], verify.stdout
        assert [p["pending_commit"] for p in verify.json["pending"]] == [commit]


def test_a_half_downloaded_nas_snapshot_is_not_staged_on_a_new_node(staging):
    commit, missing = _half_downloaded(staging)
    result = staging.mirror()
    assert result.code == 1 and "Traceback" not in result.stderr
    assert not (staging.local / "models--acme--Weights" / "refs" / "main").exists()
    detail = next(p["detail"] for p in result.json["problems"] if p["kind"] == "incomplete")
    assert commit in detail and missing[0] in detail


def test_files_absent_on_purpose_are_excluded_and_then_the_snapshot_stages(staging):
    commit, missing = _half_downloaded(staging)
    for name in missing:
        (staging.nas / "models--acme--Weights" / "snapshots" / commit / name).unlink(missing_ok=True)
    index = staging.nas / "models--acme--Weights" / "snapshots" / commit / "model.safetensors.index.json"
    manifest = write_manifest(staging.manifest, staging.nas, staging.local,
                              {MODEL: {"exclude": [*missing, "model.safetensors.index.json"]}})
    assert index.exists()
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert (staging.local / "models--acme--Weights" / "refs" / "main").read_text() == commit


# ---------------------------------------------------------------- 5. a source that changes during the copy

@pytest.mark.parametrize("mode", ["rewrite", "append"])
@pytest.mark.parametrize("full", [False, True])
def test_a_source_written_during_the_copy_is_never_staged_torn(tmp_path, mode, full):
    """A real file inside a snapshot with no trees json has no independent hash: --full took the
    bytes it had just read as the truth, and staged a torn file or a prefix with exit 0."""
    nas = Hub(tmp_path / "nas")
    snap = nas.repo(MODEL).snapshot()
    real = snap.add_real("weights.bin", os.urandom(96 * MiB))
    snap.finish(trees=False)
    manifest = write_manifest(tmp_path / "m.toml", nas.root, tmp_path / "nvme", {MODEL: {}})
    writer = source_writer(real, mode, tmp_path / "nvme")
    try:
        result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json", *(["--full"] if full else []))
    finally:
        writer.kill()
        writer.wait()
    staged = tmp_path / "nvme" / "models--acme--Weights" / "snapshots" / snap.commit / "weights.bin"
    assert "Traceback" not in result.stderr
    assert result.code == 1, "a file written throughout the copy was accepted"
    assert any(p["kind"] == "mismatch" and "changed while it was copied" in p["detail"]
               for p in result.json["problems"]), result.json["problems"]
    assert not staged.exists()
    assert not (tmp_path / "nvme" / "models--acme--Weights" / "refs" / "main").exists()
    assert temp_files(tmp_path / "nvme") == []
    # Once the writer is done, the same command stages the file as it now is.
    again = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json", *(["--full"] if full else []))
    assert again.code == 0, again.stdout
    assert sha256_file(staged) == sha256_file(real)


# ---------------------------------------------------------------- 9. local-side errors name the local side

def test_a_directory_where_a_blob_belongs_is_named_locally(staging):
    assert staging.mirror().code == 0
    blob = next((staging.local / "models--acme--Weights" / "blobs").iterdir())
    target = blob.resolve()
    blob.unlink()
    if target.is_relative_to(staging.local / "models--acme--Weights"):
        target.unlink(missing_ok=True)
    blob.mkdir()
    (blob / "keep").write_text("an operator's file")
    result = staging.mirror()
    assert result.code == 1 and "Traceback" not in result.stderr and "internal error" not in result.stderr
    problem = next(p for p in result.json["problems"] if p["kind"] == "local_conflict")
    assert problem["path"].startswith(str(staging.local)) and str(staging.nas) not in problem["detail"]
    assert (blob / "keep").read_text() == "an operator's file"


def test_a_read_only_node_hub_verifies_and_refuses_only_real_writes(staging, tmp_path):
    needs_root()
    assert staging.mirror().code == 0
    ro = tmp_path / "ro-hub"
    with read_only_bind(staging.local, ro):
        manifest = write_manifest(tmp_path / "ro.toml", staging.nas, ro, {MODEL: {}})
        for command in (["mirror"], ["verify"], ["verify", "--full"]):
            result = run_stage(*command, "--node", "dgx1", "--manifest", manifest)
            assert result.code == 0, (command, result.stderr)
        snap = Hub(staging.nas).repo(MODEL).snapshot()
        snap.add_lfs("new.safetensors", random_safetensors(9, MiB), shared=False)
        snap.finish(ref="main")
        result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
        assert result.code == 3 and str(ro) in result.stderr and "read-only" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_read_only_local_blobs_directory_is_named_with_exit_3(staging, tmp_path):
    needs_root()
    assert staging.mirror().code == 0
    blobs = staging.local / "models--acme--Weights" / "blobs"
    snap = Hub(staging.nas).repo(MODEL).snapshot()
    snap.add_lfs("new.safetensors", random_safetensors(9, MiB), shared=False)
    snap.finish(ref="main")
    with read_only_bind(blobs, blobs):
        result = staging.mirror()
    assert result.code == 3 and str(blobs) in result.stderr and str(staging.nas) not in result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


# ---------------------------------------------------------------- 7. an operator cleaning up during a mirror

def test_a_mirror_survives_an_operator_deleting_what_audit_listed(tmp_path):
    nas = Hub(tmp_path / "nas")
    repo = nas.repo(MODEL)
    for seed in (1, 2):
        snap = repo.snapshot()
        for i in range(60):
            snap.add_lfs(f"part-{i:02d}.bin", random_safetensors(seed * 100 + i, 256 * 1024), shared=i % 2 == 0)
        snap.finish(ref="main")
    local = tmp_path / "nvme"
    manifest = write_manifest(tmp_path / "m.toml", nas.root, local, {MODEL: {}})
    (repo.dir / "refs" / "main").write_text(repo.dir.joinpath("snapshots").iterdir().__next__().name)
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    cleaner = subprocess.Popen([sys.executable, "-c", (
        "import os, shutil, sys, time\n"
        "root = sys.argv[1]\n"
        "end = time.time() + 20\n"
        "while time.time() < end:\n"
        "    for d, dirs, names in os.walk(root):\n"
        "        if d.endswith('/snapshots') or d.endswith('/trees'):\n"
        "            for n in dirs + names:\n"
        "                p = os.path.join(d, n)\n"
        "                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)\n"
        "    time.sleep(0.001)\n"), str(local)])
    try:
        for snapshot in sorted((repo.dir / "snapshots").iterdir()):
            (repo.dir / "refs" / "main").write_text(snapshot.name)
            result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
            assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
            assert result.code in (0, 1), result.stderr
            run_json(result)
    finally:
        cleaner.kill()
        cleaner.wait()
    final = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert final.code == 0, final.stdout
    assert_hub_truthful(local, nas.root)


# ---------------------------------------------------------------- 10. input that makes no sense

def test_excludes_that_remove_every_entry_exit_2(staging):
    manifest = write_manifest(staging.manifest, staging.nas, staging.local, {MODEL: {"exclude": ["*"]}})
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 2 and f'models."{MODEL}".exclude' in result.stderr
    assert not staging.local.exists()


def test_an_excluded_entry_that_a_staged_entry_links_through_exits_2(tmp_path):
    nas = Hub(tmp_path / "nas")
    snap = nas.repo(MODEL).snapshot()
    snap.add_lfs("page15/experts.safetensors", random_safetensors(3, MiB), shared=False)
    snap.add_raw_link("experts.safetensors", "page15/experts.safetensors")
    snap.add_git("config.json", b"{}")
    snap.finish()
    manifest = write_manifest(tmp_path / "m.toml", nas.root, tmp_path / "nvme", {MODEL: {"exclude": ["page15/**"]}})
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 2, result.stderr
    assert "experts.safetensors links through page15/experts.safetensors" in result.stderr
    assert not (tmp_path / "nvme").exists()


# ---------------------------------------------------------------- 12. the shared store, as huggingface_hub writes it

def test_the_node_store_lists_only_the_node_repos_and_takes_hub_modes(tmp_path):
    nas = Hub(tmp_path / "nas")
    shared = random_safetensors(5, MiB)
    for repo_id in (MODEL, "acme/Other"):
        snap = nas.repo(repo_id).snapshot()
        snap.add_lfs("model.safetensors", shared, shared=True)
        snap.finish()
    local = tmp_path / "nvme"
    local.mkdir(mode=0o2775)
    os.chmod(local, 0o2775)  # a group-shared hub
    manifest = write_manifest(tmp_path / "m.toml", nas.root, local, {MODEL: {}, "acme/Other": {}})
    manifest.write_text(manifest.read_text().replace('models = ["acme/Weights", "acme/Other"]', 'models = ["acme/Weights"]'))
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    refs = list((local / "blobs").rglob("*.refs"))
    assert len(refs) == 1
    listed = refs[0].read_text().splitlines()
    assert len(listed) == 1 and listed[0].startswith("models--acme--Weights/blobs/")
    payload = refs[0].with_suffix("")
    assert oct(os.stat(payload).st_mode & 0o7777) == oct(0o444)
    assert oct(os.stat(refs[0]).st_mode & 0o7777) == oct(0o666)
    assert oct(os.stat(local / "blobs" / ".huggingface-shared-blobs").st_mode & 0o7777) == oct(0o444)
    assert os.stat(payload.parent).st_mode & 0o2000  # setgid kept on store directories
    # huggingface_hub's own view of the node: no warnings, and its GC finds nothing to collect.
    code = ("import sys, warnings; warnings.simplefilter('error')\n"
            "from huggingface_hub import scan_cache_dir\n"
            "from huggingface_hub.utils._shared_blobs import unreferenced_shared_blobs\n"
            "info = scan_cache_dir(sys.argv[1]); assert not info.warnings, info.warnings\n"
            "assert not unreferenced_shared_blobs(sys.argv[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_hard_link_planted_at_the_lock_is_refused(staging, tmp_path):
    victim = staging.local.parent / "victim"
    staging.local.mkdir(parents=True)
    victim.write_bytes(b"precious")
    (staging.local / ".locks").mkdir()
    os.link(victim, staging.local / ".locks" / "stager.lock")
    result = staging.mirror()
    assert result.code == 3 and "lock file" in result.stderr
    assert victim.read_bytes() == b"precious"


def test_a_mirror_that_waited_for_the_lock_stages_the_ref_as_it_is_then(staging):
    """`stage mirror --wait` (the Slurm prolog's) reads the NAS's refs before it waits for another
    mirror; a ref moved during the wait is what it must stage once it holds the hub, not the commit
    it read before."""
    assert staging.mirror().code == 0
    new = Hub(staging.nas).repo(MODEL).snapshot()
    new.add_lfs("model-00001-of-00001.safetensors", random_safetensors(91, 1 * MiB), shared=False)
    new.finish(ref=None)
    lock = staging.local / ".locks" / "stager.lock"
    with holding(lock) as holder:
        waiting = subprocess.Popen([*STAGE, "mirror", "--node", "dgx1", "--wait", "60", "--json", "--manifest",
                                    str(staging.manifest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # It has read the ref and opened the lock file: it is waiting for the holder.
        while os.path.realpath(lock) not in open_files(waiting.pid):
            assert waiting.poll() is None, waiting.communicate()
            time.sleep(0.002)
        ref = staging.nas / "models--acme--Weights" / "refs" / "main"
        (ref.parent / "main.tmp").write_text(new.commit)
        os.replace(ref.parent / "main.tmp", ref)
        holder.stdin.close()
        out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, out + err
    assert (staging.local / "models--acme--Weights" / "refs" / "main").read_text() == new.commit
    assert offline_load(staging.local) == new.sha256


def test_a_fifo_planted_at_the_node_ref_is_reported_and_replaced_never_waited_on(staging):
    """verify reads the node's refs to compare them with the NAS's commit; a FIFO at refs/main
    blocked that read forever. It is `not_a_file` now, and the mirror writes the ref over it."""
    assert staging.mirror().code == 0
    ref = staging.local / "models--acme--Weights" / "refs" / "main"
    ref.unlink()
    os.mkfifo(ref)
    verify = staging.stage("verify", "--json", timeout=30)
    assert verify.code == 1, verify.stdout + verify.stderr
    assert [(p["kind"], p["path"]) for p in run_json(verify)["problems"]] == [("not_a_file", str(ref))]
    assert staging.mirror(timeout=30).code == 0
    assert ref.read_text() == staging.snapshot.commit and offline_load(staging.local) == staging.snapshot.sha256
