"""Durable records next to staged or archived data: SHA256SUMS, JSON-lines journals, MOVED.txt.

SHA256SUMS uses GNU coreutils' text format (`<64 hex>  <name>`), so `sha256sum -c
SHA256SUMS` run in that directory is the independent check.  Updates rewrite the
whole file atomically and keep every line for other names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stager.atomic import atomic_write_bytes, fsync_dir, open_for_write

SUMS_NAME = "SHA256SUMS"


def _escape(name: str) -> tuple[str, str]:
    """GNU escaping: a name with a backslash or newline is written escaped, and the line starts with '\\'."""
    if "\\" in name or "\n" in name or "\r" in name:
        return "\\", name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "", name


def _unescape(name: str) -> str:
    out, i = [], 0
    while i < len(name):
        if name[i] == "\\" and i + 1 < len(name):
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(name[i + 1], name[i + 1]))
            i += 2
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def read_sums(path: Path) -> dict[str, str]:
    """name -> sha256 from a GNU SHA256SUMS file (missing file: empty)."""
    sums: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return sums
    for line in text.splitlines():
        escaped = line.startswith("\\")
        body = line[1:] if escaped else line
        if len(body) < 66 or body[64:66] not in ("  ", " *"):
            continue
        name = body[66:]
        sums[_unescape(name) if escaped else name] = body[:64].lower()
    return sums


def update_sums(path: Path, entries: dict[str, str]) -> None:
    """Set `entries` (name -> sha256) in the SHA256SUMS at `path`, keeping all other lines."""
    sums = read_sums(path)
    sums.update(entries)
    lines = []
    for name in sorted(sums):
        prefix, written = _escape(name)
        lines.append(f"{prefix}{sums[name]}  {written}\n")
    atomic_write_bytes(path, "".join(lines).encode("utf-8", errors="surrogateescape"))


def append_journal(path: Path, record: dict) -> None:
    """Append one JSON line and fsync: the journal is the audit trail, so it must survive a crash."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = open_for_write(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def read_journal(path: Path) -> list[dict]:
    """Records of a JSON-lines journal; a torn last line (crash mid-append) is ignored."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


MOVED_NAME = "MOVED.txt"


def moved_block(*, destination: str, sums: str, host: str, time: str, files: list[tuple[str, int, str, str]]) -> str:
    """One run's section of a MOVED.txt: where the files went and the per-file sha256.

    `files` holds (sha256, bytes, name relative to the MOVED.txt, "copied" | "adopted").
    The name comes last and uses the SHA256SUMS escaping, so every file line parses as
    `<sha256>  <bytes>  <copied|adopted>  <name>` whatever the name holds.
    """
    total = sum(size for _, size, _, _ in files)
    lines = [
        f"destination: {destination}",
        f"sums: {sums}",
        f"time: {time}",
        f"host: {host}",
        f"bytes: {total}",
        f"files: {len(files)}",
    ]
    for sha256, size, name, how in files:
        prefix, written = _escape(name)
        lines.append(f"{prefix}{sha256}  {size}  {how}  {written}")
    return "\n".join(lines) + "\n"
