"""Time `stage prune` on a node hub of N files (docs/benchmarks.md, "Prune").

The node hub holds one staged model (kept), an old revision of it with N/4 snapshot entries
linking to N/4 blobs of its own, and an unlisted repo of the same shape: N files and links to
remove. Blobs are hard links of one small file, so the hub is made in seconds and the figure is
the per-file cost (scan, in-use check, journal, unlink), not the disk's bandwidth.

    python scripts/lab/bench_prune.py /tmp/bench-prune 100000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hubgen import Hub, random_safetensors  # noqa: E402

MODEL = "bench/Kept"


def fill_revision(repo: Path, commit: str, count: int, seed: Path) -> None:
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    (snapshot / "files").mkdir(parents=True, exist_ok=True)
    blobs.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        name = hashlib.sha256(f"{repo.name}:{commit}:{i}".encode()).hexdigest()
        os.link(seed, blobs / name)
        os.symlink(f"../../../blobs/{name}", snapshot / "files" / f"part-{i:06d}.txt")


def main(root: Path, files: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    nas = Hub(root / "nas" / "hf" / "hub")
    snap = nas.repo(MODEL).snapshot()
    snap.add_lfs("model.safetensors", random_safetensors(1, 64 * 1024))
    snap.add_git("config.json", b"{}")
    snap.finish()
    hub = root / "nvme" / "hf" / "hub"
    manifest = root / "cluster.toml"
    manifest.write_text(f'[nas]\nhub = "{nas.root}"\n\n[models."{MODEL}"]\nrevision = "main"\n\n'
                        f'[nodes.bench]\nhub = "{hub}"\nmodels = ["{MODEL}"]\n')
    stage = [sys.executable, "-m", "stager"]
    subprocess.run([*stage, "mirror", "--node", "bench", "--manifest", str(manifest)], check=True,
                   stdout=subprocess.DEVNULL)
    seed = root / "seed.txt"
    seed.write_bytes(b"x" * 100)
    started = time.monotonic()
    quarter = files // 4
    fill_revision(hub / "models--bench--Kept", "0" * 40, quarter, seed)
    fill_revision(hub / "models--bench--Gone", "1" * 40, quarter, seed)
    made = time.monotonic() - started
    timings = {}
    for label, extra in (("audit", ["audit"]), ("dry-run", ["prune", "--dry-run"]), ("prune", ["prune"])):
        t0 = time.monotonic()
        ran = subprocess.run([*stage, *extra, "--node", "bench", "--json", "--manifest", str(manifest)],
                             capture_output=True, text=True)
        timings[label] = round(time.monotonic() - t0, 2)
        if label == "prune":
            report = json.loads(ran.stdout)
            assert ran.returncode == 0, ran.stdout + ran.stderr
            removed = report["removed_files"]
    left = sum(len(names) for _, _, names in os.walk(hub))
    return {"files_and_links": 4 * quarter, "made_seconds": round(made, 2), **timings,
            "removed_files": removed, "left_in_hub": left}


if __name__ == "__main__":
    # argparse, so that `--help` is help: read as ROOT, it was a directory to remove.
    parser = argparse.ArgumentParser(prog="bench_prune.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, metavar="ROOT", help="a scratch directory, removed first")
    parser.add_argument("files", type=int, metavar="N", help="files and links to remove (docs/benchmarks.md: 100000)")
    args = parser.parse_args()
    print(json.dumps(main(args.root, args.files)))
