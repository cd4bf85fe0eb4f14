"""The NAS as a real sshfs mount of a real sshd on 127.0.0.1, for sites without NFS.

sshfs refuses to read any link whose target is absolute or holds "..", which is every link of a
hub cache, unless it is mounted with `-o no_contain_symlinks`. Mounted so, a mirror through it
is byte-identical to a mirror from the NAS's own path, and the same links are refused. A mount
that loses its server stops the run with exit 3 and one line, and a re-run converges."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_stage, write_manifest
from hubgen import Hub, random_safetensors
from reliability_support import assert_hub_truthful, temp_files
from remote_fixtures import (DRAFTER, FLASH, HOSTILE, MiB, SshServer, build_remote_nas, hub_tree, load_offline,
                             manifest_for)
from stager.mirror.hub import walk_repo
from stager.sources.local import LocalSource

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="sshfs mounts need /dev/fuse and root")


@pytest.fixture(scope="module")
def nas(tmp_path_factory) -> dict:
    return build_remote_nas(tmp_path_factory.mktemp("sshfs-nas"))


@contextlib.contextmanager
def sshfs(server: SshServer, remote: Path, mountpoint: Path, *options: str):
    """`remote` on the server, mounted read-only at `mountpoint`; unmounted whatever happened."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    opts = ["ro", f"IdentityFile={server.key}", f"UserKnownHostsFile={server.known_hosts}", "BatchMode=yes",
            "ServerAliveInterval=2", "ServerAliveCountMax=2", *options]
    subprocess.run(["sshfs", "-p", str(server.port), "-o", ",".join(opts), f"{server.user}@127.0.0.1:{remote}",
                    str(mountpoint)], check=True, timeout=30)
    try:
        yield mountpoint
    finally:
        if subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def sshfs_pid(mountpoint: Path) -> int:
    out = subprocess.run(["pgrep", "-f", f"sshfs .*{mountpoint}"], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def mounted(nas: dict, mountpoint: Path) -> dict:
    """The NAS as this node sees it through the mount: its hub and its alias both map there."""
    hub = mountpoint / nas["hub"].relative_to(nas["root"])
    return {**nas, "hub": hub, "aliases": {"/volume1/hf/hub": str(hub)}}


def test_a_mirror_through_sshfs_is_byte_identical_to_the_nas_mirror(nas, sshd, tmp_path):
    direct = tmp_path / "direct" / "hf" / "hub"
    result = run_stage("mirror", "--node", "dgx1", "--json",
                       "--manifest", manifest_for(tmp_path / "direct.toml", nas, str(nas["hub"]), direct))
    assert result.code == 0, result.stderr
    with sshfs(sshd, nas["root"], tmp_path / "mnt", "no_contain_symlinks") as mnt:
        seen = mounted(nas, mnt)
        local = tmp_path / "via-sshfs" / "hf" / "hub"
        manifest = manifest_for(tmp_path / "sshfs.toml", seen, str(seen["hub"]), local)
        first = run_stage("mirror", "--node", "dgx1", "--json", "--manifest", manifest)
        assert first.code == 0, first.stderr
        assert first.json["problems"] == [] and first.json["copied_files"] == result.json["copied_files"]
        again = run_stage("mirror", "--node", "dgx1", "--json", "--manifest", manifest)
        assert again.code == 0 and again.json["copied_bytes"] == 0, again.stderr
        full = run_stage("verify", "--node", "dgx1", "--full", "--json", "--manifest", manifest)
        assert full.code == 0 and full.json["problems"] == [], full.stdout
    assert hub_tree(local) == hub_tree(direct)  # same links, same bytes
    check = assert_hub_truthful(local, nas["hub"])
    assert check.files >= 6 and check.links >= 6 and check.temps == 0
    staged = load_offline(local)
    assert staged == load_offline(direct) and staged["repos"] == [FLASH, DRAFTER]
    assert hub_tree(nas["hub"]) == nas["before"]


def test_hostile_links_are_refused_through_sshfs_as_on_the_nas_path(nas, sshd, tmp_path):
    def kinds(source: LocalSource) -> dict[str, str]:
        snapshot = walk_repo(source, HOSTILE, "main", [])
        return {p.path.rsplit("/snapshots/", 1)[1]: p.kind for p in snapshot.problems}

    direct = kinds(LocalSource(str(nas["hub"]), nas["aliases"]))
    with sshfs(sshd, nas["root"], tmp_path / "mnt", "no_contain_symlinks") as mnt:
        seen = mounted(nas, mnt)
        via = kinds(LocalSource(str(seen["hub"]), seen["aliases"]))
    assert via == direct
    assert {name.split("/", 1)[1]: kind for name, kind in via.items()} == {
        "escape-relative": "escape", "escape-absolute": "escape", "escape-through-dir": "escape",
        "dangling": "dangling", "loop-a": "loop", "loop-b": "loop", "a-directory": "not_a_file",
        "a-fifo": "not_a_file"}


def test_a_default_sshfs_mount_names_each_hidden_link_and_the_remedy(nas, sshd, tmp_path):
    with sshfs(sshd, nas["root"], tmp_path / "mnt") as mnt:
        seen = mounted(nas, mnt)
        local = tmp_path / "local" / "hf" / "hub"
        result = run_stage("mirror", "--node", "dgx1", "--json",
                           "--manifest", manifest_for(tmp_path / "m.toml", seen, str(seen["hub"]), local))
    assert result.code == 1, result.stderr
    assert "Traceback" not in result.stderr
    problems = [p for p in result.json["problems"] if p["kind"] != "ref_not_moved"]
    assert problems and all(p["kind"] == "unreadable" and "no_contain_symlinks" in p["detail"] for p in problems)
    assert not list(local.glob("*/refs/main"))  # no ref onto snapshots with unreadable entries
    flash_links = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                   "nested/deeper/adapter.safetensors"}
    assert {p["path"].rsplit("/", 1)[-1] for p in problems} >= {Path(name).name for name in flash_links}
    # Only what could be read was staged, and nothing staged leads back to the mount.
    assert assert_hub_truthful(local, nas["hub"]).temps == 0
    snapshot = local / f"models--{FLASH.replace('/', '--')}" / "snapshots" / nas["flash"].commit
    assert (snapshot / "tokenizer.json").read_bytes() == b'{"model": {"type": "BPE"}}'
    assert not any(os.path.lexists(snapshot / name) for name in flash_links)


def test_a_lost_sshfs_server_stops_the_run_with_exit_3_and_a_rerun_converges(sshd, tmp_path):
    hub = Hub(tmp_path / "nas" / "hf" / "hub")
    big = hub.repo("acme/Big").snapshot()
    for index in range(4):
        big.add_lfs(f"model-{index}.safetensors", random_safetensors(40 + index, 48 * MiB), shared=index % 2 == 0)
    big.finish()
    before = hub_tree(hub.root)
    local = tmp_path / "local" / "hf" / "hub"
    nas = {"root": tmp_path / "nas", "hub": hub.root, "aliases": {}}
    with sshfs(sshd, nas["root"], tmp_path / "mnt", "no_contain_symlinks") as mnt:
        seen = mounted(nas, mnt)
        manifest = write_manifest(tmp_path / "m.toml", seen["hub"], local, {"acme/Big": {}})
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
        proc = subprocess.Popen([sys.executable, "-m", "stager", "mirror", "--node", "dgx1", "--manifest", str(manifest)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not temp_files(local):  # kill the mount while a blob is being copied
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        os.kill(sshfs_pid(mnt), signal.SIGKILL)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage: error: NAS unreachable: ") and str(mnt) in lines[0], err
    assert temp_files(local) == []
    assert_hub_truthful(local, hub.root)  # whatever is under a final name holds the NAS's bytes
    with sshfs(sshd, nas["root"], tmp_path / "mnt", "no_contain_symlinks"):
        result = run_stage("mirror", "--node", "dgx1", "--json", "--manifest", manifest)
        assert result.code == 0, result.stderr
    check = assert_hub_truthful(local, hub.root, big)
    assert check.ref_present and check.files >= 4 and check.temps == 0  # blobs, plus ref, .refs and trees
    assert hub_tree(hub.root) == before
