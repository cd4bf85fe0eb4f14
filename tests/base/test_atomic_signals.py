"""A signal at any step of an atomic write leaves no temp file, no open descriptor, and the final
name either as it was or complete.

The command's handler raises in the main thread between any two bytecodes. Here the real handler
(stager.cli.app) gets a real SIGTERM right after one system call of the write has succeeded, each
call in turn: the moment CI's archive-signal test hit now and then, when a `.stage-*.tmp` was made
and not yet where the clean-up could see it.
"""

from __future__ import annotations

import importlib
import os
import signal
from pathlib import Path

import pytest

from stager.base import atomic

app = importlib.import_module("stager.cli.app")  # the module; the name `app` in it is the Typer app

OLD, NEW = b"the bytes that were here\n", b"new bytes, all of them\n" * 1000


class _SignalAfter:
    """Stands for `os` inside stager.base.atomic: the first call of `name` succeeds, then SIGTERM
    arrives, so the handler's exception comes out of that call as if it had landed right after it."""

    def __init__(self, name: str):
        self.name, self.fired = name, False

    def __getattr__(self, attr: str):
        real = getattr(os, attr)
        if attr != self.name or self.fired:
            return real

        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            self.fired = True
            signal.raise_signal(signal.SIGTERM)
            return result

        return call


@pytest.fixture
def handler():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, app._on_signal)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _write_file(path: Path, batch: atomic.SyncBatch | None) -> None:
    try:
        with atomic.atomic_file(path, size_hint=len(NEW), mtime_ns=10**18, batch=batch) as out:
            out.write(NEW)
        if batch is not None:
            batch.commit()
    except BaseException:
        if batch is not None:
            batch.discard()
        raise


# What each kind of write calls in `os`, in order; the signal comes after each in turn. The batch's
# own directory descriptor is opened before the signal can come (it is not a temp file).
WRITES = {
    "file": (lambda path, _: _write_file(path, None),
             ["open", "fchmod", "posix_fallocate", "fsync", "posix_fadvise", "utime", "close", "replace"]),
    "batched file": (_write_file,
                     ["open", "fchmod", "posix_fallocate", "posix_fadvise", "utime", "close", "replace"]),
    "symlink": (lambda path, _: atomic.atomic_symlink("elsewhere", path), ["symlink", "replace"]),
    "hardlink": (lambda path, _: atomic.atomic_hardlink(path.with_name("source"), path), ["link", "replace"]),
}
CASES = [(kind, call) for kind, (_, calls) in WRITES.items() for call in calls]


@pytest.mark.parametrize("kind,call", CASES, ids=[f"{k}-after-{c}" for k, c in CASES])
def test_a_signal_after_any_step_leaves_no_temp_and_no_descriptor(tmp_path, monkeypatch, handler, kind, call):
    write, _ = WRITES[kind]
    target = tmp_path / "target"
    target.write_bytes(OLD)
    (tmp_path / "source").write_bytes(NEW)
    batch = atomic.SyncBatch(tmp_path) if kind == "batched file" else None
    before = open_descriptors()
    proxy = _SignalAfter(call)
    monkeypatch.setattr(atomic, "os", proxy)
    try:
        with pytest.raises(app.Signalled) as raised:
            write(target, batch)
    finally:
        monkeypatch.undo()
        after = open_descriptors()
        if batch is not None:
            batch.close()

    assert proxy.fired, f"{kind} never called os.{call}"
    assert raised.value.exit_code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "target"]  # no temp left
    assert after == before
    if target.is_symlink():
        assert os.readlink(target) == "elsewhere"
    else:
        assert target.read_bytes() in (OLD, NEW)  # as it was, or complete: never a prefix


def test_a_signal_outside_the_held_steps_is_raised_at_once(handler):
    """Holding is only for the steps inside the block: elsewhere the handler raises as before."""
    with pytest.raises(app.Signalled):
        signal.raise_signal(signal.SIGTERM)
