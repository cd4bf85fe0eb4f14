"""Where stager reads hubs from: a path (`local.py`) or an `sftp://` peer (`sftp.py`), either
read at a limited rate (`throttle.py`, `--bwlimit`).

All build on `base.py` alone, so the layer has no import circle; the sftp module, which
needs paramiko, is loaded only for an `sftp://` URL.
"""

from __future__ import annotations

from stager.sources.base import Source
from stager.sources.local import LocalSource
from stager.sources.throttle import Throttle, ThrottledSource


def open_source(hub: str, aliases: dict[str, str], throttle: Throttle | None = None) -> Source:
    """A Source for a path or URL, read through `throttle` when there is one. sftp:// sources need
    the optional paramiko dependency."""
    if "://" in hub and not hub.startswith("file://"):
        from stager.sources.sftp import open_remote_source

        source = open_remote_source(hub, aliases)
    else:
        source = LocalSource(hub.removeprefix("file://"), aliases)
    return source if throttle is None else ThrottledSource(source, throttle)
