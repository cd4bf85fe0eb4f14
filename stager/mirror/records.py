"""Durable records next to staged or archived data: SHA256SUMS, JSON-lines journals, MOVED.txt.

SHA256SUMS uses GNU coreutils' text format (`<64 hex>  <name>`), so `sha256sum -c
SHA256SUMS` run in that directory is the independent check.  Updates rewrite the
whole file atomically and keep every line for other names.

Records are never read or written through a symlink: a link planted at a record's name would
otherwise have root copy its target's content into the record, or write into the target.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from stager.base.atomic import atomic_write_bytes, fsync_dir, open_for_write
from stager.base.errors import CannotRun
from stager.base.small_files import read_regular

SUMS_NAME = "SHA256SUMS"
MOVED_NAME = "MOVED.txt"

MOVED_HEADER = """\
# Files listed below were moved out of this directory by `stage archive`.
# Each was hashed (SHA-256) while it was copied; the copy was then re-read from the
# destination and hashed again, and the original was deleted only after both matched.
# Check the archive with:  cd <directory of the sums file> && sha256sum -c SHA256SUMS
"""


def read_record(path: Path) -> str | None:
    """The text of a record file, None if it does not exist; a symlink at `path` is exit 3."""
    try:
        return read_regular(path).decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CannotRun(f"{path} is a symlink; refusing to use it as a record") from None
        if exc.errno == errno.EINVAL:
            raise CannotRun(f"{path} is not a regular file; refusing to use it as a record") from None
        raise


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


def _parse_sums_line(line: str) -> tuple[str, str] | None:
    """(name, sha256) of one SHA256SUMS line, None for a line in another format."""
    escaped = line.startswith("\\")
    body = line[1:] if escaped else line
    if len(body) < 66 or body[64:66] not in ("  ", " *"):
        return None
    name = body[66:]
    return (_unescape(name) if escaped else name), body[:64].lower()


def read_sums(path: Path) -> dict[str, str]:
    """name -> sha256 from a GNU SHA256SUMS file (missing file: empty)."""
    # "\n" only: str.splitlines() also splits at \x1c, \x85 and others, which GNU leaves raw in a name.
    parsed = map(_parse_sums_line, (read_record(path) or "").split("\n"))
    return dict(entry for entry in parsed if entry is not None)


def update_sums(path: Path, entries: dict[str, str]) -> None:
    """Set `entries` (name -> sha256) in the SHA256SUMS at `path`, keeping all other lines."""
    sums = read_sums(path) | entries
    lines = []
    for name in sorted(sums):
        prefix, written = _escape(name)
        lines.append(f"{prefix}{sums[name]}  {written}\n")
    atomic_write_bytes(path, "".join(lines).encode("utf-8", errors="surrogateescape"))


def drop_from_sums(path: Path, gone: set[str]) -> None:
    """Remove the lines of a SHA256SUMS that name a file in `gone` (absolute, normalized paths),
    keeping every other line verbatim; a file left with no line is removed, since `sha256sum -c`
    fails on an empty list."""
    text = read_record(path)
    if text is None:
        return
    lines = text.split("\n")
    kept = [line for line in lines if not _names_one_of(line, path.parent, gone)]
    if len(kept) == len(lines):
        return
    if any(line.strip() for line in kept):
        atomic_write_bytes(path, "\n".join(kept).encode("utf-8", errors="surrogateescape"))
    else:
        os.unlink(path)
        fsync_dir(path.parent)


def _names_one_of(line: str, directory: Path, paths: set[str]) -> bool:
    entry = _parse_sums_line(line)
    return entry is not None and os.path.normpath(os.path.join(directory, entry[0])) in paths


def append_record(path: Path, data: bytes) -> None:
    """Append and fsync, never through a link. Appending, not rewriting, so two runs recording into
    one file at once never drop each other's lines."""
    fd = open_for_write(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        _append_and_sync(fd, data)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def _append_and_sync(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def append_journal(path: Path, records: list[dict]) -> None:
    """Append JSON lines and fsync once: the journal is the audit trail, so it must survive a crash."""
    append_record(path, "".join(json.dumps(record, sort_keys=True) + "\n" for record in records).encode())


def read_journal(path: Path) -> list[dict]:
    """Records of a JSON-lines journal; a torn last line (crash mid-append) is ignored."""
    records = []
    for line in (read_record(path) or "").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def moved_block(*, destination: str, sums: str, host: str, time: str, files: list[tuple[str, int, str, str]]) -> str:
    """One section of a MOVED.txt: where the files went and the per-file sha256.

    `files` holds (sha256, bytes, name relative to the MOVED.txt, "copied" | "adopted").
    The name comes last and uses the SHA256SUMS escaping, so every file line parses as
    `<sha256>  <bytes>  <copied|adopted>  <name>` whatever the name holds, and every header line
    as `<key>: <value>` with the same escaping.
    """
    total = sum(size for _, size, _, _ in files)
    header = {"destination": destination, "sums": sums, "time": time, "host": host, "bytes": str(total),
              "files": str(len(files))}
    lines = []
    for key, value in header.items():
        # Paths may hold a newline too: escaped the same way, the '\\' before the key saying so.
        prefix, written = _escape(value)
        lines.append(f"{prefix}{key}: {written}")
    for sha256, size, name, how in files:
        prefix, written = _escape(name)
        lines.append(f"{prefix}{sha256}  {size}  {how}  {written}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def moved_record(path: Path) -> Iterator[Callable[[str], None]]:
    """Hold the MOVED.txt at `path` (created if missing) under an exclusive lock and yield a
    function that adds one section to it (the header first, in a new one); earlier sections, and
    notes written by hand, stay as they are.

    Two archives of one source directory into different DESTs hold different DEST locks, so this
    lock is what orders their records in the source: without it both read an empty MOVED.txt,
    both wrote the header, and the two sections ran together into one. The caller rewrites the
    SHA256SUMS files beside it while holding it, for the same reason."""
    fd = open_for_write(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)

        def append(block: str) -> None:
            size = os.fstat(fd).st_size
            lead = MOVED_HEADER if size == 0 else "\n" if os.pread(fd, 1, size - 1) == b"\n" else "\n\n"
            _append_and_sync(fd, (lead + block).encode("utf-8", errors="surrogateescape"))
            fsync_dir(path.parent)

        yield append
    finally:
        os.close(fd)  # releases the lock


def journal_tail(path: Path, commit_event: str = "removed") -> tuple[dict | None, list[dict]]:
    """(the last record whose `event` is `commit_event`, the records after it) of a JSON-lines
    journal, read backwards from its end in chunks: a journal grows for the life of a node, while
    a run needs only its last commit and what a killed run wrote after it. A torn last line is
    ignored; a journal that is missing, or a link, reads as empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None, []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, []
        end = os.fstat(fd).st_size
        tail = b""
        later: list[dict] = []
        while True:
            start = max(0, end - (1 << 20))
            tail = os.pread(fd, end - start, start) + tail
            end = start
            lines = tail.split(b"\n")
            tail = lines.pop(0) if start > 0 else b""  # a partial first line waits for the next chunk
            for line in reversed(lines):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("event") == commit_event:
                    return record, later[::-1]
                later.append(record)
            if start == 0:
                return None, later[::-1]
    finally:
        os.close(fd)
