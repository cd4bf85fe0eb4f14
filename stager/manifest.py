"""The cluster manifest (`manifests/*.toml`): what each node stages, validated by pydantic.

Every key that operators write is a field here; unknown keys are refused, because
a typo such as `exlcude` would otherwise stage files the operator meant to keep
on the NAS.  Errors name the file, the dotted key and what was expected.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from stager import identity
from stager.errors import BadInput
from stager.units import parse_size

DEFAULT_MANIFEST = Path("manifests/cluster.toml")
MANIFEST_ENV = "STAGE_MANIFEST"

# A node's SSH address for peers: [user@]host[:port]; a URL or a path here is a mistake.
_SSH_ADDRESS = re.compile(r"^([A-Za-z0-9._-]+@)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?$")

# Hub repo ids: "name" or "owner/name", the characters the Hub itself allows.
# Anything else (notably "..") could make a repo directory outside the hub.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _size(value: object) -> int:
    try:
        return parse_size(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(str(exc)) from None


ByteSize = Annotated[int, BeforeValidator(_size)]


class _Strict(BaseModel):
    # strict: `world = "3"` is a string where a count belongs, not a count (TOML has both types).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NasConfig(_Strict):
    hub: str = Field(description="The NAS's Hugging Face hub cache: a path, or an sftp:// URL")
    aliases: dict[str, str] = Field(default_factory=dict)

    @field_validator("aliases")
    @classmethod
    def _absolute_aliases(cls, aliases: dict[str, str]) -> dict[str, str]:
        for prefix, target in aliases.items():
            if not prefix.startswith("/") or not target.startswith("/"):
                raise ValueError(f"alias {prefix!r} = {target!r}: both sides must be absolute paths")
        return aliases


class ModelConfig(_Strict):
    revision: str = "main"
    exclude: list[str] = Field(default_factory=list)

    @field_validator("revision")
    @classmethod
    def _safe_revision(cls, revision: str) -> str:
        parts = revision.split("/")
        if not revision or revision.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"expected a branch, tag or commit, got {revision!r}")
        return revision


class NodeConfig(_Strict):
    hub: str = Field(description="Node-local hub cache: the mirror's destination")
    reserve: ByteSize = 0
    models: list[str] = Field(default_factory=list)
    engram_dir: str | None = None
    rank: int | None = Field(default=None, ge=0)
    ranks: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, description="The TP ranks this node "
                                                            "serves, one per GPU; `rank` for a single one")
    source: str | None = Field(default=None, description="Overrides nas.hub as this node's source")
    address: str | None = Field(default=None, description="[user@]host[:port]: where peers reach this node's "
                                "hub over SFTP (`stage fleet mirror --fan-out`)")

    @field_validator("models")
    @classmethod
    def _listed_once(cls, models: list[str]) -> list[str]:
        twice = sorted({m for m in models if models.count(m) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return models

    @field_validator("address")
    @classmethod
    def _ssh_address(cls, address: str | None) -> str | None:
        if address is not None and not _SSH_ADDRESS.match(address):
            raise ValueError(f"expected [user@]host[:port], got {address!r}")
        return address

    @field_validator("hub", "engram_dir")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isabs(path):
            raise ValueError(f"expected an absolute path, got {path!r}")
        return path

    @field_validator("ranks")
    @classmethod
    def _ranks_once(cls, ranks: list[int] | None) -> list[int] | None:
        if ranks is not None and not ranks:
            raise ValueError("an empty list serves no rank; leave ranks out to serve every rank")
        twice = sorted({r for r in ranks or () if ranks.count(r) > 1})
        if twice:
            raise ValueError(f"rank {twice[0]} listed more than once")
        return ranks

    @model_validator(mode="after")
    def _rank_or_ranks(self) -> "NodeConfig":
        if self.rank is not None and self.ranks is not None:
            raise ValueError("rank and ranks are both set; keep one (ranks = [...] for several)")
        return self

    @property
    def engram_ranks(self) -> list[int] | None:
        """The TP ranks this node serves (`ranks`, else `rank`); None when neither is set."""
        return self.ranks if self.ranks is not None else None if self.rank is None else [self.rank]


class EngramConfig(_Strict):
    model: str
    world: int = Field(ge=1)
    layout: Literal["floor", "heads"] = "floor"
    engram_head_rows: list[int] | None = None
    layers: list[int] | None = None


class Manifest(_Strict):
    nas: NasConfig
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    nodes: dict[str, NodeConfig] = Field(default_factory=dict)
    engram: EngramConfig | None = None
    path: str = Field(default="", exclude=True, description="Where the manifest was read from")

    @field_validator("models")
    @classmethod
    def _repo_ids(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for repo_id in models:
            if not _REPO_ID.match(repo_id) or ".." in repo_id:
                raise ValueError(f"model {repo_id!r} is not a valid repo id (expected 'owner/name')")
        return models

    @model_validator(mode="after")
    def _references_exist(self) -> "Manifest":
        for name, node in self.nodes.items():
            for repo_id in node.models:
                if repo_id not in self.models:
                    raise ValueError(f"nodes.{name}.models: {repo_id!r} has no [models.\"{repo_id}\"] table")
        if self.engram is not None and self.engram.model not in self.models:
            raise ValueError(f"engram.model: {self.engram.model!r} has no [models.\"{self.engram.model}\"] table")
        return self

    @model_validator(mode="after")
    def _destinations_apart_from_sources(self) -> "Manifest":
        """The NAS is read-only to this tool: a node hub or engram_dir that is the NAS hub, lies in it
        or holds it would have the mirror (its lock file, its temp sweep) write on the NAS."""
        for name, node in self.nodes.items():
            sources = [s.removeprefix("file://") for s in (self.nas.hub, node.source)
                       if s and ("://" not in s or s.startswith("file://"))]
            for key in ("hub", "engram_dir"):
                dest = getattr(node, key)
                for source in sources:
                    if dest and _overlap(dest, source):
                        raise ValueError(f"nodes.{name}.{key}: {dest} overlaps the source hub {source}, "
                                         "which this tool never writes")
        return self

    def node(self, name: str) -> NodeConfig:
        if name not in self.nodes:
            known = ", ".join(sorted(self.nodes)) or "none"
            raise BadInput(f"{self.path}: nodes.{name}: no such node (known: {known})")
        return self.nodes[name]

    def local_sources(self, extra: list[str] = ()) -> list[str]:
        """Every local spelling of a source this tool must never write: the NAS hub, its alias
        targets, and any local source given on the command line. sftp:// sources are not local."""
        roots = [self.nas.hub, *self.nas.aliases.values(), *extra]
        return [r.removeprefix("file://") for r in roots if r and ("://" not in r or r.startswith("file://"))]

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


def _overlap(a: str, b: str) -> bool:
    a, b = os.path.normpath(a), os.path.normpath(b)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _dotted(loc: tuple) -> str:
    parts = []
    for item in loc:
        text = str(item)
        parts.append(f'"{text}"' if re.search(r"[^A-Za-z0-9_-]", text) else text)
    return ".".join(parts)


def _describe(error: dict) -> str:
    key = _dotted(tuple(p for p in error["loc"] if not str(p).startswith("function-")))
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{key}: unknown key"
    if kind == "missing":
        return f"{key}: required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    if kind not in ("value_error", "assertion_error") and not isinstance(got, dict):
        message = f"{message}, got {got!r}"
    return f"{key}: {message}" if key else message


def resolve_manifest_path(explicit: str | os.PathLike | None) -> Path:
    """`--manifest`, else $STAGE_MANIFEST, else manifests/cluster.toml in the working directory."""
    if explicit:
        return Path(explicit)
    if os.environ.get(MANIFEST_ENV):
        return Path(os.environ[MANIFEST_ENV])
    return DEFAULT_MANIFEST


def load_manifest(explicit: str | os.PathLike | None = None) -> Manifest:
    path = resolve_manifest_path(explicit)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: manifest not found (use --manifest PATH or set {MANIFEST_ENV})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read manifest: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not valid TOML: {exc}") from None
    if "path" in raw:
        raise BadInput(f"{path}: path: unknown key")
    nul = _nul_keys(raw)
    if nul:
        raise BadInput(f"{path}: " + "; ".join(f"{key}: a NUL byte cannot be in a path or name" for key in nul))
    try:
        return Manifest.model_validate({**raw, "path": str(path)})
    except ValidationError as exc:
        # Every problem, on one line: fixing them one run at a time wastes an operator's evening.
        raise BadInput(f"{path}: " + "; ".join(_describe(error) for error in exc.errors())) from None


def _nul_keys(value: object, key: tuple = ()) -> list[str]:
    """Dotted keys whose key or string value holds a NUL byte (no path or repo id can)."""
    if isinstance(value, str):
        return [_dotted(key)] if "\0" in value else []
    if isinstance(value, dict):
        found = [_dotted((*key, k)) for k in value if "\0" in str(k)]
        return found + [f for k, v in value.items() for f in _nul_keys(v, (*key, k))]
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in _nul_keys(v, (*key, i))]
    return []
