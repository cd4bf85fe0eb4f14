"""Thread pools that stop their queued work when the run ends early.

A `with ThreadPoolExecutor()` block that is left by an exception (Ctrl-C, SIGTERM, a full disk)
runs every task still queued before it lets the exception through, unless something cancels
them: `Executor.map` cancels its own when its iterator is closed, tasks given to `submit` are
not. Here queued tasks are cancelled whichever way they were queued, and only the running ones
are waited for, so clean-up starts within one task's time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor


@contextlib.contextmanager
def worker_pool(jobs: int, name: str) -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix=name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
