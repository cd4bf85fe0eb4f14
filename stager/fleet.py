"""`stage fleet`: one command for every node at once, run as Ray tasks pinned to the nodes.

Each node runs its node-local command (`stage mirror --node X --json`, ...) as a subprocess
of a Ray task scheduled with the label selector `stage-node=X` and `num_cpus=0`: the exit code
and the JSON are exactly the node-local contract, and the task never holds a CPU slot that GPU
work is waiting for.  The driver collects one report per node.  A node that is not in the Ray
cluster, or that has not answered by the deadline, is reported as unreachable (exit 3); the
fleet's exit code is the worst node's.

`--fan-out` (mirror only) stages one node from the NAS, then every staged node serves one more
peer over SFTP (`nodes.X.address`), so the staged set doubles each round and each byte leaves
the NAS once.  Served nodes still verify against the NAS (see mirror.reference_source).

Who may use the cluster: an unauthenticated Ray cluster runs any code that reaches its port,
as the user that started it, and here that user writes the node hubs (and is often root).  So
before it joins, the driver sends the cluster one read-only request carrying no token; the
cluster must refuse it as unauthenticated (Ray's RAY_AUTH_MODE=token), or the fleet does not run
(exit 3) unless --allow-unauthenticated-cluster is given.  The driver's own RAY_AUTH_MODE proves
nothing: a cluster without authentication accepts requests with a token just as well.

Ray is imported only here, and only when a fleet command runs: it is an optional extra.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stager.errors import EXIT_CANNOT_RUN, EXIT_OK, BadInput, CannotRun
from stager.manifest import Manifest
from stager.units import format_size

LABEL = "stage-node"
# ray.init retries a dead GCS address forever; joining a live cluster takes a few seconds.
CONNECT_TIMEOUT = 60.0
KILL_GRACE = 10.0
INSTALL_HINT = "stage fleet needs Ray on every node: pip install 'stager[fleet]' (see docs/fleet.md)"
# What the table's "bytes" column shows for each command (verify moves no bytes; prune: bytes freed).
BYTES_KEY = {"mirror": "copied_bytes", "pack-engram": "packed_bytes", "audit": "needed_bytes", "prune": "freed_bytes"}
STATUS = {
    "audit": ("ok", "warning", "critical", "unknown"),  # Nagios, as `stage audit` exits
    "default": ("ok", "problems", "bad input", "cannot run"),
}
PR_SET_PDEATHSIG = 1
ALLOW_OPEN = "--allow-unauthenticated-cluster"
TOKEN_REMEDY = ("export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<a copy of the cluster's token file, "
                "mode 0600> (docs/fleet.md)")
# What the cluster did with a request (_knock); UNCLEAR covers every other gRPC status.
ANSWERED, UNAUTHENTICATED, SILENT, UNCLEAR = "answered", "unauthenticated", "silent", "unclear"


@dataclass(frozen=True)
class NodeRun:
    """One node's outcome: its node-local exit code and JSON report, or why there is none."""

    node: str
    exit_code: int
    status: str
    report: dict | None = None
    seconds: float | None = None
    source: str | None = None  # mirror: where the node copied from
    host: str | None = None
    error: str | None = None
    bytes: int | None = None
    problems: int | None = None

    def to_json(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "bytes": self.bytes,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "problems": self.problems,
                "source": self.source, "host": self.host, "error": self.error, "report": self.report}


@dataclass(frozen=True)
class FleetReport:
    command: str
    runs: tuple[NodeRun, ...]
    seconds: float
    fan_out: bool
    ray_address: str
    # "token": the cluster refused a request without one; "disabled": it answered one, and the run
    # went ahead under --allow-unauthenticated-cluster; "unchecked": the check had no clear answer.
    cluster_auth: str = "token"

    @property
    def exit_code(self) -> int:
        return max((run.exit_code for run in self.runs), default=EXIT_OK)

    @property
    def copied_from(self) -> dict[str, int] | None:
        """Bytes copied per source: with --fan-out the NAS's share is one copy of the data."""
        if self.command != "mirror":
            return None
        totals: dict[str, int] = {}
        for run in self.runs:
            if run.report and run.source:
                totals[run.source] = totals.get(run.source, 0) + int(run.report.get("copied_bytes") or 0)
        return totals

    def to_json(self) -> dict:
        return {"command": self.command, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
                "fan_out": self.fan_out, "ray_address": self.ray_address, "cluster_auth": self.cluster_auth,
                "copied_from": self.copied_from,
                "nodes": {run.node: run.to_json() for run in self.runs}}


def unreachable(node: str, why: str, source: str | None = None) -> NodeRun:
    return NodeRun(node, EXIT_CANNOT_RUN, "unreachable", source=source, error=why)


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


def verify_options(command: str, full: bool, subset: str | None) -> tuple[str, ...]:
    """`--full` and `--subset N/T` for each node's `stage verify`, checked once here so a typo is
    one exit 2 rather than one per node."""
    if not full and subset is None:
        return ()
    if command != "verify":
        raise BadInput(f"--full and --subset apply to `stage fleet verify` only, not {command}")
    from stager.verify import Subset

    try:
        chosen = Subset.parse(subset) if subset is not None else None
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return (("--full",) if full else ()) + (("--subset", subset) if chosen else ())


def peer_url(manifest: Manifest, node: str) -> str:
    """The SFTP URL of a staged node's local hub, for its peers."""
    config = manifest.nodes[node]
    return f"sftp://{config.address}{config.hub}"


# ---- on the node (inside the Ray task) -----------------------------------------------------------

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


# ---- the driver ----------------------------------------------------------------------------------

def run_fleet(manifest: Manifest, command: str, nodes: list[str] | None, *, timeout: float,
              fan_out: bool, full: bool = False, subset: str | None = None,
              allow_unauthenticated: bool = False) -> FleetReport:
    names = list(dict.fromkeys(nodes or manifest.nodes))
    if not names:
        raise BadInput(f"{manifest.path}: nodes: no nodes to run on")
    for name in names:
        manifest.node(name)
    if fan_out and command != "mirror":
        raise BadInput(f"--fan-out applies to `stage fleet mirror` only, not {command}")
    if fan_out and not any(manifest.nodes[name].address for name in names):
        raise BadInput(f"{manifest.path}: --fan-out needs nodes.<name>.address = \"[user@]host[:port]\" "
                       f"on the nodes that serve their peers")
    options = verify_options(command, full, subset)
    ray = _import_ray()
    started = time.monotonic()
    address, auth = _connect(ray, min(CONNECT_TIMEOUT, timeout), allow_unauthenticated)
    try:
        driver = _Driver(ray, manifest, command, started + timeout, timeout, options)
        runs = driver.fan_out(names) if fan_out else driver.all_at_once(names)
    finally:
        ray.shutdown()
    return FleetReport(command, tuple(runs[name] for name in names), time.monotonic() - started, fan_out, address,
                       auth)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise CannotRun(INSTALL_HINT) from None
    return ray


def _connect(ray, timeout: float, allow_unauthenticated: bool) -> tuple[str, str]:
    """Join the cluster at $RAY_ADDRESS (else the one this host belongs to), within `timeout`,
    once it has shown that it refuses requests without a token. Returns the address and what
    the authentication check found.

    ray.init never gives up on an address that does not answer, so it runs in a daemon
    thread that is abandoned on timeout; the process still exits promptly after the error.
    """
    address = os.environ.get("RAY_ADDRESS") or "auto"
    hint = "start one with `ray start --head` and set RAY_ADDRESS=<head>:6379 (docs/fleet.md)"
    where = f"RAY_ADDRESS={address}" if address != "auto" else "this host (RAY_ADDRESS is not set)"
    _probe(address, timeout, hint)
    auth = _require_token(address, where, hint, timeout, allow_unauthenticated)
    outcome: list = []

    def init() -> None:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, namespace="stager")
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - reported as one line below
            outcome.append(exc)

    thread = threading.Thread(target=init, name="stage-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise CannotRun(f"no Ray cluster answered at {where} within {timeout:g}s; {hint}")
    if outcome[0] is not None:
        text = str(outcome[0]).strip()
        reason = text.splitlines()[0].rstrip(".") if text else type(outcome[0]).__name__
        raise CannotRun(f"cannot join a Ray cluster at {where}: {reason}; {hint}")
    return address, auth


def _probe(address: str, timeout: float, hint: str) -> None:
    """A closed head port fails here at once: ray.init would retry it forever, logging each
    retry on stderr from its C++ core."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto" or a ray:// client address: ray.init resolves those
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 10.0)).close()
    except OSError as exc:
        raise CannotRun(f"no Ray cluster at RAY_ADDRESS={address}: {exc.strerror or exc}; {hint}") from None


# ---- who may use the cluster ---------------------------------------------------------------------

def _require_token(address: str, where: str, hint: str, timeout: float, allow_open: bool) -> str:
    """Check, before joining, that the cluster refuses a request that carries no token, and that
    it accepts this driver's token. Returns "token", or under `allow_open` "disabled" (it
    answered without a token) or "unchecked" (no clear answer).

    Only the port the driver joins through is asked (the GCS, or a Ray Client server). The
    other nodes are covered by how Ray joins: a node reaches the GCS with the token of its own
    RAY_AUTH_MODE=token, which also makes it enforce the token on its own ports, and a node
    started without it cannot join a token cluster at all.
    """
    target, client = _control_endpoint(address, where, hint)
    anonymous, detail = _knock(target, client, None, timeout)
    if anonymous == SILENT:
        raise CannotRun(f"no Ray cluster answered at {where} within {timeout:g}s; {hint}")
    if anonymous == ANSWERED:
        if allow_open:
            return "disabled"
        raise CannotRun(f"the Ray cluster at {where} accepts requests without a token: anyone who reaches its "
                        f"port runs code as the user that writes the node hubs; restart it with RAY_AUTH_MODE=token "
                        f"(docs/fleet.md) or pass {ALLOW_OPEN}")
    if anonymous == UNCLEAR:
        if allow_open:
            return "unchecked"
        raise CannotRun(f"cannot tell whether the Ray cluster at {where} requires a token ({detail}); "
                        f"pass {ALLOW_OPEN} to run anyway")
    token, origin = _driver_token(address)
    if token is None:
        raise CannotRun(f"the Ray cluster at {where} requires a token and this driver {origin}: {TOKEN_REMEDY}")
    if _knock(target, client, token, timeout)[0] == UNAUTHENTICATED:
        raise CannotRun(f"the Ray cluster at {where} refused this driver's token from {origin}: "
                        f"it is not the cluster's token; {TOKEN_REMEDY}")
    return "token"


def _control_endpoint(address: str, where: str, hint: str) -> tuple[str, bool]:
    """The host:port ray.init will talk to first, and whether it is a Ray Client server (ray://)."""
    if address.startswith("ray://"):
        rest = address[len("ray://"):].split("/", 1)[0]
        return (rest if rest.rpartition(":")[2].isdigit() else f"{rest}:10001"), True
    try:  # "auto": the cluster ray.init would join (Ray's own lookup: ray start's record, then pgrep)
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address(address)
    except Exception as exc:  # noqa: BLE001 - ray.init would fail the same way
        text = str(exc).strip()
        reason = text.splitlines()[0].rstrip(".") if text else type(exc).__name__
        raise CannotRun(f"cannot join a Ray cluster at {where}: {reason}; {hint}") from None
    if not target:
        raise CannotRun(f"cannot join a Ray cluster at {where}: no running Ray cluster found; {hint}")
    return target, False


def _knock(target: str, client: bool, token: str | None, timeout: float) -> tuple[str, str]:
    """Send one read-only request (GCS: GetClusterId; Ray Client: a ping), with `token` or none.
    Returns (ANSWERED | UNAUTHENTICATED | SILENT | UNCLEAR, detail). Ray checks the token before
    it runs a method, so an answer means the method ran for whoever asked."""
    import grpc

    if client:
        from ray.core.generated import ray_client_pb2 as pb, ray_client_pb2_grpc as rpc

        def call(channel, metadata):
            ping = pb.ClusterInfoRequest(type=pb.ClusterInfoType.PING)
            return rpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout, metadata=metadata)
    else:
        from ray.core.generated import gcs_service_pb2 as pb, gcs_service_pb2_grpc as rpc

        def call(channel, metadata):
            return rpc.NodeInfoGcsServiceStub(channel).GetClusterId(pb.GetClusterIdRequest(), timeout=timeout,
                                                                    metadata=metadata)

    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    try:
        with _channel(grpc, target) as channel:
            call(channel, metadata)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return UNAUTHENTICATED, ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return SILENT, ""
        return UNCLEAR, f"{target} said {code.name}: {(exc.details() or '').strip() or 'no details'}"
    except Exception as exc:  # noqa: BLE001 - TLS files unreadable, bad address: no clear answer
        return UNCLEAR, f"{target}: {exc}"
    return ANSWERED, ""


def _channel(grpc, target: str):
    """A channel without Ray's token interceptor, with TLS when Ray uses it (RAY_USE_TLS)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._common.tls_utils import load_certs_from_env

        chain, key, ca = load_certs_from_env()
        credentials = grpc.ssl_channel_credentials(certificate_chain=chain, private_key=key, root_certificates=ca)
        return grpc.secure_channel(target, credentials)
    return grpc.insecure_channel(target)


def _driver_token(address: str) -> tuple[str | None, str]:
    """The token ray.init will send, and where it comes from; or None and why there is none.

    Ray reads it from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token,
    and sends it only in token mode (RAY_AUTH_MODE=token; with no RAY_ADDRESS and no
    RAY_AUTH_MODE, ray.init turns token mode on by itself when it finds a token). A token file
    other users can read is refused: the token is the cluster's only key.
    """
    try:
        from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    except ImportError:
        return None, "runs a Ray without token authentication (it came with Ray 2.52)"
    mode = os.environ.get("RAY_AUTH_MODE")
    if get_authentication_mode() != AuthenticationMode.TOKEN and not (address == "auto" and mode is None):
        return None, f"sends none (RAY_AUTH_MODE={mode or '<unset>'})"
    loader = AuthenticationTokenLoader.instance()
    try:
        found = loader.has_token(ignore_auth_mode=True)
    except Exception as exc:  # noqa: BLE001 - AuthenticationError: RAY_AUTH_TOKEN_PATH unreadable or empty
        return None, f"has none: {str(exc).split('. ')[0].strip()}"
    if not found:
        return None, "has none (not in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    if os.environ.get("RAY_AUTH_TOKEN"):
        origin = "RAY_AUTH_TOKEN"
    else:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
        origin = path
        mode_bits = stat.S_IMODE(os.stat(path).st_mode)
        if mode_bits & 0o077:
            raise CannotRun(f"the Ray token file {path} can be read by other users (mode {mode_bits:04o}): "
                            f"run chmod 600 {path}")
    return loader.get_raw_token(ignore_auth_mode=True), origin


@dataclass
class _Driver:
    ray: object
    manifest: Manifest
    command: str
    deadline: float
    timeout: float
    options: tuple[str, ...] = ()
    running: dict = field(default_factory=dict)  # ObjectRef -> (node, source override)
    runs: dict[str, NodeRun] = field(default_factory=dict)

    def __post_init__(self):
        self.task = self.ray.remote(num_cpus=0, max_retries=0)(run_on_node)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def present(self, names: list[str]) -> list[str]:
        """The named nodes that have a live Ray node labelled for them; the others are unreachable."""
        labelled = {node.get("Labels", {}).get(LABEL) for node in self.ray.nodes() if node.get("Alive")}
        for name in names:
            if name not in labelled:
                self.runs[name] = unreachable(name, f"no live Ray node is labelled {LABEL}={name}")
        return [name for name in names if name in labelled]

    def launch(self, node: str, source: str | None = None) -> None:
        argv = node_argv(self.manifest, self.command, node, source, self.options)
        # The node stops its command a little before the deadline, so it can still say "timed out"
        # (alive but slow) rather than be counted as silent.
        budget = max(1.0, self.left() - min(5.0, 0.1 * self.timeout))
        ref = self.task.options(label_selector={LABEL: node}, name=f"stage {self.command} {node}").remote(argv, budget)
        self.running[ref] = (node, source)

    def wait_one(self) -> NodeRun | None:
        """The next node to finish, or None at the deadline."""
        if not self.running or self.left() <= 0:
            return None
        ready, _ = self.ray.wait(list(self.running), num_returns=1, timeout=self.left())
        if not ready:
            return None
        node, source = self.running.pop(ready[0])
        run = self.collect(ready[0], node, source)
        self.runs[node] = run
        return run

    def collect(self, ref, node: str, source: str | None) -> NodeRun:
        try:
            out = self.ray.get(ref, timeout=max(1.0, self.left()))
        except self.ray.exceptions.RayError as exc:
            text = str(exc).strip()
            return unreachable(node, f"the Ray task failed: {text.splitlines()[-1] if text else type(exc).__name__}", source)
        stderr_lines = [line for line in out["stderr"].splitlines() if line.strip()]
        error = stderr_lines[-1][:500] if stderr_lines else None
        if out["timed_out"]:
            return NodeRun(node, EXIT_CANNOT_RUN, "timed out", seconds=out["seconds"], source=source, host=out["host"],
                           error=f"killed at the fleet deadline ({self.timeout:g}s)")
        code = out["code"]
        if code < 0 or code > EXIT_CANNOT_RUN:
            error = f"stage {self.command} ended with {'signal ' + str(-code) if code < 0 else 'exit ' + str(code)}"
            code = EXIT_CANNOT_RUN
        try:
            report = json.loads(out["stdout"]) if out["stdout"].strip() else None
        except ValueError:
            report, error = None, error or "the node-local command printed something other than JSON"
        if not isinstance(report, dict):
            report = None
        problems = report.get("problems") if report else None
        names = STATUS.get(self.command, STATUS["default"])
        return NodeRun(
            node, code, names[code], report=report, seconds=out["seconds"],
            source=((report or {}).get("source") or source) if self.command == "mirror" else source,
            host=out["host"], error=error if code != EXIT_OK else None,
            bytes=(report or {}).get(BYTES_KEY[self.command]) if self.command in BYTES_KEY else None,
            problems=len(problems) if isinstance(problems, list) else None)

    def give_up(self) -> None:
        """At the deadline: cancel what is still running (its command is killed on the node)."""
        for ref, (node, source) in self.running.items():
            self.ray.cancel(ref)
            self.runs[node] = unreachable(node, f"no answer within {self.timeout:g}s", source)
        self.running.clear()

    def all_at_once(self, names: list[str]) -> dict[str, NodeRun]:
        for node in self.present(names):
            self.launch(node)
        while self.wait_one():
            pass
        self.give_up()
        return self.runs

    def fan_out(self, names: list[str]) -> dict[str, NodeRun]:
        """Each staged node serves one peer at a time; a node no staged or staging node can serve
        (other models, no address) stages from its own source. Nodes with a `source` of their own
        in the manifest keep it."""
        nodes = self.manifest.nodes
        # Nodes with an address go first: only they can pass the data on.
        pending = sorted(self.present(names), key=lambda n: nodes[n].address is None)
        idle: list[str] = []
        serving: dict[str, str] = {}  # staging node -> the peer serving it

        def can_serve(server: str, node: str) -> bool:
            return bool(nodes[server].address) and set(nodes[node].models) <= set(nodes[server].models)

        while pending or self.running:
            for node in list(pending):
                server = next((s for s in idle if can_serve(s, node)), None)
                if nodes[node].source is None and server is not None:
                    idle.remove(server)
                    serving[node] = server
                    self.launch(node, peer_url(self.manifest, server))
                    pending.remove(node)
                    continue
                coming = [n for n, _ in self.running.values()] + list(serving.values())
                if nodes[node].source is not None or not any(can_serve(s, node) for s in coming):
                    self.launch(node)
                    pending.remove(node)
            run = self.wait_one()
            if run is None:
                break
            if run.node in serving:
                idle.append(serving.pop(run.node))
            if run.exit_code == EXIT_OK and nodes[run.node].address:
                idle.append(run.node)
        self.give_up()
        for node in pending:
            self.runs[node] = unreachable(node, f"not started: no peer was staged within {self.timeout:g}s")
        return self.runs


# ---- the table -----------------------------------------------------------------------------------

def table(report: FleetReport, problems_per_node: int = 5) -> list[str]:
    """The per-node table, each node's first problems, and a closing count."""
    rows = [("node", "status", "bytes", "seconds", "problems", "detail")]
    for run in report.runs:
        detail = run.error or (f"from {run.source}" if run.source else "")
        rows.append((run.node, run.status, "-" if run.bytes is None else format_size(run.bytes),
                     "-" if run.seconds is None else f"{run.seconds:.1f}",
                     "-" if run.problems is None else str(run.problems), detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5] for row in rows]
    for run in report.runs:
        for problem in ((run.report or {}).get("problems") or [])[:problems_per_node]:
            if isinstance(problem, dict):
                lines.append(f"  {run.node}: {problem.get('kind')} {problem.get('path')}: {problem.get('detail')}")
    counts: dict[str, int] = {}
    for run in report.runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    copied = report.copied_from
    if copied:
        summary += "; copied " + ", ".join(f"{format_size(n)} from {src}" for src, n in copied.items())
    if report.cluster_auth != "token":
        lines.append(f"warning: the Ray cluster's authentication is {report.cluster_auth} ({ALLOW_OPEN})")
    lines.append(f"fleet {report.command}: {summary} in {report.seconds:.1f}s (exit {report.exit_code})")
    return lines
