#!/usr/bin/env python3
"""Create a demo NAS hub cache and a manifest for it: `python scripts/make_demo_nas.py [DIR]`.

Then: `stage mirror --node dgx1 --manifest DIR/cluster.toml`.
"""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hubgen import build_demo  # noqa: E402


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "demo")
    if root.exists():
        shutil.rmtree(root)
    manifest = build_demo(root)
    print(manifest)


if __name__ == "__main__":
    main()
