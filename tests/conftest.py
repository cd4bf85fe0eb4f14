"""Shared fixtures: real hub trees on disk and the real `stage` CLI in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every Ray the suite starts stays on loopback, and so does every Ray client in a test process.
# Ray reads this once, when it is first imported in a process: whichever test imported it first
# (for one of its exception classes, say) would otherwise decide, for every later test on that
# worker, whether "127.0.0.1" means loopback or this host's address. The namespace lab sets its
# own for the processes it starts.
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(RAY_LOOPBACK)
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "scripts" / "lab")]

from hubgen import Hub  # noqa: E402

BIN = Path(sys.executable).parent
# The installed entry point, as an operator's shell runs it (`python -m stager` where none is installed).
INSTALLED_STAGE = [str(BIN / "stage")] if (BIN / "stage").exists() else [sys.executable, "-m", "stager"]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def run_stage(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path | None = None) -> Result:
    """Run the real CLI (`python -m stager`) and capture everything."""
    proc = subprocess.run(
        [sys.executable, "-m", "stager", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def make_demo(where: Path) -> Path:
    """scripts/make_demo_nas.py as the README runs it, in `where`; returns the manifest path."""
    shutil.copytree(REPO / "scripts", where / "scripts")
    subprocess.run([sys.executable, "scripts/make_demo_nas.py", "demo"], cwd=where, check=True,
                   capture_output=True)
    return where / "demo" / "cluster.toml"


def open_files(pid: int) -> list[str]:
    """What `pid` has open now, as /proc names it: a descriptor closed (or the process gone) while
    they are read is left out, not an error."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return []
    paths = []
    for fd in fds:
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return paths


def bytes_written(pid: int) -> int:
    """What `pid` has written so far (its `wchar` in /proc/PID/io), 0 once it is gone: a temp
    file's size is no measure of a copy, which sizes the file whole before it writes."""
    try:
        return int(Path(f"/proc/{pid}/io").read_text().split("wchar:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return 0


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(path: Path, nas: Path, local: Path, models: dict[str, dict], *, reserve: str = "0",
                   aliases: dict[str, str] | None = None, extra: str = "") -> Path:
    """A manifest with one node `dgx1`. `models` maps repo id -> {revision, exclude}."""
    lines = ["[nas]", f'hub = "{nas}"']
    if aliases:
        lines.append("aliases = { " + ", ".join(f'"{k}" = "{v}"' for k, v in aliases.items()) + " }")
    for repo_id, cfg in models.items():
        lines.append(f'\n[models."{repo_id}"]')
        lines.append(f'revision = "{cfg.get("revision", "main")}"')
        if cfg.get("exclude"):
            lines.append("exclude = [" + ", ".join(f'"{g}"' for g in cfg["exclude"]) + "]")
    lines += ["\n[nodes.dgx1]", f'hub = "{local}"', f'reserve = "{reserve}"',
              "models = [" + ", ".join(f'"{m}"' for m in models) + "]"]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def source_writer(path: Path, mode: str, copying_into: Path) -> subprocess.Popen:
    """A real process that rewrites `path` in place (same size) or appends to it, from the moment
    a copy is in flight (a temp file under `copying_into`) until killed."""
    code = (
        "import os, sys, time\n"
        "path, mode, local = sys.argv[1:]\n"
        "fd = os.open(path, os.O_WRONLY | (os.O_APPEND if mode == 'append' else 0))\n"
        "size = os.fstat(fd).st_size\n"
        "n = 0\n"
        "print('ready', flush=True)\n"
        "while not any('.stage-' in n for _, _, names in os.walk(local) for n in names): time.sleep(0.001)\n"
        "while True:\n"
        "    n += 1\n"
        "    if mode == 'append':\n"
        "        os.write(fd, b'more ' * 200)\n"
        "    else:\n"
        "        os.pwrite(fd, bytes([n % 251]) * 65536, (n * 65536) % max(1, size - 65536))\n"
        "    time.sleep(0.002)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), mode, str(copying_into)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 with throw-away keys (remote_fixtures.py), one per module."""
    from remote_fixtures import start_sshd

    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def nas_hub(tmp_path: Path) -> Hub:
    return Hub(tmp_path / "nas" / "hf" / "hub")


@pytest.fixture
def local_hub(tmp_path: Path) -> Path:
    return tmp_path / "nvme" / "hf" / "hub"


# scripts/test.sh runs the suite on two xdist workers (the namespace lab after, alone): each module
# whole on one worker, its module fixtures built once; every module that starts Ray on the same
# worker, one after another, as their clusters, ports and session directories are machine-wide.
# The grouping is a scheduler of our own: xdist's `loadgroup` marks name a test's group by
# rewriting its node id, which pytest 9.2 no longer reads, and every test became a group of one.
RAY_MODULES = {"tests/fleet/test_fleet.py", "tests/fleet/test_liveness.py", "tests/cli/test_fleet_cli.py",
               "tests/cli/test_docs_shell.py", "tests/fleet/test_fleet_lab.py"}


def work_unit(nodeid: str) -> str:
    """The group a test runs in: its module, or "ray" for every module that starts Ray."""
    module = nodeid.split("::")[0]
    return "ray" if module in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)  # the hook is xdist's: a run without xdist has no scheduler to make
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "each":  # every test on every worker: nothing to group
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)
