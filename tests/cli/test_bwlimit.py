"""`--bwlimit RATE`: the grammar (rsync's and rclone's spellings, anything else exit 2 naming the
option), and real copies timed against the rate, the run's parallel readers sharing one bucket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import sha256_file
from hubgen import build_sized_hub
from stager.base.units import parse_rate

BIN = Path(sys.executable).parent
STAGE = [str(BIN / "stage")] if (BIN / "stage").exists() else [sys.executable, "-m", "stager"]
KiB, MiB, GiB = 1024, 1024**2, 1024**3


def stage(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*STAGE, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("text, rate", [
    ("50M", 50 * MiB), ("50m", 50 * MiB), ("50Mi", 50 * MiB), ("50MiB", 50 * MiB),  # rsync and rclone alike
    ("800", 800 * KiB), ("1.5M", int(1.5 * MiB)), ("2G", 2 * GiB), ("1T", 1024 * GiB),  # a bare number: KiB/s
    ("50MB", 50_000_000), ("50mb", 50_000_000), ("1KB", 1000), ("4096B", 4096), ("4096b", 4096),
    (" 10K ", 10 * KiB),
    ("off", None), ("OFF", None), ("0", None), ("0.0", None), ("0M", None),  # no limit, as rclone and rsync
])
def test_accepted_spellings(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", [
    "", "M", "-1M", "50MB/s", "50M/s", "50 M", "10M:1M", "08:00,512k 12:00,10M", "1M+1", "1e6", "nan", "inf",
    "50Mbit", "50MiBs", "1P", "0x10", "100B", "0.1K", str(2**63) + "B",
])
def test_refused_spellings(text):
    with pytest.raises(ValueError) as refused:
        parse_rate(text)
    assert repr(text) in str(refused.value)


@pytest.fixture(scope="module")
def one_weight(tmp_path_factory) -> Path:
    """A NAS of one model whose weights are one 64 MiB file, and node1 that stages it."""
    return build_sized_hub(tmp_path_factory.mktemp("bw-one"), size=64 * MiB, files=1)


@pytest.fixture(scope="module")
def four_weights(tmp_path_factory) -> Path:
    return build_sized_hub(tmp_path_factory.mktemp("bw-four"), size=64 * MiB, files=4)


def mirrored(manifest: Path, *options: str, env: dict | None = None) -> dict:
    """A fresh node hub mirrored with `options`: the JSON report, every weight byte-checked."""
    local = manifest.parent / "nvme"
    shutil.rmtree(local, ignore_errors=True)
    result = stage("mirror", "--node", "node1", "--json", "--manifest", manifest, *options, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    weights = sorted((manifest.parent / "nas" / "hf" / "hub").glob("models--*/snapshots/*/*.safetensors"))
    assert weights
    for weight in weights:
        staged = local / "hf" / "hub" / weight.relative_to(manifest.parent / "nas" / "hf" / "hub")
        assert sha256_file(staged) == sha256_file(weight)
    return report


def test_a_copy_takes_its_size_over_the_rate(one_weight):
    """64 MiB at 16 MiB/s: 4 s, within 10 %. What else the run reads of the NAS (the file's samples
    before its rename, 2 MiB) is counted too, and the bucket's two pieces come free at the start."""
    report = mirrored(one_weight, "--bwlimit", "16M")
    assert report["copied_bytes"] >= 64 * MiB
    assert 3.6 <= report["seconds"] <= 4.4, report["seconds"]
    # The same in rclone's spelling; rsync's decimal MB reads the same file 5 % slower.
    assert 3.6 <= mirrored(one_weight, "--bwlimit", "16Mi")["seconds"] <= 4.4
    decimal = mirrored(one_weight, "--bwlimit", "16MB")["seconds"]
    assert 3.6 * MiB / 1e6 <= decimal <= 4.4 * MiB / 1e6, decimal


def test_parallel_copies_share_the_rate(four_weights):
    """Four weights copied at once (-j 4) take the rate together, not each: per-reader buckets
    would land 64 MiB at 16 MiB/s in about a second."""
    report = mirrored(four_weights, "--bwlimit", "16M", "--jobs", "4")
    assert report["copied_files"] >= 4
    # 64 MiB of weights plus 2 MiB of samples per weight: 72 MiB at 16 MiB/s.
    assert 3.6 <= report["seconds"] <= 72 / 16 * 1.1, report["seconds"]


def test_an_sftp_source_is_read_at_the_rate(one_weight, sshd):
    """The NAS over SSH: what sftp-server read from the hub's files (its own log), at 16 MiB/s."""
    nas = one_weight.parent / "nas" / "hf" / "hub"
    manifest = one_weight.parent / "over-ssh.toml"
    manifest.write_text(one_weight.read_text().replace(f'hub = "{nas}"', f'hub = "{sshd.url(nas)}"'))
    before = sshd.bytes_read(nas)
    report = mirrored(manifest, "--bwlimit", "16M", env=sshd.env)
    read = sshd.bytes_read(nas) - before
    assert report["source"] == sshd.url(nas) and read >= 64 * MiB
    # The bucket's first two pieces come at once; the SSH handshake takes its time beside the rate.
    assert 0.9 * read / (16 * MiB) <= report["seconds"] <= 1.1 * read / (16 * MiB) + 1.0, (report["seconds"], read)


@pytest.mark.parametrize("off", ["off", "0"])
def test_no_limit(one_weight, off):
    assert mirrored(one_weight, "--bwlimit", off)["seconds"] < 2.0


@pytest.mark.parametrize("value", ["50MB/s", "10M:1M", "-5M", "fast", "100B"])
def test_a_bad_rate_is_exit_2_naming_the_option(one_weight, value):
    local = one_weight.parent / "nvme"
    shutil.rmtree(local, ignore_errors=True)
    for json_flag in ((), ("--json",)):
        result = stage("mirror", "--node", "node1", "--bwlimit", value, *json_flag, "--manifest", one_weight)
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "'--bwlimit'" in errors[0] and repr(value) in errors[0], result.stderr
        if json_flag:
            assert json.loads(result.stdout)["exit_code"] == 2
    assert not local.exists()
