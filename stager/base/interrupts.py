"""Holding SIGINT and SIGTERM off while a thing this run creates is not yet in its clean-up's reach.

The command's handler (stager.cli.app) raises an exception in the main thread, so that every
`finally` on the way out removes what it made. It runs between any two bytecodes, and that includes
the moment after `os.open` made a temp file and before the name is held where the `except` that
removes it can see it: the signal then left a `.stage-*.tmp` behind (CI's archive-signal test, now
and then). Raising the handler's exception can never be made atomic with a system call, so instead
the few steps from creating a thing to holding it run as one block, and a signal landing inside is
delivered as the block ends, where the clean-up already knows what to remove.

Only the main thread runs Python's signal handlers, so only its blocks count (the depth is per
thread). Blocking the signal with pthread_sigmask would not do: the kernel hands it to another
thread, and Python still runs the handler in the main thread.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_main = threading.local()


def held_back(signum: int) -> bool:
    """For the signal handler, first: True if the main thread is inside a `signals_held` block, and
    then `signum` is kept and raised again as the block ends. Imports and allocates nothing."""
    if getattr(_main, "depth", 0) > 0:
        _main.pending = signum
        return True
    return False


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A signal arriving inside the block reaches its handler as the block ends (and so raises out
    of the `with` statement); one that arrived before it or after it is not affected."""
    _main.depth = getattr(_main, "depth", 0) + 1
    try:
        yield
    finally:
        _main.depth -= 1
        pending = getattr(_main, "pending", None)
        if _main.depth == 0 and pending is not None:
            _main.pending = None
            signal.raise_signal(pending)  # the handler runs now, outside the block
