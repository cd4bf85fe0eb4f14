"""File and directory modes in the node's shared store, as huggingface_hub 2.4 writes them.

Read from its `utils/_shared_blobs.py`: payloads and the store marker are read-only, readable by
whoever can traverse the hub (0400, plus group and other read where the hub grants them x);
`.refs` manifests are 0666, so another user's huggingface_hub can append its own referrers;
store directories copy the hub's own mode, setgid and sticky bits included (a group-shared hub
stays group-shared). Files elsewhere in the hub keep the default mode less the umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from stager.mirror.hub import SHARED_MARKER, SHARED_STORE, is_shared_payload

MANIFEST_MODE = 0o666


def _hub_mode(local_hub: Path) -> int:
    return stat.S_IMODE(os.stat(local_hub).st_mode)


def file_mode(local_hub: Path, rel: str) -> int | None:
    """The exact mode for hub-relative `rel`, or None for "default, less the umask"."""
    if rel == SHARED_MARKER or is_shared_payload(rel):
        hub = _hub_mode(local_hub)
        return 0o400 | (0o040 if hub & stat.S_IXGRP else 0) | (0o004 if hub & stat.S_IXOTH else 0)
    if rel.startswith(SHARED_STORE + "/") and rel.endswith(".refs"):
        return MANIFEST_MODE
    return None


def fix_directory(path: Path, local_hub: Path) -> None:
    expected = _hub_mode(local_hub) & (0o777 | stat.S_ISGID | stat.S_ISVTX)
    if stat.S_IMODE(os.lstat(path).st_mode) != expected:
        os.chmod(path, expected)
