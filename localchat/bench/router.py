"""``bench --only router``: ``localchat serve`` with two models and room for one
(``--max-models 1``), in a process of its own, read by a plain HTTP client: SmolLM2 (a real
template) and a generated model, and a generated BERT embedder beside them.

- ``router_switch_reread``: two conversations, one on each model, alternating over
  ``SWITCH_REQUESTS`` requests: each request after the first two finds its model unloaded
  (the other took its memory) and must restore its conversation's states, saved when the
  model was unloaded. The most any of them evaluated, as a share of its prompt (≤ 0.05).
- ``router_load_ttft``: the first token of a request that loads SmolLM2, minus what the
  load alone takes (``/models/load`` timed, the same state before each), median of
  ``LOAD_ROUNDS`` (≤ 0.5 s).
- ``router_unload_rss``: the server's resident memory after SmolLM2 was loaded, answered
  and unloaded, over what it was before the load, in MB (≤ 100).
- ``embed_while_chatting_ratio``: a chat stream's tokens/s while embeddings are asked for
  in a loop beside it, over its tokens/s alone (reported); median of ``EMBED_ROUNDS``.
- ``embed_cosine`` and its neighbours: ``bench --only embed``'s figures.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, filler_text, say, scratch_dir
from localchat.bench.embed import bench_embed
from localchat.bench.rss import process_resident_bytes
from localchat.bench.serve import ServeProcess, http_client, stream_reply, wait_server_idle

ROUTER_CTX = 2048
SWITCH_REQUESTS = 6
SYSTEM_WORDS = 500  # each conversation's system prompt: what a re-read would cost
LOAD_ROUNDS = 3
EMBED_ROUNDS = 3
CHAT_TOKENS = 64
MB = 1024 * 1024


def _post(root: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = http_client().post(f"{root}{path}", json=body)
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: {reply.status_code} {reply.text}")
    answer: dict[str, Any] = reply.json()
    return answer


def _switch_reread(root: str, models: tuple[str, str]) -> dict[str, Any]:
    talks = {
        model: [{"role": "system", "content": filler_text(index, SYSTEM_WORDS)}]
        for index, model in enumerate(models)
    }
    shares: list[float] = []
    for request in range(SWITCH_REQUESTS):
        model = models[request % 2]
        talk = talks[model]
        talk.append({"role": "user", "content": f"Question {request}: what comes next?"})
        reply = stream_reply(root, talk, 8, model=model)
        talk.append({"role": "assistant", "content": reply["text"]})
        if request >= 2:  # its model was unloaded for the other's
            evaluated = reply["prompt_tokens"] - reply["cached_tokens"]
            shares.append(evaluated / max(1, reply["prompt_tokens"]))
    return {
        "router_switch_reread": round(max(shares), 4),
        "router_switch_reread_each": [round(s, 4) for s in shares],
    }


def _load_ttft(root: str, model: str, others: tuple[str, ...]) -> dict[str, Any]:
    def none_loaded() -> None:
        for name in (model, *others):
            _post(root, "/models/unload", {"model": name})

    loads, ttfts = [], []
    for round_ in range(LOAD_ROUNDS):
        none_loaded()
        start = time.perf_counter()
        _post(root, "/models/load", {"model": model})
        loads.append(time.perf_counter() - start)
        none_loaded()
        messages = [{"role": "user", "content": f"Say hi, round {round_}."}]
        ttfts.append(stream_reply(root, messages, 4, model=model)["ttft_s"])
    load, ttft = statistics.median(loads), statistics.median(ttfts)
    return {
        "router_load_s": round(load, 3),
        "router_load_request_ttft_s": round(ttft, 3),
        "router_load_ttft": round(ttft - load, 3),
    }


def _unload_rss(root: str, pid: int, model: str, others: tuple[str, ...]) -> dict[str, Any]:
    for name in (model, *others):
        _post(root, "/models/unload", {"model": name})
    before = process_resident_bytes(pid)
    stream_reply(root, [{"role": "user", "content": "Write a line about memory."}], 32,
                 model=model)  # fmt: skip
    wait_server_idle(root)
    loaded = process_resident_bytes(pid)
    _post(root, "/models/unload", {"model": model})
    after = process_resident_bytes(pid)
    return {
        "router_loaded_rss_mb": round((loaded - before) / MB, 1),
        "router_unload_rss": round((after - before) / MB, 1),
    }


def _embed_while_chatting(root: str, model: str, embedder: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Write a long essay about memory."}]
    body = {"model": embedder, "input": [filler_text(i, 60) for i in range(4)]}
    ratios = []
    for _ in range(EMBED_ROUNDS):
        alone = stream_reply(root, messages, CHAT_TOKENS, model=model)["tps"]
        stop = threading.Event()

        def embed_loop(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                _post(root, "/v1/embeddings", body)

        beside = threading.Thread(target=embed_loop, daemon=True)
        beside.start()
        try:
            time.sleep(0.2)  # the embeddings are under way
            with_embeds = stream_reply(root, messages, CHAT_TOKENS, beside=True, model=model)
        finally:
            stop.set()
            beside.join(timeout=60)
        ratios.append(with_embeds["tps"] / max(1e-9, alone))
    return {"embed_while_chatting_ratio": round(statistics.median(ratios), 3)}


def bench_router(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The router's figures on SmolLM2 and a generated model (``model_path`` is not used)."""
    from localchat.models.demo import make_demo_model
    from localchat.models.demo_bert import make_embedding_model
    from localchat.models.starter import ensure_starter
    from localchat.paths import app_paths

    starter = ensure_starter(app_paths(), hub=False)
    if not starter.real:
        return {"router_skipped": f"SmolLM2 could not be had: {starter.note}"}
    results: dict[str, Any] = {}
    with scratch_dir("router") as scratch:
        other = make_demo_model(scratch / "other.gguf", "tiny", "Q8_0")
        bert = make_embedding_model(scratch / "bert.gguf", "bert-minilm")
        smol = starter.path.stem
        extra = ("--model-path", str(other), "--max-models", "1", "--embedding-model", str(bert))
        serve = ServeProcess(starter.path, scratch / "home", extra=extra, ctx=ROUTER_CTX)
        with serve as root:
            results.update(_switch_reread(root, (smol, other.stem)))
            say(progress, f"router: switch re-read {results['router_switch_reread']:.1%}")
            results.update(_load_ttft(root, smol, (other.stem,)))
            say(progress, f"router: first token after a load {results['router_load_ttft']} s")
            results.update(_unload_rss(root, serve.process.pid, smol, (other.stem,)))
            say(progress, f"router: {results['router_unload_rss']} MB left after an unload")
            results.update(_embed_while_chatting(root, smol, str(bert)))
    results.update(bench_embed(model_path, progress))
    return results
