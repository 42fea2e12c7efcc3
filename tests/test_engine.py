"""The engine on real llama.cpp with generated models: no mocks of llama_cpp here."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from localchat.backends.base import Sampling
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.template import ChatMessage
from localchat.errors import ModelLoadError, UsageError
from localchat.gguf.estimate import kv_bytes_per_token
from localchat.gguf.info import read_gguf
from localchat.models.demo import SHAPES
from tests.conftest import GREEDY


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine(tiny_model, LoadOptions(n_ctx=512))


def _run(engine: Engine, tokens: list[int], max_tokens: int = 24, sampling: Sampling = GREEDY):
    generation = engine.generate(tokens, sampling, max_tokens)
    deltas = list(generation)
    return generation, deltas


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.prompt_tokens([ChatMessage("user", text)])


def test_greedy_output_is_deterministic_across_engines(engine: Engine, tiny_model: Path) -> None:
    prompt = _prompt(engine, "Tell me about the cache")
    engine.cache.reset()
    first, _ = _run(engine, prompt)
    engine.cache.reset()
    second, _ = _run(engine, prompt)
    other = Engine(tiny_model, LoadOptions(n_ctx=512))
    third, _ = _run(other, prompt)
    other.close()
    assert first.tokens == second.tokens == third.tokens
    assert len(first.tokens) == 24
    assert len(set(first.tokens)) > 3, "a varied continuation, not one repeated token"


def test_reply_depends_on_the_prompt(engine: Engine) -> None:
    engine.cache.reset()
    a, _ = _run(engine, _prompt(engine, "hello world"))
    engine.cache.reset()
    b, _ = _run(engine, _prompt(engine, "what is the model"))
    assert a.tokens != b.tokens


def test_sampling_seed_controls_randomness(engine: Engine) -> None:
    prompt = _prompt(engine, "hello")
    runs = []
    for seed in (1, 1, 2):
        engine.cache.reset()
        generation, _ = _run(engine, prompt, sampling=Sampling(temperature=1.0, seed=seed))
        runs.append(generation.tokens)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cancel_stops_within_one_token(engine: Engine) -> None:
    cancel = threading.Event()
    engine.cache.reset()
    generation = engine.generate(_prompt(engine, "go on"), GREEDY, 200, cancel)
    seen = 0
    for _delta in generation:
        seen += 1
        if seen == 5:
            cancel.set()
    assert seen == 5
    assert generation.stats.generated_tokens == 5
    assert generation.stats.stop_reason == "cancelled"


def test_stats_count_tokens_like_the_tokenizer(engine: Engine) -> None:
    prompt = _prompt(engine, "count these tokens please")
    engine.cache.reset()
    generation, deltas = _run(engine, prompt, max_tokens=10)
    stats = generation.stats
    assert stats.prompt_tokens == len(prompt)
    assert stats.prompt_tokens_evaluated == len(prompt)
    assert stats.generated_tokens == len(deltas) == len(generation.tokens) == 10
    assert stats.ttft_s > 0 and stats.prompt_tps > 0 and stats.gen_tps > 0
    assert "".join(d.text for d in deltas) == generation.text
    assert stats.stop_reason == "length"


def test_a_longer_prompt_reuses_the_cached_prefix(engine: Engine) -> None:
    engine.cache.reset()
    first_prompt = _prompt(engine, "first message")
    first, _ = _run(engine, first_prompt, max_tokens=8)
    follow_up = first_prompt + first.tokens + engine.tokenize(" and more words", special=True)
    second, _ = _run(engine, follow_up, max_tokens=4)
    # Everything the cache held (the reply as generated, to its last token) is reused; only
    # the new tail is computed.
    held = len(first_prompt) + len(first.tokens)
    assert second.stats.prompt_tokens == len(follow_up)
    assert second.stats.prompt_tokens_evaluated == len(follow_up) - held


def test_kv_bytes_follow_tokens_times_per_token_bytes(engine: Engine, tiny_model: Path) -> None:
    shape = SHAPES["tiny"]
    per_token = shape.n_layer * shape.n_head_kv * shape.head_dim * 2 * 2  # K+V, f16
    assert engine.kv_bytes_per_token == per_token == kv_bytes_per_token(read_gguf(tiny_model))
    engine.cache.reset()
    generation, _ = _run(engine, _prompt(engine, "measure the cache"), max_tokens=12)
    cached = len(engine.cache.cached_tokens)
    # The reply's last token is evaluated too: the cache holds the whole reply.
    assert cached == generation.stats.prompt_tokens + 12
    assert generation.stats.kv_bytes_used == cached * per_token
    assert generation.stats.kv_bytes_allocated == engine.n_ctx * per_token


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_kv_bytes_agree_with_llama_cpp_state_size(tiny_model: Path, kv_type: str) -> None:
    """llama.cpp's own per-sequence state grows by our per-token KV bytes plus cell metadata."""
    engine = Engine(tiny_model, LoadOptions(n_ctx=256, kv_type=kv_type))
    sizes = {}
    for n in (20, 60, 140):
        engine.cache.reset()
        _run(engine, list(range(300, 300 + n)), max_tokens=1)
        assert len(engine.cache.cached_tokens) == n + 1
        sizes[n] = len(engine.cache.save_sequence_state())
    growth = [(sizes[60] - sizes[20]) / 40, (sizes[140] - sizes[60]) / 80]
    assert growth[0] == growth[1]
    cell_metadata = growth[0] - engine.kv_bytes_per_token
    assert 0 <= cell_metadata <= 16, f"{kv_type}: state grows {growth[0]} B/token"
    engine.close()


def test_quantized_kv_types_are_smaller(tiny_model: Path) -> None:
    info = read_gguf(tiny_model)
    f16, q8, q4 = (kv_bytes_per_token(info, t) for t in ("f16", "q8_0", "q4_0"))
    assert f16 > q8 > q4
    assert q8 == f16 * 34 // 64  # 34 bytes per 32 values vs 2 bytes each


def test_chat_template_from_the_model_is_applied(engine: Engine) -> None:
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "hi there")]
    tokens = engine.prompt_tokens(messages)
    text = "".join(engine.token_text(t) for t in tokens)
    assert text == "<s>" + engine.template.render(messages)
    assert engine.template.name == "the model's own"
    assert text.endswith(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    )
    im_start = engine.tokenize("<|im_start|>", special=True)
    assert len(im_start) == 1, "control tokens are parsed as single tokens"
    assert tokens.count(im_start[0]) == 3  # system, user, and the generation prompt


def test_state_round_trip_continues_identically(engine: Engine, tiny_model: Path) -> None:
    prompt = _prompt(engine, "remember this")
    engine.cache.reset()
    _run(engine, prompt, max_tokens=6)
    held = engine.cache.cached_tokens
    blob = engine.cache.save_sequence_state()
    follow = [*held, *engine.tokenize(" next", special=True)]
    expected, _ = _run(engine, follow, max_tokens=10)
    other = Engine(tiny_model, LoadOptions(n_ctx=512))
    assert other.cache.load_sequence_state(blob, held)
    restored, _ = _run(other, follow, max_tokens=10)
    assert restored.stats.prompt_tokens_evaluated == len(follow) - len(held)
    assert restored.tokens == expected.tokens
    other.close()


def test_context_larger_than_trained_is_refused(tiny_model: Path) -> None:
    with pytest.raises(UsageError, match="trained context 4096"):
        Engine(tiny_model, LoadOptions(n_ctx=8192))


def test_prompt_longer_than_context_is_refused(engine: Engine) -> None:
    with pytest.raises(UsageError, match="context holds"):
        engine.generate(list(range(300, 300 + 600)), GREEDY)


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "notanarch")
    writer.add_block_count(1)
    writer.add_tensor("x", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'notanarch'"):
        Engine(path)


def test_replaying_recorded_batches_rebuilds_the_cache_bit_for_bit(small_model: Path) -> None:
    """llama.cpp's numerics depend on batching; replaying the original batches does not."""
    engine = Engine(small_model, LoadOptions(n_ctx=2048))
    prompt = [engine.bos_token] + [300 + (i * 31) % 700 for i in range(300)]
    generation = engine.generate(prompt, GREEDY, 40)
    for _ in generation:
        pass
    follow = engine.generate([*engine.cache.cached_tokens, *engine.tokenize(" more")], GREEDY, 5)
    for _ in follow:
        pass
    tokens, starts = engine.cache.cached_tokens, engine.cache.batch_starts
    assert starts is not None
    # One batch for the prompt, one per generated token, one for the follow-up's new tokens.
    assert starts[:2] == [0, len(prompt)]
    original = engine.cache.save_sequence_state()
    assert engine.cache.replay(tokens, starts)
    assert engine.cache.cached_tokens == tokens
    assert engine.cache.save_sequence_state() == original
    engine.close()


def test_replay_refuses_batches_that_do_not_fit(engine: Engine) -> None:
    assert not engine.cache.replay([1, 2, 3], [1])
    assert not engine.cache.replay([1, 2, 3], [])
    assert not engine.cache.replay(list(range(300, 1000)), [0])  # one batch larger than n_batch


def test_the_cache_is_leased_by_a_claim_and_its_history_committed(engine: Engine) -> None:
    cache = engine.cache
    cache.reset()
    assert cache.owner is None and cache.committed == 0
    generation, _ = _run(engine, _prompt(engine, "Who holds the cache?"), max_tokens=4)
    # A generation commits what it put there: the prompt and the reply as held.
    assert (
        cache.committed
        == len(cache.cached_tokens)
        == len(generation._tokens) + len(generation.tokens)
    )
    cache.claim("a")
    assert cache.held_by("a") and not cache.held_by("b") and cache.owner == "a"
    history = cache.cached_tokens
    cache.extend(engine.tokenize(" read ahead"))  # past ``committed``: not the history
    assert cache.committed_tokens == history and len(cache.cached_tokens) > len(history)
    cache.hold(history[:-2])  # cut back under the history: the commit follows the cut
    assert cache.committed == len(history) - 2 and cache.held_by("a")
    cache.claim("b")
    assert cache.held_by("b") and not cache.held_by("a")
    cache.reset()  # the lease ends with the cache
    assert cache.owner is None and not cache.held_by("b") and cache.committed == 0
