"""User settings from ``settings.toml`` in the config dir; every field says why it exists."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from localchat.backends.base import SPECULATIVE_MODES
from localchat.chat.window import WINDOW_MODES
from localchat.errors import UsageError
from localchat.gguf.estimate import KV_BYTES_PER_VALUE
from localchat.gguf.quants import SWA_CACHE_MODES
from localchat.models.launch import LaunchOptions
from localchat.models.planner import MIN_TOKENS_PER_S
from localchat.state.kvstate import DEFAULT_BUDGET_BYTES
from localchat.tools.config import McpServerConfig, parse_mcp_servers
from localchat.tools.results import DEFAULT_RESULT_CHARS
from localchat.units import parse_duration, parse_size

KV_CACHE_TYPES = tuple(KV_BYTES_PER_VALUE)


@dataclass(frozen=True)
class ServerConfig:
    """A named OpenAI-compatible server; ``name`` is empty for a URL given on the command line."""

    name: str
    url: str
    key_env: str | None = None


def _servers(path: Path, value: object) -> tuple[ServerConfig, ...]:
    entries = value if isinstance(value, list) else None
    if entries is None or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"{path}: servers must be [[servers]] tables with a name and a url")
    servers = []
    for entry in entries:
        name, url, key_env = entry.get("name"), entry.get("url"), entry.get("key_env")
        unknown = set(entry) - {"name", "url", "key_env"}
        if not isinstance(name, str) or not name or not isinstance(url, str) or not url:
            raise UsageError(f"{path}: each [[servers]] entry needs a name and a url")
        if unknown or (key_env is not None and not isinstance(key_env, str)):
            raise UsageError(
                f"{path}: server {name!r}: only name, url and key_env (a variable name) are read"
            )
        servers.append(ServerConfig(name, url, key_env))
    return tuple(servers)


LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ServeConfig:
    """``[serve]``: how ``localchat serve`` listens; its flags override each. The API key
    itself stays out of files: ``api_key_env`` names the variable that holds it."""

    host: str = "127.0.0.1"
    port: int = 8080
    ctx: int | None = None
    parallel: int | None = None  # None: what memory allows (at most 4)
    log_format: str = "text"
    api_key_env: str | None = None
    # How long a model loaded on demand stays loaded once idle ("10m", "1h", 0: unloaded
    # after each reply, -1: until room is needed); Ollama's ``keep_alive`` overrides it.
    keep_alive: str | int = "30m"
    max_models: int | None = None  # models loaded at once (None: what memory allows)


def _serve(path: Path, value: object) -> ServeConfig:
    if not isinstance(value, dict):
        raise UsageError(f"{path}: serve must be a [serve] table")
    known = {f.name for f in fields(ServeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise UsageError(
            f"{path}: [serve] has no {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    config = ServeConfig(**value)
    port_ok = (
        isinstance(config.port, int)
        and not isinstance(config.port, bool)
        and 0 < config.port < 65536
    )
    ctx_ok = all(
        n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0)
        for n in (config.ctx, config.parallel)
    )
    if not isinstance(config.host, str) or not config.host or not port_ok or not ctx_ok:
        raise UsageError(
            f"{path}: [serve] host must be an address, port 1 to 65535, ctx and parallel"
            " positive numbers"
        )
    if config.log_format not in LOG_FORMATS:
        raise UsageError(
            f"{path}: [serve] log_format must be one of {', '.join(LOG_FORMATS)}, not {config.log_format!r}"
        )
    if config.api_key_env is not None and not isinstance(config.api_key_env, str):
        raise UsageError(f"{path}: [serve] api_key_env must name an environment variable")
    try:
        parse_duration(config.keep_alive)
    except UsageError as exc:
        raise UsageError(f"{path}: [serve] keep_alive: {exc}") from None
    max_models = config.max_models
    if max_models is not None and (not isinstance(max_models, int) or max_models < 1):
        raise UsageError(f"{path}: [serve] max_models must be a number from 1, not {max_models!r}")
    return config


@dataclass(frozen=True)
class Settings:
    state_budget_bytes: int = DEFAULT_BUDGET_BYTES
    """Disk space saved KV states may take; the least recently used are deleted beyond it."""

    max_tokens: int = 512
    """Longest reply, in tokens."""

    temperature: float = 0.7
    """Sampling temperature; 0 is greedy and deterministic."""

    kv_type: str = "f16"
    """KV cache type: "q8_0" halves the cache in memory and its saved state files on disk
    (at a small quality cost); "q4_0" quarters them."""

    min_tokens_per_s: float = MIN_TOKENS_PER_S
    """Generation speed a model plan should reach on this machine (about reading speed): the
    planner takes the best quant that is predicted to generate at least this fast."""

    swa_cache: str = "window"
    """Sliding-window models (Gemma 2/3, gpt-oss, Cohere 2): "window" keeps only the window
    those layers look at (a fraction of the memory); "full" keeps every position, so that
    an edit or regenerate far back never has to re-read the conversation."""

    speculative: str = "auto"
    """Speculative decoding: drafts by prompt lookup (faster where a reply repeats its
    context: a file returned with a change, a quote) and by a draft model, verified in one
    step. "auto" where replies stay exactly what they would be without it (flash attention
    over a quantized KV cache on a CPU: kv_type "q8_0" or "q4_0"), "ngram" (prompt lookup)
    and "draft" (the draft model) everywhere (llama.cpp's batches round differently from
    single steps, so a reply may differ in a token now and then), "off" never."""

    draft_model: str = ""
    """A smaller model of the same family that drafts for the one you chat with (a catalog
    name such as "qwen2.5-0.5b-instruct", or a .gguf file); empty: the one the catalog names
    for the model, where it is downloaded and the plan predicts a gain."""

    window_mode: str = "auto"
    """When old messages leave the context: "shift" the KV cache in place (fast), "exact"
    re-evaluate the new window, or "auto" (shift where the model family allows it)."""

    prefix_state_min_tokens: int = 256
    """A system prompt of at least this many tokens is saved as a shared prefix state the
    first time it is read, and restored (not re-read) when a new conversation or a one-off
    ask starts with it again; 0 turns prefix states off. They share state_budget."""

    type_ahead: bool = True
    """The app reads a message while it is typed (the model evaluates the finished words in
    the background), so Enter waits only for the last few; false: nothing before Enter."""

    restore_on_open: bool = True
    """The app restores an opened conversation's saved KV cache at once, in the background,
    so its first turn starts warm; false: the first turn restores it."""

    servers: tuple[ServerConfig, ...] = ()
    """OpenAI-compatible servers to chat through by name (``[[servers]]`` tables with
    ``name``, ``url`` — the API base, e.g. http://gpu-box:8000/v1 — and optionally
    ``key_env``, the environment variable holding its API key)."""

    serve: ServeConfig = ServeConfig()
    """``localchat serve``'s address, context and log format (``[serve]``)."""

    mcp: tuple[McpServerConfig, ...] = ()
    """MCP servers whose tools a model may call, with your consent (``[[mcp]]`` tables with
    ``name`` and either ``command = ["prog", "arg"]`` (optionally ``env``, ``cwd``) or
    ``url`` (optionally ``headers_env``); ``timeout_s`` bounds one call)."""

    tool_result_chars: int = DEFAULT_RESULT_CHARS
    """Longest tool result the model reads, in characters; a longer one is cut, saying so."""

    def launch(self, flags: LaunchOptions) -> LaunchOptions:
        """The launch options with what the flags left unset taken from here."""
        return replace(
            flags,
            kv_type=flags.kv_type or self.kv_type,
            swa_cache=flags.swa_cache or self.swa_cache,
            speculative=flags.speculative or self.speculative,
            draft_model=flags.draft_model or self.draft_model or None,
            draft_required=flags.draft_required or flags.draft_model is not None,
        )

    def server(self, spec: str) -> ServerConfig:
        """A server by its configured name, or a URL given as is."""
        found = next((s for s in self.servers if s.name == spec), None)
        if found is not None:
            return found
        if "://" in spec:
            return ServerConfig(name="", url=spec)
        names = ", ".join(s.name for s in self.servers) or "none configured"
        raise UsageError(
            f"no server named {spec!r} in settings.toml ({names}); give a URL such as"
            " http://gpu-box:8000/v1 or add a [[servers]] entry"
        )


def load_settings(path: Path) -> Settings:
    """Read ``path`` if it exists; an unknown key or bad value names the file and the key."""
    if not path.exists():
        return Settings()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: cannot read settings ({exc})") from None
    try:
        settings = Settings(**_setting_values(path, data))  # type: ignore[arg-type]
    except TypeError as exc:
        raise UsageError(f"{path}: {exc}") from None
    _check_choices(path, settings)
    _check_numbers_and_switches(path, settings)
    return settings


def _setting_values(path: Path, data: dict[str, object]) -> dict[str, object]:
    """The file's keys as Settings fields (dashes or underscores), the tables and sizes
    parsed; an unknown key raises."""
    known = {f.name for f in fields(Settings)}
    values: dict[str, object] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "state_budget":
            name, value = "state_budget_bytes", parse_size(str(value))
        if name == "servers":
            value = _servers(path, value)
        if name == "serve":
            value = _serve(path, value)
        if name == "mcp":
            value = parse_mcp_servers(path, value)
        if name not in known:
            raise UsageError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
        values[name] = value
    return values


def _check_choice(path: Path, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{path}: {name} must be one of {', '.join(choices)}, not {value!r}")


def _check_choices(path: Path, settings: Settings) -> None:
    """Each setting that names a mode holds one of its modes (the draft model: a name)."""
    _check_choice(path, "window_mode", settings.window_mode, WINDOW_MODES)
    _check_choice(path, "swa_cache", settings.swa_cache, SWA_CACHE_MODES)
    _check_choice(path, "speculative", settings.speculative, SPECULATIVE_MODES)
    if not isinstance(settings.draft_model, str):
        raise UsageError(
            f"{path}: draft_model must be a model name or a .gguf file, not {settings.draft_model!r}"
        )
    _check_choice(path, "kv_type", settings.kv_type, KV_CACHE_TYPES)


# Settings that are neither numbers nor switches (checked by _check_choices, or parsed).
NOT_NUMBERS = (
    "window_mode",
    "kv_type",
    "swa_cache",
    "speculative",
    "draft_model",
    "servers",
    "serve",
    "mcp",
)


def _check_numbers_and_switches(path: Path, settings: Settings) -> None:
    """A switch is true or false; every other plain setting a non-negative number."""
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if f.type == "bool":
            if not isinstance(value, bool):
                raise UsageError(f"{path}: setting {f.name} must be true or false, not {value!r}")
            continue
        if f.name in NOT_NUMBERS:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise UsageError(
                f"{path}: setting {f.name} must be a non-negative number, not {value!r}"
            )
