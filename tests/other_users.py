"""The real `stage` CLI run as another uid and gid (setpriv, so root only), by an interpreter that
uid can reach."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO


def python_for_others() -> str | None:
    """An interpreter another uid can run: this one, or the system's of the same version (a pyenv
    build under root's home is not reachable by other users)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/bin:/bin"), f"/usr/bin/{version}"):
        if candidate and os.path.exists(candidate) and _reachable(os.path.realpath(candidate)):
            return candidate
    return None


def _reachable(path: str) -> bool:
    """Whether every directory on the way to `path` lets others through, and others may run it."""
    parts = Path(path).parents
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts) and bool(os.stat(path).st_mode & stat.S_IXOTH)


def as_user(python: str, uid: int, gid: int, umask: int, home: Path, *args: str) -> subprocess.CompletedProcess:
    """`stage *args` as uid:gid with no other groups, under `umask`, in an environment holding only
    HOME, PATH and a PYTHONPATH to this checkout and its packages."""
    paths = [str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    shell = f"umask {umask:03o} && exec \"$@\""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "env", "-i",
                           f"HOME={home}", f"PYTHONPATH={':'.join(paths)}", "PATH=/usr/bin:/bin",
                           "/bin/sh", "-c", shell, "sh", python, "-m", "stager", *args],
                          capture_output=True, text=True, timeout=120)
