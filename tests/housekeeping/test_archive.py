"""`stage archive`: a move that never loses the only copy, checked with real files and real kills."""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file
from hubgen import pseudo_random
from ops_fixtures import MiB, needs_root, read_only_bind, tmpfs
from stager.base.atomic import is_temp_name
from stager.mirror.records import read_sums

STAGE = [sys.executable, "-m", "stager"]


def write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return sha256_file(path)


def write_big(path: Path, size: int, seed: int) -> str:
    """`size` pseudo-random bytes written in 8 MiB pieces (the test's own memory stays small)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        for i in range(0, size, 8 * MiB):
            out.write(pseudo_random(seed * 1000 + i // (8 * MiB), min(8 * MiB, size - i)))
    return sha256_file(path)


def sha256sum_check(dest: Path) -> None:
    """The independent check: GNU coreutils, run in DEST."""
    result = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=dest, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def temps_under(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, _, files in os.walk(root) for n in files if is_temp_name(n)]


def parse_moved(text: str) -> list[dict]:
    """Blocks of a MOVED.txt: `<key>: <value>` header lines, then `<sha256>  <bytes>  <how>  <name>`
    lines; a line that starts with a backslash has its value or name escaped as in SHA256SUMS."""
    blocks = []
    for chunk in text.split("\n\n"):
        lines = [line for line in chunk.splitlines() if line and not line.startswith("#")]
        if not lines:
            continue
        block = {"entries": {}}
        for line in lines:
            escaped = line.startswith("\\")
            line = line[1:] if escaped else line

            def plain(value: str) -> str:
                if not escaped:
                    return value
                return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), value)

            if re.match(r"^[0-9a-f]{64}  ", line):
                sha, size, how, name = line.split("  ", 3)
                block["entries"][plain(name)] = (sha, int(size), how)
            else:
                key, value = line.split(": ", 1)
                block[key] = plain(value)
        blocks.append(block)
    return blocks


@pytest.fixture
def tree(tmp_path: Path) -> dict:
    """Old TP2 shards with a receipt in a subdirectory, a symlink pointing out of SRC, and DEST."""
    src = tmp_path / "engram" / "tp2"
    files = {
        "engram-l1-r0of2.bin": pseudo_random(1, 3 * MiB + 17),
        "engram-l14-r0of2.bin": pseudo_random(2, 2 * MiB),
        "receipts/engram-l1-r0of2.json": b'{"layer": 1, "world": 2}\n',
        "name with spaces.bin": b"spaces\n",
        "empty.bin": b"",
    }
    sums = {name: write(src / name, data) for name, data in files.items()}
    outside = tmp_path / "keep.txt"
    outside.write_bytes(b"outside SRC: must never move\n")
    os.symlink(outside, src / "link-out")
    dest = tmp_path / "archive"
    dest.mkdir()
    return {"src": src, "dest": dest, "files": files, "sums": sums, "outside": outside}


def test_archive_moves_records_and_checks(tree):
    src, dest = tree["src"], tree["dest"]
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0, result.stderr
    report = result.json
    assert report["moved_files"] == len(tree["files"])
    assert report["moved_bytes"] == sum(len(d) for d in tree["files"].values())
    # Every byte arrived: sha256 of each DEST file, and GNU sha256sum -c over SHA256SUMS.
    for name, sha in tree["sums"].items():
        assert sha256_file(dest / "tp2" / name) == sha
    assert read_sums(dest / "SHA256SUMS") == {f"tp2/{n}": s for n, s in tree["sums"].items()}
    sha256sum_check(dest)
    # Sources are gone, the emptied subdirectory too; SRC stays as a signpost with MOVED.txt and the link.
    assert sorted(p.name for p in src.iterdir()) == ["MOVED.txt", "link-out"]
    assert os.readlink(src / "link-out") == str(tree["outside"]) and tree["outside"].exists()
    assert not (dest / "tp2" / "link-out").exists()
    assert [s["path"] for s in report["skipped"]] == [str(src / "link-out")]
    assert report["skipped"][0]["kind"] == "symlink"
    # MOVED.txt: destination, time, host, bytes, and each file's sha256.
    [block] = parse_moved((src / "MOVED.txt").read_text())
    assert block["destination"] == str(dest / "tp2")
    assert block["sums"] == str(dest / "SHA256SUMS")
    assert block["host"] == os.uname().nodename
    assert int(block["bytes"]) == report["moved_bytes"] and int(block["files"]) == len(tree["files"])
    assert abs((datetime.now(timezone.utc) - datetime.fromisoformat(block["time"])).total_seconds()) < 600
    assert {n: (sha, size) for n, (sha, size, _) in block["entries"].items()} == {
        n: (tree["sums"][n], len(tree["files"][n])) for n in tree["files"]}
    # The journal: one record per file, naming both ends and the hash both sides agreed on.
    records = [json.loads(line) for line in (dest / "archive.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in records) == sorted(f"tp2/{n}" for n in tree["files"])
    for record in records:
        relative = record["name"].removeprefix("tp2/")
        assert record["source"] == str(src / relative) and record["dest"] == str(dest / record["name"])
        assert record["sha256"] == tree["sums"][relative] and record["action"] == "copied"
        assert record["bytes"] == len(tree["files"][relative])
    assert not temps_under(dest)


def test_rerun_is_a_no_op_and_a_second_archive_appends(tree, tmp_path):
    src, dest = tree["src"], tree["dest"]
    assert run_stage("archive", src, dest).code == 0
    again = run_stage("archive", src, dest, "--json")
    assert again.code == 0 and again.json["moved_files"] == 0
    # A single file moved later from the same parent gets its own MOVED.txt block; the first is kept.
    late = write(tree["src"] / "late.bin", b"late shard\n")
    other = run_stage("archive", src / "late.bin", dest, "--json")
    assert other.code == 0 and other.json["files"][0]["sha256"] == late
    blocks = parse_moved((src / "MOVED.txt").read_text())
    assert [sorted(b["entries"]) for b in blocks] == [sorted(tree["files"]), ["late.bin"]]
    assert blocks[1]["destination"] == str(dest)
    # Re-running a file SRC that is already gone: the journal says where it went.
    gone = run_stage("archive", src / "late.bin", dest, "--json")
    assert gone.code == 0 and gone.json["already_archived"] == [str(src / "late.bin")]
    sha256sum_check(dest)
    assert read_sums(dest / "SHA256SUMS")["late.bin"] == late


@pytest.mark.parametrize("same_size", [True, False])
def test_name_collision_changes_nothing(tree, same_size):
    src, dest = tree["src"], tree["dest"]
    original = tree["files"]["engram-l1-r0of2.bin"]
    clash = bytearray(original) if same_size else bytearray(original[:1000])
    clash[500] ^= 0xFF  # one byte differs (same size: only the hashes can tell)
    clash_sha = write(dest / "tp2" / "engram-l1-r0of2.bin", bytes(clash))
    before = {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 1, result.stderr
    [problem] = result.json["problems"]
    assert problem["kind"] == "collision" and problem["path"] == str(src / "engram-l1-r0of2.bin")
    assert ("sha256" in problem["detail"]) == same_size
    # Nothing happened: every source byte is where it was, DEST's file is untouched, no records.
    assert {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()} == before
    assert sha256_file(dest / "tp2" / "engram-l1-r0of2.bin") == clash_sha
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == [
        ".stage-archive.lock", "tp2", "tp2/engram-l1-r0of2.bin"]
    assert not (src / "MOVED.txt").exists() and result.json["moved_files"] == 0


def test_identical_file_in_dest_is_adopted(tree):
    src, dest = tree["src"], tree["dest"]
    write(dest / "tp2" / "engram-l14-r0of2.bin", tree["files"]["engram-l14-r0of2.bin"])
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0, result.stderr
    actions = {Path(f["dest"]).name: f["action"] for f in result.json["files"]}
    assert actions["engram-l14-r0of2.bin"] == "adopted" and actions["engram-l1-r0of2.bin"] == "copied"
    assert result.json["copied_bytes"] == result.json["moved_bytes"] - 2 * MiB
    assert not (src / "engram-l14-r0of2.bin").exists()
    sha256sum_check(dest)
    journal = {json.loads(line)["name"]: json.loads(line) for line in (dest / "archive.jsonl").read_text().splitlines()}
    assert journal["tp2/engram-l14-r0of2.bin"]["action"] == "adopted"
    [block] = parse_moved((src / "MOVED.txt").read_text())
    assert block["entries"]["engram-l14-r0of2.bin"][2] == "adopted"


def test_killed_mid_copy_then_rerun_converges(tmp_path):
    """SIGKILL at seeded points while a 96 MiB file is being copied and re-read: after every kill
    there is a complete copy with the right hash (the source, or DEST's file under its final name),
    and the source is gone only if DEST's copy is complete and recorded. The re-run finishes."""
    src = tmp_path / "old" / "tp2"
    dest = tmp_path / "archive"
    dest.mkdir()
    size = 96 * MiB
    expected = write_big(src / "engram-l1-r0of2.bin", size, seed=7)
    command = [*STAGE, "archive", str(src), str(dest), "--json"]
    rng = random.Random(4004)
    killed_copying = 0
    for trial in range(4):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while proc.poll() is None and not temps_under(dest) and time.monotonic() < deadline:
            time.sleep(0.002)
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, 0.15))
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        stderr = proc.stderr.read().decode()
        assert "Traceback" not in stderr
        killed_copying += proc.returncode == -signal.SIGKILL
        final = dest / "tp2" / "engram-l1-r0of2.bin"
        source = src / "engram-l1-r0of2.bin"
        if final.exists():
            assert sha256_file(final) == expected, f"trial {trial}: wrong bytes under the final name"
        if source.exists():
            assert sha256_file(source) == expected, f"trial {trial}: the source was modified"
        else:
            assert final.exists() and read_sums(dest / "SHA256SUMS")["tp2/engram-l1-r0of2.bin"] == expected
            break
        if final.exists():
            final.unlink()  # start the next trial from a copy in flight again
    assert killed_copying >= 1, "no kill landed during a copy"
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0, result.stderr
    assert not (src / "engram-l1-r0of2.bin").exists()
    assert sha256_file(dest / "tp2" / "engram-l1-r0of2.bin") == expected
    assert not temps_under(dest), "the re-run sweeps the killed runs' temp files"
    sha256sum_check(dest)
    [block] = parse_moved((src / "MOVED.txt").read_text())
    assert block["entries"]["engram-l1-r0of2.bin"][:2] == (expected, size)


def test_kill_after_copy_before_delete_is_adopted(tmp_path):
    """The window between the rename and the delete: DEST holds a verified copy and the source is
    still there. The kill is sent the moment the final name appears (polled every millisecond)."""
    src = tmp_path / "old"
    dest = tmp_path / "archive"
    dest.mkdir()
    expected = write_big(src / "a.bin", 8 * MiB, seed=3)
    write_big(src / "b.bin", 64 * MiB, seed=4)
    proc = subprocess.Popen([*STAGE, "archive", str(src), str(dest)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (dest / "old" / "a.bin").exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert sha256_file(dest / "old" / "a.bin") == expected
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0, result.stderr
    by_name = {Path(f["dest"]).name: f for f in result.json["files"]}
    if "a.bin" in by_name:  # the kill landed before the delete: the re-run adopts
        assert by_name["a.bin"]["action"] == "adopted"
    assert sorted(p.name for p in src.iterdir()) == ["MOVED.txt"]
    sha256sum_check(dest)


def test_preflight_refuses_when_dest_is_too_small(tmp_path):
    needs_root()
    src = tmp_path / "old"
    expected = write_big(src / "big.bin", 6 * MiB, seed=9)
    with tmpfs(tmp_path / "small", 4 * MiB) as dest:
        result = run_stage("archive", src, dest)
        assert result.code == 3, result.stderr
        assert "not enough space" in result.stderr and str(dest) in result.stderr
        assert "Traceback" not in result.stderr
        assert [p.name for p in dest.iterdir()] == [".stage-archive.lock"]
    assert sha256_file(src / "big.bin") == expected


def test_second_writer_is_refused(tree):
    lock = tree["dest"] / ".stage-archive.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        result = run_stage("archive", tree["src"], tree["dest"])
    finally:
        os.close(fd)
    assert result.code == 3 and "locked" in result.stderr
    assert (tree["src"] / "engram-l1-r0of2.bin").exists()


def test_bad_input_exits_2_with_one_line(tree, tmp_path):
    src, dest = tree["src"], tree["dest"]
    cases = [
        ((src, tmp_path / "missing-dest"), "DEST is not an existing directory"),
        ((tmp_path / "nope", dest), "no such file or directory"),
        ((src, src / "receipts"), "overlap"),
        ((src, src / "engram-l1-r0of2.bin", dest), "overlap"),
        ((dest,), "at least one SRC"),
    ]
    for args, message in cases:
        result = run_stage("archive", *args)
        assert result.code == 2, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sha256_file(src / "engram-l1-r0of2.bin") == tree["sums"]["engram-l1-r0of2.bin"]


def test_named_symlink_is_reported_not_followed(tree, tmp_path):
    link = tmp_path / "shards-link"
    os.symlink(tree["src"], link)
    result = run_stage("archive", link, tree["dest"], "--json")
    assert result.code == 1
    assert result.json["problems"][0]["kind"] == "symlink"
    assert link.is_symlink() and (tree["src"] / "engram-l1-r0of2.bin").exists()
    assert not (tree["dest"] / "shards-link").exists()


def test_read_only_source_keeps_the_file_and_says_why(tree, tmp_path):
    """SRC on a read-only mount: the copy is made and verified, but with no MOVED.txt there is no
    delete, because a source must never vanish without a note saying where it went."""
    needs_root()
    with read_only_bind(tree["src"], tmp_path / "ro") as view:
        result = run_stage("archive", view / "engram-l1-r0of2.bin", tree["dest"], "--json")
    assert result.code == 1, result.stderr
    [problem] = result.json["problems"]
    assert problem["kind"] == "not_deleted" and "MOVED.txt could not be written" in problem["detail"]
    [moved] = result.json["files"]
    assert moved["source_deleted"] is False
    assert sha256_file(tree["src"] / "engram-l1-r0of2.bin") == tree["sums"]["engram-l1-r0of2.bin"]
    assert sha256_file(tree["dest"] / "engram-l1-r0of2.bin") == tree["sums"]["engram-l1-r0of2.bin"]
    sha256sum_check(tree["dest"])


# ---------------------------------------------------------------- identity, not path strings


def test_a_dest_name_that_is_the_source_is_refused(tree, tmp_path):
    """DEST/<dir> a symlink back to SRC, DEST/<file> a hard link of the file SRC, DEST spelled
    with `..` after a link into SRC: each DEST name is its own source. Every file used to be
    "adopted" as identical to itself and the source, the only copy, deleted with exit 0."""
    src, dest = tree["src"], tree["dest"]
    before = {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    os.symlink(src, dest / "tp2")
    linked = run_stage("archive", src, dest)
    assert linked.code == 2, linked.stdout + linked.stderr
    [line] = linked.stderr.strip().splitlines()
    assert str(dest / "tp2") in line and str(src) in line
    os.unlink(dest / "tp2")
    os.link(src / "engram-l14-r0of2.bin", dest / "engram-l14-r0of2.bin")
    hard = run_stage("archive", src / "engram-l14-r0of2.bin", dest)
    assert hard.code == 2, hard.stdout + hard.stderr
    [line] = hard.stderr.strip().splitlines()
    assert str(dest / "engram-l14-r0of2.bin") in line and str(src / "engram-l14-r0of2.bin") in line
    os.unlink(dest / "engram-l14-r0of2.bin")
    os.symlink(src / "receipts", tmp_path / "into-src")
    dotdot = run_stage("archive", src, tmp_path / "into-src" / "..")  # the kernel's `..`: SRC itself
    assert dotdot.code == 2 and "overlap" in dotdot.stderr, dotdot.stdout + dotdot.stderr
    assert {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()} == before
    assert sorted(p.name for p in dest.iterdir()) == [] and not (src / "MOVED.txt").exists()


def test_a_refused_archive_writes_nothing(tree, tmp_path):
    """Exit 2 is decided before the lock is taken: SRC == DEST once left DEST/.stage-archive.lock
    in SRC, which the next archive of SRC then moved as data."""
    src, dest = tree["src"], tree["dest"]
    listing = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    for args in [(src, src), (src, src / "receipts"), (src, dest / "missing"), (tmp_path / "nope", dest),
                 (src / "engram-l1-r0of2.bin", src / "engram-l1-r0of2.bin", dest)]:
        result = run_stage("archive", *args)
        assert result.code == 2, (args, result.stdout + result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == listing
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0 and result.json["moved_files"] == len(tree["files"])
    assert not (dest / "tp2" / ".stage-archive.lock").exists()


# ---------------------------------------------------------------- records


@pytest.mark.parametrize("record", ["DEST/.stage-archive.lock", "DEST/SHA256SUMS", "DEST/archive.jsonl",
                                    "SRC/MOVED.txt", "SRC/SHA256SUMS"])
def test_a_record_planted_as_a_symlink_is_never_written_through(tree, tmp_path, record):
    """Exit 3 before anything moves, the link's target unchanged and never copied into a record.
    MOVED.txt was read through such a link and its target's bytes written into the new MOVED.txt."""
    src, dest = tree["src"], tree["dest"]
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's secret, not a record\n")
    where, name = record.split("/")
    os.symlink(victim, (dest if where == "DEST" else src) / name)
    before = {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    result = run_stage("archive", src, dest)
    assert result.code == 3, result.stdout + result.stderr
    assert str((dest if where == "DEST" else src) / name) in result.stderr and "symlink" in result.stderr
    assert victim.read_bytes() == b"root's secret, not a record\n"
    assert {p: sha256_file(p) for p in src.rglob("*") if p.is_file() and not p.is_symlink()} == before
    assert not (dest / "tp2").exists()
    assert all(b"secret" not in p.read_bytes() for p in (*src.rglob("*"), *dest.rglob("*"))
               if p.is_file() and not p.is_symlink())


def test_empty_directories_and_earlier_records_stay(tmp_path):
    """Only what this run emptied is removed; a MOVED.txt from an earlier archive of a subdirectory
    is a record, never data (it was moved to DEST, and its directory with it)."""
    src = tmp_path / "old"
    (src / "was-empty").mkdir(parents=True)
    (src / "deep" / "also-empty").mkdir(parents=True)
    sub = write(src / "sub" / "first.bin", b"archived first\n")
    (tmp_path / "first").mkdir()
    assert run_stage("archive", src / "sub", tmp_path / "first").code == 0
    earlier = (src / "sub" / "MOVED.txt").read_bytes()
    later = write(src / "deep" / "later.bin", b"archived later\n")
    dest = tmp_path / "archive"
    dest.mkdir()
    result = run_stage("archive", src, dest, "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert [f["dest"] for f in result.json["files"]] == [str(dest / "old" / "deep" / "later.bin")]
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*")) == [
        "MOVED.txt", "deep", "deep/also-empty", "sub", "sub/MOVED.txt", "was-empty"]
    assert (src / "sub" / "MOVED.txt").read_bytes() == earlier
    assert sha256_file(tmp_path / "first" / "sub" / "first.bin") == sub
    assert sha256_file(dest / "old" / "deep" / "later.bin") == later
    sha256sum_check(dest)


def test_sums_are_written_once_per_run_not_once_per_file(tmp_path, monkeypatch):
    """SHA256SUMS was rewritten after every file: quadratic, 23 s for 2,000 shards. Counted on the
    real function, in-process; the bytes are then checked by sha256sum -c."""
    from stager.housekeeping import archive as core

    written = []
    real = core.update_sums
    monkeypatch.setattr(core, "update_sums", lambda path, entries: (written.append(len(entries)),
                                                                    real(path, entries))[1])
    src = tmp_path / "tp2"
    sums = {f"engram-l{i}-r0of2.bin": write(src / f"engram-l{i}-r0of2.bin", os.urandom(100 + i)) for i in range(300)}
    dest = tmp_path / "archive"
    dest.mkdir()
    report = core.archive([str(src)], str(dest))
    assert not report.problems and len(report.moved) == 300
    assert written == [300]
    assert read_sums(dest / "SHA256SUMS") == {f"tp2/{n}": s for n, s in sums.items()}
    sha256sum_check(dest)
    [block] = parse_moved((src / "MOVED.txt").read_text())
    assert {n: e[0] for n, e in block["entries"].items()} == sums
    assert sorted(p.name for p in src.iterdir()) == ["MOVED.txt"]


# ---------------------------------------------------------------- output


def test_every_printed_line_is_one_line(tmp_path):
    """Newlines in DEST's name, SRC's name and a file's name are printed escaped: the summary, the
    same-filesystem note, the skipped link and an error each stay one line."""
    src = tmp_path / "old\nshards"
    expected = write(src / "a\nb.bin", b"odd name\n")
    os.symlink("/etc/hostname", src / "link\nout")
    dest = tmp_path / "arch\nive"
    dest.mkdir()
    result = run_stage("archive", src, dest)
    assert result.code == 0, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert [line.split()[0] for line in lines] == ["archive:", "note:", "symlink"], lines
    assert all("\\n" in line for line in lines)
    assert sha256_file(dest / "old\nshards" / "a\nb.bin") == expected
    [block] = parse_moved((src / "MOVED.txt").read_text())  # a newline in DEST's path stays in its value
    assert (block["destination"], block["sums"], block["files"]) == (str(dest / "old\nshards"),
                                                                     str(dest / "SHA256SUMS"), "1")
    refused = run_stage("archive", dest, dest)
    assert refused.code == 2 and len((refused.stdout + refused.stderr).strip().splitlines()) == 1


def test_each_batch_writes_its_records_once_and_the_run_converges(tmp_path, monkeypatch):
    """Batches of about BATCH_BYTES (made small here): SHA256SUMS once per batch, one MOVED.txt
    section per batch, every source gone and every byte in DEST."""
    from stager.housekeeping import archive as core

    written = []
    real = core.update_sums
    monkeypatch.setattr(core, "BATCH_BYTES", 1000)
    monkeypatch.setattr(core, "update_sums", lambda path, entries: (written.append(sorted(entries)),
                                                                    real(path, entries))[1])
    src = tmp_path / "tp2"
    sums = {f"sub{i % 2}/f{i}.bin": write(src / f"sub{i % 2}" / f"f{i}.bin", os.urandom(600)) for i in range(7)}
    dest = tmp_path / "archive"
    dest.mkdir()
    report = core.archive([str(src)], str(dest))
    assert not report.problems and len(report.moved) == 7
    assert [len(batch) for batch in written] == [2, 2, 2, 1]
    assert sorted(n for batch in written for n in batch) == sorted(f"tp2/{n}" for n in sums)
    sha256sum_check(dest)
    blocks = parse_moved((src / "MOVED.txt").read_text())
    assert [len(b["entries"]) for b in blocks] == [2, 2, 2, 1]
    assert {n: e[0] for b in blocks for n, e in b["entries"].items()} == sums
    assert sorted(p.name for p in src.iterdir()) == ["MOVED.txt"]
