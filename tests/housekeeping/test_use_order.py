"""Use is when a process last read a file (its atime): `--until-free` removes the least recently
used first, and this tool's own reads (audit, verify, mirror's look at the node, prune,
pack-engram) leave every atime where it was.

Atimes are set back with os.utime to days ago, older than the mtime, so that a read under
`relatime` (this test filesystem's mount, and most nodes') moves them: a tool that reads a file
plainly, or a rule that counts the directories each scan refreshes, fails here. A real process
(`cat`) is the user that reads a model."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run_stage, write_manifest
from hubgen import Hub, random_safetensors
from other_users import as_user, python_for_others
from reliability_support import needs_root, tmpfs

WANTED, READ, IDLE = "acme/Model", "acme/A-read", "acme/B-idle"  # READ sorts (and is scanned) first
DAY = 86400


def repo(hub: Path, repo_id: str) -> Path:
    return hub / f"models--{repo_id.replace('/', '--')}"


def files_under(root: Path) -> list[str]:
    """Every regular file under `root`, but the tool's own lock files and journal. Listed once:
    each listing moves the atimes of the directories listed, which the checks below must not."""
    return sorted(os.path.join(here, name) for here, _dirs, names in os.walk(root) if "/.locks" not in here + "/"
                  for name in names if os.path.isfile(os.path.join(here, name))
                  and not os.path.islink(os.path.join(here, name)))


def atimes(files: list[str]) -> dict[str, int]:
    return {path: os.lstat(path).st_atime_ns for path in files if os.path.lexists(path)}


def sha256_untouched(path: str) -> str:
    """The file's sha256, read without moving its atime (the test runs as root: CAP_FOWNER)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOATIME)
    with os.fdopen(fd, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def set_atime(paths, seconds_ago: float) -> None:
    """atime `seconds_ago`, mtime kept: under relatime the next read of each moves it again."""
    then = time.time_ns() - int(seconds_ago * 1e9)
    for path in paths:
        os.utime(path, ns=(then, os.lstat(path).st_mtime_ns))


def age_directories(root: Path, seconds_ago: float) -> None:
    """Every directory under `root` (root included), set back after it was listed."""
    for here, _dirs, _names in os.walk(root):
        set_atime([here], seconds_ago)


def read_as_a_user(snapshot: Path) -> None:
    """A real process reading every file of a snapshot, through its links."""
    for path in sorted(p for p in snapshot.rglob("*") if not p.is_dir()):
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)


def node_with_three_repos(root: Path) -> tuple[Path, Path, list[str]]:
    """(manifest, node hub, its files): WANTED, READ and IDLE staged, then READ and IDLE dropped
    from the node's models; every file last read 5 days ago but READ's, read by `cat` just now;
    every directory's atime 10 days old, so that the first listing of each moves it."""
    nas = Hub(root / "nas" / "hf" / "hub")
    hub = root / "nvme" / "hf" / "hub"
    for n, repo_id in enumerate((WANTED, READ, IDLE)):
        snap = nas.repo(repo_id).snapshot()
        snap.add_git("config.json", b'{"n": %d}' % n)
        snap.add_lfs("model.safetensors", random_safetensors(10 + n, 96 * 1024), shared=n != 2)
        snap.finish()
    manifest = write_manifest(root / "cluster.toml", nas.root, hub, {WANTED: {}, READ: {}, IDLE: {}})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    write_manifest(manifest, nas.root, hub, {WANTED: {}})
    files = files_under(hub)
    set_atime(files, 5 * DAY)
    before = atimes(files)
    read_as_a_user(next((repo(hub, READ) / "snapshots").iterdir()))
    if atimes(files) == before:
        pytest.skip("this filesystem keeps no atimes (noatime): nothing to order by")
    age_directories(hub, 10 * DAY)
    return manifest, hub, files


def stage(manifest: Path, *args: str):
    return run_stage(*args, "--node", "dgx1", "--manifest", manifest, "--json")


def test_the_tools_own_reads_keep_atimes_and_until_free_removes_the_idle_repo_first(tmp_path):
    needs_root()
    with tmpfs(tmp_path / "nvme", 64 * 1024 * 1024):  # free space that only this test changes
        manifest, hub, files = node_with_three_repos(tmp_path)
        wanted = [p for p in files if p.startswith(str(repo(hub, WANTED)))]
        seen = atimes(files)
        hashes = {p: sha256_untouched(p) for p in files if not p.startswith(str(repo(hub, IDLE)))}
        for args in (("audit",), ("verify", "--full"), ("verify",), ("mirror",), ("mirror", "--full"),
                     ("prune", "--dry-run"), ("audit",)):
            ran = stage(manifest, *args)
            assert ran.code == 0, (args, ran.stdout, ran.stderr)
            assert atimes(files) == seen, f"stage {' '.join(args)} moved atimes"
        assert wanted and all(seen[p] < time.time_ns() - 4 * DAY * 10**9 for p in wanted)
        # Every directory has been listed by now, READ's first (relatime moved their atimes): use
        # does not see it, and the repo idle for days goes first.
        plan = stage(manifest, "audit").json["reclaim"]
        assert [(i["kind"], i["path"]) for i in plan] == [("unlisted-repo", str(repo(hub, IDLE))),
                                                          ("unlisted-repo", str(repo(hub, READ)))]
        vfs = os.statvfs(hub)
        one_item = str(vfs.f_bavail * vfs.f_frsize + 1)
        dry = stage(manifest, "prune", "--until-free", one_item, "--dry-run")
        assert [i["path"] for i in dry.json["removed"]] == [str(repo(hub, IDLE))], dry.stdout
        assert atimes(files) == seen
        ran = stage(manifest, "prune", "--until-free", one_item)
        assert ran.code == 0 and [i["path"] for i in ran.json["removed"]] == [str(repo(hub, IDLE))], ran.stdout
        assert not repo(hub, IDLE).exists() and {p: sha256_untouched(p) for p in hashes} == hashes


def test_pack_engram_and_its_verify_keep_the_atimes_of_the_checkpoint_and_the_shards(tmp_path):
    from engram_fixtures import build, pack

    env = build(tmp_path)
    checkpoint = files_under(env["local"])
    set_atime(checkpoint, 10 * DAY)
    seen = atimes(checkpoint)
    pack(env)
    assert atimes(checkpoint) == seen, "pack-engram moved the checkpoint's atimes"
    shards = files_under(env["dir"])
    assert any(p.endswith(".bin") or "shard" in p for p in shards), shards
    set_atime(shards, 10 * DAY)
    packed = atimes(shards)
    ran = stage(env["manifest"], "verify", "--full")
    assert ran.code == 0, ran.stdout + ran.stderr
    assert atimes(shards) == packed and atimes(checkpoint) == seen, "verify --full moved atimes"


def test_a_user_who_may_not_keep_atimes_still_reads(tmp_path):
    """O_NOATIME needs the file's owner (or CAP_FOWNER): another user's verify opens plainly, and
    its reads count as use, as any reader's would; the owner's keep the atimes."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python_for_others() is None:
        pytest.skip("needs root, setpriv and an interpreter other users can run")
    root = Path(tempfile.mkdtemp(prefix="stage-atime-"))
    try:
        os.chmod(root, 0o755)
        nas = Hub(root / "nas" / "hf" / "hub")
        hub = root / "nvme" / "hf" / "hub"
        snap = nas.repo(WANTED).snapshot()
        snap.add_lfs("model.safetensors", random_safetensors(1, 96 * 1024))
        snap.finish()
        manifest = write_manifest(root / "cluster.toml", nas.root, hub, {WANTED: {}})
        assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
        for path in [root, *root.rglob("*")]:
            if not path.is_symlink():
                os.chmod(path, os.stat(path).st_mode | (0o055 if path.is_dir() else 0o044))
        files = files_under(hub)
        set_atime(files, 10 * DAY)
        seen = atimes(files)
        assert stage(manifest, "verify", "--full").code == 0 and atimes(files) == seen
        other = as_user(python_for_others(), 61999, 61999, 0o022, root, "verify", "--node", "dgx1",
                        "--manifest", str(manifest), "--full", "--json")
        assert other.returncode == 0, other.stdout + other.stderr
        assert any(atimes(files)[p] > seen[p] for p in seen)  # plain reads: relatime moved them
    finally:
        shutil.rmtree(root)
