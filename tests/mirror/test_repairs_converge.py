"""A printed repair repairs: every `repair:` line, pasted as printed (shlex-split and run), converges
(the check that printed it passes afterwards), also for damage a sampled check cannot see. Each
case ends in bytes: `sha256sum -c SHA256SUMS` for shards, sha256 against the NAS for blobs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import INSTALLED_STAGE, run_stage, sha256_file
from hubgen import build_demo
from stager.engram.shard_format import HEADER_BYTES, ROW_BYTES
from stager.mirror.fingerprint import HEAD_BYTES, safetensors_head, sample_spans


@pytest.fixture
def demo(tmp_path: Path) -> dict:
    manifest = build_demo(tmp_path / "demo")
    root = manifest.parent
    staged = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert staged.code == 0, staged.stdout + staged.stderr
    packed = run_stage("pack-engram", "--node", "dgx1", "--manifest", manifest)
    assert packed.code == 0, packed.stdout + packed.stderr
    return {"manifest": manifest, "nas": root / "nas" / "hf" / "hub", "hub": root / "nvme" / "hf" / "hub",
            "engram": root / "nvme" / "engram"}


def printed_repairs(stdout: str) -> list[str]:
    return re.findall(r"^repair: (.*)$", stdout, flags=re.M)


def run_as_printed(command: str) -> subprocess.CompletedProcess:
    """The repair line as an operator pastes it: split by the shell's rules, `stage` the installed one."""
    argv = shlex.split(command)
    assert argv[0] == "stage", command
    return subprocess.run([*INSTALLED_STAGE, *argv[1:]], capture_output=True, text=True, timeout=300)


def sums_check(engram: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=engram, capture_output=True, text=True)


def damage_row(shard: Path, row_index: int) -> None:
    """Flip the bytes of one row in place (the file's size, header and name unchanged)."""
    with open(shard, "r+b") as handle:
        offset = HEADER_BYTES + row_index * ROW_BYTES
        handle.seek(offset)
        row = handle.read(ROW_BYTES)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in row))


def test_verify_full_prints_the_pack_engram_that_repairs_an_unsampled_row(demo):
    """One bad row in the middle of a shard, with nothing else to show for it: its receipt written
    after the damage, as if the disk had rotted the row (a sampled check picks 66 of ~1,668 rows).
    verify --full finds it; the printed repair re-derives every row, and the shard passes
    `sha256sum -c` again (the repair it printed before called the shard "up to date", exit 0)."""
    engram = demo["engram"]
    shard = engram / "engram-l14-r0of3.bin"
    damage_row(shard, 777)
    os.utime(shard.with_suffix(".json"))  # the receipt is no older than the damage
    assert sums_check(engram).returncode == 1
    broken = run_stage("verify", "--node", "dgx1", "--full", "--manifest", demo["manifest"])
    assert broken.code == 1 and "differs from a full re-derivation" in broken.stdout, broken.stdout
    repairs = printed_repairs(broken.stdout)
    assert repairs == [f"stage pack-engram --node dgx1 --rank 0 --full --manifest {demo['manifest']}"]
    for command in repairs:
        ran = run_as_printed(command)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert re.search(r"^packed .*engram-l14-r0of3\.bin", ran.stdout, re.M), ran.stdout
    assert sums_check(engram).returncode == 0
    again = run_stage("verify", "--node", "dgx1", "--full", "--manifest", demo["manifest"])
    assert again.code == 0 and printed_repairs(again.stdout) == [], again.stdout


def test_a_shard_changed_after_its_receipt_is_never_up_to_date(demo):
    """A row written over after packing: even a sampled pack-engram, whose rows miss it, sees that
    the shard's sha256 is no longer SHA256SUMS's and repacks it. The pack's seed is its own: in
    about 1 run in 26 its 66 rows of ~1,668 include the damaged one, which then says so first."""
    engram = demo["engram"]
    shard = engram / "engram-l1-r0of3.bin"
    damage_row(shard, 901)
    packed = run_stage("pack-engram", "--node", "dgx1", "--json", "--manifest", demo["manifest"])
    assert packed.code == 0, packed.stdout + packed.stderr
    verdicts = {Path(s["path"]).name: (s["skipped"], s["reason"]) for s in packed.json["shards"]}
    skipped, reason = verdicts["engram-l1-r0of3.bin"]
    assert not skipped, verdicts
    assert "sha256" in reason and "changed after it was packed" in reason \
        or reason == "row 901 differs from the source", verdicts
    assert all(skip for name, (skip, _) in verdicts.items() if name != "engram-l1-r0of3.bin"), verdicts
    assert sums_check(engram).returncode == 0


def interior_span(path: Path, seed: int) -> tuple[int, int]:
    """One of the regions a sampled check with `seed` reads, away from the head and tail that every
    seed reads: damage there is seen by this seed and, most likely, by no other."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = safetensors_head(handle.read(9), size)
    spans = sample_spans(size, seed, max(head, HEAD_BYTES))
    return spans[1]


def test_verify_prints_the_mirror_that_repairs_what_its_sample_saw(demo):
    """A sampled verify sees 4 KiB of damage inside a 4 MiB weight; its printed repair re-checks
    with the same seed, re-copies the file, and the blob hashes as the NAS's again (a repair with a
    fresh seed sampled other regions, called the file matching and copied nothing)."""
    weight = next(demo["hub"].glob("models--acme--Flash-3bpw/snapshots/*/model-00003-of-00003.safetensors"))
    nas_weight = demo["nas"] / weight.relative_to(demo["hub"])
    blob = Path(os.path.realpath(weight))
    seed = 4242
    offset, _length = interior_span(blob, seed)
    with open(blob, "r+b") as handle:
        handle.seek(offset)
        handle.write(os.urandom(4096))
    assert sha256_file(blob) != sha256_file(nas_weight)
    broken = run_stage("verify", "--node", "dgx1", "--seed", seed, "--manifest", demo["manifest"])
    assert broken.code == 1, broken.stdout
    repairs = printed_repairs(broken.stdout)
    assert repairs == [f"stage mirror --node dgx1 --seed {seed} --manifest {demo['manifest']}"]
    for command in repairs:
        ran = run_as_printed(command)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    assert sha256_file(Path(os.path.realpath(weight))) == sha256_file(nas_weight)
    again = run_stage("verify", "--node", "dgx1", "--seed", seed, "--manifest", demo["manifest"])
    assert again.code == 0 and printed_repairs(again.stdout) == [], again.stdout
