"""Thread pools that stop their work when the run ends early.

A `with ThreadPoolExecutor()` block that is left by an exception (Ctrl-C, SIGTERM, a full disk)
runs every task still queued before it lets the exception through, unless something cancels
them: `Executor.map` cancels its own when its iterator is closed, tasks given to `submit` are
not. Here queued tasks are cancelled whichever way they were queued, and the running ones are
told to stop: a task's long loops call `stop_point()` between chunks, which raises `Stopped`
once its pool is being left. Ctrl-C during a copy of a 20 GB shard once waited for the whole
file; now it waits for one chunk, and the temp file is discarded on the way out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

_task = threading.local()  # the stop event of the pool whose task this thread runs now
_running_lock = threading.Lock()
_running: dict[str, int] = {}  # what is in flight, by the noun its pool gives it


class Stopped(Exception):
    """The run is ending: the task stops at its next chunk, and what it was writing is discarded."""


def stop_point() -> None:
    """Raise Stopped if this thread's pool is being left; a no-op outside a pool's task."""
    event = getattr(_task, "stop", None)
    if event is not None and event.is_set():
        raise Stopped("stopped: the run is ending")


def in_flight() -> dict[str, int]:
    """{noun: tasks running now}, e.g. {"copies": 2}: what an interrupted run says it is stopping."""
    with _running_lock:
        return {noun: n for noun, n in _running.items() if n}


class _StoppablePool(ThreadPoolExecutor):
    def __init__(self, jobs: int, name: str, noun: str, stop: threading.Event):
        super().__init__(max(1, jobs), thread_name_prefix=name)
        self._noun = noun
        self._stop = stop

    def submit(self, fn, /, *args, **kwargs):
        def task():
            _task.stop = self._stop
            with _running_lock:
                _running[self._noun] = _running.get(self._noun, 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                with _running_lock:
                    _running[self._noun] -= 1
                _task.stop = None

        return super().submit(task)


@contextlib.contextmanager
def worker_pool(jobs: int, name: str, noun: str = "tasks") -> Iterator[ThreadPoolExecutor]:
    stop = threading.Event()
    pool = _StoppablePool(jobs, name, noun, stop)
    try:
        yield pool
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
