"""A group-shared hub stays usable by its group: two real uids of one group (setpriv), one after the
other in either order, under umask 002, 022 and 077, each mirror a setgid hub (mode 2775) and pack
its Engram shards; huggingface_hub then loads the staged cache offline with the NAS's bytes, and
`stage verify` passes as each user. A private hub (0700) stays private whatever the umask.

The lock file used to be created 0644: the second user got exit 3 ("permission denied") for ever."""

from __future__ import annotations

import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from hubgen import random_safetensors
from other_users import as_user, python_for_others
from reliability_support import build_staging, offline_load
from stager.mirror import store_modes


@pytest.fixture
def group_root():
    """A scratch tree other uids can traverse (pytest's tmp_path is root's, mode 0700), and two
    unused uids sharing one unused gid."""
    if os.geteuid() != 0:
        pytest.skip("needs root for setpriv")
    python = python_for_others()
    if python is None or shutil.which("setpriv") is None:
        pytest.skip("no interpreter other users can run, or no setpriv")
    root = Path(tempfile.mkdtemp(prefix="stage-group-"))
    os.chmod(root, 0o755)
    base = random.Random(os.getpid()).randrange(61000, 64000, 4)  # uids no account uses, per test run
    try:
        yield root, python, (base + 1, base + 2), base
    finally:
        shutil.rmtree(root)


def _shared_staging(root: Path, gid: int, hub_mode: int):
    staging = build_staging(root, shards=2, shard_bytes=256 * 1024, engram={0: 12})
    for path in [root, *root.rglob("*")]:  # the NAS and the manifest readable by everyone, as NFS exports are
        if not path.is_symlink():
            os.chmod(path, os.stat(path).st_mode | (0o055 if path.is_dir() else 0o044))
    for place in (staging.local, staging.engram_dir):
        place.mkdir(parents=True)
        os.chown(place, 0, gid)
        os.chmod(place, hub_mode)
    return staging


def _move_nas_ref(staging, tag: int):
    """A new revision on the NAS, so the second user's mirror writes blobs, snapshot directories,
    trees and the ref into directories the first user made."""
    old = staging.snapshot
    snap = old.repo.snapshot()
    shutil.copytree(old.dir, snap.dir, symlinks=True, dirs_exist_ok=True)  # same entries, links to the same blobs
    snap.files.update(old.files)
    snap.sha256.update(old.sha256)
    snap.add_git("notes.txt", b"revision %d\n" % tag)
    snap.add_lfs(f"extra-{tag}.safetensors", random_safetensors(100 + tag, 128 * 1024), shared=tag % 2 == 0)
    snap.finish()
    for path in staging.nas.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, os.stat(path).st_mode | (0o055 if path.is_dir() else 0o044))
    return snap


@pytest.mark.parametrize("umask, order", [(0o002, "first-second"), (0o002, "second-first"),
                                          (0o022, "second-first"), (0o077, "first-second")])
def test_two_users_of_a_group_mirror_a_setgid_hub_in_turn(group_root, umask, order):
    root, python, uids, gid = group_root
    staging = _shared_staging(root, gid, 0o2775)
    users = list(uids) if order == "first-second" else list(reversed(uids))
    homes = {uid: root / f"home-{uid}" for uid in uids}
    for uid, home in homes.items():
        home.mkdir()
        os.chown(home, uid, gid)
    manifest = ["--node", "dgx1", "--manifest", str(staging.manifest)]
    snap = staging.snapshot
    for turn, uid in enumerate(users):
        if turn:
            snap = _move_nas_ref(staging, turn)
        for command in (["mirror"], ["pack-engram"]):
            result = as_user(python, uid, gid, umask, homes[uid], *command, *manifest)
            assert result.returncode == 0, f"uid {uid} (turn {turn}) {command}: {result.stdout}{result.stderr}"
    for uid in users:
        result = as_user(python, uid, gid, umask, homes[uid], "verify", "--full", *manifest)
        assert result.returncode == 0, f"uid {uid} verify: {result.stdout}{result.stderr}"
    # The bytes: huggingface_hub offline reads the NAS's bytes for the revision the NAS names now.
    assert (staging.local / staging.snapshot.repo.dir.name / "refs" / "main").read_text() == snap.commit
    assert offline_load(staging.local) == snap.sha256
    # Everything made in the hub is the group's: setgid directories, group read-write files.
    for place in (staging.local, staging.engram_dir):
        for path in [place, *place.rglob("*")]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            assert st.st_gid == gid, f"{path}: group {st.st_gid}"
            if stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o2775, f"{path}: {stat.S_IMODE(st.st_mode):o}"
            elif (exact := store_modes.file_mode(place, str(path.relative_to(place)))) is not None:
                assert stat.S_IMODE(st.st_mode) == exact, f"{path}: {stat.S_IMODE(st.st_mode):o}"  # huggingface_hub's
            else:
                assert st.st_mode & 0o060 == 0o060, f"{path}: {stat.S_IMODE(st.st_mode):o}"


def test_a_private_hub_stays_private_whatever_the_umask(group_root):
    root, python, (owner, other), gid = group_root
    staging = _shared_staging(root, gid, 0o700)
    for place in (staging.local, staging.engram_dir):
        os.chown(place, owner, gid)
    home = root / "home"
    home.mkdir()
    os.chown(home, owner, gid)
    manifest = ["--node", "dgx1", "--manifest", str(staging.manifest)]
    for command in (["mirror"], ["pack-engram"]):
        result = as_user(python, owner, gid, 0o000, home, *command, *manifest)
        assert result.returncode == 0, result.stdout + result.stderr
    for place in (staging.local, staging.engram_dir):
        for path in [place, *place.rglob("*")]:
            st = os.lstat(path)
            # huggingface_hub's `.refs` are 0666 in any hub (store_modes.py), unreachable behind the 0700 hub.
            if not stat.S_ISLNK(st.st_mode) and not path.name.endswith(".refs"):
                assert st.st_mode & 0o077 == 0, f"{path}: {stat.S_IMODE(st.st_mode):o}"
    result = as_user(python, other, gid, 0o002, home, "verify", *manifest)
    assert result.returncode == 3 and "ermission denied" in result.stderr, result.stdout + result.stderr
