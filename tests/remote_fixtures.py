"""A real OpenSSH server on 127.0.0.1 for sftp:// sources: throw-away host and user keys, a free
port, and a per-file log of the bytes the server read (how the NAS-byte counts are measured)."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import sha256_file

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


def start_sshd(workdir: Path) -> SshServer:
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
LogLevel VERBOSE
Subsystem sftp {sftp_server} -e -l INFO 2>>{sftp_log}
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
