"""Checkpoint geometry (stager/engram/checkpoint.py and stager/mirror/safetensors_header.py): what is read
from a checkpoint before any row, and every way a checkpoint that cannot be packed is refused.

Refusals are one line, exit 2, naming the file and the tensor (or the manifest key), and leave
nothing written. The NAS is hashed before and after where pack-engram reads it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from engram_fixtures import (FLASH, W1, build, corrupt, engram_header, pack, parse_shard, reference, rewrite_index,
                             with_header)

@pytest.mark.parametrize("data,message", [
    (struct.pack("<Q", 2 ** 63) + b"{}", "header length 9223372036854775808 is impossible"),
    (b"\x10\x00\x00", "truncated safetensors header"),
    (struct.pack("<Q", 64) + b'{"a": 1', "header length 64 is impossible for a 15-byte file"),
    (with_header([1, 2, 3], 0), "safetensors header is a JSON list, expected an object"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"data_offsets": [0, 10 * 256 + 10**6]}}),
                 10 * 264 * 2), f"tensor {W1}: F8_E4M3 [10, 256] needs 2560 bytes"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"dtype": "F16", "shape": [10, 128]}}),
                 10 * 264 * 2), f"tensor {W1}: dtype F16, expected F8_E4M3"),
    (with_header(engram_header(10, **{W1.replace(".", "__"): {"dtype": "F9"}}), 10 * 264 * 2),
     f"tensor {W1}: unknown dtype 'F9'"),
])
def test_corrupt_safetensors_header_exits_2_naming_the_file_and_tensor(tmp_path, data, message):
    env = build(tmp_path, rows={1: 10, 14: 10})
    corrupt(env, data)
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert message in err, err
    assert "model-engram.safetensors" in err and err.count("\n") == 1
    assert not list(env["dir"].glob("*.bin"))


def test_span_past_eof_names_the_tensor(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    header = engram_header(10)
    corrupt(env, with_header(header, 10 * 264 * 2 - 1))  # the last tensor's span runs one byte past the end
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "tensor model.layers.14.engram.embed.scale: data ends at byte" in err and "past the end" in err


def test_config_layer_ids_are_cross_checked(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    config = env["local"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "config.json"
    target = Path(os.path.realpath(config))
    target.write_text(json.dumps({"engram_layer_ids": [1, 2]}))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "config.json: engram_layer_ids [1, 2] disagree" in err and "[1, 14]" in err


def test_not_staged_exits_3_and_from_nas_reads_the_nas_without_writing_it(tmp_path):
    env = build(tmp_path, stage=False, rows={1: 1_003, 14: 2_011})
    err = pack(env, "--rank", 0, code=3)["stderr"]
    assert f"{FLASH} is not staged on dgx1" in err and "--from-nas" in err
    before = sorted((str(p), p.lstat().st_mtime_ns, p.lstat().st_size) for p in env["nas"].rglob("*"))
    shards = pack(env, "--rank", 0, "--from-nas")["shards"]
    assert sorted((str(p), p.lstat().st_mtime_ns, p.lstat().st_size) for p in env["nas"].rglob("*")) == before
    nas_file = env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / env["info"].file
    for shard in shards:
        _, body = parse_shard(Path(shard["path"]))
        rows = {1: 1_003, 14: 2_011}[shard["layer"]]
        assert body == reference(nas_file, "model.", shard["layer"])[:rows // 3 * 264]
        assert "NAS" in json.loads(Path(shard["path"]).with_suffix(".json").read_text())["packed_from"]


@pytest.mark.parametrize("pattern,named", [("model.safetensors.index.json", "model.safetensors.index.json"),
                                           ("*.json", "model.safetensors.index.json"),
                                           ("model-engram.*", "model-engram.safetensors")])
def test_an_exclude_that_keeps_the_checkpoint_off_the_node_exits_2(tmp_path, pattern, named):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, exclude=[pattern])
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert f'models."{FLASH}".exclude: {pattern!r} keeps {named} off the node' in line, line
    assert "not staged" not in line
    assert not env["dir"].exists()
    # The NAS copy is readable, so --from-nas packs what the exclude keeps off the node.
    shards = pack(env, "--rank", 0, "--from-nas")["shards"]
    assert [parse_shard(Path(s["path"]))[1] for s in shards] == [
        reference(env["nas"] / env["info"].snapshot.dir.relative_to(env["nas"]) / env["info"].file, "model.", layer)
        [:rows // 3 * 264] for layer, rows in ((1, 1_003), (14, 2_011))]


@pytest.mark.parametrize("extra", [[], ["--from-nas"]])
def test_an_index_naming_a_file_the_snapshot_lacks_exits_2(tmp_path, extra):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, stage=False)
    rewrite_index(env, {f"model.layers.14.engram.embed.{part}": "model-00002-of-00002.safetensors"
                        for part in ("weight", "scale")})
    err = pack(env, "--rank", 0, *extra, code=2)["stderr"]
    line, = err.splitlines()
    assert "model.safetensors.index.json: weight_map names model-00002-of-00002.safetensors" in line, line
    assert "which the snapshot does not have" in line and "not staged" not in line
    assert not env["dir"].exists()


def test_a_name_with_a_newline_stays_on_one_line(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, stage=False)
    rewrite_index(env, {f"model.layers.14.engram.embed.{part}": "bad\nname.safetensors"
                        for part in ("weight", "scale")})
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert "weight_map names bad\\nname.safetensors" in line, line


def test_overlapping_data_offsets_exit_2_naming_the_tensor(tmp_path):
    env = build(tmp_path, rows={1: 10, 14: 10})
    w14 = "model.layers.14.engram.embed.weight"
    header = engram_header(10, **{w14.replace(".", "__"): {"data_offsets": [0, 2560]}})  # on top of layer 1's weight
    corrupt(env, with_header(header, 10 * 264 * 2))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert f"model-engram.safetensors: tensor {w14}: data_offsets [0, 2560] overlap tensor {W1}" in line, line
    assert not list(env["dir"].glob("*.bin"))


@pytest.mark.parametrize("case", ["gap", "bytes after the data"])
def test_data_offsets_safetensors_refuses_exit_2(tmp_path, case):
    env = build(tmp_path, rows={1: 10, 14: 10})
    header, data = engram_header(10), 10 * 264 * 2
    s14 = "model.layers.14.engram.embed.scale"
    if case == "gap":
        header[s14]["data_offsets"] = [5280, 5360]  # 80 bytes after layer 14's weight ends at 5200
        data = 5360
        message = f"tensor {s14}: data_offsets [5280, 5360] leave a gap of 80 bytes after tensor"
    else:
        data += 8
        message = "8 bytes after the tensor data"
    corrupt(env, with_header(header, data))
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert message in line and "model-engram.safetensors" in line, line
    assert not list(env["dir"].glob("*.bin"))


@pytest.mark.parametrize("heads,named", [
    ('{"1": [500, 503], "01": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'01': layer 1 is also given as '1'"),
    ('{"1": [500, 503], "1": [501, 502], "14": [1000, 1011]}', "engram_head_rows.1: the key appears twice"),
    ('{"\\u0661": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'\u0661': not a layer number"),
    ('{"1.0": [500, 503], "14": [1000, 1011]}', "engram_head_rows.'1.0': not a layer number"),
])
def test_engram_head_rows_keys_must_be_layer_numbers_once(tmp_path, heads, named):
    env = build(tmp_path, rows={1: 1_003, 14: 2_011}, layout="heads")
    config = env["local"] / env["info"].snapshot.dir.relative_to(env["nas"]) / "config.json"
    target = Path(os.path.realpath(config))
    os.chmod(target, 0o644)
    target.write_text('{"engram_layer_ids": [1, 14], "engram_head_rows": ' + heads + "}")
    err = pack(env, "--rank", 0, code=2)["stderr"]
    line, = err.splitlines()
    assert "config.json: " + named in line, line
    assert not env["dir"].exists()
