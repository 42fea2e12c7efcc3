"""The headless CLI: `ask`, `demo-model`, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.cli.main import main
from localchat.gguf.info import read_gguf

CLI = [sys.executable, "-m", "localchat.cli.main"]


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


def test_ctrl_c_during_ask_stops_cleanly(small_model: Path) -> None:
    proc = subprocess.Popen(
        [
            *CLI,
            "ask",
            "write a long story",
            "--model-path",
            str(small_model),
            "--max-tokens",
            "4000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    proc.stdout.read(1)  # the reply has started streaming
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"Traceback" not in err


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
