"""sftp:// sources: a peer node's verified local hub, or a NAS reached over SSH.

`sftp://[user@]host[:port]/absolute/path/of/the/hub` is read through fsspec's
sftp filesystem (paramiko) and offers the same read-only `Source` as a local
path, so the walk resolves links with the same rules: `lstat` and `readlink`
never follow a link, and a directory's real path comes from the server's own
realpath(3) (SSH_FXP_REALPATH), so a directory link cannot smuggle a hop out of
the hub.

Authentication, in order (docs/fleet.md):
- the key file named by $STAGE_SSH_KEY, alone;
- else the `IdentityFile`s of the host in ~/.ssh/config, plus the ssh-agent;
- else the ssh-agent and ~/.ssh/id_* (paramiko's defaults).
`HostName`, `User` and `Port` in ~/.ssh/config apply; the URL's own user and
port win.  The server's host key must already be in $STAGE_SSH_KNOWN_HOSTS,
~/.ssh/known_hosts or /etc/ssh/ssh_known_hosts: an unknown key is refused,
because a peer that answers for another's address could serve any bytes.

Every network wait is bounded by $STAGE_SSH_TIMEOUT seconds (default 30):
connecting, the handshake, authentication, and each reply while reading.  A
host that cannot be reached or stops answering ends the command with exit 3.
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import posixpath
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from stager.base.errors import BadInput, CannotRun
from stager.sources.base import Stat, absolute_to_rel, relative_inside, stat_from_mode
from stager.base.units import parse_number

SSH_KEY_ENV = "STAGE_SSH_KEY"
KNOWN_HOSTS_ENV = "STAGE_SSH_KNOWN_HOSTS"
TIMEOUT_ENV = "STAGE_SSH_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 3600.0  # an SSH reply later than an hour is a dead peer
SSH_CONFIG = "~/.ssh/config"
KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
# OpenSSH allows 10 sessions per connection (MaxSessions); fsspec's own session is the first of ours.
SESSIONS_PER_CONNECTION = 8
# A connection sits idle for as long as a node receives its bytes from peers, an hour and more on
# a big model; firewalls and NAT drop idle TCP flows after minutes (AWS NAT: 350 s). A keepalive
# every 30 s, as OpenSSH's ServerAliveInterval would send, keeps the flow known to them.
KEEPALIVE_SECONDS = 30
# paramiko's default 2 MiB SSH window stalled reads at half the link's speed. A larger window
# costs no memory here: the server only sends what BYTES_IN_FLIGHT of requests asked for.
WINDOW_BYTES = 64 * 1024 * 1024
# Reads of 255 KiB (OpenSSH's sftp-server's largest answer) in SSH packets that hold one whole:
# paramiko's per-packet work is most of its CPU, and with 32 KiB reads in 32 KiB packets a read of
# the NAS cost 3.3 CPU s per GB in the client against 2.3 s (both with AES-CTR; scripts/lab/bench.py
# has no sftp case: a loopback sshd, 256 MiB, medians of 5). A server that answers less is asked
# for the rest, and from then on for what it answered (every server answers 32 KiB, the draft's
# minimum maximum).
REQUEST_BYTES = 255 * 1024
PACKET_BYTES = 256 * 1024
MIN_REQUEST_BYTES = 32 * 1024
# Outstanding reads per file: 2 MiB or more in flight fills a LAN link; memory stays bounded.
BYTES_IN_FLIGHT = 4 * 1024 * 1024
# Bytes answered ahead of the reads that want them, kept at most: the read-ahead itself and what a
# read a chunk out of order skipped.
EARLY_LIMIT = 2 * BYTES_IN_FLIGHT
# AES-GCM first when the server offers it (paramiko prefers AES-CTR with a separate HMAC-SHA2):
# one pass of the cipher instead of two, 1.6 against 2.3 CPU s per GB in the client, measured as
# above. Only the order changes: a server without it still gets what it has.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
INSTALL_HINT = "sftp sources need paramiko: pip install '.[sftp]' in the stager checkout (see docs/fleet.md)"


@dataclass(frozen=True)
class SftpTarget:
    """Where and as whom to connect, after ~/.ssh/config and the environment are applied."""

    url: str
    hostname: str
    port: int
    user: str
    path: str
    key_files: tuple[str, ...]
    only_key_files: bool  # $STAGE_SSH_KEY: try that key alone, not the agent's
    timeout: float


def ssh_timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = parse_number(text, float, 0, MAX_TIMEOUT)
    except ValueError as exc:
        raise BadInput(f"{TIMEOUT_ENV}={text!r}: expected a number of seconds above 0: {exc}") from None
    if value == 0:
        raise BadInput(f"{TIMEOUT_ENV}={text!r}: expected a number of seconds above 0")
    return value


def resolve_target(url: str) -> SftpTarget:
    """Parse `sftp://[user@]host[:port]/path` and apply ~/.ssh/config and $STAGE_SSH_KEY."""
    import paramiko

    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise BadInput(f"sftp source {url}: the port is not a number") from None
    if parts.scheme != "sftp":
        raise BadInput(f"source {url}: only sftp:// URLs are supported besides local paths")
    if not parts.hostname or not parts.path.startswith("/"):
        raise BadInput(f"source {url}: expected sftp://[user@]host[:port]/absolute/path")
    if parts.password is not None:
        raise BadInput(f"sftp source {url}: passwords in URLs are refused (manifests get copied); use a key")
    config = paramiko.SSHConfigDict()
    config_path = Path(SSH_CONFIG).expanduser()
    if config_path.is_file():
        try:
            config = paramiko.SSHConfig.from_path(str(config_path)).lookup(parts.hostname)
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise BadInput(f"{config_path}: cannot read it: {exc}") from None
    key = os.environ.get(SSH_KEY_ENV)
    if key and not os.path.isfile(key):
        raise BadInput(f"{SSH_KEY_ENV}={key}: no such key file")
    keys = (key,) if key else tuple(os.path.expanduser(k) for k in config.get("identityfile", []))
    try:
        config_port = int(config.get("port", 22))
    except ValueError:
        raise BadInput(f"{config_path}: Port of {parts.hostname} is not a number") from None
    return SftpTarget(
        url=url,
        hostname=config.get("hostname", parts.hostname),
        port=port or config_port,
        user=parts.username or config.get("user") or getpass.getuser(),
        path=posixpath.normpath(parts.path),
        key_files=keys,
        only_key_files=bool(key),
        timeout=ssh_timeout(),
    )


def _known_host_keys():
    import paramiko

    keys = paramiko.HostKeys()
    extra = os.environ.get(KNOWN_HOSTS_ENV)
    if extra and not os.path.isfile(extra):
        raise BadInput(f"{KNOWN_HOSTS_ENV}={extra}: no such file")
    for name in ((extra,) if extra else ()) + KNOWN_HOSTS:
        path = os.path.expanduser(name)
        if os.path.isfile(path):
            try:
                keys.load(path)
            except (OSError, paramiko.SSHException, ValueError) as exc:
                raise BadInput(f"{path}: cannot read known hosts: {exc}") from None
    return keys


def _host_key_policy(known):
    import paramiko

    class KnownHostsOnly(paramiko.MissingHostKeyPolicy):
        """Accept a server only by a key already listed for its name (never learn a new one)."""

        def missing_host_key(self, client, hostname, key):
            listed = known.lookup(hostname)
            if listed is None:
                raise paramiko.SSHException(
                    f"the host key of {hostname} is not in any known_hosts file; add it with "
                    f"`ssh-keyscan {_keyscan_args(hostname)} >> ~/.ssh/known_hosts` after checking it, "
                    f"or point {KNOWN_HOSTS_ENV} at a file that lists it")
            if not known.check(hostname, key):
                raise paramiko.SSHException(
                    f"the host key of {hostname} does not match its known_hosts entry: "
                    f"refusing to read from a host that may not be {hostname}")

    return KnownHostsOnly()


def _keyscan_args(hostname: str) -> str:
    if hostname.startswith("["):
        host, _, port = hostname[1:].partition("]:")
        return f"-p {port} {host}"
    return hostname


def _known_key_types_only(known, target: SftpTarget) -> dict:
    """Ask the server for a host key type we have on file, as OpenSSH does; otherwise a host
    listed only by its RSA key would present ed25519 first and be refused as unknown."""
    import paramiko

    name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
    listed = known.lookup(name)
    if not listed:
        return {}
    types = set(listed.keys())
    if "ssh-rsa" in types:
        types |= {"rsa-sha2-512", "rsa-sha2-256"}
    others = [t for t in paramiko.Transport._preferred_keys if t not in types]
    return {"disabled_algorithms": {"keys": others}} if len(others) < len(paramiko.Transport._preferred_keys) else {}


def connect(target: SftpTarget):
    """One SSH connection (fsspec's SFTP filesystem). CannotRun if unreachable."""
    import paramiko
    from fsspec.implementations.sftp import SFTPFileSystem

    known = _known_host_keys()
    where = f"{target.hostname}:{target.port}"
    try:
        fs = SFTPFileSystem(
            target.hostname, port=target.port, username=target.user,
            key_filename=list(target.key_files) or None,
            look_for_keys=not target.key_files, allow_agent=not target.only_key_files,
            timeout=target.timeout, banner_timeout=target.timeout, auth_timeout=target.timeout,
            channel_timeout=target.timeout, host_key_policy=_host_key_policy(known),
            transport_factory=_transport_preferring_gcm, skip_instance_cache=True,
            **_known_key_types_only(known, target))
    except paramiko.AuthenticationException as exc:
        raise CannotRun(f"sftp source {target.url}: ssh authentication as {target.user} on {where} failed ({exc}); "
                        f"set {SSH_KEY_ENV} or an IdentityFile in ~/.ssh/config") from None
    except TimeoutError:
        raise CannotRun(f"sftp source {target.url}: {where} did not answer within {target.timeout:g}s") from None
    except (paramiko.SSHException, EOFError) as exc:
        raise CannotRun(f"sftp source {target.url}: ssh to {where} failed: {exc}") from None
    except OSError as exc:
        raise CannotRun(f"sftp source {target.url}: cannot reach {where}: {exc.strerror or exc}") from None
    return fs


def _transport_preferring_gcm(sock, **kwargs):
    """The connection's transport: AES-GCM first, and every session it opens (fsspec's own too)
    with the window and packets the reads need."""
    import paramiko

    transport = paramiko.Transport(sock, default_window_size=WINDOW_BYTES, default_max_packet_size=PACKET_BYTES,
                                   **kwargs)
    transport.set_keepalive(KEEPALIVE_SECONDS)
    options = transport.get_security_options()
    offered = tuple(options.ciphers)
    options.ciphers = tuple(c for c in PREFERRED_CIPHERS if c in offered) + tuple(
        c for c in offered if c not in PREFERRED_CIPHERS)
    return transport


class _Sessions:
    """SFTP sessions lent to one thread at a time.

    paramiko's SFTPClient reads replies without holding its lock, so two threads
    sharing one session interleave packets. A thread that needs a session while
    all are lent gets a new one at once (never waits: the copier opens the same
    file twice in one thread), on a new connection past MaxSessions. A new connection's
    first session is the one fsspec opened on it: a second would cost the server another
    sftp-server start (a shell, then the subsystem: 0.11 s of an agent's start, profiled on the lab).

    A connection lost while none of its sessions was lent (the NAS's sshd restarted, a link down
    for a moment while the node received from its peers) is let go, and the next take opens a new
    one; if that fails, so does the take (CannotRun). One lost during a request ends the run
    (RemoteSource._failures): its answer is gone.
    """

    def __init__(self, target: SftpTarget):
        self.target = target
        self._lock = threading.Lock()
        self._idle: list = []
        self._connections: list[list] = []  # [fsspec filesystem, sessions opened on it]

    def take(self):
        import paramiko

        with self._lock:
            while self._idle:
                sftp = self._idle.pop()
                if _alive(sftp):
                    return sftp
                sftp.close()
            for conn in [c for c in self._connections if not _connected(c[0])]:
                self._connections.remove(conn)
                conn[0].client.close()
            while True:
                conn = next((c for c in self._connections if c[1] < SESSIONS_PER_CONNECTION), None)
                if conn is None:
                    fs = connect(self.target)
                    self._connections.append([fs, 1])
                    return self._with_reply_timeout(fs.ftp)
                try:
                    sftp = paramiko.SFTPClient.from_transport(conn[0].client.get_transport())
                except (paramiko.SSHException, EOFError, OSError):
                    sftp = None
                if sftp is None:
                    # Refused (fewer sessions per connection: ChannelException), slow, or lost
                    # before its transport knew: no new session on it, and a new connection. It
                    # is not closed here: other threads may be reading on it; once lost, the
                    # next take lets it go.
                    conn[1] = SESSIONS_PER_CONNECTION
                    continue
                conn[1] += 1
                return self._with_reply_timeout(sftp)

    def _with_reply_timeout(self, sftp):
        sftp.get_channel().settimeout(self.target.timeout)
        return sftp

    def give(self, sftp) -> None:
        with self._lock:
            self._idle.append(sftp)


class RemoteSource:
    """A hub on another host, read over SFTP."""

    def __init__(self, url: str, aliases: dict[str, str] | None = None):
        self.url = url
        self.target = resolve_target(url)
        self.aliases = dict(aliases or {})
        self._sessions = _Sessions(self.target)
        self.request_bytes = REQUEST_BYTES  # lowered to what the server answers, if it answers less
        self._canonical: dict[str, str | None] = {}
        root = self.target.path
        with self._session(f"opening {root}") as sftp:
            try:
                attrs = sftp.stat(root)
                real_root = sftp.normalize(root)
            except OSError as exc:
                raise CannotRun(f"sftp source {url}: {root} is not readable on {self.target.hostname}: "
                                f"{exc.strerror or exc}") from None
        if not _is_dir(attrs.st_mode):
            raise CannotRun(f"sftp source {url}: {root} is not a directory on {self.target.hostname}")
        self._real_root = real_root
        # Absolute links may name the hub by the path in the URL or by its real path on the server.
        self._roots = sorted({root, real_root}, key=len, reverse=True)

    def path(self, rel: str) -> str:
        return posixpath.join(self.target.path, rel) if rel else self.target.path

    def display(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    @contextmanager
    def _session(self, what: str):
        sftp = self._sessions.take()
        try:
            with self._failures(sftp, what):
                yield sftp
        finally:
            self._sessions.give(sftp)

    @contextmanager
    def _failures(self, sftp, what: str):
        """A lost or silent connection ends the run (exit 3); a missing or unreadable file stays
        an OSError, which the walk and the copier report as a problem with that file."""
        import paramiko

        try:
            yield
        except TimeoutError:
            raise self._given_up(sftp, f"no reply within {self.target.timeout:g}s while {what}") from None
        except paramiko.SSHException as exc:
            raise self._given_up(sftp, f"connection lost while {what}: {exc}") from None
        except EOFError:
            raise self._given_up(sftp, f"connection lost while {what}") from None
        except OSError:
            if not _alive(sftp):
                raise self._given_up(sftp, f"connection lost while {what}") from None
            raise

    def _given_up(self, sftp, why: str) -> CannotRun:
        """The run's end, and the session's: closed, it is never lent again, so the next request
        (the closing of a reader, say) is never read a late answer meant for the one given up."""
        import paramiko

        try:
            sftp.close()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # its connection is gone already
        return CannotRun(f"sftp source {self.url}: {why}")

    def lstat(self, rel: str) -> Stat | None:
        with self._session(f"reading the attributes of {rel}") as sftp:
            try:
                attrs = sftp.lstat(self.path(rel))
            except FileNotFoundError:
                return None
        # SFTP v3 carries whole seconds only.
        return stat_from_mode(attrs.st_mode or 0, attrs.st_size or 0, int(attrs.st_mtime or 0) * 1_000_000_000)

    def readlink(self, rel: str) -> str:
        with self._session(f"reading the link {rel}") as sftp:
            return sftp.readlink(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        with self._session(f"listing {rel}") as sftp:
            return sorted(sftp.listdir(self.path(rel)))

    def read_small(self, rel: str, limit: int) -> bytes:
        with self._session(f"reading {rel}") as sftp:
            # The server's open(2) of a FIFO blocks until the session times out: its kind first
            # (links followed, as a snapshot's index is a link to its blob).
            if not stat.S_ISREG(sftp.stat(self.path(rel)).st_mode or 0):
                raise OSError(errno.EINVAL, "not a regular file", self.display(rel))
            with sftp.open(self.path(rel), "rb") as handle:
                return handle.read(limit)

    def canonical_dir(self, rel_dir: str) -> str | None:
        if rel_dir not in self._canonical:
            with self._session(f"resolving {rel_dir}") as sftp:
                real = _realpath(sftp, self.path(rel_dir))
            self._canonical[rel_dir] = relative_inside(real, self._real_root)
        return self._canonical[rel_dir]

    def absolute_to_rel(self, target: str) -> str | None:
        return absolute_to_rel(target, self.aliases, self._roots)

    def open(self, rel: str, *, uncached: bool, sequential: bool = False) -> "RemoteReader":
        """`uncached` has no remote equivalent: the server reads through its own page cache. Reads
        are pipelined (BYTES_IN_FLIGHT) whatever the access pattern; `sequential` ones read ahead."""
        st = self.lstat(rel)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", self.display(rel))
        if st.kind != "file":
            raise OSError(errno.EINVAL, "not a regular file", self.display(rel))
        sftp = self._sessions.take()
        try:
            with self._failures(sftp, f"opening {rel}"):
                handle = sftp.open(self.path(rel), "rb")
                size = handle.stat().st_size
        except BaseException:
            self._sessions.give(sftp)
            raise
        return RemoteReader(self, sftp, handle, size, rel, sequential)


class RemoteReader:
    """Positioned reads of one remote file on a session lent to it until `close`.

    Reads are pipelined in the calling thread: up to BYTES_IN_FLIGHT of requests are outstanding,
    and each reply lands straight in the caller's buffer.  paramiko's own
    readv/prefetch starts a thread per call whose bookkeeping races with the reader; a copy
    stalled on it until the timeout.  A failed read still ends in its caller, never in a thread.

    A `sequential` reader also reads ahead: its requests run on past the end of each read (up to
    BYTES_IN_FLIGHT, never past the size), and what comes back early waits for the next read.
    Without it the pipe ran dry at the end of every read, and the next read's requests queued
    behind whatever else the node was sending on its uplink: a broadcast's head, forwarding each
    chunk on the same link, read the NAS at 90 % of the link between chunks of 4 MiB. A read
    far from what was read ahead (past what was asked, or more than BYTES_IN_FLIGHT before it)
    drops it (its answers are discarded as they come); a read a chunk out of order goes on with
    it (_goes_on_ahead). `pread`, which the sampled checks use, never reads ahead: a fresh
    sample is read fresh.
    """

    def __init__(self, source: RemoteSource, sftp, handle, size: int, rel: str, sequential: bool):
        self._source = source
        self._sftp = sftp
        self._handle = handle
        self._rel = rel
        self._pos = 0
        self._sequential = sequential
        self._replies = _Replies()
        self._asked: dict[int, tuple[int, int] | None] = {}  # request -> (offset, size); None: to discard
        self._early: dict[int, memoryview] = {}  # offset -> bytes answered before the read that wants them
        self._retry: list[tuple[int, int]] = []  # the rest of short answers, still to ask
        self._next_ask = 0  # the first offset not asked for yet
        self.size = size

    def _read_at(self, view: memoryview, offset: int, ahead: bool) -> int:
        """Fill `view` with the bytes at `offset` (up to the size). Returns how many were read."""
        from paramiko.sftp import CMD_READ, int64

        end = offset + max(0, min(len(view), self.size - offset))
        if not ahead or not self._goes_on_ahead(offset, end):
            self._forget_ahead(offset)
        horizon = self.size if ahead else end
        missing = end - offset
        try:
            for at in sorted(self._early):
                missing -= self._place(view, offset, end, at, self._early.pop(at))
            with self._source._failures(self._sftp, f"reading {self._rel}"):
                while missing:
                    while ((self._retry or self._next_ask < horizon)
                           and len(self._asked) * self._source.request_bytes < BYTES_IN_FLIGHT):
                        if self._retry:
                            at, size = self._retry.pop()
                        else:
                            at, size = self._next_ask, min(self._source.request_bytes, horizon - self._next_ask)
                            self._next_ask += size
                        num = self._sftp._async_request(self._replies, CMD_READ, self._handle.handle, int64(at),
                                                        int(size))
                        self._asked[num] = (at, size)
                    self._sftp._read_response()
                    for num, kind, msg in self._replies.drain():
                        request = self._asked.pop(num, None)
                        if request is not None:
                            missing -= self._place(view, offset, end, request[0], self._answer(kind, msg, *request))
        except BaseException:
            # Nothing continues a read that failed half-way: its unanswered requests would land
            # where the next read looks for its bytes.
            self._forget_ahead(self.size)
            raise
        self._keep_early_bounded()
        return end - offset

    def _goes_on_ahead(self, offset: int, end: int) -> bool:
        """Whether the read goes on with what was read or asked ahead and not yet taken: it starts
        no further ahead than has been asked, nor more than BYTES_IN_FLIGHT before the lowest of
        it. If so, the bytes of [offset, end) that nothing holds (before what was asked, or taken
        by an earlier read) are queued to be asked for first. Several streams share a reader in
        turns (a node that became the chain's head mid-file reads the rest on every stream): their
        reads come a chunk out of order, and each such read dropped what was read ahead and asked
        again from there. A read elsewhere starts afresh."""
        spans = sorted([*((at, len(data)) for at, data in self._early.items()), *self._retry,
                        *(request for request in self._asked.values() if request is not None)])
        lowest = spans[0][0] if spans else self._next_ask
        if offset > self._next_ask or offset < lowest - BYTES_IN_FLIGHT:
            return False
        stop, reach, gaps = min(end, self._next_ask), offset, []
        for at, size in spans:
            if reach >= stop:
                break
            if at > reach:
                gaps.append((reach, min(at, stop)))
            reach = max(reach, at + size)
        if reach < stop:
            gaps.append((reach, stop))
        step = self._source.request_bytes
        pieces = [(at, min(step, gap_end - at)) for gap_start, gap_end in gaps for at in range(gap_start, gap_end, step)]
        self._retry.extend(reversed(pieces))  # asked from the end of the list: the lowest first
        return True

    def _answer(self, kind, msg, at: int, size: int) -> memoryview:
        """The bytes of one read's reply; a short one has the rest asked again, and later
        requests ask for no more than the server answers."""
        from paramiko.sftp import CMD_DATA, CMD_STATUS

        if kind == CMD_STATUS:
            try:
                self._sftp._convert_status(msg)  # raises: EOFError past the end, OSError otherwise
            except EOFError:
                raise OSError(errno.EIO, f"{self._rel} ended before {self.size} bytes: "
                                         "it changed on the source during the read") from None
        if kind != CMD_DATA:
            raise OSError(errno.EPROTO, f"unexpected SFTP reply {kind} to a read")
        data = msg.get_string()
        if not data:
            raise OSError(errno.EIO, f"{self._rel}: the server answered a read with no data")
        if len(data) < size:  # servers may answer short; ask for the rest, and ask less
            self._retry.append((at + len(data), size - len(data)))
            self._source.request_bytes = max(MIN_REQUEST_BYTES, min(self._source.request_bytes, len(data)))
        return memoryview(data)

    def _place(self, view: memoryview, offset: int, end: int, at: int, data: memoryview) -> int:
        """Copy what of `data` (the bytes at `at`) lies in [offset, end) into `view`; keep what lies
        before or beyond it for the reads to come. Returns how many bytes were placed."""
        first, last = min(max(offset, at), at + len(data)), max(min(end, at + len(data)), at)
        if first > at:
            self._early[at] = data[:first - at]
        if last > first:
            view[first - offset:last - offset] = data[first - at:last - at]
        if at + len(data) > last:
            self._early[last] = data[last - at:]
        return last - first

    def _keep_early_bounded(self) -> None:
        """What came back early and was not taken stays within EARLY_LIMIT, lowest offsets dropped
        first (a read that wants them asks again)."""
        held = sum(len(data) for data in self._early.values())
        for at in sorted(self._early):
            if held <= EARLY_LIMIT:
                break
            held -= len(self._early.pop(at))

    def _forget_ahead(self, offset: int) -> None:
        """A read that does not continue the last one: what was read ahead is dropped."""
        self._asked = dict.fromkeys(self._asked)
        self._early.clear()
        self._retry.clear()
        self._next_ask = offset

    def pread(self, length: int, offset: int) -> bytes:
        buffer = bytearray(max(0, min(length, self.size - offset)))
        return bytes(buffer[:self._read_at(memoryview(buffer), offset, ahead=False)])

    def readinto_at(self, buffer: memoryview, offset: int) -> int:
        """One positioned read into `buffer`; how many bytes it got (fewer at the end of the file)."""
        return self._read_at(buffer, offset, ahead=self._sequential)

    def readinto(self, buffer: memoryview) -> int:
        got = self._read_at(buffer, self._pos, ahead=self._sequential)
        self._pos += got
        return got

    def state(self) -> tuple[int, ...]:
        """Size and mtime as the server reports them now (SFTP carries whole seconds, no ctime)."""
        with self._source._failures(self._sftp, f"stat of {self._rel}"):
            attrs = self._handle.stat()
        return attrs.st_size, attrs.st_mtime

    def close(self) -> None:
        try:
            with self._source._failures(self._sftp, f"closing {self._rel}"):
                self._handle.close()
        finally:
            self._source._sessions.give(self._sftp)


class _Replies:
    """Where paramiko delivers the replies to our asynchronous reads (its `_async_response` hook)."""

    def __init__(self):
        self._replies: list = []

    def _async_response(self, kind, msg, num) -> None:
        self._replies.append((num, kind, msg))

    def drain(self) -> list:
        replies, self._replies = self._replies, []
        return replies


def _is_dir(mode: int | None) -> bool:
    return mode is not None and stat.S_ISDIR(mode)


def _alive(sftp) -> bool:
    channel = sftp.get_channel()
    return not channel.closed and channel.get_transport().is_active()


def _connected(fs) -> bool:
    transport = fs.client.get_transport()
    return transport is not None and transport.is_active()


def _realpath(sftp, path: str) -> str:
    """The server's realpath(3), lenient like os.path.realpath: a missing tail is kept as written,
    so a link to a missing file is reported as dangling rather than as leaving the hub."""
    try:
        return sftp.normalize(path)
    except FileNotFoundError:
        parent, name = posixpath.split(path)
        if parent == path:
            return path
        return posixpath.join(_realpath(sftp, parent), name)


def open_remote_source(url: str, aliases: dict[str, str]) -> RemoteSource:
    try:
        import paramiko  # noqa: F401
        import fsspec.implementations.sftp  # noqa: F401
    except ImportError:
        raise CannotRun(INSTALL_HINT) from None
    # paramiko's transport thread logs every failed handshake with a traceback on stderr; the
    # failure reaches the user once, as the one-line error this module raises.
    quiet = logging.getLogger("paramiko")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    return RemoteSource(url, aliases)
