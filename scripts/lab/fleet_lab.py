#!/usr/bin/env python3
"""A cluster of network namespaces on one machine, to run `stage fleet` at a chosen link speed.

    python scripts/lab/fleet_lab.py up --nodes 4 --rate 100 --size 48MiB     # build it, print how to use it, hold it
    python scripts/lab/fleet_lab.py run --nodes 3 -- stage fleet mirror --json --manifest '$STAGE_LAB_MANIFEST'
    python scripts/lab/fleet_lab.py down                                     # remove labs whose owner is dead
    python scripts/lab/fleet_lab.py list

The shape (docs/fleet-lab.md, "The lab"): a Linux bridge in the root namespace; one namespace per node
and one for the NAS, each joined to the bridge by a veth pair whose two ends are both shaped with
`tc tbf` to the link rate, so every member has R up and R down and the NAS's one uplink is shared
by all nodes. Addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range), on the bridge
only: no route leads off the machine, and nothing here connects to an address it did not make.

- The NAS is a real OpenSSH sshd in its namespace, serving a hub built by hubgen as an `sftp://`
  NAS; sftp-server logs the bytes it reads per file. Every node runs an sshd too, on its own
  address, so `stage fleet mirror --fan-out` can use it as a peer.
- Every node is a real Ray node started inside its namespace with `ray start --address`, its
  `stage-node=<name>` label and Ray's token (RAY_AUTH_MODE=token, a 0600 token file); the head
  runs in the root namespace on the bridge's address with no CPUs, so no task lands on it and a
  driver on this machine attaches to it. Nodes join one at a time: Ray waits only 30 s for a node
  to register.
- The NAS's bytes are read from its veth's counters in the root namespace, independent of what
  `stage` reports.
- Two modes make direct reads win (docs/fleet-lab.md, "Never slower than direct reads"): `--fast-nas`
  gives the manifest the NAS's directory as `nas.hub`, a path every namespace reads at the disk's
  rate (a fast NFS mount's stand-in, past the shaped links); `--cpu-quota C` caps each node's
  processes at C cores (cgroup v1 cpu.cfs_quota_us), so a relay's CPU, not its link, can be the
  limit.

Leaving nothing behind: every name carries a per-run id (namespaces `stlab-<id>-<member>`, links
`sl<id>...`), every process the lab starts carries STAGER_LAB_RUN=<id> in its environment, and the
run is recorded in /run/stager-lab/<id>.json with its owner's pid. Teardown kills the processes in
the run's namespaces and those carrying its id, deletes the namespaces and links (the qdiscs go
with them) and the run's directory. It runs from a `finally`, from atexit, on SIGTERM/SIGINT/SIGHUP
in the CLI, and from a reaper process that waits on a pipe from the owner: when the owner dies,
even by kill -9, the pipe closes and the reaper tears the run down. `down`, and every new lab,
first sweeps runs whose owner is gone. Runs as root (namespaces, bridges, tc).
"""

from __future__ import annotations

import argparse
import atexit
import compileall
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hubgen  # noqa: E402

MiB = 1024 * 1024
STATE_DIR = Path("/run/stager-lab")
NS_PREFIX = "stlab-"
MARK = "STAGER_LAB_RUN"
LABEL = "stage-node"
MODEL = "lab/model"
# RFC 2544's benchmarking range: never routed, so a mistake cannot reach another network.
TEST_RANGE = ipaddress.ip_network("198.18.0.0/15")
INNER_IF = "lab0"  # the veth end inside each namespace
HEAD_OBJECT_STORE = 80 * MiB
NODE_OBJECT_STORE = 100 * MiB
CPU_V1 = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller: --cpu-quota's cpu.cfs_quota_us
SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server")
# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): what each frame adds to the TCP payload.
FRAME_OVERHEAD = 66
_RUN_ID = re.compile(r"^[0-9a-f]{4}$")
# Loaded by every Python process of every lab node: while the node's flag file exists
# (Lab.corrupting), its large sends lose a bit. A switch rather than a restart: a node restarted
# under its own label was, for Ray, two nodes of that label until the dead one timed out, and the
# relay could be scheduled onto the dead one.
CORRUPTING_SITE = '''import os
import socket

_sendall = socket.socket.sendall
_sendmsg = socket.socket.sendmsg
_flag = os.environ.get("STAGE_LAB_CORRUPT_FLAG", "")


def _corrupting(data):
    if len(data) >= 1 << 20 and _flag and os.path.exists(_flag):
        data = bytearray(data)
        data[len(data) // 2] ^= 0x01
    return data


def _corrupting_sendall(self, data, *args):
    return _sendall(self, _corrupting(data), *args)


def _corrupting_sendmsg(self, buffers, *args):
    # The relay sends a chunk as one sendmsg of its frame and a view of its buffer.
    return _sendmsg(self, [_corrupting(memoryview(b).cast("B")) for b in buffers], *args)


socket.socket.sendall = _corrupting_sendall
socket.socket.sendmsg = _corrupting_sendmsg
'''


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


# ---- the configuration and what was built ---------------------------------------------------------

@dataclass(frozen=True)
class LabConfig:
    """nodes: how many (named dgx1..dgxN); rate_mbit: every link, both directions; size: the
    NAS hub's model bytes, split into `files` safetensors shards; slow: node name -> its own
    rate in Mbit/s (a straggler); fast_nas, cpu_quota: the modes that make direct reads win."""

    nodes: int = 3
    rate_mbit: float = 100.0
    size: int = 48 * MiB
    files: int = 6
    slow: tuple[tuple[str, float], ...] = ()
    base: Path = Path(tempfile.gettempdir())
    fast_nas: bool = False  # the manifest's nas.hub is the NAS's directory itself, not its sftp:// URL
    cpu_quota: float | None = None  # cores each node's processes may use (cgroup v1 cpu.cfs_quota_us)

    def rate_of(self, node: str) -> float:
        return dict(self.slow).get(node, self.rate_mbit)


@dataclass(frozen=True)
class Member:
    """A namespace on the bridge: the NAS or a node."""

    name: str
    namespace: str
    address: str
    host_link: str  # the veth end in the root namespace, on the bridge
    rate_mbit: float


@dataclass(frozen=True)
class LinkCounters:
    """A veth end's counters, from /sys/class/net/<link>/statistics, in the root namespace."""

    rx_bytes: int
    rx_packets: int
    tx_bytes: int
    tx_packets: int

    def __sub__(self, before: "LinkCounters") -> "LinkCounters":
        return LinkCounters(self.rx_bytes - before.rx_bytes, self.rx_packets - before.rx_packets,
                            self.tx_bytes - before.tx_bytes, self.tx_packets - before.tx_packets)

    @property
    def sent_payload(self) -> int:
        """What the member sent, less the frame headers: its TCP payload (SSH's framing included).
        The root-namespace end receives what the member sends."""
        return self.rx_bytes - FRAME_OVERHEAD * self.rx_packets


@dataclass
class Lab:
    """A running lab. Use as a context manager (or up()/down()); everything it made is removed on
    exit, and by its reaper if this process dies."""

    config: LabConfig
    run_id: str = ""
    root: Path = Path()
    bridge: str = ""
    head_address: str = ""  # the bridge's address: Ray's head and the driver
    nas: Member | None = None
    nodes: dict[str, Member] = field(default_factory=dict)
    ray_port: int = 0
    token: Path = Path()
    ssh_key: Path = Path()
    known_hosts: Path = Path()
    nas_hub: Path = Path()
    sftp_log: Path = Path()
    manifest: Path = Path()
    sha256: dict[str, str] = field(default_factory=dict)  # snapshot path -> sha256, as on the NAS
    snapshot_dir: str = ""  # the snapshot's path relative to a hub
    data_bytes: int = 0
    _reaper: subprocess.Popen | None = None
    _reaper_pipe: int | None = None

    # -- life cycle

    def __enter__(self) -> "Lab":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        require_root()
        sweep_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.run_id = claim_run_id()
        self.root = Path(tempfile.mkdtemp(prefix=f"stlab-{self.run_id}-", dir=self.config.base))
        write_state(self.run_id, {"owner": own_identity(), "root": str(self.root)})
        atexit.register(self.down)
        self._start_reaper()
        subnet = free_subnet()
        hosts = subnet.hosts()
        self.bridge = f"sl{self.run_id}br"
        self.head_address = str(next(hosts))
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.head_address}/{subnet.prefixlen}", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        names = ["nas"] + [f"dgx{i}" for i in range(1, self.config.nodes + 1)]
        for index, name in enumerate(names):
            member = Member(name, f"{NS_PREFIX}{self.run_id}-{name}", str(next(hosts)), f"sl{self.run_id}h{index}",
                            self.config.rate_mbit if name == "nas" else self.config.rate_of(name))
            self._join(member, subnet.prefixlen)
            if name == "nas":
                self.nas = member
            else:
                self.nodes[name] = member
        self._build_nas()
        self._keys()
        self._start_sshd(self.nas, self.nas_hub, log=True)
        for member in self.nodes.values():
            (self.root / "nodes" / member.name / "hub").mkdir(parents=True)
            self._start_sshd(member, None)
        self._compile_package()
        self._start_ray()
        self._write_manifest()

    def down(self) -> None:
        if not self.run_id:
            return
        teardown(self.run_id)
        if self._reaper_pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._reaper_pipe)
            self._reaper_pipe = None
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=30)
            self._reaper = None
        atexit.unregister(self.down)
        self.run_id = ""

    def _start_reaper(self) -> None:
        """A process in its own session that tears the run down once this one is gone: it reads a
        pipe whose only writer is this process, and the kernel closes it however this one dies."""
        read_end, write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != MARK}
        self._reaper = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "reap", self.run_id],
                                        stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True, env=env)
        os.close(read_end)
        self._reaper_pipe = write_end

    # -- the network

    def _join(self, member: Member, prefixlen: int) -> None:
        run(["ip", "netns", "add", member.namespace])
        run(["ip", "link", "add", member.host_link, "type", "veth", "peer", "name", INNER_IF,
             "netns", member.namespace])
        run(["ip", "link", "set", member.host_link, "master", self.bridge, "up"])
        inside = ["ip", "-n", member.namespace]
        run(inside + ["addr", "add", f"{member.address}/{prefixlen}", "dev", INNER_IF])
        run(inside + ["link", "set", INNER_IF, "up"])
        run(inside + ["link", "set", "lo", "up"])
        # Both ends' egress: the root-namespace end shapes what the member receives, the inner
        # end what it sends.
        shape([], member.host_link, member.rate_mbit)
        shape(["-n", member.namespace], INNER_IF, member.rate_mbit)

    def counters(self, member: Member | None = None) -> LinkCounters:
        link = (member or self.nas).host_link
        stats = Path("/sys/class/net") / link / "statistics"
        read = lambda name: int((stats / name).read_text())  # noqa: E731
        return LinkCounters(read("rx_bytes"), read("rx_packets"), read("tx_bytes"), read("tx_packets"))

    def reshape(self, node: str, rate_mbit: float) -> None:
        """Change one node's link rate (both directions) while the lab runs."""
        member = self.nodes[node]
        shape([], member.host_link, rate_mbit, "change")
        shape(["-n", member.namespace], INNER_IF, rate_mbit, "change")

    # -- the NAS and its hub

    def _build_nas(self) -> None:
        """One model of `files` safetensors shards of about size/files each, and a config.json."""
        hub = hubgen.Hub(self.root / "nas" / "hf" / "hub")
        snap = hub.repo(MODEL).snapshot()
        snap.add_git("config.json", b'{"architectures": ["LabForCausalLM"]}')
        per = self.config.size // self.config.files
        for i in range(self.config.files):
            size, chunks = hubgen.streamed_safetensors(1000 + i, per - 8 * 128)
            snap.add_lfs_stream(f"model-{i + 1:05d}-of-{self.config.files:05d}.safetensors", size, chunks,
                                shared=False)
        snap.finish()
        self.nas_hub = hub.root
        self.sha256 = dict(snap.sha256)
        self.snapshot_dir = str(snap.dir.relative_to(hub.root))
        self.data_bytes = sum(entry["size"] for entry in snap.files.values())

    def _keys(self) -> None:
        keys = self.root / "ssh"
        keys.mkdir(mode=0o700)
        for name in ("host_key", "user_key"):
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"stager-lab-{name}", "-f", str(keys / name)])
        shutil.copy(keys / "user_key.pub", keys / "authorized_keys")
        host_key = " ".join((keys / "host_key.pub").read_text().split()[:2])
        members = [self.nas, *self.nodes.values()]
        (keys / "known_hosts").write_text("".join(f"{m.address} {host_key}\n" for m in members))
        self.ssh_key, self.known_hosts = keys / "user_key", keys / "known_hosts"
        self.token = self.root / "ray-token"
        fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)

    def _start_sshd(self, member: Member, hub: Path | None, log: bool = False) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        sftp_server = next((p for p in SFTP_SERVERS if os.path.exists(p)), None)
        if not os.path.exists(sshd) or sftp_server is None:
            raise LabError("openssh-server is not installed (scripts/test.sh installs it)")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        keys = self.ssh_key.parent
        workdir = self.root / "sshd" / member.name
        workdir.mkdir(parents=True, exist_ok=True)
        sftp = f"{sftp_server} -e -l INFO 2>>{workdir / 'sftp.log'}" if log else sftp_server
        if log:
            self.sftp_log = workdir / "sftp.log"
            self.sftp_log.touch()
        config = workdir / "sshd_config"
        config.write_text(f"""Port 22
ListenAddress {member.address}
HostKey {keys / 'host_key'}
PidFile {workdir / 'sshd.pid'}
AuthorizedKeysFile {keys / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
UseDNS no
MaxStartups 200
MaxSessions 64
LogLevel VERBOSE
Subsystem sftp {sftp}
""")
        self.spawn(member, [sshd, "-D", "-f", str(config), "-E", str(workdir / "sshd.log")])
        wait_listening(member.address, 22, f"sshd of {member.name} ({workdir / 'sshd.log'})")

    # -- Ray

    def ray_env(self) -> dict[str, str]:
        """The environment of every Ray process of the lab: the token, the lab's SSH key (node-local
        `stage` commands inherit it), and the run's mark."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({MARK: self.run_id, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token),
                    # 1: listen on and register the node's own address (0 keeps Ray on loopback, and
                    # `ray start --address` then refuses to join).
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0",
                    # A machine shared with other work starves raylets for seconds at a time; by
                    # default the GCS marks a node dead after 5 missed 10 s health checks, and the
                    # lab would then measure Ray's detector, not the transport.
                    "RAY_health_check_timeout_ms": "30000", "RAY_health_check_failure_threshold": "10",
                    "STAGE_SSH_KEY": str(self.ssh_key), "STAGE_SSH_KNOWN_HOSTS": str(self.known_hosts)})
        return env

    def driver_env(self) -> dict[str, str]:
        """The environment for `stage fleet` (or a Ray driver) in the root namespace."""
        env = self.ray_env()
        del env[MARK]
        env["RAY_ADDRESS"] = f"{self.head_address}:{self.ray_port}"
        return env

    @staticmethod
    def _compile_package() -> None:
        """Write the package's bytecode, as pip does when it installs it on a node. Run from an
        editable checkout with PYTHONDONTWRITEBYTECODE set, every agent's Ray worker and every
        `stage` process would compile each module again: 0.1 CPU s a process, on the lab's 2
        shared cores, that no installed node spends."""
        import stager

        compileall.compile_dir(Path(stager.__file__).parent, quiet=1)

    def _start_ray(self) -> None:
        ports = free_ports(self.head_address, 5)
        self.ray_port = ports[0]
        head = [ray_bin(), "start", "--head", "--port", str(ports[0]), "--node-ip-address", self.head_address,
                "--num-cpus", "0", "--object-store-memory", str(HEAD_OBJECT_STORE), "--dashboard-port",
                str(ports[1]), "--ray-client-server-port", str(ports[2]), "--dashboard-agent-listen-port",
                str(ports[3]), "--metrics-export-port", str(ports[4]), "--temp-dir", str(self.root / "ray"),
                "--include-dashboard=false", "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port",
                "0"]
        self._ray_start(None, head, "head")
        for member in self.nodes.values():
            self._ray_start(member, self._node_argv(member), member.name)
            self.wait_for_nodes({member.name})

    def _node_argv(self, member: Member) -> list[str]:
        return [ray_bin(), "start", "--address", f"{self.head_address}:{self.ray_port}", "--node-ip-address",
                member.address, "--num-cpus", "1", "--object-store-memory", str(NODE_OBJECT_STORE),
                "--labels", f"{LABEL}={member.name}", "--temp-dir", str(self.root / f"ray-{member.name}"),
                "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0"]

    def rejoin(self, member: Member) -> None:
        """Bring a node back after kill_node: its sshd, and a new Ray node with its label."""
        self.kill_node(member.name)
        self._start_sshd(member, None)
        self._ray_start(member, self._node_argv(member), f"{member.name}-again")
        self.wait_for_nodes({member.name})

    def corrupting(self, member: Member, on: bool = True) -> None:
        """Make a node a corrupting peer (or, with on=False, honest again): every Python process
        on it (its Ray workers, so its relay) flips one byte in each socket send of 1 MiB or more,
        the way a bad NIC or a malicious member would send a chunk. Its control traffic (small
        sends, Ray's C++ core, sshd) is untouched."""
        flag = self._corrupt_flag(member)
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def _corrupt_flag(self, member: Member) -> Path:
        return self.root / f"corrupt-{member.name}"

    def _corrupting_site(self) -> Path:
        """The directory on every node's PYTHONPATH holding CORRUPTING_SITE, written once."""
        site = self.root / "corrupting-site"
        if not site.is_dir():
            site.mkdir()
            (site / "sitecustomize.py").write_text(CORRUPTING_SITE)
        return site

    def _ray_start(self, member: Member | None, argv: list[str], name: str) -> None:
        log = self.root / f"ray-start-{name}.log"
        env = self.ray_env()
        if member is not None:
            env.update({"PYTHONPATH": str(self._corrupting_site()),
                        "STAGE_LAB_CORRUPT_FLAG": str(self._corrupt_flag(member))})
        with open(log, "wb") as out:
            proc = subprocess.run(self._in(member, argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=180, preexec_fn=self._enter_cgroup(member))
        if proc.returncode != 0:
            raise LabError(f"ray start for {name} failed (exit {proc.returncode}): {log.read_text()[-2000:]}")

    def wait_for_nodes(self, labels: set[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        alive: set[str] = set()
        while time.monotonic() < deadline:
            alive = self.alive_labels()
            if labels <= alive:
                return
            time.sleep(1)
        raise LabError(f"Ray nodes {sorted(labels - alive)} did not register within {timeout:g}s")

    def alive_labels(self) -> set[str]:
        """The stage-node labels of the live Ray nodes, asked of the GCS by a short-lived driver
        process (Ray caches its token per process, and a test process may hold another)."""
        code = ("import ray, json; ray.init(log_to_driver=False, logging_level='ERROR'); "
                f"print(json.dumps([n['Labels'].get('{LABEL}') for n in ray.nodes() if n['Alive']]))")
        proc = subprocess.run([sys.executable, "-c", code], env=self.driver_env(), capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            return set()
        return {label for label in json.loads(proc.stdout.strip().splitlines()[-1]) if label}

    # -- processes

    def _in(self, member: Member | None, argv: list[str]) -> list[str]:
        return argv if member is None else ["ip", "netns", "exec", member.namespace, *argv]

    def cgroup(self, member: Member | None) -> Path | None:
        """The member's cgroup (the head's for None), made on first use; None without cgroup v2."""
        group = run_cgroup(self.run_id)
        if group is None:
            return None
        path = group / (member.name if member else "head")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _enter_cgroup(self, member: Member | None):
        """A preexec_fn that moves the child into the member's cgroup before it runs, and into its
        CPU-quota cgroup (cgroup v1) when the lab has a quota and the member is a node."""
        group = self.cgroup(member)
        quota = self.quota_cgroup(member)
        procs = [str(g / "cgroup.procs") for g in (group, quota) if g is not None]
        if not procs:
            return None

        def enter() -> None:
            for path in procs:
                with open(path, "w") as handle:
                    handle.write("0")
        return enter

    def quota_cgroup(self, member: Member | None) -> Path | None:
        """The node's cgroup v1 cpu group, capped at config.cpu_quota cores (made on first use);
        None for the NAS and the head, or without a quota."""
        if self.config.cpu_quota is None or member is None or member.name == "nas":
            return None
        group = quota_root(self.run_id) / member.name
        if not group.is_dir():
            group.mkdir(parents=True)
            period = int((group / "cpu.cfs_period_us").read_text())
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(self.config.cpu_quota * period))))
        return group

    def cpu_seconds(self, member: Member | None) -> float | None:
        """User + system CPU of every process the member ever ran (its cgroup's cpu.stat)."""
        group = self.cgroup(member)
        if group is None:
            return None
        for line in (group / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return None

    def spawn(self, member: Member | None, argv: list[str], **kwargs) -> subprocess.Popen:
        """A long-lived process of the lab, in a member's namespace (or the root one), marked with
        the run's id so teardown finds it and its descendants."""
        return subprocess.Popen(self._in(member, argv), env=kwargs.pop("env", self.ray_env()),
                                stdin=subprocess.DEVNULL, stdout=kwargs.pop("stdout", subprocess.DEVNULL),
                                stderr=kwargs.pop("stderr", subprocess.DEVNULL), start_new_session=True,
                                preexec_fn=self._enter_cgroup(member), **kwargs)

    def pids(self, member: Member) -> list[int]:
        """Every process in a member's namespace."""
        out = subprocess.run(["ip", "netns", "pids", member.namespace], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill_node(self, node: str) -> int:
        """kill -9 every process in the node's namespace (its raylet, workers and `stage` commands):
        a machine that died. Returns how many were killed."""
        return kill_all(lambda: self.pids(self.nodes[node]))

    def freeze_node(self, node: str) -> list[int]:
        """SIGSTOP every process in the node's namespace (its raylet, workers, `stage` commands,
        sshd): a node whose kernel hangs or whose VM is paused. Ray still lists it as alive, and
        its connections stay open (its kernel still acknowledges what arrives). Returns the pids
        stopped; thaw_node resumes them."""
        return stop_all(lambda: self.pids(self.nodes[node]))

    def thaw_node(self, node: str) -> None:
        """SIGCONT every process in the node's namespace."""
        for pid in self.pids(self.nodes[node]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def staged_hub(self, node: str) -> Path:
        return self.root / "nodes" / node / "hub"

    def wipe_hubs(self) -> None:
        """Empty every node's local hub (between runs of a measurement)."""
        for node in self.nodes:
            hub = self.staged_hub(node)
            shutil.rmtree(hub, ignore_errors=True)
            hub.mkdir(parents=True)

    # -- the manifest

    @property
    def nas_url(self) -> str:
        return f"sftp://root@{self.nas.address}{self.nas_hub}"

    def _write_manifest(self, path: Path | None = None, extra: dict[str, str] | None = None,
                        fast_nas: bool | None = None) -> Path:
        fast = self.config.fast_nas if fast_nas is None else fast_nas
        lines = ["[nas]", f'hub = "{self.nas_hub if fast else self.nas_url}"', f'\n[models."{MODEL}"]']
        for rank, member in enumerate(self.nodes.values()):
            lines += [f"\n[nodes.{member.name}]", f'hub = "{self.staged_hub(member.name)}"', f'models = ["{MODEL}"]',
                      f"rank = {rank}", f'address = "root@{member.address}"', (extra or {}).get(member.name, "")]
        path = path or self.root / "cluster.toml"
        path.write_text("\n".join(lines) + "\n")
        if path == self.root / "cluster.toml":
            self.manifest = path
        return path

    def manifest_with(self, name: str, extra: dict[str, str], fast_nas: bool | None = None) -> Path:
        """Another manifest for the same lab, with extra lines per node (e.g. a `source`), and the
        NAS as a path every namespace reads (`fast_nas`) or over SSH."""
        return self._write_manifest(self.root / name, extra, fast_nas)

    def describe(self) -> dict:
        return {"run": self.run_id, "root": str(self.root), "bridge": self.bridge, "manifest": str(self.manifest),
                "nas": {"address": self.nas.address, "url": self.nas_url, "namespace": self.nas.namespace,
                        "link": self.nas.host_link},
                "nodes": {m.name: {"address": m.address, "namespace": m.namespace, "link": m.host_link,
                                   "rate_mbit": m.rate_mbit, "hub": str(self.staged_hub(m.name))}
                          for m in self.nodes.values()},
                "rate_mbit": self.config.rate_mbit, "data_bytes": self.data_bytes, "files": self.config.files,
                "env": {k: v for k, v in self.driver_env().items() if k.startswith(("RAY_", "STAGE_SSH"))}}

    # -- checking what a node staged

    def staged_digests(self, node: str) -> dict[str, str | None]:
        """sha256 of every file of the snapshot as staged on `node` (None: missing)."""
        out = {}
        for rel in self.sha256:
            path = self.staged_hub(node) / self.snapshot_dir / rel
            out[rel] = sha256_file(path) if path.exists() else None
        return out


class LabError(RuntimeError):
    pass


# ---- helpers -------------------------------------------------------------------------------------

def run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise LabError(f"{shlex.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def shape(netns: list[str], link: str, rate_mbit: float, verb: str = "add") -> None:
    """tbf at `rate_mbit` on the link's egress. The bucket holds 1 ms at the rate, and at least
    256 KiB, and the queue 50 ms.

    Why 256 KiB: tbf splits a packet larger than its bucket into MTU-sized frames, and a GSO
    packet is 64 KiB of payload plus its headers. With a 64 KiB bucket every frame crossed the
    bridge and its netfilter hooks on its own, and at 8 nodes on 2 cores that per-frame work,
    not the transport under test, set the pace (the broadcast's chain took 29 s at 200 Mbit/s
    for 256 MiB; 17 s with this bucket). A real NIC segments in hardware. Over a transfer of
    seconds a 256 KiB bucket (10 ms at 200 Mbit/s) does not change the rate."""
    burst = max(256 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
    run(["tc", *netns, "qdisc", verb, "dev", link, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
         "latency", "50ms"])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, bridges, tc)")


def free_ports(host: str, count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_listening(host: str, port: int, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise LabError(f"{what} is not listening on {host}:{port} after {timeout:g}s")


def free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of the test range that no address or route on this machine overlaps."""
    used = []
    for argv in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for token in run(argv).stdout.split():
            with contextlib.suppress(ValueError):
                if "/" in token or token.count(".") == 3:
                    used.append(ipaddress.ip_network(token, strict=False))
    for subnet in TEST_RANGE.subnets(new_prefix=24):
        if not any(subnet.overlaps(net) for net in used if net.prefixlen > 0):
            return subnet
    raise LabError(f"no free /24 left in {TEST_RANGE}")


def own_identity(pid: int | None = None) -> list[int] | None:
    """(pid, start time in clock ticks): a pid alone can be reused after its process dies."""
    pid = pid or os.getpid()
    try:
        return [pid, int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])]
    except (OSError, IndexError, ValueError):
        return None


def write_state(run_id: str, state: dict) -> None:
    path = STATE_DIR / f"{run_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def read_state(run_id: str) -> dict | None:
    try:
        return json.loads((STATE_DIR / f"{run_id}.json").read_text())
    except (OSError, ValueError):
        return None


def claim_run_id() -> str:
    """A run id no namespace, link or record on this machine uses yet."""
    taken = set(present_runs())
    for _ in range(100):
        candidate = secrets.token_hex(2)
        path = STATE_DIR / f"{candidate}.json"
        if candidate in taken:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        os.write(fd, json.dumps({"owner": own_identity()}).encode())
        os.close(fd)
        return candidate
    raise LabError("no free run id")


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a hybrid host),
    or None. The lab uses it only to count each member's CPU: a cgroup's cpu.stat includes its
    processes that have already exited, which /proc cannot give."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def run_cgroup(run_id: str) -> Path | None:
    root = cgroup2_root()
    return root / f"stager-lab-{run_id}" if root else None


def quota_root(run_id: str) -> Path:
    """The run's cgroup v1 cpu group, which holds each node's quota group."""
    if not CPU_V1.is_dir():
        raise LabError(f"--cpu-quota needs cgroup v1's cpu controller at {CPU_V1}")
    return CPU_V1 / f"stager-lab-{run_id}"


def remove_quota_cgroups(run_id: str) -> None:
    """Remove the run's cgroup v1 quota groups; a process still in one (v1 has no cgroup.kill) is
    killed first."""
    root = CPU_V1 / f"stager-lab-{run_id}"
    if not root.is_dir():
        return
    deadline = time.monotonic() + 10
    for path in [*(child for child in root.iterdir() if child.is_dir()), root]:
        while path.exists():
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    break
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)


def remove_cgroups(run_id: str) -> None:
    """Kill whatever is still in the run's cgroups (cgroup.kill), then remove them. A cgroup
    cannot be removed while a dying process is still leaving it, so this waits a little."""
    remove_quota_cgroups(run_id)
    group = run_cgroup(run_id)
    if group is None or not group.exists():
        return
    children = [child for child in group.iterdir() if child.is_dir()]
    for child in children:
        with contextlib.suppress(OSError):
            (child / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 10
    for path in [*children, group]:
        while path.exists():
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)


def namespaces() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def present_runs() -> dict[str, dict]:
    """Every run with something on this machine (a record, a namespace or a link), and its record."""
    ids = {p.stem for p in STATE_DIR.glob("*.json")} if STATE_DIR.exists() else set()
    ids |= {ns[len(NS_PREFIX):].split("-")[0] for ns in namespaces() if ns.startswith(NS_PREFIX)}
    ids |= {link[2:6] for link in links() if re.match(r"^sl[0-9a-f]{4}(br|h\d+)$", link)}
    ids |= {run_id for run_id, _pid in marked_processes()}
    cgroups = cgroup2_root()
    if cgroups:
        ids |= {group.name[len("stager-lab-"):] for group in cgroups.glob("stager-lab-*")}
    return {run_id: read_state(run_id) or {} for run_id in ids if _RUN_ID.match(run_id)}


def owner_alive(state: dict) -> bool:
    owner = state.get("owner")
    return bool(owner) and own_identity(owner[0]) == owner


def marked_processes() -> list[tuple[str, int]]:
    """(run id, pid) of every process carrying STAGER_LAB_RUN in its environment."""
    found = []
    needle = f"{MARK}=".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(needle):
                found.append((var[len(needle):].decode(errors="replace"), int(entry)))
                break
    return found


def kill_all(find) -> int:
    """SIGKILL what find() returns until it returns nothing (processes may fork meanwhile)."""
    killed = 0
    for _ in range(50):
        pids = [pid for pid in find() if pid != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.1)
    return killed


def stop_all(find) -> list[int]:
    """SIGSTOP what find() returns until every one of them is stopped (one not stopped yet may fork
    meanwhile). Returns the pids stopped."""
    stopped: set[int] = set()
    for _ in range(50):
        moving = [pid for pid in find() if pid != os.getpid() and process_state(pid) not in ("T", "Z", None)]
        if not moving:
            break
        for pid in moving:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
        time.sleep(0.05)
    return sorted(stopped)


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, Z, ...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def teardown(run_id: str) -> None:
    """Remove everything of a run: its processes, namespaces, links (and so their qdiscs), its
    directory and its record. Safe to run twice and from two processes at once."""
    if not _RUN_ID.match(run_id):
        raise LabError(f"not a lab run id: {run_id!r}")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / f"{run_id}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_state(run_id) or {}
        prefix = f"{NS_PREFIX}{run_id}-"

        def processes() -> list[int]:
            pids = {pid for rid, pid in marked_processes() if rid == run_id}
            for ns in namespaces():
                if ns.startswith(prefix):
                    out = run(["ip", "netns", "pids", ns], check=False).stdout
                    pids |= {int(pid) for pid in out.split()}
            return sorted(pids)

        kill_all(processes)
        for ns in namespaces():
            if ns.startswith(prefix):
                run(["ip", "netns", "del", ns], check=False)
        for link in links():
            if re.match(rf"^sl{run_id}(br|h\d+)$", link):
                run(["ip", "link", "del", link], check=False)
        remove_cgroups(run_id)
        root = state.get("root")
        if root and Path(root).name.startswith(f"stlab-{run_id}-"):
            shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"{run_id}.json").unlink()
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"{run_id}.lock").unlink()


def sweep_stale(everything: bool = False) -> list[str]:
    """Tear down the runs whose owner is gone (a killed run that its reaper did not finish), or
    with `everything`, every run. Returns the ids removed."""
    removed = []
    for run_id, state in present_runs().items():
        if everything or not owner_alive(state):
            teardown(run_id)
            removed.append(run_id)
    return removed


def leftovers(run_id: str) -> dict[str, list]:
    """What of a run is still on the machine (empty lists: nothing)."""
    prefix = f"{NS_PREFIX}{run_id}-"
    return {"namespaces": [ns for ns in namespaces() if ns.startswith(prefix)],
            "links": [link for link in links() if re.match(rf"^sl{run_id}(br|h\d+)$", link)],
            "qdiscs": [line for line in run(["tc", "qdisc", "show"], check=False).stdout.splitlines()
                       if f"sl{run_id}" in line],
            "processes": [pid for rid, pid in marked_processes() if rid == run_id],
            "cgroups": [str(g) for g in (run_cgroup(run_id), CPU_V1 / f"stager-lab-{run_id}") if g and g.exists()],
            "files": [p for p in (STATE_DIR / f"{run_id}.json",) if p.exists()]
                     + list(Path(tempfile.gettempdir()).glob(f"stlab-{run_id}-*"))}


# ---- the command line ----------------------------------------------------------------------------

def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(|k|ki|kib|m|mi|mib|g|gi|gib)", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 48MiB, 512MiB, 1GiB)")
    scale = {"": 1, "k": 1024, "m": MiB, "g": 1024 * MiB}[match.group(2)[:1]]
    return int(float(match.group(1)) * scale)


def parse_slow(text: str) -> tuple[str, float]:
    name, _, rate = text.partition("=")
    try:
        return name, float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slow expects NODE=MBIT, e.g. dgx3=25, got {text!r}") from None


def config_from(args) -> LabConfig:
    return LabConfig(nodes=args.nodes, rate_mbit=args.rate, size=args.size, files=args.files,
                     slow=tuple(args.slow or ()), fast_nas=args.fast_nas, cpu_quota=args.cpu_quota)


def add_lab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=3, help="how many nodes, named dgx1..dgxN (default 3)")
    parser.add_argument("--rate", type=float, default=100.0, help="every link's rate in Mbit/s, both ways (100)")
    parser.add_argument("--size", type=parse_size, default=48 * MiB, help="model bytes on the NAS (48MiB)")
    parser.add_argument("--files", type=int, default=6, help="how many shards the model has (6)")
    parser.add_argument("--slow", type=parse_slow, action="append", metavar="NODE=MBIT",
                        help="a node shaped to its own rate (repeatable), e.g. dgx3=25")
    parser.add_argument("--fast-nas", action="store_true",
                        help="the manifest's nas.hub is the NAS's directory, which every namespace reads past "
                             "the shaped links (a fast NFS mount's stand-in)")
    parser.add_argument("--cpu-quota", type=float, metavar="CORES",
                        help="cap each node's processes at CORES cores (cgroup v1 cpu.cfs_quota_us), e.g. 0.25")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_lab.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See docs/fleet-lab.md, 'The lab'. Runs as root.")
    # `reap` is the lab's own reaper process (Lab._start_reaper), never typed: no help line, and not
    # among the commands listed (argparse printed "==SUPPRESS==" for it there).
    sub = parser.add_subparsers(dest="command", required=True, metavar="{up,run,down,list}")
    up = sub.add_parser("up", help="build a lab, print its description (JSON), hold it until SIGINT/SIGTERM")
    add_lab_options(up)
    runner = sub.add_parser("run", help="build a lab, run a command with the driver's environment, remove the lab",
                            description="$STAGE_LAB_MANIFEST, $STAGE_LAB_NAS_URL and the Ray/SSH variables are "
                                        "set for the command; it runs in the root namespace.")
    add_lab_options(runner)
    runner.add_argument("argv", nargs=argparse.REMAINDER, help="-- the command")
    down = sub.add_parser("down", help="remove labs whose owner process is gone")
    down.add_argument("--all", action="store_true", help="remove every lab on this machine, running or not")
    sub.add_parser("list", help="print the labs on this machine (JSON)")
    reap = sub.add_parser("reap")
    reap.add_argument("run_id")
    args = parser.parse_args(argv)

    if args.command == "reap":  # stdin is the owner's pipe: EOF means the owner is gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdin.buffer.read()
        teardown(args.run_id)
        return 0
    try:
        require_root()
        if args.command == "list":
            print(json.dumps({rid: {"owner_alive": owner_alive(s), **s} for rid, s in present_runs().items()}))
            return 0
        if args.command == "down":
            removed = sweep_stale(everything=args.all)
            print(f"removed {len(removed)} lab(s){': ' + ', '.join(removed) if removed else ''}", file=sys.stderr)
            return 0
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
        with Lab(config_from(args)) as lab:
            if args.command == "up":
                print(json.dumps(lab.describe()), flush=True)  # one line: `| jq` for people
                print(f"lab {lab.run_id} is up; Ctrl-C (or SIGTERM to {os.getpid()}) removes it", file=sys.stderr)
                while True:
                    time.sleep(3600)
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                parser.error("run: give the command after --")
            env = {**lab.driver_env(), "STAGE_LAB_MANIFEST": str(lab.manifest), "STAGE_LAB_NAS_URL": lab.nas_url}
            before, started = lab.counters(), time.monotonic()
            # The lab's paths exist only now: '$STAGE_LAB_MANIFEST' in the command is replaced here.
            command = [arg.replace("$STAGE_LAB_MANIFEST", env["STAGE_LAB_MANIFEST"])
                       .replace("$STAGE_LAB_NAS_URL", env["STAGE_LAB_NAS_URL"]) for arg in command]
            code = subprocess.run(command, env=env).returncode
            sent = lab.counters() - before
            print(json.dumps({"seconds": round(time.monotonic() - started, 2), "exit_code": code,
                              "data_bytes": lab.data_bytes, "nas_sent_bytes": sent.rx_bytes,
                              "nas_sent_payload": sent.sent_payload,
                              "nas_payload_per_data": round(sent.sent_payload / lab.data_bytes, 4)}), file=sys.stderr)
            return code
    except KeyboardInterrupt:
        return 130
    except LabError as exc:
        print(f"fleet_lab: error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
