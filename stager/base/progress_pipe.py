"""A command's byte progress for the process that started it: how `stage fleet` shows the bytes of
a node-local `stage mirror` or `stage verify` it runs as a Ray task (fleet/live.py), where there
is no terminal to draw a bar on.

The task hands the command the write end of a pipe in PROGRESS_FD. The command writes one line
`STEP DONE TOTAL` when a bar starts (STEP counts the bars: a --full mirror hashes the node's files
before it copies) and as it moves, at most every INTERVAL seconds (a count held back is written
once the interval has passed), and the bar's last line at once.
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
    trailing = _Trailing()

    def factory(total: int) -> Callable[[int], None]:
        step = next(steps)
        lock = threading.Lock()
        state = {"done": 0, "said": 0.0}

        def say(force: bool) -> None:
            now = time.monotonic()
            if not force and now - state["said"] < INTERVAL:
                trailing.due(flush)
                return
            state["said"] = now
            try:
                os.write(fd, f"{step} {state['done']} {total}\n".encode())
            except OSError:  # full (EAGAIN) or its reader gone (EPIPE): progress only
                pass

        def update(n: int) -> None:
            with lock:
                state["done"] += n
                say(state["done"] >= total)

        def flush() -> None:
            with lock:
                say(True)

        with lock:
            say(True)
        return update

    return factory


class _Trailing:
    """Counts held back by INTERVAL, written once it has passed, by a thread that runs while any
    wait. Without it a count reached just after a line stayed unsaid until the next: a copy whose
    8 MiB buffers land a file at a time (three files at once) showed one file copied of three
    for seconds, and a node stopped then was reported with a third of what it had copied."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: list[Callable[[], None]] = []
        self.running = False

    def due(self, flush: Callable[[], None]) -> None:
        with self.lock:
            if flush not in self.waiting:
                self.waiting.append(flush)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="stage-progress", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(INTERVAL)
            with self.lock:
                waiting, self.waiting = self.waiting, []
                if not waiting:
                    self.running = False
                    return
            for flush in waiting:
                flush()


def parse(line: bytes) -> tuple[int, int, int] | None:
    """(step, done, total) from one line, None for anything else."""
    parts = line.split()
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    step, done, total = (int(part) for part in parts)
    return step, done, total
