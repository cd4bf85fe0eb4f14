"""A command's byte progress for the process that started it: how `stage fleet` shows the bytes of
a node-local `stage mirror` or `stage verify` it runs as a Ray task (fleet/live.py), where there
is no terminal to draw a bar on.

The task hands the command the write end of a pipe in PROGRESS_FD. The command writes one line
`STEP DONE TOTAL` when a bar starts (STEP counts the bars: a --full mirror hashes the node's files
before it copies) and as it moves, at most every INTERVAL seconds, and the bar's last line at once.
Writes never wait: the descriptor is non-blocking, and a line that does not fit the pipe is
dropped (a later one says more), so a reader that stops reading never holds the copy.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Callable

PROGRESS_FD = "STAGE_FLEET_PROGRESS_FD"
INTERVAL = 0.25


def from_environment() -> Callable[[int], Callable[[int], None]] | None:
    """A progress factory writing to the descriptor named in PROGRESS_FD; None without one."""
    named = os.environ.get(PROGRESS_FD)
    if named is None:
        return None
    try:
        fd = int(named)
        os.set_blocking(fd, False)
    except (ValueError, OSError):
        return None  # not a descriptor this process holds: no progress, the command runs as ever
    steps = itertools.count(1)

    def factory(total: int) -> Callable[[int], None]:
        step = next(steps)
        lock = threading.Lock()
        state = {"done": 0, "said": 0.0}

        def say(force: bool) -> None:
            now = time.monotonic()
            if force or now - state["said"] >= INTERVAL:
                state["said"] = now
                try:
                    os.write(fd, f"{step} {state['done']} {total}\n".encode())
                except OSError:  # full (EAGAIN) or its reader gone (EPIPE): progress only
                    pass

        def update(n: int) -> None:
            with lock:
                state["done"] += n
                say(state["done"] >= total)

        with lock:
            say(True)
        return update

    return factory


def parse(line: bytes) -> tuple[int, int, int] | None:
    """(step, done, total) from one line, None for anything else."""
    parts = line.split()
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    step, done, total = (int(part) for part in parts)
    return step, done, total
