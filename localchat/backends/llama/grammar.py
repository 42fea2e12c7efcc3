"""Grammars that hold generation to a shape: a tool call in the model's own format, whose
JSON follows the tools' schemas (llama-cpp-python's schema converter, llama.cpp's grammar
sampler) — so even a small model writes a well-formed call when one is required."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp
from llama_cpp.llama_grammar import SchemaConverter, json_schema_to_gbnf

from localchat.backends.llama.runtime import last_error_line
from localchat.chat.tools import ToolSpec, call_frame, call_schema, named_call_frame


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class GrammarError(ValueError):
    """The tools' schemas give no grammar llama.cpp takes (the message says why)."""


def _as_templates_write_json(rules: str) -> str:
    """The converter lets the model put a space (or not) after every token; templates write
    a call back with ``tojson`` (Python's ``json.dumps``: ``", "`` and ``": "``, nothing
    else). Held to that spacing, a call the model writes is the text its template renders
    from the transcript, so the next turn keeps the call's tokens in the cache."""
    rules = rules.replace('":" space', '": "').replace('"," space', '", "')
    # No raw control characters in a string (JSON has none; the template would escape them).
    rules = rules.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')
    return re.sub(r"^space ::= .*$", 'space ::= ""', rules, count=1, flags=re.MULTILINE)


@contextmanager
def _schema_errors(
    what: str = "the tools' parameter schemas",
    remedy: str = "simplify them or use tool_choice auto",
) -> Iterator[None]:
    """The converter's failures as a ``GrammarError`` that says what to do."""
    try:
        yield
    except Exception as exc:  # the converter asserts on what it cannot follow
        raise GrammarError(
            f"{what} cannot be turned into a grammar ({type(exc).__name__}: {exc}); {remedy}"
        ) from None


def format_grammar(schema: dict[str, object]) -> str:
    """GBNF for a reply that is one JSON value following ``schema`` (structured output),
    written compactly; after it, only the end of the reply."""
    with _schema_errors("the response format's JSON schema", "simplify it"):
        rules = json_schema_to_gbnf(json.dumps(schema))
    return _as_templates_write_json(rules)


def tool_call_grammar(family: str, tools: list[ToolSpec], name: str | None = None) -> str:
    """GBNF for one call to one of ``tools`` (or the one ``name``d), framed as ``family``
    writes calls; after it, only the end of the reply."""
    if named_call_frame(family, "") is not None:
        return _named_call_grammar(family, [t for t in tools if name in (None, t.name)])
    with _schema_errors():
        rules = json_schema_to_gbnf(json.dumps(call_schema(family, tools, name)))
    rules = re.sub(r"^root\s*::=", "call ::=", rules, count=1, flags=re.MULTILINE)
    rules = _as_templates_write_json(rules)
    before, after = call_frame(family)
    parts = [_literal(before)] if before else []
    parts.append("call")
    if after:
        parts.append(_literal(after))
    return f"root ::= {' '.join(parts)}\n{rules}"


def _named_call_grammar(family: str, tools: list[ToolSpec]) -> str:
    """One call in a format that writes the tool's name outside its JSON (DeepSeek's): an
    alternative per tool, its name in the frame around its arguments' object."""
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    options = []
    for index, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.parameters)  # the converter rewrites its refs
        with _schema_errors():
            schema = converter.resolve_refs(parameters, f"tool{index}")
            rule = converter.visit(schema, f"tool{index}-arguments")
        before, after = named_call_frame(family, tool.name) or ("", "")
        options.append(f"{_literal(before)} {rule} {_literal(after)}")
    rules = _as_templates_write_json(converter.format_grammar())
    return f"root ::= {' | '.join(options)}\n{rules}"


def checked_grammar(vocab: object, rules: str) -> None:
    """Raise ``GrammarError`` unless llama.cpp parses ``rules``: a grammar it refuses gives
    a NULL sampler, which llama-cpp-python would add to its chain unchecked (a crash)."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, rules.encode(), b"root")
    if not sampler:
        raise GrammarError(f"llama.cpp could not parse the grammar: {last_error_line()}")
    llama_cpp.llama_sampler_free(sampler)
