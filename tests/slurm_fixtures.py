"""The Slurm prolog and epilog (scripts/ops) as slurmd runs them: the demo NAS with a node's settings
file, the scripts started with only Slurm's variables, and what a serving job then loads from the
node's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO, make_demo

SCRIPTS = REPO / "scripts" / "ops"


@pytest.fixture
def demo(tmp_path: Path) -> dict:
    manifest = make_demo(tmp_path)
    root = manifest.parent
    conf = tmp_path / "slurm.env"
    conf.write_text(f"STAGE={BIN / 'stage'}\nSTAGE_MANIFEST={manifest}\nSTAGE_WAIT=30\n")
    return {"manifest": manifest, "conf": conf, "nas": root / "nas" / "hf" / "hub",
            "hub": root / "nvme" / "hf" / "hub"}


def slurmd_runs(script: str, demo: dict, node: str = "dgx1", **settings: str) -> subprocess.CompletedProcess:
    """The script as slurmd starts it on `node`: an empty environment but for Slurm's variables."""
    conf = demo["conf"]
    if settings:
        conf = conf.with_name("slurm-extra.env")
        conf.write_text(demo["conf"].read_text() + "".join(f"{k}={v}\n" for k, v in settings.items()))
    env = {"SLURMD_NODENAME": node, "SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "alice",
           "STAGE_SLURM_CONF": str(conf)}
    return subprocess.run(["/bin/bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True,
                          timeout=300)


def loads_offline(hub: Path) -> dict:
    """What a serving job gets from the node's cache: huggingface_hub offline, safetensors."""
    code = """
import json
from huggingface_hub import snapshot_download
from safetensors import safe_open
out = {}
for repo in ("acme/Flash-3bpw", "acme/Flash-drafter"):
    path = snapshot_download(repo, allow_patterns=["*.safetensors"], ignore_patterns=["page15/**"])
    import glob
    for name in sorted(glob.glob(path + "/model*.safetensors")):
        if name.endswith("-engram.safetensors"):
            continue  # float8 rows, which numpy cannot hold; hashed against the NAS instead
        with safe_open(name, "np") as st:
            out[name.split("/")[-1]] = {k: st.get_tensor(k).tobytes().hex()[:64] for k in st.keys()}
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(hub.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
