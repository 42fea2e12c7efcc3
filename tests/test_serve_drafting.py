"""``localchat serve`` drafting by prompt lookup inside its batched steps, on the real
SmolLM2 (flash attention over a q8_0 cache: a verified run gets single steps' logits): a
copy reply accepts drafts and is, token for token, the reply without them — alone, side by
side with another, and under sampling with a seed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.state.kvstate import StateStore
from tests.test_serve import NAME
from tests.test_serve_batching import _queued_together
from tests.test_speculative import COPY_REQUEST, REPLY_TOKENS

STORY = "Write a short story about a lighthouse keeper."


class Drafting:
    """SmolLM2 served with ``speculative`` as given, ``parallel`` sequences."""

    def __init__(self, model: Path, states: Path, speculative: str, parallel: int = 1) -> None:
        options = LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0", speculative=speculative)
        self.engine = Engine(model, options)
        self.runner = ModelRunner(self.engine, StateStore(states), NAME, parallel=parallel)
        self.server = BackgroundServer(Router.of_one(self.runner), None)

    def ask(self, question: str, **extra: object) -> dict:
        body = {"model": NAME, "messages": [{"role": "user", "content": question}],
                "max_tokens": REPLY_TOKENS, "temperature": 0, **extra}  # fmt: skip
        response = httpx.post(f"{self.server.root}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def close(self) -> None:
        self.server.close()
        self.runner.close()
        self.engine.close()


@pytest.fixture
def plain(smollm2: Path, tmp_path: Path) -> Iterator[Drafting]:
    served = Drafting(smollm2, tmp_path / "plain", "off")
    yield served
    served.close()


@pytest.fixture
def drafting(smollm2: Path, tmp_path: Path) -> Iterator[Drafting]:
    served = Drafting(smollm2, tmp_path / "drafting", "auto", parallel=2)
    yield served
    served.close()


def _text(reply: dict) -> str:
    return str(reply["choices"][0]["message"]["content"])


@pytest.mark.usefixtures("cheap_steps")
def test_a_copy_reply_drafts_and_is_the_reply_without_drafts(
    plain: Drafting, drafting: Drafting
) -> None:
    assert drafting.runner.scheduler.drafting and not plain.runner.scheduler.drafting
    without = plain.ask(COPY_REQUEST)
    drafted = drafting.ask(COPY_REQUEST)
    assert _text(drafted) == _text(without)
    timings = drafted["timings"]
    assert timings["draft_n"] > 20 and timings["draft_n_accepted"] > timings["draft_n"] / 2
    assert without["timings"]["draft_n"] == 0
    # A story repeats little: drafts are few, and the text is the same.
    assert _text(drafting.ask(STORY)) == _text(plain.ask(STORY))


@pytest.mark.usefixtures("cheap_steps")
def test_side_by_side_each_drafting_reply_is_the_reply_alone(
    plain: Drafting, drafting: Drafting
) -> None:
    alone = [_text(plain.ask(q)) for q in (COPY_REQUEST, STORY)]
    replies: dict[int, dict] = {}

    def ask(index: int, question: str) -> None:
        replies[index] = drafting.ask(question)

    threads = [
        threading.Thread(target=ask, args=(i, q)) for i, q in enumerate((COPY_REQUEST, STORY))
    ]
    with _queued_together(drafting.runner, 2):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join()
    assert [_text(replies[0]), _text(replies[1])] == alone
    assert replies[0]["timings"]["draft_n_accepted"] > 0


@pytest.mark.usefixtures("cheap_steps")
def test_under_sampling_a_drafted_reply_draws_what_the_plain_one_draws(
    plain: Drafting, drafting: Drafting
) -> None:
    sampled = {"temperature": 0.8, "seed": 7}
    drafted = drafting.ask(COPY_REQUEST, **sampled)
    assert _text(drafted) == _text(plain.ask(COPY_REQUEST, **sampled))
    assert drafted["timings"]["draft_n_accepted"] > 0
