"""NAS states written by huggingface_hub's own client (snapshot_download against tests/hub_mock.py),
not by hand: a clean download, a download killed half-way, a download still running. The node
cache is then read the way an engine reads it: huggingface_hub offline and safetensors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file, write_manifest
from hub_mock import HubMock
from hubgen import random_safetensors

REPO_ID = "acme/Flash-mini"
REPO_DIR = "models--acme--Flash-mini"
MiB = 1024 * 1024
BIG = "model-00002-of-00002.safetensors"


def commit_a() -> dict[str, bytes]:
    index = {"metadata": {}, "weight_map": {"model.layers.0.weight": "model-00001-of-00002.safetensors",
                                            "model.layers.1.weight": BIG}}
    return {
        "config.json": b'{"architectures": ["DeepseekV4ForCausalLM"], "revision": "A"}',
        "generation_config.json": b'{"do_sample": false}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": random_safetensors(1, 2 * MiB),
        BIG: random_safetensors(2, MiB),
        "tokenizer/tokenizer.json": b'{"model": {"type": "BPE"}}',
    }


def commit_b() -> dict[str, bytes]:
    """Shard 1 and the tokenizer unchanged, a new config and a 64 MiB shard 2."""
    files = commit_a()
    files["config.json"] = b'{"architectures": ["DeepseekV4ForCausalLM"], "revision": "B"}'
    files[BIG] = random_safetensors(3, 64 * MiB)
    return files


@pytest.fixture
def hub():
    with HubMock() as mock:
        yield mock


@pytest.fixture
def procs():
    """Every client started by a test; whatever still runs at the end is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def site(tmp_path: Path) -> dict:
    nas, node = tmp_path / "nas" / "hf" / "hub", tmp_path / "nvme" / "hf" / "hub"
    nas.mkdir(parents=True)
    manifest = write_manifest(tmp_path / "cluster.toml", nas, node, {REPO_ID: {}})
    return {"tmp": tmp_path, "nas": nas, "node": node, "manifest": manifest}


def client_env(site: dict, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(HF_HOME=str(site["tmp"] / "hf-home"), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    return env


SNAPSHOT = f"from huggingface_hub import snapshot_download\nsnapshot_download({REPO_ID!r}, revision='main')\n"


def start_download(site: dict, hub: HubMock, procs: list, code: str = SNAPSHOT) -> subprocess.Popen:
    """A huggingface_hub client (by default `snapshot_download(REPO_ID, revision="main")`) writing into
    the NAS hub, in its own process."""
    log = open(site["tmp"] / f"download-{len(procs)}.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            env=client_env(site, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(site["nas"])))
    log.close()
    procs.append(proc)
    return proc


def download(site: dict, hub: HubMock, procs: list) -> None:
    proc = start_download(site, hub, procs)
    assert proc.wait(timeout=60) == 0, (site["tmp"] / f"download-{len(procs) - 1}.log").read_text()


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def partial_big_blob(site: dict, hub: HubMock, commit: str, min_bytes: int = 1) -> Path | None:
    """huggingface_hub's `blobs/<sha256>.<8 hex>.incomplete` of the big shard, once it holds `min_bytes`
    (the client writes in 10 MiB pieces)."""
    sha = hub.files(REPO_ID, commit)[BIG].sha256
    for path in (site["nas"] / REPO_DIR / "blobs").glob(f"{sha}.*.incomplete"):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size >= min_bytes:
                return path
    return None


def kill_half_way(site: dict, hub: HubMock, procs: list, commit: str, code: str = SNAPSHOT) -> Path:
    """Start a throttled download of `commit` (main on the mock) and kill -9 it while the big shard is
    half-way; returns the partial blob it left."""
    hub.throttle[BIG] = 8 * MiB  # 64 MiB takes 8 s
    proc = start_download(site, hub, procs, code)
    partial = wait_for(lambda: partial_big_blob(site, hub, commit), 30, "the big shard's .incomplete blob")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    hub.throttle.clear()
    assert 0 < partial.stat().st_size < len(hub.files(REPO_ID, commit)[BIG].data)
    return partial


def nas_missing(site: dict, hub: HubMock, commit: str) -> list[str]:
    snap = site["nas"] / REPO_DIR / "snapshots" / commit
    return sorted(p for p in hub.files(REPO_ID, commit) if not (snap / p).is_file())


def mirror(site: dict, *extra: str):
    result = run_stage("mirror", "--node", "dgx1", "--manifest", site["manifest"], "--json", *extra, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def verify_full(site: dict):
    result = run_stage("verify", "--node", "dgx1", "--manifest", site["manifest"], "--full", "--json", timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def node_ref(site: dict) -> str | None:
    ref = site["node"] / REPO_DIR / "refs" / "main"
    return ref.read_text() if ref.exists() else None


def tensor_digests(data: bytes) -> dict[str, str]:
    """sha256 of each tensor's bytes, read from the safetensors file the mock serves."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    return {name: hashlib.sha256(body[t["data_offsets"][0]:t["data_offsets"][1]]).hexdigest()
            for name, t in header.items() if name != "__metadata__"}


LOADER = r"""
import hashlib, json, os, sys
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open
repo, cache = sys.argv[1], sys.argv[2]
root = snapshot_download(repo, revision="main", cache_dir=cache)
out = {"snapshot": root, "files": {}, "tensors": {}}
for d, _, names in os.walk(root):
    for n in names:
        rel = os.path.relpath(os.path.join(d, n), root)
        path = hf_hub_download(repo, rel, revision="main", cache_dir=cache)
        with open(path, "rb") as f:
            out["files"][rel] = {"sha256": hashlib.sha256(f.read()).hexdigest(), "real": os.path.realpath(path)}
        if rel.endswith(".safetensors"):
            with safe_open(path, framework="numpy") as st:
                out["tensors"][rel] = {k: hashlib.sha256(st.get_tensor(k).tobytes()).hexdigest() for k in st.keys()}
print(json.dumps(out))
"""


def assert_node_serves(site: dict, hub: HubMock, commit: str) -> None:
    """The node cache, on its own: every file of `commit` byte-exact through relative links that stay
    in the node hub, and huggingface_hub (offline) plus safetensors load exactly those bytes."""
    node = site["node"].resolve()
    assert node_ref(site) == commit
    files = hub.files(REPO_ID, commit)
    snap = node / REPO_DIR / "snapshots" / commit
    for path, f in files.items():
        hop = snap / path
        while hop.is_symlink():
            target = os.readlink(hop)
            assert not os.path.isabs(target), f"{hop} -> {target}"
            hop = Path(os.path.normpath(hop.parent / target))
            assert hop.is_relative_to(node), f"{path} leaves the node hub: {hop}"
        assert hop.is_file() and sha256_file(hop) == f.sha256, path
    proc = subprocess.run([sys.executable, "-c", LOADER, REPO_ID, str(node)], capture_output=True, text=True,
                          env=client_env(site, HF_HUB_OFFLINE="1"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert Path(loaded["snapshot"]).name == commit
    assert {p: v["sha256"] for p, v in loaded["files"].items()} == {p: f.sha256 for p, f in files.items()}
    assert all(Path(v["real"]).is_relative_to(node) for v in loaded["files"].values()), loaded["files"]
    assert loaded["tensors"] == {p: tensor_digests(f.data) for p, f in files.items() if p.endswith(".safetensors")}


def incomplete_problem(result, site: dict, commit: str, missing: list[str]) -> dict:
    """The one problem a half-downloaded NAS snapshot must produce on a node that serves no earlier
    revision, naming the commit and what it lacks. `missing` is read after the mirror, so it can
    only have shrunk since the mirror looked."""
    problems = result.json["problems"]
    assert [p["kind"] for p in problems] == ["incomplete"], problems
    problem = problems[0]
    assert problem["path"].endswith(f"{REPO_DIR}/snapshots/{commit}"), problem
    assert commit in problem["detail"], problem
    assert missing, problem
    assert all(name in problem["detail"] for name in missing[:5]), (missing, problem)
    return problem


def assert_pending(result, serving: str, commit: str, missing: list[str]) -> dict:
    """The one pending revision a half-downloaded NAS snapshot must produce on a node serving an
    earlier whole one: the NAS's commit, the node's, and what the NAS lacks."""
    pending, = result.json["pending"]
    assert (pending["model"], pending["revision"]) == (REPO_ID, "main"), pending
    assert (pending["pending_commit"], pending["serving_commit"]) == (commit, serving), pending
    assert all(name in pending["detail"] for name in missing[:5]), (missing, pending)
    assert 0 <= pending["idle_seconds"] < 120, pending  # the download was killed just now
    return pending


def test_snapshot_download_then_mirror(site, hub, procs):
    commit = hub.commit(REPO_ID, commit_a())
    download(site, hub, procs)
    assert (site["nas"] / REPO_DIR / "refs" / "main").read_text() == commit
    assert not nas_missing(site, hub, commit)
    # The client really went through the paginated tree listing and the LFS redirect.
    assert any("cursor=" in path for _, path, _ in hub.requests)
    assert any(method == "HEAD" and status == 302 for method, _, status in hub.requests)

    result = mirror(site)
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["problems"] == []
    assert_node_serves(site, hub, commit)
    assert (site["node"] / REPO_DIR / "trees" / f"{commit}.json").read_bytes() == \
        (site["nas"] / REPO_DIR / "trees" / f"{commit}.json").read_bytes()
    check = verify_full(site)
    assert check.code == 0, check.stdout + check.stderr


def test_download_killed_half_way_on_a_new_node(site, hub, procs):
    commit = hub.commit(REPO_ID, commit_b())
    kill_half_way(site, hub, procs, commit)
    # What huggingface_hub leaves: the ref and the trees listing of the new commit, files missing.
    repo = site["nas"] / REPO_DIR
    assert (repo / "refs" / "main").read_text() == commit
    assert (repo / "trees" / f"{commit}.json").is_file()
    missing = nas_missing(site, hub, commit)
    assert BIG in missing

    result = mirror(site)
    assert result.code == 1, result.stdout + result.stderr
    problem = incomplete_problem(result, site, commit, missing)
    assert ".incomplete" in problem["detail"]
    refs = site["node"] / REPO_DIR / "refs"
    assert not refs.exists() or not any(refs.rglob("*")), "no ref at all on a node that had none"

    download(site, hub, procs)  # the download is re-run to its end
    result = mirror(site)
    assert result.code == 0, result.stdout + result.stderr
    assert_node_serves(site, hub, commit)


def test_download_killed_half_way_while_the_node_serves_the_previous_commit(site, hub, procs):
    a = hub.commit(REPO_ID, commit_a())
    download(site, hub, procs)
    assert mirror(site).code == 0
    assert_node_serves(site, hub, a)

    b = hub.commit(REPO_ID, commit_b())  # main moves to B on the Hub
    kill_half_way(site, hub, procs, b)
    assert (site["nas"] / REPO_DIR / "refs" / "main").read_text() == b
    missing = nas_missing(site, hub, b)
    assert BIG in missing

    # The NAS is mid-download, not the node: it is whole on A and stays there, exit 0, and both
    # commands name the pending revision and the one the node stays on.
    result = mirror(site)
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["problems"] == [] and result.json["copied_files"] == 0
    pending = assert_pending(result, a, b, missing)
    assert_node_serves(site, hub, a)  # still on A, every byte of it
    check = verify_full(site)
    assert check.code == 0, check.stdout + check.stderr
    assert check.json["problems"] == [] and check.json["content_checked"] == len(hub.files(REPO_ID, a))
    assert assert_pending(check, a, b, missing)["detail"] == pending["detail"]
    text = run_stage("verify", "--node", "dgx1", "--manifest", site["manifest"], timeout=60)
    assert text.code == 0 and f"pending          {REPO_ID} main: the NAS names {b}" in text.stdout, text.stdout
    assert f"the node stays on {a}" in text.stdout
    assert_node_serves(site, hub, a)

    download(site, hub, procs)
    assert not nas_missing(site, hub, b)
    result = mirror(site)
    assert result.code == 0, result.stdout + result.stderr
    assert_node_serves(site, hub, b)
    check = verify_full(site)
    assert check.code == 0, check.stdout + check.stderr


def test_mirror_while_the_download_still_runs(site, hub, procs):
    a = hub.commit(REPO_ID, commit_a())
    download(site, hub, procs)
    assert mirror(site).code == 0

    b = hub.commit(REPO_ID, commit_b())
    hub.throttle[BIG] = 4 * MiB  # 16 s for the big shard, unless the throttle is lifted
    proc = start_download(site, hub, procs)
    wait_for(lambda: partial_big_blob(site, hub, b, min_bytes=0), 30, "the big shard's .incomplete blob")

    def mirror_and_check(throttled: bool) -> bool:
        """True when the mirror found B still pending (the node stays on A), False when it staged B."""
        result = mirror(site)
        assert result.code == 0, result.stdout + result.stderr
        if result.json["pending"]:
            pending, = result.json["pending"]
            assert (pending["pending_commit"], pending["serving_commit"]) == (b, a), pending
            assert_node_serves(site, hub, a)
            return True
        assert not nas_missing(site, hub, b)
        assert_node_serves(site, hub, b)
        return False

    # Throttled, the download is certainly still running during this mirror.
    assert mirror_and_check(throttled=True)
    assert proc.poll() is None
    # Unthrottled, the download ends while this mirror runs, before or after it looks: either holds.
    hub.throttle.clear()
    mirror_and_check(throttled=False)
    assert proc.wait(timeout=60) == 0
    result = mirror(site)
    assert result.code == 0, result.stdout + result.stderr
    assert_node_serves(site, hub, b)


def test_file_by_file_download_killed_half_way(site, hub, procs):
    """How transformers' from_pretrained fills a cache: hf_hub_download of config.json, then of the
    weights, file by file. No trees listing is written, and a one-file model has no index."""
    a = hub.commit(REPO_ID, {"config.json": b'{"revision": "A"}', BIG: random_safetensors(4, MiB)})
    download(site, hub, procs)
    assert mirror(site).code == 0
    assert_node_serves(site, hub, a)

    b = hub.commit(REPO_ID, {"config.json": b'{"revision": "B"}', BIG: random_safetensors(5, 64 * MiB)})
    kill_half_way(site, hub, procs, b, code=(
        "from huggingface_hub import hf_hub_download\n"
        f"for name in ('config.json', {BIG!r}):\n"
        f"    hf_hub_download({REPO_ID!r}, name, revision='main')\n"))
    repo = site["nas"] / REPO_DIR
    assert (repo / "refs" / "main").read_text() == b and not (repo / "trees" / f"{b}.json").exists()
    assert nas_missing(site, hub, b) == [BIG]

    result = mirror(site)
    assert node_ref(site) == a, "the node was moved onto a commit without its weights"
    # A's snapshot has no listing either; the .incomplete blob is B's, so A is still whole.
    assert result.code == 0 and result.json["problems"] == [], result.stdout + result.stderr
    assert ".incomplete" in assert_pending(result, a, b, [])["detail"]
    assert_node_serves(site, hub, a)


TRANSFORMERS_LOADER = r"""
import hashlib, json, os, sys
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.utils.hub import cached_file, get_checkpoint_shard_files
repo = sys.argv[1]
config = AutoConfig.from_pretrained(repo)
tokenizer = AutoTokenizer.from_pretrained(repo)
shards, _ = get_checkpoint_shard_files(repo, cached_file(repo, "model.safetensors.index.json"))
out = {"config": [config.model_type, config.hidden_size, config.num_hidden_layers],
       "ids": tokenizer("hello world again")["input_ids"],
       "do_sample": GenerationConfig.from_pretrained(repo).do_sample, "shards": {}}
for path in shards:
    with open(path, "rb") as f:
        out["shards"][os.path.basename(path)] = {"sha256": hashlib.sha256(f.read()).hexdigest(),
                                                 "real": os.path.realpath(path)}
print(json.dumps(out))
"""


def transformers_model() -> dict[str, bytes]:
    """A model as transformers reads one: a Llama config, a fast tokenizer (tokenizers' own
    WordLevel model), a generation config, and weights in two shards named by an index."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 3}
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shards[0], "lm_head.weight": shards[1]}}
    return {"config.json": json.dumps(config).encode(), "generation_config.json": b'{"do_sample": false}',
            "tokenizer.json": tokenizer.to_str().encode(),
            "tokenizer_config.json": b'{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}',
            "model.safetensors.index.json": json.dumps(index).encode(),
            shards[0]: random_safetensors(11, 2 * MiB), shards[1]: random_safetensors(12, 3 * MiB)}


def test_transformers_offline_loads_the_config_tokenizer_and_every_shard_from_the_node(site, hub, procs):
    """The NAS filled by snapshot_download, the node staged by `stage mirror`; then transformers,
    offline and pointed at the node's hub alone, finds the config, the tokenizer, the generation
    config and the index's shards there, with the bytes the Hub served."""
    files = transformers_model()
    commit = hub.commit(REPO_ID, files)
    download(site, hub, procs)
    result = mirror(site)
    assert result.code == 0 and result.json["problems"] == [], result.stdout + result.stderr
    assert node_ref(site) == commit
    proc = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOADER, REPO_ID], capture_output=True, text=True,
                          env=client_env(site, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(site["node"])), timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["config"] == ["llama", 64, 2]
    assert loaded["ids"] == [1, 2, 0] and loaded["do_sample"] is False
    served = {name: hashlib.sha256(data).hexdigest() for name, data in files.items() if name.endswith(".safetensors")}
    assert {name: shard["sha256"] for name, shard in loaded["shards"].items()} == served
    node = site["node"].resolve()
    assert all(Path(shard["real"]).is_relative_to(node / REPO_DIR / "blobs") for shard in loaded["shards"].values())
