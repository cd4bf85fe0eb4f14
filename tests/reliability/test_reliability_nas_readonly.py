"""The NAS is never written: every command leaves every NAS entry's type, size, mtime, mode, link
target and content exactly as it was, and a mirror works from a read-only bind mount of it."""

from __future__ import annotations

import dataclasses

import pytest

from reliability_support import (MiB, assert_hub_truthful, build_staging, needs_root, read_only_bind, run_json,
                                 tree_state, untouched)


@pytest.fixture
def staging(tmp_path):
    return build_staging(tmp_path, shards=3, shard_bytes=MiB, engram={1: 3001, 14: 2003})


def test_no_command_writes_the_nas(staging, tmp_path):
    with untouched(staging.nas):
        assert staging.stage("mirror", "--dry-run", "--json").code == 0
        assert staging.stage("pack-engram", "--from-nas", "--json").code == 0
        assert staging.mirror().code == 0
        assert staging.mirror("--full").code == 0
        assert staging.stage("verify", "--json").code == 0
        assert staging.verify_full().code == 0
        assert staging.stage("verify", "--full", "--subset", "1/3", "--json").code == 0
        assert staging.stage("binds", "--format", "json").code == 0
        assert staging.stage("audit", "--json", "--prom", str(tmp_path / "stage.prom")).code in (0, 1)
    assert_hub_truthful(staging.local, staging.nas, staging.snapshot)


def test_mirror_from_a_read_only_bind_mount(staging, tmp_path):
    needs_root()
    before = tree_state(staging.nas)
    with read_only_bind(staging.nas, tmp_path / "nas-ro") as ro:
        manifest = tmp_path / "ro.toml"
        manifest.write_text(staging.manifest.read_text().replace(f'hub = "{staging.nas}"', f'hub = "{ro}"'))
        from_ro = dataclasses.replace(staging, manifest=manifest)
        with untouched(ro):
            mirrored = from_ro.mirror()
            assert mirrored.code == 0, mirrored.stderr
            assert run_json(mirrored)["copied_files"] > 0 and run_json(mirrored)["source"] == str(ro)
            assert from_ro.stage("pack-engram", "--json").code == 0
            full = from_ro.verify_full()
            assert full.code == 0, full.stderr + full.stdout
            assert from_ro.mirror("--full").code == 0
    assert tree_state(staging.nas) == before
    assert_hub_truthful(staging.local, staging.nas, staging.snapshot)
