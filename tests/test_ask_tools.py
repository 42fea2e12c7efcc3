"""``ask`` with MCP tools, end to end: a generated model held to a call by a grammar (so the
whole loop runs however random its weights), in the formats of real templates; the real test
server (tests/mcp_server.py) answering; consent; the transcript and the cache after."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from localchat.cli.main import main
from tests.test_mcp import mcp_settings, write_settings

TEMPLATES = Path(__file__).parent / "templates" / "tools"


@pytest.fixture(autouse=True)
def test_server(isolated_home: Path) -> None:
    write_settings(isolated_home, mcp_settings())


def _ask(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["ask", *args, "--temperature", "0", "--max-tokens", "150"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _export(capsys: pytest.CaptureFixture[str], name: str) -> list[dict]:
    assert main(["export", name, "--format", "json"]) == 0
    messages: list[dict] = json.loads(capsys.readouterr().out)["messages"]
    return messages


def test_a_call_without_consent_stops_the_ask_with_exit_2(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = _ask(capsys, "hi", "--model-path", str(tiny_model), "--tool-choice", "ping")
    assert code == 2
    assert (
        "localchat: tool: the model called ping({}); not run: allow it with --allow-tool ping (or --yes)"
        in err
    )
    assert "running" not in err


@pytest.mark.parametrize(
    "template",
    [
        "chatml",
        "qwen3.jinja",
        "llama-3.2.jinja",
        "mistral-nemo.jinja",
        "phi-4-mini.jinja",
        "lfm2.jinja",
        "deepseek-r1-distill-qwen.jinja",
    ],
)
def test_an_allowed_call_runs_and_the_reply_reads_only_its_result(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], template: str
) -> None:
    chosen = template if template == "chatml" else str(TEMPLATES / template)
    ask = ("--conversation", "c", "--model-path", str(tiny_model), "--template", chosen)
    code, _out, err = _ask(
        capsys, "ping it", *ask, "--tool-choice", "ping", "--allow-tool", "ping", "--json"
    )
    assert code == 0, err
    assert "localchat: tool: running ping({})" in err
    assert "localchat: tool: ping returned: pong" in err
    roles = [(m["role"], m.get("tool_calls", [{}])[0].get("name")) for m in _export(capsys, "c")]
    assert roles == [("user", None), ("assistant", "ping"), ("tool", None), ("assistant", None)]
    call, result = _export(capsys, "c")[1:3]
    assert result["content"] == "pong" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    # The next turn starts from the cache: the call as the model wrote it, the result, and
    # the reply after it are not read again.
    code, out, err = _ask(capsys, "thanks", *ask, "--json")
    assert code == 0, err
    stats = json.loads(out)["stats"]
    if template == "mistral-nemo.jinja":
        # Mistral's template writes the tools before the last user message: a new message
        # moves them, and what followed is read again (so does llama.cpp, from its template).
        assert stats["history_reevaluated_reason"] == (
            "the chat template renders message 1 (user) differently now"
        )
        return
    reason = stats["history_reevaluated_reason"] or ""
    # The call and its result are kept (a reply after them may read differently: Llama's
    # template trims what the random model wrote).
    assert "message 2" not in reason and "message 3" not in reason, reason
    assert stats["prompt_tokens_evaluated"] < stats["prompt_tokens"] / 5


def test_the_round_trip_evaluates_the_result_and_the_cue_only(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ask = ("--conversation", "r", "--model-path", str(tiny_model), "--tool-choice", "ping")
    code, out, err = _ask(capsys, "say something", *ask, "--yes", "--json")
    assert code == 0, err
    payload = json.loads(out)
    (record,) = payload["tool_calls"]
    assert record["name"] == "ping" and record["allowed"] and not record["is_error"]
    stats = payload["stats"]  # the turn that read the result
    assert stats["history_reevaluated_tokens"] == 0
    # The prompt (the tools described, the message, the call) came from the cache: what was
    # evaluated is the result's message and the cue, a few dozen of about a thousand tokens.
    assert stats["prompt_tokens"] > 900
    assert stats["kept_tokens"] + stats["prompt_tokens_evaluated"] == stats["prompt_tokens"]
    assert 0 < stats["prompt_tokens_evaluated"] < 80


def test_a_denied_call_is_kept_and_the_conversation_goes_on(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ask = ("--conversation", "d", "--model-path", str(tiny_model))
    code, _out, _err = _ask(capsys, "hi", *ask, "--tool-choice", "ping")
    assert code == 2
    messages = _export(capsys, "d")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[-1]["content"] == "error: the user did not allow this call"
    code, _out, err = _ask(capsys, "never mind", *ask)
    assert code == 0, err
    assert [m["role"] for m in _export(capsys, "d")][-2:] == ["user", "assistant"]


def test_a_one_off_ask_runs_its_calls_with_yes(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _ask(
        capsys, "ping", "--model-path", str(tiny_model), "--tool-choice", "ping", "--yes", "--json"
    )
    assert code == 0, err
    (record,) = json.loads(out)["tool_calls"]
    assert (record["name"], record["arguments"], record["result"]) == ("ping", {}, "pong")


def test_a_server_that_crashes_mid_call_leaves_the_reply_going(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _ask(
        capsys, "x", "--model-path", str(tiny_model), "--tool-choice", "crash", "--yes", "--json"
    )
    assert code == 0, err
    assert "localchat: tool: crash failed: error: the MCP server 'test' stopped" in err
    (record,) = json.loads(out)["tool_calls"]
    assert record["is_error"]


@pytest.mark.parametrize(
    ("choice", "message"),
    [("nope", "no tool named 'nope' to require (tools: ping, add"), ("sideways", "no tool named")],
)
def test_an_unknown_tool_choice_is_refused(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], choice: str, message: str
) -> None:
    code, _out, err = _ask(capsys, "x", "--model-path", str(tiny_model), "--tool-choice", choice)
    assert code == 2 and message in err


def test_required_with_no_server_is_refused(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], isolated_home: Path
) -> None:
    write_settings(isolated_home, "")
    code, _out, err = _ask(
        capsys, "x", "--model-path", str(tiny_model), "--tool-choice", "required"
    )
    assert code == 2 and "no MCP server offers a tool" in err


def test_a_real_model_held_to_a_call_writes_a_well_formed_one(
    smollm2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _ask(
        capsys, "What is 2 plus 3?", "--model-path", str(smollm2), "--tool-choice", "add",
        "--yes", "--json",
    )  # fmt: skip
    assert code == 0, err
    first = json.loads(out)["tool_calls"][0]
    assert first["name"] == "add" and set(first["arguments"]) == {"a", "b"}
    a, b = first["arguments"]["a"], first["arguments"]["b"]
    assert first["result"] == str(float(a + b)) and not first["is_error"]


def test_calls_left_without_results_are_answered_before_the_next_message(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A reply stopped on its way to its calls, a fork made at them: the next message finds
    them answered as not run (templates and servers want every call answered)."""
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.chat.tools import NOT_RUN, ToolSpec, ToolUse
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    engine = Engine(tiny_model, LoadOptions(n_ctx=2048, n_threads=2))
    store = Store(tmp_path / "db.sqlite3")
    conversation = Conversation.open(store, StateStore(tmp_path / "states"), "c", engine)
    try:
        ping = ToolSpec("ping", "Answer pong.", {"type": "object", "properties": {}})
        conversation.offer_tools(ToolUse((ping,), "ping"))
        turn = conversation.send("ping", Sampling(temperature=0), 150)
        for _ in turn:
            pass
        (call,) = turn.generation.tool_calls
        for _ in conversation.send("never mind", Sampling(temperature=0), 8):
            pass
        roles = [
            (e.record.role, e.record.content, e.record.tool_call_id) for e in conversation.exchanges
        ]
        assert roles[2] == ("tool", NOT_RUN, call.id) and roles[3][0] == "user"
        # A reply the user stopped makes no calls, whatever it wrote.
        stopped = threading.Event()
        stopped.set()
        turn = conversation.send("again", Sampling(temperature=0), 150, stopped)
        for _ in turn:
            pass
        assert turn.generation.stats.stop_reason == "cancelled" and turn.generation.tool_calls == []
    finally:
        conversation.close()
        engine.close()
        store.close()


def test_the_loop_over_a_server_sends_tools_and_reads_its_calls(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ask --server`` against ``localchat serve``: the tools go as OpenAI's ``tools``, the
    server's ``tool_calls`` come back, run here, and their result goes back as a ``tool``
    message, which the server evaluates alone (the rest is in its cache)."""
    from tests.test_serve import Served

    served = Served(smollm2, tmp_path / "states")
    try:
        server = f"{served.root}/v1"
        code, out, err = _ask(
            capsys, "What is 2 plus 3?", "--server", server, "--tool-choice", "add", "--yes",
            "--conversation", "wire", "--json",
        )  # fmt: skip
        assert code == 0, err
        payload = json.loads(out)
        first = payload["tool_calls"][0]
        assert first["name"] == "add" and not first["is_error"]
        assert first["result"] == str(float(first["arguments"]["a"] + first["arguments"]["b"]))
        stats = payload["stats"]  # the last request: results and the cue, the rest cached
        assert stats["prompt_tokens_evaluated"] < stats["prompt_tokens"] / 4
        messages = _export(capsys, "wire")
        assert [m["role"] for m in messages[:3]] == ["user", "assistant", "tool"]
        assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"]
    finally:
        served.close()
