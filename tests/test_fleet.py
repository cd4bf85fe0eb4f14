"""`stage fleet` on a real local Ray cluster: three labelled nodes on 127.0.0.1, each with its own
local hub, driven by the real CLI; peers served by a real sshd on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file
from hubgen import Hub, random_safetensors
from remote_fixtures import SshServer, hub_tree, silent_port
from stager.fleet import LABEL

FLASH = "acme/Flash-3bpw"
DRAFTER = "acme/Flash-drafter"
MiB = 1024 * 1024
NODES = ("dgx1", "dgx2", "dgx3")
# Without the first, Ray binds to and connects through the host's network interface instead of
# loopback; the second keeps it from reporting usage statistics to the Ray project.
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
# Shard size for the fan-out measurement; raise it to measure at a realistic ratio of data to samples.
FANOUT_MIB = int(os.environ.get("STAGE_TEST_FANOUT_MIB", "4"))


@pytest.fixture(scope="module")
def cluster(sshd):
    """One head and two workers, labelled stage-node=dgx1..dgx3. The environment (loopback, the
    test's SSH keys) is set before the raylets start, so their workers inherit it."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in {**RAY_LOOPBACK, **sshd.env}.items():
            env.setenv(key, value)
        # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported.
        from ray.cluster_utils import Cluster

        # Ray's session files go to a directory of this run, short enough for its unix sockets.
        temp_dir = tempfile.mkdtemp(prefix="stage-ray-", dir="/tmp")
        ray_cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "labels": {LABEL: NODES[0]}, "include_dashboard": False, "temp_dir": temp_dir})
        try:
            for name in NODES[1:]:
                ray_cluster.add_node(num_cpus=1, labels={LABEL: name}, temp_dir=temp_dir)
            ray_cluster.wait_for_nodes()
            env.setenv("RAY_ADDRESS", ray_cluster.address)
            yield ray_cluster
        finally:
            ray_cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


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
                   extra_nodes: tuple[str, ...] = (), node_extra: dict[str, str] | None = None) -> Path:
    lines = ["[nas]", f'hub = "{nas_hub or nas["hub"]}"', f'aliases = {{ "/volume1/hf/hub" = "{nas["hub"]}" }}',
             f'\n[models."{FLASH}"]', f'\n[models."{DRAFTER}"]']
    for rank, name in enumerate(NODES + extra_nodes):
        lines += [f"\n[nodes.{name}]", f'hub = "{nodes_root / name / "hub"}"', f'models = ["{FLASH}", "{DRAFTER}"]',
                  f"rank = {rank}", f'address = "{sshd.address}"', (node_extra or {}).get(name, "")]
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
    result, _ = fleet("mirror", "--json", "--timeout", "120", "--manifest", manifest)
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
    table = result.stderr.splitlines()
    assert table[0].split() == ["node", "status", "bytes", "seconds", "problems", "detail"]
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


def listening_addresses(root_pid: int) -> set[str]:
    """Local addresses of the listening TCP sockets held by root_pid's descendants (from /proc)."""
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
    inodes = set()
    for pid in family - {root_pid}:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].split(":")[0])
    return found


def test_the_cluster_listens_on_loopback_only(cluster):
    """RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every Ray process on 127.0.0.1."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    addresses = listening_addresses(os.getpid())
    assert addresses and addresses <= loopback, addresses


def test_each_node_runs_the_node_local_command_with_its_own_rank(nas, sshd, tmp_path):
    from stager.fleet import node_argv
    from stager.manifest import load_manifest

    manifest = load_manifest(fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd))
    path = str((tmp_path / "m.toml").resolve())
    assert node_argv(manifest, "pack-engram", "dgx3") == [
        "pack-engram", "--node", "dgx3", "--json", "--manifest", path, "--rank", "2"]
    assert node_argv(manifest, "audit", "dgx3") == ["audit", "--node", "dgx3", "--json", "--manifest", path]
    assert node_argv(manifest, "mirror", "dgx2", "sftp://peer/hub")[-2:] == ["--source", "sftp://peer/hub"]


def test_misuse_is_bad_input(nas, sshd, tmp_path):
    manifest = fleet_manifest(tmp_path / "m.toml", nas, tmp_path, sshd)
    result, _ = fleet("verify", "--fan-out", "--manifest", manifest)
    assert result.code == 2 and "--fan-out applies to `stage fleet mirror` only" in result.stderr
    result, _ = fleet("verify", "--nodes", "dgx1,nope", "--manifest", manifest)
    assert result.code == 2 and "nodes.nope: no such node" in result.stderr


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
                                   "pip install 'stager[fleet]' (see docs/fleet.md)")
