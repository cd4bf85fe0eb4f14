"""Nothing waits on a file that is not a regular file.

Two checks, each catching the next such path: every `open(`-like call in stager/ is either the
one non-blocking reader or a reviewed site whose file kind is already proven, and a real FIFO
planted at each path the commands read ends the command at once, with its documented exit code
and one line naming the path."""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from reliability_support import STAGE, build_staging

STAGER = Path(__file__).resolve().parents[2] / "stager"

# Calls that open or read a file by name. `.open(` matches any object's: a source's and a
# checkpoint's readers are listed below with why they cannot block.
OPENERS = {"open", "os.open", "io.open", "os.fdopen", "json.load", "tomllib.load", "np.fromfile", "np.load",
           "np.memmap", "mmap.mmap"}
METHODS = {"open", "read_text", "read_bytes", "write_text", "write_bytes"}

# (module, enclosing function, call) -> why the kind of what it opens is already proven.
REVIEWED = {
    ("base/small_files.py", "open_keeping_atime", "os.open"):
        "the open behind open_regular and LocalReader, which pass O_NONBLOCK and check S_ISREG through the descriptor",
    ("sources/local.py", "LocalReader.__init__", "os.open"):
        "O_NONBLOCK|O_NOFOLLOW, then S_ISREG through the descriptor before any read",
    ("sources/local.py", "reopen_direct", "os.open"):
        "/proc/self/fd/N of a descriptor already proven a regular file",
    ("sources/local.py", "aligned_buffer", "mmap.mmap"): "anonymous memory, no file",
    ("sources/sftp.py", "RemoteSource.read_small", "sftp.open"): "stat() says a regular file just before",
    ("sources/sftp.py", "RemoteSource.open", "sftp.open"): "lstat() says a regular file just before",
    ("sources/throttle.py", "ThrottledSource.open", "self._source.open"): "the wrapped source's own open, above",
    ("base/atomic.py", "fsync_dir", "os.open"): "O_DIRECTORY: anything but a directory fails at once",
    ("base/atomic.py", "SyncBatch.__init__", "os.open"): "O_DIRECTORY: anything but a directory fails at once",
    ("base/atomic.py", "_create_temp", "os.open"): "O_CREAT|O_EXCL|O_NOFOLLOW: a new file of our own",
    ("base/atomic.py", "open_for_write", "os.open"): "O_NONBLOCK|O_NOFOLLOW, then S_ISREG through the descriptor",
    ("mirror/verify.py", "_drop_cache", "os.open"): "O_NONBLOCK|O_NOFOLLOW and never read: only a page-cache hint",
    ("cli/terminal.py", "discard", "os.open"): "os.devnull, the null device, on purpose",
    ("base/lock.py", "LockTable.read", "open"): "/proc/locks, a procfs file",
    ("base/identity.py", "mount_table", "open"): "/proc/<pid>/mountinfo, a procfs file",
    ("base/identity.py", "mount_id", "open"): "/proc/self/fdinfo/<fd>, a procfs file",
    ("housekeeping/fence.py", "open_dir", "os.open"): "O_DIRECTORY|O_NOFOLLOW: anything but a directory fails at once",
    ("base/identity.py", "open_by", "open"): "/proc/<pid>/fdinfo/<fd>, a procfs file",
    ("housekeeping/archive.py", "_processes", "open"): "/proc/<pid>/comm, a procfs file",
    ("housekeeping/in_use.py", "command_of", "open"): "/proc/<pid>/cmdline and comm, procfs files",
    ("housekeeping/in_use.py", "_by_mapping", "open"): "/proc/<pid>/maps, a procfs file",
    ("mirror/records.py", "journal_tail", "os.open"): "O_NONBLOCK|O_NOFOLLOW, then S_ISREG through the descriptor",
    ("housekeeping/prune.py", "sweep_payload", "os.open"): "O_NONBLOCK|O_NOFOLLOW, then S_ISREG through the descriptor; only flocked",
    ("mirror/execute.py", "land_verified", "source.open"): "a source's reader (sources/local.py, sftp.py)",
    ("fleet/broadcast/relay.py", "_Feed.fill", "os.open"): "/proc/self/fd/N of our own temp file, open already",
    ("fleet/agent.py", "NodeAgent.open", "self.relay.open"): "the relay's listening sockets, no file",
    ("fleet/probe.py", "read_nas", "source.open"): "a source's reader",
    ("fleet/node.py", "CommandProgress._read", "os.fdopen"): "the read end of a pipe this process made (os.pipe)",
    ("fleet/node.py", "CommandProgress.stopped", "open"): "/proc/<pid>/stat of its own command, a procfs file",
    ("mirror/observe.py", "DigestCache._digest", "self.source.open"): "a source's reader",
    ("engram/checkpoint.py", "Checkpoint.open", "self.source.open"): "a source's reader",
    ("engram/checkpoint.py", "_header", "source.open"): "a source's reader",
    ("engram/packer.py", "pack_layer", "checkpoint.open"): "Checkpoint.open: a source's reader",
    ("engram/packer.py", "pack_rows", "checkpoint.open"): "Checkpoint.open: a source's reader",
    ("engram/checks.py", "check_shard", "checkpoint.open"): "Checkpoint.open: a source's reader",
}


def _call_name(func: ast.expr) -> tuple[str, bool] | None:
    """(dotted name, is a method call) of a call that opens or reads a file by name, else None."""
    if isinstance(func, ast.Name) and func.id in OPENERS:
        return func.id, False
    if isinstance(func, ast.Attribute):
        dotted = ast.unparse(func)
        if dotted in OPENERS:
            return dotted, False
        if func.attr in METHODS:
            return dotted, True
    return None


def _open_sites() -> list[tuple[str, str, str, int]]:
    sites = []
    for path in sorted(STAGER.rglob("*.py")):
        module = str(path.relative_to(STAGER))
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, scope: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call) and (name := _call_name(child.func)):
                    sites.append((module, ".".join(scope), name[0], child.lineno))
                visit(child, scope)

        visit(tree, [])
    return sites


def test_every_open_in_stager_is_the_regular_file_reader_or_a_reviewed_site():
    """A plain open() of the safetensors index and of the node's ref hung mirror on a FIFO; the next
    such call fails here until it goes through small_files or is reviewed into REVIEWED."""
    sites = _open_sites()
    unreviewed = [f"stager/{m}:{line} {scope}: {call}(" for m, scope, call, line in sites
                  if (m, scope, call) not in REVIEWED]
    assert not unreviewed, "open a file of unproven kind with stager.base.small_files:\n" + "\n".join(unreviewed)
    seen = {(m, scope, call) for m, scope, call, _ in sites}
    assert not set(REVIEWED) - seen, f"reviewed sites that no longer exist: {sorted(set(REVIEWED) - seen)}"


SNAP = "nas/hf/hub/models--acme--Weights/snapshots"
NODE = "nvme/hf/hub"
REPO = "models--acme--Weights"

# (case, where the FIFO goes under the staging root, command, exit code, what must follow).
# "named": one output line names the FIFO's path; "replaced": the command wrote a regular file
# over it (the FIFO was a damaged copy of the tool's own output); "ignored": an optional NAS
# file that is not a file is left out, as huggingface_hub would.
PLANTED = [
    ("NAS safetensors index, mirror", f"{SNAP}/{{commit}}/model.safetensors.index.json", "mirror", 1, "named"),
    ("NAS safetensors index, verify", f"{SNAP}/{{commit}}/model.safetensors.index.json", "verify", 1, "named"),
    ("NAS index blob, verify --full", f"nas/hf/hub/{REPO}/blobs/{{index_blob}}", "verify --full", 1, "named"),
    ("NAS ref, mirror", f"nas/hf/hub/{REPO}/refs/main", "mirror", 1, "named"),
    ("NAS ref, verify", f"nas/hf/hub/{REPO}/refs/main", "verify", 1, "named"),
    ("NAS trees json, mirror", f"nas/hf/hub/{REPO}/trees/{{commit}}.json", "mirror", 0, "ignored"),
    ("NAS shared-store marker, mirror", "nas/hf/hub/blobs/.huggingface-shared-blobs", "mirror", 0, "ignored"),
    ("NAS shared-store .refs, mirror", "nas/hf/hub/blobs/{shared_refs}", "mirror", 0, "ignored"),
    ("node ref, verify", f"{NODE}/{REPO}/refs/main", "verify", 1, "named"),
    ("node ref with a NAS problem, mirror", f"{NODE}/{REPO}/refs/main", "mirror", 1, "named"),
    ("node trees json, verify", f"{NODE}/{REPO}/trees/{{commit}}.json", "verify", 1, "named"),
    ("node trees json, mirror", f"{NODE}/{REPO}/trees/{{commit}}.json", "mirror", 0, "replaced"),
    ("node shared-store .refs, mirror", f"{NODE}/blobs/{{shared_refs}}", "mirror", 0, "replaced"),
    ("node config blob, verify", f"{NODE}/{REPO}/blobs/{{config_blob}}", "verify", 1, "named"),
    ("node hub lock, mirror", f"{NODE}/.locks/stager.lock", "mirror", 3, "named"),
    ("Engram SHA256SUMS, verify", "nvme/engram/SHA256SUMS", "verify", 1, "named"),
    ("Engram SHA256SUMS, pack-engram", "nvme/engram/SHA256SUMS", "pack-engram", 3, "named"),
    ("Engram receipt, verify", "nvme/engram/engram-l0-r0of3.json", "verify", 1, "named"),
    ("Engram receipt, pack-engram", "nvme/engram/engram-l0-r0of3.json", "pack-engram", 0, "replaced"),
    ("Engram shard, verify", "nvme/engram/engram-l0-r1of3.bin", "verify", 1, "named"),
    ("Engram lock, pack-engram", "nvme/engram/.locks/engram.lock", "pack-engram", 3, "named"),
    ("manifest, verify", "cluster.toml", "verify", 2, "named"),
    ("manifest, mirror", "cluster.toml", "mirror", 2, "named"),
]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A node staged and packed from a NAS with a shared-store payload, an index and an Engram table."""
    staging = build_staging(tmp_path_factory.mktemp("packed"), shards=2, shard_bytes=64 * 1024, engram={0: 64})
    assert staging.mirror().code == 0 and staging.stage("pack-engram").code == 0
    return staging.root


@pytest.mark.parametrize("case, where, command, code, then", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_fifo_at_any_path_a_command_reads_ends_it_at_once(packed, tmp_path, case, where, command, code, then):
    """A FIFO named *.safetensors.index.json on the NAS hung mirror and verify, and one at the node's
    ref hung a mirror that had a NAS problem to report; no path a command reads may block it."""
    root = tmp_path / "staging"
    shutil.copytree(packed, root, symlinks=True)
    manifest = root / "cluster.toml"
    manifest.write_text(manifest.read_text().replace(str(packed), str(root)))
    snapshot = next((root / SNAP).iterdir())
    index = snapshot / "model.safetensors.index.json"
    names = {"commit": snapshot.name, "index_blob": os.path.basename(os.readlink(index)),
             "config_blob": os.path.basename(os.readlink(snapshot / "config.json")),
             "shared_refs": next((root / "nas/hf/hub/blobs").rglob("*.refs")).relative_to(root / "nas/hf/hub/blobs")}
    fifo = root / where.format(**names)
    if "with a NAS problem" in case:  # the ref cannot move: its message reads the node's ref
        index.unlink()
        os.mkfifo(index)
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        proc = subprocess.run([*STAGE, *command.split(), "--node", "dgx1", "--manifest", str(manifest)],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} waited on the FIFO at {fifo}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "Traceback" not in out, out
    if then == "named":
        shown = fifo.name if fifo.suffix == ".json" and "engram" in where else str(fifo)
        assert [line for line in out.splitlines() if shown in line], out
    elif then == "replaced":
        assert stat.S_ISREG(os.lstat(fifo).st_mode), f"{command} left the FIFO at {fifo}"
        assert subprocess.run([*STAGE, "verify", "--node", "dgx1", "--manifest", str(manifest)],
                              capture_output=True, timeout=30).returncode == 0
    else:
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the NAS is never written"
