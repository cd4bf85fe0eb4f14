"""The operator contract of `stage`, exercised the way an operator's shell does: the installed entry
point as a subprocess, the README's own command lines, real pipes closed early, real signals in the
middle of real copies, another user, a read-only mount, a systemd unit and a container launch
with a stand-in `docker` that records its arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import BIN, INSTALLED_STAGE, make_demo, open_files, write_manifest
from hubgen import Hub, add_engram_checkpoint, streamed_safetensors

REPO = Path(__file__).resolve().parents[2]
TEMP = re.compile(r"\.stage-[0-9a-f]{8}\.tmp$")  # atomic.py's temp names
MiB = 1024 * 1024


def stage(*args, cwd=None, env=None, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*INSTALLED_STAGE, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**_clean_env(), **(env or {})}, **kwargs)


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("STAGE_MANIFEST", None)
    return env


def shell(script: str, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run `script` in bash with the installed `stage` first on PATH, as an operator's shell has it."""
    path = f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**_clean_env(), "PATH": path, **(env or {})})


def temp_files(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if TEMP.search(n)]


def sh_blocks(markdown: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", markdown, flags=re.S)


# ---- 1. the README path ------------------------------------------------------------------------

def test_readme_path_is_green_end_to_end(tmp_path):
    """The README's main job, then every demo command it shows next, verbatim: each exits 0."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "scripts", checkout / "scripts")
    (checkout / ".venv").symlink_to(BIN.parent)  # the venv the README's first two commands create
    blocks = [b for b in sh_blocks((REPO / "README.md").read_text()) if "demo" in b or "STAGE_MANIFEST" in b]
    main_job, *next_steps = blocks
    # The venv and the install exist already: run the rest of the main job's line as written.
    steps = [part.strip() for part in main_job.strip().split("&&")]
    steps = [s for s in steps if not s.startswith("python3 -m venv") and "pip install" not in s]
    assert steps == [".venv/bin/python scripts/make_demo_nas.py demo",
                     ".venv/bin/stage mirror --node dgx1 --manifest demo/cluster.toml"]
    lines = steps + [line for block in next_steps for line in block.splitlines() if line.strip()]
    assert any(re.match(r"stage verify --node dgx1\b", line) for line in lines), "the README shows verify next"
    script = "\n".join(f'{line}\necho "::rc $? :: {line.split("#")[0].strip()}" >&2' for line in lines)
    result = shell(script, cwd=checkout)
    codes = re.findall(r"^::rc (\d+) :: (.*)$", result.stderr, flags=re.M)
    assert len(codes) == len(lines), result.stderr
    failed = [(cmd, code) for code, cmd in codes if code != "0"]
    assert not failed, f"{failed}\n{result.stderr}"
    # And what an operator types without reading further: verify the node the main job staged.
    assert stage("verify", "--node", "dgx1", "--manifest", "demo/cluster.toml", cwd=checkout).returncode == 0


# ---- 2. repair hints are commands that run ----------------------------------------------------------

def printed_commands(text: str) -> list[str]:
    """Every command the tool told the operator to run: `repair: CMD` lines and `stage ...` in backticks."""
    found = re.findall(r"^repair: (stage .*)$", text, flags=re.M) + re.findall(r"`(stage [^`]+)`", text)
    return list(dict.fromkeys(found))


def run_hints(text: str, cwd: Path) -> list[str]:
    commands = printed_commands(text)
    for command in commands:
        result = shell(command, cwd=cwd)
        assert result.returncode == 0, f"the printed hint `{command}` exited {result.returncode}: {result.stderr}"
    return commands


def test_printed_repairs_run_and_repair(tmp_path):
    manifest = make_demo(tmp_path)
    rel = "demo/cluster.toml"
    assert stage("mirror", "--node", "dgx1", "--manifest", rel, cwd=tmp_path).returncode == 0
    staged = tmp_path / "demo" / "nvme" / "hf" / "hub"
    victim = next(staged.glob("models--acme--Flash-drafter/snapshots/*/model.safetensors"))
    os.unlink(os.path.realpath(victim))
    broken = stage("verify", "--node", "dgx1", "--seed", "4242", "--manifest", rel, cwd=tmp_path)
    assert broken.returncode == 1
    # The repair repeats the check that found the damage: the verify's own seed.
    assert run_hints(broken.stdout, tmp_path) == [f"stage mirror --node dgx1 --seed 4242 --manifest {rel}"]
    assert stage("verify", "--node", "dgx1", "--manifest", rel, cwd=tmp_path).returncode == 0

    # dgx2 has Engram shards configured. Before its mirror, verify says how to get the checkpoint;
    # every command it names (mirror, or pack-engram from the NAS) runs as printed.
    unstaged = stage("verify", "--node", "dgx2", "--manifest", rel, cwd=tmp_path)
    assert unstaged.returncode == 1
    hints = run_hints(unstaged.stdout, tmp_path)
    assert f"stage mirror --node dgx2 --manifest {rel}" in hints
    assert f"stage pack-engram --node dgx2 --from-nas --manifest {rel}" in hints
    assert all("--manifest" in h for h in hints)
    (tmp_path / "demo" / "nvme-dgx2" / "engram").joinpath("engram-l1-r0of3.bin").unlink()
    missing = stage("verify", "--node", "dgx2", "--manifest", rel, cwd=tmp_path)
    assert missing.returncode == 1
    assert run_hints(missing.stdout, tmp_path) == [f"stage pack-engram --node dgx2 --rank 0 --manifest {rel}"]
    assert stage("verify", "--node", "dgx2", "--manifest", rel, cwd=tmp_path).returncode == 0

    # A manifest given as $STAGE_MANIFEST is named in the hint too, so the hint runs without it.
    os.unlink(os.path.realpath(victim))
    from_env = stage("verify", "--node", "dgx1", cwd=tmp_path, env={"STAGE_MANIFEST": str(manifest)})
    [hint] = run_hints(from_env.stdout, tmp_path)
    assert re.fullmatch(rf"stage mirror --node dgx1 --seed \d+ --manifest {re.escape(str(manifest))}", hint), hint


# ---- 3. stdout is the result, stderr the rest ---------------------------------------------------------

def test_report_on_stdout_and_json_errors_are_one_object(tmp_path):
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    mirror = stage("mirror", "--node", "dgx1", "--manifest", rel, cwd=tmp_path)
    assert mirror.returncode == 0 and mirror.stdout.startswith("dgx1: copied 9 files")
    verify = shell(f"stage verify --node dgx1 --manifest {rel} | grep -c 'sampled verify'", cwd=tmp_path)
    assert verify.stdout.strip() == "1" and verify.stderr == ""

    def one_object(result):
        assert result.stdout.count("\n") == 1, result.stdout
        return json.loads(result.stdout)

    bad_node = stage("verify", "--json", "--node", "nope", "--manifest", rel, cwd=tmp_path)
    assert bad_node.returncode == 2
    assert one_object(bad_node) == {"error": f"{rel}: nodes.nope: no such node (known: dgx1, dgx2)",
                                    "exit_code": 2}
    assert bad_node.stderr.startswith("stage: error: ")
    usage = stage("mirror", "--json", "--manifest", rel, cwd=tmp_path)  # --node is missing
    assert usage.returncode == 2 and one_object(usage)["exit_code"] == 2 and "--node" in one_object(usage)["error"]
    no_manifest = stage("binds", "--node", "dgx1", "--json", "--manifest", "absent.toml", cwd=tmp_path)
    assert no_manifest.returncode == 2 and "absent.toml" in one_object(no_manifest)["error"]

    # Exit 3 (could not run): another process holds the node hub's lock.
    import fcntl

    lock = tmp_path / "demo" / "nvme" / "hf" / "hub" / ".locks" / "stager.lock"
    with open(lock, "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        locked = stage("mirror", "--node", "dgx1", "--json", "--manifest", rel, cwd=tmp_path)
    assert locked.returncode == 3 and one_object(locked)["exit_code"] == 3 and "locked" in one_object(locked)["error"]

    # binds: --json beside the docker -v lines; the -v lines alone on stdout.
    docker = stage("binds", "--node", "dgx1", "--manifest", rel, cwd=tmp_path)
    as_json = one_object(stage("binds", "--node", "dgx1", "--json", "--manifest", rel, cwd=tmp_path))
    assert docker.stdout.splitlines() == [f"-v {b['source']}:{b['target']}:ro" for b in as_json["binds"]]
    assert as_json == one_object(stage("binds", "--node", "dgx1", "--format", "json", "--manifest", rel,
                                       cwd=tmp_path))


@pytest.fixture(scope="module")
def wide_nas(tmp_path_factory):
    """A model of 800 small files, none staged: `stage binds` writes ~200 KB, several pipe buffers."""
    root = tmp_path_factory.mktemp("wide")
    hub = Hub(root / "nas")
    snap = hub.repo("acme/Wide").snapshot()
    for i in range(800):
        snap.add_git(f"shards/part-{i:04d}-of-0800-with-a-long-name.json", b'{"part": %d}' % i)
    snap.finish()
    return write_manifest(root / "m.toml", hub.root, root / "nvme" / "hf" / "hub", {"acme/Wide": {}})


@pytest.mark.parametrize("pipeline", ["stage binds --node dgx1 --manifest {m} | head -1",
                                      "stage binds --node dgx1 --json --manifest {m} | head -c1"])
def test_a_closed_pipe_ends_quietly_never_with_1(wide_nas, tmp_path, pipeline):
    result = shell(f"set -o pipefail; {pipeline.format(m=wide_nas)}; echo \"status ${{PIPESTATUS[0]}}\" >&2",
                   cwd=tmp_path)
    status = int(re.search(r"status (\d+)", result.stderr).group(1))
    assert status in (0, 141), result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert "BrokenPipe" not in result.stderr and len(result.stdout) <= 400


# ---- 4. signals --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_nas(tmp_path_factory):
    """About 400 MiB on a real disk: four 48 MiB weight files and a two-layer Engram table of 2 x 87 MiB."""
    root = tmp_path_factory.mktemp("big")
    hub = Hub(root / "nas")
    snap = hub.repo("acme/Big").snapshot()
    for i in range(4):
        size, chunks = streamed_safetensors(100 + i, 48 * MiB)
        snap.add_lfs_stream(f"model-0000{i + 1}-of-00004.safetensors", size, chunks, shared=False)
    add_engram_checkpoint(snap, layers=(1, 2), rows=330_000)
    snap.finish()
    return root / "nas"


def big_manifest(big_nas: Path, where: Path) -> Path:
    node = where / "nvme"
    return write_manifest(where / "m.toml", big_nas, node / "hf" / "hub", {"acme/Big": {}}, extra=(
        f'engram_dir = "{node / "engram"}"\nrank = 0\n\n[engram]\nmodel = "acme/Big"\nworld = 1\n'))


def signal_when(command: list[str], ready, sig: int, cwd=None, timeout: float = 120):
    """Start `command`, send `sig` as soon as `ready(pid)` holds, return (exit code, stderr, seconds
    from the signal to the exit). Fails if the command ends before it was ever ready."""
    proc = subprocess.Popen([*INSTALLED_STAGE, *map(str, command)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=cwd, env=_clean_env())
    deadline = time.monotonic() + timeout
    while not ready(proc.pid):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"{command[0]} ended (exit {proc.returncode}) before the moment to signal it: {err[-2000:]}")
        time.sleep(0.002)
    proc.send_signal(sig)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace"), time.monotonic() - sent


def writing_temp(root: Path):
    return lambda _pid: bool(temp_files(root))


def reading_under(root: Path):
    """True while the process has a file under `root` open (hashing it)."""
    prefix = str(root) + "/"

    def ready(pid: int) -> bool:
        return any(path.startswith(prefix) for path in open_files(pid))

    return ready


def handles_sigterm(pid: int) -> bool:
    """The process has its SIGTERM handler installed (SigCgt), i.e. stage's main() runs."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, flags=re.M).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def assert_ended_by(sig: int, code: int, err: str) -> None:
    assert code == 128 + sig, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    word = "interrupted" if sig == signal.SIGINT else "terminated"
    assert len(lines) == 1 and re.fullmatch(rf"stage: {word}(, stopping \d+ [a-z]+( in flight\.\.\.))?",
                                            lines[0]), lines


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])


@SIGNALS
def test_signal_during_mirror_cleans_up_and_releases_the_lock(big_nas, tmp_path, sig):
    manifest = big_manifest(big_nas, tmp_path)
    hub = tmp_path / "nvme" / "hf" / "hub"
    code, err, _ = signal_when(["mirror", "--node", "dgx1", "--full", "-j", "2", "--manifest", manifest],
                               writing_temp(hub), sig)
    assert_ended_by(sig, code, err)
    assert temp_files(hub) == []
    again = stage("mirror", "--node", "dgx1", "--full", "--manifest", manifest)
    assert again.returncode == 0, again.stderr  # not refused as locked; it converges and verifies
    assert temp_files(tmp_path) == []


def bytes_read(pid: int) -> int | None:
    """What the process has read so far (`rchar`: every read(2), page cache or not)."""
    try:
        return int(re.search(r"^rchar: (\d+)$", Path(f"/proc/{pid}/io").read_text(), flags=re.M).group(1))
    except (OSError, AttributeError):
        return None


@SIGNALS
def test_signal_during_verify_stops_the_queued_hashing(big_nas, tmp_path, sig):
    """Signalled while a 48 MiB weight is hashed with more than 160 MiB still queued behind it,
    `verify --full -j 1` reads at most the rest of that file before it exits (stager/base/workers.py)."""
    manifest = big_manifest(big_nas, tmp_path)
    blobs = tmp_path / "nvme" / "hf" / "hub" / "models--acme--Big" / "blobs"
    assert stage("mirror", "--node", "dgx1", "--manifest", manifest).returncode == 0
    queued_after = sum(p.stat().st_size for p in blobs.iterdir()) - 160 * MiB
    at_signal: list[int] = []

    def hashing_a_weight_early(pid: int) -> bool:
        weight = [p for p in open_files(pid) if p.startswith(f"{blobs}/") and os.path.getsize(p) < 64 * MiB]
        done = bytes_read(pid)
        if weight and done is not None and done < queued_after:
            at_signal.append(done)
        return bool(at_signal)

    proc = subprocess.Popen([*INSTALLED_STAGE, "verify", "--node", "dgx1", "--full", "-j", "1",
                             "--manifest", str(manifest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_clean_env())
    while not hashing_a_weight_early(proc.pid):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(sig)
    last = at_signal[0]
    while proc.poll() is None:
        last = bytes_read(proc.pid) or last
        time.sleep(0.001)
    _, err = proc.communicate()
    assert_ended_by(sig, proc.returncode, err.decode())
    assert last - at_signal[0] < 56 * MiB, f"{(last - at_signal[0]) / MiB:.0f} MiB read after the signal"


@SIGNALS
def test_signal_during_pack_engram_cleans_up_and_releases_the_lock(big_nas, tmp_path, sig):
    manifest = big_manifest(big_nas, tmp_path)
    shards = tmp_path / "nvme" / "engram"
    code, err, _ = signal_when(["pack-engram", "--node", "dgx1", "--from-nas", "--manifest", manifest],
                               writing_temp(shards), sig)
    assert_ended_by(sig, code, err)
    assert temp_files(shards) == []
    again = stage("pack-engram", "--node", "dgx1", "--from-nas", "--manifest", manifest)
    assert again.returncode == 0, again.stderr


@SIGNALS
def test_signal_during_archive_cleans_up_and_releases_the_lock(tmp_path, sig):
    src, dest = tmp_path / "old-tp2", tmp_path / "archive"
    src.mkdir()
    dest.mkdir()
    for i in range(3):
        size, chunks = streamed_safetensors(7 + i, 64 * MiB)
        with open(src / f"engram-l{i}-r0of2.bin", "wb") as out:
            for chunk in chunks:
                out.write(chunk)
    names = sorted(p.name for p in src.iterdir())
    code, err, _ = signal_when(["archive", src, dest], writing_temp(dest), sig)
    assert_ended_by(sig, code, err)
    assert temp_files(dest) == []
    kept = {p.name for p in src.glob("*")} | {p.name for p in dest.rglob("*.bin")}
    assert sorted(kept) == names  # every file still has at least one copy
    again = stage("archive", src, dest)
    assert again.returncode == 0, again.stderr


def test_the_signal_handler_imports_nothing(monkeypatch):
    """A signal that lands while a module is being imported: an import from the handler found
    `logging` half-initialised, and its AttributeError took the signal's place (exit 3 where 143
    was due, seen in CI's audit-signal test). Here any import of the workers module fails."""
    import importlib

    app = importlib.import_module("stager.cli.app")  # the module; the name `app` in it is the Typer app
    monkeypatch.setitem(sys.modules, "stager.base.workers", None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(app.Signalled) as raised:
            app._on_signal(signal.SIGTERM, None)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert raised.value.exit_code == 128 + signal.SIGTERM and raised.value.message == "terminated"


@SIGNALS
def test_signal_during_audit_ends_with_one_line(big_nas, tmp_path, sig):
    manifest = big_manifest(big_nas, tmp_path)
    prom = tmp_path / "textfile" / "stage.prom"
    prom.parent.mkdir()
    for _attempt in range(5):
        code, err, _ = signal_when(["audit", "--node", "dgx1", "--prom", prom, "--manifest", manifest],
                                   handles_sigterm, sig)
        if code != 0:  # 0: the audit finished before the signal arrived; try again
            break
    assert_ended_by(sig, code, err)
    assert temp_files(prom.parent) == []


# ---- 5. permissions are named ----------------------------------------------------------------------

@pytest.fixture
def shared_demo():
    """The demo in a directory every user may traverse (pytest's own tmp dir is root's alone)."""
    where = Path(tempfile.mkdtemp(prefix="stage-contract-", dir="/tmp"))
    where.chmod(0o755)
    try:
        yield make_demo(where).relative_to(where), where
    finally:
        shutil.rmtree(where)


def as_nobody(*args, cwd) -> subprocess.CompletedProcess:
    """`stage ARGS` run as user nobody, through setpriv (the interpreter lives where nobody can run it)."""
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           sys.executable, "-m", "stager", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**_clean_env(), "HOME": "/tmp"})


def assert_permission_named(result, path: Path) -> None:
    assert result.returncode == 3, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("stage: error: permission denied: "), line
    assert str(path) in line and "nobody" in line and "internal error" not in line


def test_permission_problems_name_the_path_and_the_user(shared_demo):
    manifest, where = shared_demo
    probe = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                            "-c", "import stager.cli"], capture_output=True, cwd=where, env=_clean_env())
    if probe.returncode != 0:
        pytest.skip("cannot run the interpreter as user nobody here")
    demo = where / "demo"
    # The node hub cannot be created: demo/ is root's.
    assert_permission_named(as_nobody("mirror", "--node", "dgx1", "--manifest", manifest, cwd=where), demo)
    # The hub exists, and its lock is root's.
    assert stage("mirror", "--node", "dgx1", "--manifest", manifest, cwd=where).returncode == 0
    lock = demo / "nvme" / "hf" / "hub" / ".locks" / "stager.lock"
    assert_permission_named(as_nobody("mirror", "--node", "dgx1", "--manifest", manifest, cwd=where), lock)
    # The engram directory is root's.
    assert stage("mirror", "--node", "dgx2", "--manifest", manifest, cwd=where).returncode == 0
    (demo / "nvme-dgx2" / "engram").mkdir()
    result = as_nobody("pack-engram", "--node", "dgx2", "--manifest", manifest, cwd=where)
    assert_permission_named(result, demo / "nvme-dgx2" / "engram")
    # --json: the same error as one object.
    result = as_nobody("mirror", "--node", "dgx1", "--json", "--manifest", manifest, cwd=where)
    assert json.loads(result.stdout)["exit_code"] == 3 and "permission denied" in json.loads(result.stdout)["error"]
    # The audit's textfile directory is root's: STAGE UNKNOWN (3), naming it, its owner and the user.
    textfile = where / "textfile"
    textfile.mkdir(mode=0o755)
    result = as_nobody("audit", "--node", "dgx1", "--prom", textfile / "stage.prom", "--manifest", manifest, cwd=where)
    assert result.returncode == 3, result.stdout + result.stderr
    [status] = result.stdout.splitlines()
    assert status.startswith("STAGE UNKNOWN: ") and f"permission denied: {textfile} (owner root:root" in status, status
    assert "stage runs as user nobody" in status and not list(textfile.iterdir())


def test_a_read_only_mount_is_named(shared_demo):
    manifest, where = shared_demo
    if shutil.which("unshare") is None or shell("unshare -m true", cwd=where).returncode != 0:
        pytest.skip("no mount namespaces here")
    assert stage("mirror", "--node", "dgx2", "--manifest", manifest, cwd=where).returncode == 0
    engram = where / "demo" / "nvme-dgx2" / "engram"
    engram.mkdir()
    hub1 = where / "demo" / "nvme"
    hub1.mkdir()
    stage_cmd = " ".join(INSTALLED_STAGE)
    # A private mount namespace: the read-only bind mounts vanish with the shell.
    result = subprocess.run(["unshare", "-m", "bash", "-c", f"""
        mount --make-rprivate /
        mount --bind {engram} {engram} && mount -o remount,bind,ro {engram} || exit 99
        mount --bind {hub1} {hub1} && mount -o remount,bind,ro {hub1} || exit 99
        {stage_cmd} pack-engram --node dgx2 --manifest {manifest} 2>pack.err; echo "pack $?"
        {stage_cmd} mirror --node dgx1 --manifest {manifest} 2>mirror.err; echo "mirror $?"
        {stage_cmd} pack-engram --node dgx2 -n --manifest {manifest} 2>pack-n.err; echo "pack-n $?"
        {stage_cmd} mirror --node dgx1 -n --manifest {manifest} 2>mirror-n.err >/dev/null; echo "mirror-n $?"
        """], capture_output=True, text=True, cwd=where, timeout=300, env=_clean_env())
    if result.returncode == 99:
        pytest.skip("bind mounts are not permitted here")
    assert "pack 3" in result.stdout and "mirror 3" in result.stdout, result.stdout + result.stderr
    pack, = (where / "pack.err").read_text().strip().splitlines()
    assert pack.startswith("stage: error: read-only file system: ") and str(engram) in pack
    mirror, = (where / "mirror.err").read_text().strip().splitlines()
    assert mirror.startswith("stage: error: ") and str(hub1) in mirror
    assert re.search(r"read-only file ?system", mirror)
    # A dry run ends as the real run would: the same line, the same exit code.
    assert "pack-n 3" in result.stdout and "mirror-n 3" in result.stdout, result.stdout
    assert (where / "pack-n.err").read_text() == (where / "pack.err").read_text()
    assert (where / "mirror-n.err").read_text() == (where / "mirror.err").read_text()


# ---- 6. CLI conventions ------------------------------------------------------------------------------

def test_version_help_placeholders_and_grammar(tmp_path):
    from stager import __version__

    version = stage("--version")
    assert version.returncode == 0 and version.stdout == f"stage {__version__}\n"
    commands = ["mirror", "verify", "pack-engram", "archive", "audit", "binds", "fleet"]
    for args in ([], *([c] for c in commands)):
        short, long = stage(*args, "-h"), stage(*args, "--help")
        assert short.returncode == 0 and short.stdout == long.stdout, (args, short.stderr)
        usage = short.stdout
        # Types are not placeholders ("<str>", "<list[int]>", "TEXT"); a list of choices ("<a|b>") is fine.
        assert not re.search(r"<[a-z][^>|]*>|\b(TEXT|INTEGER|FLOAT)\b", usage), (args, usage)
    mirror_help = stage("mirror", "-h").stdout
    for placeholder in ("--node NAME", "--manifest PATH", "--jobs N", "--seed N"):
        assert placeholder in mirror_help, mirror_help
    assert "--subset N/T" in stage("verify", "-h").stdout

    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    assert stage("mirror", "--node", "dgx1", "--manifest", rel, cwd=tmp_path).returncode == 0
    victim = next((tmp_path / "demo" / "nvme" / "hf" / "hub").glob("models--acme--Flash-drafter/snapshots/*/config.json"))
    os.unlink(os.path.realpath(victim))
    one = stage("verify", "--node", "dgx1", "--manifest", rel, cwd=tmp_path)
    assert one.returncode == 1 and one.stdout.splitlines()[0].endswith(", 1 problem"), one.stdout


def test_dry_run_lists_each_copy_with_its_reason(tmp_path):
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    text = stage("mirror", "--node", "dgx1", "--dry-run", "--manifest", rel, cwd=tmp_path)
    assert text.returncode == 0
    listed = [line for line in text.stdout.splitlines() if line.startswith("  would copy ")]
    assert len(listed) == 9 and all(re.search(r"\(\d.*\): \S", line) for line in listed), text.stdout
    assert text.stdout.splitlines()[-1].startswith("dgx1: would copy 9 files")
    assert not (tmp_path / "demo" / "nvme").exists()
    data = json.loads(stage("mirror", "--node", "dgx1", "--dry-run", "--json", "--manifest", rel, cwd=tmp_path).stdout)
    assert len(data["would_copy"]) == 9 == data["copied_files"]
    assert {"path", "source", "bytes", "reason"} <= set(data["would_copy"][0])
    assert sum(item["bytes"] for item in data["would_copy"]) == data["bytes_needed"]
    assert stage("mirror", "--node", "dgx1", "--manifest", rel, cwd=tmp_path).returncode == 0
    warm = json.loads(stage("mirror", "--node", "dgx1", "--dry-run", "--json", "--manifest", rel, cwd=tmp_path).stdout)
    assert warm["would_copy"] == []


# ---- 7. integration recipes ------------------------------------------------------------------------

def test_systemd_unit_stages_before_the_inference_service(tmp_path):
    import configparser

    text = (REPO / "scripts" / "ops" / "stage-mirror.service").read_text()
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(text)
    assert "inference.service" in unit["Unit"]["Before"].split()
    assert unit["Install"]["RequiredBy"] == "inference.service"
    assert unit["Service"]["Type"] == "oneshot" and unit["Service"]["RemainAfterExit"] == "yes"
    exec_start = unit["Service"]["ExecStart"]
    assert exec_start.startswith("/usr/local/bin/stage mirror --node ")
    # The unit as systemd reads it, with ExecStart pointing at this install.
    local = tmp_path / "stage-mirror.service"
    local.write_text(text.replace("/usr/local/bin/stage", INSTALLED_STAGE[0]))
    if shutil.which("systemd-analyze"):
        check = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
        assert check.returncode == 0 and check.stderr.strip() == "", check.stderr
    # Its ExecStart, with the unit's environment, stages the demo.
    manifest = make_demo(tmp_path)
    command = exec_start.replace("/usr/local/bin/stage", INSTALLED_STAGE[0]).replace("${STAGE_NODE}", "dgx1")
    result = shell(command, cwd=tmp_path, env={"STAGE_MANIFEST": str(manifest)})
    assert result.returncode == 0, result.stderr


def fake_docker(bin_dir: Path, record: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {record}\n')
    (bin_dir / "docker").chmod(0o755)


def test_container_launch_gates_on_verify_and_binds_read_only(tmp_path):
    manifest = make_demo(tmp_path)
    script = REPO / "scripts" / "ops" / "stage-serve.sh"
    record = tmp_path / "docker.argv"
    fake_docker(tmp_path / "fake-bin", record)
    env = {"STAGE_NODE": "dgx1", "STAGE_MANIFEST": str(manifest), "PATH": f"{tmp_path / 'fake-bin'}:{BIN}:/usr/bin:/bin"}

    # Not staged yet: the gate refuses, docker never runs.
    refused = subprocess.run([str(script), "acme/serve:1", "--port", "8000"], capture_output=True, text=True,
                             cwd=tmp_path, env={**_clean_env(), **env}, timeout=300)
    assert refused.returncode == 1 and not record.exists(), refused.stderr

    assert stage("mirror", "--node", "dgx1", "--manifest", manifest).returncode == 0
    served = subprocess.run([str(script), "acme/serve:1", "--port", "8000"], capture_output=True, text=True,
                            cwd=tmp_path, env={**_clean_env(), **env}, timeout=300)
    assert served.returncode == 0, served.stderr
    argv = record.read_text().split("\0")[:-1]
    assert argv[0] == "run" and argv[-3:] == ["acme/serve:1", "--port", "8000"]
    volumes = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-v"]
    binds = json.loads(stage("binds", "--node", "dgx1", "--container-hub", "/hf/hub", "--json",
                             "--manifest", manifest).stdout)["binds"]
    assert volumes == [f"{b['source']}:{b['target']}:ro" for b in binds]
    nas = str(tmp_path / "demo" / "nas")
    fallback = [v for v in volumes if v.startswith(nas + "/")]
    assert fallback and all(v.endswith(":ro") for v in volumes)  # the excluded page15/ comes from the NAS
    assert "HF_HUB_CACHE=/hf/hub" in argv and "HF_HUB_OFFLINE=1" in argv


# ---- 8. start-up ------------------------------------------------------------------------------------

def imported_modules(args, cwd) -> set[str]:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "stager", *args], capture_output=True,
                            text=True, cwd=cwd, env=_clean_env())
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


def test_warm_no_op_runs_import_only_what_they_need(tmp_path):
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    assert stage("mirror", "--node", "dgx1", "--manifest", rel, cwd=tmp_path).returncode == 0
    for command in ("mirror", "verify"):
        modules = imported_modules([command, "--node", "dgx1", "--manifest", rel], tmp_path)
        heavy = {m for m in modules if m.split(".")[0] in ("numpy", "pydantic") or m.startswith("stager.engram")
                 or m == "typer._adapters" or m == "tqdm"}
        assert not heavy, (command, sorted(heavy))


# ---- verify beside a running mirror -----------------------------------------------------------------

def test_verify_while_a_mirror_writes_says_so(big_nas, tmp_path):
    """A launcher's `stage verify` gate run while cron's `stage mirror` is copying: the problems it
    finds are that mirror's unfinished work, and the report says which process holds the hub
    (read from /proc/locks; the lock is not taken, so the mirror carries on and finishes)."""
    manifest = big_manifest(big_nas, tmp_path)
    hub = tmp_path / "nvme" / "hf" / "hub"
    mirror = subprocess.Popen([*INSTALLED_STAGE, "mirror", "--node", "dgx1", "--full", "-j", "1",
                               "--manifest", str(manifest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_clean_env())
    while not temp_files(hub):
        assert mirror.poll() is None, mirror.communicate()
        time.sleep(0.002)
    # Held still mid-copy (its lock and temp files in place) while both verifies look: on a loaded
    # machine the mirror once finished between the two.
    mirror.send_signal(signal.SIGSTOP)
    try:
        during = stage("verify", "--node", "dgx1", "--json", "--manifest", manifest)
        text = stage("verify", "--node", "dgx1", "--manifest", manifest)
    finally:
        mirror.send_signal(signal.SIGCONT)
    _, err = mirror.communicate(timeout=300)
    assert mirror.returncode == 0, err
    report = json.loads(during.stdout)
    assert during.returncode == 1 and report["missing"] > 0, during.stdout
    assert report["notes"] == [f"a stage mirror (pid {mirror.pid}) is writing {hub} now: what it has not "
                               "finished shows as problems; verify again once it ends"]
    assert f"note: a stage mirror (pid {mirror.pid})" in text.stderr and "note:" not in text.stdout
    after = json.loads(stage("verify", "--node", "dgx1", "--json", "--manifest", manifest).stdout)
    assert after["notes"] == [] and not [p for p in after["problems"] if p["path"].startswith(f"{hub}/")], after


# ---- 9. the shell contract: -q/-v, -n, repeated options, help ------------------------------------------

def click_app():
    """The whole `stage` app as click sees it, every command present and future."""
    import typer

    from stager.cli import app

    return typer.main.get_command(app)


def every_command() -> dict:
    """Every command that runs, by its words: a group's (`fleet`) commands as `fleet mirror` ..."""
    found = {}

    def walk(group, words):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                walk(command, [*words, name])
            else:
                found[" ".join([*words, name])] = command

    walk(click_app(), [])
    return found


def test_every_command_takes_quiet_and_verbose_and_none_takes_n_for_node():
    commands = every_command()
    assert {"mirror", "fleet mirror", "fleet prune"} <= set(commands), sorted(commands)
    for name, command in commands.items():
        usage = stage(*name.split(), "-h").stdout
        assert "-q, --quiet" in usage and "-v, --verbose" in usage, (name, usage)
        node = [p for p in command.params if "--node" in getattr(p, "opts", ())]
        assert all(p.opts == ["--node"] and not p.secondary_opts for p in node), (name, [p.opts for p in node])
        dry = [p for p in command.params if "--dry-run" in getattr(p, "opts", ())]
        assert all(sorted(p.opts) == ["--dry-run", "-n"] for p in dry), (name, [p.opts for p in dry])


def test_quiet_keeps_the_result_and_errors_verbose_names_each_file(tmp_path):
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    hub = tmp_path / "demo" / "nvme" / "hf" / "hub"
    loud = stage("mirror", "--node", "dgx1", "-vv", "--manifest", rel, cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    # Each file by the name people know it by (repo@commit/path, tests/cli/test_names.py), staged.
    copied = [line.split(" ")[1] for line in loud.stderr.splitlines() if line.startswith("copied ")]
    staged = [next(hub.glob(f"models--{name.split('@')[0].replace('/', '--')}/snapshots/"
                            f"{name.split('@')[1].split('/')[0]}*/{name.split('/', 2)[2]}"), None) for name in copied]
    assert len(copied) == 9 and all(p is not None and p.is_file() for p in staged), loud.stderr
    assert re.search(r"^plan: 9 copies \(", loud.stderr, flags=re.M), loud.stderr  # -vv: the debug detail
    normal = stage("binds", "--node", "dgx1", "--manifest", rel, cwd=tmp_path)
    quiet = stage("binds", "--node", "dgx1", "--quiet", "--manifest", rel, cwd=tmp_path)
    assert normal.stderr and quiet.stderr == "" and quiet.stdout == normal.stdout and quiet.returncode == 0
    audit_quiet = stage("audit", "--node", "dgx1", "-q", "--manifest", rel, cwd=tmp_path)
    assert audit_quiet.stderr == "" and audit_quiet.stdout.startswith("STAGE OK"), audit_quiet
    error = stage("verify", "--node", "dgx9", "-q", "--manifest", rel, cwd=tmp_path)
    assert error.returncode == 2 and error.stderr.startswith("stage: error: ") and "dgx9" in error.stderr
    both = stage("verify", "--node", "dgx1", "-q", "-v", "--manifest", rel, cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.count("\n") == 1 and "--quiet" in both.stderr


def test_n_is_a_dry_run_and_never_a_node(tmp_path):
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    dry = stage("mirror", "--node", "dgx1", "-n", "--manifest", rel, cwd=tmp_path)
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1].startswith("dgx1: would copy 9 files"), dry.stdout
    assert not (tmp_path / "demo" / "nvme").exists()
    for args in (["mirror", "-n", "dgx1"], ["verify", "-n", "dgx1"], ["audit", "-n", "dgx1"]):
        old = stage(*args, "--manifest", rel, cwd=tmp_path)
        assert old.returncode == 2, (args, old.stdout, old.stderr)
    assert not (tmp_path / "demo" / "nvme").exists()


def single_valued_options(command) -> list[str]:
    return [max(p.opts, key=len) for p in command.params if p.param_type_name == "option"
            and not p.multiple and not p.count and not p.is_flag]


def test_a_repeated_single_valued_option_is_exit_2_naming_it(tmp_path):
    """Every command, every option that takes one value: given twice it is refused before anything
    runs, in one line naming it (click kept the last one: `--node a --node b` staged b)."""
    make_demo(tmp_path)
    rel = "demo/cluster.toml"
    tried = 0
    for name, command in every_command().items():
        for option in single_valued_options(command):
            result = stage(*name.split(), option, "1", option, "1", "--json", cwd=tmp_path)
            lines = result.stderr.splitlines()
            assert result.returncode == 2 and len(lines) == 1, (name, option, result.stderr)
            assert lines[0].startswith("stage: error: ") and option in lines[0], (name, option, lines)
            assert json.loads(result.stdout)["exit_code"] == 2
            tried += 1
    assert tried >= 15
    twice = stage("mirror", "--node", "dgx1", "-m", rel, "--manifest", rel, cwd=tmp_path)
    assert twice.returncode == 2 and "-m/--manifest given more than once" in twice.stderr, twice.stderr
    assert not (tmp_path / "demo" / "nvme").exists()
    # Repeatable options and flags still repeat.
    models = stage("mirror", "--node", "dgx1", "--model", "acme/Flash-3bpw", "--model", "acme/Flash-drafter",
                   "--dry-run", "--dry-run", "--manifest", rel, cwd=tmp_path)
    assert models.returncode == 0, models.stderr


def test_help_shows_every_command_description_whole():
    root = click_app()
    for words, group in (([], root), (["fleet"], root.commands["fleet"])):
        usage = stage(*words, "-h").stdout
        assert "..." not in usage.split("Commands:")[1], usage
        flat = " ".join(usage.split())
        for name, command in group.commands.items():
            first = " ".join(command.help.split("\n\n")[0].split())
            assert f"{name} {first}" in flat, (words, name, first, usage)


# ---- 10. dry runs: archive and pack-engram list everything and touch nothing --------------------------

def tree_state(*roots: Path) -> dict:
    """Every file's sha256 and every directory's and link's stat, under `roots`: what a dry run must not change."""
    import hashlib

    state = {}
    for root in roots:
        for here, dirs, files in os.walk(root):
            for name in [".", *dirs, *files]:
                path = os.path.normpath(os.path.join(here, name))
                st = os.lstat(path)
                entry = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
                if os.path.isfile(path) and not os.path.islink(path):
                    entry += (hashlib.sha256(Path(path).read_bytes()).hexdigest(),)
                state[path] = entry
    return state


def test_archive_dry_run_lists_every_move_and_changes_nothing(tmp_path):
    src, dest = tmp_path / "old-tp2", tmp_path / "archive"
    (src / "sub").mkdir(parents=True)
    dest.mkdir()
    for i, name in enumerate(["engram-l0-r0of2.bin", "engram-l1-r0of2.bin", "sub/notes.txt"]):
        (src / name).write_bytes(os.urandom(1000 + i))
    (dest / "old-tp2").mkdir()
    (dest / "old-tp2" / "engram-l1-r0of2.bin").write_bytes((src / "engram-l1-r0of2.bin").read_bytes())  # adopted
    before = tree_state(tmp_path)
    text = stage("archive", "-n", src, dest)
    data = json.loads(stage("archive", "--dry-run", "--json", src, dest).stdout)
    assert tree_state(tmp_path) == before  # no lock, no temp, no record, no directory
    assert text.returncode == 0, text.stderr
    listed = [line for line in text.stdout.splitlines() if line.startswith("  would ")]
    assert len(listed) == 3 and text.stdout.splitlines()[3].startswith("archive: would move 3 files"), text.stdout
    assert data["dry_run"] is True and data["moved_files"] == 0
    planned = {item["path"]: (item["to"], item["action"]) for item in data["would_move"]}
    assert planned == {str(src / "engram-l0-r0of2.bin"): (str(dest / "old-tp2" / "engram-l0-r0of2.bin"), "copy"),
                       str(src / "engram-l1-r0of2.bin"): (str(dest / "old-tp2" / "engram-l1-r0of2.bin"), "adopt"),
                       str(src / "sub" / "notes.txt"): (str(dest / "old-tp2" / "sub" / "notes.txt"), "copy")}
    real = json.loads(stage("archive", "--json", src, dest).stdout)
    assert {item["source"] for item in real["files"]} == set(planned), real["files"]
    assert all(Path(to).is_file() and not Path(path).exists() for path, (to, _) in planned.items())


def test_pack_engram_dry_run_lists_every_shard_and_changes_nothing(tmp_path):
    manifest = make_demo(tmp_path)
    assert stage("mirror", "--node", "dgx2", "--manifest", manifest).returncode == 0
    node = tmp_path / "demo" / "nvme-dgx2"
    before = tree_state(node, tmp_path / "demo")
    text = stage("pack-engram", "--node", "dgx2", "-n", "--manifest", manifest)
    data = json.loads(stage("pack-engram", "--node", "dgx2", "--dry-run", "--json", "--manifest", manifest).stdout)
    assert tree_state(node, tmp_path / "demo") == before and not (node / "engram").exists()
    assert text.returncode == 0 and text.stdout.count("would pack /") == 2, text.stdout
    assert data["dry_run"] is True and [s["skipped"] for s in data["shards"]] == [False, False]
    packed = json.loads(stage("pack-engram", "--node", "dgx2", "--json", "--manifest", manifest).stdout)
    assert [s["path"] for s in packed["shards"]] == [s["path"] for s in data["shards"]]
    assert packed["packed_bytes"] == data["packed_bytes"] > 0
    after = tree_state(node)
    warm = json.loads(stage("pack-engram", "--node", "dgx2", "-n", "--json", "--manifest", manifest).stdout)
    assert all(s["skipped"] and s["reason"] == "up to date" for s in warm["shards"]) and tree_state(node) == after


def test_a_dry_run_that_could_not_write_ends_as_the_real_run(shared_demo):
    """Run as a user without write access, each dry run prints the real run's error line and exits
    with its code (it listed its plan and exited 0 before)."""
    manifest, where = shared_demo
    demo = where / "demo"
    cases = [["mirror", "--node", "dgx1"]]
    assert stage("mirror", "--node", "dgx2", "--manifest", manifest, cwd=where).returncode == 0
    cases.append(["pack-engram", "--node", "dgx2"])
    old, archive = where / "old", where / "archive"
    old.mkdir(mode=0o755)
    (old / "engram-l0-r0of2.bin").write_bytes(b"x" * 4096)
    archive.mkdir(mode=0o755)  # root's: nobody cannot write DEST
    cases.append(["archive", old, archive])
    before = tree_state(where)
    for args in cases:
        real = as_nobody(*args, "--manifest", manifest, cwd=where)
        dry = as_nobody(*args, "-n", "--manifest", manifest, cwd=where)
        assert real.returncode == 3 and "permission denied" in real.stderr or "not writable" in real.stderr, real
        assert (dry.returncode, dry.stderr) == (real.returncode, real.stderr), (args, dry.stderr, real.stderr)
    assert tree_state(where) == before
    # DEST writable, SRC not: the real run copies and keeps the source (not_deleted, exit 1); so does the dry run.
    archive.chmod(0o777)
    dry = as_nobody("archive", "-n", "--json", old, archive, cwd=where)
    assert dry.returncode == 1 and [p["kind"] for p in json.loads(dry.stdout)["problems"]] == ["not_deleted"], dry
    assert list(archive.iterdir()) == []
    real = as_nobody("archive", "--json", old, archive, cwd=where)
    assert real.returncode == 1 and [p["kind"] for p in json.loads(real.stdout)["problems"]] == ["not_deleted"]


# ---- 11. Ctrl-C mid-copy on a slow source: said at once, stopped at the next chunk -------------------

@contextlib.contextmanager
def throttled_reads(path: Path, bytes_per_second: int):
    """A blkio cgroup (v1) that reads the disk holding `path` at `bytes_per_second`: a slow NAS
    with real, uncached reads. Yields the cgroup.procs file to put a process in."""
    root = Path("/sys/fs/cgroup/blkio")
    if not (root / "blkio.throttle.read_bps_device").exists():
        pytest.skip("no blkio cgroup (v1) to throttle reads with here")
    dev = os.stat(path).st_dev
    group = root / f"stage-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} {bytes_per_second}\n")
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_ctrl_c_mid_copy_says_so_at_once_and_stops_at_the_next_chunk(tmp_path):
    """A 160 MiB weight read at 16 MiB/s (ten seconds): SIGINT once the copy is under way ends the
    mirror within a few seconds, not when the file is done; the stderr line says what it stops,
    no temp file is left, the lock is free and the next mirror stages a hub that verifies."""
    hub = Hub(tmp_path / "nas")
    snap = hub.repo("acme/Slow").snapshot()
    size, chunks = streamed_safetensors(5, 160 * MiB)
    snap.add_lfs_stream("model.safetensors", size, chunks, shared=False)
    snap.finish()
    for blob in (tmp_path / "nas").rglob("*"):  # every NAS byte read from the (throttled) disk, not the page cache
        if blob.is_file():
            fd = os.open(blob, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    node = tmp_path / "nvme" / "hf" / "hub"
    manifest = write_manifest(tmp_path / "m.toml", tmp_path / "nas", node, {"acme/Slow": {}})
    rate = 16 * MiB
    with throttled_reads(tmp_path, rate) as procs:
        proc = subprocess.Popen([*INSTALLED_STAGE, "mirror", "--node", "dgx1", "-j", "1", "--manifest", str(manifest)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_clean_env(),
                                preexec_fn=lambda: procs.write_text(str(os.getpid())))
        deadline = time.monotonic() + 60
        while not temp_files(node):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        started = time.monotonic()
        time.sleep(2)  # the copy is under way: at most 2 s x 16 MiB/s of it is done
        copied = min(size, (time.monotonic() - started) * rate)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        first_line_after = None
        while first_line_after is None and proc.poll() is None:
            if os.read(proc.stderr.fileno(), 4096):  # the line comes at once, before the clean-up
                first_line_after = time.monotonic() - sent
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    left = (size - copied) / rate  # what waiting for the file's end would have taken, at least
    assert proc.returncode == 130, err
    assert first_line_after is not None and first_line_after < 1.0, first_line_after
    assert took < min(4.0, left / 2), f"{took:.1f}s from SIGINT to exit; the file had {left:.1f}s to go"
    assert temp_files(tmp_path) == []
    again = stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert again.returncode == 0, again.stderr  # the lock was released
    assert stage("verify", "--node", "dgx1", "--full", "--manifest", manifest).returncode == 0


# ---- 12. scripts/hubgen.py as a command ---------------------------------------------------------------

def hubgen_cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "hubgen.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env=_clean_env())


def test_hubgen_has_a_command_line_that_builds_hubs_stage_can_serve(tmp_path):
    usage = hubgen_cli("--help", cwd=tmp_path)
    assert usage.returncode == 0 and all(word in usage.stdout for word in ("demo", "hub", "engram")), usage
    assert "--size SIZE" in hubgen_cli("hub", "-h", cwd=tmp_path).stdout
    made = hubgen_cli("hub", "h", "--size", "24MiB", "--files", "3", "--small-files", "4", cwd=tmp_path)
    manifest = Path(made.stdout.strip())
    assert made.returncode == 0 and manifest == tmp_path / "h" / "cluster.toml", made
    snapshot = next((tmp_path / "h" / "nas" / "hf" / "hub" / "models--acme--Model" / "snapshots").iterdir())
    weights = sorted(snapshot.glob("*.safetensors"))
    assert len(weights) == 3 and abs(sum(w.stat().st_size for w in weights) - 24 * MiB) < 4096
    assert len(list((snapshot / "extra").iterdir())) == 4
    assert stage("mirror", "--node", "node1", "-q", "--manifest", manifest).returncode == 0
    assert stage("verify", "--node", "node1", "--full", "-q", "--manifest", manifest).returncode == 0
    from huggingface_hub import snapshot_download
    from safetensors import safe_open

    local = snapshot_download("acme/Model", cache_dir=tmp_path / "h" / "nvme" / "hf" / "hub", local_files_only=True)
    with safe_open(os.path.join(local, weights[0].name), "numpy") as staged:
        assert list(staged.keys())  # the staged weight loads

    engram = hubgen_cli("engram", "e", "--rows", "3001", "--world", "2", "--layers", "3", cwd=tmp_path)
    manifest = Path(engram.stdout.strip())
    assert engram.returncode == 0 and stage("mirror", "--node", "node1", "--manifest", manifest).returncode == 0
    packed = json.loads(stage("pack-engram", "--node", "node1", "--json", "--manifest", manifest).stdout)
    assert [(s["layer"], s["rank"], s["world"]) for s in packed["shards"]] == [(3, 0, 2), (3, 1, 2)]
    assert stage("verify", "--node", "node1", "--full", "--manifest", manifest).returncode == 0

    demo = hubgen_cli("demo", "d", cwd=tmp_path)
    assert demo.returncode == 0 and stage("mirror", "--node", "dgx1", "--manifest", demo.stdout.strip()).returncode == 0
    again = hubgen_cli("demo", "d", cwd=tmp_path)  # DIR holds a hub now: refused unless --force
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr
    assert hubgen_cli("--force", "demo", "d", cwd=tmp_path).returncode == 0
    bad = hubgen_cli("hub", "x", "--size", "12X", cwd=tmp_path)
    assert bad.returncode == 2 and "--size" in bad.stderr and not (tmp_path / "x").exists()


# ---- 13. the default manifest is named --------------------------------------------------------------

def test_without_manifest_or_env_every_error_names_the_default_manifest(tmp_path):
    make_demo(tmp_path)
    (tmp_path / "manifests").mkdir()
    shutil.copy(tmp_path / "demo" / "cluster.toml", tmp_path / "manifests" / "cluster.toml")
    default = tmp_path / "manifests" / "cluster.toml"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = stage("verify", "--node", "dgx1", cwd=elsewhere)
    assert missing.returncode == 2 and missing.stderr.startswith(
        f"stage: error: {elsewhere}/manifests/cluster.toml: manifest not found"), missing.stderr
    unknown = stage("verify", "--node", "dgx9", cwd=tmp_path)
    assert unknown.returncode == 2 and str(default) in unknown.stderr, unknown.stderr
    assert stage("mirror", "--node", "dgx1", cwd=tmp_path).returncode == 0
    lock = tmp_path / "demo" / "nvme" / "hf" / "hub" / ".locks" / "stager.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "30"])
    try:
        while not (lock.exists() and _held(lock)):
            time.sleep(0.01)
        locked = stage("mirror", "--node", "dgx1", cwd=tmp_path)
        locked_json = stage("mirror", "--node", "dgx1", "--json", cwd=tmp_path)
        named = stage("mirror", "--node", "dgx1", "--manifest", default, cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert locked.returncode == 3 and f"(manifest: {default}, the default" in locked.stderr, locked.stderr
    assert f"(manifest: {default}" in json.loads(locked_json.stdout)["error"]
    assert named.returncode == 3 and "(manifest:" not in named.stderr  # the operator named it
    audit = stage("audit", "--node", "dgx1", "--prom", "/proc/no-such-dir/stage.prom", cwd=tmp_path)
    assert audit.returncode == 3 and f"(manifest: {default}" in audit.stdout, audit.stdout


def _held(lock: Path) -> bool:
    ino = os.stat(lock).st_ino
    return any(line.split()[5].endswith(f":{ino}") for line in Path("/proc/locks").read_text().splitlines())
