"""The budget of one chat-template render: what every filter, method and operator may cost.

Theory of operation: a render gets a deadline and a size (``max_chars``). Two things keep every
single operation within them, since Python cannot interrupt a C-level ``sorted`` or ``join``:

- **Sizes are checked before the work.** Every value the template holds has a *text size* at
  most ``max_chars`` (`_Budget.text_size`: the characters ``str()`` of it writes, not counting
  escapes; memoised per object, so each container is walked once per render), and every list,
  tuple or dict at most `MAX_TEMPLATE_ITEMS` items. Each operation that can make a larger
  value is checked from its arguments first: ``*``, ``+``, ``~``, ``%`` and ``format`` (their
  conversions times their largest argument), padding widths, ``replace``, ``join``,
  ``indent``, ``expandtabs``, ``translate``, ``batch``/``slice`` fills, ``tojson``'s indent,
  ``lipsum``. What the template writes is charged as it is written, in macros and
  ``{% set %}`` blocks too, up to `WRITE_FACTOR` times ``max_chars`` in all.
- **Work done item by item in Python is bounded by count.** Filters that call Python code per
  item or character (``sort``'s key, ``unique``, ``groupby``, ``wordwrap``'s chunks,
  ``striptags``, ``title``, ``urlencode``, ``pprint``, ...) take at most `MAX_ITEMWISE` items
  or characters: about 0.2 s of work. ``wordwrap`` copies the rest of a long word for each
  line it breaks off, so it is also held to `MAX_WRAP_WORK` characters copied, and ``sum``
  over lists or strings (quadratic) to `MAX_SUM_WORK` items copied. Attribute lookups, which
  such filters make per item, look at the clock too.

Everything else is linear in its input and so bounded by the sizes; the deadline is checked
on every loop iteration, call and write. Any refusal is a `ChatTemplateError`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import StagerunError

__all__ = ["MAX_INTEGER_BITS", "MAX_RENDERED_CHARS", "RENDER_TIMEOUT", "ChatTemplateError"]

# Characters a render may write, or hold in one value: four times the largest request body
# (4 MiB), so the biggest chat a client can send renders; no model's context holds that much.
MAX_RENDERED_CHARS = 2**24
# Seconds a render may take: real templates render the largest chat allowed in milliseconds.
RENDER_TIMEOUT = 2.0
# Bits of an integer a template may make with * and ** (about 20,000 digits): far beyond any
# arithmetic a template does, and short of the powers that would compute for minutes.
MAX_INTEGER_BITS = 2**16
# Items in any list, tuple or dict a template makes (the messages of a chat are far fewer).
MAX_TEMPLATE_ITEMS = 2**20
# Items, or characters, that a filter may walk one by one in Python code: under 1 s of work
# with attribute lookups through the sandbox (groupby: ~12 us an item), ~0.1 s without.
MAX_ITEMWISE = 2**16
# Characters wordwrap may copy breaking long words (length^2 / width): ~0.2 s.
MAX_WRAP_WORK = 2**32
# Items ``sum`` may copy adding lists or strings (each addition copies the total so far): ~0.3 s.
MAX_SUM_WORK = 2**27
# What a render may write in all, macros and {% set %} blocks included, in units of max_chars.
WRITE_FACTOR = 4

_FORMAT_NUMBER = re.compile(r"\d+")
_REUSED_ARGUMENT = re.compile(r"\{\s*[0-9A-Za-z_]|%\(")  # '{0}', '{name}', '%(name)s'
_SIZED = (str, list, tuple, dict, set, frozenset)
_PLAIN = frozenset({float, bool, type(None)})

# Filters that run Python code per item (or per character of a string).
ITEMWISE_FILTERS = frozenset({
    "batch", "dictsort", "groupby", "join", "list", "map", "max", "min", "pprint", "reject",
    "rejectattr", "select", "selectattr", "slice", "sort", "sum", "title",
    "unique", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr",
})  # fmt: skip


class ChatTemplateError(StagerunError, ValueError):
    """A chat template rejected the messages (``raise_exception``) or failed to render."""


def _refuse(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"the chat template {what}; fix the template")


class _Budget:
    """One render's deadline and size limit; the render's thread finds it in `_chat`."""

    def __init__(self, max_chars: int, timeout: float) -> None:
        self.max_chars = max_chars
        self.timeout = timeout
        self.written = 0
        self._deadline = time.monotonic() + timeout
        self._sizes: dict[int, tuple[Any, int]] = {}  # id -> (the container, its text size)

    def __repr__(self) -> str:
        left = self._deadline - time.monotonic()
        return f"<_Budget max_chars={self.max_chars} written={self.written} {left:.3f}s left>"

    def check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise ChatTemplateError(
                f"the chat template ran for more than {self.timeout} s; fix the template"
            )

    def check_size(self, size: int, what: str = "a value") -> None:
        if size > self.max_chars:
            raise _refuse(
                f"made {what} of {size} characters, more than the limit of {self.max_chars}"
            )

    def check_items(self, n: int, what: str, limit: int = MAX_TEMPLATE_ITEMS) -> None:
        if n > limit:
            raise _refuse(f"made {what} of {n} items, more than the limit of {limit}")

    def check_walk(self, n: int, name: str, limit: int = MAX_ITEMWISE) -> None:
        """Before ``name`` walks ``n`` items (or characters) one by one in Python."""
        if n > limit:
            raise _refuse(
                f"gives {name} {n} items or characters to walk one by one, more than the limit "
                f"of {limit}"
            )

    def text_size(self, value: Any) -> int:
        """The characters ``str(value)`` writes, about (escapes aside); stops past the limit."""
        if isinstance(value, str):
            return len(value)
        if type(value) is int:
            return value.bit_length() * 3 // 10 + 1
        if not isinstance(value, list | tuple | dict | set | frozenset):
            return 8  # numbers, None, Undefined, ...: their text is short
        known = self._sizes.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        self.check_items(len(value), "a container")
        size = 2
        if isinstance(value, dict):
            for key, item in value.items():
                size += self.text_size(key) + self.text_size(item) + 4
                if size > self.max_chars:
                    break
        else:
            for item in value:
                size += self.text_size(item) + 2
                if size > self.max_chars:
                    break
        self._sizes[id(value)] = (value, size)
        return size

    def checked(self, value: Any) -> Any:
        """``value``, unless it is a string or container over the size limit."""
        kind = type(value)
        if kind is str:
            self.check_size(len(value))
        elif kind is int:
            if value.bit_length() > MAX_INTEGER_BITS:
                raise _refuse(f"made an integer of more than {MAX_INTEGER_BITS} bits")
        elif kind not in _PLAIN and isinstance(value, _SIZED):
            self.check_size(self.text_size(value))
        return value

    def charge_write(self, value: Any) -> None:
        """Before ``value`` is written, at the top or into a macro or block: count it."""
        self.check_time()
        self.written += self.text_size(value)
        if self.written > WRITE_FACTOR * self.max_chars:
            raise _refuse(
                f"wrote more than {WRITE_FACTOR * self.max_chars} characters in all "
                f"({WRITE_FACTOR} times the limit of {self.max_chars}, macros included)"
            )

    def concat(self, parts: Sequence[Any]) -> str:
        """``a ~ b ~ ...``, sized first."""
        self.check_size(sum(self.text_size(p) for p in parts), "a string with ~")
        return "".join(str(p) for p in parts)

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        sized = (str, list, tuple)
        if operator == "*":
            if isinstance(left, int) and isinstance(right, sized):
                left, right = right, left
            if isinstance(left, sized) and type(right) is int:
                n = max(right, 0)
                if not isinstance(left, str):
                    self.check_items(len(left) * n, "a list with *")
                self.check_size(self.text_size(left) * n)
            elif (
                type(left) is int
                and type(right) is int
                and left.bit_length() + right.bit_length() > MAX_INTEGER_BITS
            ):
                raise _refuse(f"multiplies integers into more than {MAX_INTEGER_BITS} bits")
        elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1:
            if right * math.log2(abs(left)) > MAX_INTEGER_BITS:
                raise _refuse(
                    f"computes {left} ** {right}, an integer of more than {MAX_INTEGER_BITS} bits"
                )
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            if not isinstance(left, str):
                self.check_items(len(left) + len(right), "a list with +")
            self.check_size(self.text_size(left) + self.text_size(right))
        elif operator == "%" and isinstance(left, str):
            self.check_format(left, right if isinstance(right, tuple | Mapping) else (right,))

    def check_format(self, template: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> None:
        """Before formatting ``args`` into ``template``: widths, and the text it can write."""
        widest = 0
        for number in _FORMAT_NUMBER.findall(template):
            if len(number) > 9 or int(number) > self.max_chars:
                raise _refuse(
                    f"formats with a width of {number}, more than the limit of {self.max_chars}"
                )
            widest = max(widest, int(number))
        values = list(args.values()) if isinstance(args, Mapping) else list(args)
        sizes = [self.text_size(v) for v in values]
        conversions = template.count("%") + template.count("{")
        if isinstance(args, Mapping) or _REUSED_ARGUMENT.search(template):
            most = conversions * (max(sizes, default=0) + widest)  # an argument can recur
        else:
            most = sum(sizes) + conversions * widest
        self.check_size(len(template) + most, "a formatted string")

    def check_call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Before calling the function or method ``name`` (a bound one's object first)."""
        self.check_time()
        values = [*args, *kwargs.values()]
        for value in values:
            if type(value) is int and abs(value) > self.max_chars:
                raise _refuse(f"calls {name} with {value}, more than the limit of {self.max_chars}")
            self.checked(value)
        strings = [v for v in values if isinstance(v, str)]
        if name == "replace" and len(strings) >= 3:
            text, old, new = strings[:3]
            self.check_size(len(text) + text.count(old) * (len(new) - len(old)))
        elif name == "join":
            items = next((v for v in values if isinstance(v, list | tuple)), ())
            separator = len(strings[0]) if strings else 0
            self.check_size(separator * len(items) + sum(self.text_size(x) for x in items))
        elif name == "indent" and strings:
            width = next((v for v in values[1:] if isinstance(v, int | str)), 4)
            prefix = width if type(width) is int else len(str(width))
            self.check_size(len(strings[0]) + (strings[0].count("\n") + 1) * prefix)
        elif name == "expandtabs" and strings:
            size = next((v for v in values[1:] if type(v) is int), 8)
            self.check_size(len(strings[0]) + strings[0].count("\t") * max(size, 0))
        elif name == "translate" and strings and len(values) > 1:
            table = values[1]
            longest = 1
            if isinstance(table, Mapping):
                longest = max((self.text_size(v) for v in table.values()), default=1)
            self.check_size(len(strings[0]) * max(longest, 1))
        elif name == "generate_lorem_ipsum":  # lipsum(n=5, html=True, min=20, max=100)
            n = kwargs.get("n", args[0] if args else 5)
            most = kwargs.get("max", args[3] if len(args) > 3 else 100)
            if type(n) is int and type(most) is int:
                self.check_walk(n * most, "lipsum")

    def check_filter(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Before the filter ``name`` runs on ``args[0]``."""
        self.check_call(name, args, kwargs)
        value = args[0] if args else None
        if name in ITEMWISE_FILTERS and isinstance(value, _SIZED):
            self.check_walk(len(value), name)
        check = _FILTER_CHECKS.get(name)
        if check is not None:
            check(self, list(args), dict(kwargs))


def _arg(args: list[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _check_format_filter(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    if args and isinstance(args[0], str):
        budget.check_format(args[0], kwargs or tuple(args[1:]))


def _check_wordwrap(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    text, width = args[0], _arg(args, kwargs, 1, "width", 79)
    wrapstring = _arg(args, kwargs, 3, "wrapstring", None) or "\n"
    if isinstance(text, str) and type(width) is int:
        work = len(text) * len(text) // max(width, 1)
        if work > MAX_WRAP_WORK:
            raise _refuse(
                f"wraps {len(text)} characters at width {width}, which copies {work} "
                f"characters, more than the limit of {MAX_WRAP_WORK}"
            )
        if isinstance(wrapstring, str):
            budget.check_size(len(text) + (len(text) + 1) * len(wrapstring), "a wrapped text")


def _check_fill(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    count = _arg(args, kwargs, 1, "linecount", None)
    count = _arg(args, kwargs, 1, "slices", count)
    fill = _arg(args, kwargs, 2, "fill_with", None)
    if type(count) is int:
        budget.check_walk(count, "batch or slice")
        budget.check_size(count * budget.text_size(fill), "a fill")


def _check_sum(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    start, items = _arg(args, kwargs, 2, "start", 0), args[0]
    if isinstance(start, str | list | tuple) and isinstance(items, Sequence):
        total = len(start) + sum(len(x) for x in items if isinstance(x, _SIZED))
        work = len(items) * total // 2
        if work > MAX_SUM_WORK:
            raise _refuse(
                f"sums {len(items)} lists or strings of {total} items in all, which copies "
                f"{work} items, more than the limit of {MAX_SUM_WORK}"
            )


def _shape(value: Any, depth: int = 0) -> tuple[int, int]:
    """The items (containers included) and nesting depth of a value, for tojson and pprint."""
    if not isinstance(value, list | tuple | dict):
        return 1, depth
    items, deepest = 1, depth + 1
    for item in value.values() if isinstance(value, dict) else value:
        n, d = _shape(item, depth + 1)
        items, deepest = items + n, max(deepest, d)
        if items > MAX_TEMPLATE_ITEMS:
            break
    return items, deepest


def _check_tojson(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    indent = _arg(args, kwargs, 1, "indent", None)
    if indent:
        width = indent if type(indent) is int else len(str(indent))
        items, depth = _shape(args[0])
        budget.check_size(budget.text_size(args[0]) + items * (1 + width * depth), "JSON")


def _check_pprint(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    budget.check_walk(_shape(args[0])[0], "pprint")


def _check_striptags(budget: _Budget, args: list[Any], kwargs: dict[str, Any]) -> None:
    if isinstance(args[0], str):
        budget.check_walk(args[0].count("<"), "striptags")


_FILTER_CHECKS = {
    "batch": _check_fill,
    "format": _check_format_filter,
    "pprint": _check_pprint,
    "slice": _check_fill,
    "striptags": _check_striptags,
    "sum": _check_sum,
    "tojson": _check_tojson,
    "wordwrap": _check_wordwrap,
}
