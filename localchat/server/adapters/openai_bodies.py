"""What OpenAI's chat and text completions send back: the whole body, the stream's chunks
(each with its choice's index), usage with ``cached_tokens``, llama-server's ``timings``,
and ``logprobs`` in each endpoint's own shape."""

from __future__ import annotations

import json
from typing import Any

from localchat.backends.base import TurnStats
from localchat.chat.tools import ToolCall
from localchat.server.adapters.sse import sse
from localchat.server.events import (
    Called,
    Event,
    Failed,
    Finished,
    Logprob,
    Reasoning,
    Text,
    TokenChoice,
)
from localchat.server.requests import GenerationRequest
from localchat.server.tool_api import openai_calls
from localchat.server.turns import WholeReply, failure

FINISH_REASONS = {"stop_sequence": "stop", "context": "length", "cancelled": "stop"}


def finish_reason(finished: Finished) -> str:
    return FINISH_REASONS.get(finished.reason, finished.reason)


def usage(ends: list[Finished]) -> dict[str, Any]:
    """OpenAI's usage over a request's replies (the prompt counted once): ``cached_tokens``
    are prompt tokens not evaluated (held in memory or restored from disk)."""
    prompt = ends[0].stats.prompt_tokens
    completion = sum(end.stats.generated_tokens for end in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": ends[0].cached_tokens},
    }


def timings(stats: TurnStats) -> dict[str, Any]:
    """llama-server's per-request timings (and its draft counts)."""
    predicted_s = stats.generated_tokens / stats.gen_tps if stats.gen_tps else 0.0
    return {
        "cache_n": max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated),
        "prompt_n": stats.prompt_tokens_evaluated,
        "prompt_ms": round(stats.ttft_s * 1000, 3),
        "prompt_per_second": round(stats.prompt_tps, 3),
        "predicted_n": stats.generated_tokens,
        "predicted_ms": round(predicted_s * 1000, 3),
        "predicted_per_second": round(stats.gen_tps, 3),
        "draft_n": stats.drafted_tokens,
        "draft_n_accepted": stats.accepted_tokens,
    }


def _choice_json(choice: TokenChoice) -> dict[str, Any]:
    return {"token": choice.text, "logprob": choice.logprob, "bytes": list(choice.data)}


def logprobs_body(request: GenerationRequest, found: list[Logprob]) -> dict[str, Any] | None:
    """``logprobs`` of a choice: chat's ``content`` list, or the text completion's arrays."""
    if request.logprobs is None:
        return None
    if request.messages is not None:
        content = [{**_choice_json(lp.chosen), "top_logprobs": [_choice_json(t) for t in lp.top]}
                   for lp in found]  # fmt: skip
        return {"content": content, "refusal": None}
    offsets, at = [], 0
    for lp in found:
        offsets.append(at)
        at += len(lp.chosen.text)
    return {
        "tokens": [lp.chosen.text for lp in found],
        "token_logprobs": [lp.chosen.logprob for lp in found],
        "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in found],
        "text_offset": offsets,
    }


def _envelope(request: GenerationRequest, chunk: bool) -> dict[str, Any]:
    chat = request.messages is not None
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": request.request_id if chat else request.request_id.replace("chatcmpl", "cmpl"),
        "object": f"{kind}.chunk" if chunk and chat else kind,
        "created": request.created,
        "model": request.model,
    }


def _whole_choice(request: GenerationRequest, index: int, reply: WholeReply) -> dict[str, Any]:
    reason, calls = finish_reason(reply.finished), reply.calls
    found = logprobs_body(request, reply.logprobs)
    if request.messages is None:
        return {"index": index, "text": reply.text, "logprobs": found, "finish_reason": reason}
    text = reply.text
    message: dict[str, Any] = {"role": "assistant", "content": text or None if calls else text}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} for call in openai_calls(calls)
        ]
    return {"index": index, "message": message, "logprobs": found, "finish_reason": reason}


def completion_body(request: GenerationRequest, replies: list[WholeReply]) -> dict[str, Any]:
    """The whole response: a choice per reply (with the tools each calls)."""
    ends = [reply.finished for reply in replies]
    return {
        **_envelope(request, chunk=False),
        "choices": [_whole_choice(request, i, reply) for i, reply in enumerate(replies)],
        "usage": usage(ends),
        "timings": timings(ends[0].stats),
    }


def delta_chunk(
    request: GenerationRequest,
    text: str = "",
    reasoning: bool = False,
    first: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed piece of a reply."""
    if request.messages is None:
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": None}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["reasoning_content" if reasoning else "content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": None}
    body = {**_envelope(request, chunk=True), "choices": [choice]}
    if request.include_usage:
        body["usage"] = None
    return body


class ChunkStream:
    """The replies' events as OpenAI's SSE chunks, each with its choice's index; the usage
    chunk (with llama-server's ``timings``, where ``include_usage`` asks) and ``[DONE]``
    once every reply has ended. A token's logprobs ride in the chunk of the text that
    follows it (or one of their own at a batch's end)."""

    def __init__(self, request: GenerationRequest, n: int) -> None:
        self.request = request
        self.calls: list[tuple[ToolCall, ...]] = [()] * n
        self.pending: list[list[Logprob]] = [[] for _ in range(n)]
        self.ends: list[Finished | None] = [None] * n

    def head(self) -> bytes:
        return sse([json.dumps(delta_chunk(self.request, first=True, index=i))
                    for i in range(len(self.ends))])  # fmt: skip

    def _chunk(self, index: int, text: str = "", reasoning: bool = False) -> str:
        chunk = delta_chunk(self.request, text, reasoning, index=index)
        if self.pending[index]:
            found = logprobs_body(self.request, self.pending[index])
            chunk["choices"][0]["logprobs"] = found
            self.pending[index] = []
        return json.dumps(chunk)

    def write(self, index: int, batch: list[Event]) -> bytes:
        data: list[str] = []
        for event in batch:
            if isinstance(event, Logprob):
                self.pending[index].append(event)
            elif isinstance(event, Text | Reasoning):
                data.append(self._chunk(index, event.text, isinstance(event, Reasoning)))
            elif isinstance(event, Called):
                self.calls[index] = event.calls
            elif isinstance(event, Finished):
                data += self._end(index, event)
            elif isinstance(event, Failed):
                data.append(json.dumps(failure(event.error).body()))
        if self.pending[index]:
            data.append(self._chunk(index))
        return sse(data)

    def _end(self, index: int, finished: Finished) -> list[str]:
        """The calls the reply made (one delta), the chunk that says why it ended, and,
        once all have ended, the usage chunk where it was asked for and ``[DONE]``."""
        request, chunks = self.request, []
        if self.pending[index]:
            chunks.append(self._chunk(index))
        if self.calls[index]:
            called = delta_chunk(request, index=index)
            called["choices"][0]["delta"]["tool_calls"] = openai_calls(self.calls[index])
            chunks.append(json.dumps(called))
        last = delta_chunk(request, index=index)
        last["choices"][0]["finish_reason"] = finish_reason(finished)
        last["timings"] = timings(finished.stats)
        chunks.append(json.dumps(last))
        self.ends[index] = finished
        ends = [end for end in self.ends if end is not None]
        if len(ends) < len(self.ends):
            return chunks
        if request.include_usage:
            tail = {**_envelope(request, chunk=True), "choices": [], "usage": usage(ends),
                    "timings": timings(ends[0].stats)}  # fmt: skip
            chunks.append(json.dumps(tail))
        return [*chunks, "[DONE]"]
