#!/usr/bin/env python3
"""Create a demo NAS hub cache and a manifest for it: `python scripts/make_demo_nas.py [DIR]`.

DIR (default ./demo) gets a NAS hub under DIR/nas with the traps a real one has (an absolute
link through a NAS-side alias, a shared blob store, an excluded subtree, a .no_exist marker),
and DIR/cluster.toml with two nodes:

- dgx1 stages the models, nothing else. The README's main job mirrors it, and every command the
  README shows next (verify, binds, audit, mirror --dry-run) then exits 0.
- dgx2 also packs Engram row shards into its engram_dir. A node with shards configured verifies
  clean only once they are packed, so it is a node of its own, with its own steps:
  `stage mirror --node dgx2`, `stage pack-engram --node dgx2`, `stage verify --node dgx2`.

Prints the manifest's path on stdout.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hubgen import build_demo  # noqa: E402


def main() -> None:
    # argparse, so that `--help` prints this help: read as DIR, it once built a demo named "--help".
    parser = argparse.ArgumentParser(prog="make_demo_nas.py", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", nargs="?", default="demo", metavar="DIR",
                        help="where to build it (default ./demo); an existing DIR is replaced")
    root = Path(parser.parse_args().dir)
    if root.exists():
        shutil.rmtree(root)
    print(build_demo(root, engram_node="dgx2"))


if __name__ == "__main__":
    main()
