"""The manifest means one thing: wrong types, fractional bytes, duplicates and NUL bytes exit 2,
naming the file and every offending key on one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_stage

BASE = '''[nas]
hub = "/mnt/nas/hf/hub"

[models."acme/Flash"]
revision = "main"

[nodes.dgx1]
hub = "/nvme/hf/hub"
models = ["acme/Flash"]
'''


def stage_with(tmp_path: Path, text: str, *args: str):
    manifest = tmp_path / "cluster.toml"
    manifest.write_text(text)
    return manifest, run_stage(*(args or ("mirror", "--node", "dgx1", "--dry-run")), "--manifest", manifest)


@pytest.mark.parametrize("line, key", [
    ("reserve = 1.5", "nodes.dgx1.reserve"),          # once silently 1 byte
    ('reserve = "1.5"', "nodes.dgx1.reserve"),        # a fractional byte count
    ('reserve = "20 parsecs"', "nodes.dgx1.reserve"),
    ("reserve = true", "nodes.dgx1.reserve"),
    ('rank = "2"', "nodes.dgx1.rank"),                 # a count given as a string
])
def test_a_value_of_the_wrong_kind_exits_2_naming_the_key(tmp_path, line, key):
    manifest, result = stage_with(tmp_path, BASE.replace('models = ["acme/Flash"]', f'models = ["acme/Flash"]\n{line}'))
    assert result.code == 2, result.stderr
    assert f"{manifest}: " in result.stderr and key in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_world_as_a_string_exits_2(tmp_path):
    text = BASE + '\n[engram]\nmodel = "acme/Flash"\nworld = "3"\n'
    _, result = stage_with(tmp_path, text)
    assert result.code == 2 and "engram.world" in result.stderr


@pytest.mark.parametrize("reserve, expected", [("1048576", 1048576), ('"20GiB"', 20 * 1024**3), ('"500MB"', 500 * 1000**2)])
def test_a_bare_integer_is_bytes_and_units_mean_what_df_means(reserve, expected):
    from stager.manifest import read_manifest
    import tomllib

    manifest = read_manifest(tomllib.loads(f'nas.hub = "/nas"\n[nodes.a]\nhub = "/nvme"\nreserve = {reserve}\n'
                                           '[nodes.b]\nhub = "/nvme"\n'), "cluster.toml")
    assert manifest.nodes["a"].reserve == expected
    assert manifest.nodes["b"].reserve == 0  # the documented default


def test_a_model_listed_twice_for_a_node_exits_2(tmp_path):
    _, result = stage_with(tmp_path, BASE.replace('models = ["acme/Flash"]', 'models = ["acme/Flash", "acme/Flash"]'))
    assert result.code == 2 and "nodes.dgx1.models" in result.stderr and "more than once" in result.stderr


def test_every_problem_is_listed(tmp_path):
    text = BASE.replace('models = ["acme/Flash"]', 'models = ["acme/Flash", "acme/Flash"]\nreserve = 1.5\nexlcude = []')
    _, result = stage_with(tmp_path, text)
    assert result.code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "more)" not in line
    for key in ("nodes.dgx1.models", "nodes.dgx1.reserve", "nodes.dgx1.exlcude"):
        assert key in line, line


@pytest.mark.parametrize("where", ["revision", "hub", "key"])
def test_a_nul_byte_in_a_manifest_string_exits_2(tmp_path, where):
    if where == "revision":
        text = BASE.replace('revision = "main"', 'revision = "ma\\u0000in"')
    elif where == "hub":
        text = BASE.replace('hub = "/nvme/hf/hub"', 'hub = "/nvme/hf\\u0000/hub"')
    else:
        text = BASE.replace('[models."acme/Flash"]', '[models."acme/Fl\\u0000ash"]')
    _, result = stage_with(tmp_path, text)
    assert result.code == 2 and "NUL" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large", "not utf-8"])
def test_a_manifest_that_is_not_a_small_text_file_exits_2_at_once(tmp_path, kind):
    """A FIFO blocked the read forever and /dev/zero filled memory; each is now one line, exit 2."""
    path = tmp_path / "cluster.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "too large":
        path.write_text(BASE + "#" * (1 << 20) + "\n")
    else:
        path.write_bytes(BASE.encode() + b"# \xff\xfe\n")
    result = run_stage("verify", "--node", "dgx1", "--manifest", path, timeout=20)
    assert result.code == 2, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"stage: error: {path}: cannot read manifest: "), line


def test_a_manifest_reached_through_a_symlink_is_read(tmp_path):
    (tmp_path / "real.toml").write_text(BASE)
    (tmp_path / "cluster.toml").symlink_to("real.toml")
    result = run_stage("mirror", "--node", "dgx1", "--dry-run", "--json", "--manifest", tmp_path / "cluster.toml")
    assert "cannot read manifest" not in result.stderr and "not found" not in result.stderr, result.stderr
