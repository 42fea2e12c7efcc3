"""Tools through the model's own template: real templates (Qwen3, Llama 3.2, Mistral Nemo,
Phi-4-mini, LFM2) render a tools list, an assistant's calls and the tools' results, and each
family's calls are found again in a reply — the format the template itself writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.chat.template import ChatMessage, ChatTemplate
from localchat.chat.tools import ID_LENGTH, ToolCall, ToolSpec, parse_tool_calls

TOOLS_DIR = Path(__file__).parent / "templates" / "tools"
WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city now.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
FAMILIES = {
    "qwen3": "hermes",
    "llama-3.2": "llama3",
    "mistral-nemo": "mistral",
    "phi-4-mini": "phi4",
    "lfm2": "lfm2",
}
# What each family's model writes when it calls the tool (as their templates teach it).
REPLIES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]',
    "phi4": '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Oslo"}}<|/tool_call|>',
    "lfm2": '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|tool_call_end|>',
    "generic": 'Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((TOOLS_DIR / f"{name}.jinja").read_text(), "<s>", "</s>", name)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_real_template_says_its_family_and_renders_the_tools(name: str) -> None:
    template = _template(name)
    assert template.tool_family == FAMILIES[name]
    question = [ChatMessage("user", "What is the weather in Oslo?")]
    plain = template.render(question)
    with_tools = template.render(question, tools=[WEATHER])
    assert "get_weather" not in plain and "get_weather" in with_tools
    assert "The weather in a city now." in with_tools and '"city"' in with_tools


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_call_the_template_writes_is_parsed_back_and_a_result_renders(name: str) -> None:
    template = _template(name)
    call = ToolCall("get_weather", {"city": "Oslo"})
    assert len(call.id) == ID_LENGTH and call.id.isalnum()
    exchange = [
        ChatMessage("user", "What is the weather in Oslo?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", '{"temperature": 21}', tool_call_id=call.id),
    ]
    text = template.render(exchange, tools=[WEATHER])
    assert '{"temperature": 21}' in text or '\\"temperature\\": 21' in text
    # The call as the template wrote it is what the parser finds in a reply.
    written = template.render(exchange[:2], add_generation_prompt=False)
    after_question = written.split("Oslo?", 1)[1]
    _, calls = parse_tool_calls(after_question, template.tool_family, {"get_weather"})
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_each_familys_reply_gives_its_call(family: str) -> None:
    content, calls = parse_tool_calls(REPLIES[family], family, {"get_weather"})
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert content == ("Let me look." if family == "generic" else "")
    if family == "mistral":
        assert calls[0].id == "a1b2c3d4e"  # the model's own id pairs its result


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> and so on'
    assert parse_tool_calls(broken, "hermes") == (broken, [])
    unknown = '{"name": "rm_rf", "arguments": {}}'
    assert parse_tool_calls(unknown, "generic", {"get_weather"}) == (unknown, [])
    prose = 'Use {braces} and {"name": 1} freely.'
    assert parse_tool_calls(prose, "llama3") == (prose, [])
    several = REPLIES["hermes"] + "\n" + REPLIES["hermes"].replace("Oslo", "Rome")
    _, calls = parse_tool_calls(several, "hermes")
    assert [c.arguments["city"] for c in calls] == ["Oslo", "Rome"]
    as_string = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
    assert parse_tool_calls(as_string, "generic")[1][0].arguments == {"city": "Oslo"}


def test_a_template_without_tools_gets_them_described_in_the_system_prompt() -> None:
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    template = ChatTemplate(chatml, name="chatml")
    assert template.tool_family == "generic"
    text = template.render([ChatMessage("user", "Weather in Oslo?")], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou can call these functions.")
    assert '"name": "get_weather"' in text and "Weather in Oslo?" in text
    with_system = template.render(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")], tools=[WEATHER]
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call")
