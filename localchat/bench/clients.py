"""``bench --only clients``: every wire API of ``localchat serve`` on the real SmolLM2, in a
process of its own, read by plain HTTP (httpx) as the official clients read it.

- ``agent_loop_reread_<api>``: a 10-turn agent loop through ``/v1/messages``,
  ``/v1/responses`` (continued by ``previous_response_id`` alone) and ``/api/chat``: a long
  system prompt, 10 tool definitions, each turn a tool call (held to one where the API can
  ask) and its result. The worst of turns 2-10's share of prompt tokens evaluated (not
  supplied by the cache), from the server's own counters; ``..._after_restart``: the next
  turn of each loop after the server restarted. ``agent_first_turn_s``: the first turn's
  seconds (the head read cold); ``agent_later_turn_s``, ``agent_restart_turn_s``: the
  median of later turns' and of the turns after the restart. The system prompt is ~8,000 tokens
  (``agent_head_tokens``), past SmolLM2's 8,192-token context with the tools and turns, so
  the loops run on the bench's generated model (a 16k context of its 32k; calls held by the
  grammar).
- ``api_parity``: 1 where a greedy reply is the same text through the four chat APIs.
- ``<api>_gen_ratio``: one stream's tokens/s through each API over
  ``/v1/chat/completions``'s, the median of pairs taken side by side, order alternating.
- ``structured_valid``: the share of 50 schema cases whose reply is valid JSON after the
  schema (``response_format``), and ``structured_speed_ratio``, their tokens/s over the
  same requests unconstrained (the median ratio).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, filler_text, say, scratch_dir
from localchat.bench.serve import ServeProcess, http_client, wait_server_idle

AGENT_CTX = 16384
HEAD_TOKENS = 8000  # the system prompt's, as agents send them
TURNS = 10
GEN_TOKENS = 48
GEN_PAIRS = 9
SCHEMA_CASES = 50
ASK = "Write a short note about caches."
APIS = ("messages", "responses", "ollama")


def _tools() -> list[dict[str, Any]]:
    """Ten function tools, as an agent offers them (OpenAI's shape)."""
    names = ["read_file", "write_file", "list_dir", "grep", "run_tests", "git_diff",
             "git_commit", "search_docs", "open_url", "ask_user"]  # fmt: skip
    return [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')}: {filler_text(i, 30)}",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "enum": ["a.py", "b.py", "c.md"]},
            "count": {"type": "integer", "enum": [1, 2, 3]}},
            "required": ["path", "count"]}}} for i, name in enumerate(names)]  # fmt: skip


def _metric(root: str) -> tuple[float, float]:
    """Prompt tokens evaluated, and those the cache supplied (memory and disk), so far."""
    from localchat.backends.remote import metric_value

    text = http_client().get(f"{root}/metrics").text
    evaluated = metric_value(text, ("llamacpp:prompt_tokens_total",)) or 0.0
    cached = sum(metric_value(text, (name,)) or 0.0 for name in (
        "localchat:prompt_tokens_cached_total", "localchat:prompt_tokens_restored_total"))  # fmt: skip
    return evaluated, cached


def _share_evaluated(root: str, send: Callable[[], None]) -> tuple[float, float]:
    """What share of one request's prompt was evaluated rather than supplied by the cache,
    and the request's seconds."""
    wait_server_idle(root)
    before = _metric(root)
    start = time.perf_counter()
    send()
    seconds = time.perf_counter() - start
    wait_server_idle(root)
    after = _metric(root)
    evaluated, cached = after[0] - before[0], after[1] - before[1]
    return evaluated / max(1.0, evaluated + cached), seconds


class _Loop:
    """One agent conversation through one API: each ``turn`` sends what is new."""

    def __init__(self, api: str, root: str, system: str, tools: list[dict[str, Any]]) -> None:
        self.api, self.root, self.system, self.tools = api, root, system, tools
        self.messages: list[dict[str, Any]] = []
        self.previous: str | None = None  # Responses: the id that continues it
        self.pending: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug in a.py."}]

    def turn(self, index: int) -> None:
        send = getattr(self, f"_{self.api}")
        send(index)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = http_client().post(f"{self.root}{path}", json=body)
        reply.raise_for_status()
        found: dict[str, Any] = reply.json()
        return found

    def _messages(self, index: int) -> None:
        self.messages += self.pending
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in self.tools]  # fmt: skip
        reply = self._post("/v1/messages", {"model": "local", "max_tokens": 60, "system": self.system,
            "messages": self.messages, "tools": tools, "tool_choice": {"type": "any"},
            "temperature": 0})  # fmt: skip
        self.messages.append({"role": "assistant", "content": reply["content"]})
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        self.pending = [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"result {index}: ok"}
            for b in uses] or f"result {index}: ok"}]  # fmt: skip

    def _responses(self, index: int) -> None:
        tools = [{"type": "function", **t["function"]} for t in self.tools]
        body = {"model": "local", "instructions": self.system, "tools": tools,
                "tool_choice": "required", "max_output_tokens": 60, "temperature": 0,
                "input": self.pending}  # fmt: skip
        if self.previous:
            body["previous_response_id"] = self.previous
        reply = self._post("/v1/responses", body)
        self.previous = reply["id"]
        calls = [i for i in reply["output"] if i["type"] == "function_call"]
        self.pending = [{"type": "function_call_output", "call_id": c["call_id"],
                         "output": f"result {index}: ok"} for c in calls] or [
            {"role": "user", "content": f"result {index}: ok"}]  # fmt: skip

    def _ollama(self, index: int) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system})
        self.messages += self.pending
        reply = self._post("/api/chat", {"model": "local", "messages": self.messages,
            "tools": self.tools, "stream": False,
            "options": {"temperature": 0, "num_predict": 60}})  # fmt: skip
        said = reply["message"]
        self.messages.append(
            {k: v for k, v in said.items() if k in ("role", "content", "tool_calls")}
        )
        calls = said.get("tool_calls") or []
        # Ollama has no way to require a call: a reply without one gets the result as text.
        self.pending = [{"role": "tool", "tool_name": c["function"]["name"],
                         "content": f"result {index}: ok"} for c in calls] or [
            {"role": "user", "content": f"result {index}: ok"}]  # fmt: skip


def _system_prompt(root: str) -> tuple[str, int]:
    """Filler text of about ``HEAD_TOKENS`` tokens in the served model's tokenizer."""

    def tokens(text: str) -> int:
        return len(http_client().post(f"{root}/tokenize", json={"content": text}).json()["tokens"])

    words = HEAD_TOKENS * 1000 // tokens(filler_text(3, 1000))
    system = filler_text(3, words)
    return system, tokens(system)


def _agent_loops(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    tools = _tools()
    results: dict[str, Any] = {}
    with ServeProcess(model, home, len(APIS), ctx=AGENT_CTX) as root:
        system, results["agent_head_tokens"] = _system_prompt(root)
        loops = [_Loop(api, root, system, tools) for api in APIS]
        later: list[float] = []
        for loop in loops:
            turns = [_share_evaluated(root, functools.partial(loop.turn, i)) for i in range(TURNS)]
            worst = max(share for share, _ in turns[1:])
            results[f"agent_loop_reread_{loop.api}"] = round(worst, 4)
            results.setdefault("agent_first_turn_s", round(turns[0][1], 2))  # the head, cold
            later += [seconds for _, seconds in turns[1:]]
            say(progress, f"clients: {loop.api}: turns 2-{TURNS} evaluated at most"
                 f" {worst:.1%} of their prompt (turn 1: {turns[0][0]:.0%},"
                 f" {turns[0][1]:.1f} s)")  # fmt: skip
        results["agent_later_turn_s"] = round(statistics.median(later), 2)
    with ServeProcess(model, home, len(APIS), ctx=AGENT_CTX) as root:  # restarted
        restarted = []
        for loop in loops:
            loop.root = root
            share, seconds = _share_evaluated(root, functools.partial(loop.turn, TURNS))
            restarted.append(seconds)
            results[f"agent_loop_reread_{loop.api}_after_restart"] = round(share, 4)
            say(progress, f"clients: {loop.api} after a restart: {share:.1%} evaluated,"
                 f" {seconds:.1f} s")  # fmt: skip
        results["agent_restart_turn_s"] = round(statistics.median(restarted), 2)
    results["agent_loop_reread"] = max(
        v for k, v in results.items() if k.startswith("agent_loop_reread_")
    )
    return results


def _lines(root: str, path: str, body: dict[str, Any]) -> list[tuple[float, str]]:
    """A streamed response's data lines (SSE's ``data:`` or NDJSON), each with when it came."""
    out = []
    with http_client().stream("POST", f"{root}{path}", json=body) as reply:
        for line in reply.iter_lines():
            data = line[6:] if line.startswith("data: ") else line
            if data.startswith("{"):
                out.append((time.perf_counter(), data))
    return out


def _text_of(api: str, data: dict[str, Any]) -> str:
    """The answer text one streamed object carries, in each API's shape."""
    if api == "chat":
        choices = data.get("choices") or [{}]
        return str(choices[0].get("delta", {}).get("content") or "")
    if api == "messages":
        return (
            str(data.get("delta", {}).get("text", ""))
            if data.get("type") == "content_block_delta"
            else ""
        )
    if api == "responses":
        return (
            str(data.get("delta", "")) if data.get("type") == "response.output_text.delta" else ""
        )
    return str(data.get("message", {}).get("content") or "")


def _request(api: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    system, user = "You are a helpful assistant.", ASK
    if api == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "system", "content": system},
            {"role": "user", "content": user}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    if api == "messages":
        return "/v1/messages", {"system": system, "messages": [{"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    if api == "responses":
        return "/v1/responses", {"instructions": system, "input": user, "stream": True,
            "max_output_tokens": max_tokens, "temperature": 0, "store": False}  # fmt: skip
    return "/api/chat", {"messages": [{"role": "system", "content": system},
        {"role": "user", "content": user}], "options": {"temperature": 0, "num_predict": max_tokens}}  # fmt: skip


def _stream(root: str, api: str, max_tokens: int = GEN_TOKENS) -> tuple[str, float]:
    """A greedy reply through ``api``: its text and its tokens/s as the client reads it."""
    wait_server_idle(root)
    path, body = _request(api, max_tokens)
    pieces = [(at, _text_of(api, json.loads(data))) for at, data in _lines(root, path, body)]
    times = [at for at, text in pieces if text]
    text = "".join(text for _, text in pieces)
    tokens = len(http_client().post(f"{root}/tokenize", json={"content": text}).json()["tokens"])
    return text, (tokens - 1) / max(1e-9, times[-1] - times[0])


def _parity_and_speed(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with ServeProcess(model, home, 1) as root:
        texts = {api: _stream(root, api)[0] for api in ("chat", *APIS)}
        results["api_parity"] = int(len(set(texts.values())) == 1 and bool(texts["chat"]))
        say(
            progress,
            f"clients: greedy replies the same through all four APIs: {bool(results['api_parity'])}",
        )
        for api in APIS:
            ratios = []
            for index in range(GEN_PAIRS):
                order = ("chat", api) if index % 2 == 0 else (api, "chat")
                speeds = {side: _stream(root, side)[1] for side in order}
                ratios.append(speeds[api] / speeds["chat"])
            results[f"{api}_gen_ratio"] = round(statistics.median(ratios), 3)
            say(
                progress,
                f"clients: {api} streams at {statistics.median(ratios):.3f} of chat's speed",
            )
    return results


def schema_cases() -> list[dict[str, Any]]:
    """Fifty JSON schemas of the kinds clients send: flat and nested objects, enums,
    arrays, numbers, booleans, optional fields (strings bounded so a reply ends)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "number"},
        {"type": "boolean"}, {"type": "string", "enum": ["low", "mid", "high"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False},
    ]  # fmt: skip
    names = ["name", "age", "score", "ok", "level", "ids", "tags", "point", "note", "size"]
    cases = []
    for index in range(SCHEMA_CASES):
        fields = 1 + index % 4
        properties = {names[(index + k) % len(names)]: kinds[(index * 3 + k) % len(kinds)]
                      for k in range(fields)}  # fmt: skip
        required = sorted(properties)[: max(1, fields - index % 2)]
        cases.append({"type": "object", "properties": properties, "required": required,
                      "additionalProperties": False})  # fmt: skip
    return cases


def _structured(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    import jsonschema

    valid, ratios = 0, []
    with ServeProcess(model, home, 1) as root:
        for index, schema in enumerate(schema_cases()):
            messages = [{"role": "user", "content": f"Describe item {index} as JSON."}]
            base = {"messages": messages, "max_tokens": 120, "temperature": 0}
            wait_server_idle(root)
            held = http_client().post(f"{root}/v1/chat/completions", json={**base, "response_format": {
                "type": "json_schema", "json_schema": {"name": f"case{index}", "schema": schema,
                                                       "strict": True}}}).json()  # fmt: skip
            wait_server_idle(root)
            free = http_client().post(f"{root}/v1/chat/completions", json=base).json()
            try:
                jsonschema.validate(json.loads(held["choices"][0]["message"]["content"]), schema)
                valid += held["choices"][0]["finish_reason"] == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
            speeds = (
                held["timings"]["predicted_per_second"],
                free["timings"]["predicted_per_second"],
            )
            if held["usage"]["completion_tokens"] > 4 and speeds[1]:
                ratios.append(speeds[0] / speeds[1])
    share = valid / SCHEMA_CASES
    say(progress, f"clients: {valid}/{SCHEMA_CASES} schema replies valid, at"
         f" {statistics.median(ratios):.2f} of unconstrained tokens/s")  # fmt: skip
    return {
        "structured_valid": round(share, 3),
        "structured_speed_ratio": round(statistics.median(ratios), 3),
    }


def bench_clients(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The client APIs' figures: the agent loops on ``model_path`` (the bench's generated
    model, for its long context), the rest on SmolLM2 (a real template and tokenizer)."""
    from localchat.models.starter import ensure_starter
    from localchat.paths import app_paths

    starter = ensure_starter(app_paths(), hub=False)
    if not starter.real:
        return {"clients_skipped": f"SmolLM2 could not be had: {starter.note}"}
    with scratch_dir("clients") as scratch:
        results = _agent_loops(model_path, scratch / "agent", progress)
        results |= _parity_and_speed(starter.path, scratch / "speed", progress)
        results |= _structured(starter.path, scratch / "schema", progress)
    return results
