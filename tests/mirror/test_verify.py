"""`stage verify`: the ladder (sampled, full, rotating scrub) and the three-state verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_stage, write_manifest
from hubgen import Hub, random_safetensors
from stager.mirror.fingerprint import Digest, Verdict, judge, safetensors_head, sample_spans

REPO_ID = "acme/Flash-3bpw"
MiB = 1024 * 1024


@pytest.fixture
def staged(tmp_path: Path, nas_hub: Hub, local_hub: Path):
    snap = nas_hub.repo(REPO_ID).snapshot()
    snap.add_git("config.json", b'{"architectures": ["X"]}')  # 40-hex git sha1 blob name
    snap.add_lfs("model-00001-of-00002.safetensors", random_safetensors(1, 4 * MiB), shared=True)  # sha256 name
    snap.add_lfs("model-00002-of-00002.safetensors", random_safetensors(2, 4 * MiB), shared=False)
    snap.add_real("tokenizer.json", b'{"model": {"type": "BPE"}}')  # reference: trees json
    snap.add_lfs("skip/me.safetensors", random_safetensors(3, MiB), shared=False)
    snap.finish()
    snap.add_real("notes.txt", b"a real file the trees listing does not know")  # reference: NAS copy
    manifest = write_manifest(tmp_path / "cluster.toml", nas_hub.root, local_hub, {REPO_ID: {"exclude": ["skip/*"]}})
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert result.code == 0, result.stderr
    return {"manifest": manifest, "local": local_hub, "nas": nas_hub.root, "snap": snap,
            "snapdir": local_hub / snap.dir.relative_to(nas_hub.root)}


def verify(env, *extra):
    return run_stage("verify", "--node", "dgx1", "--manifest", env["manifest"], "--json", *extra)


def flip(path: Path, offset: int) -> None:
    real = Path(os.path.realpath(path))
    with open(real, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def unsampled_offset(path: Path, seed: int) -> int:
    data = Path(os.path.realpath(path)).read_bytes()
    spans = sample_spans(len(data), seed, safetensors_head(data[:9], len(data)))
    return next(off for off in range(len(data) // 3, len(data)) if all(not s <= off < s + n for s, n in spans))


def test_clean_node_verifies_in_both_modes(staged):
    for extra in ((), ("--full",)):
        result = verify(staged, *extra)
        assert result.code == 0, result.stdout
        data = result.json
        assert data["checked"] == data["ok"] and data["problems"] == []
        assert data["excluded"] == ["skip/me.safetensors"]
    assert verify(staged).json["seed"] is not None  # the sampled report names its seed


def test_sampled_catches_head_damage_and_names_the_file(staged):
    shard = staged["snapdir"] / "model-00001-of-00002.safetensors"
    flip(shard, 100)  # inside the safetensors header: always sampled
    result = verify(staged)
    assert result.code == 1
    [problem] = result.json["problems"]
    assert problem["kind"] == "mismatch" and problem["path"] == str(shard)
    assert result.json["mismatches"] == 1


def test_full_catches_what_sampling_misses(staged):
    shard = staged["snapdir"] / "model-00002-of-00002.safetensors"
    flip(shard, unsampled_offset(shard, seed=11))
    assert verify(staged, "--seed", "11").code == 0  # the documented blind spot of sampling
    result = verify(staged, "--full")
    assert result.code == 1
    assert [(p["kind"], p["path"]) for p in result.json["problems"]] == [("mismatch", str(shard))]
    assert "sha256" in result.json["problems"][0]["detail"]


@pytest.mark.parametrize("name, reference", [
    ("config.json", "git-sha1"), ("tokenizer.json", "git-sha1"), ("notes.txt", "blake3"),
])
def test_full_uses_the_strongest_reference(staged, name, reference):
    flip(staged["snapdir"] / name, 2)
    result = verify(staged, "--full")
    assert result.code == 1
    [problem] = result.json["problems"]
    assert problem["path"] == str(staged["snapdir"] / name) and reference in problem["detail"]


def test_links_missing_dangling_and_remote_are_named(staged):
    snapdir = staged["snapdir"]
    (snapdir / "config.json").unlink()
    payload = Path(os.path.realpath(snapdir / "model-00001-of-00002.safetensors"))
    payload.unlink()
    blob = snapdir / os.readlink(snapdir / "model-00002-of-00002.safetensors")
    nas_blob = staged["nas"] / Path(os.path.normpath(blob)).relative_to(staged["local"])
    blob.unlink()
    os.symlink(nas_blob, blob)  # resolves, but through the NAS
    result = verify(staged)
    assert result.code == 1
    kinds = {Path(p["path"]).name: p["kind"] for p in result.json["problems"]}
    assert kinds == {"config.json": "missing", "model-00001-of-00002.safetensors": "dangling",
                     "model-00002-of-00002.safetensors": "remote"}
    assert (result.json["missing"], result.json["dangling"], result.json["remote"]) == (1, 1, 1)
    repair = run_stage("verify", "--node", "dgx1", "--manifest", staged["manifest"])
    assert "stage mirror --node dgx1" in repair.stdout  # the report ends with the repair command


def test_rotating_scrub_covers_every_blob_once(staged):
    total = verify(staged, "--full").json
    assert total["content_checked"] == 5
    runs = [verify(staged, "--full", "--subset", f"{n}/3").json for n in (1, 2, 3)]
    assert sum(run["content_checked"] for run in runs) == 5  # each blob's bytes are read in one bucket
    assert all(run["checked"] == total["checked"] for run in runs)  # structure: every entry, every bucket
    assert verify(staged, "--full", "--subset", "0/3").json["content_checked"] == runs[2]["content_checked"]


def test_every_subset_checks_the_structure_of_every_entry(staged):
    """A deleted snapshot entry once passed 6 of 7 subsets: only its own bucket looked at it."""
    entry = next(p for p in (staged["local"]).rglob("snapshots/*/*") if p.is_symlink())
    entry.unlink()
    for n in range(1, 8):
        result = verify(staged, "--full", "--subset", f"{n}/7")
        assert result.code == 1, f"subset {n}/7 passed with {entry} deleted"
        assert [p["kind"] for p in result.json["problems"]] == ["missing"]
        assert result.json["problems"][0]["path"] == str(entry)
    bad = verify(staged, "--full", "--subset", "5/3")
    assert bad.code == 2 and "--subset" in bad.stderr


def test_sampled_verify_reads_only_samples(tmp_path, nas_hub, local_hub):
    snap = nas_hub.repo(REPO_ID).snapshot()
    snap.add_lfs("big.safetensors", random_safetensors(5, 96 * MiB, names=1), shared=False)
    snap.finish()
    manifest = write_manifest(tmp_path / "m.toml", nas_hub.root, local_hub, {REPO_ID: {}})
    assert run_stage("mirror", "--node", "dgx1", "--manifest", manifest).code == 0
    probe = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print(open('/proc/self/io').read(), file=sys.stderr))\n"
             f"sys.argv = ['stage', 'verify', '--node', 'dgx1', '--manifest', {str(manifest)!r}]\n"
             "runpy.run_module('stager', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    io = dict(line.split(": ") for line in proc.stderr.splitlines() if line.startswith("rchar"))
    assert int(io["rchar"]) < 24 * MiB  # both sides of a 96 MiB blob, plus the interpreter's imports


class FlakySource:
    """A real source whose first sampled read of one file returns a flipped byte (a flaky NFS read)."""

    def __init__(self, inner, flaky_rel: str):
        self.inner, self.flaky_rel, self.fired = inner, flaky_rel, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open(self, rel, **kwargs):
        reader = self.inner.open(rel, **kwargs)
        if rel != self.flaky_rel or self.fired:
            return reader
        self.fired = True
        real_pread = reader.pread

        def pread(length, offset):
            data = real_pread(length, offset)
            return (bytes([data[0] ^ 1]) + data[1:]) if offset == 0 and data else data

        reader.pread = pread
        return reader


def test_mismatch_is_reread_once_and_reported_as_flaky(staged):
    from stager.manifest import load_manifest
    from stager.mirror.pipeline import node_job, walk
    from stager.mirror.observe import DigestCache
    from stager.mirror.verify import verify_snapshots

    job = node_job(load_manifest(staged["manifest"]), "dgx1", None, jobs=1, seed=5)
    snapshots = walk(job)
    entry = next(e for s in snapshots for e in s.entries if e.path == "model-00002-of-00002.safetensors")
    source = FlakySource(job.source, entry.final)
    report = verify_snapshots(source, job.local_hub, snapshots, DigestCache(source, 5), full=False, jobs=1)
    assert source.fired and report.problems == []
    assert report.reread == [str(staged["snapdir"] / "model-00002-of-00002.safetensors")]


def test_could_not_check_is_never_equal():
    assert judge(Digest("sha256", 3, None, "unreadable"), Digest("sha256", 3, "ab")) is Verdict.UNCHECKED
    assert judge(Digest("sha256", 3, "ab"), Digest("blake3", 3, "ab")) is Verdict.UNCHECKED
    assert judge(Digest("sha256", 3, "ab"), Digest("sha256", 4, "ab")) is Verdict.DIFFER
    assert judge(Digest("sha256", 3, "ab"), Digest("sha256", None, "ab")) is Verdict.MATCH


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """Run `stage` with stderr on a real pseudo-terminal; returns (exit code, what the terminal showed)."""
    import pty
    import subprocess
    import sys

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "stager", *args], stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    return proc.wait(timeout=60), shown.decode(errors="replace")


@pytest.mark.parametrize("args", [("verify",), ("verify", "--full"), ("mirror", "--full")])
def test_a_byte_progress_bar_on_a_terminal_and_none_in_a_pipe(staged, args):
    """`verify --full` sat silent for as long as it hashed; a warm `mirror --full` re-hashes too."""
    code, shown = _on_a_terminal(*args, "--node", "dgx1", "--manifest", str(staged["manifest"]))
    assert code == 0, shown
    assert "100%|" in shown and "B/s" in shown, shown
    piped = run_stage(*args, "--node", "dgx1", "--manifest", staged["manifest"])
    assert "%|" not in piped.stderr and "B/s" not in piped.stderr


def test_a_nas_blob_that_fails_its_own_name_is_blamed_on_the_nas(tmp_path, nas_hub, local_hub):
    """The default mirror copies such a blob (it matches the NAS); --full names the NAS copy as bad,
    because mirroring again cannot repair it."""
    snap = nas_hub.repo(REPO_ID).snapshot()
    name = snap.add_lfs("model.safetensors", random_safetensors(3, MiB), shared=False)
    snap.finish()
    blob = nas_hub.repo(REPO_ID).dir / "blobs" / name
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot on the NAS, same size
    blob.write_bytes(bytes(data))
    manifest = write_manifest(tmp_path / "m.toml", nas_hub.root, local_hub, {REPO_ID: {}})
    sampled = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json", "--seed", "1")
    assert sampled.code == 0  # sampling cannot see one byte in the middle: by design, see design.md
    for command in (["verify", "--full"], ["mirror", "--full"]):
        result = run_stage(*command, "--node", "dgx1", "--manifest", manifest, "--json")
        assert result.code == 1
        problem = next(p for p in result.json["problems"] if p["kind"] == "mismatch")
        assert "NAS file is bad" in problem["detail"] and "cannot fix it" in problem["detail"], problem
    verify = run_stage("verify", "--full", "--node", "dgx1", "--manifest", manifest, "--json")
    assert verify.json["repair"] == []  # no command to paste that could not work


def test_a_link_removed_and_made_again_while_it_is_checked_is_there_or_missing_never_an_error(tmp_path: Path):
    """Another process unlinks and remakes a snapshot entry as fast as it can (an operator deleting
    what the audit listed, while the mirror checks its links): every look at it sees a link to
    the blob or nothing. A readlink between the unlink and the remake once raised ENOENT, and the
    mirror ended with exit 3 naming the entry."""
    from stager.base.identity import look
    from stager.mirror.verify import check_local_chain

    hub = tmp_path / "hub"
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / "b").write_bytes(b"weights")
    (hub / "snap").mkdir()
    churner = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "end = time.time() + 2\n"
        "while time.time() < end:\n"
        "    os.symlink('../blobs/b', 'snap/a')\n"
        "    os.unlink('snap/a')\n")], cwd=hub)
    seen = {"link": 0, "absent": 0}
    try:
        while churner.poll() is None:
            st, target = look(hub / "snap" / "a")
            assert (st is None and target is None) or target == "../blobs/b", (st, target)
            seen["link" if target else "absent"] += 1
            final, problem, _links = check_local_chain(hub, "snap/a")
            assert final == "blobs/b" or problem.kind == "missing", (final, problem)
    finally:
        churner.kill()
        churner.wait()
    assert churner.returncode == 0 or churner.returncode == -9
    assert seen["link"] and seen["absent"], seen
