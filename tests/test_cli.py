"""The headless CLI: `ask`, `demo-model`, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localchat.backends.llama import runtime
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.cli.main import main
from localchat.gguf.info import read_gguf
from tests.conftest import GREEDY

CLI = [sys.executable, "-m", "localchat"]
# How long a process may take to exit after Ctrl+C: it stops within a second, but a 2-core
# machine with two CPU hogs beside the test suite can starve it for many.
STOP_WAIT_S = 30


def _ask_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["ask", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ask_json_reports_reply_and_stats(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _ask_json(
        capsys, "hello", "--model-path", str(tiny_model), "--temperature", "0", "--max-tokens", "16"
    )
    stats = result["stats"]
    assert result["model"] == tiny_model.name
    assert result["conversation"] is None
    assert isinstance(result["reply"], str) and result["reply"]
    assert stats["generated_tokens"] == 16
    assert stats["prompt_tokens"] == stats["prompt_tokens_evaluated"] > 5
    assert stats["kv_bytes_used"] == (stats["prompt_tokens"] + 16) * 512
    assert result["template"] == "the model's own"
    assert result["n_ctx"] == 4096  # the default, within the model's trained 4,096
    assert stats["kv_bytes_allocated"] == 4096 * 512
    assert stats["restored_from_state"] is False
    assert stats["window_dropped_messages"] == 0
    for key in ("ttft_s", "prompt_tps", "gen_tps"):
        assert stats[key] > 0


def test_greedy_ask_is_deterministic_and_one_off(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("hi", "--model-path", str(tiny_model), "--temperature", "0", "--max-tokens", "12")
    first = _ask_json(capsys, *args)
    second = _ask_json(capsys, *args)
    assert first["reply"] == second["reply"]
    # Nothing carried over: the second call evaluated its whole prompt again.
    assert second["stats"]["prompt_tokens_evaluated"] == first["stats"]["prompt_tokens"]


def test_system_prompt_is_part_of_the_prompt(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ("hi", "--model-path", str(tiny_model), "--temperature", "0", "--max-tokens", "4")
    plain = _ask_json(capsys, *base)
    with_system = _ask_json(capsys, *base, "--system", "You are a helpful assistant.")
    assert with_system["stats"]["prompt_tokens"] > plain["stats"]["prompt_tokens"] + 5


def test_ask_streams_text_to_stdout(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ask", "hello", "--model-path", str(tiny_model), "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1


def test_ask_without_a_model_uses_the_cached_demo(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _ask_json(capsys, "hello", "--max-tokens", "2")
    assert result["model"].startswith("demo-small-Q4_K_M")
    assert list((isolated_home / "cache" / "demo-models").glob("*.gguf"))


def test_demo_model_command_writes_a_loadable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.gguf"
    assert main(["demo-model", str(out), "--shape", "tiny", "--quant", "Q8_0", "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert read_gguf(out).file_type == "Q8_0"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "no such file"),
        ("text", "not a GGUF file"),
        ("truncated", "truncated GGUF file"),
    ],
)
def test_bad_model_files_give_one_line_errors(
    tmp_path: Path, tiny_model: Path, setup: str, expected: str
) -> None:
    path = tmp_path / f"{setup}.gguf"
    if setup == "text":
        path.write_text("not a model")
    elif setup == "truncated":
        path.write_bytes(tiny_model.read_bytes()[:100_000])
    result = _run_cli("ask", "hi", "--model-path", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert (
        lines[0].startswith("localchat: error: ") and str(path) in lines[0] and expected in lines[0]
    )
    assert "Traceback" not in result.stderr


def test_context_too_large_names_the_limit(tiny_model: Path) -> None:
    result = _run_cli("ask", "hi", "--model-path", str(tiny_model), "--ctx", "100000")
    assert result.returncode == 2
    assert "trained context 4096" in result.stderr and "--ctx 4096" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args", [["--ctx", "zero"], ["--max-tokens", "-3"], ["--temperature", "hot"]]
)
def test_bad_arguments_are_one_line(tiny_model: Path, args: list[str]) -> None:
    result = _run_cli("ask", "hi", "--model-path", str(tiny_model), *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def _start(*args: str, python: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, *python, *CLI[1:], *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # Unbuffered pipes: what a test reads before ``communicate`` (which reads the file
        # descriptors themselves) is all that left them, none held in a reader's buffer.
        bufsize=0,
    )


def _interrupt(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """Ctrl+C: the process exits 130 with no traceback (and nothing printed as ignored)."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {STOP_WAIT_S} s after Ctrl+C; stderr: {err[-2000:]!r}")
    assert proc.returncode == 130, err[-2000:]
    assert b"Traceback" not in err and b"Exception ignored" not in err, err[-2000:]
    return out, err


def _read_stderr_until(proc: subprocess.Popen[bytes], marker: bytes) -> bytes:
    """Lines of stderr up to and including the first with ``marker``."""
    assert proc.stderr is not None
    seen = b""
    while marker not in seen:
        line = proc.stderr.readline()
        assert line, f"the process ended before saying {marker!r}: {seen[-2000:]!r}"
        seen += line
    return seen


@pytest.mark.parametrize("after", ["localchat.cli.entry", "localchat.cli.main"])
def test_ctrl_c_during_imports_stops_cleanly(tiny_model: Path, after: str) -> None:
    # -X importtime names each module as its import ends: Ctrl+C lands in the next ones
    # (the CLI's own, then the command's: llama_cpp among them).
    proc = _start("ask", "hi", "--model-path", str(tiny_model), python=("-X", "importtime"))
    _read_stderr_until(proc, f"| {after}\n".encode())
    _out, err = _interrupt(proc)
    assert b"localchat: interrupted" in err


def test_ctrl_c_during_ask_stops_cleanly(small_model: Path) -> None:
    proc = _start(
        "ask", "write a long story", "--model-path", str(small_model), "--max-tokens", "4000"
    )
    assert proc.stdout is not None
    proc.stdout.read(1)  # the reply has started streaming
    _interrupt(proc)


def test_ctrl_c_during_a_long_prompt_stops_cleanly(small_model: Path, tmp_path: Path) -> None:
    # About 6,700 tokens: seconds of prompt evaluation, stopped between two graph nodes.
    text = tmp_path / "long.txt"
    text.write_text(
        " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    )
    proc = _start(
        "ask", "summarize", "--attach", str(text), "--model-path", str(small_model), "--ctx", "8192"
    )
    _read_stderr_until(proc, b"localchat: attached long.txt")  # loaded; the prompt is next
    time.sleep(0.3)
    out, _err = _interrupt(proc)
    assert out == b""  # stopped before the reply's first token


def test_ctrl_c_in_a_conversation_keeps_the_partial_reply(small_model: Path) -> None:
    ask = ("ask", "--conversation", "story", "--model-path", str(small_model))
    proc = _start(*ask, "write a long story", "--max-tokens", "4000")
    assert proc.stdout is not None
    first = b""
    while len(first.strip()) < 3:  # some of the reply
        chunk = proc.stdout.read(20)
        assert chunk, "the reply ended before any of it was read"
        first += chunk
    out, _err = _interrupt(proc)
    reply = (first + out).decode()
    result = _run_cli("export", "story", "--format", "json")
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)["messages"][-1]
    assert stored["role"] == "assistant" and reply.strip()
    assert stored["content"].strip().startswith(reply.strip())
    # The saved cache holds that partial turn: the next one starts from it.
    again = _run_cli(*ask, "go on", "--max-tokens", "2", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["stats"]["restored_from_state"] is True


def test_an_abort_stops_a_load(small_model: Path) -> None:
    runtime.request_abort()
    try:
        with pytest.raises(KeyboardInterrupt):
            Engine(small_model)
    finally:
        runtime.clear_abort()


def test_an_aborted_prompt_keeps_whole_batches_and_goes_on_exactly(small_model: Path) -> None:
    engine = Engine(small_model, LoadOptions(n_ctx=4096))
    try:
        prompt = engine.tokenize("the quick brown fox " * 600, add_bos=True)[:2000]

        def abort_after_the_first_batch() -> None:
            while not engine.cache.cached_tokens:
                time.sleep(0.002)
            runtime.request_abort()

        watcher = threading.Thread(target=abort_after_the_first_batch)
        watcher.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                list(engine.generate(prompt, GREEDY, 8))
        finally:
            watcher.join()
            runtime.clear_abort()
        kept = len(engine.cache.cached_tokens)
        assert 0 < kept < len(prompt) and kept % engine.n_batch == 0
        assert engine.cache.cached_tokens == prompt[:kept]
        assert engine.cache.batch_starts == list(range(0, kept, engine.n_batch))
        # Going on from the kept batches evaluates the rest in the batches a fresh prompt
        # would: the reply is the one an uninterrupted evaluation gives.
        resumed = engine.generate(prompt, GREEDY, 8)
        list(resumed)
        assert resumed.stats.prompt_tokens_evaluated == len(prompt) - kept
        engine.cache.reset()
        fresh = engine.generate(prompt, GREEDY, 8)
        list(fresh)
        assert resumed.tokens == fresh.tokens
    finally:
        engine.close()


def test_model_flags_count_before_or_after_the_subcommand(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["--model-path", str(tiny_model), "--ctx", "1024", "ask", "hi"],
        ["ask", "hi", "--model-path", str(tiny_model), "--ctx", "1024"],
        ["--ctx", "2048", "ask", "hi", "--model-path", str(tiny_model), "--ctx", "1024"],
    ):
        assert main([*argv, "--max-tokens", "2", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["n_ctx"], result["model"]) == (1024, tiny_model.name), argv


def test_ask_reads_the_message_from_stdin(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    base = ["--model-path", str(tiny_model), "--max-tokens", "2", "--json", "--temperature", "0"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    assert main(["ask", "-", *base]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert main(["ask", "hello there", *base]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["reply"] == piped["reply"]
    assert given["stats"]["prompt_tokens"] == piped["stats"]["prompt_tokens"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there"))
    assert main(["ask", *base]) == 0  # piped with no message at all
    again = json.loads(capsys.readouterr().out)
    assert again["stats"]["prompt_tokens"] == piped["stats"]["prompt_tokens"]
    assert again["reply"] == piped["reply"]
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert main(["ask", "-", *base]) == 2
    assert "the message read from stdin is empty" in capsys.readouterr().err


def test_hw_json_says_what_must_be_free(
    capsys: pytest.CaptureFixture[str], calibrated: object
) -> None:
    assert main(["hw", "--json", "--ram", "16GiB"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    fitting = [p for p in plans if p["fits"]]
    assert fitting
    for plan in fitting:
        assert 0 < plan["required_bytes"] <= plan["estimated_bytes"]
        assert plan["required_vram_bytes"] == 0
