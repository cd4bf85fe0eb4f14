"""Fixtures for the operations commands (archive, audit, binds): real mounts and a staged demo node."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, run_stage

MiB = 1024 * 1024


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for mount(8)")


def umount(mountpoint: Path) -> None:
    if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)  # a straggler still holds it


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size: int) -> Iterator[Path]:
    """A real tmpfs of `size` bytes at `mountpoint`, unmounted whatever happens."""
    needs_root()
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        umount(mountpoint)


@contextlib.contextmanager
def container_view(binds: list[dict]) -> Iterator[None]:
    """Do what `docker run -v src:dst:ro` does, on this host: bind each source read-only at its
    target, creating the mount point (an empty file or directory) as docker does in the rootfs."""
    needs_root()
    mounted: list[Path] = []
    try:
        for bind in binds:
            source, target = Path(bind["source"]), Path(bind["target"])
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                target.mkdir(exist_ok=True)
            else:
                target.touch()
            subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
            mounted.append(target)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        yield
    finally:
        for target in reversed(mounted):
            umount(target)


def stage(manifest: Path, *args: str):
    result = run_stage(*args, "--node", "dgx1", "--manifest", manifest, timeout=180)
    assert result.code == 0, result.stdout + result.stderr
    return result


__all__ = ["MiB", "REPO", "container_view", "needs_root", "stage", "tmpfs", "umount"]
