"""What runs on a node for a fleet command that is not its broadcast part: the node-local `stage`
command, as a subprocess of a Ray actor pinned to the node (`NodeCommand`), whose other thread
answers the driver's progress calls from the command's byte counts.

Why an actor and not a task: a task cannot be asked anything while it runs. A node whose
processes were stopped (SIGSTOP, a paused VM) while Ray still listed it held `stage fleet verify`
or `stage fleet mirror --transport nas` until its --timeout; an actor that answers nothing is
silent, and the driver judges it as it judges a silent broadcast agent (liveness.Watch).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

from stager.base import progress_pipe
from stager.fleet.report import Progress
from stager.manifest import Manifest

# The Ray node label that carries a node's manifest name: how an actor or a task finds its node.
LABEL = "stage-node"
# A closing mirror may find the hub's lock still held for a moment by the node's relay.
LOCK_WAIT = 30.0
KILL_GRACE = 10.0
STOPPED_POLL = 0.2  # how often a stopped command's progress call looks again
PR_SET_PDEATHSIG = 1


def node_argv(manifest: Manifest, command: str, node: str, source: str | None = None,
              options: tuple[str, ...] = ()) -> list[str]:
    """The node-local command line. The manifest is passed by absolute path: it must be readable
    at the same path on every node (a shared filesystem, or the same deployment). `options` are
    passed on as given (verify: --full, --subset N/T)."""
    argv = [command, "--node", node, "--json", "--manifest", os.path.abspath(manifest.path)]
    if command == "pack-engram":
        argv += [arg for rank in manifest.nodes[node].engram_ranks or () for arg in ("--rank", str(rank))]
    if source:
        argv += ["--source", source]
    return argv + list(options)


class NodeCommand:
    """A node's node-local command for one fleet run: `run` runs it, `progress` answers at once,
    from another thread, with its latest byte counts (None before its first), so that a node that
    answers nothing is one that cannot, never one that is busy."""

    def __init__(self):
        self.counts: CommandProgress | None = None

    def run(self, argv: list[str], timeout: float, source: str | None = None) -> dict:
        """`source`: where the command copies from, in a word (NAS, a peer), for its progress."""
        self.counts = CommandProgress(argv, source)
        return run_on_node(argv, timeout, self.counts)

    def progress(self) -> Progress | None:
        counts = self.counts
        if counts is None:
            return None
        # A command stopped (SIGSTOP) with this worker still running is as frozen as a node
        # stopped whole: its answer waits until it runs again, so the driver finds it silent.
        while counts.stopped():
            time.sleep(STOPPED_POLL)
        latest = counts.latest
        return None if latest is None else replace(latest, read_at=time.monotonic())


class CommandProgress:
    """The pipe a node-local command writes its byte counts to (base/progress_pipe.py), read in a
    thread of its own: the latest as a Progress."""

    def __init__(self, argv: list[str], source: str | None):
        self.command, self.source = argv[0], source
        # A --full mirror first hashes the node's own files (its first bar), then copies.
        self.copy_step = 2 if self.command == "mirror" and "--full" in argv else 1
        self.latest: Progress | None = None
        self.pid: int | None = None  # the command's, once started
        self.read_fd, self.write_fd = os.pipe()
        self.thread = threading.Thread(target=self._read, name="stage-fleet-progress", daemon=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, progress_pipe.PROGRESS_FD: str(self.write_fd)}

    def started(self, pid: int | None) -> None:
        """The command (`pid`, None if it did not start) holds the write end now: this process
        lets go of its own."""
        self.pid = pid
        os.close(self.write_fd)
        self.thread.start()

    def stopped(self) -> bool:
        """Whether the command is stopped by a signal (its state in /proc: T, or t when traced)."""
        if self.pid is None:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", encoding="utf-8", errors="replace") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False  # ended: its answer is its run's
        return state in ("T", "t")

    def join(self) -> None:
        self.thread.join(timeout=1.0)

    def _read(self) -> None:
        with os.fdopen(self.read_fd, "rb") as pipe:
            for line in pipe:
                counts = progress_pipe.parse(line)
                if counts is not None:
                    step, done, total = counts
                    phase = "hash" if step < self.copy_step else self.command
                    # A line is written as its count is reached (progress_pipe), so its arrival
                    # is when the bytes grew.
                    last = self.latest
                    grew_at = last.grew_at if last is not None and (last.step, last.copy_done) == (step, done) else (
                        time.monotonic() if done else None)
                    self.latest = Progress(phase, source=self.source if phase == "mirror" else None, copy_done=done,
                                           copy_total=total, step=step, grew_at=grew_at)


def run_on_node(argv: list[str], timeout: float, progress: CommandProgress | None = None) -> dict:
    """Run `stage ARGV` here and return its exit code and output. The command is killed at
    `timeout`, when the call is cancelled, and (by the kernel) if this Ray worker dies, so a
    fleet run never leaves a writer behind on a node. With `progress`, the command writes its
    byte counts to it."""
    started = time.monotonic()
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "stager", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=_parent_death_signal(), env=progress.env() if progress else None,
                                pass_fds=(progress.write_fd,) if progress else ())
    finally:
        if progress is not None:
            progress.started(proc.pid if proc is not None else None)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        out, err = _stop(proc)
    except BaseException:  # interrupted (KeyboardInterrupt, SystemExit): no command outlives its caller
        _stop(proc)
        raise
    finally:
        if progress is not None:
            progress.join()
    return {"code": proc.returncode, "stdout": out, "stderr": err, "seconds": time.monotonic() - started,
            "host": socket.gethostname(), "timed_out": timed_out}


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM the command's process group; SIGKILL it if it lingers. Returns its output so far."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def _parent_death_signal():
    """A preexec_fn asking the kernel to SIGTERM the child when its Ray worker dies."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


