"""`stage archive` against live systems: bind mounts, other processes writing the files being
archived, two archives of one directory at once, and an Engram directory that `stage verify` and
`sha256sum -c` must still pass afterwards. Every check ends in the bytes (sha256 of the files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file
from ops_fixtures import MiB
from reliability_support import bind, build_staging, holding
from stager.base.atomic import is_temp_name
from stager.mirror.records import read_sums
from test_archive import parse_moved, sha256sum_check, write, write_big

STAGE = [sys.executable, "-m", "stager"]


def hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def one_error_line(stderr: str, *paths: Path) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    for path in paths:
        assert str(path) in lines[0], (path, lines[0])
    return lines[0]


# ---------------------------------------------------------------- identity: a DEST that is SRC


def test_dest_bind_mount_of_the_source_directory_is_refused(tmp_path):
    """DEST is the source's parent mounted again: every file looked identical to itself, was
    "adopted", and the source, the only copy, was deleted with exit 0."""
    src = tmp_path / "nvme" / "old"
    data = {"a.bin": os.urandom(70_000), "sub/b.bin": os.urandom(5_000)}
    for name, content in data.items():
        write(src / name, content)
    before = hashes(src.parent)
    with bind(src.parent, tmp_path / "archive") as dest:
        result = run_stage("archive", src, dest)
        assert result.code == 2, result.stdout + result.stderr
        one_error_line(result.stderr, src, dest)
        assert not (dest / ".stage-archive.lock").exists()
    assert hashes(src.parent) == before


def test_dest_subdirectory_bind_mounted_onto_the_source_is_refused(tmp_path):
    """DEST/<name of SRC> is SRC itself, mounted there: DEST's own check passes, each file's name
    in DEST is the source file. Refused naming both, with nothing written."""
    src = tmp_path / "nvme" / "tp2"
    expected = write_big(src / "engram-l1-r0of2.bin", 3 * MiB, seed=11)
    dest = tmp_path / "archive"
    with bind(src, dest / "tp2"):
        result = run_stage("archive", src, dest)
        assert result.code == 2, result.stdout + result.stderr
        one_error_line(result.stderr, src / "engram-l1-r0of2.bin", dest / "tp2" / "engram-l1-r0of2.bin")
        assert sorted(p.name for p in dest.iterdir()) == ["tp2"]
    assert sha256_file(src / "engram-l1-r0of2.bin") == expected
    assert sorted(p.name for p in src.iterdir()) == ["engram-l1-r0of2.bin"]


def test_dest_on_the_nas_is_refused_however_spelled(tmp_path):
    """With a manifest (--manifest, or $STAGE_MANIFEST), DEST must not be, or lie in, nas.hub or an
    alias target: reached through a bind mount, a symlink, or `..` after a link."""
    staging = build_staging(tmp_path, shards=1, shard_bytes=4096)
    alias_target = tmp_path / "nas-alias" / "hub"
    alias_target.mkdir(parents=True)
    staging.manifest.write_text(staging.manifest.read_text().replace(
        f'hub = "{staging.nas}"\n', f'hub = "{staging.nas}"\naliases = {{ "/volume1/hub" = "{alias_target}" }}\n', 1))
    src = tmp_path / "old"
    expected = write(src / "a.bin", b"keep me\n")
    nas_before = hashes(staging.nas)
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(alias_target, links / "to-alias")
    os.symlink(staging.nas / "models--acme--Weights", links / "into-nas")
    by_env = {"STAGE_MANIFEST": str(staging.manifest)}
    with bind(staging.nas, tmp_path / "nas-again") as nas_again:
        cases = [(nas_again / "models--acme--Weights", staging.nas, ["--manifest", str(staging.manifest)], None),
                 (links / "to-alias", alias_target, [], by_env),
                 (links / "into-nas" / "blobs" / "..", staging.nas, [], by_env)]
        for dest, named, options, env in cases:
            result = run_stage("archive", src, dest, *options, env=env)
            assert result.code == 2, (dest, result.stdout + result.stderr)
            assert str(named) in one_error_line(result.stderr), dest
    assert hashes(staging.nas) == nas_before
    assert sha256_file(src / "a.bin") == expected and not (src / "MOVED.txt").exists()
    assert list(alias_target.iterdir()) == []


# ---------------------------------------------------------------- a file still being written


def test_a_log_being_appended_to_is_not_archived(tmp_path):
    """Another process appends 40 lines with its file open: the archive of its directory once kept
    the first 12, deleted the source, exit 0. Now: in_use, exit 1, every line kept. The writer
    holds its file open from before the run until after it, whatever the machine's speed."""
    src = tmp_path / "logs"
    dest = tmp_path / "archive"
    src.mkdir()
    dest.mkdir()
    quiet = write(src / "old.log", b"finished long ago\n")
    lines = [f"line {i:02d} of the log\n".encode() for i in range(40)]
    go_on = tmp_path / "go-on"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "with open(sys.argv[1], 'ab', buffering=0) as log:\n"
        "    for i in range(40):\n"
        "        log.write(f'line {i:02d} of the log\\n'.encode()); time.sleep(0.01)\n"
        "        while i == 19 and not os.path.exists(sys.argv[2]):\n"
        "            time.sleep(0.01)\n"), str(src / "app.log"), str(go_on)])
    try:
        deadline = time.monotonic() + 30
        while not (src / "app.log").exists() or (src / "app.log").stat().st_size < len(b"".join(lines[:20])):
            assert time.monotonic() < deadline and writer.poll() is None, "the writer did not start"
            time.sleep(0.005)
        result = run_stage("archive", src, dest, "--json")
    finally:
        go_on.touch()
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert result.code == 1, result.stdout + result.stderr
    [problem] = result.json["problems"]
    assert problem["kind"] == "in_use" and problem["path"] == str(src / "app.log")
    assert f"pid {writer.pid}" in problem["detail"]
    assert (src / "app.log").read_bytes() == b"".join(lines)
    assert not (dest / "logs" / "app.log").exists()
    # The quiet file beside it moved as usual.
    assert sha256_file(dest / "logs" / "old.log") == quiet and not (src / "old.log").exists()
    sha256sum_check(dest)


def test_a_file_rewritten_in_place_during_the_copy_is_kept(tmp_path):
    """A writer changes bytes in place while the copy runs and puts the mtime back (as `touch -r`
    or rsync --inplace do): size and mtime agree, only ctime tells. The source must survive with
    its new bytes, and DEST must hold no copy under the final name."""
    src = tmp_path / "old"
    dest = tmp_path / "archive"
    dest.mkdir()
    big = src / "big.bin"
    write_big(big, 160 * MiB, seed=21)
    command = [*STAGE, "archive", str(src), str(dest), "--json"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(is_temp_name(p.name) for p in (dest / "old").glob("*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    st = os.stat(big)
    with open(big, "r+b") as handle:  # opened only now: not open for writing when the run began
        handle.seek(0)
        handle.write(b"REWRITTEN")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    expected = sha256_file(big)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout + stderr
    report = json.loads(stdout)
    assert [p["kind"] for p in report["problems"]] in (["changed"], ["in_use"])
    assert sha256_file(big) == expected
    assert not (dest / "old" / "big.bin").exists()
    assert "old/big.bin" not in read_sums(dest / "SHA256SUMS")
    assert not [p for p in dest.rglob("*") if is_temp_name(p.name)]


# ---------------------------------------------------------------- records stay true


def test_two_archives_of_one_directory_at_once_keep_both_moved_sections(tmp_path):
    """Two runs into two DESTs (two locks) record in one SRC directory's MOVED.txt at the same
    time. Rewriting it from a copy read earlier dropped the other run's section."""
    src = tmp_path / "nvme" / "old"
    sums = {}
    for tag, seed in (("a", 31), ("b", 32)):
        sums[f"{tag}1.bin"] = write(src / f"{tag}1.bin", f"small {tag}\n".encode())
        sums[f"{tag}2.bin"] = write_big(src / f"{tag}2.bin", 48 * MiB, seed=seed)
        sums[f"{tag}3.bin"] = write(src / f"{tag}3.bin", f"last {tag}\n".encode())
    runs = []
    for tag in "ab":
        dest = tmp_path / f"archive-{tag}"
        dest.mkdir()
        runs.append(subprocess.Popen([*STAGE, "archive", *(str(src / f"{tag}{i}.bin") for i in (1, 2, 3)),
                                      str(dest)], stderr=subprocess.PIPE, text=True))
    for run in runs:
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
    blocks = parse_moved((src / "MOVED.txt").read_text())
    listed = {name: entry[0] for block in blocks for name, entry in block["entries"].items()}
    assert listed == sums
    assert {block["destination"] for block in blocks} == {str(tmp_path / "archive-a"), str(tmp_path / "archive-b")}
    for tag in "ab":
        for i in (1, 2, 3):
            assert sha256_file(tmp_path / f"archive-{tag}" / f"{tag}{i}.bin") == sums[f"{tag}{i}.bin"]
        sha256sum_check(tmp_path / f"archive-{tag}")


def _record_one_section(directory: Path, tag: str, gate: Path) -> None:
    """One archive's recording step, in its own process: released with the other by `gate`."""
    from stager.mirror.records import SUMS_NAME, drop_from_sums, moved_block, moved_record
    while not gate.exists():
        pass
    block = moved_block(destination=f"/archive-{tag}", sums=f"/archive-{tag}/SHA256SUMS", host="h", time="t",
                        files=[("0" * 64, 1, f"{tag}.bin", "copied")])
    with moved_record(directory / "MOVED.txt") as append:
        append(block)
        drop_from_sums(directory / SUMS_NAME, {str(directory / f"{tag}.bin")})


def test_two_runs_recording_in_one_directory_at_the_same_instant_keep_both_sections(tmp_path):
    """The two-archives race at the instant it bites, repeated: two processes released together
    each add a section to a new MOVED.txt and drop their own line from the SHA256SUMS beside it.
    Both once read the empty file and wrote the header, running the sections into one; and a
    SHA256SUMS rewritten from a copy read before the other run's rewrite brought its line back."""
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    for round_ in range(40):
        directory = tmp_path / f"r{round_}"
        directory.mkdir()
        (directory / "SHA256SUMS").write_text(f"{'1' * 64}  a.bin\n{'2' * 64}  b.bin\n{'3' * 64}  kept.bin\n")
        gate = directory / "go"
        workers = [fork.Process(target=_record_one_section, args=(directory, tag, gate)) for tag in "ab"]
        for worker in workers:
            worker.start()
        gate.touch()
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0
        blocks = parse_moved((directory / "MOVED.txt").read_text())
        assert sorted(block["destination"] for block in blocks) == ["/archive-a", "/archive-b"], round_
        assert [list(block["entries"]) for block in blocks] in ([["a.bin"], ["b.bin"]], [["b.bin"], ["a.bin"]])
        assert read_sums(directory / "SHA256SUMS") == {"kept.bin": "3" * 64}, round_


def test_archived_tp2_shards_leave_the_engram_directory_verifiable(tmp_path):
    """Old TP2 shards archived out of an engram_dir that also holds the TP3 shards: the directory's
    SHA256SUMS still passes `sha256sum -c` (two "FAILED open or read" before), `stage verify`
    passes, and each receipt went with its shard."""
    staging = build_staging(tmp_path, shards=1, shard_bytes=4096, engram={1: 4_001, 14: 3_001})
    assert staging.mirror().code == 0
    for args in ((), ("--world", "2")):
        packed = staging.stage("pack-engram", "--json", *args)
        assert packed.code == 0, packed.stderr
    engram = staging.engram_dir
    tp2 = sorted(p for p in engram.iterdir() if p.name.endswith("of2.bin"))
    assert len(tp2) == 4
    tp3_before = {n: h for n, h in hashes(engram).items() if "of3" in n}
    tp2_sums = {p.name: sha256_file(p) for p in tp2} | {p.with_suffix(".json").name: sha256_file(p.with_suffix(".json"))
                                                       for p in tp2}
    dest = tmp_path / "archive"
    dest.mkdir()
    result = run_stage("archive", *tp2, dest, "--json")
    assert result.code == 0, result.stdout + result.stderr
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=engram, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == len(tp3_before) // 2  # one line per TP3 shard, none for receipts
    verify = staging.stage("verify", "--full", "--json")
    assert verify.code == 0, verify.stdout + verify.stderr
    assert {n: h for n, h in hashes(engram).items() if "of3" in n} == tp3_before
    assert not [p for p in engram.iterdir() if "of2" in p.name]
    assert {n: h for n, h in hashes(dest).items() if n.startswith("engram-")} == tp2_sums
    assert read_sums(dest / "SHA256SUMS") == tp2_sums
    sha256sum_check(dest)


# ---------------------------------------------------------------- archive beside pack-engram


def packed_tp2_and_tp3(tmp_path: Path):
    staging = build_staging(tmp_path, shards=1, shard_bytes=4096, engram={1: 4_001, 14: 3_001})
    assert staging.mirror().code == 0
    for args in (("--world", "2"), ()):
        packed = staging.stage("pack-engram", "--json", *args)
        assert packed.code == 0, packed.stderr
    return staging


def test_archive_refuses_while_pack_engram_holds_the_engram_directory(tmp_path):
    """archive rewrites an engram_dir's SHA256SUMS, as pack-engram does; it held only DEST's lock,
    so a pack finishing meanwhile could lose its edit. It takes pack-engram's lock too."""
    staging = packed_tp2_and_tp3(tmp_path)
    engram = staging.engram_dir
    data = lambda: {n: h for n, h in hashes(engram).items() if not n.startswith(".locks/")}  # noqa: E731
    before = data()
    tp2 = sorted(p for p in engram.iterdir() if p.name.endswith("of2.bin"))
    dest = tmp_path / "archive"
    dest.mkdir()
    lock = engram / ".locks" / "engram.lock"
    with holding(lock) as holder:
        refused = run_stage("archive", *tp2, dest)
    assert refused.code == 3, refused.stdout + refused.stderr
    line = one_error_line(refused.stderr, lock)
    assert f"locked by another stage process (pid {holder.pid})" in line
    assert data() == before
    assert [p.name for p in dest.iterdir() if p.name != ".stage-archive.lock"] == []


def test_archiving_a_whole_engram_directory_leaves_its_lock_in_place(tmp_path):
    """The lock file is how pack-engram keeps a second writer out; archived and deleted, the next
    pack-engram and a run still holding the old file would both hold "the" lock."""
    staging = packed_tp2_and_tp3(tmp_path)
    engram = staging.engram_dir
    shards = {n: h for n, h in hashes(engram).items() if n.startswith("engram-")}
    dest = tmp_path / "archive"
    dest.mkdir()
    result = run_stage("archive", engram, dest, "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert (engram / ".locks" / "engram.lock").is_file()
    assert not (dest / engram.name / ".locks").exists()
    assert {n.split("/", 1)[1]: h for n, h in hashes(dest).items() if "/engram-" in n} == shards
    sha256sum_check(dest)


def test_archive_and_pack_engram_at_once_leave_sha256sums_true(tmp_path):
    """Real processes: TP2 shards archived while pack-engram rewrites a TP3 shard in the same
    directory. Each either finishes or refuses (exit 3), and afterwards the directory's SHA256SUMS
    lists exactly the shards it holds, by their bytes."""
    staging = packed_tp2_and_tp3(tmp_path)
    engram = staging.engram_dir
    for round_ in range(3):
        if round_:
            assert staging.stage("pack-engram", "--world", "2").code == 0
        tp2 = sorted(str(p) for p in engram.iterdir() if p.name.endswith("of2.bin"))
        assert tp2
        next(engram.glob("engram-l1-r0of3.bin")).unlink()  # pack-engram has a shard to write again
        dest = tmp_path / f"archive-{round_}"
        dest.mkdir()
        env = {**os.environ, "STAGE_MANIFEST": str(staging.manifest)}
        runs = [subprocess.Popen([*STAGE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for args in (["pack-engram", "--node", "dgx1"], ["archive", *tp2, str(dest)])]
        for run in runs:
            out, err = run.communicate(timeout=120)
            assert run.returncode in (0, 3), out + err
            assert run.returncode == 0 or "locked by another stage process" in err, err
        if runs[0].returncode == 3:
            assert staging.stage("pack-engram").code == 0
        sha256sum_check(engram)
        listed = set(read_sums(engram / "SHA256SUMS"))
        assert listed == {p.name for p in engram.iterdir() if p.name.endswith(".bin")}


@pytest.mark.parametrize("command", ["pack-engram", "verify", "archive"])
def test_a_fifo_planted_at_sha256sums_never_hangs_a_run(tmp_path, command):
    """A record's name holding a FIFO blocked the read of every command that rewrites or checks it."""
    staging = packed_tp2_and_tp3(tmp_path)
    engram = staging.engram_dir
    (engram / "SHA256SUMS").unlink()
    os.mkfifo(engram / "SHA256SUMS")
    (engram / "engram-l1-r0of3.bin").unlink()  # pack-engram has a shard to write, and SHA256SUMS to update
    dest = tmp_path / "archive"
    dest.mkdir()
    args = {"pack-engram": ["pack-engram", "--node", "dgx1", "--manifest", staging.manifest],
            "verify": ["verify", "--node", "dgx1", "--manifest", staging.manifest],
            "archive": ["archive", *sorted(engram.glob("*of2.bin")), dest]}[command]
    result = run_stage(*args, timeout=60)
    out = result.stdout + result.stderr
    assert f"{engram / 'SHA256SUMS'}" in out and "not a regular file" in out, out
    assert result.code == (1 if command == "verify" else 3), out
    assert sorted(p.name for p in engram.glob("*of2.bin"))  # nothing archived without its record
