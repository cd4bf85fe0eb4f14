"""`stage fleet`: one help per command, listing exactly the options that command takes (one help
for all five listed `--subset` and `--until-free` under mirror, then refused them there); and
`--bwlimit`, checked on the driver and handed on to each node's own `stage mirror`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import sha256_file
from stager.fleet.node import node_argv, run_on_node
from stager.fleet.options import mirror_options
from stager.manifest import load_manifest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STAGE = [str(BIN / "stage")] if (BIN / "stage").exists() else [sys.executable, "-m", "stager"]
MiB = 1024 * 1024

COMMON = {"--nodes", "--timeout", "--allow-unauthenticated-cluster", "--json", "-m", "--manifest", "-q", "--quiet",
          "-v", "--verbose", "-h", "--help"}
OWN = {
    "mirror": {"--transport", "--fan-out", "--ports", "--bwlimit", "--full", "--streams"},
    "verify": {"--full", "--subset"},
    "pack-engram": set(),
    "audit": set(),
    "prune": {"-n", "--dry-run", "--until-free", "--only"},
}


def stage(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*STAGE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def listed_options(help_text: str) -> set[str]:
    """The option names of a click help's Options section (the first column)."""
    names = set()
    for line in help_text.splitlines():
        match = re.match(r"^  (-[\w-]+)(?:, (-[\w-]+))?", line)
        if match:
            names.update(name for name in match.groups() if name)
    return names


@pytest.mark.parametrize("command", sorted(OWN))
def test_each_fleet_command_has_its_own_help(command):
    short, long = stage("fleet", command, "-h"), stage("fleet", command, "--help")
    assert short.returncode == 0 and short.stdout == long.stdout, short.stderr
    assert short.stdout.startswith(f"Usage: stage fleet {command} [OPTIONS]\n"), short.stdout
    assert listed_options(short.stdout) == COMMON | OWN[command], short.stdout
    # An option of another fleet command is refused by the parser, naming it (exit 2).
    for other in sorted(set().union(*OWN.values()) - OWN[command] - {"-n"}):
        refused = stage("fleet", command, other, "--manifest", "/nonexistent.toml")
        assert refused.returncode == 2 and f"No such option: {other}" in refused.stderr, (other, refused.stderr)


def test_the_fleet_help_lists_its_commands():
    result = stage("fleet", "-h")
    assert result.returncode == 0 and result.stdout.startswith("Usage: stage fleet [OPTIONS] COMMAND [ARGS]...")
    listed = re.findall(r"^  ([a-z-]+) ", result.stdout.split("Commands:")[1], flags=re.M)
    assert listed == ["mirror", "verify", "pack-engram", "audit", "prune"], result.stdout
    assert listed_options(result.stdout) == {"-h", "--help"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("fleet-cli")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_demo_nas.py"), str(where / "demo")], check=True,
                   capture_output=True)
    return where / "demo" / "cluster.toml"


def test_bwlimit_is_refused_before_the_cluster_is_asked(demo):
    for value in ("50MB/s", "fast", "10M:1M"):
        result = stage("fleet", "mirror", "--bwlimit", value, "--json", "--manifest", demo)
        assert result.returncode == 2 and "Invalid value for '--bwlimit'" in result.stderr, result.stderr
        assert json.loads(result.stdout)["exit_code"] == 2


def test_streams_out_of_range_or_off_the_broadcast_exits_2_naming_it(demo, tmp_path):
    for value in ("0", "65", "two"):
        result = stage("fleet", "mirror", "--streams", value, "--json", "--manifest", demo)
        assert result.returncode == 2 and "Invalid value for '--streams'" in result.stderr, result.stderr
    result = stage("fleet", "mirror", "--streams", "2", "--transport", "nas", "--manifest", demo)
    assert result.returncode == 2 and "--streams applies to the broadcast transport only" in result.stderr
    for number, value in enumerate(("0", "65", "2.0", '"4"')):
        manifest = tmp_path / f"streams-{number}.toml"
        manifest.write_text(demo.read_text() + f"\n[fleet]\nstreams = {value}\n")
        result = stage("fleet", "mirror", "--manifest", manifest)
        assert result.returncode == 2 and f"{manifest}: fleet.streams: expected a whole number" in result.stderr, (
            value, result.stderr)


def test_each_node_mirrors_at_the_rate(demo):
    """What a node's Ray task runs for `stage fleet mirror --transport nas --bwlimit 8M`: the
    node-local command line, run as the task runs it, reads the NAS at 8 MiB/s."""
    manifest = load_manifest(str(demo))
    assert mirror_options("mirror", None) == ()
    argv = node_argv(manifest, "mirror", "dgx1", None, mirror_options("mirror", "8M"))
    assert argv[-2:] == ["--bwlimit", "8M"]
    shutil.rmtree(demo.parent / "nvme", ignore_errors=True)
    answer = run_on_node(argv, timeout=120)
    assert answer["code"] == 0, answer["stderr"]
    report = json.loads(answer["stdout"])
    weights = list((demo.parent / "nvme" / "hf" / "hub").glob("models--*/snapshots/*/*.safetensors"))
    assert len(weights) == 5
    for staged in weights:  # each LFS blob is named by its SHA-256
        assert sha256_file(staged) == os.path.basename(os.readlink(staged))
    # At least the copied bytes at the rate (samples come on top); unlimited, the demo takes 0.2 s.
    assert report["seconds"] >= 0.9 * report["copied_bytes"] / (8 * MiB), report


RAY_PRINTS = """
import contextlib, sys
from stager.fleet.cluster import import_ray
import_ray()
from ray._private.worker import print_to_stdstream
line = {"lines": ["A worker died or was killed while executing a task"], "pid": "raylet", "is_err": False,
        "ip": "10.0.0.1", "localhost": "10.0.0.2"}
with contextlib.redirect_stdout(sys.stderr):  # as driver.run_fleet has it while Ray is up
    print_to_stdstream(dict(line), ignore_prefix=False)
    print_to_stdstream(dict(line), ignore_prefix=False)
sys.stderr.flush()
"""


def test_ray_prints_no_colour_codes_into_a_pipe():
    """What the driver passes on from the raylets, through Ray's own printing: plain lines into a
    pipe (a log, `2>&1 | tee`), each as it came; Ray's colours on a terminal."""
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_COLOR_PREFIX", "RAY_DEDUP_LOGS")}
    piped = subprocess.run([sys.executable, "-c", RAY_PRINTS], capture_output=True, text=True, timeout=120, env=env)
    assert piped.returncode == 0, piped.stderr
    said = [line for line in piped.stderr.splitlines() if "A worker died" in line]
    assert said == ["(raylet, ip=10.0.0.1) A worker died or was killed while executing a task"] * 2, piped.stderr
    assert "\x1b[" not in piped.stderr + piped.stdout
    leader, follower = pty.openpty()
    try:
        on_tty = subprocess.run([sys.executable, "-c", RAY_PRINTS], stdout=subprocess.PIPE, stderr=follower,
                                timeout=120, env=env)
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert on_tty.returncode == 0
    assert b"\x1b[33m(raylet, ip=10.0.0.1)" in shown, shown
