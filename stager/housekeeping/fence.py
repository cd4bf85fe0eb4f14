"""Where the node's paths end: a root's own filesystem and mount, which prune never leaves.

Trust model: a directory belongs to a root's tree when the descriptor that opened it has the
root's st_dev and the root's mount id, both read from that descriptor at that moment (fstat, and
the `mnt_id` of /proc/self/fdinfo); only then is it listed, and only through it is anything
removed. Directories are opened one level at a time relative to their parent's descriptor, with
O_NOFOLLOW|O_DIRECTORY, so a link or a mount put in place of a path after it was checked cannot
redirect a removal. The mount table (/proc/self/mountinfo) names what a mount shows and finds a
file bound over a file, which has no directory to open; it is read at each check, never kept.

Why the mount id and not st_dev alone: a bind of a NAS directory that lies on the hub's own
filesystem (a second mount of that filesystem, or the NAS exported from it) has the hub's st_dev,
and a prune once walked into such a bind in a node snapshot and deleted the NAS's files. Why
fdinfo and not statx's STX_MNT_ID: Python 3.11's os has no statx, and a mount id read from the very
descriptor the walk then acts through leaves no window between the check and the use (Linux 3.15
and later have it; without it nothing is entered). Only directories are compared by st_dev: on
overlayfs a regular file reports the st_dev of the layer it lives in.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import NamedTuple

from stager.base import identity
from stager.base.errors import CannotRun

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Crossing:
    """A mount found inside a root: what lies beyond it is not the node's, and is never entered."""

    point: str
    shows: str  # the directory it shows, as this namespace sees it (or source:root)

    def to_json(self) -> dict:
        return {"point": self.point, "shows": self.shows}


class Beyond(Exception):
    """A directory on the way to a path, or inside what is to go, is on another mount or
    filesystem than the root's."""

    def __init__(self, crossing: Crossing):
        super().__init__(f"a mount at {crossing.point} (showing {crossing.shows}): never entered")
        self.crossing = crossing


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def open_dir(name: str, dir_fd: int | None = None) -> int:
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


@dataclass(frozen=True)
class Fence:
    """A root directory's filesystem (st_dev) and mount (mount id)."""

    root: str  # resolved
    dev: int
    mount: int

    @classmethod
    def of(cls, root: str) -> "Fence":
        fd = open_dir(root)
        try:
            mount = identity.mount_id(fd)
            if mount is None:
                raise CannotRun(f"cannot tell which mount {root} lies on: /proc/self/fdinfo gives no mnt_id "
                                "(Linux 3.15 or later with /proc mounted is needed)")
            return cls(root, os.fstat(fd).st_dev, mount)
        finally:
            os.close(fd)

    def holds(self, fd: int) -> bool:
        """The open directory `fd` is on this root's filesystem and mount."""
        return os.fstat(fd).st_dev == self.dev and identity.mount_id(fd) == self.mount

    def mounts_below(self) -> dict[str, Crossing]:
        """Every mount strictly below the root in this namespace, by mount point, read now."""
        table = identity.mount_table()
        return {m.point: Crossing(m.point, identity.shown_at(m, table)) for m in table
                if m.point != self.root and under(m.point, self.root)}

    def crossing_at(self, path: str) -> Crossing:
        """What the mount table says is mounted at `path`, found on the way by its descriptor."""
        table = identity.mount_table()
        found = [m for m in table if m.point == path]
        if found:
            return Crossing(path, identity.shown_at(found[-1], table))
        return Crossing(path, "another mount or filesystem (not in this namespace's mount table)")


class Entry(NamedTuple):
    """A directory entry as the scan saw it (lstat: a link is never followed). A tuple, not a
    dataclass: a scan makes one per name, 100,000 and more."""

    name: str
    path: str
    st: os.stat_result
    is_dir: bool


class View:
    """The scan's look at one root: directories are listed only on the root's own mount, and every
    mount met on the way is recorded in `crossings` instead of being entered."""

    def __init__(self, fence: Fence):
        self.fence = fence
        self.crossings: dict[str, Crossing] = fence.mounts_below()

    def listing(self, path: str) -> list[Entry]:
        """The entries of the directory `path`, sorted by name, each with its lstat; [] when it is
        gone, not a directory, or beyond the fence. Mount points among them are left out."""
        if path in self.crossings:
            return []
        try:
            fd = open_dir(path)
        except OSError:
            return []
        try:
            if not self.fence.holds(fd):
                self.crossings[path] = self.fence.crossing_at(path)
                return []
            entries = []
            prefix = path.rstrip("/") + "/"
            with os.scandir(fd) as listed:
                for found in listed:
                    full = prefix + found.name
                    if full in self.crossings:
                        continue
                    try:
                        st = found.stat(follow_symlinks=False)
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # moved by a writer since the listing
                    is_dir = stat.S_ISDIR(st.st_mode)
                    if is_dir and st.st_dev != self.fence.dev:
                        self.crossings[full] = self.fence.crossing_at(full)
                        continue
                    entries.append(Entry(found.name, full, st, is_dir))
        finally:
            os.close(fd)
        return sorted(entries, key=lambda e: e.name)

    def tree(self, root: str):
        """(directory, [(path, lstat)] of its subdirectories, [(path, lstat)] of everything else),
        top down, never through a link or a mount. Not os.walk: it stats every link's target to
        ask whether it is a directory, which followed the links of a snapshot into the blobs (and
        could follow a planted one onto the NAS) and took most of a prune of 100,000 files."""
        stack = [root]
        while stack:
            here = stack.pop()
            entries = self.listing(here)
            if here in self.crossings:
                continue
            dirs = [(e.path, e.st) for e in entries if e.is_dir]
            yield here, dirs, [(e.path, e.st) for e in entries if not e.is_dir]
            stack.extend(path for path, _st in reversed(dirs))

    def mounts_in(self, directory: str) -> list[Crossing]:
        """The crossings directly inside `directory` (found so far: list it first)."""
        return [c for point, c in sorted(self.crossings.items()) if os.path.dirname(point) == directory]


class Tree:
    """Removal under one root, through directory descriptors opened from the root down, one
    level at a time, each checked against the fence. Descriptors are kept until `close` (one
    item's steps), so a directory is opened once per item."""

    def __init__(self, fence: Fence):
        self.fence = fence
        self._fds: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def dir(self, path: str) -> int:
        """The descriptor of the directory `path` (the root or below it). Raises Beyond when a
        directory on the way is on another mount, OSError (ELOOP, ENOTDIR) when one is a link
        or not a directory."""
        if path in self._fds:
            return self._fds[path]
        if path == self.fence.root:
            fd = open_dir(path)
        else:
            if not under(path, self.fence.root):
                raise ValueError(f"{path} is not under {self.fence.root}")
            parent, name = os.path.split(path)
            fd = open_dir(name, self.dir(parent))
        if not self.fence.holds(fd):
            os.close(fd)
            raise Beyond(self.fence.crossing_at(path))
        self._fds[path] = fd
        return fd

    def lstat(self, path: str) -> os.stat_result:
        parent, name = os.path.split(path)
        return os.stat(name, dir_fd=self.dir(parent), follow_symlinks=False)

    def unlink(self, path: str) -> None:
        parent, name = os.path.split(path)
        os.unlink(name, dir_fd=self.dir(parent))

    def fsync(self, directory: str) -> None:
        os.fsync(self.dir(directory))

    def ensure_dir(self, path: str) -> None:
        """Make the directory `path` (its parent must exist) unless it is there; a link or a file
        in its place fails when it is opened."""
        parent, name = os.path.split(path)
        try:
            os.mkdir(name, 0o755, dir_fd=self.dir(parent))
            os.fsync(self.dir(parent))
        except FileExistsError:
            pass
        self.dir(path)

    def rename(self, path: str, directory: str, new_name: str) -> None:
        parent, name = os.path.split(path)
        os.rename(name, new_name, src_dir_fd=self.dir(parent), dst_dir_fd=self.dir(directory))
        self._forget(path)

    def remove_tree(self, path: str) -> list[str]:
        """Delete `path` and, for a directory, everything below it, never entering a directory on
        another mount or filesystem. Returns the mount points left in place (then the directories
        above them stay too); [] when all of it is gone."""
        parent, name = os.path.split(path)
        self._forget(path)
        return _remove(self.fence, self.dir(parent), name, path)

    def _forget(self, path: str) -> None:
        for cached in [p for p in self._fds if under(p, path)]:
            os.close(self._fds.pop(cached))


def _remove(fence: Fence, parent_fd: int, name: str, path: str, is_dir: bool | None = None) -> list[str]:
    """`_remove` of one name under `parent_fd`; `is_dir` is the listing's word for it (the entry's
    type, read without a stat), None to stat it."""
    if is_dir is None:
        try:
            is_dir = stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return []
    if not is_dir:
        try:
            os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return [path]  # a file bound over this one: a mount point, never removed through
            if exc.errno != errno.EISDIR:
                raise
            return _remove(fence, parent_fd, name, path)  # a directory now: look again
        return []
    fd = open_dir(name, parent_fd)
    left: list[str] = []
    try:
        if not fence.holds(fd):
            return [path]
        with os.scandir(fd) as listed:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in listed]
        for child, child_is_dir in children:
            left.extend(_remove(fence, fd, child, os.path.join(path, child), child_is_dir))
    finally:
        os.close(fd)
    if not left:
        os.rmdir(name, dir_fd=parent_fd)
    return left
