"""``localchat serve`` answering requests side by side (continuous batching) on the real
SmolLM2: one llama.cpp step for every running sequence, a request that arrives while
another streams starts at once, greedy replies among others are each reply alone, and each
sequence samples with its own parameters."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import llama_cpp
import pytest

from localchat.backends.base import Sampling
from localchat.backends.llama.batch import Chunk, SequenceBatch, StepInterrupted
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.backends.llama.runtime import last_error_line
from localchat.chat.template import ChatMessage
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.server.scheduler import COPY_MIN_TOKENS, PREPARE_WAIT_S
from localchat.state.kvstate import StateStore
from tests.test_serve import NAME, QUESTION, Served, _client, _plain_reply, holding_compute

QUESTIONS = [
    QUESTION,
    "List five fruits and say the colour of each.",
    "Explain what a binary search does, step by step.",
]


@pytest.fixture
def served3(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states", parallel=3)
    yield server
    server.close()


def _post(root: str, question: str, max_tokens: int, **extra: object) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    return httpx.post(f"{root}/v1/chat/completions", json=body, timeout=300)


def _ask(root: str, question: str, max_tokens: int, **extra: object) -> dict:
    response = _post(root, question, max_tokens, **extra)
    assert response.status_code == 200, response.text
    return dict(response.json())


@contextlib.contextmanager
def _queued_together(runner: ModelRunner, count: int) -> Iterator[None]:
    """Hold the compute thread until ``count`` requests are handed in, so they start in
    one step, side by side, however fast the model and however busy the machine."""
    with holding_compute():
        yield
        deadline = time.monotonic() + 120
        while runner.scheduler.waiting < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.scheduler.waiting == count


def _all_at_once(runner: ModelRunner, calls: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=call) for call in calls]
    with _queued_together(runner, len(calls)):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join()


def test_greedy_replies_side_by_side_are_each_reply_alone(served3: Served, smollm2: Path) -> None:
    replies: dict[int, str] = {}

    def ask(index: int) -> None:
        body = _ask(served3.root, QUESTIONS[index], 48)
        replies[index] = body["choices"][0]["message"]["content"]

    _all_at_once(served3.runner, [functools.partial(ask, i) for i in range(len(QUESTIONS))])
    assert served3.runner.counters.running == 0 and served3.runner.counters.queued == 0
    for index, question in enumerate(QUESTIONS):
        assert replies[index] == _plain_reply(smollm2, [ChatMessage("user", question)], 48)
    assert served3.runner.counters.peak_running == 3  # side by side, a sequence each


def test_a_request_that_arrives_while_another_streams_is_answered_before_it_ends(
    served3: Served, smollm2: Path
) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    streamed: list[str] = []
    first = threading.Event()

    def stream_long() -> None:
        with httpx.stream("POST", f"{served3.root}/v1/chat/completions", json=body,
                          timeout=300) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    streamed.append(line)
                    if len(streamed) > 2:  # the reply itself streams (not just its role)
                        first.set()

    long_reply = threading.Thread(target=stream_long)
    long_reply.start()
    assert first.wait(120)
    short = _ask(served3.root, QUESTIONS[1], 8)
    # The short reply came while the long one was still streaming (a queue would have
    # answered it only after all 400 tokens).
    assert long_reply.is_alive() and served3.runner.counters.running == 1
    assert short["usage"]["completion_tokens"] == 8
    # The system prompt both share was copied from the streaming sequence, not evaluated,
    # and the reply is the one it has alone.
    assert short["usage"]["prompt_tokens_details"]["cached_tokens"] >= COPY_MIN_TOKENS
    plain = _plain_reply(smollm2, [ChatMessage("user", QUESTIONS[1])], 8)
    assert short["choices"][0]["message"]["content"] == plain
    long_reply.join()
    assert len(streamed) > 300


def _greedy_side_by_side(batch: SequenceBatch, prompts: list[list[int]], steps: int,
                         interrupt_at: int | None = None) -> list[list[int]]:  # fmt: skip
    """Each prompt read in its own sequence, then ``steps`` greedy tokens for all of them
    in shared steps; the step ``interrupt_at`` is given up midway once, then taken again."""
    samplers = [batch.sampler(Sampling(temperature=0.0)) for _ in prompts]
    rows = batch.decode([Chunk(seq, prompt) for seq, prompt in enumerate(prompts)])
    replies = [[batch.sample(samplers[seq], rows[seq][0])] for seq in range(len(prompts))]
    for step in range(steps):
        chunks = [Chunk(seq, [reply[-1]]) for seq, reply in enumerate(replies)]
        if step == interrupt_at:
            held = [list(tokens) for tokens in batch.tokens]
            batch.interrupt()  # before the decode: it stops at its first graph node
            with pytest.raises(StepInterrupted):
                batch.decode(chunks)
            assert batch.tokens == held  # nothing of the step was kept
            batch.clear_interrupt()
        rows = batch.decode(chunks)
        for seq, reply in enumerate(replies):
            reply.append(batch.sample(samplers[seq], rows[seq][0]))
    for sampler in samplers:
        sampler.close()
    return replies


def test_a_step_given_up_midway_keeps_nothing_and_the_replies_go_on_exactly(
    smollm2: Path,
) -> None:
    engine = Engine(smollm2, LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0"))
    try:
        prompts = [engine.prompt_tokens([ChatMessage("user", q)]) for q in QUESTIONS[:2]]
        replies = []
        for interrupt_at in (None, 5):
            batch = SequenceBatch(engine, 2, 1024)
            try:
                replies.append(_greedy_side_by_side(batch, prompts, 12, interrupt_at))
            finally:
                batch.close()
        assert replies[0] == replies[1]
    finally:
        engine.close()


def test_a_step_stopped_in_a_later_micro_batch_keeps_none_of_it(smollm2: Path) -> None:
    """Sequences adding unequal runs split a step into micro-batches; stopped in the last,
    llama.cpp keeps those before it, and the batch cuts them: each cache ends where it was,
    and the step taken again reads what it reads uninterrupted."""
    engine = Engine(smollm2, LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0", n_ubatch=4))
    batch = SequenceBatch(engine, 2, 1024)
    calls, stop_at = [0], [0]

    @llama_cpp.ggml_abort_callback
    def counting(_data: object) -> bool:  # asked after every graph node
        calls[0] += 1
        return bool(stop_at[0]) and calls[0] >= stop_at[0]

    try:
        prompts = [engine.prompt_tokens([ChatMessage("user", q)]) for q in QUESTIONS[:2]]
        batch.decode([Chunk(seq, prompt) for seq, prompt in enumerate(prompts)])
        llama_cpp.llama_set_abort_callback(batch._context, counting, None)
        sampler = batch.sampler(Sampling(temperature=0.0))
        held = [len(tokens) for tokens in batch.tokens]

        def step(chunks: list[Chunk]) -> tuple[int, list[int]]:
            calls[0] = 0
            rows = batch.decode(chunks)
            picked = [batch.sample(sampler, row) for seq in sorted(rows) for row in rows[seq]]
            for seq, length in enumerate(held):
                batch.cut(seq, length)
            return calls[0], picked

        one_token, _ = step([Chunk(0, [prompts[0][-1]])])
        unequal = [Chunk(0, [prompts[0][-1]]), Chunk(1, prompts[0][-7:], every=True)]
        nodes, picked = step(unequal)
        assert nodes > 1.5 * one_token  # several micro-batches' graphs
        stop_at[0], calls[0] = nodes - 1, 0  # in the last micro-batch's graph
        batch.interrupt()  # (its own byte is not asked here: the decode says why it stopped)
        with pytest.raises(StepInterrupted):
            batch.decode(unequal)
        assert "failed" not in last_error_line()  # not a failure a later error would name
        assert [len(tokens) for tokens in batch.tokens] == held
        for seq, length in enumerate(held):  # llama.cpp's cache ends there too
            assert llama_cpp.llama_memory_seq_pos_max(batch._memory, seq) == length - 1
        batch.clear_interrupt()
        stop_at[0] = 0
        assert step(unequal) == (nodes, picked)
        sampler.close()
    finally:
        batch.close()
        engine.close()


def test_requests_that_arrive_while_a_reply_streams_leave_it_exact(
    served3: Served, smollm2: Path
) -> None:
    """Each request admitted while the sequences generate stops the step in flight so that
    it can join the next (here they are refused once their prompt is made: a reply too long
    for the context); the streaming reply is the one it has alone."""
    question = "Tell a very long story."
    body = {"model": NAME, "messages": [{"role": "user", "content": question}],
            "max_tokens": 300, "temperature": 0, "stream": True}  # fmt: skip
    pieces: list[str] = []

    def stream_long() -> None:
        with httpx.stream("POST", f"{served3.root}/v1/chat/completions", json=body,
                          timeout=300) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))

    long_reply = threading.Thread(target=stream_long)
    long_reply.start()
    scheduler = served3.runner.scheduler
    refused = 0
    while long_reply.is_alive() and scheduler.interrupted_steps < 3:
        if served3.runner.counters.running:
            too_long = _post(served3.root, QUESTIONS[1], 100_000)
            assert too_long.status_code == 400, too_long.text
            refused += 1
        time.sleep(PREPARE_WAIT_S)
    long_reply.join()
    assert scheduler.interrupted_steps >= 3, f"{refused} requests stopped no step"
    metrics = httpx.get(f"{served3.root}/metrics").text
    assert f"localchat:steps_interrupted_total {scheduler.interrupted_steps}" in metrics
    assert served3.runner.counters.queued == 0 and scheduler.preparing == 0
    plain = _plain_reply(smollm2, [ChatMessage("user", question)], 300)
    assert "".join(pieces) == plain


def test_each_sequence_samples_with_its_own_parameters(served3: Served) -> None:
    def sampled(seed: int, **extra: object) -> str:
        body = _ask(served3.root, QUESTIONS[2], 24, temperature=1.0, top_p=0.95, seed=seed,
                    **extra)  # fmt: skip
        return str(body["choices"][0]["message"]["content"])

    alone = sampled(7)
    # Side by side, each with its own seed: a seed gives its reply again whatever runs beside
    # it (one shared sampler would mix the draws).
    together: dict[int, str] = {}

    def ask(index: int, seed: int) -> None:
        together[index] = sampled(seed)

    _all_at_once(served3.runner, [functools.partial(ask, i, s) for i, s in enumerate((7, 8, 7))])
    assert served3.runner.counters.peak_running == 3
    assert together[0] == together[2] == alone
    assert together[1] != alone or sampled(9) != alone
    greedy = _ask(served3.root, QUESTIONS[2], 24)["choices"][0]["message"]["content"]
    penalised = _ask(served3.root, QUESTIONS[2], 24, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised["choices"][0]["message"]["content"] != greedy
    refused = httpx.post(f"{served3.root}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3})  # fmt: skip
    assert refused.status_code == 400 and "presence_penalty" in refused.json()["error"]["message"]


def test_the_openai_client_streams_two_replies_at_once(served3: Served, smollm2: Path) -> None:
    client = _client(served3.root)
    with _queued_together(served3.runner, 2):  # the streams open before either runs
        streams = [
            client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": q}],
                temperature=0,
                max_tokens=32,
                stream=True,
            )
            for q in QUESTIONS[:2]
        ]
    # Read the two streams in turn, a chunk of each: both are running together.
    texts = ["", ""]
    iterators = [iter(s) for s in streams]
    live = [True, True]
    while any(live):
        for index, chunks in enumerate(iterators):
            if not live[index]:
                continue
            chunk = next(chunks, None)
            if chunk is None:
                live[index] = False
            elif chunk.choices and chunk.choices[0].delta.content:
                texts[index] += chunk.choices[0].delta.content
    for index, question in enumerate(QUESTIONS[:2]):
        assert texts[index] == _plain_reply(smollm2, [ChatMessage("user", question)], 32)
    assert served3.runner.counters.peak_running == 2


def test_a_client_that_leaves_stops_its_sequence_and_the_others_go_on(
    served3: Served, smollm2: Path
) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}  # fmt: skip
    other: dict[str, str] = {}
    with httpx.stream("POST", f"{served3.root}/v1/chat/completions", json=body,
                      timeout=300) as response:  # fmt: skip
        lines = response.iter_lines()
        next(lines)

        def ask_other() -> None:
            reply = _ask(served3.root, QUESTIONS[0], 40)
            other["text"] = reply["choices"][0]["message"]["content"]

        beside = threading.Thread(target=ask_other)
        beside.start()
        counters = served3.runner.counters
        deadline = time.monotonic() + 60
        while counters.running < 2 and time.monotonic() < deadline:  # both run
            next(lines)
        assert counters.running == 2
    # The story's client left: its sequence stops; the other reply is whole and unchanged.
    beside.join()
    assert other["text"] == _plain_reply(smollm2, [ChatMessage("user", QUESTIONS[0])], 40)
    deadline = time.monotonic() + 30
    while counters.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counters.running == 0 and counters.generated_tokens < 300


def test_parallel_defaults_to_what_memory_allows(served3: Served) -> None:
    from localchat.server.runner import MAX_PARALLEL_CPU, default_parallel

    engine = served3.engine
    one = engine.kv_bytes_per_token * engine.n_ctx  # a sequence's cache
    assert default_parallel(engine, 0) == 1  # always one
    assert default_parallel(engine, 6 * one) == 3  # half of what is free goes to caches
    assert default_parallel(engine, 10**15) == MAX_PARALLEL_CPU


def test_a_generated_model_served_side_by_side_writes_asks_replies(
    tiny_model: Path, tmp_path: Path
) -> None:
    # An F16 cache without flash attention (the tiny model's plan at this context): the
    # configuration where a unified cache would change replies.
    options = LoadOptions(n_ctx=512, n_threads=2)
    engine = Engine(tiny_model, options)
    assert not engine.flash_attn and engine.options.kv_type == "f16"
    runner = ModelRunner(engine, StateStore(tmp_path / "states"), "tiny", parallel=2)
    server = BackgroundServer(Router.of_one(runner))
    try:
        replies: dict[int, dict] = {}

        def ask(index: int) -> None:
            replies[index] = _ask(server.root, QUESTIONS[index], 96, model="tiny")

        # Thousands of tokens/s: only held together do the two replies share steps.
        _all_at_once(runner, [functools.partial(ask, i) for i in range(2)])
        assert runner.counters.peak_running == 2
    finally:
        server.close()
        runner.close()
        engine.close()
    for index in range(2):
        alone = Engine(tiny_model, options)
        try:
            generation = alone.generate(
                alone.prompt_tokens([ChatMessage("user", QUESTIONS[index])]),
                Sampling(temperature=0.0),
                96,
            )
            for _ in generation:
                pass
        finally:
            alone.close()
        assert replies[index]["choices"][0]["message"]["content"] == generation.text
        assert replies[index]["usage"]["completion_tokens"] == generation.stats.generated_tokens


def test_the_engines_own_context_holds_no_sequence_when_serving(
    smollm2: Path, tmp_path: Path
) -> None:
    # serve loads the engine with a small context of its own: the sequences' context holds
    # the KV, planned (flash attention, q8_0) for the context asked.
    options = LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0", own_cells=256)
    engine = Engine(smollm2, options)
    runner = ModelRunner(engine, StateStore(tmp_path / "states"), NAME, parallel=2)
    server = BackgroundServer(Router.of_one(runner))
    try:
        assert engine.n_ctx == 256 and engine.planned_ctx == 2048
        assert runner.batch.n_ctx_seq == 2048
        assert engine.kv_bytes_allocated <= 256 * engine.kv_bytes_per_token
        reply = _ask(server.root, QUESTIONS[0], 40)
        assert reply["choices"][0]["message"]["content"] == _plain_reply(
            smollm2, [ChatMessage("user", QUESTIONS[0])], 40
        )
        assert runner.cache.key.n_ctx == 2048  # saved states name the sequences' context
    finally:
        server.close()
        runner.close()
        engine.close()
