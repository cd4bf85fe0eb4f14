"""Fixtures for the operations commands (archive, audit, binds): a container's read-only mounts
made for real, and the CLI run against a demo node. Real faults (tmpfs, read-only binds) come from
reliability_support."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from conftest import run_stage
from reliability_support import MiB, needs_root, read_only_bind, tmpfs


def umount(mountpoint: Path) -> None:
    if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)  # a straggler still holds it


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


__all__ = ["MiB", "container_view", "needs_root", "read_only_bind", "stage", "tmpfs", "umount"]
