"""Sliding-window models keep only their window in the cache, and stay exact.

The demo factory's ``swa-tiny`` shape is a gemma3-architecture model: five of every six
layers attend 64 positions back. With the window cache those layers keep only 768 cells
(window + micro-batch, padded), so a cache that held 1,000+ tokens cannot simply be cut
back: regenerate, edits and restored states must rebuild (replay) instead, and every reply
must equal the one a full-size cache gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.local import Conversation
from localchat.models.demo import make_demo_model
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

CTX = 4096
WORDS = "the window keeps what the layers look at and nothing more than that".split()


@pytest.fixture(scope="session")
def swa_model(models_dir: Path) -> Path:
    return make_demo_model(models_dir / "swa-tiny-Q8_0.gguf", "swa-tiny", "Q8_0")


def _engine(path: Path, swa_cache: str) -> Engine:
    return Engine(path, LoadOptions(n_ctx=CTX, swa_cache=swa_cache))


def _text(turn: int, words: int = 260) -> str:
    return " ".join(WORDS[(turn * 5 + i) % len(WORDS)] for i in range(words))


def test_the_window_cache_is_what_llama_cpp_allocated(swa_model: Path) -> None:
    window, full = _engine(swa_model, "window"), _engine(swa_model, "full")
    try:
        assert window.n_swa == 64 and window.windowed and not full.windowed
        cells = sorted(c.cells for c in window.buffers.kv)
        assert cells[0] < CTX and cells[1] >= CTX  # a window cache beside the full one
        assert all(c.cells >= CTX for c in full.buffers.kv)
        assert window.kv_bytes_allocated == window.buffers.kv_bytes
        assert window.kv_bytes_allocated < 0.5 * full.kv_bytes_allocated
        # The live figure never counts more cells than a window cache has.
        assert window.kv_bytes_for(3000) < full.kv_bytes_for(3000)
        assert window.kv_bytes_for(10) == full.kv_bytes_for(10)
        assert window.buffers.compute and window.buffers.weights
    finally:
        window.close()
        full.close()


def test_a_window_cache_cannot_be_cut_back_past_its_window(swa_model: Path) -> None:
    engine = _engine(swa_model, "window")
    try:
        prompt = engine.tokenize(_text(0, 1400), add_bos=True)[:1500]
        engine.cache.hold(prompt)
        assert engine.cache.cached_tokens == prompt
        assert engine.cache.keeps(len(prompt) - 10)
        assert not engine.cache.keeps(200), "those positions left the sliding-window cache"
        # hold() to a short prefix rebuilds (replays) instead of cutting.
        engine.cache.hold(prompt[:200])
        assert engine.cache.cached_tokens == prompt[:200] or engine.cache.cached_tokens == []
    finally:
        engine.close()


def _conversation(path: Path, swa_cache: str, name: str) -> tuple[Conversation, Engine]:
    engine = _engine(path, swa_cache)
    data = app_paths().data_dir / swa_cache
    store = Store(data / "conversations.sqlite3")
    return Conversation.open(store, StateStore(data / "states"), name, engine), engine


def _reply(conversation: Conversation, text: str, evaluated: list[int] | None = None) -> str:
    turn = conversation.send(text, GREEDY, 24)
    for _ in turn:
        pass
    if evaluated is not None:
        evaluated.append(turn.stats.prompt_tokens_evaluated)
    return turn.generation.text


def test_turns_regenerate_and_resume_match_the_full_cache(swa_model: Path) -> None:
    replies: dict[str, list[str]] = {}
    edit_cost: dict[str, list[int]] = {"full": [], "window": []}
    for mode in ("full", "window"):
        conversation, engine = _conversation(swa_model, mode, "long")
        out = [_reply(conversation, _text(turn)) for turn in range(4)]  # past 768 cells
        assert len(engine.cache.cached_tokens) > 1000
        # Regenerate: the last exchange goes, the same question is asked again.
        question = conversation.take_back_last_exchange()
        assert question is not None
        out.append(_reply(conversation, question))
        # An edit far back: three exchanges go, another question in their place. The window
        # cache no longer has what the layers must see there: it is rebuilt, not cut.
        for _ in range(3):
            conversation.take_back_last_exchange()
        out.append(_reply(conversation, "something else entirely, asked instead", edit_cost[mode]))
        out += [_reply(conversation, _text(turn)) for turn in (5, 6)]  # past the window again
        conversation.save_state()
        conversation.saver.wait(30)
        conversation.close()
        engine.close()
        # Resumed in a new engine from the saved state: only the new message is evaluated.
        conversation, engine = _conversation(swa_model, mode, "long")
        turn = conversation.send(_text(9, 30), GREEDY, 24)
        for _ in turn:
            pass
        out.append(turn.generation.text)
        assert turn.restore.restored, mode
        stats = turn.stats
        assert stats.prompt_tokens > 1000 and stats.prompt_tokens_evaluated < 120, mode
        conversation.close()
        engine.close()
        replies[mode] = out
    assert replies["window"] == replies["full"]
    # The full cache was cut; the window cache was rebuilt up to the edit (in its batches).
    assert edit_cost["window"][0] > edit_cost["full"][0] + 200
    assert replies["window"][4] == replies["window"][3], "regenerate gives the same reply"


@pytest.mark.parametrize("n_ctx", [2048, 8192])
@pytest.mark.parametrize("swa_cache", ["window", "full"])
def test_the_estimate_counts_window_caches_and_the_kernel(
    swa_model: Path, n_ctx: int, swa_cache: str
) -> None:
    from localchat.gguf.estimate import ModelDims, compute_buffer_bytes, kv_cache_bytes
    from localchat.gguf.info import read_gguf

    dims = ModelDims.from_gguf(read_gguf(swa_model))
    assert dims.swa_pattern == 6 and dims.window_layers() == 5
    engine = Engine(swa_model, LoadOptions(n_ctx=n_ctx, swa_cache=swa_cache))
    try:
        assert engine.flash_attn == (n_ctx >= 8192)  # the plan's rule, applied by the engine
        estimated = kv_cache_bytes(dims, n_ctx, "f16", swa_full=swa_cache == "full")
        assert estimated == engine.kv_bytes_allocated
        compute = compute_buffer_bytes(dims, n_ctx, "f16", engine.flash_attn)
        reported = sum(engine.buffers.compute.values())
        assert abs(compute - reported) <= 0.25 * reported + 8 * 2**20
        summary = engine.buffers_summary()
        assert "compute" in summary and ("window cache" in summary) == (swa_cache == "window")
    finally:
        engine.close()


def test_plans_choose_the_attention_kernel_and_micro_batch_with_a_reason() -> None:
    from localchat.gguf.estimate import estimate_memory
    from localchat.models.catalog import find_model, load_catalog
    from localchat.models.hardware import Hardware
    from localchat.models.planner import plan_model, sized_candidates

    gib = 1024**3
    entry = find_model(load_catalog(), "llama-3.2-1b-instruct")
    candidates = sized_candidates(entry.dims, [(f.quant, f.file, f.size) for f in entry.files])
    roomy = Hardware(24 * gib, 23 * gib, 2)
    short = plan_model(entry.name, entry.dims, candidates, roomy, 2048)
    assert not short.flash_attn and short.n_ubatch == 512  # faster on a CPU at 2k
    long = plan_model(entry.name, entry.dims, candidates, roomy, 32768)
    assert long.flash_attn and "flash attention (saves" in long.explanation
    # Memory between what Q8_0 needs as the engine would run it and with flash attention:
    # that makes the better quant fit, and the plan says so; tighter still, a q8_0 cache or
    # half the micro-batch.
    q8 = next(c for c in candidates if c.quant == "Q8_0")

    def needs(flash_attn: bool | None, n_ubatch: int) -> int:
        estimate = estimate_memory(entry.dims, q8.weights, 2048, "f16", 0, flash_attn, n_ubatch)
        return estimate.ram_required

    def machine(budget: float) -> Hardware:
        free = int((budget + 512 * 2**20) / 0.9)
        return Hardware(free, free, 2)

    assert needs(True, 256) < needs(True, 512) < needs(None, 512)
    fa = plan_model(
        entry.name, entry.dims, candidates, machine((needs(None, 512) + needs(True, 512)) / 2), 2048
    )
    assert (fa.quant, fa.flash_attn, fa.n_ubatch) == ("Q8_0", True, 512)
    assert "flash attention (to fit)" in fa.explanation
    tighter = plan_model(
        entry.name, entry.dims, candidates, machine((needs(True, 512) + needs(True, 256)) / 2), 2048
    )
    assert tighter.quant == "Q8_0" and (tighter.kv_type == "q8_0" or tighter.n_ubatch == 256)
    assert "KV q8_0" in tighter.explanation or "micro-batch 256 (to fit)" in tighter.explanation
