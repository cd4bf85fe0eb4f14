"""A small Hugging Face Hub on 127.0.0.1, enough for huggingface_hub's own `snapshot_download`.

Point a client at it with `HF_ENDPOINT=mock.url` (and `HF_HUB_DISABLE_XET=1`: no Xet headers are
served). Endpoints, as huggingface_hub 2.x calls them:

- `GET /api/models/{repo}[/revision/{rev}]`: model_info; `sha` is the commit, `siblings` the files.
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`: list_repo_tree, paginated with a
  `Link: <...&cursor=N>; rel="next"` header, `page_size` entries a page.
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: a regular file answers 200 with `ETag: "<git sha1>"`;
  an LFS file answers 302 to `http://localhost:<port>/cdn/<sha256>` (another origin, as the Hub's
  CDN is, so the client stops at the redirect) with `X-Linked-Etag: "<sha256>"` and
  `X-Linked-Size`. Both carry `X-Repo-Commit`. Errors carry the Hub's `X-Error-Code`.
- `HEAD|GET /cdn/<sha256>`: the LFS bytes; `Range: bytes=a-[b]` answers 206.

Each repo holds any number of commits; `move_ref` moves a branch between them. `throttle[path] =
bytes per second` serves that file slowly (it may be changed while a download runs), so a client
can be killed half-way through it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
CHUNK = 64 * 1024


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class File:
    path: str
    data: bytes = field(repr=False)
    lfs: bool

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @cached_property
    def oid(self) -> str:
        """The git blob id: of the LFS pointer for an LFS file, as git (and the Hub) store it."""
        return git_sha1(self.pointer if self.lfs else self.data)

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.oid, "size": len(self.data), "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        return entry


@dataclass
class MockRepo:
    commits: dict[str, dict[str, File]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class HubMock:
    def __init__(self, page_size: int = 3):
        self.repos: dict[str, MockRepo] = {}
        self.blobs: dict[str, File] = {}  # sha256 -> an LFS file with that content
        self.throttle: dict[str, float] = {}  # repo path -> bytes per second
        self.page_size = page_size
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._stopping = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}/cdn"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-mock", daemon=True)

    def __enter__(self) -> "HubMock":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()  # throttled responses end at their next chunk
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def commit(self, repo_id: str, files: dict[str, bytes], *, ref: str | None = "main") -> str:
        """Add a commit holding exactly `files` (LFS by suffix); move `ref` onto it. Returns its hash."""
        repo = self.repos.setdefault(repo_id, MockRepo())
        tree = {path: File(path, data, path.endswith(LFS_SUFFIXES)) for path, data in sorted(files.items())}
        digest = hashlib.sha1(f"{repo_id}:{len(repo.commits)}".encode())
        for f in tree.values():
            digest.update(f"{f.path}:{f.oid}".encode())
            if f.lfs:
                self.blobs[f.sha256] = f
        commit = digest.hexdigest()
        repo.commits[commit] = tree
        if ref:
            repo.refs[ref] = commit
        return commit

    def move_ref(self, repo_id: str, ref: str, commit: str) -> None:
        assert commit in self.repos[repo_id].commits
        self.repos[repo_id].refs[ref] = commit

    def files(self, repo_id: str, commit: str) -> dict[str, File]:
        return self.repos[repo_id].commits[commit]


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")


def _handler(hub: HubMock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            try:
                if m := _CDN.match(path):
                    self._cdn(m["sha"], body)
                elif m := _TREE.match(path):
                    self._tree(m["repo"], m["rev"], (m["path"] or "").strip("/"), query)
                elif m := _API.match(path):
                    self._info(m["repo"], m["rev"] or "main")
                elif m := _RESOLVE.match(path):
                    self._resolve(m["repo"], m["rev"], m["path"], body)
                else:
                    self._error(404, "", "Not found")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away (killed mid-download)

        def _reply(self, status: int, headers: dict[str, str], payload: bytes = b"", body: bool = True) -> None:
            hub.requests.append((self.command, self.path, status))
            self.send_response(status)
            for key, value in {"Content-Length": str(len(payload)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            if body and payload:
                self.wfile.write(payload)

        def _json(self, data, headers: dict[str, str] | None = None) -> None:
            self._reply(200, {"Content-Type": "application/json", **(headers or {})}, json.dumps(data).encode())

        def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
            extra = {"X-Error-Code": code} if code else {}
            self._reply(status, {**extra, "X-Error-Message": message, "Content-Type": "application/json", **(headers or {})},
                        json.dumps({"error": message}).encode(), body=self.command != "HEAD")

        def _commit(self, repo_id: str, rev: str) -> tuple[MockRepo | None, str | None]:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                return None, None
            commit = repo.resolve(rev)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo, commit

        def _info(self, repo_id: str, rev: str) -> None:
            repo, commit = self._commit(repo_id, rev)
            if commit:
                self._json({"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                            "disabled": False, "gated": False, "tags": [],
                            "siblings": [{"rfilename": p} for p in repo.commits[commit]]})

        def _tree(self, repo_id: str, rev: str, under: str, query: dict) -> None:
            repo, commit = self._commit(repo_id, rev)
            if not commit:
                return
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            entries, folders = [], set()
            prefix = f"{under}/" if under else ""
            for f in repo.commits[commit].values():
                if not f.path.startswith(prefix):
                    continue
                parts = f.path[len(prefix):].split("/")
                for depth in range(1, len(parts)):  # the folders on the way, as the Hub lists them
                    folder = prefix + "/".join(parts[:depth])
                    if folder not in folders and (recursive or depth == 1):
                        folders.add(folder)
                        entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                        "size": 0, "path": folder})
                if recursive or len(parts) == 1:
                    entries.append(f.tree_entry())
            if under and not entries:
                self._error(404, "EntryNotFound", f"{under} does not exist at {commit}")
                return
            start = int(query.get("cursor", ["0"])[0])
            page = entries[start:start + hub.page_size]
            headers = {}
            if start + hub.page_size < len(entries):
                nxt = f"{hub.url}/api/models/{repo_id}/tree/{rev}{'/' + under if under else ''}" \
                      f"?recursive={str(recursive).lower()}&cursor={start + hub.page_size}"
                headers["Link"] = f'<{nxt}>; rel="next"'
            self._json(page, headers)

        def _resolve(self, repo_id: str, rev: str, path: str, body: bool) -> None:
            repo, commit = self._commit(repo_id, rev)
            if not commit:
                return
            f = repo.commits[commit].get(path)
            if f is None:
                self._error(404, "EntryNotFound", f"{path} does not exist at {commit}", {"X-Repo-Commit": commit})
                return
            if f.lfs:
                self._reply(302, {"Location": f"{hub.cdn}/{f.sha256}", "X-Repo-Commit": commit, "ETag": f'"{f.oid}"',
                                  "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data))})
                return
            self._send_file(f, {"X-Repo-Commit": commit, "ETag": f'"{f.oid}"'}, body)

        def _cdn(self, sha: str, body: bool) -> None:
            f = hub.blobs.get(sha)
            if f is None:
                self._error(404, "", "No such object")
                return
            self._send_file(f, {"ETag": f'"{sha}"'}, body)

        def _send_file(self, f: File, headers: dict[str, str], body: bool) -> None:
            start, end, status = 0, len(f.data), 200
            if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
                start, status = int(m[1]), 206
                end = min(end, int(m[2]) + 1) if m[2] else end
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(f.data)}"
            self._reply(status, {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                                 "Content-Length": str(end - start)}, body=False)
            if not body:
                return
            view = memoryview(f.data)
            for offset in range(start, end, CHUNK):
                if hub._stopping.is_set():
                    self.close_connection = True
                    return
                self.wfile.write(view[offset:min(end, offset + CHUNK)])
                rate = hub.throttle.get(f.path)
                if rate:
                    time.sleep(CHUNK / rate)

    return Handler
