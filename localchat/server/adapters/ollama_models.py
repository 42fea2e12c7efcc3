"""Ollama's listings: ``/api/tags`` (every model served), ``/api/show`` (one model's
details, context and template), ``/api/ps`` (the models loaded, and when each unloads)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from localchat.server.model_facts import ServedModel
from localchat.server.requests import bad

FOREVER_STAMP = "2318-01-01T00:00:00Z"  # Ollama's "never unloaded"


def _details(model: ServedModel) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": model.architecture,
        "families": [model.architecture],
        "parameter_size": model.parameter_label,
        "quantization_level": model.quantization,
    }


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def tags(served: list[ServedModel]) -> dict[str, Any]:
    """``/api/tags``: every model served, under each of its names."""
    entries = [{"name": _tagged(name), "model": _tagged(name),
                "modified_at": _stamp(model.modified_at), "size": model.size_bytes,
                "digest": model.digest, "details": _details(model)}
               for model in served for name in model.names]  # fmt: skip
    return {"models": entries}


def show(model: ServedModel) -> dict[str, Any]:
    """``/api/show``: details, ``model_info`` (the context length is what one request may
    hold here), ``capabilities`` and the chat template."""
    arch = model.architecture
    info = {
        "general.architecture": arch,
        "general.parameter_count": model.parameters,
        f"{arch}.context_length": model.n_ctx,
        "general.file_type": model.quantization,
    }
    return {
        "modelfile": f"# served by localchat\nFROM {model.name}\nPARAMETER num_ctx {model.n_ctx}\n",
        "parameters": f"num_ctx {model.n_ctx}",
        "template": model.template,
        "details": _details(model),
        "model_info": info,
        "capabilities": list(model.capabilities),
        "modified_at": _stamp(model.modified_at),
    }


def running(served: list[ServedModel]) -> dict[str, Any]:
    """``/api/ps``: the models loaded, each with the memory it holds (weights and caches)
    and when keep_alive unloads it (a model kept for good, or answering now, says the far
    future as Ollama does)."""
    entries = []
    for model in served:
        if model.status != "loaded":
            continue
        left = model.expires_in_s
        expires = _stamp(time.time() + left) if left is not None else FOREVER_STAMP
        entries.append({"name": _tagged(model.name), "model": _tagged(model.name),
                        "size": model.memory_bytes, "digest": model.digest,
                        "details": _details(model), "expires_at": expires, "size_vram": 0,
                        "context_length": model.n_ctx})  # fmt: skip
    return {"models": entries}


def show_request(body: Any) -> str:
    """The model an ``/api/show`` body names: ``model`` (or the older ``name``)."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str):
        raise bad("model must name a model", "invalid_type")
    return name
