"""The cluster manifest (`manifests/*.toml`): what each node stages, checked key by key.

Every key that operators write is a field here; unknown keys are refused, because a typo such as
`exlcude` would otherwise stage files the operator meant to keep on the NAS. Errors name the file,
the dotted key and what was expected, and every problem in the file is listed at once.

The schema is a dozen keys, read by the small table reader below rather than by a validation
library: every command reads the manifest first, so its import is on the start-up path of every
`stage` run (docs/benchmarks.md, "Start-up").
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable

from stager.base import identity
from stager.base.errors import BadInput
from stager.base.small_files import read_regular
from stager.base.units import RATE_GRAMMAR, parse_duration, parse_rate, parse_size

DEFAULT_MANIFEST = Path("manifests/cluster.toml")
MANIFEST_ENV = "STAGE_MANIFEST"
MANIFEST_LIMIT = 1 << 20  # a cluster's manifest is a few KiB

# A node's SSH address for peers: [user@]host[:port]; a URL or a path here is a mistake.
_SSH_ADDRESS = re.compile(r"^([A-Za-z0-9._-]+@)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?$")

# Hub repo ids: "name" or "owner/name", the characters the Hub itself allows.
# Anything else (notably "..") could make a repo directory outside the hub.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# --- Reading values ---------------------------------------------------------------------------
# A reader takes the TOML value of one key and returns what the field holds. A problem with the
# value itself is a ValueError; a container whose items have problems raises _Invalid with each
# item's key, so that the message names the innermost key ("nodes.dgx1.ranks.1").

Key = tuple  # dotted key parts: table names, key names, list positions


class _Invalid(Exception):
    def __init__(self, problems: list[tuple[Key, str]]):
        super().__init__(problems)
        self.problems = problems


def _read(reader: Callable, value: object, key: Key, problems: list[tuple[Key, str]]) -> object:
    """`reader(value)`, with its problems added to `problems` under `key` (None if there were any)."""
    try:
        return reader(value)
    except ValueError as exc:
        problems.append((key, str(exc)))
    except _Invalid as exc:
        problems.extend(((*key, *inner), message) for inner, message in exc.problems)
    return None


def _text(value: object) -> str:
    # TOML has strings and numbers: `world = "3"` is a string where a count belongs, and no value
    # is converted from one kind to the other.
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


# TP sizes, ranks and layer numbers: far beyond any model, and a bound on the loops and files a
# typo (`world = 30000000`) would otherwise ask for. The CLI's --world, --rank and --layer share it.
MAX_TP = 4096
# Counts and sizes land in 64-bit fields (shard headers, statvfs figures): a larger one is a typo.
MAX_WHOLE = 2**63 - 1


def _whole(minimum: int | None = None, maximum: int = MAX_WHOLE) -> Callable[[object], int]:
    # A TOML float (`world = inf`, `rank = nan`, `world = 2.0`) is not a whole number: refused, never rounded.
    def read(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"expected a whole number of at least {minimum}, got {value!r}")
        if value > maximum:
            raise ValueError(f"expected a whole number of at most {maximum}, got {value!r}")
        return value
    return read


def _one_of(*choices: str) -> Callable[[object], str]:
    def read(value: object) -> str:
        if value not in choices:
            raise ValueError(f"expected {' or '.join(map(repr, choices))}, got {value!r}")
        return value  # type: ignore[return-value]
    return read


def _list_of(item: Callable) -> Callable[[object], list]:
    return _each(list, item)


def _table_of(item: Callable) -> Callable[[object], dict]:
    """A TOML table whose keys are names the operator chooses (repo ids, node names, aliases)."""
    return _each(dict, item)


def _each(kind: type, item: Callable) -> Callable[[object], object]:
    """A list (keyed by position) or a table of values that `item` reads, every item's problem kept."""
    def read(value: object) -> object:
        if not isinstance(value, kind):
            raise ValueError(f"expected a {'list' if kind is list else 'table'}, got {value!r}")
        problems: list[tuple[Key, str]] = []
        items = {k: _read(item, v, (k,), problems) for k, v in (enumerate(value) if kind is list else value.items())}
        if problems:
            raise _Invalid(problems)
        return list(items.values()) if kind is list else items
    return read


def _table(cls: type, **fixed: object) -> Callable[[object], object]:
    """A TOML table whose keys are the fields of `cls` made with `_key`: unknown keys and missing
    required keys are problems, every key's value goes through its field's reader, then
    `cls(..., **fixed)` checks the keys together (its __post_init__ raises ValueError or _Invalid)."""
    def read(value: object) -> object:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table, got {value!r}")
        keys = {f.name: f for f in fields(cls) if "read" in f.metadata}
        problems: list[tuple[Key, str]] = [((k,), "unknown key") for k in value if k not in keys]
        values = {}
        for name, spec in keys.items():
            if name in value:
                values[name] = _read(spec.metadata["read"], value[name], (name,), problems)
            elif spec.default is MISSING and spec.default_factory is MISSING:
                problems.append(((name,), "required key is missing"))
        if problems:
            raise _Invalid(problems)
        return cls(**values, **fixed)
    return read


def _key(reader: Callable, default: object = MISSING):
    """A manifest key: its reader, and its default when it may be left out."""
    metadata = {"read": reader}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _absolute_path(value: object) -> str:
    path = _text(value)
    if not os.path.isabs(path):
        raise ValueError(f"expected an absolute path, got {path!r}")
    return path


def _revision(value: object) -> str:
    revision = _text(value)
    parts = revision.split("/")
    if not revision or revision.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"expected a branch, tag or commit, got {revision!r}")
    return revision


def _ssh_address(value: object) -> str:
    address = _text(value)
    if not _SSH_ADDRESS.match(address):
        raise ValueError(f"expected [user@]host[:port], got {address!r}")
    return address


def _byte_size(value: object) -> int:
    return parse_size(value)  # type: ignore[arg-type]  # it refuses floats and booleans itself


def _duration(value: object) -> int:
    return parse_duration(value)  # type: ignore[arg-type]  # it refuses floats and booleans itself


def _rate(value: object) -> int:
    """Bytes per second, spelled as --bwlimit spells a rate ("10G" = 10 GiB/s, "3GB" = 3e9 B/s). A
    rate that is no limit ("0", "off") says nothing about a path, and is refused. So is a TOML
    number: as --bwlimit reads it, a bare number is KiB/s, where a manifest's reader would guess
    bytes; the quotes and the unit say which."""
    try:
        rate = parse_rate(value) if isinstance(value, str) else None
    except ValueError:
        rate = None
    if rate is None:
        grammar = RATE_GRAMMAR.removesuffix("; 0 or off for no limit")
        raise ValueError(f"expected bytes per second in quotes, such as '10GB' or '3G' ({grammar}), got {value!r}")
    return rate


def _aliases(value: object) -> dict[str, str]:
    aliases = _table_of(_text)(value)
    for prefix, target in aliases.items():
        if not prefix.startswith("/") or not target.startswith("/"):
            raise ValueError(f"alias {prefix!r} = {target!r}: both sides must be absolute paths")
    return aliases


def _node_models(value: object) -> list[str]:
    models = _list_of(_text)(value)
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once")
    return models


def _ranks(value: object) -> list[int]:
    ranks = _list_of(_whole(0, MAX_TP - 1))(value)
    if not ranks:
        raise ValueError("an empty list serves no rank; leave ranks out to serve every rank")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"rank {twice[0]} listed more than once")
    return ranks


def _repo_ids(read_models: Callable) -> Callable[[object], dict]:
    def read(value: object) -> dict:
        if isinstance(value, dict):
            bad = [((repo_id,), "not a valid repo id (expected 'owner/name')")
                   for repo_id in value if not _REPO_ID.match(repo_id) or ".." in repo_id]
            if bad:
                raise _Invalid(bad)
        return read_models(value)
    return read


# --- The manifest -----------------------------------------------------------------------------

@dataclass(frozen=True)
class NasConfig:
    hub: str = _key(_text)  # the NAS's Hugging Face hub cache: a path, or an sftp:// URL
    aliases: dict[str, str] = _key(_aliases, {})  # absolute link targets on the NAS host -> their path here
    # How long a download the NAS's ref names may show no progress before the audit warns (hub.Pending).
    pending_warn_after: int = _key(_duration, 6 * 3600)


@dataclass(frozen=True)
class ModelConfig:
    revision: str = _key(_revision, "main")
    exclude: list[str] = _key(_list_of(_text), [])


@dataclass(frozen=True)
class NodeConfig:
    hub: str = _key(_absolute_path)  # the node-local hub cache: the mirror's destination
    reserve: int = _key(_byte_size, 0)  # bytes kept free; a bare integer is bytes
    models: list[str] = _key(_node_models, [])
    engram_dir: str | None = _key(_absolute_path, None)
    rank: int | None = _key(_whole(0, MAX_TP - 1), None)
    ranks: list[int] | None = _key(_ranks, None)  # the TP ranks this node serves, one per GPU; `rank` for one
    source: str | None = _key(_text, None)  # overrides nas.hub as this node's source
    # [user@]host[:port]: where peers reach this node's hub over SFTP (`stage fleet mirror --fan-out`)
    address: str | None = _key(_ssh_address, None)

    def __post_init__(self) -> None:
        if self.rank is not None and self.ranks is not None:
            raise ValueError("rank and ranks are both set; keep one (ranks = [...] for several)")

    @property
    def engram_ranks(self) -> list[int] | None:
        """The TP ranks this node serves (`ranks`, else `rank`); None when neither is set."""
        return self.ranks if self.ranks is not None else None if self.rank is None else [self.rank]


@dataclass(frozen=True)
class EngramConfig:
    model: str = _key(_text)
    world: int = _key(_whole(1, MAX_TP))
    layout: str = _key(_one_of("floor", "heads"), "floor")
    engram_head_rows: list[int] | None = _key(_list_of(_whole(0)), None)
    layers: list[int] | None = _key(_list_of(_whole(0, MAX_TP - 1)), None)


@dataclass(frozen=True)
class FleetConfig:
    """What `stage fleet mirror` is told of the paths bytes take, instead of measuring them at
    the start of each run (docs/fleet.md, "Never slower than direct reads"). Bytes per second."""

    nas_rate: int | None = _key(_rate, None)  # what the NAS serves all nodes together
    nas_node_rate: int | None = _key(_rate, None)  # what one node reads from the NAS by itself
    relay_rate: int | None = _key(_rate, None)  # what a node's relay receives and passes on (its link, its CPU)
    # Connections per hop of the broadcast, each with a thread at either end (docs/fleet.md, "Streams
    # per hop"); unset, each node takes one per core, at most 4. 64 is the protocol's bound.
    streams: int | None = _key(_whole(1, 64), None)


@dataclass(frozen=True)
class Manifest:
    nas: NasConfig = _key(_table(NasConfig))
    models: dict[str, ModelConfig] = _key(_repo_ids(_table_of(_table(ModelConfig))), {})
    nodes: dict[str, NodeConfig] = _key(_table_of(_table(NodeConfig)), {})
    engram: EngramConfig | None = _key(_table(EngramConfig), None)
    fleet: FleetConfig = _key(_table(FleetConfig), FleetConfig())
    path: str = ""  # where the manifest was read from; not a key

    def __post_init__(self) -> None:
        problems: list[tuple[Key, str]] = []
        for name, node in self.nodes.items():
            problems += [(("nodes", name, "models"), f"{repo_id!r} has no [models.\"{repo_id}\"] table")
                         for repo_id in node.models if repo_id not in self.models]
        if self.engram is not None and self.engram.model not in self.models:
            problems.append((("engram", "model"), f"{self.engram.model!r} has no [models.\"{self.engram.model}\"] table"))
        problems += self._destinations_on_sources()
        if problems:
            raise _Invalid(problems)

    def _destinations_on_sources(self) -> list[tuple[Key, str]]:
        """The NAS is read-only to this tool: a node hub or engram_dir that is the NAS hub, lies in it
        or holds it would have the mirror (its lock file, its temp sweep) write on the NAS. This
        compares spellings; `refuse_source_overlap` compares identities when a command writes."""
        problems = []
        for name, node in self.nodes.items():
            sources = _local_paths([self.nas.hub, node.source])
            for key in ("hub", "engram_dir"):
                dest = getattr(node, key)
                problems += [(("nodes", name, key), f"{dest} overlaps the source hub {source}, which this tool "
                              "never writes") for source in sources if dest and _overlap(dest, source)]
        return problems

    def node(self, name: str) -> NodeConfig:
        if name not in self.nodes:
            known = ", ".join(sorted(self.nodes)) or "none"
            raise BadInput(f"{self.path}: nodes.{name}: no such node (known: {known})")
        return self.nodes[name]

    def local_sources(self, extra: list[str] = ()) -> list[str]:
        """Every local spelling of a source this tool must never write: the NAS hub, its alias
        targets, and any local source given on the command line. sftp:// sources are not local."""
        return _local_paths([self.nas.hub, *self.nas.aliases.values(), *extra])

    def refuse_source_overlap(self, key: str, dest: str, extra: list[str] = ()) -> None:
        """Exit 2 when a destination (`key` = `dest`) is, lies in, or holds a local source,
        however spelled (see identity.py).

        Checked when a command is about to write, not when the manifest is parsed: a node hub that
        was a symlink to the NAS passed a comparison of spellings, and the mirror wrote its lock
        into the NAS; an engram_dir linked into a NAS repo got shards written there."""
        for root in self.local_sources(extra):
            if identity.overlap(dest, root):
                shown = identity.resolved(dest)
                via = f" (resolves to {shown})" if shown != dest else ""
                raise BadInput(f"{self.path}: {key}: {dest}{via} is, lies inside or holds the source {root}; "
                               "this tool never writes there")

    def source_for(self, node_name: str) -> str:
        """Where this node stages from: its own `source` override, else the NAS hub."""
        return self.node(node_name).source or self.nas.hub


def _local_paths(hubs: list[str | None]) -> list[str]:
    """The hubs given as paths or file:// URLs, as paths; an sftp:// hub is not on this host."""
    return [h.removeprefix("file://") for h in hubs if h and ("://" not in h or h.startswith("file://"))]


def _overlap(a: str, b: str) -> bool:
    a, b = os.path.normpath(a), os.path.normpath(b)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _dotted(key: Key) -> str:
    return ".".join(f'"{part}"' if re.search(r"[^A-Za-z0-9_-]", str(part)) else str(part) for part in key)


def resolve_manifest_path(explicit: str | os.PathLike | None) -> Path:
    """`--manifest`, else $STAGE_MANIFEST, else manifests/cluster.toml in the working directory
    (absolute, so that every message names the file wherever the command was run from)."""
    if explicit:
        return Path(explicit)
    if os.environ.get(MANIFEST_ENV):
        return Path(os.environ[MANIFEST_ENV])
    return Path.cwd() / DEFAULT_MANIFEST


_default_in_use: Path | None = None


def default_in_use() -> Path | None:
    """The default manifest, if this process read (or tried to read) it for want of `--manifest`
    and $STAGE_MANIFEST: an error then names it, since the operator never did (a cron job run from
    another directory once failed on "lock held" with no word of which cluster it meant)."""
    return _default_in_use


def load_manifest(explicit: str | os.PathLike | None = None) -> Manifest:
    global _default_in_use
    path = resolve_manifest_path(explicit)
    if not explicit and not os.environ.get(MANIFEST_ENV):
        _default_in_use = path
    try:
        # A manifest may be a symlink (to a shared config checkout); a FIFO or /dev/zero is refused.
        raw = tomllib.loads(read_regular(path, MANIFEST_LIMIT, follow=True).decode("utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: manifest not found (use --manifest PATH or set {MANIFEST_ENV})") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read manifest: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: cannot read manifest: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not valid TOML: {exc}") from None
    return read_manifest(raw, str(path))


def read_manifest(raw: dict, path: str) -> Manifest:
    """The manifest in `raw` (parsed TOML), or BadInput listing every problem, each under its key."""
    nul = _nul_keys(raw)
    if nul:
        raise BadInput(f"{path}: " + "; ".join(f"{_dotted(key)}: a NUL byte cannot be in a path or name"
                                               for key in nul))
    problems: list[tuple[Key, str]] = []
    manifest = _read(_table(Manifest, path=path), raw, (), problems)
    if problems:
        # Every problem, on one line: fixing them one run at a time wastes an operator's evening.
        raise BadInput(f"{path}: " + "; ".join(f"{_dotted(key)}: {message}" if key else message
                                               for key, message in problems))
    return manifest  # type: ignore[return-value]


def _nul_keys(value: object, key: Key = ()) -> list[Key]:
    """Keys whose name or string value holds a NUL byte (no path or repo id can)."""
    if isinstance(value, str):
        return [key] if "\0" in value else []
    if isinstance(value, dict):
        found = [(*key, k) for k in value if "\0" in k]
        return found + [f for k, v in value.items() for f in _nul_keys(v, (*key, k))]
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in _nul_keys(v, (*key, i))]
    return []
