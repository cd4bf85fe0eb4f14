"""sftp:// sources against a real sshd on 127.0.0.1: the same walk rules, byte-identical mirrors,
verification against the NAS, and bounded failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import run_stage, sha256_file, source_writer, write_manifest
from hubgen import Hub, pseudo_random
from reliability_support import temp_files
from remote_fixtures import (DRAFTER, FLASH, HOSTILE, MiB, build_remote_nas, hub_tree as tree, load_offline,
                             manifest_for, silent_port, start_sshd)
from stager.base.errors import CannotRun
from stager.sources.sftp import _alive
from stager.mirror.hub import walk_repo
from stager.sources import open_source
from stager.sources.local import LocalSource


@pytest.fixture(autouse=True)
def ssh_env(sshd, monkeypatch):
    """In-process sources and the CLI subprocesses (run_stage copies os.environ) use the test keys."""
    for key, value in sshd.env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def nas(tmp_path_factory) -> dict:
    return build_remote_nas(tmp_path_factory.mktemp("remote"))


def stage(manifest: Path, *extra: str) -> dict:
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json", *extra)
    assert result.code == 0, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    return result.json


def test_peer_and_sftp_nas_mirrors_are_byte_identical_to_the_nas_mirror(nas, sshd, tmp_path):
    from_nas = tmp_path / "a" / "hub"
    stage(manifest_for(tmp_path / "a.toml", nas, str(nas["hub"]), from_nas))
    # A second node stages from the first one's local hub, over SFTP, with more threads than one
    # SSH connection has sessions.
    from_peer = tmp_path / "b" / "hub"
    peer = stage(manifest_for(tmp_path / "b.toml", nas, str(nas["hub"]), from_peer), "--source", sshd.url(from_nas),
                 "--jobs", "12")
    # A third reaches the NAS itself over SSH; the absolute aliased link is resolved on the server.
    over_ssh = tmp_path / "c" / "hub"
    remote_nas = stage(manifest_for(tmp_path / "c.toml", nas, sshd.url(nas["hub"]), over_ssh))

    reference = tree(from_nas)
    assert sum(kind == "file" for kind, *_ in reference.values()) >= 8
    assert tree(from_peer) == reference
    assert tree(over_ssh) == reference
    for staged in (from_peer, over_ssh):
        for path in staged.rglob("*.safetensors"):
            snap = nas["flash"] if FLASH.replace("/", "--") in str(path) else nas["drafter"]
            assert sha256_file(path) == snap.sha256[str(path).split("/snapshots/")[1].split("/", 1)[1]]
        assert load_offline(staged) == load_offline(from_nas)

    assert peer["source"] == sshd.url(from_nas) and peer["problems"] == []
    assert peer["copied_bytes"] == remote_nas["copied_bytes"] > 0
    # Staged from a peer, checked against the NAS, which answers.
    assert peer["verify"]["verified_against"] == str(nas["hub"])
    assert remote_nas["verify"]["verified_against"] == sshd.url(nas["hub"])
    # The peer's hub and the NAS were only read: nothing under them changed.
    assert tree(from_nas) == reference


def test_verification_falls_back_to_the_peer_when_the_nas_is_unreachable(nas, sshd, tmp_path):
    peer_hub = tmp_path / "peer" / "hub"
    stage(manifest_for(tmp_path / "peer.toml", nas, str(nas["hub"]), peer_hub))
    gone = tmp_path / "unmounted" / "hf" / "hub"
    local = tmp_path / "node" / "hub"
    manifest = manifest_for(tmp_path / "node.toml", nas, str(gone), local, f'source = "{sshd.url(peer_hub)}"\n')
    report = stage(manifest)
    assert report["source"] == sshd.url(peer_hub)
    assert report["verify"]["verified_against"] == sshd.url(peer_hub)
    assert report["verify"]["ok"] == report["verify"]["checked"] > 0
    checked = run_stage("verify", "--node", "dgx1", "--manifest", manifest, "--json")
    assert checked.code == 0, checked.stderr
    assert checked.json["verified_against"] == sshd.url(peer_hub) and checked.json["problems"] == []
    assert tree(local) == tree(peer_hub)
    # Once the NAS answers again, it is the reference again.
    manifest.write_text(manifest.read_text().replace(f'hub = "{gone}"', f'hub = "{nas["hub"]}"', 1))
    checked = run_stage("verify", "--node", "dgx1", "--manifest", manifest, "--json")
    assert checked.code == 0 and checked.json["verified_against"] == str(nas["hub"])


def test_links_resolve_on_the_server_by_the_same_rules(nas, sshd):
    local = LocalSource(str(nas["hub"]), nas["aliases"])
    remote = open_source(sshd.url(nas["hub"]), nas["aliases"])
    for repo in (FLASH, DRAFTER, HOSTILE):
        mine, theirs = walk_repo(local, repo, "main", []), walk_repo(remote, repo, "main", [])
        assert [(e.path, e.chain, e.size) for e in theirs.entries] == [(e.path, e.chain, e.size) for e in mine.entries]
        assert theirs.metadata == mine.metadata and theirs.tree_listing == mine.tree_listing

        def kinds(snapshot, source):
            return sorted((p.path.removeprefix(source.display("")), p.kind) for p in snapshot.problems)

        assert kinds(theirs, remote) == kinds(mine, local)
    hostile = {p.path.rsplit("/", 1)[1]: p.kind for p in walk_repo(remote, HOSTILE, "main", []).problems}
    assert hostile == {"escape-relative": "escape", "escape-absolute": "escape", "escape-through-dir": "escape",
                       "dangling": "dangling", "loop-a": "loop", "loop-b": "loop", "a-directory": "not_a_file",
                       "a-fifo": "not_a_file"}
    entries = {e.path: e.chain for e in walk_repo(remote, HOSTILE, "main", []).entries}
    assert set(entries) == {"ok.json", "aliased", "cross-repo"}
    assert entries["aliased"][-1] == entries["ok.json"][-1]


def test_ssh_config_supplies_host_port_user_and_key(nas, sshd, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host peer-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n  IdentityFile {sshd.key}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("STAGE_SSH_KEY")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    source = open_source(f"sftp://peer-alias{nas['hub']}", nas["aliases"])
    assert source.lstat("blobs").kind == "dir"
    assert [e.path for e in walk_repo(source, DRAFTER, "main", []).entries] == ["config.json", "model.safetensors"]


def test_reads_are_exact_and_many_readers_share_the_connections(nas, sshd, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    sizes = [0, 1, 32 * 1024 - 1, 32 * 1024 + 1, MiB, 3 * MiB + 12345]
    for i, size in enumerate(sizes):
        (hub / f"f{i}").write_bytes(pseudo_random(i, size))
    source = open_source(sshd.url(hub), {})
    # More readers open at once than one connection allows sessions (OpenSSH MaxSessions is 10).
    readers = [source.open(f"f{i % len(sizes)}", uncached=True) for i in range(20)]
    try:
        def check(index: int) -> None:
            reader, data = readers[index], pseudo_random(index % len(sizes), sizes[index % len(sizes)])
            assert reader.size == len(data)
            assert reader.pread(len(data) + 100, 0) == data
            assert reader.pread(100, len(data) // 2) == data[len(data) // 2:len(data) // 2 + 100]
            assert reader.pread(10, len(data)) == b""
            buffer = bytearray(MiB + 7)
            got = bytearray()
            while n := reader.readinto(memoryview(buffer)):
                got += buffer[:n]
            assert bytes(got) == data

        threads = [threading.Thread(target=check, args=(i,)) for i in range(len(readers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        for reader in readers:
            reader.close()
    with pytest.raises(OSError):
        source.open("missing", uncached=True)
    os.symlink("f1", hub / "link")
    with pytest.raises(OSError, match="not a regular file"):
        source.open("link", uncached=True)  # readers never follow links: the walk resolves them


def test_a_source_starts_one_sftp_server_until_two_readers_need_two(sshd, tmp_path):
    """Opening a source and reading a file start one sftp-server on the server: the session fsspec
    opens with the connection is the first the source lends, with the window and packets its reads
    need. It once opened a second beside it at once (a shell and a subsystem started on the NAS by
    every node of a fleet run)."""
    from stager.sources.sftp import PACKET_BYTES, WINDOW_BYTES

    def started() -> int:
        return sshd.sftp_log.read_text().count("session opened for local user")

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "f").write_bytes(pseudo_random(7, MiB))
    before = started()
    source = open_source(sshd.url(hub), {})
    reader = source.open("f", uncached=True)
    assert reader.pread(MiB, 0) == pseudo_random(7, MiB)
    reader.close()
    assert started() - before == 1
    session = source._sessions.take()
    try:
        assert (session.get_channel().in_window_size, session.get_channel().in_max_packet_size) == (
            WINDOW_BYTES, PACKET_BYTES)
        second = source.open("f", uncached=True)  # while the first session is lent: a second one
        assert second.pread(10, 5) == pseudo_random(7, MiB)[5:15]
        second.close()
    finally:
        source._sessions.give(session)
    assert started() - before == 2


def test_a_server_that_allows_one_session_per_connection_gets_a_connection_per_reader(tmp_path, monkeypatch):
    """OpenSSH with MaxSessions 1: fsspec's session is the connection's only one. The source once
    opened a second beside it at once and, refused, gave up ("the server refuses SFTP sessions");
    now three readers at once read on three connections, every byte right."""
    single = start_sshd(tmp_path / "single-sshd", max_sessions=1)
    try:
        for key, value in single.env.items():
            monkeypatch.setenv(key, value)
        hub = tmp_path / "hub"
        hub.mkdir()
        for i in range(3):
            (hub / f"f{i}").write_bytes(pseudo_random(20 + i, MiB + i))
        source = open_source(single.url(hub), {})
        readers = [source.open(f"f{i}", uncached=True) for i in range(3)]
        try:
            for i, reader in enumerate(readers):
                assert reader.pread(MiB + 10, 0) == pseudo_random(20 + i, MiB + i)
        finally:
            for reader in readers:
                reader.close()
        assert len(single.session_pids()) >= 3
    finally:
        single.stop()


def served_blobs(sshd, tmp_path: Path, names: tuple[str, ...], size: int, seed: int):
    """`<name>/blob` for each name, the same `size` pseudo-random bytes, in a hub the sshd serves
    (one directory each: sftp-server's log is counted by directory): (hub, data, its source)."""
    hub = tmp_path / "hub"
    data = pseudo_random(seed, size)
    for name in names:
        (hub / name).mkdir(parents=True)
        (hub / name / "blob").write_bytes(data)
    return hub, data, open_source(sshd.url(hub), {})


def test_a_sequential_reader_asks_ahead_and_a_read_elsewhere_drops_what_it_asked(sshd, tmp_path):
    """A sequential reader keeps requests in flight past each read, so the pipe does not run dry
    between reads; reads of odd lengths get exactly their bytes from answers that straddle them;
    a read elsewhere gets its own bytes, not what was read ahead; and a whole sequential read
    reads the file from the server exactly once, nothing past its end."""
    size = 6 * MiB + 999
    hub, data, source = served_blobs(sshd, tmp_path, ("whole", "jumps"), size, seed=12)
    reader = source.open("whole/blob", uncached=True, sequential=True)
    try:
        got, offset = bytearray(), 0
        while offset < size:
            buffer = bytearray(MiB + 17)
            n = reader.readinto_at(memoryview(buffer), offset)
            if offset == 0:
                assert reader._next_ask > n, "nothing was asked past the first read"
            got += buffer[:n]
            offset += n
    finally:
        reader.close()
    assert got == data
    reader = source.open("jumps/blob", uncached=True, sequential=True)
    try:
        for offset, length in [(0, MiB), (MiB, MiB), (4 * MiB + 3, 5000), (2 * MiB, 300), (2 * MiB + 300, MiB),
                               (size - 10, MiB)]:
            buffer = bytearray(length)
            n = reader.readinto_at(memoryview(buffer), offset)
            assert bytes(buffer[:n]) == data[offset:offset + length], (offset, length)
        assert reader.pread(1000, 3 * MiB) == data[3 * MiB:3 * MiB + 1000]
    finally:
        reader.close()
    assert sshd.bytes_read(hub / "whole") == size


def test_reads_a_chunk_out_of_order_keep_what_was_read_ahead_and_the_file_is_read_once(sshd, tmp_path):
    """Two streams taking 1 MiB chunks in turns from one sequential reader (a node that became the
    chain's head mid-file): each pair comes in either order. Every read gets its bytes, and the
    server reads the file once: a read a chunk out of order once dropped what was read ahead and
    asked for it again. A read over bytes already taken asks for them again, and a read past a
    gap starts afresh: each gets its bytes."""
    size = 12 * MiB + 321
    hub, data, source = served_blobs(sshd, tmp_path, ("turns", "over"), size, seed=14)
    chunks = list(range(0, size, MiB))
    order = [offset for pair in zip(chunks[1::2], chunks[0::2]) for offset in pair] + chunks[len(chunks) // 2 * 2:]
    assert sorted(order) == chunks and order[:2] == [MiB, 0]
    reader = source.open("turns/blob", uncached=True, sequential=True)
    try:
        for offset in order:
            buffer = bytearray(MiB)
            got = reader.readinto_at(memoryview(buffer), offset)
            assert bytes(buffer[:got]) == data[offset:offset + MiB], offset
    finally:
        reader.close()
    assert sshd.bytes_read(hub / "turns") == size
    reader = source.open("over/blob", uncached=True, sequential=True)
    try:
        for offset, length in [(4 * MiB + 3, 5000), (4 * MiB, 10_000), (MiB, MiB), (9 * MiB, 300), (2 * MiB, MiB)]:
            buffer = bytearray(length)
            got = reader.readinto_at(memoryview(buffer), offset)
            assert bytes(buffer[:got]) == data[offset:offset + length], (offset, length)
    finally:
        reader.close()


def test_reads_of_255_kib_read_exactly_the_bytes_asked_for(sshd, tmp_path):
    """Reads go out as 255 KiB requests in flight: every read, sequential, scattered or of odd
    length, gets exactly its bytes, and sftp-server's own log counts exactly what was asked (the
    whole file once for a copy, only the sampled spans for a sample, nothing past the end)."""
    from stager.mirror.fingerprint import sampled_digest

    hub = tmp_path / "hub"
    hub.mkdir()
    size = 8 * MiB + 4321
    data = pseudo_random(11, size)
    for name in ("copied", "sampled", "mixed"):  # one directory each: the log is counted by directory
        (hub / name).mkdir()
        (hub / name / "blob").write_bytes(data)
    source = open_source(sshd.url(hub), {})
    step = MiB

    def read(name: str, pattern: list[tuple[int, int]]) -> None:
        reader = source.open(f"{name}/blob", uncached=True)
        try:
            for offset, length in pattern:
                buffer = bytearray(length)
                got = reader.readinto_at(memoryview(buffer), offset)
                assert bytes(buffer[:got]) == data[offset:offset + length], (name, offset, length)
            # OpenSSH offers AES-GCM, so it is taken over paramiko's own first choice (AES-CTR).
            assert reader._sftp.get_channel().get_transport().remote_cipher == "aes128-gcm@openssh.com"
        finally:
            reader.close()

    read("copied", [(offset, step) for offset in range(0, size, step)])
    mixed = [(0, step), (step, step), (5 * MiB + 7, 1000), (2 * step, step // 2), (size - 100, step)]
    read("mixed", mixed)
    reader = source.open("sampled/blob", uncached=True)
    try:
        sample = sampled_digest(reader, 1234)
    finally:
        reader.close()
    local = LocalSource(str(hub)).open("sampled/blob", uncached=True)
    try:
        assert sample == sampled_digest(local, 1234)
    finally:
        local.close()
    read_by = {name: sshd.bytes_read(hub / name) for name in ("copied", "sampled", "mixed")}
    assert source.request_bytes == 255 * 1024  # OpenSSH answers each 255 KiB read whole
    assert read_by["copied"] == size, read_by
    assert read_by["sampled"] < size // 2, read_by
    assert read_by["mixed"] == sum(min(length, size - offset) for offset, length in mixed), read_by


def test_a_server_that_answers_less_than_asked_is_asked_for_the_rest_then_for_what_it_answers(
        tmp_path, monkeypatch):
    """OpenSSH's sftp-server behind a filter that caps every read at 40,000 bytes (as older or
    stricter servers answer): every byte arrives, each read's rest is asked for, later requests
    are the server's size, and the server reads the file once."""
    capped = start_sshd(tmp_path / "capped-sshd", read_cap=40_000)
    try:
        for key, value in capped.env.items():
            monkeypatch.setenv(key, value)
        hub = tmp_path / "hub"
        (hub / "blob").parent.mkdir(parents=True)
        size = 3 * MiB + 7
        data = pseudo_random(12, size)
        (hub / "blob").write_bytes(data)
        source = open_source(capped.url(hub), {})
        reader = source.open("blob", uncached=True)
        try:
            buffer = bytearray(MiB)
            for offset in range(0, size, MiB):
                got = reader.readinto_at(memoryview(buffer), offset)
                assert bytes(buffer[:got]) == data[offset:offset + MiB], offset
            assert reader.pread(100_000, 12_345) == data[12_345:112_345]
        finally:
            reader.close()
        assert source.request_bytes == 40_000
        assert capped.bytes_read(hub) == size + 100_000
    finally:
        capped.stop()


def test_a_file_that_shrinks_during_a_read_is_a_file_problem_not_a_lost_source(sshd, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "blob").write_bytes(pseudo_random(3, 2 * MiB))
    source = open_source(sshd.url(hub), {})
    reader = source.open("blob", uncached=True)
    try:
        os.truncate(hub / "blob", MiB)
        with pytest.raises(OSError, match="changed on the source"):
            reader.pread(2 * MiB, 0)
        assert source.lstat("blob").size == MiB  # the connection is still good
    finally:
        reader.close()


def test_a_connection_lost_during_a_read_ends_it_and_the_next_request_connects_again(nas, sshd, tmp_path):
    """Its answer gone, the read in flight ends the run (CannotRun, at once, not a hang). The
    source itself is not dead for good: the next request opens a new connection."""
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "blob").write_bytes(pseudo_random(7, 4 * MiB))
    before = set(sshd.session_pids())
    source = open_source(sshd.url(hub), {})
    reader = source.open("blob", uncached=True)
    assert reader.pread(16, 0) == pseudo_random(7, 16)
    lost = set(sshd.session_pids()) - before
    for pid in lost:
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(CannotRun, match="connection lost"):
        reader.pread(4 * MiB, 0)
    assert time.monotonic() - started < 10
    reader.close()
    again = source.open("blob", uncached=True)
    assert again.pread(4 * MiB, 0) == pseudo_random(7, 4 * MiB)
    again.close()
    assert set(sshd.session_pids()) - before - lost


def test_an_idle_connection_sends_keepalives(tmp_path, monkeypatch):
    """A node's NAS connection idles while it receives from its peers; firewalls and NAT drop
    idle flows. Its transport sends SSH keepalives, seen by the server (sshd's DEBUG log names
    each global request), here every second where a run sends them every 30 s."""
    from stager.sources import sftp

    monkeypatch.setattr(sftp, "KEEPALIVE_SECONDS", 1)
    own = start_sshd(tmp_path / "own-sshd", log_level="DEBUG")
    try:
        for key, value in own.env.items():
            monkeypatch.setenv(key, value)
        hub = tmp_path / "hub"
        hub.mkdir()
        (hub / "f").write_bytes(b"x")
        source = open_source(own.url(hub), {})
        assert source.lstat("f").size == 1
        deadline = time.monotonic() + 10
        while own.log.read_text().count("keepalive@") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert own.log.read_text().count("keepalive@") >= 2, own.log.read_text()[-2000:]
    finally:
        own.stop()


def kill_and_wait_until_seen(source, pids: set[int]) -> None:
    """SIGKILL the server's side of the source's connections, and wait until the transports' own
    threads have seen them end, as they would have long before a node's next request."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(sftp) for sftp in source._sessions._idle) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_connection_lost_while_idle_is_replaced_and_a_nas_gone_for_good_is_one_clear_error(tmp_path, monkeypatch):
    """A node's NAS connection sits idle while it receives from its peers. The NAS's sshd
    restarted (its sessions killed) in that time: the next reads open a new connection and read
    every byte right, where they once ended the run with "connection lost". With the NAS gone
    for good, the next request fails at once, naming the source."""
    own = start_sshd(tmp_path / "own-sshd")
    try:
        for key, value in own.env.items():
            monkeypatch.setenv(key, value)
        hub = tmp_path / "hub"
        hub.mkdir()
        (hub / "blob").write_bytes(pseudo_random(9, 3 * MiB))
        source = open_source(own.url(hub), {})
        reader = source.open("blob", uncached=True)
        assert reader.pread(3 * MiB, 0) == pseudo_random(9, 3 * MiB)
        reader.close()
        first = set(own.session_pids())
        kill_and_wait_until_seen(source, first)
        assert source.lstat("blob").size == 3 * MiB
        reader = source.open("blob", uncached=True)
        assert reader.pread(3 * MiB, 0) == pseudo_random(9, 3 * MiB)
        reader.close()
        assert set(own.session_pids()) and not set(own.session_pids()) & first
        assert len(source._sessions._connections) == 1
        second = set(own.session_pids())
        own.stop()
        kill_and_wait_until_seen(source, second)
        started = time.monotonic()
        with pytest.raises(CannotRun, match=r"sftp source sftp://.*cannot reach"):
            source.lstat("blob")
        assert time.monotonic() - started < 10
    finally:
        own.stop()


@pytest.mark.parametrize("case", ["refused", "silent", "unknown host key", "wrong key", "not a hub"])
def test_unreachable_sources_exit_3_with_one_line_quickly(nas, sshd, tmp_path, case):
    env = {"STAGE_SSH_TIMEOUT": "2"}
    url = sshd.url(nas["hub"])
    if case == "refused":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"sftp://{sshd.user}@127.0.0.1:{port}{nas['hub']}"
    elif case == "silent":
        port = silent_port()
        url = f"sftp://{sshd.user}@127.0.0.1:{port}{nas['hub']}"
    elif case == "unknown host key":
        (tmp_path / "empty_known_hosts").write_text("")
        env["STAGE_SSH_KNOWN_HOSTS"] = str(tmp_path / "empty_known_hosts")
        env["HOME"] = str(tmp_path)
    elif case == "wrong key":
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        env["STAGE_SSH_KEY"] = str(tmp_path / "other")
    else:
        url = sshd.url(nas["root"] / "nothing-here")
    manifest = manifest_for(tmp_path / "m.toml", nas, url, tmp_path / "local")
    started = time.monotonic()
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, env=env, timeout=60)
    elapsed = time.monotonic() - started
    assert result.code == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage: error: sftp source "), result.stderr
    assert elapsed < 15
    expected = {"refused": "cannot reach", "silent": "failed", "unknown host key": "ssh-keyscan -p",
                "wrong key": "authentication", "not a hub": "not readable"}[case]
    assert expected in lines[0]
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").rglob("*.safetensors"))


@pytest.mark.parametrize("url, message", [
    ("sftp://user:secret@127.0.0.1/hub", "passwords in URLs are refused"),
    ("sftp://127.0.0.1:notaport/hub", "port is not a number"),
    ("sftp://127.0.0.1", "expected sftp://"),
    ("s3://bucket/hub", "only sftp:// URLs"),
])
def test_malformed_source_urls_are_bad_input(nas, tmp_path, url, message):
    manifest = manifest_for(tmp_path / "m.toml", nas, url, tmp_path / "local")
    result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest)
    assert result.code == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_the_nas_was_only_read(nas):
    """For the whole module: every link and every file's bytes on the NAS are as built."""
    assert tree(nas["hub"]) == nas["before"]


def test_a_read_that_failed_half_way_is_not_continued_with_its_own_answers(sshd, tmp_path):
    """A sequential read that fails (the file shrank under it) leaves requests unanswered; a later
    read where it would have ended gets that file's bytes there, not the failed read's answers."""
    hub = tmp_path / "hub"
    hub.mkdir()
    size = 8 * MiB
    data = pseudo_random(13, size)
    (hub / "blob").write_bytes(data)
    source = open_source(sshd.url(hub), {})
    reader = source.open("blob", uncached=True, sequential=True)
    try:
        os.truncate(hub / "blob", MiB // 2)
        with pytest.raises(OSError, match="changed on the source"):
            reader.readinto_at(memoryview(bytearray(2 * MiB)), 0)
        (hub / "blob").write_bytes(data)
        buffer = bytearray(2 * MiB)
        got = reader.readinto_at(memoryview(buffer), 2 * MiB)
        assert bytes(buffer[:got]) == data[2 * MiB:4 * MiB]
    finally:
        reader.close()


@pytest.mark.parametrize("mode", ["rewrite", "append"])
def test_a_nas_file_written_during_a_copy_over_sftp_is_never_staged_torn(sshd, tmp_path, mode):
    """A real process rewrites (or appends to) a NAS file while `stage mirror` copies it over SFTP,
    reading ahead: the bytes read ahead do not let a torn copy through. The copy is refused and
    nothing is staged; once the writer stops, the same command stages the file as it now is."""
    nas = Hub(tmp_path / "nas")
    snap = nas.repo("acme/Weights").snapshot()
    real = snap.add_real("weights.bin", os.urandom(96 * MiB))
    snap.finish(trees=False)
    local = tmp_path / "nvme"
    manifest = write_manifest(tmp_path / "m.toml", nas.root, local, {"acme/Weights": {}})
    manifest.write_text(manifest.read_text().replace(f'hub = "{nas.root}"', f'hub = "{sshd.url(nas.root)}"', 1))
    writer = source_writer(real, mode, local)
    try:
        result = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    finally:
        writer.kill()
        writer.wait()
    staged = local / "models--acme--Weights" / "snapshots" / snap.commit / "weights.bin"
    assert "Traceback" not in result.stderr
    assert result.code == 1, "a file written throughout the copy was accepted"
    assert any(p["kind"] == "mismatch" and "changed while it was copied" in p["detail"]
               for p in result.json["problems"]), result.json["problems"]
    assert not staged.exists()
    assert temp_files(local) == []
    again = run_stage("mirror", "--node", "dgx1", "--manifest", manifest, "--json")
    assert again.code == 0, again.stdout + again.stderr
    assert sha256_file(staged) == sha256_file(real)
