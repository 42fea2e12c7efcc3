"""Jinja's immutable sandbox with bounds: a chat template is code from whoever published the
file. The sandbox stops it touching the machine, not running for hours or filling memory, so
every render is bounded: ``RENDER_SECONDS``, ``RENDER_CHARS`` characters (more for long
chats), whichever comes first. A thread cannot be stopped from outside, so the bound is
cooperative: each loop step, call and filter checks the clock, and whatever can make far more
than it is given (``*``, ``+``, ``~``, ``%``, ``**``, ``range``, padding, joining, formatting,
printing a nested value, a captured block, the output) checks what it would make first.
"""

from __future__ import annotations

import functools
import json
import re
import string
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from itertools import islice, repeat
from time import monotonic
from types import BuiltinMethodType, FunctionType
from typing import Any, cast

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 1.0  # how long one render may run (40 messages take well under 1 ms)
RENDER_CHARS = 4_000_000  # characters in any one value a render makes, and in its output
CHARS_PER_MESSAGE_CHAR = 4  # and more per character of the messages: long chats are long
MADE_IN_ALL_FACTOR = 16  # times as much a render may make in all (values of 64 Ki or more)
INT_BITS = 65_536  # bits in any number a template computes

_LARGE = 65_536
_LATE = f"ran past {RENDER_SECONDS:g} s"


# -- bounds ---------------------------------------------------------------------------------


class RanAway(Exception):
    """Raised inside the sandbox past a bound (no template construct can catch it)."""


class _Budget:
    """One render's bounds (current on this thread while it runs): when it must end, the
    largest value, and what it may still make in all (many large values fill memory too)."""

    __slots__ = ("deadline", "left", "limit", "outer")

    def __init__(self, limit: int) -> None:
        self.deadline = monotonic() + RENDER_SECONDS
        self.limit = limit
        self.left = MADE_IN_ALL_FACTOR * limit
        self.outer: _Budget | None = None

    def __enter__(self) -> _Budget:
        self.outer, _BOUNDS.budget = _BOUNDS.budget, self
        return self

    def __exit__(self, *_: object) -> None:
        _BOUNDS.budget = self.outer


class _Bounds(threading.local):
    budget: _Budget | None = None


_BOUNDS = _Bounds()


def _budget() -> _Budget:
    return _BOUNDS.budget or _Budget(RENDER_CHARS)


def _too_big(limit: int, what: str = "") -> RanAway:
    return RanAway(f"made more than {limit / 1e6:.1f} million characters{what}")


def _check_bound(estimate: int, limit: int) -> None:
    if estimate > limit:
        raise _too_big(limit)


def _check_bits(bits: int) -> None:
    if bits > INT_BITS:
        raise RanAway(f"made a number of more than {INT_BITS:,} bits")


def _size(value: Any) -> int:
    """A value's cost in characters: an item of a list costs 8, of a set or dict 16."""
    if isinstance(value, (list, tuple)):
        return 8 * len(value)
    if isinstance(value, (dict, set, frozenset)):
        return 16 * len(value)
    return len(value) if isinstance(value, (str, bytes)) else 0


def _check_size(value: Any, budget: _Budget) -> None:
    """Refuse a value the sandbox made past the bounds; a large one counts toward all made."""
    if type(value) is int:
        _check_bits(value.bit_length())
    elif (size := _size(value)) > _LARGE:
        _check_bound(size, budget.limit)
        budget.left -= size
        if budget.left < 0:
            raise _too_big(MADE_IN_ALL_FACTOR * budget.limit, " in all")


def _weight(value: Any, limit: int, indent: int = 0) -> int:
    """About how many characters ``value`` spells out as (``str``, ``repr``, JSON indented by
    ``indent``), counted until past ``limit``: a short list may hold one long text many times
    over, or nest deeply. Past ``limit // 16`` parts it is too big (no template prints that)."""
    total, parts = 0, limit // 16
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and total <= limit:
        parts -= 1
        if parts < 0:
            return limit + 1
        item, depth = stack.pop()
        total += 2 + indent * depth
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            total += 4 * len(item)
            if total <= limit:
                stack.extend(zip(item, repeat(depth + 1)))
                if isinstance(item, dict):
                    stack.extend(zip(item.values(), repeat(depth + 1)))
        elif isinstance(item, range):
            total += 8 * len(item)  # within bounds: only _range makes one
        elif isinstance(item, Namespace):
            stack.append((object.__getattribute__(item, "_Namespace__attrs"), depth))
        elif type(item) is int:
            total += item.bit_length() // 3
    return total


def _estimate(bound: Callable[..., int], args: Iterable[Any], kwargs: dict[str, Any]) -> int:
    """At most what a call that can make far more than it is given makes, by ``bound`` (which
    takes the call's arguments, a str method's string first); 0 where they do not fit."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
    try:
        return bound(*args, **kwargs)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return 0


def _padded(s: Any, width: Any, *_: Any, **__: Any) -> int:  # center, ljust, zfill, batch
    return max(len(s), width) if type(width) is int else 0


def _replaced(s: Any, old: Any, new: Any, count: int | None = -1) -> int:
    hits = len(s) + 1 if not old else s.count(old)
    hits = min(hits, count) if count is not None and count >= 0 else hits
    return len(s) + hits * max(0, len(new) - len(old))


def _joined(sep: Any, items: Any) -> int:
    return len(sep) * max(0, len(items) - 1) + _weight(items, _budget().limit)


def _largest(values: Iterable[Any]) -> int:
    return max((_weight(value, _budget().limit) for value in values), default=0)


def _formatted(fmt: str, *args: Any, **kwargs: Any) -> int:
    """``str.format``: each field at most its largest value, or its widest width."""
    fields, widest = 0, 0
    numbers = [a for a in (*args, *kwargs.values()) if type(a) is int]
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            fields += 1
            widths = [int(n) for n in re.findall(r"\d+", spec or "")]
            widest = max(widest, *widths, *(numbers if "{" in (spec or "") else ()))
    return len(fmt) + fields * (_largest((*args, *kwargs.values())) + widest)


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf(fmt: Any, values: Any) -> int:
    """``fmt % values``: each conversion at most its largest value, or its widest width."""
    if not isinstance(fmt, str):
        return 0
    specs = _PRINTF.findall(fmt)
    given = values if isinstance(values, tuple) else (values,)  # a mapping counts whole
    widths = [int(n) for spec in specs for n in spec if n.isdigit()]
    if any("*" in spec for spec in specs):
        widths += [v for v in given if type(v) is int]
    return len(fmt) + len(specs) * (_largest(given) + max(widths, default=0))


def _step(width: Any) -> int:
    return width if type(width) is int else len(width) if isinstance(width, str) else 0


def _summed(iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    """Lists summed are copied once per item: bounded by their count times their size."""
    if isinstance(start, (int, float)):
        return 0
    limit = _budget().limit
    return max(1, len(iterable)) * _weight(iterable, limit) + _weight(start, limit)


_METHOD_BOUNDS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(0, tabsize),
    "replace": _replaced,
    "join": _joined,
    "format": _formatted,
    "format_map": lambda fmt, mapping: _formatted(fmt, mapping),
    "translate": lambda s, table: len(s) * max([1, *map(_size, table.values())]),
}
_FILTER_BOUNDS: dict[str, Callable[..., int]] = {
    "center": _padded,
    "indent": lambda s, width=4, *_: len(s) + (s.count("\n") + 1) * _step(width),
    "wordwrap": lambda s, width=79, w=True, wrapstring=None, *_: len(s) * (2 + _step(wrapstring)),
    "batch": lambda value, linecount, fill_with=None: _padded("", linecount),
    "slice": lambda value, slices, fill_with=None: _padded("", slices),
    "format": lambda value, *args, **kwargs: _printf(value, kwargs or args),
    "replace": _replaced,
    "join": lambda value, d="", attribute=None: _joined(d if isinstance(d, str) else "", value),
    "tojson": lambda value, indent=None, *_, **__: _weight(value, _budget().limit, _step(indent)),
    "string": lambda value: _weight(value, _budget().limit),
    "pprint": lambda value: _weight(value, _budget().limit, 1),
    "sum": _summed,
}
# Filters that make about what they are given, in one pass (the others are watched).
_LINEAR_FILTERS = frozenset(
    "abs attr capitalize count d default first float int items last length lower max min"
    " random reverse round safe striptags title trim truncate upper wordcount".split()
)
_READ_WHOLE = frozenset({"join", "sum"})  # an iterator given is read into a list, then sized


# -- the hooks ------------------------------------------------------------------------------


class _Steps:
    """A ``{% for %}``'s items; each step checks the render's clock."""

    __slots__ = ("_deadline", "_items")

    def __init__(self, items: Any) -> None:
        self._items = items
        self._deadline = _budget().deadline

    def __len__(self) -> int:
        return len(self._items)  # an iterator's TypeError: Jinja's loop counts as it goes

    def __iter__(self) -> Iterator[Any]:
        deadline = self._deadline
        for item in self._items:
            if monotonic() > deadline:
                raise RanAway(_LATE)
            yield item


def _bounded_text(text: str) -> str:
    """What a ``~`` concatenation made, sized."""
    if len(text) > _LARGE:
        _check_size(text, _budget())
    return text


def _finalize(value: Any) -> Any:
    """What ``{{ … }}`` prints, as is; a value that is not text is sized before Jinja spells
    it out (a list may hold one long text many times over)."""
    if type(value) is not str:
        limit = _budget().limit
        _check_bound(_weight(value, limit), limit)
    return value


def _range(*args: int) -> range:
    """Jinja's ``range`` up to the render's size bound, not 100,000 items: a loop over it is
    bounded by the clock, a list or a sum of it by its length."""
    items = range(*args)
    length = (items.stop - items.start) // items.step  # len() fails past sys.maxsize
    _check_bound(8 * length, _budget().limit)
    return items


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` checking the clock, what it would make, and what it made."""
    bound = _FILTER_BOUNDS.get(name)
    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # context, environment
    read_whole = name in _READ_WHOLE

    @functools.wraps(func)  # keeps jinja_pass_arg: Jinja still passes what func takes
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if monotonic() > budget.deadline:
            raise RanAway(_LATE)
        if read_whole and len(args) > skip and isinstance(args[skip], Iterator):
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
        if bound is not None:
            _check_bound(_estimate(bound, args[skip:], kwargs), budget.limit)
        result = func(*args, **kwargs)
        if type(result) is not str or len(result) > _LARGE:
            _check_size(result, budget)
        return result

    return bounded


class _Guard(NodeTransformer):
    """Bounds what the sandbox has no hook for: each ``{% for %}`` iterates ``_steps`` of its
    items, and each ``~`` passes ``_text``."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_steps", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "_text", [], [], None, None, lineno=node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox whose hooks check the running render's bounds."""

    # Intercepted operators are not folded at compile time either ('x' * 10**9 included).
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":  # the common case, kept quick: building short texts
            result = left + right
            if type(result) is not str or len(result) > _LARGE:
                _check_size(result, _budget())
            return result
        budget = _budget()
        ints = type(left) is int and type(right) is int
        if operator == "*" and ints:
            _check_bits(left.bit_length() + right.bit_length())
        elif operator == "*" and isinstance(left, int) != isinstance(right, int):
            items, times = (left, right) if isinstance(right, int) else (right, left)
            _check_bound(_size(items) * times, budget.limit)
        elif operator == "**" and ints and abs(left) > 1:
            _check_bits(left.bit_length() * max(0, right))
        elif operator == "%":
            _check_bound(_printf(left, right), budget.limit)
        result = self.binop_table[operator](left, right)
        _check_size(result, budget)
        return result

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if monotonic() > budget.deadline:
            raise RanAway(_LATE)
        # A str method (str.format comes wrapped by the sandbox) that can make far more.
        method: Any = getattr(obj, "__wrapped__", None) if type(obj) is FunctionType else obj
        owner = method.__self__ if type(method) is BuiltinMethodType else None
        if isinstance(owner, (str, bytes)) and (bound := _METHOD_BOUNDS.get(method.__name__)):
            if method.__name__ == "join" and args and isinstance(args[0], Iterator):
                args = (list(args[0]), *args[1:])  # str.join reads it whole anyway
            _check_bound(_estimate(bound, (owner, *args), kwargs), budget.limit)
        result = super().call(context, obj, *args, **kwargs)
        if type(result) is not str or len(result) > _LARGE:
            _check_size(result, budget)
        return result

    def concat(self, parts: Iterable[str]) -> str:
        """A captured block's text (``{% set %}``, a macro's, ``{% filter %}``), sized first."""
        items = parts if isinstance(parts, list) else list(parts)
        budget = _budget()
        _check_bound(sum(map(len, items)), budget.limit)
        text = "".join(items)
        _check_size(text, budget)
        return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """transformers' ``tojson``: plain JSON, no HTML escaping, non-ASCII kept as is."""
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )


def compile_bounded(source: str) -> Template:
    """``source`` compiled with its loops and ``~`` bounded (constants fold within bounds)."""
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_finalize
    )
    env.filters["tojson"] = _tojson
    for name, func in list(env.filters.items()):
        if name not in _LINEAR_FILTERS:
            env.filters[name] = _bounded_filter(name, func)
    env.filters["_steps"] = _Steps
    env.filters["_text"] = _bounded_text
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _range
    del env.globals["lipsum"]  # thousands of paragraphs in one call; minja has none
    with _Budget(RENDER_CHARS):
        tree = _Guard().visit(env.parse(source))
        tree.set_environment(env)
        return env.from_string(tree)


def render_bounded(template: Template, context: dict[str, Any], limit: int) -> str:
    """The template's output, streamed and counted a batch of pieces at a time (a batch holds
    references, not copies): it stops past ``limit`` characters."""
    chunks: list[str] = []
    size = 0
    with _Budget(limit):
        stream = cast(Generator[str, None, None], template.generate(**context))
        try:
            while batch := list(islice(stream, 256)):
                chunks += batch
                size += sum(map(len, batch))
                if size > limit:
                    raise _too_big(limit)
        finally:
            stream.close()
    return "".join(chunks)
