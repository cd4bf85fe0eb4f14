"""A node-local command's byte counts, as `stage fleet` reads them from its pipe."""

from __future__ import annotations

import os
import select
import time

from stager.base import progress_pipe


def read_lines(fd: int, seconds: float) -> list[str]:
    """Every line written to the pipe's read end within `seconds`."""
    got, until = b"", time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            got += os.read(fd, 4096)
    return got.decode().splitlines()


def test_a_count_held_back_by_the_interval_is_written_once_it_has_passed(monkeypatch):
    """Three files' buffers land within a moment of each other: the first count is written, the
    next two are held back by the interval, and then written, with no later count to carry them.
    Unwritten, the driver saw one file of three copied for as long as the next buffer took."""
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setenv(progress_pipe.PROGRESS_FD, str(write_end))
        update = progress_pipe.from_environment()(30)
        assert read_lines(read_end, 0.05) == ["1 0 30"]
        for _ in range(2):
            update(10)
        lines = read_lines(read_end, 3 * progress_pipe.INTERVAL)
        assert lines and lines[-1] == "1 20 30", lines
        update(10)  # the bar's last count: at once
        assert read_lines(read_end, 0.05) == ["1 30 30"]
    finally:
        os.close(read_end)
        os.close(write_end)
