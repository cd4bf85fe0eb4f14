"""Who uses a file right now: open descriptors, memory maps, and bind mounts in other mount namespaces.

Trust model: the kernel's /proc is the only witness, read at the moment of the question and never
remembered. Files are compared by identity, `(st_dev, st_ino)`, never by the path a process shows:
a container sees a staged blob under its own path (`/hf/hub/...`), and a deleted-but-mapped file
shows as "(deleted)". Nothing here opens, reads or stats a file that is not already known to be
one of the files asked about, so a hung NFS mount that another process has open is never touched:
descriptors are matched by the inode number in /proc/<pid>/fdinfo first, mappings by the device
and inode columns of /proc/<pid>/maps, mounts by the device column of /proc/<pid>/mountinfo.

What it cannot see: processes in another pid namespace that this one cannot enter (run on the
host, as root), and processes on other hosts (an NFS client elsewhere). An inference engine
mmaps its safetensors and keeps the mapping after closing the descriptor; the container launcher
bind-mounts staged files read-only: both are seen.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from stager.base import identity

FileId = tuple[int, int]  # (st_dev, st_ino)
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Use:
    """One process using one file: how (open, mapped, bind-mounted at a path), its pid and command."""

    pid: int
    command: str
    how: str

    def describe(self) -> str:
        return f"{self.how} by pid {self.pid} ({self.command})"


def command_of(pid: int) -> str:
    """The process's command line (its name when the line is empty, as for a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            args = handle.read(4096).split(b"\0")
        line = " ".join(os.fsdecode(a) for a in args if a)
        if line:
            return line[:200]
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def _pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def _by_descriptor(pid: int, ids: set[FileId], found: dict[FileId, list[Use]]) -> None:
    for file_id in identity.open_by(pid, ids):
        found.setdefault(file_id, []).append(Use(pid, command_of(pid), "open"))


def _by_mapping(pid: int, numbers: set[int], ids: set[FileId], found: dict[FileId, list[Use]]) -> None:
    """Mapped files, from the device and inode columns of /proc/<pid>/maps. A device that differs
    for an inode asked about (btrfs subvolumes and overlayfs report another device in stat()) is
    settled by a stat of the mapping itself in /proc/<pid>/map_files."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="surrogateescape") as handle:
            lines = handle.readlines()
    except OSError:
        return
    seen: set[FileId] = set()
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[4] == "0":
            continue
        try:
            ino = int(fields[4])
        except ValueError:
            continue
        if ino not in numbers:
            continue
        major, _, minor = fields[3].partition(":")
        try:
            dev = os.makedev(int(major, 16), int(minor, 16))
        except ValueError:
            continue
        file_id = (dev, ino)
        if file_id not in ids:
            try:
                st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
            except OSError:
                continue
            file_id = (st.st_dev, st.st_ino)
            if file_id not in ids:
                continue
        if file_id not in seen:
            seen.add(file_id)
            found.setdefault(file_id, []).append(Use(pid, command_of(pid), "memory-mapped"))


def _namespaces() -> dict[str, int]:
    """Mount namespaces other than ours: namespace -> its lowest pid."""
    try:
        mine = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return {}
    others: dict[str, int] = {}
    for pid in _pids():
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        if ns != mine:
            others.setdefault(ns, pid)
    return others


def _by_mount(devices: set[str], ids: set[FileId], dirs: dict[FileId, list[FileId]],
              found: dict[FileId, list[Use]]) -> None:
    """Bind mounts in other mount namespaces whose root is one of `ids`, or a directory in `dirs`
    (a directory -> the files below it that it exposes). Only mounts of the filesystems in
    `devices` (mountinfo's major:minor) are looked at, each by a stat of its root through the
    namespace's own view (/proc/<pid>/root/<mount point>), so the comparison is by identity: a
    namespace's copy of the whole filesystem (every `unshare -m` and systemd PrivateTmp unit has
    one) has the filesystem's root there, which holds no file of a repo by itself."""
    for pid in _namespaces().values():
        try:
            with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
                lines = handle.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 5 or fields[2] not in devices:
                continue
            point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
            try:
                st = os.lstat(f"/proc/{pid}/root{point}")
            except OSError:
                continue
            root = (st.st_dev, st.st_ino)
            exposed = ([root] if root in ids else []) + dirs.get(root, [])
            for file_id in exposed:
                found.setdefault(file_id, []).append(Use(pid, command_of(pid), f"bind-mounted at {point}"))


def users(ids: set[FileId], *, dirs: dict[FileId, list[FileId]] | None = None,
          devices: set[str] = frozenset()) -> dict[FileId, list[Use]]:
    """Every use of the files `ids` on this host: open by a process, memory-mapped, or
    bind-mounted into another mount namespace (the file itself, or a directory of `dirs` above it
    on a filesystem of `devices`). Files nobody uses are absent from the answer."""
    found: dict[FileId, list[Use]] = {}
    if not ids:
        return found
    numbers = {ino for _dev, ino in ids}
    me = os.getpid()
    for pid in _pids():
        if pid == me:
            continue
        _by_descriptor(pid, ids, found)
        _by_mapping(pid, numbers, ids, found)
    if devices:
        _by_mount(set(devices), ids, dirs or {}, found)
    return found
