"""Numbers are numbers: every numeric option, environment variable and manifest count refuses NaN,
infinities and out-of-range values with exit 2 and one line naming it, at once (`--wait nan` and
`--wait inf` used to wait for ever on a held lock)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import typer

from conftest import run_stage
from reliability_support import STAGE, build_staging, holding
from stager.cli.app import app

BAD_FLOATS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    staging = build_staging(tmp_path_factory.mktemp("numbers"), shards=1, shard_bytes=4096, engram={0: 8})
    assert staging.mirror().code == 0
    return staging


def _numeric_options():
    """(command path, option name, kind) for every int or float option of every command."""
    root = typer.main.get_command(app)
    found = []

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        for param in command.params:
            desc = getattr(param, "type_descriptor", None)
            annotation = getattr(desc, "annotation", None)
            inner = getattr(annotation, "__args__", (annotation,))
            kind = next((t for t in inner if t in (int, float)), None)
            if kind is not None and not getattr(param, "is_flag", False) and not getattr(param, "count", False):
                found.append((" ".join(path), param.opts[0], kind, desc.parameter_info))

    walk(root, [])
    return found


def test_every_numeric_option_has_a_range():
    """An option without both bounds would take 10**30 workers or a wait of a million years."""
    options = _numeric_options()
    assert {name for _, name, _, _ in options} >= {"--wait", "--jobs", "--seed", "--timeout", "--world", "--rank",
                                                   "--layer"}
    unbounded = [f"{cmd} {name}" for cmd, name, _, info in options if info.min is None or info.max is None]
    assert not unbounded, unbounded


def _cases():
    cases = []
    for cmd, name, kind, info in _numeric_options():
        # Without bounds (the old --seed, --world, --rank, --layer) the out-of-range cases still stand.
        low, high = (-1 if info.min is None else info.min), (10**20 if info.max is None else info.max)
        values = ["nan", "inf", "-inf", str(high * 10 + 1), str(low - 1)] if kind is float else \
            ["nan", "1.5", str(high + 1), str(low - 1), "9" * 30]
        cases += [(cmd, name, value) for value in values]
    return cases


@pytest.mark.parametrize("command, option, value", _cases())
def test_a_bad_number_is_exit_2_naming_the_option(staged, command, option, value):
    """Held lock: an accepted `--wait nan` would wait on it for ever instead of ending."""
    args = [*command.split(), f"{option}={value}", "--manifest", str(staged.manifest)]
    if not command.startswith("fleet "):  # the fleet's commands run on every node: no --node
        args += ["--node", "dgx1"]
    with holding(staged.local / ".locks" / "stager.lock"):
        started = time.monotonic()
        proc = subprocess.run([*STAGE, *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and option in errors[0] and value in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 20


@pytest.mark.parametrize("value", BAD_FLOATS + ["-1", "86401"])
def test_mirror_wait_refuses_what_is_not_a_number_of_seconds(staged, value):
    with holding(staged.local / ".locks" / "stager.lock"):
        result = run_stage("mirror", "--node", "dgx1", "--wait", value, "--json", "--manifest", staged.manifest,
                           timeout=30)
    assert result.code == 2 and result.json["exit_code"] == 2 and "--wait" in result.json["error"], result.stderr


def test_a_finite_wait_in_range_still_waits_and_gives_up(staged):
    with holding(staged.local / ".locks" / "stager.lock"):
        result = run_stage("mirror", "--node", "dgx1", "--wait", "0.5", "--manifest", staged.manifest, timeout=30)
    assert result.code == 3 and "after 0.5 s" in result.stderr, result.stderr


@pytest.mark.parametrize("key, value", [
    ("world", "nan"), ("world", "inf"), ("world", "-inf"), ("world", "3.0"), ("world", "0"), ("world", "4097"),
    ("world", "99999999999999999999"), ("layers", "[nan]"), ("layers", "[4096]"), ("layers", "[-1]"),
    ("reserve", "nan"), ("reserve", "inf"), ("reserve", '"nan"'), ("reserve", '"inf GiB"'),
    ("reserve", '"9999999999 PB"'), ("reserve", "99999999999999999999"), ("rank", "nan"), ("rank", "4096"),
])
def test_a_manifest_number_that_is_not_one_is_exit_2_naming_the_key(staged, tmp_path, key, value):
    text = staged.manifest.read_text()
    table = "engram" if key in ("world", "layers") else "nodes.dgx1"
    lines = [line for line in text.splitlines() if not line.startswith(f"{key} =")]
    at = lines.index(f"[{table}]") + 1
    lines.insert(at, f"{key} = {value}")
    manifest = tmp_path / "bad.toml"
    manifest.write_text("\n".join(lines) + "\n")
    result = run_stage("verify", "--node", "dgx1", "--manifest", manifest, timeout=30)
    assert result.code == 2, result.stdout + result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"stage: error: {manifest}: {table}.{key}"), line


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "1e999", "7200", "soon"])
def test_stage_ssh_timeout_refuses_what_is_not_a_number_of_seconds(staged, tmp_path, value):
    """STAGE_SSH_TIMEOUT=inf became the socket's timeout: a silent peer held the run for ever."""
    result = run_stage("mirror", "--node", "dgx1", "--source", "sftp://127.0.0.1:1/hub", "--manifest", staged.manifest,
                       env={"STAGE_SSH_TIMEOUT": value}, timeout=30)
    assert result.code == 2, result.stdout + result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"stage: error: STAGE_SSH_TIMEOUT={value!r}"), line
