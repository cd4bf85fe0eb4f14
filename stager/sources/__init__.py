"""Where stager reads hubs from: a path (`local.py`) or an `sftp://` peer (`sftp.py`).

Both build on `base.py` alone, so the layer has no import circle; the sftp module, which
needs paramiko, is loaded only for an `sftp://` URL.
"""

from __future__ import annotations

from stager.sources.base import Source
from stager.sources.local import LocalSource


def open_source(hub: str, aliases: dict[str, str]) -> Source:
    """A Source for a path or URL. sftp:// sources need the optional paramiko dependency."""
    if "://" in hub and not hub.startswith("file://"):
        from stager.sources.sftp import open_remote_source

        return open_remote_source(hub, aliases)
    return LocalSource(hub.removeprefix("file://"), aliases)
