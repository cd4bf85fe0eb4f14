"""Who holds a file or directory right now: descriptors, memory maps, working and root
directories, and mounts in every mount namespace, this process's own included.

Trust model: the kernel's /proc is the only witness, read at the moment of the question and never
remembered. Files are compared by identity, `(st_dev, st_ino)`, never by the path a process shows:
a container sees a staged blob under its own path (`/hf/hub/...`), and a deleted-but-mapped file
shows as "(deleted)". Nothing here opens, reads or stats a file that is not already known to be
on one of the node's filesystems, so a hung NFS mount that another process uses is never touched:
descriptors are matched by the inode number in /proc/<pid>/fdinfo first, mappings by the device
and inode columns of /proc/<pid>/maps, mounts by the device column of mountinfo, and a working or
root directory is stat'ed only when the mount it lies on (the longest mount point over the path
/proc/<pid>/cwd reads, in that process's namespace) is of the node's filesystems.

What it cannot see: processes in another pid namespace that this one cannot enter (run on the
host, as root), and processes on other hosts (an NFS client elsewhere). An inference engine
mmaps its safetensors and keeps the mapping after closing the descriptor; the container launcher
bind-mounts staged files read-only; `cd <snapshot> && serve --model .` keeps only its working
directory there: all are seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stager.base import identity

FileId = tuple[int, int]  # (st_dev, st_ino)
SELF = "self"
CWD, ROOT = "working directory", "root directory"


@dataclass(frozen=True)
class Use:
    """One holder of one file or directory: a process (`pid`, its command) and how it holds it,
    or a mount of this process's own namespace (`pid` None), which no one process holds."""

    pid: int | None
    command: str
    how: str  # open | memory-mapped | working directory | root directory | bind-mounted at P | a mount at P
    mount: str | None = None  # the mount point, in the holder's namespace
    shows: str | None = None  # what that mount shows (its source, as this namespace sees it)

    def describe(self) -> str:
        shown = f", showing {self.shows}" if self.shows else ""
        if self.pid is None:
            return f"{self.how}{shown} (this mount namespace)"
        if self.how in (CWD, ROOT):
            return f"the {self.how} of pid {self.pid} ({self.command})"
        if self.mount is not None:
            return f"{self.how}{shown} in the mount namespace of pid {self.pid} ({self.command})"
        return f"{self.how} by pid {self.pid} ({self.command})"

    def to_json(self) -> dict:
        return {"pid": self.pid, "command": self.command, "how": self.how, "mount": self.mount, "shows": self.shows}


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


def _namespaces() -> dict[str, int | str]:
    """Every mount namespace on the host -> how to read it: SELF for this process's own, else its
    lowest pid."""
    try:
        mine = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return {}
    spaces: dict[str, int | str] = {mine: SELF}
    for pid in _pids():
        try:
            spaces.setdefault(os.readlink(f"/proc/{pid}/ns/mnt"), pid)
        except OSError:
            continue
    return spaces


class _Tables:
    """Each mount namespace's mount table, read once per question, by the namespace's reader."""

    def __init__(self, spaces: dict[str, int | str]):
        self.spaces = spaces
        self._tables: dict[str, list[identity.Mount]] = {}

    def of(self, ns: str) -> list[identity.Mount]:
        if ns not in self._tables:
            self._tables[ns] = identity.mount_table(self.spaces[ns]) if ns in self.spaces else []
        return self._tables[ns]

    def of_pid(self, pid: int) -> list[identity.Mount]:
        try:
            return self.of(os.readlink(f"/proc/{pid}/ns/mnt"))
        except OSError:
            return []


def _on_devices(path: str, table: list[identity.Mount], devices: set[str]) -> bool:
    """Whether `path` lies on a mount of one of `devices` (the longest mount point over it)."""
    best: identity.Mount | None = None
    for mount in table:  # a later mount on the same point hides the earlier one: >= keeps the last
        if (path == mount.point or path.startswith(mount.point.rstrip("/") + "/")) and \
                (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best is not None and best.device in devices


def _by_directory(pid: int, ids: set[FileId], devices: set[str], tables: _Tables,
                  found: dict[FileId, list[Use]]) -> None:
    """The process's working and root directories. The path /proc/<pid>/cwd reads (in the
    process's own namespace) picks the mount it is on, and only one of the node's filesystems is
    stat'ed: an operator's shell sitting in a hung NFS mount is never touched."""
    for link, how in ((f"/proc/{pid}/cwd", CWD), (f"/proc/{pid}/root", ROOT)):
        try:
            where = os.readlink(link)
        except OSError:
            continue
        if not where.startswith("/") or where.endswith(" (deleted)"):
            continue
        if not _on_devices(where, tables.of_pid(pid), devices):
            continue
        try:
            st = os.stat(link)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in ids:
            found.setdefault((st.st_dev, st.st_ino), []).append(Use(pid, command_of(pid), how))


def _by_mount(devices: set[str], wanted: set[FileId], tables: _Tables, found: dict[FileId, list[Use]]) -> None:
    """Mounts, in every mount namespace and this one too, whose root is one of `wanted`. Only
    mounts of the filesystems in `devices` (mountinfo's major:minor) are looked at, each by a stat
    of its root through the namespace's own view (/proc/<pid>/root/<mount point>), so the
    comparison is by identity: a namespace's copy of the whole filesystem (every `unshare -m` and
    systemd PrivateTmp unit has one) has the filesystem's root there, which holds nothing asked
    about by itself."""
    for ns, reader in tables.spaces.items():
        table = tables.of(ns)
        for mount in table:
            if mount.device not in devices:
                continue
            try:
                st = os.lstat(f"/proc/{reader}/root{mount.point}")
            except OSError:
                continue
            root = (st.st_dev, st.st_ino)
            if root not in wanted:
                continue
            how = f"bind-mounted at {mount.point}"
            shows = identity.shown_at(mount, table)
            use = Use(None, "", how, mount.point, shows) if reader == SELF else \
                Use(int(reader), command_of(int(reader)), how, mount.point, shows)
            found.setdefault(root, []).append(use)


def users(ids: set[FileId], *, exposing: set[FileId] = frozenset(),
          devices: set[str] = frozenset()) -> dict[FileId, list[Use]]:
    """Every holder on this host of the files and directories `ids`: a process that has one open
    or mapped, or has one as its working or root directory; and a mount whose root is one of them
    or one of `exposing` (directories a mount of which exposes them: a repo, its blobs/), in any
    mount namespace including this one. Mounts and directories are looked for on the filesystems
    of `devices` only. What nobody holds is absent from the answer."""
    found: dict[FileId, list[Use]] = {}
    if not ids and not exposing:
        return found
    numbers = {ino for _dev, ino in ids}
    tables = _Tables(_namespaces())
    me = os.getpid()
    for pid in _pids():
        if pid == me:
            continue
        _by_descriptor(pid, ids, found)
        _by_mapping(pid, numbers, ids, found)
        if devices:
            _by_directory(pid, ids, set(devices), tables, found)
    if devices:
        _by_mount(set(devices), set(ids) | set(exposing), tables, found)
    return found
