"""Reading a message ahead while it is typed: the turn that sends it evaluates only what was
not read yet, and its prompt is exactly the one it would be without reading ahead — typed
slowly, typed with edits, or pasted — so the greedy reply is the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.prompt import settled_chars
from localchat.conversation.local import READ_AHEAD_BATCH, Conversation
from localchat.conversation.prefix_states import ID_PREFIX
from localchat.conversation.turn import ReadAheadResult
from localchat.models.demo import make_demo_model
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

MESSAGE = (
    "Here is what I would like to know: how does the cache work when I type a long message,"
    " with numbers like 12345 and 3.14, (x+y)*2 = 42; it's   spaced\n\nand a second"
    " paragraph? Zürich, naïve café, 東京は日本の首都です。 Thanks!"
)
KINDS = ("spm", "spm-space", "gpt2", "llama3", "qwen2")


@pytest.fixture(scope="module", params=KINDS)
def kind_model(request: pytest.FixtureRequest, models_dir: Path) -> Path:
    """The tiny shape under each tokenizer kind (SentencePiece, GPT-2, Llama 3, Qwen2 BPE)."""
    kind = request.param
    return make_demo_model(models_dir / f"tiny-{kind}.gguf", "tiny", "Q4_K_M", tokenizer=kind)


def _engine(model: Path, n_ctx: int = 1024) -> Iterator[Engine]:
    loaded = Engine(model, LoadOptions(n_ctx=n_ctx))
    yield loaded
    loaded.close()


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    yield from _engine(tiny_model)


def _open(engine: Engine, name: str, system: str | None = "Be brief.", **kw: int) -> Conversation:
    paths = app_paths()
    store = Store(paths.database)
    return Conversation.open(store, StateStore(paths.states_dir), name, engine, system, **kw)


def _reply(conversation: Conversation, text: str, max_tokens: int = 16) -> tuple[str, dict]:
    turn = conversation.send(text, GREEDY, max_tokens)
    for _ in turn:
        pass
    return turn.generation.text, turn.stats_dict() | {"prompt": turn.prompt.tokens}


def _never() -> bool:
    return False


def _type(conversation: Conversation, keystrokes: list[str]) -> None:
    """Each keystroke's text read ahead as the app does (every change, nothing waiting)."""
    for draft in keystrokes:
        conversation.read_ahead(draft, 16, _never)


def _typed(text: str) -> list[str]:
    return [text[: i + 1] for i in range(len(text))]


def _with_history(engine: Engine, name: str) -> Conversation:
    conversation = _open(engine, name)
    _reply(conversation, "Hello there.")
    return conversation


def test_typed_and_pasted_give_the_same_prompt_and_reply(kind_model: Path) -> None:
    for engine in _engine(kind_model):
        pasted = _with_history(engine, "pasted")
        pasted_reply, pasted_stats = _reply(pasted, MESSAGE)
        pasted.close()
        typed = _with_history(engine, "typed")
        before = engine._llm.tokens_evaluated
        _type(typed, _typed(MESSAGE))
        spent = engine._llm.tokens_evaluated - before
        typed_reply, typed_stats = _reply(typed, MESSAGE)
        assert typed_stats["prompt"] == pasted_stats["prompt"]  # exactly the same token ids
        assert typed_reply == pasted_reply
        ahead = typed_stats["read_ahead_tokens"]
        assert ahead > 0.7 * pasted_stats["prompt_tokens_evaluated"]
        assert spent == ahead  # nothing read ahead had to be thrown away
        evaluated = typed_stats["prompt_tokens_evaluated"]
        assert evaluated == pasted_stats["prompt_tokens_evaluated"] - ahead
        assert engine.cache.cached_tokens[: len(typed_stats["prompt"])] == typed_stats["prompt"]


def test_edits_fall_back_to_what_still_agrees(engine: Engine) -> None:
    final = "The quick brown fox jumps over the lazy cat, then it sleeps all afternoon."
    keystrokes = _typed("The quick brown fox jumps over the lazy dog and runs")
    wrong = keystrokes[-1]
    keystrokes += [wrong[:i] for i in range(len(wrong) - 1, len("The quick brown fox"), -1)]
    keystrokes += _typed(final)[len("The quick brown fox") :]
    # An edit in the middle: a word of the settled text changes after it was read.
    keystrokes += [final.replace("quick", "slow"), final]
    reference = _with_history(engine, "reference")
    reference_reply, reference_stats = _reply(reference, final)
    reference.close()
    edited = _with_history(engine, "edited")
    _type(edited, keystrokes)
    edited_reply, edited_stats = _reply(edited, final)
    assert edited_stats["prompt"] == reference_stats["prompt"]
    assert edited_reply == reference_reply
    assert edited_stats["read_ahead_tokens"] > 0


def test_a_message_that_would_move_the_window_waits_for_enter(tiny_model: Path) -> None:
    for engine in _engine(tiny_model, n_ctx=160):
        conversation = _open(engine, "full", system=None)
        for text in ("One two three four five.", "Six seven eight nine ten."):
            _reply(conversation, text, 24)
        held = engine.cache.cached_tokens
        before = engine._llm.tokens_evaluated
        long_message = " ".join(["word"] * 120)
        assert conversation.read_ahead(long_message, 24, _never) == ReadAheadResult(0)
        assert engine._llm.tokens_evaluated == before and engine.cache.cached_tokens == held
        _reply_text, stats = _reply(conversation, long_message, 24)
        assert stats["window_dropped_messages"] > 0 and stats["read_ahead_tokens"] == 0


def test_reading_ahead_gives_way_between_small_steps(engine: Engine) -> None:
    conversation = _with_history(engine, "busy")
    base = len(engine.cache.cached_tokens)
    calls = 0

    def after_one_step() -> bool:
        nonlocal calls
        calls += 1
        return calls > 1

    ahead = conversation.read_ahead(MESSAGE, 16, after_one_step)
    assert ahead == ReadAheadResult(READ_AHEAD_BATCH, finished=False)
    assert len(engine.cache.cached_tokens) - base == READ_AHEAD_BATCH
    again = conversation.read_ahead(MESSAGE, 16, _never)  # and goes on
    assert again.finished and again.tokens > READ_AHEAD_BATCH


def test_a_new_conversation_reads_its_known_system_prompt_from_disk_while_typing(
    engine: Engine,
) -> None:
    persona = " ".join(f"Rule {i}: answer in plain words, keep it short." for i in range(20))
    first = _open(engine, "first", system=persona)
    cold_reply, cold = _reply(first, MESSAGE)
    first.saver.wait()
    first.close()
    engine.cache.reset()
    prefix_files = [p for p in StateStore(app_paths().states_dir).files() if ID_PREFIX in p.name]
    assert len(prefix_files) == 1
    second = _open(engine, "second", system=persona)
    _type(second, _typed(MESSAGE))
    warm_reply, warm = _reply(second, MESSAGE)
    assert warm["restored_prefix_tokens"] > 200  # the system prompt came from disk
    assert warm["read_ahead_tokens"] > 0 and warm["prompt"] == cold["prompt"]
    assert warm_reply == cold_reply
    assert warm["prompt_tokens_evaluated"] < 20


def test_a_closed_conversation_or_an_empty_box_reads_nothing(engine: Engine) -> None:
    conversation = _with_history(engine, "quiet")
    held = engine.cache.cached_tokens
    assert conversation.read_ahead("   \n", 16, _never) == ReadAheadResult(0)
    assert engine.cache.cached_tokens == held
    conversation.close()
    assert conversation.read_ahead(MESSAGE, 16, _never) == ReadAheadResult(0)
    assert engine.cache.cached_tokens == held


@pytest.mark.parametrize(
    ("text", "settled"),
    [
        ("hello wor", "hello"),
        ("hello world  ", "hello world"),
        ("one\n\ntwo", "one"),
        ("word", ""),
        ("   ", ""),
        ("x" * 60, "x" * 44),  # a long run without whitespace: all but its tail
    ],
)
def test_settled_text_stops_before_the_word_being_typed(text: str, settled: str) -> None:
    assert text[: settled_chars(text)] == settled


def test_read_ahead_tokens_count_only_where_they_are_the_prompts_exact_ids(
    engine: Engine,
) -> None:
    """Tokens past what was read for the conversation are matched id by id, never by the
    text they spell (as a reply's are): the same text in other tokens is evaluated again."""
    final = "Tell me about caches and windows, please."
    reference = _with_history(engine, "reference")
    _reference_reply, reference_stats = _reply(reference, final)
    reference.close()
    odd = _with_history(engine, "odd")
    base = len(engine.cache.cached_tokens)
    _type(odd, _typed("Tell me about "))
    # What was read of the message (after the template's "<|im_start|>user\n"), then the
    # text that follows it in the final message, one token per character.
    read = engine.detokenize(engine.cache.cached_tokens[base:], special=True).split("user\n", 1)[1]
    assert final.startswith(read) and read
    rest = final[len(read) : len(read) + 12]
    spelled = [t for ch in rest for t in engine.tokenize(ch)]
    assert engine.detokenize(spelled) == rest and len(spelled) == len(rest)
    engine.cache.extend(spelled)
    _reply_text, stats = _reply(odd, final)
    assert stats["prompt"] == reference_stats["prompt"]
    assert stats["history_reevaluated_tokens"] == 0


def _reference_prompt(engine: Engine, history: list[str], final: str, **kw: object) -> list[int]:
    """The prompt ``final`` gets after ``history`` with nothing read ahead."""
    reference = _open(engine, "reference-" + str(len(history)), **kw)  # type: ignore[arg-type]
    for text in history:
        _reply(reference, text)
    prompt: list[int] = _reply(reference, final)[1]["prompt"]
    reference.close()
    return prompt


def test_what_was_read_ahead_stays_speculative_when_the_conversation_is_reopened(
    smollm2: Path,
) -> None:
    """A draft read ahead, the conversation closed and reopened on the same model (Ctrl+N,
    then back): its tokens are no history, the next prompt is the canonical one."""
    for engine in _engine(smollm2):
        draft, final = "Hello there\n\nsecond para wo", "Hello there\n\n\nthird"
        expected = _reference_prompt(engine, ["Hi"], final)
        first = _open(engine, "reopened")
        _reply(first, "Hi")
        _type(first, _typed(draft))
        assert first.read_ahead(draft, 16, _never).tokens > 0
        first.close()
        again = _open(engine, "reopened")
        assert _reply(again, final)[1]["prompt"] == expected
        third = _open(engine, "retyped")
        _reply(third, "Hi")
        _type(third, _typed(draft))
        third.close()
        retyped = _open(engine, "retyped")
        _type(retyped, _typed(final))
        assert _reply(retyped, final)[1]["prompt"] == expected


def test_a_rebuild_that_gives_way_leaves_the_prompt_as_it_would_be(engine: Engine) -> None:
    """A known long system prompt read while typing, stopped between its batches (Enter
    pressed): nothing half-done stays, and the turn reads exactly what it would have."""
    persona = " ".join(f"Rule {i}: answer in plain words, keep it short." for i in range(40))
    small_batches = Engine(engine.model_path, LoadOptions(n_ctx=2048, n_batch=256))
    try:
        # Read without saving a prefix state: the next start has to evaluate it again.
        expected = _reference_prompt(
            small_batches, [], MESSAGE, system=persona, prefix_min_tokens=0
        )
        small_batches.cache.reset()
        fresh = _open(small_batches, "stopped", system=persona)
        result = fresh.read_ahead(MESSAGE, 16, lambda: True)
        assert (
            result == ReadAheadResult(0, finished=False) and not small_batches.cache.cached_tokens
        )
        _text, stats = _reply(fresh, MESSAGE)
        assert stats["prompt"] == expected and len(expected) > 2 * 256
        assert stats["restored_prefix_tokens"] == 0 and stats["read_ahead_tokens"] == 0
    finally:
        small_batches.close()


def test_a_history_without_its_saved_state_is_left_to_the_turn(engine: Engine) -> None:
    conversation = _with_history(engine, "evicted")
    conversation.saver.wait()
    conversation.close()
    states = StateStore(app_paths().states_dir)
    states.discard(conversation.record.id, engine.fingerprint)
    engine.cache.reset()
    reopened = _open(engine, "evicted")
    assert reopened.read_ahead(MESSAGE, 16, _never) == ReadAheadResult(0)
    assert not engine.cache.cached_tokens  # nothing read: the turn replays its recorded batches
    _text, stats = _reply(reopened, MESSAGE)
    assert stats["prompt"] == _reference_prompt(engine, ["Hello there."], MESSAGE)


@pytest.mark.parametrize("change", ["regenerate", "system prompt"])
def test_a_change_to_the_conversation_after_reading_ahead_keeps_the_prompt_exact(
    engine: Engine, change: str
) -> None:
    conversation = _with_history(engine, "changed")
    _reply(conversation, "A second question.")
    _type(conversation, _typed(MESSAGE))
    if change == "regenerate":
        question = conversation.take_back_last_exchange()
        assert question == "A second question."
        _text, stats = _reply(conversation, MESSAGE)
        expected = _reference_prompt(engine, ["Hello there."], MESSAGE)
    else:
        conversation.set_system_prompt("Answer in French.")
        _text, stats = _reply(conversation, MESSAGE)
        # The transcript under its new system prompt, tokenized whole: the cache's head changed.
        expected = engine.prompt_builder().build(conversation.window_messages()[:-1]).tokens
    assert stats["prompt"] == expected
