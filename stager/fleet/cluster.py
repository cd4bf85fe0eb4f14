"""Joining the Ray cluster, and only one that lets no stranger in.

An unauthenticated Ray cluster runs any code that reaches its port, as the user that started it,
and here that user writes the node hubs (and is often root). So before it joins, the driver sends
the cluster one read-only request carrying no token; the cluster must refuse it as
unauthenticated (Ray's RAY_AUTH_MODE=token), or the fleet does not run (exit 3) unless
--allow-unauthenticated-cluster is given. The driver's own RAY_AUTH_MODE proves nothing: a
cluster without authentication accepts requests with a token just as well.

Ray is imported only here, and only when a fleet command runs: it is an optional extra.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import stat
import sys
import threading
from pathlib import Path

from stager.base.errors import CannotRun
from stager.fleet.report import ALLOW_OPEN

# ray.init retries a dead GCS address forever; joining a live cluster takes a few seconds.
CONNECT_TIMEOUT = 60.0
# From the checkout: no `stager` on PyPI is this project, so `pip install 'stager[fleet]'` is not.
INSTALL_HINT = "stage fleet needs Ray on every node: pip install '.[fleet]' in the stager checkout (see docs/fleet.md)"
TOKEN_REMEDY = ("export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<a copy of the cluster's token file, "
                "mode 0600> (docs/fleet.md)")
# The GCS's read-only method the driver calls before it joins (_knock).
GCS_KNOCK = "/ray.rpc.NodeInfoGcsService/GetClusterId"
# What the cluster did with a request (_knock); UNCLEAR covers every other gRPC status.
ANSWERED, UNAUTHENTICATED, SILENT, UNCLEAR = "answered", "unauthenticated", "silent", "unclear"


# Ray colours what it passes on from the raylets (a worker killed, ...), and the "[repeated Nx
# across cluster]" of a line it folded, whatever the stream: in a log file or a pipe those are
# escape codes around every such line. The first has a switch; the second has none but the
# folding itself, so off a terminal each line comes as Ray got it. An operator's setting wins.
PLAIN_RAY_OUTPUT = {"RAY_COLOR_PREFIX": "0", "RAY_DEDUP_LOGS": "0"}


def require_ray() -> None:
    """Ray is an optional extra: without it, say so before anything else is asked. Not imported
    here: connect settles the driver's token mode first, which Ray reads when it is imported."""
    if importlib.util.find_spec("ray") is None:
        raise CannotRun(INSTALL_HINT)


def import_ray():
    if not sys.stderr.isatty():  # the driver sends Ray's stdout to stderr too (driver.run_fleet)
        for name, value in PLAIN_RAY_OUTPUT.items():
            os.environ.setdefault(name, value)  # RAY_DEDUP_LOGS is read when ray is imported
    try:
        import ray
    except ImportError:
        raise CannotRun(INSTALL_HINT) from None
    return ray


def connect(timeout: float, allow_unauthenticated: bool) -> tuple[object, str, str]:
    """Join the cluster at $RAY_ADDRESS (else the one this host belongs to), within `timeout`,
    once it has shown that it refuses requests without a token. Returns Ray, the address and
    what the authentication check found.

    ray.init never gives up on an address that does not answer, so it runs in a daemon
    thread that is abandoned on timeout; the process still exits promptly after the error.
    """
    address = os.environ.get("RAY_ADDRESS") or "auto"
    hint = "start one with `ray start --head` and set RAY_ADDRESS=<head>:6379 (docs/fleet.md)"
    where = f"RAY_ADDRESS={address}" if address != "auto" else "this host (RAY_ADDRESS is not set)"
    _probe(address, timeout, hint)
    auth = _require_token(address, where, hint, timeout, allow_unauthenticated)
    if auth == "disabled":
        _drop_token_mode(where)
    ray = import_ray()
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
    return ray, address, auth


def _drop_token_mode(where: str) -> None:
    """Join a cluster that answers without a token in Ray's mode without one. A driver in token
    mode refuses the cluster's own calls to it, which carry no token: the GCS, asking the owner
    of each actor whether it still holds it, takes the refusal for the owner's death and ends
    every actor the driver creates ("the actor never ran"), so every node of the run failed. Ray
    reads RAY_AUTH_MODE once, when it is imported; Ray imported already in token mode (to find
    the cluster of RAY_ADDRESS unset or ray://, or for TLS) cannot change, and the run stops here."""
    if "ray" not in sys.modules:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        return
    from ray._raylet import AuthenticationMode, get_authentication_mode

    if get_authentication_mode() == AuthenticationMode.TOKEN:
        raise CannotRun(f"the Ray cluster at {where} accepts requests without a token, and this driver runs with "
                        f"RAY_AUTH_MODE=token: the cluster would end every actor it starts; run it with "
                        f"RAY_AUTH_MODE=disabled, or restart the cluster with RAY_AUTH_MODE=token (docs/fleet.md)")


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
    if address != "auto":
        return address, False  # host:port, knocked at as given: Ray is not imported yet (connect)
    try:  # the cluster ray.init would join (Ray's own lookup: ray start's record, then pgrep)
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
        import_ray()
        from ray.core.generated import ray_client_pb2 as pb, ray_client_pb2_grpc as rpc

        def call(channel, metadata):
            ping = pb.ClusterInfoRequest(type=pb.ClusterInfoType.PING)
            return rpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout, metadata=metadata)
    else:
        def call(channel, metadata):
            # By its method's name, with an empty request (b"" is an empty GetClusterIdRequest) and
            # the answer unread: Ray's generated stubs would import Ray, and the driver's own
            # token mode must be settled before that (connect).
            method = channel.unary_unary(GCS_KNOCK, request_serializer=bytes, response_deserializer=bytes)
            return method(b"", timeout=timeout, metadata=metadata)

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
    import_ray()  # the cluster wants a token: the driver's token mode is the one to import Ray in
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
