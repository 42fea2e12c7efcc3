"""Jinja's immutable sandbox with bounds: a chat template is code from whoever published the
file. The sandbox stops it touching the machine, not running for hours or filling memory, so
every render is bounded: ``RENDER_SECONDS`` of its thread's CPU time, ``RENDER_CHARS``
characters in any one value (more for long chats), and ``MADE_IN_ALL_FACTOR`` times that in all
it makes, whichever comes first.

Time is CPU time (``time.thread_time``), not the wall clock: a template that spins burns CPU,
one merely paused (a laptop asleep, SIGSTOP, swapping, other threads holding the GIL) does not.
So every failure here is a property of the template, time included, and ``ChatTemplate`` keeps
refusing a template once it ran past a bound.

A thread cannot be stopped from outside, so the bounds are cooperative: each loop step, call and
filter checks the clock, and a filter given many items checks it at each; whatever can make far
more than it is given (``*``, ``+``, ``~``, ``%``, ``**``, ``range``, padding, joining,
formatting, spelling out a nested value, a captured block, the output) checks what it would make
first; a call whose time grows faster than what it is given (``wordwrap``, ``urlize``, sorting,
``rfind`` and ``strip`` with long arguments, punycode) is refused past a size first, since the
clock is not read while it runs; and every value made but a short text counts toward what a
render makes in all, a list, dict or namespace by the texts it holds.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import string
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from itertools import islice, repeat
from operator import length_hint
from time import monotonic, thread_time
from types import BuiltinMethodType, FunctionType
from typing import Any, cast

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 1.0  # CPU time one render may take (40 messages take well under 1 ms)
RENDER_CHARS = 4_000_000  # characters in any one value a render makes, and in its output
CHARS_PER_MESSAGE_CHAR = 4  # and more per character of the messages: long chats are long
MADE_IN_ALL_FACTOR = 16  # times as much a render may make in all (every value it makes)
INT_BITS = 65_536  # bits in any number a template computes
CALL_CHARS = 65_536  # characters a call slower than linear may take (wordwrap, urlize, pprint)
CALL_ITEMS = 16_384  # items a sort may take (a key each in Python, then n log n comparisons)
CALL_STEPS = 2**28  # steps of a backward search or a strip by many characters (~0.1 s)
CODEC_CHARS = 1_024  # characters punycode and idna may take (quadratic, in Python)

_LARGE = 65_536  # a text this long is within any render's bound on one value
_SHORT = 64  # a text made that is not counted toward all made (see _check_size)
_PACE = 4_096  # a filter given more items than this checks the clock at each
_LATE = f"ran past {RENDER_SECONDS:g} s of CPU time"
_SCALARS = frozenset({bool, float, type(None)})


# -- bounds ---------------------------------------------------------------------------------


class RanAway(Exception):
    """Raised inside the sandbox past a bound (no template construct can catch it)."""


class _Budget:
    """One render's bounds (current on this thread while it runs): when it must end, the
    largest value, and what it may still make in all (many values fill memory too).

    ``cpu`` is the end in this thread's CPU time; ``deadline`` the wall-clock time before which
    it cannot have come (CPU time never runs faster), read cheaply at each check."""

    __slots__ = ("cpu", "deadline", "left", "limit", "outer")

    def __init__(self, limit: int) -> None:
        self.cpu = thread_time() + RENDER_SECONDS
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


def _late(budget: _Budget) -> None:
    """Past the wall-clock mark: refuse if the render spent its CPU time, else move the mark to
    the earliest it can (a pause, a suspend, a wait for the GIL costs nothing)."""
    left = budget.cpu - thread_time()
    if left <= 0:
        raise RanAway(_LATE)
    budget.deadline = monotonic() + left


def _too_big(limit: int, what: str = "") -> RanAway:
    return RanAway(f"made more than {limit / 1e6:.1f} million characters{what}")


def _check_bound(estimate: int, limit: int) -> None:
    if estimate > limit:
        raise _too_big(limit)


def _check_bits(bits: int) -> None:
    if bits > INT_BITS:
        raise RanAway(f"made a number of more than {INT_BITS:,} bits")


def _size(value: Any) -> int:
    """A value's own size in characters: an item of a list costs 8, of a set or dict 16."""
    if isinstance(value, (list, tuple)):
        return 8 * len(value)
    if isinstance(value, (dict, set, frozenset)):
        return 16 * len(value)
    return len(value) if isinstance(value, (str, bytes)) else 0


def _held(value: Any) -> int:
    """What a new value holds, in characters: its own size and its items' lengths, one level
    deep (a short list of long texts holds them all; read in C, cheaply)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return _size(value) + sum(map(length_hint, value))
    if isinstance(value, dict):
        return _size(value) + sum(map(length_hint, value)) + sum(map(length_hint, value.values()))
    if isinstance(value, Namespace):
        return _held(object.__getattribute__(value, "_Namespace__attrs"))
    return len(value) if isinstance(value, (str, bytes)) else 0


def _check_size(value: Any, budget: _Budget) -> None:
    """Refuse a value the sandbox made past the bounds; what it holds counts toward all made
    (a short text does not: keeping it costs less than the loop step that keeps it)."""
    kind = type(value)
    if kind is str:
        size = held = len(value)
        if size <= _SHORT:
            return
    elif kind is int:
        _check_bits(value.bit_length())
        return
    elif kind in _SCALARS:
        return
    else:
        size, held = _size(value), _held(value)
    if size > budget.limit:
        raise _too_big(budget.limit)
    budget.left -= held
    if budget.left < 0:
        raise _too_big(MADE_IN_ALL_FACTOR * budget.limit, " in all")


def _weight(value: Any, limit: int, indent: int = 0) -> int:
    """About how many characters ``value`` spells out as (``str``, ``repr``, JSON indented by
    ``indent``), counted until past ``limit``: a short list may hold one long text many times
    over, or nest deeply. Past ``limit // 16`` parts (250,000 at most: spelling each out is a
    step in Python for some) it is too big (no template prints that)."""
    total, parts = 0, min(limit, RENDER_CHARS) // 16
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
    """What ``bound`` says of a call (given its arguments, a method's owner first): at most
    what it makes, or what it costs; 0 where they do not fit (the call fails on its own)."""
    if kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
    try:
        return bound(*args, **kwargs)
    except (TypeError, ValueError, AttributeError, OverflowError, LookupError):
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


def _searched(s: Any, sub: Any = None, *_: Any, **kwargs: Any) -> int:
    """``rfind`` and its kin compare up to ``len(sub)`` characters at each place of ``s`` (only
    forward search is linear); ``strip`` looks each character up in ``chars`` as long."""
    sub = kwargs.get("sep", kwargs.get("chars", sub))
    if not isinstance(sub, (str, bytes)) or len(sub) <= 32:
        return 0  # a short one: at most 32 times linear
    return len(sub) * (len(s) if isinstance(s, (str, bytes)) else _weight(s, _budget().limit))


def _coded(s: Any, encoding: str = "utf-8", *_: Any, **__: Any) -> int:
    """punycode (and idna, which uses it) run in Python in quadratic time; the others in C."""
    return len(s) if codecs.lookup(encoding).name in ("punycode", "idna") else 0


def _urlized(text: Any, *_: Any, **__: Any) -> int:
    """``urlize`` peels punctuation off each word a step at a time: quadratic in its length."""
    if not isinstance(text, str):
        if _weight(text, CALL_CHARS) > CALL_CHARS:
            return CALL_CHARS + 1
        text = str(text)
    if len(text) > CALL_CHARS:
        return len(text)
    return max(len(text), sum(len(word) ** 2 for word in text.split()) // 16)


_METHOD_BOUNDS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(0, tabsize),
    "replace": _replaced,
    "join": _joined,
    "format": _formatted,
    "format_map": lambda fmt, mapping: _formatted(fmt, mapping),
    "translate": lambda s, table: len(s) * max([1, *map(_size, table.values())]),
    "to_bytes": lambda n, length=1, *_, **__: _padded("", length),  # however small n is
    "strftime": lambda when, fmt: 256 * len(fmt),  # Python tries buffers up to this
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
    "urlencode": lambda value: (3 if value.isascii() else 12) * len(value),  # a str's %XX
}
# Calls whose time grows faster than what they are given, and how far they may go.
_Cost = tuple[Callable[..., int], int, str]
_SORTED: _Cost = (lambda value, *_, **__: len(value), CALL_ITEMS, "items")
_STEPS: _Cost = (_searched, CALL_STEPS, "steps")
_METHOD_COSTS: dict[str, _Cost] = {
    **dict.fromkeys(("rfind", "rindex", "rsplit", "rpartition"), _STEPS),
    **dict.fromkeys(("strip", "lstrip", "rstrip"), _STEPS),
    **dict.fromkeys(("encode", "decode"), (_coded, CODEC_CHARS, "characters")),
}
_METHODS = frozenset(_METHOD_BOUNDS) | frozenset(_METHOD_COSTS)
_FILTER_COSTS: dict[str, _Cost] = {
    "wordwrap": (lambda s, *_, **__: len(s), CALL_CHARS, "characters"),  # long words: quadratic
    "urlize": (_urlized, CALL_CHARS, "characters"),
    "pprint": (lambda value: _weight(value, CALL_CHARS, 1), CALL_CHARS, "characters"),  # × depth
    **dict.fromkeys(("sort", "groupby", "dictsort"), _SORTED),
}
_ARGUMENT_COSTS: dict[str, _Cost] = {"trim": _STEPS}  # only when given more than the value
# Filters that make nothing new, in constant or linear time: left as they are.
_PLAIN_FILTERS = frozenset(
    "abs attr count d default first float items last length random round".split()
)
# Filters that read their input item by item, in Python for most: the clock is checked at
# each past ``_PACE`` of them. Those that read an iterator whole are given it as a list.
_EACH_FILTERS = frozenset(
    "batch groupby join list map max min reject rejectattr select selectattr slice sort sum"
    " unique".split()
)
_READ_WHOLE = frozenset({"groupby", "join", "sort", "sum"})
# Filters that spell a value that is not text out as text first: sized as printing it is.
_TEXT_FILTERS = frozenset(
    "capitalize center e escape forceescape format indent lower replace safe striptags title"
    " trim truncate upper urlencode urlize wordcount wordwrap xmlattr".split()
)


def _check_cost(name: str, cost: _Cost, args: Iterable[Any], kwargs: dict[str, Any]) -> None:
    bound, most, what = cost
    if _estimate(bound, args, kwargs) > most:
        raise RanAway(f"asked {name} for more than {most:,} {what}")


# -- the hooks ------------------------------------------------------------------------------


class _Steps:
    """Items read one at a time, each step checking the render's clock: a ``{% for %}``'s, or
    what a filter given many items reads."""

    __slots__ = ("_budget", "_items")

    def __init__(self, items: Any) -> None:
        self._items = items
        self._budget = _budget()

    def __len__(self) -> int:
        return len(self._items)  # an iterator's TypeError: Jinja's loop counts as it goes

    def __bool__(self) -> bool:  # as the items are (``map`` asks), an iterator's True
        return isinstance(self._items, Iterator) or bool(self._items)

    def __iter__(self) -> Iterator[Any]:
        budget = self._budget
        for item in self._items:
            if monotonic() > budget.deadline:
                _late(budget)
            yield item


def _made(value: Any) -> Any:
    """A value made where the sandbox has no hook (a slice, a ``~``), counted."""
    _check_size(value, _budget())
    return value


def _spelled(value: Any) -> Any:
    """What ``{{ … }}`` prints, or ``~`` joins, as is; a value that is not text is sized before
    Jinja spells it out (a list may hold one long text many times over)."""
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
    """``func`` checking the clock, what it would make and cost, and counting what it made."""
    bound, cost = _FILTER_BOUNDS.get(name), _FILTER_COSTS.get(name)
    given = _ARGUMENT_COSTS.get(name)
    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # context, environment
    read_whole, each, text = name in _READ_WHOLE, name in _EACH_FILTERS, name in _TEXT_FILTERS

    @functools.wraps(func)  # keeps jinja_pass_arg: Jinja still passes what func takes
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if monotonic() > budget.deadline:
            _late(budget)
        if len(args) > skip:
            value = args[skip]
            if read_whole and isinstance(value, Iterator):
                value = list(value)
            elif text and type(value) is not str:
                _check_bound(_weight(value, budget.limit), budget.limit)
            if bound is not None:
                _check_bound(_estimate(bound, (value, *args[skip + 1 :]), kwargs), budget.limit)
            if cost is not None:
                _check_cost(name, cost, (value, *args[skip + 1 :]), kwargs)
            if each and length_hint(value) > _PACE:
                value = _Steps(value)
            args = (*args[:skip], value, *args[skip + 1 :])
        result = func(*args, **kwargs)
        if type(result) is not str or len(result) > _SHORT:
            _check_size(result, budget)
        return result

    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:  # trim, upper, title…: linear, text only
        if type(value := args[skip]) is not str:
            _spelled(value)
        if given is not None and (kwargs or len(args) > skip + 1):
            _check_cost(name, given, args[skip:], kwargs)
        result = func(*args, **kwargs)
        if result is not value and (type(result) is not str or len(result) > _SHORT):
            _check_size(result, _budget())  # (a text trimmed of nothing is the same text)
        return result

    return bounded if bound or cost or each or read_whole or not text else counted


class _Guard(NodeTransformer):
    """Bounds what the sandbox has no hook for: each ``{% for %}`` iterates ``_steps`` of its
    items, each ``~`` sizes its parts and counts what it made, and so does each slice."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_steps", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [
            part if isinstance(part, nodes.Const) else self._filter(part, "_spelled")
            for part in node.nodes
        ]
        return self._filter(node, "_made")

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        return self._filter(node, "_made") if isinstance(node.arg, nodes.Slice) else node

    @staticmethod
    def _filter(node: nodes.Expr, name: str) -> nodes.Expr:
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox whose hooks check the running render's bounds."""

    # Intercepted operators are not folded at compile time either ('x' * 10**9 included).
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":  # the common case, kept quick: building texts
            result = left + right
            if type(result) is str and (size := len(result)) <= _LARGE:
                if size <= _SHORT or (budget := _BOUNDS.budget) is None:
                    return result
                budget.left -= size
                if budget.left >= 0:
                    return result
            _check_size(result, _budget())  # refuses, or sizes what is not a text
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
            _late(budget)
        # A builtin method (str.format comes wrapped by the sandbox) that can make far more
        # than it is given, or take far longer.
        method: Any = getattr(obj, "__wrapped__", None) if type(obj) is FunctionType else obj
        if type(method) is BuiltinMethodType and (name := method.__name__) in _METHODS:
            owner = method.__self__
            if bound := _METHOD_BOUNDS.get(name):
                if name == "join" and args and isinstance(args[0], Iterator):
                    args = (list(args[0]), *args[1:])  # str.join reads it whole anyway
                _check_bound(_estimate(bound, (owner, *args), kwargs), budget.limit)
            given = args or len(kwargs) > ("_loop_vars" in kwargs) + ("_block_vars" in kwargs)
            if given and (cost := _METHOD_COSTS.get(name)):  # none costs much without
                _check_cost(name, cost, (owner, *args), kwargs)
        result = super().call(context, obj, *args, **kwargs)
        if type(result) is not str or len(result) > _SHORT:
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


def _raise_exception(message: Any) -> None:
    raise TemplateError(_spelled(message))


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
    """``source`` compiled with its loops, ``~`` and slices bounded (constants fold within
    bounds); a literal Python cannot spell out (an integer of 4,300 digits) does not compile."""
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_spelled
    )
    env.filters["tojson"] = _tojson
    for name, func in list(env.filters.items()):
        if name not in _PLAIN_FILTERS:
            env.filters[name] = _bounded_filter(name, func)
    env.filters.update(_steps=_Steps, _made=_made, _spelled=_spelled)
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _range
    del env.globals["lipsum"]  # thousands of paragraphs in one call; minja has none
    with _Budget(RENDER_CHARS):
        try:
            tree = _Guard().visit(env.parse(source))
            tree.set_environment(env)
            return env.from_string(tree)
        except (ValueError, OverflowError) as exc:
            raise TemplateError(str(exc)) from None


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
