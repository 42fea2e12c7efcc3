"""An OpenAI-compatible server as a backend: vLLM, llama-server, Ollama, LM Studio, or
llama-cpp-python's own server, all streamed over Server-Sent Events.

The server renders the chat template and keeps its own cache (vLLM's prefix cache,
llama-server's slots); localchat keeps the transcript, the window and the figures. What a
server answers is outside text: every error names the server and is one bounded line, and
replies are shown as text by the layers above. httpx and httpx-sse carry the wire, all of
it here: a reply's events are read into text and figures by ``remote_reply``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx_sse

from localchat.backends.base import BackendView, CacheView, Sampling
from localchat.backends.remote_errors import (
    ERROR_TEXT_LIMIT,
    ContextExceeded,
    RemoteError,
    ServerRefused,
)
from localchat.backends.remote_reply import RemoteReply
from localchat.chat.images import openai_parts
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolUse
from localchat.errors import UsageError, one_line
from localchat.paths import app_paths
from localchat.state.images import ImageStore
from localchat.text import shown

# The key: localchat's own variable first, then the one every OpenAI client reads.
API_KEY_ENVS = ("LOCALCHAT_API_KEY", "OPENAI_API_KEY")
CONNECT_TIMEOUT_S = 5.0
# A long prompt on a busy server can take minutes before its first token.
READ_TIMEOUT_S = 600.0
# What a chat template adds around each message (role header, end marker) where the server
# cannot count: the window plans with it, and the figures say "estimated".
MESSAGE_OVERHEAD_TOKENS = 6
# An image's tokens, planned before the server reads it: most small vision models take 256
# to 1,100 (Gemma 3 256, LLaVA 576, SmolVLM about 1,100); a Qwen2-VL photo can take more.
IMAGE_TOKENS_GUESS = 1024
DATA_URIS = 64 * 2**20  # the images' data URIs kept to send again, at most (the last always)
CHARS_PER_TOKEN = 4
# The cache figure after a turn is a nicety: never worth more than this wait.
METRICS_TIMEOUT_S = 1.0
# Texts whose counts are remembered (a long conversation's messages, not without bound).
COUNT_CACHE_SIZE = 4096
# Prometheus gauges that say how full the server's KV cache is (0–1).
KV_USAGE_METRICS = (
    "llamacpp:kv_cache_usage_ratio",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
_CONTEXT_ERROR = re.compile(
    r"context length|context window|context size|exceed_context|context_length_exceeded", re.I
)
_CONTEXT_LIMIT = re.compile(
    r"(?:maximum context length|context window of|n_ctx)\D{0,20}(\d+)", re.I
)


def api_key_from_env(key_env: str | None = None) -> str | None:
    """The API key: ``key_env`` if a server names one, else LOCALCHAT_API_KEY, OPENAI_API_KEY."""
    names = (key_env,) if key_env else API_KEY_ENVS
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


@dataclass(frozen=True)
class ServerModel:
    """One model a server lists, with its context size where the listing gives it."""

    id: str
    context_size: int | None = None


def server_label(url: str) -> str:
    """How errors and the app name a server: its host and port."""
    parts = urlsplit(url)
    return parts.netloc or url


def _check_url(url: str) -> str:
    """The API base as given, if httpx can reach it: an http(s) URL with a host and port."""
    bad = UsageError(
        f"server URL {shown(url)!r} is not an http(s) address; give the API base,"
        " e.g. http://gpu-box:8000/v1"
    )
    try:
        parsed = httpx.URL(url.strip())
        _ = parsed.port  # a port that is not a number fails here
    except (ValueError, httpx.InvalidURL):
        raise bad from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise bad
    return url.strip().rstrip("/")


def _check_key(api_key: str | None, key_source: str) -> None:
    """An API key goes into an HTTP header: printable ASCII only."""
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
        raise UsageError(
            f"the API key in {key_source} has characters an HTTP header cannot carry;"
            " check the variable's value"
        )


def _transport_error(server: str, exc: Exception) -> RemoteError:
    """A refused connection or a timeout, as one line naming the server."""
    if isinstance(exc, httpx.TimeoutException):
        return RemoteError(f"{server} did not answer in time")
    return RemoteError(
        f"cannot reach {server} ({shown(one_line(exc), 80)}); is the server running at that"
        " address?"
    )


def _error_text(response: httpx.Response) -> str:
    """The server's own words about a failed request, bounded to one line."""
    with contextlib.suppress(httpx.HTTPError):
        response.read()
    body: Any = None
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        body = json.loads(response.content or b"null")
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message") or error.get("type") or json.dumps(error)
        if error is not None:
            return shown(" ".join(str(error).split()), ERROR_TEXT_LIMIT)
    text = response.content.decode("utf-8", "replace")
    return shown(" ".join(text.split()), ERROR_TEXT_LIMIT) or response.reason_phrase


def _context_limit(text: str) -> int | None:
    match = _CONTEXT_LIMIT.search(text)
    return int(match.group(1)) if match else None


def metric_value(text: str, names: Sequence[str]) -> float | None:
    """The first of ``names`` in a Prometheus text exposition (any labels), as a number."""
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        if name in names:
            rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name) :]
            with contextlib.suppress(ValueError, IndexError):
                return float(rest.split()[0])  # a timestamp may follow the value
    return None


def stream_body(
    model: str | None,
    messages: Sequence[ChatMessage],
    sampling: Sampling,
    max_tokens: int,
    image_url: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The body of a streamed chat request, every sampling setting spelled out: a server's
    defaults differ (llama-cpp-python's repeat penalty is 1.1), and a field left out is a
    different reply. A message's images go as ``image_url`` parts where they are in it
    (``image_url``: an image's key as the data URI sent)."""
    return {
        "model": model,
        "messages": [_openai_message(m, image_url) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repeat_penalty": sampling.repeat_penalty,
        "seed": sampling.seed,
    }


def _openai_message(message: ChatMessage, image_url: Callable[[str], str] | None) -> dict[str, Any]:
    """One message as OpenAI's API takes it, its images as content parts."""
    sent = message.as_openai()
    if message.images:
        if image_url is None:
            raise UsageError("this message shows images and nothing here can send them")
        sent["content"] = openai_parts(message.content, message.images, message.image_at, image_url)
    return sent


class RemoteBackend:
    """A model on an OpenAI-compatible server: lists, counts, streams, reports its cache."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        *,
        name: str | None = None,
        context_size: int | None = None,
        transport: httpx.BaseTransport | None = None,
        key_env: str | None = None,
    ) -> None:
        """``context_size``: the server's context where the user knows it better than the
        server says (llama-cpp-python's server does not publish it). ``key_env``: the
        variable the key came from, named when the server refuses it."""
        self.url = _check_url(url)
        self.key_source = key_env or " or ".join(API_KEY_ENVS)
        _check_key(api_key, self.key_source)
        self.server = name or server_label(self.url)
        # The server's root, where llama-server and vLLM put /tokenize, /props and /metrics.
        self.root = self.url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            transport=transport,
        )
        try:
            self._choose(model, context_size)
        except BaseException:
            self._client.close()
            raise
        # Which tokenize route the server has: unknown (None), found (a path) or none ("").
        self._tokenize_path: str | None = None
        self._metrics_seen: bool | None = None
        self._counts: dict[str, int] = {}
        self._reads_images: bool | None = None  # what the server's /props says, once asked
        self._asked_images = False
        self._data_uris: OrderedDict[str, str] = OrderedDict()  # the latest images sent
        self._images: ImageStore | None = None  # the data folder's, on the first image sent

    def _choose(self, model: str | None, context_size: int | None) -> None:
        self.models = self.list_models()
        if not self.models:
            raise RemoteError(f"{self.server} lists no models; load one on the server")
        if model is None:
            chosen = self.models[0]
        else:
            found = next((m for m in self.models if m.id == model), None)
            if found is None:
                ids = ", ".join(shown(m.id, 60) for m in self.models[:8])
                raise ServerRefused(
                    f"{self.server} has no model {shown(model)!r}; it serves {ids}"
                    " (pick one with --model)"
                )
            chosen = found
        self.model = chosen.id
        self._context = context_size or chosen.context_size or self._probe_context()

    # -- what the conversation layer asks (backend.Backend) ------------------------------
    @property
    def model_name(self) -> str:
        return f"{self.model} @ {self.server}"

    @property
    def fingerprint(self) -> str:
        return f"remote:{self.url}#{self.model}"

    @property
    def context_size(self) -> int | None:
        return self._context

    @property
    def threads(self) -> int:
        """A server's reply costs this machine one thread: the reader's."""
        return 1

    @property
    def frees_with_process(self) -> bool:
        """Its client holds connections: closed, even when the app quits."""
        return False

    def images_refused(self) -> str | None:
        """Images go to the server as data URIs; one whose ``/props`` says it reads none
        (llama-server's, localchat serve's) refuses them here, before anything is sent.
        Another server that cannot read them says so when it is asked."""
        if not self._asked_images:
            self._reads_images, self._asked_images = self._probe_vision(), True
        if self._reads_images is False:
            return (
                f"{self.model} on {self.server} reads no images (its server loaded it"
                " without a projector); start the server with the model's mmproj, or run a"
                " vision model here with --model-path"
            )
        return None

    def _probe_vision(self) -> bool | None:
        """llama-server's ``/props`` says whether its model reads images (None: no page)."""
        with contextlib.suppress(RemoteError):
            # autoload: a llama-server router answers for a model it has not loaded
            # without loading it (an unloaded one answers no page: unknown).
            params = {"model": self.model, "autoload": "false"}
            response = self._request("GET", f"{self.root}/props", params=params)
            if response.status_code == 200:
                with contextlib.suppress(ValueError, AttributeError):
                    vision = response.json().get("modalities", {}).get("vision")
                    return vision if isinstance(vision, bool) else None
        return None

    def _image_url(self, key: str) -> str:
        """The stored image ``key`` as a data URI, as every OpenAI-compatible server takes
        an image (none fetches a file of ours)."""
        found = self._data_uris.get(key)
        if found is not None:
            self._data_uris.move_to_end(key)
            return found
        if self._images is None:
            self._images = ImageStore(app_paths().images_dir)
        stored = self._images.facts(key)
        data = base64.b64encode(self._images.get(key)).decode()
        found = self._data_uris[key] = f"data:{stored.mime};base64,{data}"
        while len(self._data_uris) > 1 and sum(map(len, self._data_uris.values())) > DATA_URIS:
            self._data_uris.popitem(last=False)  # every turn resends the history's images
        return found

    def describe(self) -> BackendView:
        context = f"ctx {self._context}" if self._context else "ctx not published by the server"
        return BackendView(
            f"{self.model} · {self.server}",
            f"{self.model}\non {self.server}\n{context}",
            self.model,
            None,  # the server renders its own template and does not say which
            self.url,
        )

    def cache_view(self, tokens: int, server_usage: float | None = None) -> CacheView:
        """The cache is the server's: its fill where its /metrics says, never a zero here."""
        return CacheView(
            tokens, self._context, server_usage=server_usage, counted=self.counts_exactly
        )

    def learn_context_size(self, n_ctx: int) -> None:
        """The server told its context in an error: plan with it from now on."""
        self._context = n_ctx

    def close(self) -> None:
        self._client.close()

    # -- requests -------------------------------------------------------------------------
    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request; a refused connection or a timeout becomes one line naming the server."""
        try:
            return self._client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise _transport_error(self.server, exc) from None

    def _raise_for(self, response: httpx.Response, what: str) -> None:
        """The one-line error for a refused request, by what the status means to the user."""
        status = response.status_code
        if status < 400:
            return
        text = _error_text(response)
        if status in (401, 403):
            raise ServerRefused(
                f"{self.server} refused the API key (HTTP {status}: {text}); set"
                f" {self.key_source} to a key it accepts"
            )
        if status == 404:
            raise ServerRefused(
                f"{self.server}: {what} not found (HTTP 404: {text}); check --model and that"
                " the URL is the API base (e.g. http://host:8000/v1)"
            )
        if status in (400, 413, 422) and _CONTEXT_ERROR.search(text):
            raise ContextExceeded(
                f"{self.server}: the prompt does not fit the model's context ({text});"
                " start a new conversation or send a shorter message",
                _context_limit(text),
            )
        raise RemoteError(f"{self.server} failed on {what} (HTTP {status}: {text})")

    def _json(self, response: httpx.Response, what: str) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.server} answered {what} with something not JSON") from None

    def list_models(self) -> list[ServerModel]:
        """The models the server serves (``/models``), with contexts where it says them."""
        response = self._request("GET", f"{self.url}/models")
        self._raise_for(response, "the model list")
        data = self._json(response, "the model list")
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise RemoteError(f"{self.server} answered the model list without a 'data' list")
        models = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            meta = entry.get("meta")
            context = entry.get("max_model_len") or (
                meta.get("n_ctx") if isinstance(meta, dict) else None
            )  # vLLM, llama-server
            models.append(ServerModel(entry["id"], context if isinstance(context, int) else None))
        return models

    def _probe_context(self) -> int | None:
        """llama-server's ``/props`` says the context of its slots; others have no such page."""
        with contextlib.suppress(RemoteError):
            response = self._request("GET", f"{self.root}/props")
            if response.status_code == 200:
                with contextlib.suppress(ValueError, AttributeError):
                    settings = response.json().get("default_generation_settings", {})
                    n_ctx = settings.get("n_ctx")
                    if isinstance(n_ctx, int) and n_ctx > 0:
                        return n_ctx
        return None

    # -- counting -------------------------------------------------------------------------
    @property
    def counts_exactly(self) -> bool:
        """Whether token counts come from the server's tokenizer (else they are estimates)."""
        return bool(self._tokenize_path)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text``: by the server's ``/tokenize`` where it has one (llama-server,
        vLLM, llama-cpp-python's ``/extras/tokenize``), else estimated from its length."""
        if text in self._counts:
            return self._counts[text]
        count = self._tokenize(text) if self._tokenize_path != "" else None
        if count is None:
            count = max(1, -(-len(text) // CHARS_PER_TOKEN)) if text else 0
        if len(self._counts) >= COUNT_CACHE_SIZE:
            self._counts.clear()
        self._counts[text] = count
        return count

    def _tokenize(self, text: str) -> int | None:
        # One body both llama-server ("content") and vLLM ("prompt") read.
        body: dict[str, Any] = {"model": self.model, "content": text, "prompt": text}
        body |= {"input": text, "add_special": False, "add_special_tokens": False}
        paths = [self._tokenize_path] if self._tokenize_path else ["/tokenize", "/extras/tokenize"]
        for path in paths:
            try:
                response = self._request("POST", f"{self.root}{path}", json=body)
            except RemoteError:
                return None
            if response.status_code != 200:
                if path == self._tokenize_path:
                    return None  # a route that worked, failing once: estimate this one
                continue
            with contextlib.suppress(ValueError, AttributeError):
                tokens = response.json().get("tokens")
                if isinstance(tokens, list):
                    self._tokenize_path = path
                    return len(tokens)
        if not self._tokenize_path:
            self._tokenize_path = ""
        return None

    def message_tokens(self, message: ChatMessage) -> int:
        """What one message takes in the prompt: its text and the template around it, and
        a guess for each image (how many tokens an image takes is the server's model's)."""
        text = self.count_tokens(message.content) + MESSAGE_OVERHEAD_TOKENS
        return text + IMAGE_TOKENS_GUESS * len(message.images)

    # -- the server's cache ---------------------------------------------------------------
    def cache_usage(self) -> float | None:
        """How full the server's KV cache is (0–1) where its ``/metrics`` says; else None."""
        if self._metrics_seen is False:
            return None
        try:
            response = self._client.get(f"{self.root}/metrics", timeout=METRICS_TIMEOUT_S)
        except Exception:  # a closed client, a stalled server: the figure is just not shown
            return None
        usage = (
            metric_value(response.text, KV_USAGE_METRICS) if response.status_code == 200 else None
        )
        self._metrics_seen = usage is not None
        if usage is not None and usage > 1.0:  # some versions report percent
            usage /= 100.0
        return usage

    # -- a reply --------------------------------------------------------------------------
    def stream(
        self,
        messages: Sequence[ChatMessage],
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        tool_use: ToolUse | None = None,
    ) -> RemoteReply:
        """Send the conversation and open the reply's stream: a refusal (key, model, context,
        server down) raises here, before anything is shown; the text comes as it is read.
        The tools offered go as OpenAI's ``tools``; the server parses the calls."""
        body = stream_body(
            self.model, messages, sampling or Sampling(), max_tokens, self._image_url
        )
        if tool_use is not None and tool_use.tools:
            body["tools"] = [tool.schema() for tool in tool_use.tools]
            choice = tool_use.forced_name
            body["tool_choice"] = (
                tool_use.choice
                if choice is None
                else {"type": "function", "function": {"name": choice}}
            )
        # Counted before the stream opens: llama-cpp-python's server cuts a running stream
        # short when another request (a tokenize) waits for its model.
        prompt_tokens = sum(self.message_tokens(m) for m in messages)
        sent = time.perf_counter()
        context = httpx_sse.connect_sse(
            self._client, "POST", f"{self.url}/chat/completions", json=body
        )
        try:
            source = context.__enter__()
        except httpx.HTTPError as exc:
            raise _transport_error(self.server, exc) from None
        try:
            self._raise_for(source.response, "the chat request")
        except BaseException:
            context.__exit__(None, None, None)
            raise
        connection = _SSEConnection(context, source, self.server, cancel)
        return RemoteReply(self, connection, sent, cancel, prompt_tokens)


class _SSEConnection:
    """A reply's open connection, the part of it that is httpx's (``remote_reply.EventStream``):
    the events' data as they arrive, a hang-up, the close."""

    def __init__(
        self,
        context: Any,  # httpx_sse's context manager, exited when the reply ends
        source: httpx_sse.EventSource,
        server: str,
        cancel: threading.Event | None,
    ) -> None:
        self._context = context
        self._source = source
        self._server = server
        self._cancel = cancel

    def data(self) -> Iterator[str]:
        """Each event's data; a connection that breaks is a RemoteError, unless the user
        cancelled (the hang-up broke it): then the events just end."""
        try:
            for event in self._source.iter_sse():
                yield event.data
        except httpx.HTTPError as exc:
            if self._cancel is None or not self._cancel.is_set():
                raise RemoteError(
                    f"{self._server}: the connection broke mid-reply ({shown(str(exc), 80)});"
                    " the partial reply is kept"
                ) from None

    def hang_up(self) -> None:
        """Shut the socket down: on Linux that wakes a reader blocked in ``recv`` (closing
        alone does not) and tells the server, which stops generating. The reader closes the
        response itself when it wakes."""
        stream = self._source.response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._context.__exit__(None, None, None)
