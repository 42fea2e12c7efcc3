"""A local HTTP server that speaks the part of the Hugging Face hub's API localchat uses.

Tests point ``HF_ENDPOINT`` at it (nothing reaches the internet). It serves files from a
folder per repo, answers range requests, reports LFS sizes and sha256 like the hub, and can
be told to cut a transfer mid-file or to serve corrupted bytes.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from localchat.models.hub import file_sha256

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubState:
    """What the server serves, and the faults it injects."""

    repos: dict[str, Path] = field(default_factory=dict)
    cut_after_bytes: int | None = None  # end the next full download after this many bytes
    corrupt: set[str] = field(default_factory=set)  # file names served with flipped bytes
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, range)
    authorizations: list[str] = field(default_factory=list)  # each request's Authorization
    # A hostile hub: names listed for files that are not where they say, and a forged ETag.
    aliases: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (repo, real)
    forged_etag: str | None = None

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        for alias, (alias_repo, real) in self.aliases.items():
            if alias_repo == repo:
                files[alias] = root / real
        return files


class _Handler(BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, payload: object, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self, what: str) -> None:
        body = json.dumps({"error": f"{what} not found"}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header(
            "X-Error-Code", "EntryNotFound" if "/resolve/" in self.path else "RepoNotFound"
        )
        self.send_header("X-Error-Message", f"{what} not found")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._handle(head=False)

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def _handle(self, head: bool) -> None:
        state = self.server.state
        path = unquote(self.path.split("?", 1)[0])
        state.requests.append((self.command, path, self.headers.get("Range", "")))
        state.authorizations.append(self.headers.get("Authorization", ""))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if info:
            repo = info.group(1)
            if repo not in state.repos:
                return self._not_found(f"repo {repo}")
            siblings = [
                {
                    "rfilename": name,
                    "size": p.stat().st_size,
                    "lfs": {"sha256": file_sha256(p), "size": p.stat().st_size, "pointerSize": 134},
                }
                for name, p in state.files(repo).items()
            ]
            return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings})
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if tree:
            repo = tree.group(1)
            if repo not in state.repos:
                return self._not_found(f"repo {repo}")
            entries = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": COMMIT,
                 "lfs": {"oid": file_sha256(p), "size": p.stat().st_size, "pointerSize": 134}}
                for name, p in state.files(repo).items()
            ]  # fmt: skip
            return self._json(entries)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve:
            # Like the hub, a file asked for at a commit names that commit.
            commit = resolve.group(2) if re.fullmatch(r"[0-9a-f]{40}", resolve.group(2)) else COMMIT
            return self._serve_file(resolve.group(1), resolve.group(3), head, commit)
        self._not_found(path)

    def _serve_file(self, repo: str, name: str, head: bool, commit: str = COMMIT) -> None:
        state = self.server.state
        if repo not in state.repos:
            return self._not_found(f"repo {repo}")
        files = state.files(repo)
        if name not in files:
            return self._not_found(f"file {name}")
        data_path = files[name]
        size = data_path.stat().st_size
        start, end = 0, size - 1
        ranged = self.headers.get("Range")
        if ranged:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", ranged.strip())
            if match:
                start = int(match.group(1))
                end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        length = end - start + 1
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        etag = state.forged_etag or file_sha256(data_path)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Linked-Etag", f'"{etag}"')
        self.send_header("X-Linked-Size", str(size))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        with data_path.open("rb") as handle:
            handle.seek(start)
            data = handle.read(length)
        if name in state.corrupt:
            data = bytes(b ^ 0xFF if i % 4096 == 0 else b for i, b in enumerate(data))
        cut = state.cut_after_bytes
        if cut is not None and length > cut:
            state.cut_after_bytes = None
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: HubState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
