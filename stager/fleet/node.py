"""What runs on a node, inside its Ray task: the node-local `stage` command, as a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from stager.base.errors import BadInput
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


def mirror_options(command: str, transport: str | None, bwlimit: str | None) -> tuple[str, ...]:
    """`--bwlimit RATE` for each node's `stage mirror`: each node reads at most RATE from its
    sources. The broadcast's head reads the NAS, and its closing mirrors run, inside the nodes'
    agents, which take no rate yet: refused there rather than silently not applied."""
    if bwlimit is None:
        return ()
    if command != "mirror":
        raise BadInput(f"--bwlimit applies to `stage fleet mirror` only, not {command}")
    if transport == "broadcast":
        raise BadInput("--bwlimit is not applied by the broadcast transport yet: "
                       "add --transport nas (every node reads the NAS at RATE) or --transport sftp")
    return "--bwlimit", bwlimit


def run_on_node(argv: list[str], timeout: float) -> dict:
    """Run `stage ARGV` here and return its exit code and output. The command is killed at
    `timeout`, when the task is cancelled, and (by the kernel) if this Ray worker dies, so a
    fleet run never leaves a writer behind on a node."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stager", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_parent_death_signal())
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        out, err = _stop(proc)
    except BaseException:  # cancelled by the driver (KeyboardInterrupt in the task)
        _stop(proc)
        raise
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


