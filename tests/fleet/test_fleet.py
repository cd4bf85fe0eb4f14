"""`stage fleet` on a real local Ray cluster: three labelled nodes on 127.0.0.1, each with its own
local hub, driven by the real CLI; peers served by a real sshd on 127.0.0.1. The cluster requires
Ray's token: its head is started with `ray start --head` and RAY_AUTH_MODE=token, as docs/fleet.md
sets one up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import RAY_LOOPBACK, bytes_written, open_files, run_stage, sha256_file
from hubgen import Hub, random_safetensors
from remote_fixtures import SshServer, hub_tree, load_offline, silent_port
from stager.fleet.node import LABEL
from stager.base.lock import HUB_LOCK, LockTable
from stager.base.units import format_size

FLASH = "acme/Flash-3bpw"
DRAFTER = "acme/Flash-drafter"
MiB = 1024 * 1024
NODES = ("dgx1", "dgx2", "dgx3")
# Shard size for the fan-out measurement; raise it to measure at a realistic ratio of data to samples.
FANOUT_MIB = int(os.environ.get("STAGE_TEST_FANOUT_MIB", "4"))


# What a driver needs to use the test cluster; run_without_token() removes these.
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Head:
    """A head node started by `ray start --head --block` (its pid), and its ports."""

    process: subprocess.Popen
    address: str
    client_address: str  # the Ray Client server, ray://
    dashboard_port: int
    log: Path
    token: Path | None = None


@contextmanager
def ray_head(temp_dir: Path, label: str, env: dict[str, str]):
    """`ray start --head` as docs/fleet.md runs it, on loopback: no dashboard, the node's label.
    Every port it would take by default (6379, 10001, 52365) is a free one, so it can run next
    to other clusters on the machine. Stopped by SIGTERM to its own pid, never `ray stop`, which
    stops every Ray process of the user."""
    port, client_port, dashboard_port = free_port(), free_port(), free_port()
    log = temp_dir / f"ray-start-{label}.log"
    argv = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--port", str(port),
            "--node-ip-address", "127.0.0.1", "--include-dashboard=false", "--dashboard-port", str(dashboard_port),
            "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(free_port()),
            "--labels", f"{LABEL}={label}", "--num-cpus", "1", "--object-store-memory", str(150 * MiB),
            "--min-worker-port", "0", "--max-worker-port", "0", "--temp-dir", str(temp_dir / "ray")]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(process, f"127.0.0.1:{port}", f"ray://127.0.0.1:{client_port}", dashboard_port, log)
    try:
        yield head
    finally:
        process.terminate()  # ray start --block stops the processes it started on SIGTERM
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


LIVE_NODES = r"""
import json, sys
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions

state = GlobalState()
state._initialize_global_state(GcsClientOptions.create(sys.argv[1], None, allow_cluster_id_nil=True,
                                                       fetch_cluster_id_if_nil=False))
print(json.dumps([node for node in state.node_table() if node["Alive"]], default=str))
"""


def live_nodes(address: str) -> list[dict]:
    """The GCS's node table (what ray.nodes() returns), read with the token in this process's
    environment by a process of its own: Ray caches the auth mode and token a process first
    loads (AuthenticationTokenLoader), so a read in this process would carry them to every later
    cluster, and any earlier Ray use in the test process would decide them."""
    read = subprocess.run([sys.executable, "-c", LIVE_NODES, address], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    if read.returncode != 0:
        raise RuntimeError(read.stderr[-2000:])
    return json.loads(read.stdout.strip().splitlines()[-1])


def wait_for_labels(head: Head, labels: set[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.process.poll() is None, head.log.read_text()[-3000:]
        try:
            if labels <= {node["Labels"].get(LABEL) for node in live_nodes(head.address)}:
                return
        except Exception:  # noqa: BLE001 - the GCS is not up yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"Ray nodes {labels} not up within {timeout}s: {head.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def cluster(sshd):
    """A head labelled stage-node=dgx1 started by `ray start --head` with RAY_AUTH_MODE=token and a
    0600 token file, and two more nodes labelled dgx2 and dgx3 joined with the same token. The
    environment (loopback, the token, the test's SSH keys) is set before Ray starts, so its
    workers and this process's drivers inherit it."""
    # Ray's session files go to a directory of this run, short enough for its unix sockets.
    temp_dir = Path(tempfile.mkdtemp(prefix="stage-ray-", dir="/tmp"))
    token = temp_dir / "auth_token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    with pytest.MonkeyPatch.context() as env:
        for key, value in {**RAY_LOOPBACK, **sshd.env, "RAY_AUTH_MODE": "token",
                           "RAY_AUTH_TOKEN_PATH": str(token)}.items():
            env.setenv(key, value)
        env.delenv("RAY_AUTH_TOKEN", raising=False)
        try:
            with ray_head(temp_dir, NODES[0], dict(os.environ)) as head:
                head.token = token
                wait_for_labels(head, {NODES[0]})
                with joined_nodes(head, NODES[1:], temp_dir):
                    wait_for_labels(head, set(NODES))
                    env.setenv("RAY_ADDRESS", head.address)
                    yield head
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


JOIN_NODE = r"""
import json, sys
from ray._private.node import Node
from ray._private.parameter import RayParams

# spawn_reaper: the node's processes die with this one even if it is killed.
node = Node(RayParams(**json.loads(sys.argv[1])), head=False, shutdown_at_exit=False, spawn_reaper=True)
print("joined", flush=True)
try:
    sys.stdin.read()  # until the test closes it
finally:
    node.kill_all_processes(check_alive=False, allow_graceful=True)
"""


@contextmanager
def joined_nodes(head: Head, names: tuple[str, ...], temp_dir: Path):
    """More nodes for the head's cluster, started the way `ray start --address` starts them, each
    by a process of its own with this process's environment: `ray start --address` itself refuses
    to add a node while Ray is kept on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), and without
    that every Ray port listens on all interfaces. Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER and
    RAY_AUTH_MODE once per process, so a node started in this one would take whatever an earlier
    import of Ray here (a test module's collection, say) found in the environment."""
    nodes = []
    try:
        for name in names:
            params = {"gcs_address": head.address, "node_ip_address": "127.0.0.1", "num_cpus": 1,
                      "labels": {LABEL: name}, "temp_dir": str(temp_dir / "ray"), "object_store_memory": 150 * MiB,
                      "min_worker_port": 0, "max_worker_port": 0, "include_log_monitor": False,
                      "node_manager_port": 0}
            log = open(temp_dir / f"join-{name}.log", "wb")
            nodes.append(subprocess.Popen([sys.executable, "-c", JOIN_NODE, json.dumps(params)], env=dict(os.environ),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
            log.close()
            # Ray gives up on a GCS it cannot reach within about 20 s; a node not joined by then never will.
            ready, _, _ = select.select([nodes[-1].stdout], [], [], 120)
            joined = nodes[-1].stdout.readline() if ready else b""
            assert joined == b"joined\n", (temp_dir / f"join-{name}.log").read_text()[-3000:]
        yield nodes
    finally:
        for node in nodes:
            node.stdin.close()
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()


@pytest.fixture(scope="module")
def nas(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fleet")
    hub = Hub(root / "nas" / "hf" / "hub")
    flash = hub.repo(FLASH).snapshot()
    flash.add_git("config.json", b'{"architectures": ["DeepseekV4ForCausalLM"]}')
    flash.add_lfs("model-00001-of-00002.safetensors", random_safetensors(1, FANOUT_MIB * MiB), shared=True)
    flash.add_lfs("model-00002-of-00002.safetensors", random_safetensors(2, FANOUT_MIB * MiB + 999), shared=True,
                  absolute_via="/volume1/hf/hub")
    flash.add_real("tokenizer.json", b'{"model": {"type": "BPE"}}')
    flash.finish()
    drafter = hub.repo(DRAFTER).snapshot()
    drafter.add_lfs("model.safetensors", random_safetensors(99, MiB), shared=False)
    drafter.finish()
    return {"root": root, "hub": hub.root, "snaps": {FLASH: flash, DRAFTER: drafter}}


def fleet_manifest(path: Path, nas: dict, nodes_root: Path, sshd: SshServer, *, nas_hub: str | None = None,
                   extra_nodes: tuple[str, ...] = (), node_extra: dict[str, str] | None = None,
                   unaddressed: tuple[str, ...] = ()) -> Path:
    lines = ["[nas]", f'hub = "{nas_hub or nas["hub"]}"', f'aliases = {{ "/volume1/hf/hub" = "{nas["hub"]}" }}',
             f'\n[models."{FLASH}"]', f'\n[models."{DRAFTER}"]']
    for rank, name in enumerate(NODES + extra_nodes):
        lines += [f"\n[nodes.{name}]", f'hub = "{nodes_root / name / "hub"}"', f'models = ["{FLASH}", "{DRAFTER}"]',
                  f"rank = {rank}", "" if name in unaddressed else f'address = "{sshd.address}"',
                  (node_extra or {}).get(name, "")]
    path.write_text("\n".join(lines) + "\n")
    return path


def fleet(*args, timeout: float = 120):
    started = time.monotonic()
    result = run_stage("fleet", *args, timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr
    return result, time.monotonic() - started


def assert_staged_like_the_nas(hub: Path, nas: dict) -> None:
    for repo, snap in nas["snaps"].items():
        for rel, digest in snap.sha256.items():
            staged = hub / snap.dir.relative_to(nas["hub"]) / rel
            assert staged.exists(), staged
            assert sha256_file(staged) == digest, staged


@pytest.fixture(scope="module")
def staged(cluster, nas, sshd, tmp_path_factory) -> dict:
    """`stage fleet mirror` once for the module: three nodes staged by one command. The NAS is
    reached over SSH, so sftp-server's own log counts every byte read from it."""
    root = tmp_path_factory.mktemp("nodes")
    nas_url = sshd.url(nas["hub"])
    manifest = fleet_manifest(root / "cluster.toml", nas, root, sshd, nas_hub=nas_url)
    before = sshd.bytes_read(nas["hub"])
    result, _ = fleet("mirror", "--json", "--transport", "nas", "--timeout", "120", "--manifest", manifest)
    return {"root": root, "manifest": manifest, "result": result, "nas_url": nas_url,
            "nas_bytes": sshd.bytes_read(nas["hub"]) - before}


def test_fleet_mirror_stages_every_node_from_one_command(staged, nas):
    result = staged["result"]
    assert result.code == 0, result.stderr + result.stdout
    report = result.json
    assert report["command"] == "mirror" and report["exit_code"] == 0 and not report["fan_out"]
    assert list(report["nodes"]) == list(NODES)
    data = None
    for name, run in report["nodes"].items():
        assert run["status"] == "ok" and run["exit_code"] == 0 and run["error"] is None
        assert run["source"] == staged["nas_url"] == run["report"]["source"]
        assert run["bytes"] == run["report"]["copied_bytes"] > 0 and run["problems"] == 0 and run["seconds"] > 0
        assert run["report"]["verify"]["ok"] == run["report"]["verify"]["checked"] > 0
        data = data or run["bytes"]
        assert run["bytes"] == data
        assert_staged_like_the_nas(staged["root"] / name / "hub", nas)
    assert report["copied_from"] == {staged["nas_url"]: 3 * data}
    assert report["transport"] == "nas" and report["nas_bytes"] == 3 * data
    assert all(run["transport"] == "nas" and run["nas_bytes"] == data and run["peer_bytes"] == 0
               for run in report["nodes"].values())
    trees = [hub_tree(staged["root"] / name / "hub") for name in NODES]
    assert trees[0] == trees[1] == trees[2]


def test_fleet_verify_reports_each_node_and_exits_with_the_worst(staged, nas, sshd):
    """dgx2's shard loses a byte (exit 1 there), dgx4 has no Ray node (exit 3): the fleet exits 3."""
    root = staged["root"]
    manifest = fleet_manifest(root / "with-dgx4.toml", nas, root, sshd, nas_hub=staged["nas_url"], extra_nodes=("dgx4",))
    shard = next((root / "dgx2" / "hub" / "blobs").glob("??/*[0-9a-f]"))
    original = shard.read_bytes()
    try:
        with open(shard, "r+b") as handle:
            handle.seek(len(original) - 10)  # inside the sampled tail
            handle.write(bytes([original[-10] ^ 0xFF]))
        result, elapsed = fleet("verify", "--json", "--timeout", "60", "--manifest", manifest)
    finally:
        shard.write_bytes(original)
    # dgx4 is reported as unreachable at once, not after the timeout.
    assert result.code == 3 == result.json["exit_code"] and elapsed < 60, result.stderr
    nodes = result.json["nodes"]
    assert [(nodes[n]["status"], nodes[n]["exit_code"]) for n in (*NODES, "dgx4")] == [
        ("ok", 0), ("problems", 1), ("ok", 0), ("unreachable", 3)]
    for name in ("dgx1", "dgx3"):
        report = nodes[name]["report"]
        assert report["ok"] == report["checked"] > 0 and report["problems"] == []
        assert report["verified_against"] == staged["nas_url"] and nodes[name]["bytes"] is None
    assert nodes["dgx2"]["problems"] == 1 and nodes["dgx2"]["report"]["problems"][0]["kind"] == "mismatch"
    assert nodes["dgx4"]["report"] is None and nodes["dgx4"]["error"] == "no live Ray node is labelled stage-node=dgx4"


def test_fleet_audit_keeps_nagios_codes_and_the_worst_wins(staged, nas, sshd):
    root = staged["root"]
    manifest = fleet_manifest(root / "audit.toml", nas, root, sshd, node_extra={"dgx3": 'reserve = "1PiB"'})
    result, _ = fleet("audit", "--json", "--timeout", "120", "--manifest", manifest)
    nodes = result.json["nodes"]
    assert result.code == 2 == result.json["exit_code"], result.stderr
    assert [nodes[n]["status"] for n in NODES] == ["ok", "ok", "critical"]
    assert nodes["dgx3"]["report"]["status"] == "CRITICAL" and nodes["dgx1"]["report"]["status"] == "OK"
    assert all(nodes[n]["bytes"] == nodes[n]["report"]["needed_bytes"] == 0 for n in NODES)


def test_a_node_silent_past_the_timeout_is_stopped_and_reported_in_the_table(staged, nas, sshd):
    root = staged["root"]
    hung = f"sftp://{sshd.user}@127.0.0.1:{silent_port()}{nas['hub']}"
    manifest = fleet_manifest(root / "hung.toml", nas, root / "hung", sshd, node_extra={"dgx2": f'source = "{hung}"'})
    result, elapsed = fleet("mirror", "--nodes", "dgx2", "--timeout", "8", "--manifest", manifest)
    assert result.code == 3 and elapsed < 30, (elapsed, result.stderr)
    table = result.stdout.splitlines()
    assert table[0].split() == ["node", "status", "transport", "from", "files", "copied", "from", "NAS", "from", "peers",
                                "seconds", "problems", "detail"]
    # The node answers just before the deadline that it stopped its command; a node that cannot
    # even say that is counted as unreachable.
    assert table[1].startswith("dgx2  timed out ") and table[1].endswith("killed at the fleet deadline (8s)") \
        or table[1].startswith("dgx2  unreachable ") and table[1].endswith("no answer within 8s"), table
    assert len(table) == 3 and table[2].endswith("(exit 3)") and table[2].startswith("fleet mirror: 1 ")
    # The node-local command was killed, not left running against the hung source.
    time.sleep(2)
    survivors = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, str(manifest))]
    assert survivors == []


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_fan_out_reads_each_byte_from_the_nas_once(staged, nas, sshd, tmp_path):
    nas_url = staged["nas_url"]
    manifest = fleet_manifest(tmp_path / "fan-out.toml", nas, tmp_path, sshd, nas_hub=nas_url)
    before = sshd.bytes_read(nas["hub"])
    result, _ = fleet("mirror", "--json", "--fan-out", "--timeout", "120", "--manifest", manifest)
    fan_bytes = sshd.bytes_read(nas["hub"]) - before
    assert result.code == 0, result.stderr + result.stdout
    fan = result.json
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
        # Served by a peer, verified against the NAS.
        assert fan["nodes"][name]["report"]["verify"]["verified_against"] == nas_url
    assert hub_tree(tmp_path / "dgx1" / "hub") == hub_tree(tmp_path / "dgx2" / "hub") \
        == hub_tree(tmp_path / "dgx3" / "hub") == hub_tree(staged["root"] / "dgx1" / "hub")
    assert fan["nodes"]["dgx1"]["source"] == nas_url
    assert {fan["nodes"][n]["source"] for n in ("dgx2", "dgx3")} <= {sshd.url(tmp_path / n / "hub") for n in ("dgx1", "dgx2")}

    plain, plain_bytes = staged["result"].json, staged["nas_bytes"]
    data = plain["nodes"]["dgx1"]["bytes"]
    files = 4
    assert fan["copied_from"][nas_url] == data and sum(fan["copied_from"].values()) == 3 * data
    # Without fan-out every node reads the data from the NAS; with it the data leaves the NAS once,
    # plus each node's sampled verification (at most 1 MiB per file) and the small metadata files.
    assert plain_bytes >= 3 * data
    assert data <= fan_bytes <= data + 3 * files * (MiB + 64 * 1024)
    print(f"\nNAS bytes read staging 3 nodes of {data} bytes: {plain_bytes} without fan-out, {fan_bytes} with it")


# ---- the broadcast --------------------------------------------------------------------------------

# What a receiving node's checks may read back from the NAS per file, beyond the data: the sampled
# check before the rename reads the samples twice (before, and fresh after), the closing mirror once.
SAMPLE_READS = 3 * (MiB + 64 * 1024)


def small_files(nas: dict, staged: dict) -> int:
    """Bytes of the files each node reads from the NAS itself: those of at most 1 MiB (sizes
    from a staged node: one NAS link is absolute, through an alias)."""
    hub = staged["root"] / "dgx1" / "hub"
    sizes = [(hub / snap.dir.relative_to(nas["hub"]) / rel).stat().st_size
             for snap in nas["snaps"].values() for rel in snap.sha256]
    return sum(size for size in sizes if size <= MiB)


def verify_full(manifest: Path, node: str):
    result = run_stage("verify", "--full", "--node", node, "--json", "--manifest", manifest)
    assert result.code == 0 and result.json["problems"] == [], (node, result.stdout, result.stderr)
    return result.json


@pytest.fixture(scope="module")
def broadcast_run(cluster, staged, nas, sshd, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("broadcast")
    manifest = fleet_manifest(root / "cluster.toml", nas, root, sshd, nas_hub=staged["nas_url"])
    before = sshd.bytes_read(nas["hub"])
    # Told the broadcast: on loopback the NAS is as fast as the "links", and the choice would be direct reads.
    result, elapsed = fleet("mirror", "--transport", "broadcast", "--json", "--timeout", "120", "--manifest", manifest)
    return {"root": root, "manifest": manifest, "result": result, "seconds": elapsed,
            "nas_bytes": sshd.bytes_read(nas["hub"]) - before}


def test_broadcast_stages_every_node_reading_the_nas_once(broadcast_run, staged, nas):
    result, root = broadcast_run["result"], broadcast_run["root"]
    assert result.code == 0, result.stderr + result.stdout
    report = result.json
    data, small = staged["result"].json["nodes"]["dgx1"]["bytes"], small_files(nas, staged)
    assert report["transport"] == "broadcast" and report["nas_bytes"] == data + 2 * small
    nodes = report["nodes"]
    # The head read every shared byte from the NAS, the others got all of theirs from peers
    # (the files of at most 1 MiB, which each node's check reads whole anyway, from the NAS).
    assert (nodes["dgx1"]["nas_bytes"], nodes["dgx1"]["peer_bytes"]) == (data, 0)
    for name in ("dgx2", "dgx3"):
        assert (nodes[name]["nas_bytes"], nodes[name]["peer_bytes"]) == (small, data - small), nodes[name]
    for name in NODES:
        run = nodes[name]
        assert run["fallbacks"] == [] and run["bad_senders"] == [] and run["refused_connections"] == []
        assert run["report"]["copied_bytes"] == small and run["report"]["problems"] == []
        assert run["report"]["verify"]["verified_against"] == staged["nas_url"]
        hub = root / name / "hub"
        assert_staged_like_the_nas(hub, nas)
        assert hub_tree(hub) == hub_tree(staged["root"] / "dgx1" / "hub")
        verify_full(broadcast_run["manifest"], name)
    # The tail received everything through two relays: huggingface_hub loads it offline.
    assert load_offline(root / "dgx3" / "hub")["repos"] == sorted([FLASH, DRAFTER])
    # Bytes the NAS's own sftp-server read: the data once, plus each node's bounded sampled checks.
    files = 4
    assert data <= broadcast_run["nas_bytes"] <= data + 3 * files * SAMPLE_READS, broadcast_run["nas_bytes"]
    print(f"\nbroadcast to 3 nodes of {data} bytes: NAS read {broadcast_run['nas_bytes']} bytes "
          f"(every node reading it: {staged['nas_bytes']}), {broadcast_run['seconds']:.1f}s")


def broadcasts_at_once(manifests: list[Path], deadline: int, timeout: float) -> list:
    """`stage fleet mirror --transport broadcast --json --timeout DEADLINE` for each manifest, all
    started at once; each process killed at `timeout`."""
    with ThreadPoolExecutor(len(manifests)) as pool:
        runs = [pool.submit(fleet, "mirror", "--transport", "broadcast", "--json", "--timeout", str(deadline),
                            "--manifest", manifest, timeout=timeout) for manifest in manifests]
        return [run.result()[0] for run in runs]


def test_two_broadcasts_at_once_on_one_cluster_each_stage_their_own_hubs(cluster, staged, nas, sshd, tmp_path):
    """Two runs at the same time on one Ray cluster, each for its own hubs (two operators, two
    manifests): each run's agents are its own. Named by their node alone, the second run's agents
    were refused by Ray (ActorAlreadyExistsError, the name taken), as they would be for a run
    started while the last one's agents were still being ended."""
    roots = [tmp_path / f"run{i}" for i in range(2)]
    manifests = []
    for root in roots:
        root.mkdir()
        manifests.append(fleet_manifest(root / "cluster.toml", nas, root, sshd, nas_hub=staged["nas_url"]))
    results = broadcasts_at_once(manifests, 120, timeout=180)
    for root, result in zip(roots, results):
        assert result.code == 0, result.stderr + result.stdout
        assert result.json["transport"] == "broadcast"
        for name in NODES:
            assert result.json["nodes"][name]["report"]["problems"] == [], result.json["nodes"][name]
            assert_staged_like_the_nas(root / name / "hub", nas)


def test_two_runs_at_once_for_the_same_hubs_both_end_staged_and_neither_writes_the_nas(cluster, staged, nas, sshd,
                                                                                       tmp_path):
    """Two operators start the same fleet mirror at the same moment (a cron job and a hand run).
    Each node's hub takes one writer at a time: whichever run's relay holds it, the other run's
    node waits for the lock or is reported as locked by that holder, and neither run leaves a
    node half staged. Every file on every node has its NAS bytes; the NAS is unchanged."""
    manifest = fleet_manifest(tmp_path / "cluster.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    before = {path: path.stat().st_mtime_ns for path in nas["hub"].rglob("*") if not path.is_symlink()}
    results = broadcasts_at_once([manifest, manifest], 150, timeout=240)
    for result in results:
        assert result.code == 0, result.stderr + result.stdout
        for name in NODES:
            assert result.json["nodes"][name]["report"]["problems"] == [], result.json["nodes"][name]
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
        assert not list((tmp_path / name / "hub").rglob("*.incomplete")), name
    # A relay that found its hub locked says by whom: the other run's process, by pid.
    for result in results:
        for name in NODES:
            for fallback in result.json["nodes"][name].get("fallbacks") or ():
                if "locked" in (fallback.get("why") or ""):
                    assert re.search(r"locked by .*pid \d+", fallback["why"]), fallback
    assert before == {path: path.stat().st_mtime_ns for path in nas["hub"].rglob("*") if not path.is_symlink()}


# A driver of its own, not one in the test process: Ray takes its settings (loopback, the auth
# mode, the token) from the environment of the moment a process first imports it, and a test on
# this worker may have imported it before the cluster's environment was set. The key goes to the
# test on a pipe (argv[2]): never in a file, an argument or the environment.
DRIVER_TELLING_ITS_KEY = r"""
import json, os, sys
from stager.fleet.driver import run_fleet
from stager.fleet.broadcast import chain
from stager.manifest import load_manifest

minted_by_chain = chain.mint

def told_mint():
    minted = minted_by_chain()
    os.write(int(sys.argv[2]), minted[0].hex().encode() + b"\n")
    return minted

chain.mint = told_mint
report = run_fleet(load_manifest(sys.argv[1]), "mirror", None, timeout=120, transport="broadcast")
print(json.dumps(report.to_json()))
"""


def test_a_node_holding_a_blob_receives_none_of_it_and_the_key_never_leaves_memory(cluster, staged, nas, sshd,
                                                                                   tmp_path):
    """dgx2 already holds everything but one shard: it receives that shard only, and no chain
    waits for it on the rest. The run's key (told to this test by the driver on a pipe) is never
    in any process's argv or environment during the run, nor in a file after it."""
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    assert run_stage("mirror", "--node", "dgx2", "--manifest", manifest).code == 0
    shard = nas["snaps"][FLASH].dir / "model-00002-of-00002.safetensors"
    blob = (tmp_path / "dgx2" / "hub" / shard.relative_to(nas["hub"])).resolve()
    shard_size = blob.stat().st_size
    blob.unlink()

    minted, scans, leaks = [], [0], []
    told, telling = os.pipe()

    def scan_processes():
        with os.fdopen(told, "rb") as pipe:
            line = pipe.readline().strip()
            if line:
                minted.append(bytes.fromhex(line.decode()))
            needles = (minted[0], minted[0].hex().encode()) if minted else ()
            while needles:
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    for part in ("cmdline", "environ"):
                        try:
                            text = Path(f"/proc/{pid}/{part}").read_bytes()
                        except OSError:
                            continue
                        leaks.extend(f"/proc/{pid}/{part}" for needle in needles if needle in text)
                scans[0] += 1
                if driver.poll() is not None:
                    break
                time.sleep(0.05)

    driver = subprocess.Popen([sys.executable, "-c", DRIVER_TELLING_ITS_KEY, str(manifest), str(telling)],
                              pass_fds=(telling,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(telling)
    scanner = threading.Thread(target=scan_processes, daemon=True)
    scanner.start()
    out, err = driver.communicate(timeout=180)
    scanner.join()
    assert driver.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["exit_code"] == 0 and report["transport"] == "broadcast", report
    data = staged["result"].json["nodes"]["dgx1"]["bytes"]
    nodes = report["nodes"]
    assert nodes["dgx2"]["peer_bytes"] + nodes["dgx2"]["nas_bytes"] == shard_size
    assert nodes["dgx1"]["nas_bytes"] == data and nodes["dgx3"]["peer_bytes"] == data - small_files(nas, staged), nodes
    assert report["nas_bytes"] == data + small_files(nas, staged)
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
    assert len(minted) == 1 and scans[0] > 0 and leaks == []
    key = minted[0]
    for top in (cluster.log.parent, tmp_path, Path("/dev/shm")):
        for path in top.rglob("*"):
            try:
                if path.is_file() and not path.is_symlink() and path.stat().st_size < 256 * MiB:
                    content = path.read_bytes()
                    assert key not in content and key.hex().encode() not in content, path
            except (PermissionError, FileNotFoundError):
                continue


def relay_pid(hub: Path) -> int | None:
    """The pid holding `hub`'s writer lock while it is a broadcast relay (from its `open` on: the
    lock is taken there, and a 9 MiB run is over in well under a second on loopback)."""
    state, pid = LockTable.read().state(hub / HUB_LOCK)  # the holder, from the kernel's lock table
    if state != "held" or pid is None:
        return None
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if title.startswith(b"ray::NodeAgent") else None


def test_a_relay_killed_mid_run_is_routed_around_and_a_rerun_converges(cluster, staged, nas, sshd, tmp_path):
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    # The broadcast asked for: told nothing, the choice on loopback may be direct reads.
    proc = subprocess.Popen([sys.executable, "-m", "stager", "fleet", "mirror", "--transport", "broadcast", "--json",
                             "--timeout", "120", "--manifest", str(manifest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 90
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        killed = relay_pid(tmp_path / "dgx2" / "hub")
        if killed is not None:
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    out, err = proc.communicate(timeout=120)
    assert killed is not None, err
    import json

    report = json.loads(out)
    # The others finished; dgx2 itself was staged by its own mirror, from the NAS.
    assert proc.returncode == 0 and report["exit_code"] == 0, err
    nodes = report["nodes"]
    assert [f["path"] for f in nodes["dgx2"]["fallbacks"]] == [None], nodes["dgx2"]
    # Killed while it received, or while the driver still waited for it to listen.
    assert nodes["dgx2"]["fallbacks"][0]["why"].startswith(("relay failed", "relay did not start")), nodes["dgx2"]
    assert nodes["dgx3"]["bad_senders"] == [] and nodes["dgx3"]["report"]["problems"] == []
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
        assert nodes[name]["status"] == "ok"
    again, _ = fleet("mirror", "--json", "--timeout", "120", "--manifest", manifest)
    assert again.code == 0, again.stderr
    assert all(run["report"]["copied_bytes"] == 0 and run["peer_bytes"] == 0 for run in again.json["nodes"].values())
    verify_full(manifest, "dgx2")


def node_mirror_pid(manifest: Path, node: str) -> int | None:
    """The pid of the node-local `stage mirror --node NODE` a fleet run started with `manifest`."""
    wanted = ["mirror", "--node", node]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(manifest) in argv and any(argv[i:i + 3] == wanted for i in range(len(argv))):
            return int(pid)
    return None


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("with_its_worker", [True, False], ids=["mirror-and-worker", "mirror-alone"])
def test_a_node_whose_command_freezes_is_reported_stalled_and_the_others_finish(cluster, staged, nas, sshd,
                                                                                tmp_path, with_its_worker):
    """--transport nas: each node runs its own `stage mirror` in an actor of its own. dgx2's
    mirror is stopped (SIGSTOP) while it copies, with the Ray worker that runs it or alone: Ray
    still lists the node, and nothing of it fails. The run returns once dgx2 has answered
    nothing for SILENCE, not at its --timeout: exit 3, dgx2 `stalled` with what it had copied, the
    others staged. After SIGCONT a re-run stages dgx2."""
    from stager.fleet.liveness import SILENCE

    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    proc = subprocess.Popen([sys.executable, "-m", "stager", "fleet", "mirror", "--transport", "nas", "--bwlimit", "1M",
                             "--json", "--timeout", "300", "--manifest", str(manifest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not frozen and proc.poll() is None and time.monotonic() < deadline:
            mirror = node_mirror_pid(manifest, "dgx2")
            if mirror is not None and bytes_written(mirror) >= 3 * MiB:  # a third of its copy
                frozen = [parent_pid(mirror), mirror] if with_its_worker else [mirror]
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
            time.sleep(0.05)
        out, err = proc.communicate(timeout=200)
        returned = time.monotonic() - stopped_at
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert frozen, err
    assert returned <= SILENCE + 15, (returned, err)
    report = json.loads(out)
    assert proc.returncode == 3 and report["exit_code"] == 3, err
    dgx2 = report["nodes"]["dgx2"]
    assert dgx2["status"] == "stalled" and dgx2["exit_code"] == 3, dgx2
    assert re.fullmatch(rf"its stage mirror answered nothing for \d+s; ({SIZE}) of ({SIZE}) done \(mirror\)",
                        dgx2["error"]), dgx2
    assert 0 < dgx2["progress"]["copy_done"] < dgx2["progress"]["copy_total"], json.dumps(dgx2)
    for name in ("dgx1", "dgx3"):
        assert report["nodes"][name]["status"] == "ok", report["nodes"][name]
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
    # Thawed, its mirror ends (its actor was ended with the run), leaving what a killed run leaves.
    deadline = time.monotonic() + 30
    while node_mirror_pid(manifest, "dgx2") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node_mirror_pid(manifest, "dgx2") is None
    again, _ = fleet("mirror", "--transport", "nas", "--json", "--timeout", "120", "--manifest", manifest)
    assert again.code == 0, again.stderr
    assert_staged_like_the_nas(tmp_path / "dgx2" / "hub", nas)


@contextmanager
def byte_flipped(path: Path, offset: int):
    """`path` with the byte at `offset` flipped (a NAS file that no longer matches its name, its
    size unchanged), restored after, with its mtime."""
    st = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([original[0] ^ 0x40]))
    try:
        yield
    finally:
        with open(path, "r+b") as handle:
            handle.seek(offset)
            handle.write(original)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_full_refuses_a_nas_file_that_fails_its_name_on_every_node_and_stages_the_rest(cluster, staged, nas, sshd,
                                                                                        tmp_path):
    """One shard's NAS bytes differ from its name in the middle of the file (the default mirror's
    samples of the NAS match the copy, so it stages the file as it is). `stage fleet mirror --full`
    broadcasts, its head hashes every byte it reads, finds it is not the file's name and says so
    down the chain: the file is refused on every node (exit 1, the file named), read from the NAS
    once, and every other file is staged right."""
    import json

    flash = nas["snaps"][FLASH]
    name = "model-00001-of-00002.safetensors"
    blob = (flash.dir / name).resolve()
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    with byte_flipped(blob, blob.stat().st_size // 2):
        before = sshd.bytes_read(nas["hub"])
        # Asked for: told nothing, the choice on loopback may be direct reads.
        result, _ = fleet("mirror", "--full", "--transport", "broadcast", "--json", "--timeout", "120",
                          "--manifest", manifest)
        read = sshd.bytes_read(nas["hub"]) - before
        assert result.code == 1, result.stderr + result.stdout
        report = json.loads(result.stdout)
        assert report["transport"] == "broadcast" and report["exit_code"] == 1
        for node in NODES:
            run = report["nodes"][node]
            hub = tmp_path / node / "hub"
            bad = [p for p in run["report"]["problems"] if "does not match its blob name" in p["detail"]]
            assert [p["path"] for p in bad] == [staged["nas_url"] + str(blob)[len(str(nas["hub"])):]], run
            assert "download it again on the NAS" in bad[0]["detail"]
            assert not (hub / flash.dir.relative_to(nas["hub"]) / name).exists(), node
            for repo, snap in nas["snaps"].items():
                for rel, digest in snap.sha256.items():
                    if (repo, rel) != (FLASH, name):
                        assert sha256_file(hub / snap.dir.relative_to(nas["hub"]) / rel) == digest, (node, rel)
            refused = [f for f in run["fallbacks"] if f["path"] and f["path"].endswith(blob.name)]
            assert refused and "does not match its blob name" in refused[0]["why"], run["fallbacks"]
        # The other shard went down the chain: dgx2 and dgx3 took their bytes from peers.
        assert all(report["nodes"][node]["peer_bytes"] > 0 for node in ("dgx2", "dgx3")), report["nodes"]
        # The bad shard left the NAS once, for the head: the others refused it on its word.
        assert read < staged["nas_bytes"] / 3 + 2 * blob.stat().st_size, read
        # Without --full the same NAS file is staged as it is: its samples match the NAS's.
        plain, _ = fleet("mirror", "--json", "--timeout", "120", "--manifest", manifest)
        assert plain.code == 0, plain.stderr
        for node in NODES:
            staged_blob = tmp_path / node / "hub" / flash.dir.relative_to(nas["hub"]) / name
            assert sha256_file(staged_blob) == sha256_file(blob) != flash.sha256[name]


def descendants(root_pid: int) -> set[int]:
    """root_pid's descendants (from /proc), not root_pid itself."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    family, frontier = set(), {root_pid}
    while frontier:
        family |= frontier
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - family
    return family - {root_pid}


def listening_addresses(root_pid: int) -> dict[str, str]:
    """Local address:port (hex, as /proc/net/tcp* writes them) -> IP of each listening TCP socket
    held by root_pid's descendants."""
    inodes = set()
    for pid in descendants(root_pid):
        inodes |= {link[8:-1] for link in open_files(pid) if link.startswith("socket:[")}
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found[fields[1]] = fields[1].split(":")[0]
    return found


def test_the_cluster_listens_on_loopback_only(cluster):
    """RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every Ray process on 127.0.0.1."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    addresses = set(listening_addresses(os.getpid()).values())
    assert addresses and addresses <= loopback, addresses


def test_the_dashboard_is_off(cluster):
    """--include-dashboard=false: the dashboard's web server is not started, and nothing listens on
    its port. Ray still runs the dashboard process for usage statistics, without a frontend, and
    each node's agent; both on loopback, and both require the token."""
    commands = []
    for pid in descendants(os.getpid()):
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            continue
    assert any(command[0].endswith("gcs_server") for command in commands)  # the head's processes are in view
    dashboards = [command for command in commands if any(arg.endswith("dashboard/dashboard.py") for arg in command)]
    assert all("--disable-frontend" in command and "--host=127.0.0.1" in command for command in dashboards), dashboards
    ports = {int(local.split(":")[1], 16) for local in listening_addresses(os.getpid())}
    assert ports and cluster.dashboard_port not in ports


# ---- who may use the cluster ----------------------------------------------------------------------

TOKEN_REMEDY = ("export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<a copy of the cluster's token file, "
                "mode 0600> (docs/fleet.md)")
DRIVER = """
import logging, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
task = ray.remote(num_cpus=0)(lambda: "ran on the cluster")
print(ray.get(task.options(label_selector={"stage-node": "dgx2"}).remote(), timeout=60))
"""


def environment_without_token(**extra: str) -> dict[str, str]:
    return {**{key: value for key, value in os.environ.items() if key not in AUTH_VARS}, **extra}


def run_driver(env: dict[str, str]) -> subprocess.CompletedProcess:
    """A plain Ray driver: join the cluster and run one task on dgx2."""
    return subprocess.run([sys.executable, "-c", DRIVER, os.environ["RAY_ADDRESS"]], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_driver_without_the_clusters_token_can_neither_join_nor_run_a_task(cluster):
    # Ray retries a refused join for 20 s by default; two attempts show the same refusal.
    quick = {"RAY_gcs_server_port_wait_time_s": "2"}
    for env in (environment_without_token(**quick),
                environment_without_token(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **quick)):
        refused = run_driver(env)
        assert refused.returncode != 0 and "ran on the cluster" not in refused.stdout
        assert "Unauthenticated" in refused.stderr and "Failed to connect" in refused.stderr, refused.stderr[-3000:]
    admitted = run_driver(dict(os.environ))
    assert admitted.returncode == 0 and admitted.stdout.strip() == "ran on the cluster", admitted.stderr[-3000:]


def test_every_node_refuses_a_request_without_the_token(cluster):
    """What `stage fleet` relies on when it asks the head only: each node enforces the token too."""
    import grpc
    from ray.core.generated import node_manager_pb2 as pb, node_manager_pb2_grpc as rpc

    nodes = live_nodes(cluster.address)
    assert sorted(node["Labels"][LABEL] for node in nodes) == list(NODES)
    bearer = [("authorization", f"Bearer {cluster.token.read_text()}")]
    for node in nodes:
        with grpc.insecure_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}") as channel:
            raylet = rpc.NodeManagerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                raylet.GetSystemConfig(pb.GetSystemConfigRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert raylet.GetSystemConfig(pb.GetSystemConfigRequest(), timeout=10, metadata=bearer).system_config


def test_fleet_without_the_clusters_token_exits_3_at_once_naming_the_remedy(cluster, nas, sshd, tmp_path):
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd)
    at = f"the Ray cluster at RAY_ADDRESS={cluster.address}"
    loose = tmp_path / "readable_token"
    loose.write_text(cluster.token.read_text())
    loose.chmod(0o644)
    cases = [
        ({}, f"{at} requires a token and this driver sends none (RAY_AUTH_MODE=<unset>): {TOKEN_REMEDY}"),
        ({"RAY_AUTH_MODE": "token", "HOME": str(tmp_path)},
         f"{at} requires a token and this driver has none (not in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
         f"~/.ray/auth_token): {TOKEN_REMEDY}"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
         f"{at} refused this driver's token from RAY_AUTH_TOKEN: it is not the cluster's token; {TOKEN_REMEDY}"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(loose)},
         f"the Ray token file {loose} can be read by other users (mode 0644): run chmod 600 {loose}"),
        ({"RAY_ADDRESS": cluster.client_address},  # through the Ray Client server
         f"the Ray cluster at RAY_ADDRESS={cluster.client_address} requires a token and this driver sends none "
         f"(RAY_AUTH_MODE=<unset>): {TOKEN_REMEDY}"),
    ]
    for extra, message in cases:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "stager", "fleet", "verify", "--manifest", str(manifest)],
                              env=environment_without_token(**extra), capture_output=True, text=True, timeout=60)
        # Refused before ray.init, which would retry the refused join for 20 s.
        assert proc.returncode == 3 and time.monotonic() - started < 15, (extra, proc.stderr)
        assert proc.stderr.strip().splitlines() == [f"stage: error: {message}"], proc.stderr


def test_a_cluster_without_authentication_is_refused_unless_allowed(cluster, staged):
    """A second head, started without RAY_AUTH_MODE=token: it answers anyone."""
    temp_dir = Path(tempfile.mkdtemp(prefix="stage-ray-", dir="/tmp"))
    try:
        with ray_head(temp_dir, NODES[0], environment_without_token(RAY_AUTH_MODE="disabled")) as head:
            wait_for_labels(head, {NODES[0]})
            args = ("fleet", "verify", "--nodes", NODES[0], "--timeout", "120", "--manifest", staged["manifest"])
            started = time.monotonic()
            refused = run_stage(*args, env={"RAY_ADDRESS": head.address})
            assert refused.code == 3 and time.monotonic() - started < 15, refused.stderr
            assert refused.stderr.strip().splitlines() == [
                f"stage: error: the Ray cluster at RAY_ADDRESS={head.address} accepts requests without a token: "
                "anyone who reaches its port runs code as the user that writes the node hubs; restart it with "
                "RAY_AUTH_MODE=token (docs/fleet.md) or pass --allow-unauthenticated-cluster"]
            # This driver's environment is in token mode: on the open cluster it joins without it, else
            # the cluster ended every actor it started ("the actor never ran").
            assert os.environ.get("RAY_AUTH_MODE") == "token"
            allowed = run_stage(*args, "--json", "--allow-unauthenticated-cluster", env={"RAY_ADDRESS": head.address})
            assert allowed.code == 0, allowed.stderr
            assert allowed.json["cluster_auth"] == "disabled" and allowed.json["nodes"][NODES[0]]["status"] == "ok"
            # Through the Ray Client port Ray is imported to knock, in token mode: one line, exit 3.
            client = run_stage(*args, "--allow-unauthenticated-cluster", env={"RAY_ADDRESS": head.client_address})
            assert client.code == 3 and client.stderr.strip().splitlines() == [
                f"stage: error: the Ray cluster at RAY_ADDRESS={head.client_address} accepts requests without a "
                "token, and this driver runs with RAY_AUTH_MODE=token: the cluster would end every actor it starts; "
                "run it with RAY_AUTH_MODE=disabled, or restart the cluster with RAY_AUTH_MODE=token (docs/fleet.md)"]
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_stderr_warns_when_the_cluster_is_unauthenticated():
    from stager.fleet.report import FleetReport, NodeRun, notes, table

    run = NodeRun("dgx1", 0, "ok", seconds=1.0, problems=0)
    report = FleetReport("verify", (run,), 2.0, False, "dgx1:6379", cluster_auth="disabled")
    assert notes(report) == ["warning: the Ray cluster's authentication is disabled (--allow-unauthenticated-cluster)"]
    assert table(report)[-1] == "fleet verify: 1 ok in 2.0s (exit 0)" and len(table(report)) == 3
    assert FleetReport("verify", (run,), 2.0, False, "dgx1:6379").to_json()["cluster_auth"] == "token"
    assert notes(FleetReport("verify", (run,), 2.0, False, "dgx1:6379")) == []


def test_fleet_verify_passes_full_and_subset_to_every_node(staged):
    result, _ = fleet("verify", "--full", "--subset", "1/2", "--json", "--timeout", "120",
                      "--manifest", staged["manifest"])
    assert result.code == 0, result.stderr
    for name in NODES:
        report = result.json["nodes"][name]["report"]
        assert (report["mode"], report["subset"], report["seed"]) == ("full", "1/2", None), name
        assert report["problems"] == [] and report["checked"] > 0


def test_fleet_prune_passes_dry_run_until_free_and_only_to_every_node(staged, nas):
    """An orphan blob on dgx1 and dgx2: each node's `--until-free` stops before it (the space is
    there), `--dry-run` lists it and removes nothing, the real run removes exactly it, and every
    staged byte stays right."""
    orphans, sizes = {}, {}
    for index, name in enumerate(("dgx1", "dgx2")):
        orphan = staged["root"] / name / "hub" / f"models--{FLASH.replace('/', '--')}" / "blobs" / ("ab" * 31 + f"{index:02x}")
        sizes[name] = 4096 + index
        orphan.write_bytes(os.urandom(sizes[name]))
        orphans[name] = orphan
    try:
        common = ("--only", "blob", "--json", "--timeout", "120", "--manifest", staged["manifest"])
        # Already 1 KiB free: the orphan is left, and the target said met.
        enough, _ = fleet("prune", "--dry-run", "--until-free", "1KiB", *common)
        assert enough.code == 0, enough.stderr
        for name in NODES:
            report = enough.json["nodes"][name]["report"]
            assert (report["dry_run"], report["until_free"], report["target_met"], report["removed"]) == (
                True, "1KiB", True, []), report
            assert [item["path"] for item in report["left"]] == ([str(orphans[name])] if name in orphans else [])
        dry, _ = fleet("prune", "--dry-run", *common)
        assert dry.code == 0, dry.stderr
        for name in NODES:
            report = dry.json["nodes"][name]["report"]
            assert report["dry_run"] is True and report["until_free"] is None, report
            listed = [item["path"] for item in report["removed"]]
            assert listed == ([str(orphans[name])] if name in orphans else []), (name, listed)
        assert all(orphan.exists() for orphan in orphans.values())
        real, _ = fleet("prune", *common)
        assert real.code == 0, real.stderr
        for name in NODES:
            run = real.json["nodes"][name]
            assert run["report"]["dry_run"] is False
            assert [item["path"] for item in run["report"]["removed"]] == ([str(orphans[name])] if name in orphans else [])
            assert run["bytes"] == run["report"]["freed_bytes"] == sizes.get(name, 0)
        assert not any(orphan.exists() for orphan in orphans.values())
    finally:
        for orphan in orphans.values():
            orphan.unlink(missing_ok=True)
    for name in NODES:
        assert_staged_like_the_nas(staged["root"] / name / "hub", nas)


def test_each_node_runs_the_node_local_command_with_its_own_rank(nas, sshd, tmp_path):
    from stager.fleet.node import node_argv
    from stager.manifest import load_manifest

    manifest = load_manifest(fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd))
    path = str((tmp_path / "m.toml").resolve())
    assert node_argv(manifest, "pack-engram", "dgx3") == [
        "pack-engram", "--node", "dgx3", "--json", "--manifest", path, "--rank", "2"]
    assert node_argv(manifest, "audit", "dgx3") == ["audit", "--node", "dgx3", "--json", "--manifest", path]
    # `stage fleet prune`: each node's own prune, its bytes column the bytes it freed.
    from stager.fleet.report import BYTES_KEY

    assert node_argv(manifest, "prune", "dgx1") == ["prune", "--node", "dgx1", "--json", "--manifest", path]
    assert BYTES_KEY["prune"] == "freed_bytes"
    assert node_argv(manifest, "mirror", "dgx2", "sftp://peer/hub")[-2:] == ["--source", "sftp://peer/hub"]
    assert node_argv(manifest, "verify", "dgx1", None, ("--subset", "0/3")) == [
        "verify", "--node", "dgx1", "--json", "--manifest", path, "--subset", "0/3"]


def test_misuse_is_bad_input(nas, sshd, tmp_path):
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd)
    # Each fleet command takes only its own options (tests/cli/test_fleet_cli.py checks every help).
    result, _ = fleet("verify", "--fan-out", "--manifest", manifest)
    assert result.code == 2 and "No such option: --fan-out" in result.stderr
    result, _ = fleet("verify", "--nodes", "dgx1,nope", "--manifest", manifest)
    assert result.code == 2 and "nodes.nope: no such node" in result.stderr
    result, _ = fleet("mirror", "--subset", "1/2", "--manifest", manifest)
    assert result.code == 2 and "No such option: --subset" in result.stderr
    result, _ = fleet("verify", "--subset", "3", "--manifest", manifest)
    assert result.code == 2 and "--subset expects N/T such as 3/7, got '3'" in result.stderr
    result, _ = fleet("mirror", "--until-free", "1GiB", "--manifest", manifest)
    assert result.code == 2 and "No such option: --until-free" in result.stderr
    result, _ = fleet("prune", "--only", "snapshots", "--manifest", manifest)
    assert result.code == 2 and "--only: snapshots is not a kind" in result.stderr


def test_no_cluster_at_ray_address_exits_3_without_hanging(nas, sshd, tmp_path):
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{sock.getsockname()[1]}"
    result = run_stage("fleet", "verify", "--manifest", manifest, env={**RAY_LOOPBACK, "RAY_ADDRESS": closed}, timeout=60)
    assert result.code == 3
    assert result.stderr.strip().splitlines() == [
        f"stage: error: no Ray cluster at RAY_ADDRESS={closed}: Connection refused; start one with "
        "`ray start --head` and set RAY_ADDRESS=<head>:6379 (docs/fleet.md)"]
    # A port that accepts and never answers: ray.init would wait forever; the command does not.
    silent = f"127.0.0.1:{silent_port()}"
    started = time.monotonic()
    result = run_stage("fleet", "verify", "--timeout", "5", "--manifest", manifest,
                       env={**RAY_LOOPBACK, "RAY_ADDRESS": silent}, timeout=60)
    assert result.code == 3 and time.monotonic() - started < 30
    assert (f"stage: error: no Ray cluster answered at RAY_ADDRESS={silent} within 5s; start one with "
            "`ray start --head` and set RAY_ADDRESS=<head>:6379 (docs/fleet.md)") in result.stderr.splitlines()


def test_without_ray_installed_the_command_says_how_to_install_it(nas, sshd, tmp_path):
    fake = tmp_path / "no-ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd)
    proc = subprocess.run([sys.executable, "-m", "stager", "fleet", "mirror", "--manifest", str(manifest)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert proc.returncode == 3
    assert proc.stderr.strip() == ("stage: error: stage fleet needs Ray on every node: "
                                   "pip install '.[fleet]' in the stager checkout (see docs/fleet.md)")



# ---- what the operator sees: the result on stdout, progress and warnings on stderr -----------------

SIZE = r"\d+ B|\d+\.\d\d [KMGT]iB"


def table(stdout: str) -> tuple[list[str], dict[str, dict[str, str]], list[str]]:
    """A fleet table as printed: its columns, each node's row by column (cells cut at the
    header's column starts), and every other line (problems, paths, the closing count)."""
    lines = stdout.splitlines()
    found = list(re.finditer(r"\S+(?: \S+)*", lines[0]))
    names, starts = [m.group() for m in found], [m.start() for m in found]
    rows, rest = {}, []
    for line in lines[1:]:
        if line.split(" ", 1)[0] in (*NODES, "dgx4"):
            cells = [line[start:end].strip() for start, end in zip(starts, [*starts[1:], None])]
            rows[cells[0]] = dict(zip(names, cells))
        else:
            rest.append(line)
    return names, rows, rest


def no_table_on(stderr: str) -> None:
    """Nothing of the result on stderr, and no terminal codes off a terminal."""
    assert not [line for line in stderr.splitlines() if line.startswith(("node ", *NODES, "fleet "))], stderr
    assert "\x1b[" not in stderr, stderr


def test_fleet_mirror_prints_its_rows_on_stdout(cluster, staged, nas, sshd, tmp_path):
    """The broadcast's rows: where each node's bytes came from (the head from the NAS, the others
    from the node before them, their small files from the NAS), files and bytes copied, on stdout
    (`| grep dgx2` finds dgx2's row); nothing of it on stderr."""
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    result, _ = fleet("mirror", "--transport", "broadcast", "--timeout", "120", "--manifest", manifest)
    assert result.code == 0, result.stderr + result.stdout
    no_table_on(result.stderr)
    names, rows, rest = table(result.stdout)
    assert names == ["node", "status", "transport", "from", "files", "copied", "from NAS", "from peers", "seconds",
                     "problems", "detail"]
    plain = staged["result"].json["nodes"]["dgx1"]
    data, files, small = plain["bytes"], plain["report"]["copied_files"], small_files(nas, staged)
    assert list(rows) == list(NODES)
    for name, row in rows.items():
        assert (row["status"], row["transport"], row["files"], row["copied"], row["problems"], row["detail"]) == (
            "ok", "broadcast", str(files), format_size(data), "0", ""), row
        assert re.fullmatch(r"\d+\.\d", row["seconds"]), row
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
    assert (rows["dgx1"]["from"], rows["dgx1"]["from NAS"], rows["dgx1"]["from peers"]) == ("NAS", format_size(data),
                                                                                           "0 B")
    for name, upstreams in (("dgx2", {"dgx1"}), ("dgx3", {"dgx1", "dgx2"})):
        peers = rows[name]["from"].split("+")
        assert peers[-1] == "NAS" and peers[:-1] and set(peers[:-1]) <= upstreams, rows[name]
        assert (rows[name]["from NAS"], rows[name]["from peers"]) == (format_size(small), format_size(data - small))
    assert [line for line in result.stdout.splitlines() if "dgx2" in line.split()[:1]] == [
        result.stdout.splitlines()[2]]
    assert rest[-1].startswith(f"fleet mirror: 3 ok; copied {format_size(3 * small)} from NAS; "
                               f"{format_size(data + 2 * small)} read from the NAS (broadcast) in "), rest
    assert rest[-1].endswith("(exit 0)")


def test_fleet_verify_audit_and_prune_print_their_rows_on_stdout(staged, nas, sshd, tmp_path):
    """Each command's own columns: verify (mode, against, ok of checked; a problem by the names
    people know the file by), audit (free, needed, reclaimable, its state and reason), prune
    (would remove, bytes, in use; -v lists the paths of each node)."""
    root = staged["root"]
    shard = next((root / "dgx2" / "hub" / "blobs").glob("??/*[0-9a-f]"))
    original = shard.read_bytes()
    try:
        with open(shard, "r+b") as handle:
            handle.seek(len(original) - 10)
            handle.write(bytes([original[-10] ^ 0xFF]))
        verify, _ = fleet("verify", "--timeout", "120", "--manifest", staged["manifest"])
    finally:
        shard.write_bytes(original)
    assert verify.code == 1, verify.stderr
    no_table_on(verify.stderr)
    names, rows, rest = table(verify.stdout)
    assert names == ["node", "status", "mode", "against", "ok", "seconds", "problems", "detail"]
    checked = staged["result"].json["nodes"]["dgx1"]["report"]["verify"]["checked"]
    assert [(row["status"], row["mode"], row["against"], row["ok"], row["problems"]) for row in rows.values()] == [
        ("ok", "sampled", "NAS", f"{checked}/{checked}", "0"), ("problems", "sampled", "NAS", f"{checked - 1}/{checked}", "1"),
        ("ok", "sampled", "NAS", f"{checked}/{checked}", "0")]
    hub = root / "dgx2" / "hub" / f"models--{FLASH.replace('/', '--')}"
    assert re.fullmatch(rf"  dgx2: mismatch {FLASH}@[0-9a-f]{{7}}/(model-0000[12]-of-00002\.safetensors) blob "
                        rf"[0-9a-f]{{64}}: .+ \({hub}/snapshots/[0-9a-f]{{40}}/\1\)", rest[0]), rest
    assert rest[-1].startswith("fleet verify: 2 ok, 1 problems in ") and rest[-1].endswith("(exit 1)")

    manifest = fleet_manifest(tmp_path / "audit.toml", nas, root, sshd, nas_hub=staged["nas_url"],
                              node_extra={"dgx3": 'reserve = "1PiB"'})
    audit, _ = fleet("audit", "--timeout", "120", "--manifest", manifest)
    audit_json, _ = fleet("audit", "--json", "--timeout", "120", "--manifest", manifest)
    assert audit.code == 2 == audit_json.code, audit.stderr
    no_table_on(audit.stderr)
    names, rows, rest = table(audit.stdout)
    assert names == ["node", "status", "free", "needed", "reclaimable", "seconds", "problems", "detail"]
    for name, row in rows.items():
        node = audit_json.json["nodes"][name]
        assert row["status"] == node["status"] == ("critical" if name == "dgx3" else "ok")
        assert re.fullmatch(SIZE, row["free"]) and node["free_bytes"] > 0, row
        assert (row["needed"], row["reclaimable"]) == ("0 B", "0 B") and node["reclaimable_bytes"] == 0
        assert node["reason"] == node["report"]["reason"]
        if name == "dgx3":  # free space moves between two runs: the reason's words, its sizes as sizes
            assert re.fullmatch(rf"/: needs 0 B \+ reserve 1024\.00 TiB, free ({SIZE}) \(short by ({SIZE})\)",
                                row["detail"]), row
        else:
            assert re.fullmatch(rf"/: ({SIZE}) would remain after staging 0 B \(reserve 0 B\)", row["detail"]), row
    assert rest[-1].startswith("fleet audit: 2 ok, 1 critical in ")

    orphan = root / "dgx1" / "hub" / f"models--{FLASH.replace('/', '--')}" / "blobs" / ("cd" * 32)
    orphan.write_bytes(os.urandom(4096))
    try:
        args = ("prune", "--dry-run", "--only", "blob", "--timeout", "120", "--manifest", staged["manifest"])
        quiet, _ = fleet(*args)
        listed, _ = fleet(*args, "-v")
        assert orphan.exists()
    finally:
        orphan.unlink()
    for result in (quiet, listed):
        assert result.code == 0, result.stderr
        no_table_on(result.stderr)
        names, rows, rest = table(result.stdout)
        assert names == ["node", "status", "would remove", "bytes", "in use", "seconds", "problems", "detail"]
        assert [(row["would remove"], row["bytes"], row["in use"]) for row in rows.values()] == [
            ("1", "4.00 KiB", "0"), ("0", "0 B", "0"), ("0", "0 B", "0")]
    assert table(quiet.stdout)[2] == [quiet.stdout.splitlines()[-1]]
    assert table(listed.stdout)[2][:-1] == [f"  dgx1: would remove blob 4.00 KiB {orphan}"]


NO_ADDRESS = ("none of them has nodes.<name>.address in the manifest, and the broadcast needs it on two or more "
              "nodes")


def fallback_line(nodes: str, why: str, read: int, extra: int) -> str:
    one = "," not in nodes and " and " not in nodes
    return (f"warning: {nodes} {'reads the NAS itself' if one else 'read the NAS themselves'}, not "
            f"{'its' if one else 'their'} peers: {why}; {format_size(read)} from the NAS, {format_size(extra)} more "
            'than one read of each byte (docs/fleet.md, "Addresses and ports")')


def test_nodes_that_read_the_nas_instead_of_their_peers_are_named_once_with_what_it_costs(
        broadcast_run, staged, nas, sshd, tmp_path):
    data = staged["result"].json["nodes"]["dgx1"]["bytes"]
    # No node has an address: each reads the NAS itself; one read of the data was owed anyway.
    bare = fleet_manifest(tmp_path / "bare.toml", nas, tmp_path / "bare", sshd, nas_hub=staged["nas_url"],
                          unaddressed=NODES)
    result, _ = fleet("mirror", "--timeout", "120", "--manifest", bare)
    assert result.code == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warned == [fallback_line("dgx1, dgx2 and dgx3", NO_ADDRESS, 3 * data, 2 * data)], result.stderr
    assert "warning" not in result.stdout and {row["transport"] for row in table(result.stdout)[1].values()} == {"nas"}
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / "bare" / name / "hub", nas)
    bare_json = fleet_manifest(tmp_path / "bare-json.toml", nas, tmp_path / "bare-json", sshd,
                               nas_hub=staged["nas_url"], unaddressed=NODES)
    result, _ = fleet("mirror", "--json", "--timeout", "120", "--manifest", bare_json)
    assert result.code == 0 and result.json["transport"] == "nas", result.stderr
    assert result.json["nas_fallback"] == [{"nodes": list(NODES), "why": NO_ADDRESS, "nas_bytes": 3 * data,
                                            "extra_bytes": 2 * data}]
    assert [line for line in result.stderr.splitlines() if "warning" in line] == [
        fallback_line("dgx1, dgx2 and dgx3", NO_ADDRESS, 3 * data, 2 * data)]

    # dgx3 alone has none: the broadcast between dgx1 and dgx2, and dgx3 named.
    part = fleet_manifest(tmp_path / "part.toml", nas, tmp_path / "part", sshd, nas_hub=staged["nas_url"],
                          unaddressed=("dgx3",))
    result, _ = fleet("mirror", "--transport", "broadcast", "--json", "--timeout", "120", "--manifest", part)
    assert result.code == 0, result.stderr
    why = "no nodes.<name>.address in the manifest, where the broadcast would listen"
    assert result.json["nas_fallback"] == [{"nodes": ["dgx3"], "why": why, "nas_bytes": data, "extra_bytes": data}]
    assert [line for line in result.stderr.splitlines() if "warning" in line] == [
        fallback_line("dgx3", why, data, data)]
    nodes = result.json["nodes"]
    assert nodes["dgx2"]["peer_bytes"] > 0 and (nodes["dgx3"]["nas_bytes"], nodes["dgx3"]["peer_bytes"]) == (data, 0)
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / "part" / name / "hub", nas)

    # Every node has one: nothing to say.
    assert broadcast_run["result"].json["nas_fallback"] == [] and "warning" not in broadcast_run["result"].stderr
    # A single node has no peers to read from.
    alone, _ = fleet("mirror", "--nodes", "dgx1", "--json", "--timeout", "120", "--manifest", bare)
    assert alone.code == 0 and alone.json["nas_fallback"] == [] and "warning" not in alone.stderr


def on_a_terminal(*args, columns: int = 150, timeout: float = 180) -> tuple[int, str, str]:
    """`stage fleet ARGS` with its stderr on a terminal (a pty `columns` wide) and its stdout a
    pipe: its exit code, its stdout, and what the terminal was sent (line ends as sent)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    attributes = termios.tcgetattr(follower)
    attributes[1] &= ~termios.ONLCR  # keep "\n" as the command wrote it
    termios.tcsetattr(follower, termios.TCSANOW, attributes)
    shown = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the other side is closed and drained
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "stager", "fleet", *map(str, args)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=follower)
        os.close(follower)
        follower = -1
        reader.start()
        out, _ = proc.communicate(timeout=timeout)
        reader.join(10)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    return proc.returncode, out.decode(), shown.decode(errors="replace")


def frames(shown: str) -> list[list[str]]:
    """The blocks of lines the terminal was sent between two moves of the cursor back up."""
    return [[line for line in re.sub(r"\x1b\[J|\r", "", part).split("\n") if line]
            for part in re.split(r"\x1b\[\d+A", shown)]


def test_a_terminal_gets_a_line_per_node_redrawn_in_place_and_a_pipe_none(staged, nas, sshd, tmp_path):
    """Nodes without an address read the NAS each (--bwlimit 2M: a few seconds each): on a
    terminal, a line per node (bytes of what, rate, ETA, from where), redrawn in place, the
    fallback said once above it with the bytes the nodes set out to copy; the table on stdout.
    Through a pipe, with -q, and with --json: not a line of it."""
    data = staged["result"].json["nodes"]["dgx1"]["bytes"]

    def manifest(name: str) -> Path:
        return fleet_manifest(tmp_path / f"{name}.toml", nas, tmp_path / name, sshd, nas_hub=staged["nas_url"],
                              unaddressed=NODES)

    args = ("mirror", "--bwlimit", "2M", "--timeout", "120", "--manifest")
    code, out, shown = on_a_terminal(*args, manifest("tty"))
    assert code == 0, shown
    assert {row["status"] for row in table(out)[1].values()} == {"ok"} and "\x1b[" not in out
    drawn = frames(shown)
    assert len(drawn) >= 4 and "\x1b[3A" in shown, shown  # three lines, drawn again in place
    moving = rf"({SIZE}) of ({SIZE})  ({SIZE})/s  ETA \d+:\d\d"
    for name in NODES:
        lines = [line for frame in drawn for line in frame if re.fullmatch(rf"{name}  copying from NAS\s+{moving}", line)]
        assert lines, (name, shown)
        assert {re.fullmatch(rf"{name}  copying from NAS\s+{moving}", line).group(2) for line in lines} == {
            format_size(data)}
        assert re.fullmatch(rf"{name}  ok\s+{re.escape(format_size(data))}  in 0:\d\d", drawn[-1][NODES.index(name)])
    warning = fallback_line("dgx1, dgx2 and dgx3", NO_ADDRESS, 3 * data, 2 * data)
    assert shown.count(warning) == 1 and shown.index(warning) < shown.rindex("copying from NAS"), shown
    for name in NODES:
        assert_staged_like_the_nas(tmp_path / "tty" / name / "hub", nas)

    # The runs that must draw nothing, at once: each as long as the one above, where lines were drawn.
    with ThreadPoolExecutor(3) as pool:
        piped = pool.submit(fleet, *args, manifest("pipe"))
        quiet = {option: pool.submit(on_a_terminal, *args, manifest(option.strip("-")), option)
                 for option in ("-q", "--json")}
        piped = piped.result()[0]
        assert piped.code == 0 and "copying" not in piped.stderr, piped.stderr
        no_table_on(piped.stderr)
        for option, warned in (("-q", 0), ("--json", 1)):  # -q: the result and errors only
            code, out, shown = quiet[option].result()
            assert code == 0 and "copying" not in shown and "\x1b[" not in shown, (option, shown)
            assert shown.count(warning) == warned, (option, shown)


def test_the_broadcast_at_a_bwlimit_shows_each_node_receiving_from_the_one_before_it(staged, nas, sshd, tmp_path):
    """--bwlimit 2M with the broadcast: the head reads the NAS at 2 MiB/s and each relay sends at
    most that, so the run takes at least the data's time at the rate; a terminal shows dgx1
    receiving from the NAS, dgx2 from dgx1 and dgx3 from dgx2, at no more than the rate."""
    data, rate = staged["result"].json["nodes"]["dgx1"]["bytes"], 2 * MiB
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd, nas_hub=staged["nas_url"])
    started = time.monotonic()
    code, out, shown = on_a_terminal("mirror", "--transport", "broadcast", "--bwlimit", "2M", "--timeout", "120",
                                     "--manifest", manifest)
    took = time.monotonic() - started
    assert code == 0, shown
    rows = table(out)[1]
    assert {row["transport"] for row in rows.values()} == {"broadcast"} and rows["dgx3"]["from"].startswith("dgx2"), out
    assert took >= 0.9 * data / rate, took
    last = frames(shown)[-1]
    assert [re.sub(r"\s+in \d+:\d\d$", "", line) for line in last] == [f"{name}  ok" for name in NODES], last
    drawn = [line for frame in frames(shown) for line in frame]
    for name, source in (("dgx1", "NAS"), ("dgx2", "dgx1"), ("dgx3", "dgx2")):
        moving = [re.fullmatch(rf"{name}  receiving from {source}\s+({SIZE}) of ({SIZE})  ({SIZE})/s  ETA \d+:\d\d",
                               line) for line in drawn]
        seen = [match for match in moving if match]
        assert seen, (name, shown)
        for match in seen:
            amount, unit = match.group(3).split()
            assert float(amount) * {"B": 1, "KiB": 1024, "MiB": MiB}[unit] <= 1.25 * rate, match.group(0)
        assert_staged_like_the_nas(tmp_path / name / "hub", nas)
    print(f"\nbroadcast of {data} bytes at --bwlimit 2M: {took:.1f} s ({data / rate:.1f} s at the rate)")
