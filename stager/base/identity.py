"""Identity, not path strings: when two spellings name one file or directory.

Trust model: a path in the manifest or on the command line is a spelling, checked
at the moment of use. Two spellings are the same place when their resolved paths
match, when `(st_dev, st_ino)` match, or, for bind mounts (which realpath cannot
see through), when they map to overlapping paths *inside the same filesystem*
according to /proc/self/mountinfo. A node hub that was a symlink to the NAS passed
a string comparison once, and the mirror then wrote its lock into the NAS.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def file_id(path: str | os.PathLike, *, follow: bool = True) -> tuple[int, int] | None:
    """(st_dev, st_ino) of `path`, or None if it does not exist (or cannot be reached)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def resolved(path: str | os.PathLike) -> str:
    """The absolute, symlink-free spelling (a missing tail is kept as written).

    The one way stager resolves a path. os.path.realpath raises when a link vanishes between its
    lstat and its readlink (a churning hub, an operator's rm during an audit); resolved again, the
    vanished link is a missing tail like any other."""
    for _ in range(RESOLVE_ATTEMPTS - 1):
        try:
            return os.path.realpath(path)  # not abspath first: it would collapse "link/.." before the link resolves
        except (FileNotFoundError, NotADirectoryError):
            continue
    return os.path.realpath(path)


RESOLVE_ATTEMPTS = 5


def look(path: str | os.PathLike) -> tuple[os.stat_result | None, str | None]:
    """`path` as one look, not followed: its lstat (None when it is not there) and, for a link,
    its target. A link removed between the lstat and the readlink is not there: an operator
    deleting a snapshot while the mirror checked it once ended the run with exit 3 (ENOENT from the
    readlink). A link replaced by another kind of file between the two (EINVAL) is looked at again."""
    for _ in range(RESOLVE_ATTEMPTS):
        try:
            st = os.lstat(path)
            return st, (os.readlink(path) if stat.S_ISLNK(st.st_mode) else None)
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return None, None  # a link and a file by turns at every look: not there until it settles


@dataclass(frozen=True)
class Mount:
    """One mount of a mount namespace, as its mountinfo line gives it."""

    id: int  # the kernel's mount id: what /proc/<pid>/fdinfo's mnt_id names
    device: str  # "major:minor": one filesystem, however often it is mounted
    root: str  # the directory of that filesystem mounted here (not "/" for a bind mount)
    point: str  # where it is mounted, relative to the reading process's root
    fstype: str
    source: str


def _unescape(text: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def mount_table(pid: int | str = "self") -> list[Mount]:
    """The mounts of `pid`'s mount namespace in the kernel's order, where a later mount on a point
    hides the earlier ones ([] when the table cannot be read)."""
    mounts: list[Mount] = []
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
            lines = handle.readlines()
    except OSError:
        return []
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        mounts.append(Mount(int(fields[0]), fields[2], _unescape(fields[3]), _unescape(fields[4]),
                            _unescape(rest[0]) if rest else "?", _unescape(rest[1]) if len(rest) > 1 else "?"))
    return mounts


def mount_id(fd: int) -> int | None:
    """The mount that the open descriptor `fd` lies on (mountinfo's first column), read from
    /proc/self/fdinfo: the very descriptor the caller then acts through, so nothing is looked up
    by path between the check and the use. None when /proc cannot say."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def shown_at(mount: Mount, table: list[Mount]) -> str:
    """Where the directory a mount shows is itself seen in `table`'s namespace: a bind of a NAS
    directory reads as that directory's path under the NAS's own mount point; a mount whose
    filesystem is mounted nowhere else reads `source:root` (`nas:/export/hf` for NFS)."""
    best: Mount | None = None
    for other in table:
        if other.id == mount.id or other.device != mount.device or not _under(mount.root, other.root):
            continue
        if _under(other.point, mount.point):
            continue  # a mount inside this one cannot be where it comes from
        if best is None or len(other.root) > len(best.root):
            best = other
    if best is None:
        return f"{mount.source}:{mount.root}" if mount.root != "/" else mount.source
    rest = mount.root[len(best.root):].lstrip("/") if best.root != "/" else mount.root.lstrip("/")
    return os.path.normpath(os.path.join(best.point, rest)) if rest else best.point


def _mounts() -> list[Mount]:
    """Mounts of this process, longest mount point first."""
    # A later mount on the same point hides the earlier one: keep the last of each point.
    by_point = {m.point: m for m in mount_table()}
    return sorted(by_point.values(), key=lambda m: len(m.point), reverse=True)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _filesystem_location(real: str, mounts: list[Mount]) -> tuple[str, str] | None:
    """(device, path inside that filesystem) of a resolved path."""
    for mount in mounts:
        if _under(real, mount.point):
            rest = real[len(mount.point):].lstrip("/") if mount.point != "/" else real.lstrip("/")
            return mount.device, os.path.normpath(os.path.join(mount.root, rest))
    return None


def _existing_ancestor(real: str) -> str:
    """`real` itself, or the nearest ancestor that exists: a destination may not be made yet."""
    probe = real
    while not os.path.lexists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    return probe


def same_place(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when `a` and `b` name the same existing file or directory, however spelled."""
    ida, idb = file_id(a), file_id(b)
    return ida is not None and ida == idb


def overlap(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when `a` is, lies inside, or holds `b`, through any symlink, `..` or bind mount."""
    real_a, real_b = resolved(a), resolved(b)
    if _under(real_a, real_b) or _under(real_b, real_a):
        return True
    if same_place(_existing_ancestor(real_a), real_b) or same_place(real_a, _existing_ancestor(real_b)):
        return True
    mounts = _mounts()
    loc_a = _filesystem_location(real_a, mounts)
    loc_b = _filesystem_location(real_b, mounts)
    if loc_a is None or loc_b is None or loc_a[0] != loc_b[0]:
        return False
    return _under(loc_a[1], loc_b[1]) or _under(loc_b[1], loc_a[1])


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True when `path` resolves to `root` or below it, including through a bind mount of `root`."""
    real, real_root = resolved(path), resolved(root)
    if _under(real, real_root):
        return True
    mounts = _mounts()
    loc, loc_root = _filesystem_location(real, mounts), _filesystem_location(real_root, mounts)
    return loc is not None and loc_root is not None and loc[0] == loc_root[0] and _under(loc[1], loc_root[1])


def writers(ids: set[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Processes on this host holding any of `ids` ((st_dev, st_ino)) open for writing: id -> pids.
    Blind to writers on other hosts (NFS clients elsewhere), to a shared writable mmap whose
    descriptor was closed, and to processes this one may not inspect (run as root to see all)."""
    found: dict[tuple[int, int], list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for file_id in open_by(int(pid), ids, writable_only=True):
            found.setdefault(file_id, []).append(int(pid))
    return found


def open_by(pid: int, ids: set[tuple[int, int]], *, writable_only: bool = False) -> list[tuple[int, int]]:
    """Which of `ids` process `pid` has open (one entry per descriptor; only those open for
    writing if `writable_only`). Read from /proc: each descriptor's access mode and inode number
    in /proc/<pid>/fdinfo, and only for a matching inode number a stat of the open file itself,
    so a hung NFS mount that the process has a file open on is never touched."""
    numbers = {ino for _dev, ino in ids}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []  # gone, or not ours to inspect
    found = []
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(link).startswith("/"):
                continue  # a socket, pipe or anonymous inode
            with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as handle:
                info = dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
            if writable_only and int(info["flags"], 8) & os.O_ACCMODE == os.O_RDONLY:
                continue
            if "ino" in info and int(info["ino"]) not in numbers:
                continue  # kernels before 5.14 have no ino line: the stat decides
            st = os.stat(link)
        except (OSError, KeyError, ValueError):
            continue  # the descriptor closed while we looked
        if (st.st_dev, st.st_ino) in ids:
            found.append((st.st_dev, st.st_ino))
    return found


def escape_from(real_dir: str, root: str, sources: tuple[str, ...] = ()) -> str | None:
    """Why a resolved directory of the node hub (`root`, also resolved) is not really in it, or
    None: it resolves outside the hub (a directory link), or into one of `sources` (a link or a
    mount of the NAS). The one rule for the observer, the executor and the verifier."""
    if real_dir != root and not real_dir.startswith(root.rstrip("/") + "/"):
        return f"resolves to {real_dir}, outside the local hub, through a directory link"
    for source in sources:
        if inside(real_dir, source):
            return f"lies in the source {source} (through a link or mount)"
    return None


def filesystem_device(path: str | os.PathLike) -> str | None:
    """The "major:minor" /proc/self/mountinfo gives the filesystem holding `path` (or the nearest
    existing ancestor): how another mount namespace's mountinfo names the same filesystem."""
    location = _filesystem_location(_existing_ancestor(resolved(path)), _mounts())
    return location[0] if location else None
