"""Build Hugging Face hub caches on disk, the way a NAS holds them, for the demo, tests and bench.

Nothing here talks to a network: files are written with the exact layout that
huggingface_hub 1.x/2.x produces, including the hub-level shared blob store.

As a command (`python scripts/hubgen.py -h`), each subcommand writes DIR/nas/hf/hub and a
DIR/cluster.toml for it, and prints the manifest's path:

    hubgen.py demo DIR [--scale N]                   the demo NAS (scripts/make_demo_nas.py's)
    hubgen.py hub DIR --size 8GiB --files 4          one model of that size in that many weight files
    hubgen.py engram DIR --rows 100000 --world 8     an Engram checkpoint, and a node that packs it

As a library (tests, scripts/lab/bench.py): Hub, Snapshot, add_engram_checkpoint, build_demo, ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import blake3


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def safetensors_header(tensors: dict[str, tuple[str, list[int], int]], metadata: dict | None = None) -> bytes:
    """The safetensors prefix for {name: (dtype, shape, data bytes)}: 8-byte LE header length, then the
    JSON header padded to 8 bytes. The tensors' data follows it in the same order."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict | None = None) -> bytes:
    """Serialize {name: (dtype, shape, raw bytes)} in the safetensors format, without importing safetensors."""
    sizes = {name: (dtype, shape, len(raw)) for name, (dtype, shape, raw) in tensors.items()}
    return safetensors_header(sizes, metadata) + b"".join(raw for _, _, raw in tensors.values())


def random_safetensors(seed: int, tensor_bytes: int, names: int = 2, dtype: str = "F16") -> bytes:
    """A loadable safetensors file of about `tensor_bytes`, content determined by `seed`."""
    per = max(2, tensor_bytes // names // 2 * 2)
    tensors = {}
    for i in range(names):
        raw = pseudo_random(seed * 1000 + i, per)
        tensors[f"model.layers.{i}.weight"] = (dtype, [per // 2], raw)
    return safetensors_bytes(tensors)


def pseudo_random(seed: int, size: int) -> bytes:
    """Fast deterministic bytes (blake3 XOF), so fixtures of any size cost no RNG time."""
    return blake3.blake3(str(seed).encode()).digest(length=size)


def streamed_safetensors(seed: int, tensor_bytes: int, chunk: int = 8 * 1024 * 1024) -> tuple[int, Iterator[bytes]]:
    """(total size, chunks) of a one-tensor safetensors file too big to hold in memory (the bench's GiB
    blobs). The data is pseudo_random(seed, ...) read through the XOF's seek, one chunk at a time."""
    tensor_bytes = max(2, tensor_bytes // 2 * 2)
    head = safetensors_header({"model.layers.0.weight": ("F16", [tensor_bytes // 2], tensor_bytes)})

    def chunks() -> Iterator[bytes]:
        yield head
        xof = blake3.blake3(str(seed).encode())
        for offset in range(0, tensor_bytes, chunk):
            yield xof.digest(length=min(chunk, tensor_bytes - offset), seek=offset)

    return len(head) + tensor_bytes, chunks()


@dataclass
class Snapshot:
    repo: "Repo"
    commit: str
    files: dict[str, dict] = field(default_factory=dict)  # the trees/<commit>.json listing
    sha256: dict[str, str] = field(default_factory=dict)  # path -> sha256 of its content, for tests

    @property
    def dir(self) -> Path:
        return self.repo.dir / "snapshots" / self.commit

    def _entry(self, path: str) -> Path:
        entry = self.dir / path
        entry.parent.mkdir(parents=True, exist_ok=True)
        return entry

    def _link_to_blob(self, path: str, blob_name: str) -> None:
        depth = path.count("/")
        os.symlink("../" * (depth + 2) + f"blobs/{blob_name}", self._entry(path))

    def add_lfs(self, path: str, data: bytes, *, shared: bool = True, absolute_via: str | None = None) -> str:
        """An LFS file: blob named by its sha256. `shared` puts the bytes in the hub-level store
        (repo blob -> ../../blobs/xx/<xet>); `absolute_via` writes that link as an absolute path
        under the given NAS-side prefix (what `nas.aliases` maps back)."""
        sha = hashlib.sha256(data).hexdigest()
        blob = self.repo.dir / "blobs" / sha
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists() and not blob.is_symlink():
            if shared:
                xet = self.repo.hub.store(data)
                if absolute_via:
                    os.symlink(f"{absolute_via}/blobs/{xet[:2]}/{xet}", blob)
                else:
                    os.symlink(f"../../blobs/{xet[:2]}/{xet}", blob)
                self.repo.hub.add_store_ref(xet, f"{self.repo.dir.name}/blobs/{sha}")
            else:
                blob.write_bytes(data)
        self._link_to_blob(path, sha)
        self.files[path] = {"size": len(data), "blob_id": git_sha1(data), "lfs_sha256": sha, "lfs_size": len(data)}
        self.sha256[path] = sha
        return sha

    def add_lfs_stream(self, path: str, size: int, chunks: Iterable[bytes], *, shared: bool = True) -> str:
        """add_lfs for content too big for memory: the chunks are written once and hashed on the way."""
        incoming = self.repo.hub.root / f".incoming-{os.getpid()}"
        sha, sha1, xet = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size), blake3.blake3(b"xet:")
        written = 0
        with open(incoming, "wb") as out:
            for data in chunks:
                for hasher in (sha, sha1, xet):
                    hasher.update(data)
                out.write(data)
                written += len(data)
        if written != size:
            incoming.unlink()
            raise ValueError(f"{path}: chunks held {written} bytes, expected {size}")
        name = sha.hexdigest()
        blob = self.repo.dir / "blobs" / name
        blob.parent.mkdir(parents=True, exist_ok=True)
        if blob.exists() or blob.is_symlink():
            incoming.unlink()
        elif shared:
            xet_name = xet.hexdigest()
            self.repo.hub.store_file(incoming, xet_name)
            os.symlink(f"../../blobs/{xet_name[:2]}/{xet_name}", blob)
            self.repo.hub.add_store_ref(xet_name, f"{self.repo.dir.name}/blobs/{name}")
        else:
            os.replace(incoming, blob)
        self._link_to_blob(path, name)
        self.files[path] = {"size": size, "blob_id": sha1.hexdigest(), "lfs_sha256": name, "lfs_size": size}
        self.sha256[path] = name
        return name

    def add_git(self, path: str, data: bytes) -> str:
        """A regular git file: blob named by its git sha1."""
        sha1 = git_sha1(data)
        blob = self.repo.dir / "blobs" / sha1
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        self._link_to_blob(path, sha1)
        self.files[path] = {"size": len(data), "blob_id": sha1}
        self.sha256[path] = hashlib.sha256(data).hexdigest()
        return sha1

    def add_real(self, path: str, data: bytes) -> Path:
        """A real file inside the snapshot (copied there by hand, or by an old tool)."""
        entry = self._entry(path)
        entry.write_bytes(data)
        self.files[path] = {"size": len(data), "blob_id": git_sha1(data)}
        self.sha256[path] = hashlib.sha256(data).hexdigest()
        return entry

    def add_raw_link(self, path: str, target: str) -> Path:
        entry = self._entry(path)
        os.symlink(target, entry)
        return entry

    def finish(self, *, ref: str | None = "main", trees: bool = True, no_exist: tuple[str, ...] = ()) -> "Snapshot":
        if ref:
            ref_path = self.repo.dir / "refs" / ref
            ref_path.parent.mkdir(parents=True, exist_ok=True)
            ref_path.write_text(self.commit)  # 40 hex, no newline: huggingface_hub's format
        if trees:
            tree = self.repo.dir / "trees" / f"{self.commit}.json"
            tree.parent.mkdir(parents=True, exist_ok=True)
            tree.write_text(json.dumps({"format_version": 1, "files": dict(sorted(self.files.items()))}, indent=2))
        for path in no_exist:
            marker = self.repo.dir / ".no_exist" / self.commit / path
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return self


@dataclass
class Repo:
    hub: "Hub"
    repo_id: str

    @property
    def dir(self) -> Path:
        return self.hub.root / f"models--{self.repo_id.replace('/', '--')}"

    def snapshot(self, commit: str | None = None) -> Snapshot:
        commit = commit or hashlib.sha1(f"{self.repo_id}:{len(list(self.dir.glob('snapshots/*')))}".encode()).hexdigest()
        (self.dir / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        return Snapshot(self, commit)


class Hub:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def repo(self, repo_id: str) -> Repo:
        return Repo(self, repo_id)

    def store(self, data: bytes) -> str:
        """Put bytes in the hub-level shared store; returns the content (xet) hash naming it."""
        xet = blake3.blake3(b"xet:" + data).hexdigest()
        payload = self._payload(xet)
        if not payload.exists():
            payload.write_bytes(data)
        return xet

    def store_file(self, path: Path, xet: str) -> None:
        """Move an already written file into the shared store under its content hash."""
        os.replace(path, self._payload(xet))

    def _payload(self, xet: str) -> Path:
        store = self.root / "blobs"
        store.mkdir(exist_ok=True)
        marker = store / ".huggingface-shared-blobs"
        if not marker.exists():
            marker.write_text("1\n")
        payload = store / xet[:2] / xet
        payload.parent.mkdir(exist_ok=True)
        return payload

    def add_store_ref(self, xet: str, referrer: str) -> None:
        with open(self.root / "blobs" / xet[:2] / f"{xet}.refs", "a") as refs:
            refs.write(referrer + "\n")


ENGRAM_WEIGHT_BYTES = 256  # F8_E4M3 [rows, 256]
ENGRAM_SCALE_BYTES = 8  # F8_E8M0 [rows, 8]


@dataclass(frozen=True)
class EngramCheckpoint:
    """What add_engram_checkpoint wrote: the snapshot, the safetensors file and each layer's row count."""

    snapshot: Snapshot
    file: str
    rows: dict[int, int]
    prefix: str
    sha256: str

    def tensor(self, layer: int, part: str) -> str:
        return f"{self.prefix}layers.{layer}.engram.embed.{part}"


def add_engram_checkpoint(target: "Snapshot | Hub", repo_id: str | None = None, *, layers=(1, 14),
                          rows: int | dict[int, int] = 4099, prefix: str = "model.", heads=None, seed: int = 0,
                          file: str = "model-engram.safetensors", config: dict | None = None,
                          weight_map: dict[str, str] | None = None, shared: bool = True, streamed: bool = True,
                          absolute_via: str | None = None, chunk: int = 8 * 1024 * 1024,
                          leading_bytes: int = 0) -> EngramCheckpoint:
    """A DeepSeek-V4-style Engram checkpoint: for each layer, `{prefix}layers.{L}.engram.embed.weight`
    (F8_E4M3, [rows, 256]) and `.scale` (F8_E8M0, [rows, 8]) in one safetensors file, plus
    model.safetensors.index.json (`weight_map`, merged with the one given) and config.json (`config`
    plus `engram_layer_ids`, and `engram_head_rows` when `heads` is given).

    `target` is a Snapshot (the caller finishes it), or a Hub plus `repo_id` (a new repo, finished).
    `rows` is one count for every layer or {layer: rows}. Bytes are blake3 XOF output read by seek, so
    streamed=True (the default) writes a table of any size in `chunk` pieces, never whole in memory;
    streamed=False builds the file in memory and can link it through an absolute `absolute_via` path.
    `leading_bytes` puts a U8 tensor of that size (`{prefix}norm.weight`) before the Engram tensors,
    as a real checkpoint has other tensors first: an odd size leaves every Engram span at an offset
    that is not a multiple of 8 (the header is padded to 8 bytes).
    """
    snap = target.repo(repo_id).snapshot() if isinstance(target, Hub) else target
    counts = {layer: rows[layer] if isinstance(rows, dict) else rows for layer in layers}
    tensors: dict[str, tuple[str, list[int], int]] = {}
    if leading_bytes:
        tensors[f"{prefix}norm.weight"] = ("U8", [leading_bytes], leading_bytes)
    for layer, count in counts.items():
        tensors[f"{prefix}layers.{layer}.engram.embed.weight"] = ("F8_E4M3", [count, ENGRAM_WEIGHT_BYTES],
                                                                  count * ENGRAM_WEIGHT_BYTES)
        tensors[f"{prefix}layers.{layer}.engram.embed.scale"] = ("F8_E8M0", [count, ENGRAM_SCALE_BYTES],
                                                                 count * ENGRAM_SCALE_BYTES)
    head = safetensors_header(tensors)

    def chunks() -> Iterator[bytes]:
        yield head
        for name, (_dtype, _shape, nbytes) in tensors.items():
            xof = blake3.blake3(f"engram:{seed}:{name}".encode())
            for offset in range(0, nbytes, chunk):
                yield xof.digest(length=min(chunk, nbytes - offset), seek=offset)

    size = len(head) + sum(nbytes for _, _, nbytes in tensors.values())
    if streamed:
        sha = snap.add_lfs_stream(file, size, chunks(), shared=shared)
    else:
        sha = snap.add_lfs(file, b"".join(chunks()), shared=shared, absolute_via=absolute_via)
    index = {"metadata": {"total_size": size}, "weight_map": {**(weight_map or {}), **{n: file for n in tensors}}}
    snap.add_git("model.safetensors.index.json", json.dumps(index, indent=2).encode())
    settings = {**(config or {"architectures": ["DeepseekV4ForCausalLM"]}), "engram_layer_ids": list(layers)}
    if heads is not None:
        settings["engram_head_rows"] = heads
    snap.add_git("config.json", json.dumps(settings, indent=2).encode())
    if isinstance(target, Hub):
        snap.finish()
    return EngramCheckpoint(snap, file, counts, prefix, sha)


def demo_manifest(root: Path, nas: Path, engram_node: str) -> str:
    """The demo's manifest: dgx1 stages the models into root/nvme. `engram_node` packs the Engram
    shards too: "dgx1" itself (what most tests use), or "dgx2", a node of its own under
    root/nvme-dgx2 (what scripts/make_demo_nas.py gives a newcomer: dgx1 then verifies clean
    right after its mirror, with nothing to pack)."""
    engram = f"""engram_dir = "{root}/nvme/engram"
rank = 0
""" if engram_node == "dgx1" else ""
    dgx2 = f"""
[nodes.dgx2]
hub = "{root}/nvme-dgx2/hf/hub"
reserve = "64MiB"
models = ["acme/Flash-3bpw"]
engram_dir = "{root}/nvme-dgx2/engram"
rank = 0
""" if engram_node == "dgx2" else ""
    return f"""# Demo cluster: a NAS hub under {root}/nas, and node hubs under {root}/nvme*.
[nas]
hub = "{nas}"
aliases = {{ "/volume1/hf/hub" = "{nas}" }}  # the NAS wrote some links as /volume1/...

[models."acme/Flash-3bpw"]
revision = "main"
exclude = ["page15/**"]      # stays on the NAS; `stage binds` mounts it from there

[models."acme/Flash-drafter"]
revision = "main"

[nodes.dgx1]
hub = "{root}/nvme/hf/hub"
reserve = "64MiB"
models = ["acme/Flash-3bpw", "acme/Flash-drafter"]
{engram}{dgx2}
[engram]
model = "acme/Flash-3bpw"
world = 3
"""


def build_demo(root: Path, *, scale: int = 1, engram_node: str = "dgx1") -> Path:
    """A demo NAS under root/nas/hf/hub with the traps a real one has, a node hub under
    root/nvme, and root/cluster.toml pointing at both (see demo_manifest). Returns the manifest path."""
    root = Path(root).resolve()
    nas = root / "nas" / "hf" / "hub"
    hub = Hub(nas)
    flash = hub.repo("acme/Flash-3bpw").snapshot()
    index = {"metadata": {}, "weight_map": {}}
    for i in range(1, 4):
        name = f"model-0000{i}-of-00003.safetensors"
        data = random_safetensors(i, scale * 4 * 1024 * 1024)
        flash.add_lfs(name, data, shared=True, absolute_via="/volume1/hf/hub" if i == 2 else None)
        index["weight_map"][f"model.layers.{i}.weight"] = name
    # A small two-layer Engram table (row counts that TP=3 does not divide) with its index and config.
    add_engram_checkpoint(flash, layers=(1, 14), rows={1: 5003, 14: 5011}, weight_map=index["weight_map"],
                          config={"architectures": ["DeepseekV4ForCausalLM"]})
    flash.add_real("tokenizer.json", json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode())
    flash.add_lfs("page15/experts.safetensors", random_safetensors(15, scale * 2 * 1024 * 1024), shared=False)
    flash.finish(no_exist=("generation_config.json",))
    drafter = hub.repo("acme/Flash-drafter").snapshot()
    drafter.add_git("config.json", b'{"architectures": ["DrafterForCausalLM"]}')
    drafter.add_lfs("model.safetensors", random_safetensors(99, scale * 2 * 1024 * 1024), shared=True)
    drafter.finish()
    manifest = root / "cluster.toml"
    manifest.write_text(demo_manifest(root, nas, engram_node))
    return manifest


def build_sized_hub(root: Path, *, size: int, files: int, repo_id: str = "acme/Model", small_files: int = 0,
                    shared: bool = True) -> Path:
    """A NAS hub under root/nas/hf/hub holding `repo_id`: `files` streamed safetensors weights of
    `size` bytes in all (never held in memory), a config.json, an index, and `small_files` git
    blobs of 1-64 KiB; root/cluster.toml stages it onto node `node1` (root/nvme/hf/hub)."""
    root = Path(root).resolve()
    nas = root / "nas" / "hf" / "hub"
    snap = Hub(nas).repo(repo_id).snapshot()
    snap.add_git("config.json", json.dumps({"architectures": ["ModelForCausalLM"]}).encode())
    index: dict = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i in range(1, files + 1):
        name = f"model-{i:05d}-of-{files:05d}.safetensors"
        tensor = max(16, size // files - 128)
        blob_size, chunks = streamed_safetensors(i, tensor)
        snap.add_lfs_stream(name, blob_size, chunks, shared=shared and i % 2 == 1)
        index["weight_map"][f"model.layers.{i}.weight"] = name
        index["metadata"]["total_size"] += blob_size
    snap.add_git("model.safetensors.index.json", json.dumps(index, indent=2).encode())
    for i in range(small_files):
        snap.add_git(f"extra/file-{i:05d}.json", pseudo_random(10_000 + i, 1024 * (1 + (i * 37) % 64)))
    snap.finish()
    manifest = root / "cluster.toml"
    manifest.write_text(f"""[nas]
hub = "{nas}"

[models."{repo_id}"]
revision = "main"

[nodes.node1]
hub = "{root}/nvme/hf/hub"
models = ["{repo_id}"]
""")
    return manifest


def build_engram_hub(root: Path, *, rows: int, layers: tuple[int, ...], world: int,
                     repo_id: str = "acme/Engram") -> Path:
    """A NAS hub under root/nas/hf/hub holding an Engram checkpoint of `rows` rows per layer;
    root/cluster.toml stages it onto node `node1`, which packs every rank of TP `world`."""
    root = Path(root).resolve()
    nas = root / "nas" / "hf" / "hub"
    add_engram_checkpoint(Hub(nas), repo_id, layers=layers, rows=rows, streamed=True)
    manifest = root / "cluster.toml"
    manifest.write_text(f"""[nas]
hub = "{nas}"

[models."{repo_id}"]
revision = "main"

[nodes.node1]
hub = "{root}/nvme/hf/hub"
models = ["{repo_id}"]
engram_dir = "{root}/nvme/engram"
ranks = {list(range(world))}

[engram]
model = "{repo_id}"
world = {world}
""")
    return manifest


def _size(text: str) -> int:
    from stager.base.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers such as 1,14, got {text!r}") from None
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"expected distinct layer numbers >= 0, got {text!r}")
    return layers


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="hubgen.py", description="Write a Hugging Face hub cache as a NAS holds it (DIR/nas/hf/hub) and a "
                                      "manifest for it (DIR/cluster.toml); print the manifest's path.")
    top.add_argument("--force", action="store_true", help="replace DIR if it exists (default: refuse)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="the demo NAS: two models with a real NAS's traps, nodes dgx1 and dgx2",
                               description="The demo NAS of scripts/make_demo_nas.py and the README.")
    demo.add_argument("dir", metavar="DIR", type=Path)
    demo.add_argument("--scale", type=_count, default=1, metavar="N", help="weights N times the default size (4 MiB)")
    demo.add_argument("--engram-node", choices=["dgx1", "dgx2"], default="dgx2",
                      help="the node that packs Engram shards (default dgx2, a node of its own)")
    hub = commands.add_parser("hub", help="one model of a given size in a given number of weight files",
                              description="One model of SIZE bytes in FILES safetensors weights (streamed, any size), "
                                          "half of them in the hub-level shared blob store; node node1 stages it.")
    hub.add_argument("dir", metavar="DIR", type=Path)
    hub.add_argument("--size", type=_size, required=True, metavar="SIZE", help="total weight bytes (8GiB, 500MB, ...)")
    hub.add_argument("--files", type=_count, default=4, metavar="N", help="weight files (default 4)")
    hub.add_argument("--small-files", type=int, default=0, metavar="N", help="also N git blobs of 1-64 KiB")
    hub.add_argument("--repo", default="acme/Model", metavar="ORG/NAME", help="repo id (default acme/Model)")
    hub.add_argument("--no-shared-store", action="store_true", help="every blob in the repo's own blobs/")
    engram = commands.add_parser("engram", help="an Engram checkpoint, and a node that packs every rank",
                                 description="A DeepSeek-V4-style Engram checkpoint (F8_E4M3 weight and F8_E8M0 "
                                             "scale per layer); node node1 stages it and packs every rank.")
    engram.add_argument("dir", metavar="DIR", type=Path)
    engram.add_argument("--rows", type=_count, default=4099, metavar="N", help="rows per layer (264 bytes each)")
    engram.add_argument("--layers", type=_layers, default=(1, 14), metavar="L,L", help="layer ids (default 1,14)")
    engram.add_argument("--world", type=_count, default=3, metavar="TP", help="TP size (default 3)")
    engram.add_argument("--repo", default="acme/Engram", metavar="ORG/NAME", help="repo id (default acme/Engram)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root: Path = args.dir
    occupied = any(root.iterdir()) if root.is_dir() else os.path.lexists(root)  # an empty DIR is fine
    if occupied:
        if not args.force:
            print(f"hubgen.py: {root} exists; use --force to replace it", file=sys.stderr)
            return 2
        shutil.rmtree(root) if root.is_dir() and not root.is_symlink() else root.unlink()
    if args.command == "demo":
        manifest = build_demo(root, scale=args.scale, engram_node=args.engram_node)
    elif args.command == "hub":
        manifest = build_sized_hub(root, size=args.size, files=args.files, repo_id=args.repo,
                                   small_files=args.small_files, shared=not args.no_shared_store)
    else:
        manifest = build_engram_hub(root, rows=args.rows, layers=args.layers, world=args.world, repo_id=args.repo)
    print(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
