"""MCP servers through the official SDK: a real stdio server written with it
(tests/mcp_server.py), started, listed, called, crashing and failing; their settings; and
``localchat tools``."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.chat.tools import ToolCall
from localchat.cli.main import main
from localchat.errors import UsageError
from localchat.settings import load_settings
from localchat.tools.config import McpServerConfig
from localchat.tools.servers import ToolServers

SERVER = Path(__file__).parent / "mcp_server.py"
TEST_SERVER = McpServerConfig("test", (sys.executable, str(SERVER)))


def write_settings(home: Path, body: str) -> Path:
    path = home / "config" / "settings.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def mcp_settings(*extra: str) -> str:
    """settings.toml with the test server (and ``extra`` [[mcp]] blocks)."""
    command = json.dumps([sys.executable, str(SERVER)])
    return "\n".join([f'[[mcp]]\nname = "test"\ncommand = {command}\n', *extra])


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ToolServers]:
    hub = ToolServers((TEST_SERVER,), tmp_path / "logs", result_chars=1000)
    assert hub.start() == []
    yield hub
    hub.close()


def test_a_server_lists_its_tools_and_answers_calls(servers: ToolServers, tmp_path: Path) -> None:
    names = [tool.name for tool in servers.tools()]
    assert names[:3] == ["ping", "add", "echo"]
    add = next(tool for tool in servers.tools() if tool.name == "add")
    assert add.description == "Add two numbers."
    assert add.parameters["required"] == ["a", "b"]
    assert servers.server_of("add") == "test"
    result = servers.call(ToolCall("add", {"a": 2, "b": 3}))
    assert (result.text, result.is_error) == ("5.0", False)
    # Its stderr went to its log (it would draw over the app), readable by the user only.
    log = tmp_path / "logs" / "mcp-test.log"
    assert "localchat-test MCP server starting" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_a_tool_error_is_a_result_the_model_reads(servers: ToolServers) -> None:
    failed = servers.call(ToolCall("fail", {}))
    assert failed.is_error and "fail" in failed.text
    unknown = servers.call(ToolCall("nope", {}))
    assert unknown.is_error and "no MCP server has a tool named 'nope'" in unknown.text


def test_a_result_over_the_limit_is_cut_saying_so(servers: ToolServers) -> None:
    result = servers.call(ToolCall("big", {"size": 50_000}))
    assert result.cut_chars == 49_000
    assert result.text.startswith("x" * 1000)
    assert result.text.endswith("[localchat: the result was cut to 1,000 of 50,000 characters]")


def test_control_characters_in_a_result_are_shown_not_sent(servers: ToolServers) -> None:
    result = servers.call(ToolCall("echo", {"text": "red \x1b[31mtext\x1b[0m\nline"}))
    assert result.text == "red \\x1b[31mtext\\x1b[0m\nline"


def test_a_server_that_dies_mid_call_is_an_error_result_and_stays_down(
    servers: ToolServers,
) -> None:
    crashed = servers.call(ToolCall("crash", {}))
    assert crashed.is_error and "the MCP server 'test' stopped" in crashed.text
    assert servers.statuses[0].state.startswith("stopped")
    after = servers.call(ToolCall("ping", {}))
    assert after.is_error and "stopped" in after.text
    # Its tools stay offered: they render at the prompt's head, where a change re-reads all.
    assert "ping" in [tool.name for tool in servers.tools()]


def test_a_slow_call_times_out(tmp_path: Path) -> None:
    slow = McpServerConfig("test", TEST_SERVER.command, timeout_s=1)
    hub = ToolServers((slow,), tmp_path / "logs")
    try:
        assert hub.start() == []
        result = hub.call(ToolCall("slow", {"seconds": 30}))
        assert result.is_error and "no result within 1 s" in result.text
        assert hub.call(ToolCall("ping", {})).text == "pong"  # the server still answers
    finally:
        hub.close()


def test_a_server_that_cannot_start_is_one_line_and_the_others_run(tmp_path: Path) -> None:
    missing = McpServerConfig("gone", ("/nonexistent/mcp-server",))
    hub = ToolServers((missing, TEST_SERVER), tmp_path / "logs")
    try:
        problems = hub.start()
        assert problems == [
            "MCP server 'gone' failed: its command was not found (/nonexistent/mcp-server)"
        ]
        assert hub.call(ToolCall("ping", {})).text == "pong"
    finally:
        hub.close()


def test_a_server_that_answers_late_runs_from_then_on(tmp_path: Path) -> None:
    slow = McpServerConfig("slow", TEST_SERVER.command, env={"LOCALCHAT_TEST_MCP_DELAY": "2"})
    answered = threading.Event()
    hub = ToolServers((slow,), tmp_path / "logs", on_late=lambda name: answered.set())
    try:
        assert hub.start(timeout_s=0.5) == ["MCP server 'slow' failed: no answer within 0 s"]
        assert hub.tools() == [] and hub.call(ToolCall("ping", {})).is_error
        assert answered.wait(60)
        assert hub.statuses[0].running and hub.server_of("ping") == "slow"
        assert hub.call(ToolCall("ping", {})).text == "pong"
    finally:
        hub.close()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('[[mcp]]\nname = "x"\n', "needs either command"),
        ('[[mcp]]\nname = "x"\ncommand = ["a"]\nurl = "http://h/mcp"\n', "not both"),
        ('[[mcp]]\nname = "a b"\ncommand = ["a"]\n', "a name of letters"),
        ('[[mcp]]\nname = "x"\ncommand = "prog"\n', "command must be a list"),
        ('[[mcp]]\nname = "x"\ncommand = ["a"]\nport = 3\n', "has no port"),
        ('[[mcp]]\nname = "x"\nurl = "localhost"\n', "url must be an address"),
        ('[[mcp]]\nname = "x"\ncommand = ["a"]\ntimeout_s = 0\n', "timeout_s must be"),
        ('[[mcp]]\nname = "x"\ncommand = ["a"]\n[[mcp]]\nname = "x"\ncommand = ["b"]\n', "twice"),
    ],
)
def test_bad_mcp_settings_are_one_line_naming_the_server(
    isolated_home: Path, block: str, message: str
) -> None:
    path = write_settings(isolated_home, block)
    with pytest.raises(UsageError, match=message):
        load_settings(path)


def test_mcp_settings_as_written(isolated_home: Path) -> None:
    path = write_settings(
        isolated_home,
        mcp_settings(
            '[[mcp]]\nname = "web"\nurl = "http://127.0.0.1:9/mcp"\n'
            'headers_env = { Authorization = "WEB_TOKEN" }\n'
        ),
    )
    test, web = load_settings(path).mcp
    assert test.command == (sys.executable, str(SERVER)) and test.url is None
    assert web.url == "http://127.0.0.1:9/mcp" and web.headers_env == {"Authorization": "WEB_TOKEN"}


def test_tools_command_lists_servers_and_tools(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_settings(isolated_home, mcp_settings())
    assert main(["tools"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("test  running")
    assert "  add  Add two numbers." in out
    assert main(["tools", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "running" and "ping" in [t["name"] for t in row["tools"]]


def test_tools_command_says_which_server_failed(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_settings(
        isolated_home, mcp_settings('[[mcp]]\nname = "gone"\ncommand = ["/nonexistent/x"]\n')
    )
    assert main(["tools"]) == 1
    out = capsys.readouterr().out
    assert "gone  failed: its command was not found (/nonexistent/x)" in out
    assert "test  running" in out


def test_no_servers_configured(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tools"]) == 0
    assert "no MCP servers configured: add [[mcp]] entries to" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_server_over_streamable_http(tmp_path: Path) -> None:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(SERVER), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.1)
        web = McpServerConfig("web", url=f"http://127.0.0.1:{port}/mcp")
        hub = ToolServers((web,), tmp_path / "logs")
        try:
            assert hub.start() == []
            assert hub.call(ToolCall("add", {"a": 1, "b": 2})).text == "3.0"
        finally:
            hub.close()
    finally:
        process.terminate()
        process.wait(30)


def test_a_call_the_user_stops_returns_at_once(servers: ToolServers) -> None:
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    result = servers.call(ToolCall("slow", {"seconds": 60}), stop)
    assert result.is_error and "the user stopped the call" in result.text
    assert time.monotonic() - started < 30  # not the tool's minute
    assert servers.call(ToolCall("ping", {})).text == "pong"  # the server goes on
