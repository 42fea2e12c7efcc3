"""A small OpenAI-compatible server of our own, for what a real one will not do on demand:
drop a stream mid-reply, send a malformed event, put escapes in text, wait before the first
token, refuse a key, fail, or answer "context length exceeded".

It streams ``reply`` one piece per event, the way llama.cpp's servers send tokens, and
records each chat request's body and whether the client hung up.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class ServerScript:
    """What the server answers; change fields between requests to inject faults."""

    models: list[dict[str, Any]] = field(default_factory=lambda: [{"id": "stand-in"}])
    reply: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "."])
    key: str | None = None  # the bearer key it wants (None: any)
    first_token_delay_s: float = 0.0
    drop_after: int | None = None  # close the connection after this many content events
    malformed_after: int | None = None  # send a non-JSON event after this many
    error_event_after: int | None = None  # send an {"error": …} event after this many
    status: int = 200  # answer the chat request with this status (and an error body)
    context_limit: int | None = None  # characters/4 a prompt may hold, else 400
    tokenize: bool = False  # serve llama-server's /tokenize (one token per 4 characters)
    metrics: str | None = None  # the /metrics page, if any
    usage: bool = True  # send a final usage chunk
    tokens_per_event: int = 1  # what usage reports per content event (vLLM packs several)
    requests: list[dict[str, Any]] = field(default_factory=list)
    hung_up: threading.Event = field(default_factory=threading.Event)


def _tokens(text: str) -> int:
    return max(1, -(-len(text) // 4))


class _Handler(BaseHTTPRequestHandler):
    server: SSEServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, payload: object, content_type: str = "application/json") -> None:
        body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        key = self.server.script.key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send(401, {"error": {"message": "Invalid API key", "type": "auth"}})
        return False

    def do_GET(self) -> None:
        script = self.server.script
        if self.path == "/v1/models":
            if self._authorized():
                self._send(200, {"object": "list", "data": script.models})
        elif self.path == "/metrics" and script.metrics is not None:
            self._send(200, script.metrics, "text/plain")
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        script = self.server.script
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/tokenize" and script.tokenize:
            self._send(200, {"tokens": list(range(_tokens(body.get("content", ""))))})
            return
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        if not self._authorized():
            return
        script.requests.append(body)
        if body.get("model") not in [m["id"] for m in script.models]:
            self._send(404, {"error": {"message": f"model {body.get('model')} not found"}})
            return
        if script.status != 200:
            self._send(script.status, {"error": {"message": "the stand-in failed on purpose"}})
            return
        prompt = sum(_tokens(m["content"]) + 6 for m in body["messages"])
        if script.context_limit is not None and prompt > script.context_limit:
            message = (
                f"This model's maximum context length is {script.context_limit} tokens."
                f" However, you requested {prompt} tokens."
            )
            self._send(400, {"error": {"message": message, "code": "context_length_exceeded"}})
            return
        self._stream(script, prompt)

    def _event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, script: ServerScript, prompt: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self._event(json.dumps({"choices": [{"delta": {"role": "assistant"}}]}))
            deadline = time.monotonic() + script.first_token_delay_s
            while time.monotonic() < deadline:  # a slow first token: the client may hang up
                time.sleep(0.1)
                # A keep-alive comment, as sse-starlette sends: no event reaches the client's
                # reading loop, so only a hang-up from its side can end the wait.
                self.wfile.write(b": ping\n\n")
                self.wfile.flush()
            for sent, piece in enumerate(script.reply):
                if script.drop_after is not None and sent == script.drop_after:
                    return
                if script.malformed_after is not None and sent == script.malformed_after:
                    self._event("{not json")
                if script.error_event_after is not None and sent == script.error_event_after:
                    self._event(json.dumps({"error": {"message": "out of memory on the GPU"}}))
                    return
                self._event(json.dumps({"choices": [{"delta": {"content": piece}}]}))
            finish = {"choices": [{"delta": {}, "finish_reason": "stop"}]}
            self._event(json.dumps(finish))
            if script.usage:
                generated = len(script.reply) * script.tokens_per_event
                usage = {"prompt_tokens": prompt, "completion_tokens": generated}
                self._event(json.dumps({"choices": [], "usage": usage}))
            self._event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            script.hung_up.set()


class SSEServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: ServerScript) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self) -> SSEServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
