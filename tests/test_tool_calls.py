"""Tools through the model's own template: real templates (Qwen3, Llama 3.2, Mistral Nemo,
Phi-4-mini, LFM2, DeepSeek-R1-Distill) render a tools list, an assistant's calls and the tools' results, and each
family's calls are found again in a reply — the format the template itself writes."""

from __future__ import annotations

import re
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
    "deepseek-r1-distill-qwen": "deepseek",
}
# What each family's model writes when it calls the tool (as their templates teach it).
REPLIES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]',
    "phi4": '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Oslo"}}<|/tool_call|>',
    "lfm2": '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|tool_call_end|>',
    "deepseek": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
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
    # (DeepSeek's cue opens a reasoning block its template leaves out of calls.)
    cue = template.render(exchange[:1]).removesuffix("<think>\n")
    written = template.render(exchange[:2], add_generation_prompt=False)
    assert written.startswith(cue)
    reply = written[len(cue) :]
    _, calls = parse_tool_calls(reply, template.tool_family, {"get_weather"})
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


def test_json_that_is_no_call_is_left_whole() -> None:
    definition = '{"name": "get_weather", "description": "x", "parameters": {"type": "object"}}'
    assert parse_tool_calls(definition, "generic", {"get_weather"}) == (definition, [])
    bare_name = 'Try {"name": "get_weather"} later.'
    assert parse_tool_calls(bare_name, "generic") == (bare_name, [])
    nested = '{"steps": [{"name": "get_weather", "arguments": {"city": "Oslo"}}], "retry": 2}'
    assert parse_tool_calls(nested, "generic") == (nested, [])
    listed = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    content, calls = parse_tool_calls(listed, "generic")
    assert content == "" and [c.arguments["city"] for c in calls] == ["Oslo", "Rome"]
    # Llama 3's call is the whole reply: JSON later in a text reply is text.
    prose = 'Here is JSON: {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse_tool_calls(prose, "llama3") == (prose, [])
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse_tool_calls(tagged, "llama3")[1][0].arguments == {"city": "Oslo"}


def test_lfm2s_own_python_calls_are_read_too() -> None:
    reply = '<|tool_call_start|>[get_weather(city="Oslo"), get_weather(city="Rome")]<|tool_call_end|>Done.'
    content, calls = parse_tool_calls(reply, "lfm2", {"get_weather"})
    assert content == "Done." and [c.arguments for c in calls] == [
        {"city": "Oslo"},
        {"city": "Rome"},
    ]
    assert parse_tool_calls("<|tool_call_start|>[os.system('x')]<|tool_call_end|>", "lfm2")[1] == []


def test_a_clients_call_ids_reach_mistral_as_nine_characters() -> None:
    template = _template("mistral-nemo")
    call = ToolCall("get_weather", {"city": "Oslo"}, "call_0123456789abcdef")
    text = template.render(
        [
            ChatMessage("user", "Weather?"),
            ChatMessage("assistant", "", tool_calls=(call,)),
            ChatMessage("tool", "21 C", tool_call_id=call.id),
        ],
        tools=[WEATHER],
    )
    ids = re.findall(r'"(?:id|call_id)": "(\w+)"', text)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == ID_LENGTH


def test_a_template_without_tools_or_a_system_role_takes_a_whole_exchange() -> None:
    template = ChatTemplate((TOOLS_DIR.parent / "no_system.jinja").read_text(), "<s>", "</s>")
    assert template.tool_family == "generic" and not template.caps.supports_system_role
    call = ToolCall("get_weather", {"city": "Oslo"})
    text = template.render(
        [
            ChatMessage("user", "Weather in Oslo and Rome?"),
            ChatMessage("assistant", "", tool_calls=(call,)),
            ChatMessage("tool", "21 C", tool_call_id=call.id),
            ChatMessage("tool", "25 C", tool_call_id="other"),
        ],
        tools=[WEATHER],
    )
    assert "You can call these functions." in text and '"get_weather"' in text
    assert "21 C" in text and "25 C" in text


def test_a_grammar_takes_definitions_and_refuses_what_it_cannot_follow() -> None:
    from localchat.backends.llama.grammar import GrammarError, tool_call_grammar

    pydantic_style = ToolSpec("book", "Book a trip.", {
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"]})  # fmt: skip
    grammar = tool_call_grammar("hermes", [WEATHER, pydantic_style])
    assert grammar.startswith('root ::= "<tool_call>\\n" call "\\n</tool_call>"')
    assert '"\\"book\\""' in grammar and '"\\"get_weather\\""' in grammar
    broken = ToolSpec("odd", "", {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})
    with pytest.raises(GrammarError, match="cannot be turned into a grammar"):
        tool_call_grammar("hermes", [broken])
    # DeepSeek's name stands outside the JSON: one alternative per tool, each its own
    # arguments' rules (a $ref resolved within its tool), or the one named.
    deepseek = tool_call_grammar("deepseek", [WEATHER, pydantic_style])
    root = deepseek.splitlines()[0]
    assert root.count(" | ") == 1 and "tool0-arguments" in root and "tool1-arguments" in root
    assert 'get_weather\\n```json\\n" tool0-arguments "\\n```<｜tool▁call▁end｜>' in root
    named = tool_call_grammar("deepseek", [WEATHER, pydantic_style], "book").splitlines()[0]
    assert " | " not in named and "<｜tool▁sep｜>book" in named
    with pytest.raises(GrammarError, match="cannot be turned into a grammar"):
        tool_call_grammar("deepseek", [broken])


def test_deepseeks_template_gets_the_tools_described_with_its_own_call_format() -> None:
    template = _template("deepseek-r1-distill-qwen")
    # It adds a call's arguments to strings: they go in as JSON text.
    assert template.caps.arguments_as_text
    text = template.render([ChatMessage("user", "Weather?")], tools=[WEATHER])
    assert text.startswith("<s>You can call these functions. To call one, reply with")
    assert "<｜tool▁sep｜><function name>\n```json\n<an object of its arguments>" in text
    # Several calls in one block, and a block the model never closed.
    two = REPLIES["deepseek"].replace(
        "<｜tool▁calls▁end｜>",
        "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Rome"}\n```<｜tool▁call▁end｜>',
    )
    _, calls = parse_tool_calls(two, "deepseek", {"get_weather"})
    assert [c.arguments["city"] for c in calls] == ["Oslo", "Rome"]
    # A call with broken JSON, or of an unknown tool, leaves the whole block as text.
    broken = REPLIES["deepseek"].replace('{"city": "Oslo"}', '{"city": ')
    assert parse_tool_calls(broken, "deepseek", {"get_weather"}) == (broken, [])
    assert parse_tool_calls(REPLIES["deepseek"], "deepseek", {"other"})[1] == []
