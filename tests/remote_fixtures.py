"""A real OpenSSH server on 127.0.0.1 for sftp:// sources: throw-away host and user keys, a free
port, and a per-file log of the bytes the server read (how the NAS-byte counts are measured)."""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import sha256_file, write_manifest
from hubgen import Hub, random_safetensors

SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server")
_CLOSE = re.compile(r'^close "(.*)" bytes read (\d+) written (\d+)$')


@dataclass
class SshServer:
    process: subprocess.Popen
    port: int
    user: str
    key: Path
    known_hosts: Path
    sftp_log: Path

    @property
    def address(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    def url(self, path: Path | str) -> str:
        return f"sftp://{self.address}{path}"

    @property
    def log(self) -> Path:
        """sshd's own log (-E), its listener's and every connection's."""
        return self.sftp_log.with_name("sshd.log")

    @property
    def env(self) -> dict[str, str]:
        return {"STAGE_SSH_KEY": str(self.key), "STAGE_SSH_KNOWN_HOSTS": str(self.known_hosts)}

    def bytes_read(self, under: Path | str) -> int:
        """Bytes the server read from files under `under`, from sftp-server's close records."""
        prefix = str(under).rstrip("/") + "/"
        total = 0
        for line in self.sftp_log.read_text().splitlines():
            match = _CLOSE.match(line)
            if match and match.group(1).startswith(prefix):
                total += int(match.group(2))
        return total

    def session_pids(self) -> list[int]:
        """The per-connection sshd processes (children of the listener)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()] if children.exists() else []

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_sshd(workdir: Path, read_cap: int | None = None, max_sessions: int = 10,
               log_level: str = "VERBOSE") -> SshServer:
    """A real sshd with throw-away keys. `read_cap`: its sftp-server answers no read with more
    than that many bytes (an older or stricter server), through SFTP_READ_CAP's filter.
    `max_sessions`: sessions it allows per connection (OpenSSH's MaxSessions, 10 by default).
    `log_level`: its LogLevel, in `log` (DEBUG names each request a client sends)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    sftp_server = next((p for p in SFTP_SERVERS if os.path.exists(p)), None)
    if not os.path.exists(sshd) or sftp_server is None:
        raise RuntimeError("openssh-server is not installed (scripts/test.sh installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(workdir / name)], check=True)
    shutil.copy(workdir / "user_key.pub", workdir / "authorized_keys")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    sftp_log = workdir / "sftp.log"
    sftp_log.touch()
    subsystem = f"{sftp_server} -e -l INFO 2>>{sftp_log}"
    if read_cap is not None:
        (workdir / "read_cap.py").write_text(SFTP_READ_CAP)
        subsystem = f"{sys.executable} {workdir / 'read_cap.py'} {read_cap} {subsystem}"
    for _attempt in range(5):
        port = free_port()
        config = workdir / "sshd_config"
        config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {workdir / 'host_key'}
PidFile {workdir / 'sshd.pid'}
AuthorizedKeysFile {workdir / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
UseDNS no
MaxStartups 200
MaxSessions {max_sessions}
LogLevel {log_level}
Subsystem sftp {subsystem}
""")
        process = subprocess.Popen([sshd, "-D", "-f", str(config), "-E", str(workdir / "sshd.log")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _listening(port, process):
            host_key = (workdir / "host_key.pub").read_text().split()[:2]
            known_hosts = workdir / "known_hosts"
            known_hosts.write_text(f"[127.0.0.1]:{port} {' '.join(host_key)}\n")
            return SshServer(process, port, getpass.getuser(), workdir / "user_key", known_hosts, sftp_log)
        process.kill()
        process.wait()
    raise RuntimeError(f"sshd did not start; see {workdir / 'sshd.log'}")


# Between sshd and a real sftp-server: lowers the length of every SSH_FXP_READ request to the cap,
# so the server answers each read with at most that many bytes, as some servers do.
SFTP_READ_CAP = r"""
import os, struct, subprocess, sys
cap = int(sys.argv[1])
server = subprocess.Popen(" ".join(sys.argv[2:]), shell=True, stdin=subprocess.PIPE, stdout=sys.stdout.fileno())
def exact(n):
    data = b""
    while len(data) < n:
        got = os.read(0, n - len(data))
        if not got:
            return None
        data += got
    return data
while (head := exact(4)) is not None:
    body = exact(struct.unpack(">I", head)[0])
    if body is None:
        break
    if body[0] == 5:  # SSH_FXP_READ: id, string handle, uint64 offset, uint32 length
        handle_length = struct.unpack(">I", body[5:9])[0]
        at = 9 + handle_length + 8
        length = struct.unpack(">I", body[at:at + 4])[0]
        body = body[:at] + struct.pack(">I", min(length, cap)) + body[at + 4:]
    server.stdin.write(head + body)
    server.stdin.flush()
server.stdin.close()
server.wait()
"""


def _listening(port: int, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def silent_port() -> int:
    """A port that accepts TCP connections and never says a word (a hung host)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []

    def hold() -> None:
        while True:
            held.append(listener.accept())

    threading.Thread(target=hold, daemon=True).start()
    return listener.getsockname()[1]


def hub_tree(root: Path) -> dict[str, tuple]:
    """Every non-directory under a hub: its link text, the sha256 of a regular file, or "other"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".locks"]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif name in filenames:
                out[rel] = ("file", sha256_file(path)) if path.is_file() else ("other",)
    return out


# ---------------------------------------------------------------- the NAS the remote tests read

FLASH = "acme/Flash-3bpw"
DRAFTER = "acme/Flash-drafter"
HOSTILE = "acme/Hostile"
MiB = 1024 * 1024


def build_remote_nas(root: Path) -> dict:
    """A NAS hub with the layouts a real one has: shared-store two-hop links, an absolute link under
    an aliased prefix, a real file, nested paths, an excluded folder, .no_exist markers, and a repo
    of hostile links."""
    hub = Hub(root / "nas" / "hf" / "hub")
    flash = hub.repo(FLASH).snapshot()
    flash.add_git("config.json", b'{"architectures": ["DeepseekV4ForCausalLM"]}')
    flash.add_lfs("model-00001-of-00002.safetensors", random_safetensors(1, 3 * MiB + 4321), shared=True)
    flash.add_lfs("model-00002-of-00002.safetensors", random_safetensors(2, 2 * MiB), shared=True,
                  absolute_via="/volume1/hf/hub")
    flash.add_lfs("nested/deeper/adapter.safetensors", random_safetensors(5, MiB // 2), shared=False)
    flash.add_real("tokenizer.json", b'{"model": {"type": "BPE"}}')
    flash.add_lfs("page15/experts.safetensors", random_safetensors(15, MiB), shared=False)
    flash.finish(no_exist=("generation_config.json",))
    drafter = hub.repo(DRAFTER).snapshot()
    drafter.add_git("config.json", b'{"architectures": ["Drafter"]}')
    drafter.add_lfs("model.safetensors", random_safetensors(99, MiB), shared=True)
    drafter.finish()

    hostile = hub.repo(HOSTILE).snapshot()
    hostile.add_git("ok.json", b"{}")
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"not in the hub")
    os.symlink(outside, hostile.repo.dir / "linkdir")  # a directory link that leaves the hub
    hostile.add_raw_link("escape-relative", "../../../../../../../../../etc/hostname")
    hostile.add_raw_link("escape-absolute", str(outside / "secret.bin"))
    hostile.add_raw_link("escape-through-dir", "../../linkdir/secret.bin")
    hostile.add_raw_link("dangling", "../../blobs/" + "f" * 64)
    hostile.add_raw_link("loop-a", "loop-b")
    hostile.add_raw_link("loop-b", "loop-a")
    hostile.add_raw_link("a-directory", "../../blobs")
    hostile.add_raw_link("aliased", f"/volume1/hf/hub/{hostile.repo.dir.name}/snapshots/{hostile.commit}/ok.json")
    hostile.add_raw_link("cross-repo", f"../../../{flash.repo.dir.name}/snapshots/{flash.commit}/config.json")
    os.mkfifo(hostile.dir / "a-fifo")
    hostile.finish()
    return {"root": root, "hub": hub.root, "before": hub_tree(hub.root), "flash": flash, "drafter": drafter, "hostile": hostile,
            "aliases": {"/volume1/hf/hub": str(hub.root)}}


def manifest_for(path: Path, nas: dict, hub: str, local: Path, extra: str = "") -> Path:
    manifest = write_manifest(path, nas["hub"], local, {FLASH: {"exclude": ["page15/**"]}, DRAFTER: {}},
                              aliases=nas["aliases"], extra=extra)
    text = manifest.read_text().replace(f'hub = "{nas["hub"]}"', f'hub = "{hub}"', 1)
    manifest.write_text(text)
    return manifest


def load_offline(hub: Path) -> dict:
    """Load the staged models with huggingface_hub offline and safetensors, in a fresh process."""
    code = f"""
import json, warnings
warnings.simplefilter("error")
from huggingface_hub import hf_hub_download, scan_cache_dir, snapshot_download
from safetensors import safe_open
info = scan_cache_dir()
assert not info.warnings, info.warnings
out = {{"repos": sorted(r.repo_id for r in info.repos), "tensors": {{}}}}
snapshot_download("{FLASH}", ignore_patterns=["page15/**"])
for repo, name in (("{FLASH}", "model-00002-of-00002.safetensors"), ("{DRAFTER}", "model.safetensors")):
    with safe_open(hf_hub_download(repo, name), "np") as st:
        out["tensors"][name] = {{k: st.get_tensor(k).tobytes().hex() for k in st.keys()}}
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
