"""A chat template is code from whoever published the model file: the sandbox keeps it off the
machine, these bounds keep it from running for hours or filling memory (issue 27, item 5).

Each hostile template here is refused with one line that suggests ``--template``: while it is
probed at load (a probe past its bounds is not read as "unsupported"), when a turn renders it,
and through the CLI. Ordinary templates render exactly as plain Jinja renders them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.formats import BUILTIN
from localchat.chat.template import ChatMessage, ChatTemplate, TemplateRunaway
from localchat.errors import ModelFileError

TEMPLATES = Path(__file__).parent / "templates"
DAY = datetime(2025, 3, 4, 12, 0)

NESTED_LOOPS = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
# Runs away only on a message that says "boom": it loads (the probes never say it).
ON_BOOM = (
    "{% for m in messages %}{% if 'boom' in m.content %}"
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _refused(source: str, match: str = "") -> TemplateRunaway:
    """The template is refused (at load or at its first render) with one line."""
    with pytest.raises(TemplateRunaway, match=match) as caught:
        ChatTemplate(source).render([ChatMessage("user", "hi")])
    message = str(caught.value)
    assert "\n" not in message and "--template" in message and "chatml" in message
    assert isinstance(caught.value, ModelFileError)
    return caught.value


def test_nested_loops_fail_the_load_probe_instead_of_hanging() -> None:
    started = time.monotonic()
    with pytest.raises(ModelFileError, match=r"ran past 1 s") as caught:
        ChatTemplate(NESTED_LOOPS)  # the probes render it while it loads
    assert time.monotonic() - started < 30  # hours unbounded; about a second bounded
    message = str(caught.value)
    assert "\n" not in message and "the model's own" in message
    assert "hostile or broken" in message and "--template chatml" in message


def test_the_render_thread_returns_and_the_process_stays_responsive() -> None:
    before = threading.active_count()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            ChatTemplate(NESTED_LOOPS)
        except ModelFileError as exc:
            errors.append(exc)

    worker = threading.Thread(target=load)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], TemplateRunaway)
    assert threading.active_count() == before
    chatml = ChatTemplate(BUILTIN["chatml"].source)
    assert chatml.render([ChatMessage("user", "hi")]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**9 }}",
        "{{ 'x' * 1000000000 }}",  # a literal: not computed while it compiles either
        "{{ 'x'.center(10**9) }}",
        "{{ 'x'|center(1000000000) }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '%999999999d'|format(1) }}",
        "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}",
        "{% set s = 'x' * 1000000 %}{{ s.join(['a'] * 1000) }}",
        "{% set s = 'x' * 1000000 %}{{ [s] * 1000 }}",  # short to list, long to print
        "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|tojson }}",
        "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}",
        "{{ [1]|batch(1000000000, 'x')|list|length }}",
        "{{ ('a\n' * 100000)|indent(100000) }}",
        "{{ range(10**7)|list|length }}",
        "{{ range(10**20)|length }}",
    ],
)
def test_one_huge_value_is_refused_before_it_is_made(source: str) -> None:
    _refused(source, "million characters")


@pytest.mark.parametrize("op", ["~", "+"])
def test_text_grown_in_a_loop_is_refused(op: str) -> None:
    source = (
        "{% set ns = namespace(s='ab') %}"
        f"{{% for i in range(100) %}}{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}"
        "{{ ns.s|length }}"
    )
    _refused(source, "4.0 million characters")


def test_a_list_grown_in_a_loop_is_refused() -> None:
    source = (
        "{% set ns = namespace(items=[]) %}"
        "{% for i in range(400000) %}{% set ns.items = ns.items + [i] %}{% endfor %}"
    )
    _refused(source, "million characters")


def test_many_large_values_are_refused_in_all() -> None:
    source = (
        "{% set ns = namespace(kept=[]) %}"
        "{% for i in range(10000) %}{% set ns.kept = ns.kept + ['x' * 3000000] %}{% endfor %}"
    )
    _refused(source, "64.0 million characters in all")


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(10**6) %}xxxxxxxxxx{% endfor %}",  # the range itself is too long
        "{% for i in range(400000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}",  # streamed output
        "{% for i in range(2000) %}{% for j in range(2000) %}xx{% endfor %}{% endfor %}",
        "{% set b %}{% for i in range(400000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}{% endset %}",
        "{% macro m() %}{% for i in range(400000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}"
        "{% endmacro %}{{ m()|length }}",
    ],
)
def test_giant_output_is_refused_on_size(source: str) -> None:
    _refused(source, "4.0 million characters")


def test_numbers_and_recursion_are_bounded() -> None:
    _refused("{{ 10 ** 1000000000 }}", "bits")
    squaring = "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    _refused(squaring + "{% endfor %}", "bits")
    _refused("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed without end")
    fan_out = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    _refused(fan_out + "{{ f(60) }}", "ran past 1 s")


def test_a_render_that_runs_away_fails_and_later_ones_fail_at_once() -> None:
    template = ChatTemplate(ON_BOOM, name="the model's own", model="m.gguf")
    assert template.render([ChatMessage("user", "hi")]).startswith("<|im_start|>user\nhi")
    with pytest.raises(TemplateRunaway) as caught:
        template.render([ChatMessage("user", "boom")])
    assert str(caught.value).startswith('m.gguf: the chat template "the model\'s own" ran past')
    started = time.monotonic()
    with pytest.raises(TemplateRunaway, match="ran past 1 s"):
        template.render([ChatMessage("user", "hi")])  # hostile once: refused from then on
    assert time.monotonic() - started < 0.5


# -- one call that runs for minutes, many values that fill memory, a pause (review 2) -------------


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ ('x' * 1900000)|wordwrap(1) }}", "asked wordwrap for more than 65,536 characters"),
        ("{{ ('.' * 30000 + 'a.')|urlize }}", "asked urlize"),  # one word: quadratic
        ("{{ ('.' * 3000 + 'a.')|urlize }}", "asked urlize"),  # short, but 3,000² steps
        ("{{ range(500000)|sort(attribute='real')|length }}", "asked sort for more than 16,384"),
        ("{{ range(500000)|groupby('real')|length }}", "asked groupby"),
        ("{{ {}.fromkeys(range(100000))|dictsort|length }}", "asked dictsort"),
        ("{{ ('a' * 1000000).rfind('ab' + 'a' * 500000) }}", "asked rfind for more than"),
        ("{{ ('a' * 1000000).rsplit(sep='ab' + 'a' * 500000) }}", "asked rsplit"),
        ("{{ ('x' * 2000000).strip('y' * 2000000 + 'x') }}", "asked strip"),
        ("{{ ('x' * 2000000)|trim(chars='y' * 2000000 + 'x') }}", "asked trim"),
        ("{{ ('\u00e9' * 20000).encode('punycode') }}", "asked encode for more than 1,024"),
        ("{{ ('\u00e9' * 20000).encode('IDNA') }}", "asked encode"),
        (
            "{% set ns = namespace(x=[]) %}{% for i in range(300) %}"
            "{% set ns.x = [ns.x, 'abcdefgh' * 20] %}{% endfor %}{{ ns.x|pprint }}",
            "asked pprint",  # each level printed again at each level above it
        ),
    ],
)
def test_a_call_slower_than_linear_is_refused_before_it_runs(source: str, match: str) -> None:
    """The clock is not read inside one call: wordwrap(1) on 1.9 M characters took 119 s."""
    _refused(source, match)


def test_a_filter_reading_many_items_checks_the_clock_at_each() -> None:
    """A long chat allows long values: one ``select`` over millions of items is a long call."""
    source = (
        "{% if messages[0].content|length > 1000 %}"
        "{{ range(4400000)|select('none')|first }}{% endif %}"
    )
    template = ChatTemplate(source)  # short probes: it loads
    with pytest.raises(TemplateRunaway, match="ran past 1 s of CPU time"):
        template.render([ChatMessage("user", "x" * 8_000_000)])


@pytest.mark.parametrize(
    "source",
    [
        "{{ range(3000)|map('center', 60000)|list|length }}",  # 180 MB in 0.1 s before
        "{% set ns = namespace(x=[]) %}{% for i in range(3000) %}"
        "{% set ns.x = [ns.x, 'y' * 60000] %}{% endfor %}",
        "{% set s = 'y' * 60000 %}{% set ns = namespace(x=[]) %}{% for i in range(3000) %}"
        "{% set ns.x = [ns.x, s[i:]] %}{% endfor %}",
        "{% set s = 'y' * 60000 %}{% set ns = namespace(x=[]) %}{% for i in range(3000) %}"
        "{% set ns.x = [ns.x, s|upper] %}{% endfor %}",
        "{% set s = 'y' * 60000 %}{% set ns = namespace(x=[]) %}{% for i in range(3000) %}"
        "{% set ns.x = [ns.x, s ~ i] %}{% endfor %}",
        "{% set s = 'y' * 60000 %}{% set ns = namespace(x=[]) %}{% for i in range(3000) %}"
        "{% set ns.x = [ns.x, s.replace('y', 'z')] %}{% endfor %}",
        "{% set s = 'y' * 1000000 %}{{ ([s] * 3000)|length }}",  # a list weighs what it holds
    ],
)
def test_many_values_below_64_ki_are_counted_in_all(source: str) -> None:
    _refused(source, "64.0 million characters in all")


@pytest.mark.parametrize(
    "use",
    ["{{ 'x' ~ ns.x }}", "{{ ns.x|upper }}", "{{ ns.x|trim }}", "{{ raise_exception(ns.x) }}"],
)
def test_a_value_shared_many_times_over_is_sized_before_it_is_spelled_out(use: str) -> None:
    doubled = (
        "{% set ns = namespace(x=['x' * 1000]) %}"
        "{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
    )  # 2**40 copies of one text, in a few KB
    _refused(doubled + use, "million characters")


def test_numbers_from_text_and_bytes_from_numbers_are_bounded() -> None:
    _refused("{{ ('f' * 1000000)|int(base=16) % 7 }}", "bits")
    _refused("{{ (1).to_bytes(1500000000, 'big')|length }}", "million characters")
    _refused("{{ strftime_now('%Y' * 100000) }}", "million characters")


class _Suspended(datetime):
    """A clock whose ``strftime`` finds the machine suspended for a while (no CPU spent)."""

    def strftime(self, fmt: str) -> str:
        time.sleep(1.3)
        return super().strftime(fmt)


def test_a_pause_during_a_render_is_not_a_runaway() -> None:
    """Time is the render thread's CPU time: a laptop asleep mid-render costs none of it."""
    source = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    template = ChatTemplate(source)
    paused = _Suspended(2025, 3, 4, 12, 0)
    assert template.render([ChatMessage("user", "hi")], now=paused) == "2025hi"
    assert template.render([ChatMessage("user", "hi")], now=DAY) == "2025hi"  # not sticky


def test_a_literal_python_cannot_spell_out_does_not_compile() -> None:
    with pytest.raises(ModelFileError, match="does not compile") as caught:
        ChatTemplate("{{ 0x" + "f" * 5000 + " }}")
    assert not isinstance(caught.value, TemplateRunaway) and "\n" not in str(caught.value)


# -- ordinary templates: exactly what plain Jinja renders, as before ---------------------------

CONSTRUCTS = """\
{%- macro line(m) -%}{{ m.role|upper ~ ': ' ~ m.content|trim }}{%- endmacro -%}
{%- set ns = namespace(n=0, text='') -%}
{%- for m in messages if m.role != 'system' -%}
{%- set ns.n = ns.n + 1 -%}{%- set ns.text = ns.text + m.content[:3] -%}
{{ line(m) }}{% if loop.last %} (last of {{ loop.length }}){% endif %}
{% endfor -%}
{{ ns.n }} {{ ns.text }} {{ messages|map(attribute='role')|join(',') }}
{{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages[0] }}
{{ {'a': [1, 2], 'b': 'ü'}|tojson(indent=2) }} {{ '%s-%05d'|format('x', 42) }}
{{ '{:>6}|{}'.format('ab', 3) }} {{ 'ab' * 3 }} {{ [1, 2] * 2 }} {{ 2 ** 10 }} {{ '%d%%' % 50 }}
{{ 'a-b-c'.replace('-', '+') }} {{ 'x'.center(7, '*') }} {{ 'a\nb'|indent(2, first=true) }}
{{ range(5)|list }} {{ range(3)|sum }} {{ [[1], [2]]|sum(start=[]) }} {{ 'a b'|wordwrap(1) }}
{{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2, 3]|slice(2)|list }} {{ ['b', 'a']|sort|join }}
{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}\
{% endif %}{% endfor %}
{% set captured %}{% for i in range(3) %}{{ i }}{% if i == 1 %}{% break %}{% endif %}\
{% endfor %}{% endset %}{{ captured ~ '!' }} {{ strftime_now('%Y-%m-%d') }} {{ none }}
{%- if add_generation_prompt %}<assistant>{% endif -%}
"""


def _plain_jinja(source: str, messages: list[ChatMessage], generation: bool) -> str:
    """What the template rendered before it was bounded: Jinja's immutable sandbox as is."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    context: dict[str, Any] = {
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "add_generation_prompt": generation,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "strftime_now": DAY.strftime,
    }
    return env.from_string(source).render(**context)


def _sources() -> dict[str, str]:
    sources = {path.name: path.read_text() for path in sorted(TEMPLATES.glob("*.jinja"))}
    sources.update({name: chat_format.source for name, chat_format in BUILTIN.items()})
    sources["constructs"] = CONSTRUCTS
    return sources


@pytest.mark.parametrize("name", sorted(_sources()))
def test_ordinary_templates_render_exactly_as_plain_jinja(name: str) -> None:
    source = _sources()[name]
    template = ChatTemplate(source, "<s>", "</s>", name)
    for n in (1, 2, 5, 40):
        messages = [ChatMessage("user" if i % 2 == 0 else "assistant", f"m{i} ü") for i in range(n)]
        for generation in (True, False):
            adapted = template.adapt(messages)
            assert template.render(messages, generation, DAY) == _plain_jinja(
                source, adapted, generation
            )


def test_a_long_conversation_is_not_mistaken_for_a_runaway() -> None:
    """The size bound grows with the messages: an 8 MiB attachment renders."""
    template = ChatTemplate(BUILTIN["llama3"].source, "<s>", "</s>", "llama3")
    attachment = "line of an attached file\n" * (8 * 1024 * 1024 // 25)
    text = template.render([ChatMessage("user", attachment), ChatMessage("assistant", "ok")] * 2)
    assert text.count(attachment.strip()) == 2


# -- on a model file -----------------------------------------------------------------------------


def _with_template(source: Path, dest: Path, template: str) -> Path:
    """A copy of ``source`` whose ``tokenizer.chat_template`` is ``template`` (gguf's copier,
    as tests/gguf_edit.py uses it)."""
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    writer = gguf.GGUFWriter(dest, arch=arch.contents(), endianess=reader.endianess)
    new = {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template)}
    copy_with_new_metadata(reader, writer, new, [])
    return dest


def test_loading_a_model_whose_template_runs_away_fails_naming_the_file(
    tmp_path: Path, tiny_model: Path
) -> None:
    hostile = _with_template(tiny_model, tmp_path / "hostile.gguf", NESTED_LOOPS)
    with pytest.raises(ModelFileError) as caught:
        Engine(hostile, LoadOptions(n_ctx=512))
    assert isinstance(caught.value, TemplateRunaway)
    message = str(caught.value)
    assert message.startswith(f'{hostile}: the chat template "the model\'s own" ran past 1 s')
    assert "\n" not in message and "--template" in message
    # The bound names its way out: the same file loads with a template chosen.
    engine = Engine(hostile, LoadOptions(n_ctx=512, template="chatml"))
    assert engine.template.render([ChatMessage("user", "hi")]).startswith("<|im_start|>user")
    engine.close()


def test_a_turn_whose_render_runs_away_fails_with_one_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    trigger = _with_template(tiny_model, tmp_path / "trigger.gguf", ON_BOOM)
    engine = Engine(trigger, LoadOptions(n_ctx=512))
    with pytest.raises(TemplateRunaway) as caught:
        engine.template.render([ChatMessage("user", "boom")])
    assert str(caught.value).startswith(f"{trigger}: the chat template")
    engine.close()
    result = _run_cli("ask", "boom", "--model-path", str(trigger), "--max-tokens", "2")
    _assert_one_line_error(result, str(trigger), "ran past 1 s")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "localchat.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _assert_one_line_error(
    result: subprocess.CompletedProcess[str], path: str, expected: str
) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("localchat: error: ") and path in lines[0]
    assert expected in lines[0] and "--template" in lines[0]
    assert "Traceback" not in result.stderr


def test_the_cli_refuses_a_hostile_model_with_one_line(tmp_path: Path, tiny_model: Path) -> None:
    hostile = _with_template(tiny_model, tmp_path / "hostile.gguf", NESTED_LOOPS)
    started = time.monotonic()
    result = _run_cli("ask", "hi", "--model-path", str(hostile))
    assert time.monotonic() - started < 60
    _assert_one_line_error(result, str(hostile), "ran past 1 s")
