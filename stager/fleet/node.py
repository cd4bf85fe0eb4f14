"""What runs on a node, inside its Ray task: the node-local `stage` command, as a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from stager.manifest import Manifest

# The Ray node label that carries a node's manifest name: how a task finds its node.
LABEL = "stage-node"
# A closing mirror may find the hub's lock still held for a moment by the node's relay.
LOCK_WAIT = 30.0
KILL_GRACE = 10.0
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


def run_on_node(argv: list[str], timeout: float, board=None, node: str | None = None,
                source: str | None = None) -> dict:
    """Run `stage ARGV` here and return its exit code and output. The command is killed at
    `timeout`, when the task is cancelled, and (by the kernel) if this Ray worker dies, so a
    fleet run never leaves a writer behind on a node. With the run's `board` (live.py), the
    command's byte counts are posted to it as `node`'s, copying from `source`."""
    from stager.fleet.live import TaskProgress

    started = time.monotonic()
    progress = TaskProgress(board, node or "", argv, source) if board is not None else None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "stager", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=_parent_death_signal(), env=progress.env() if progress else None,
                                pass_fds=(progress.write_fd,) if progress else ())
    finally:
        if progress is not None:
            progress.started()
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        out, err = _stop(proc)
    except BaseException:  # cancelled by the driver (KeyboardInterrupt in the task)
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


