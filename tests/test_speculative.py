"""Speculative decoding by prompt lookup: drafts verified in one decode never change a reply
where the attention kernel is batch-invariant (flash attention), greedy or sampled, across
turns, a resume from the saved state and a stop string; and it drafts only where it pays."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from localchat.backends.base import Sampling
from localchat.backends.llama.draft_policy import (
    DEEP,
    DEEP_MATCH,
    PRIOR_EXTRA_TOKEN_COST,
    SHALLOW,
    Draft,
    DraftPolicy,
    expected_tokens,
)
from localchat.backends.llama.drafting import lookup_draft
from localchat.backends.llama.engine import KV_TYPES, Engine, LoadOptions
from localchat.backends.llama.generation import Generation
from localchat.bench.spec import COPY_PROMPT, SOURCE
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.conversation.turn import ConversationTurn
from localchat.errors import UsageError
from localchat.models.speed import SpeedModel, machine_name
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.widgets.prompt_input import PromptInput
from tests.conftest import GREEDY

from .tui_helpers import chat_app

# A reply that repeats its context (the bench's file to return renamed): what prompt lookup
# is for.
COPY_REQUEST = COPY_PROMPT
REPLY_TOKENS = 110


def _engine(model: Path, speculative: str, n_ctx: int = 2048) -> Engine:
    """Flash attention over a quantized cache: batches get single steps' logits on a CPU."""
    options = LoadOptions(n_ctx=n_ctx, n_threads=2, kv_type="q8_0", speculative=speculative)
    return Engine(model, options)


def _reply(engine: Engine, sampling: Sampling, text: str = COPY_REQUEST) -> Generation:
    generation = engine.generate(
        engine.prompt_tokens([ChatMessage("user", text)]), sampling, REPLY_TOKENS
    )
    for _ in generation:
        pass
    return generation


def _said(
    conversation: Conversation, text: str, max_tokens: int = REPLY_TOKENS
) -> ConversationTurn:
    """A greedy turn sent and read to its end."""
    turn = conversation.send(text, GREEDY, max_tokens)
    for _ in turn:
        pass
    return turn


def _same_with_drafts_and_without(
    run: Callable[[Path, Path, str], list[str]], model: Path, tmp_path: Path
) -> None:
    """``run`` (model, a home of its own, the speculative mode) with drafts and without: the
    replies must be the same, token for token."""
    replies = {}
    for mode in ("auto", "off"):
        (tmp_path / mode).mkdir()
        replies[mode] = run(model, tmp_path / mode, mode)
    assert replies["auto"] == replies["off"]


def test_a_draft_continues_the_latest_earlier_match_of_the_longest_ngram() -> None:
    context = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3], dtype=np.intc)
    # "1 2 3" occurred twice before the tail: the latest one is followed by 7 8 4.
    assert lookup_draft(context, 2).tokens == [7, 8]
    assert lookup_draft(context, 10).tokens == [7, 8, 4, 1, 2, 3]
    assert lookup_draft(context, 10).depth == 3  # "9 1 2 3" against "4 1 2 3"
    assert lookup_draft(np.array([1, 2, 3, 4], dtype=np.intc), 4).tokens == []
    assert lookup_draft(context, 0).tokens == []
    # A copy in progress: everything before the tail matched too.
    copied = np.array([*range(10, 30), *range(10, 25)], dtype=np.intc)
    found = lookup_draft(copied, 4)
    assert found.tokens == [25, 26, 27, 28] and found.deep


def test_lookup_matches_whole_ids_only() -> None:
    """The ids are searched as bytes: a match across two ids' bytes is not a match."""
    rng = random.Random(3)
    values = [0x01010101, 0x01010100, 0x00010101, 1, 256, 65536, 0]
    for _ in range(3000):
        context = [rng.choice(values) for _ in range(rng.randint(2, 30))]
        expected: list[int] = []
        for size in (4, 3, 2):
            starts = [
                i for i in range(len(context) - size) if context[i : i + size] == context[-size:]
            ]
            if len(context) > size and starts:
                expected = context[starts[-1] + size : starts[-1] + size + 5]
                break
        assert lookup_draft(np.array(context, dtype=np.intc), 5).tokens == expected, context


def test_the_policy_drafts_only_where_the_expected_gain_beats_a_plain_step() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    draft = Draft(list(range(8)), depth=DEEP_MATCH)
    cpu = DraftPolicy()
    # Step costs as measured on 2 cores: 1, 1.75, 2.2 and 3.2 single steps.
    for n_tokens, seconds in ((1, 0.010), (2, 0.0175), (3, 0.022), (5, 0.032)):
        cpu.record_step(n_tokens, seconds)
    assert cpu.cost(4) == pytest.approx(2.7)  # between measured sizes
    cpu.acceptance[DEEP] = 0.3  # prose: drafts fail
    assert cpu.draft_length(draft) == 0
    cpu.acceptance[DEEP] = 0.95  # a copy: long drafts pay even on 2 cores
    assert cpu.draft_length(draft) >= 4
    assert cpu.draft_length(Draft([1, 2], DEEP_MATCH)) == 2  # never more than was drafted
    gpu = DraftPolicy()
    for n_tokens in range(1, 10):
        gpu.record_step(n_tokens, 0.010 + 0.0005 * n_tokens)  # nearly flat
    gpu.acceptance[SHALLOW] = 0.5
    assert gpu.draft_length(Draft(list(range(8)), depth=3)) >= 2
    # Before steps are timed, the calibration's curve for the model: between its sizes
    # linear, past the last at its mean slope; once a single step is timed, the curve
    # still answers for sizes not timed past the largest timed.
    calibrated = DraftPolicy(prior_costs={1: 1.0, 2: 1.0, 3: 1.1, 5: 2.0, 9: 3.0})
    assert calibrated.cost(2) == 1.0 and calibrated.cost(4) == pytest.approx(1.55)
    assert calibrated.cost(11) == pytest.approx(3.0 + 2 * 0.25)
    calibrated.record_step(1, 0.01)
    assert calibrated.cost(3) == pytest.approx(1.1)
    assert DraftPolicy().cost(5) == pytest.approx(1 + 4 * PRIOR_EXTRA_TOKEN_COST)
    # Verifications teach each kind of match its acceptance; idle steps bring it back.
    policy = DraftPolicy()
    for _ in range(10):
        policy.record_verification(SHALLOW, 4, 0)
    assert policy.acceptance[SHALLOW] < 0.05 and policy.acceptance[DEEP] > 0.8
    for _ in range(100):
        policy.idle_step()
    assert policy.acceptance[SHALLOW] > 0.55


def test_an_unknown_mode_is_one_clear_line(tiny_model: Path) -> None:
    with pytest.raises(UsageError, match="unknown speculative mode 'fast'; choose one of auto"):
        Engine(tiny_model, LoadOptions(speculative="fast"))


def test_auto_drafts_only_with_batch_invariant_kernels(tiny_model: Path) -> None:
    plain = Engine(tiny_model, LoadOptions(n_ctx=512, flash_attn=False))
    flash = Engine(tiny_model, LoadOptions(n_ctx=512, flash_attn=True))
    quantized = Engine(tiny_model, LoadOptions(n_ctx=512, kv_type="q8_0"))
    forced = Engine(tiny_model, LoadOptions(n_ctx=512, flash_attn=False, speculative="ngram"))
    try:
        assert not plain.drafting and not flash.drafting
        assert quantized.drafting and forced.drafting
    finally:
        for engine in (plain, flash, quantized, forced):
            engine.close()


@pytest.mark.parametrize(
    "sampling", [GREEDY, Sampling(temperature=0.8, seed=7)], ids=["greedy", "sampled"]
)
@pytest.mark.usefixtures("cheap_steps")
def test_replies_are_token_for_token_those_without_drafts(
    smollm2: Path, sampling: Sampling
) -> None:
    off, on = _engine(smollm2, "off"), _engine(smollm2, "auto")
    try:
        plain, drafted = _reply(off, sampling), _reply(on, sampling)
        # Sampled at each position, kept while the draft agrees: the same draws as without.
        assert drafted.tokens == plain.tokens and drafted.text == plain.text
        assert drafted.stats.accepted_tokens > 0 and plain.stats.drafted_tokens == 0
    finally:
        off.close()
        on.close()


@pytest.mark.usefixtures("cheap_steps")
def test_a_copy_reply_accepts_most_drafts(smollm2: Path) -> None:
    engine = _engine(smollm2, "auto")
    try:
        generation = _reply(engine, GREEDY)
        stats = generation.stats
        assert stats.drafted_tokens > 20
        assert stats.accepted_tokens > stats.drafted_tokens / 2
        assert stats.accepted_tokens <= min(stats.drafted_tokens, stats.generated_tokens)
        # What the cache holds is exactly the prompt and the reply (the last token evaluated),
        # also where the reply ends on a token its draft did not have (drafts past it left).
        prompt = engine.prompt_tokens([ChatMessage("user", COPY_REQUEST)])
        assert engine.cache.cached_tokens == prompt + generation.tokens
        for limit in range(60, 80):
            cut = engine.generate(prompt, GREEDY, limit)
            for _ in cut:
                pass
            assert cut.tokens == generation.tokens[:limit]
            assert engine.cache.cached_tokens == prompt + cut.tokens, limit
    finally:
        engine.close()


def _conversation_turns(model: Path, home: Path, speculative: str) -> list[str]:
    """Two turns, the conversation closed, reopened on a new engine from its saved state, a
    third turn."""
    replies = []
    store = Store(home / "db.sqlite3")
    states = StateStore(home / "states")
    engine = _engine(model, speculative)
    conversation = Conversation.open(store, states, "copy", engine)
    for text in (COPY_REQUEST, "Now rename average_of to mean_column, the whole file again."):
        replies.append(_said(conversation, text).generation.text)
    conversation.wait_saved()
    conversation.close()
    engine.close()
    engine = _engine(model, speculative)
    conversation = Conversation.open(store, states, "copy", engine)
    turn = _said(conversation, "And once more, unchanged.")
    assert turn.restore.restored  # from the saved state, not re-read
    replies.append(turn.generation.text)
    conversation.close()
    engine.close()
    store.close()
    return replies


def test_a_conversation_resumed_from_its_saved_state_is_the_same_with_drafts(
    smollm2: Path, tmp_path: Path
) -> None:
    _same_with_drafts_and_without(_conversation_turns, smollm2, tmp_path)


@pytest.mark.usefixtures("cheap_steps")
def test_a_stop_string_inside_a_drafted_run_ends_the_reply_where_it_would(
    smollm2: Path,
) -> None:
    off, on = _engine(smollm2, "off"), _engine(smollm2, "auto")
    try:
        plain_text = _reply(off, GREEDY).text
        assert "startswith" in plain_text  # the stop string comes in the copied run
        for engine in (off, on):
            engine.template.stop = (*engine.template.stop, "startswith")
        cut_off = _reply(off, GREEDY)
        cut_on = _reply(on, GREEDY)
        assert (cut_on.tokens, cut_on.text) == (cut_off.tokens, cut_off.text)
        assert "startswith" not in cut_on.text and cut_on.text in plain_text
        assert cut_on.stats.accepted_tokens > 0  # drafted up to the stop (and past it)
        # The cache keeps only the reply as cut, no draft past the stop string.
        prompt = on.prompt_tokens([ChatMessage("user", COPY_REQUEST)])
        assert on.cache.cached_tokens == prompt + cut_on.tokens
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize(("kv_type", "invariant"), [("q8_0", True), ("f16", False)])
def test_which_kernels_give_a_batch_the_logits_of_single_steps(
    smollm2: Path, kv_type: str, invariant: bool
) -> None:
    """Why ``auto`` drafts over a quantized cache only: past 512 cells a single token's flash
    attention over an F16 cache takes llama.cpp's split-KV path, a batch does not. (Should
    llama.cpp change that, this test says so and ``Engine.batch_invariant`` can widen.)"""
    llm = llama_cpp.Llama(
        model_path=str(smollm2), n_ctx=1024, n_threads=2, flash_attn=True,
        type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type], verbose=False,
    )  # fmt: skip
    try:
        prompt = llm.tokenize(SOURCE.encode() * 4, add_bos=True)[:700]
        extra = llm.tokenize(b" def sum_column(rows, column):")[:4]
        n_vocab = llm.n_vocab()

        def logits(index: int) -> np.ndarray:
            row = llm._ctx.get_logits_ith(index)
            return np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()

        llm.eval(prompt)
        single = []
        for token in extra:
            llm.eval([token])
            single.append(logits(-1))
        llm.n_tokens = len(prompt)
        llm._batch.set_batch(batch=extra, n_past=len(prompt), logits_all=True)
        llm._ctx.kv_cache_seq_rm(-1, len(prompt), -1)
        llm._ctx.decode(llm._batch)
        batch = [logits(i) for i in range(len(extra))]
        same = all(np.array_equal(a, b) for a, b in zip(single, batch, strict=True))
        assert same is invariant
    finally:
        llm.close()


def _ask_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert main(["ask", *args, "--temperature", "0", "--max-tokens", "120", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.usefixtures("cheap_steps")
def test_ask_reports_drafts_and_off_turns_them_off(
    smollm2: Path, isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [COPY_REQUEST, "--model-path", str(smollm2), "--kv-type", "q8_0"]
    # A calibration a hundred times too slow: three plain turns would correct it; turns that
    # drafts sped up say nothing about it and leave it as it is.
    slow = {t: 1e-6 for t in ("F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K")}
    SpeedModel(slow, 0.05, slow, 0.005, machine_name(), 2).save(app_paths().speed_calibration)
    before = app_paths().speed_calibration.read_text()
    drafted = _ask_json(capsys, *common)
    for _ in range(2):
        assert _ask_json(capsys, *common)["stats"]["drafted_tokens"] > 0
    assert app_paths().speed_calibration.read_text() == before
    plain = _ask_json(capsys, *common, "--speculative", "off")
    assert drafted["reply"] == plain["reply"]
    assert drafted["stats"]["accepted_tokens"] > 0
    assert drafted["stats"]["drafted_tokens"] >= drafted["stats"]["accepted_tokens"]
    assert drafted["stats"]["speculative_speedup"] > 0
    assert plain["stats"]["drafted_tokens"] == 0 and plain["stats"]["speculative_speedup"] is None
    # The setting decides when no flag does; a bad one is a line that names it.
    app_paths().settings_file.parent.mkdir(parents=True, exist_ok=True)
    app_paths().settings_file.write_text('speculative = "off"\n')
    assert _ask_json(capsys, *common)["stats"]["drafted_tokens"] == 0
    app_paths().settings_file.write_text('speculative = "fast"\n')
    assert main(["ask", "hi", "--model-path", str(smollm2)]) == 2
    assert (
        "speculative must be one of auto, off, ngram, draft, not 'fast'" in capsys.readouterr().err
    )


@pytest.mark.usefixtures("cheap_steps")
async def test_the_panel_shows_how_many_drafts_were_accepted(
    smollm2: Path, isolated_home: Path
) -> None:
    app_paths().settings_file.parent.mkdir(parents=True, exist_ok=True)
    # Pasted whole (read ahead as typed, a prompt is evaluated in other batches, and a
    # 135M model then answers otherwise).
    app_paths().settings_file.write_text('kv_type = "q8_0"\ntype_ahead = false\n')
    async with chat_app(smollm2, n_ctx=2048, max_tokens=120) as ui:
        ui.app.screen.query_one(PromptInput).text = COPY_REQUEST
        finished = await ui.send("enter")
        assert finished.stats.accepted_tokens > 0
        speed = ui.text("#speed")
        share = finished.stats.accepted_tokens / finished.stats.drafted_tokens
        assert f"drafts {share:.0%} accepted" in speed


def _window_and_regenerate(model: Path, home: Path, speculative: str) -> list[str]:
    """Copy turns in a context that holds one and a half of them (the window moves), then the
    last question answered again (a regenerate: the cache cut back to before it)."""
    store = Store(home / "db.sqlite3")
    engine = _engine(model, speculative, n_ctx=448)
    conversation = Conversation.open(store, StateStore(home / "states"), "window", engine)
    replies, moved = [], False
    for text in (COPY_REQUEST, "Once more."):
        turn = _said(conversation, text, 96)
        moved = moved or bool(turn.window.dropped_messages)
        replies.append(turn.generation.text)
    assert moved, "the window moved"
    question = conversation.take_back_last_exchange()
    assert question == "Once more."
    replies.append(_said(conversation, question, 96).generation.text)
    conversation.close()
    engine.close()
    store.close()
    return replies


def test_a_moved_window_and_a_regenerate_are_the_same_with_drafts(
    smollm2: Path, tmp_path: Path
) -> None:
    _same_with_drafts_and_without(_window_and_regenerate, smollm2, tmp_path)
