"""Rendering chat messages with a model's Jinja chat template, the way Hugging Face does.

The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` on and
the ``loopcontrols`` extension, and gets the helpers templates in the wild call:
``raise_exception(message)``, ``strftime_now(format)`` and a ``tojson`` filter that keeps
non-ASCII text as is. A model file without a template gets ChatML.

A template is code from the model file (or ``--chat-template``), so one render is also held to
a budget, as defence in depth: a deadline (``timeout``) and a size (``max_chars``) that neither
the output nor any value the template makes or reads may exceed. The clock is read on every
iteration of every ``{% for %}`` (each loop's iterable is wrapped when the template compiles),
every call (macros too, so recursion is covered) and every piece of output, which are the only
ways a template repeats work. Sizes are checked before the operations that multiply them
(``*``, ``**``, ``+``, ``%``, integer arguments such as padding widths, format widths,
``replace``, ``join``, ``indent``), so those never allocate beyond the budget; every other
value is checked as the template gets it back. Any failure is a `ChatTemplateError`.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from .._errors import StagerunError

__all__ = [
    "CHATML_TEMPLATE",
    "MAX_RENDERED_CHARS",
    "RENDER_TIMEOUT",
    "ChatTemplateError",
    "render_chat",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Characters a render may write, or hold in one value: four times the largest request body
# (4 MiB), so the biggest chat a client can send renders; no model's context holds that much.
MAX_RENDERED_CHARS = 2**24
# Seconds a render may take: real templates render the largest chat allowed in milliseconds.
RENDER_TIMEOUT = 2.0
# Bits of an integer a template may make with * and ** (about 20,000 digits): far beyond any
# arithmetic a template does, and short of the powers that would compute for minutes.
MAX_INTEGER_BITS = 2**16

_FORMAT_NUMBER = re.compile(r"\d+")
_LOOP_FILTER = "_stagerun_bounded_loop"  # wraps the iterable of each {% for %}


class ChatTemplateError(StagerunError, ValueError):
    """A chat template rejected the messages (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class _Budget:
    """One render's deadline and size limit; the render's thread finds it in `_current`."""

    def __init__(self, max_chars: int, timeout: float) -> None:
        self.max_chars = max_chars
        self.timeout = timeout
        self._deadline = time.monotonic() + timeout

    def __repr__(self) -> str:
        left = self._deadline - time.monotonic()
        return f"<_Budget max_chars={self.max_chars} {left:.3f}s left>"

    def check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise ChatTemplateError(
                f"the chat template ran for more than {self.timeout} s; fix the template"
            )

    def check_size(self, size: int, what: str = "a value") -> None:
        if size > self.max_chars:
            raise ChatTemplateError(
                f"the chat template made {what} of {size} characters, more than the limit of "
                f"{self.max_chars}; fix the template"
            )

    def checked(self, value: Any) -> Any:
        """``value``, unless it is a string or container over the size limit."""
        if isinstance(value, str | list | tuple | dict):
            self.check_size(len(value))
        elif type(value) is int and value.bit_length() > MAX_INTEGER_BITS:
            raise ChatTemplateError(
                f"the chat template made an integer of more than {MAX_INTEGER_BITS} bits"
            )
        return value

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        sized = (str, list, tuple)
        if operator == "*":
            if isinstance(left, int) and isinstance(right, sized):
                left, right = right, left
            if isinstance(left, sized) and type(right) is int:
                self.check_size(len(left) * max(right, 0))
            elif (
                type(left) is int
                and type(right) is int
                and left.bit_length() + right.bit_length() > MAX_INTEGER_BITS
            ):
                raise ChatTemplateError(
                    f"the chat template multiplies integers into more than {MAX_INTEGER_BITS} bits"
                )
        elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1:
            if right * math.log2(abs(left)) > MAX_INTEGER_BITS:
                raise ChatTemplateError(
                    f"the chat template computes {left} ** {right}, an integer of more than "
                    f"{MAX_INTEGER_BITS} bits"
                )
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            self.check_size(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self.check_format(left)

    def check_call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Before calling the function, method or filter ``name``: will the result fit?"""
        self.check_time()
        values = [*args, *kwargs.values()]
        for value in values:
            if type(value) is int and abs(value) > self.max_chars:
                raise ChatTemplateError(
                    f"the chat template calls {name} with {value}, more than the limit of "
                    f"{self.max_chars}; fix the template"
                )
        strings = [v for v in values if isinstance(v, str)]
        if name == "format" and strings:  # the filter: ``'%5s' | format(x)``
            self.check_format(strings[0])
        elif name == "replace" and len(strings) >= 3:
            text, old, new = strings[:3]
            count = text.count(old)
            self.check_size(len(text) + count * (len(new) - len(old)))
        elif name == "join":
            items = next((v for v in values if isinstance(v, list | tuple)), ())
            separator = len(strings[0]) if strings else 0
            self.check_size(
                separator * len(items) + sum(len(x) for x in items if isinstance(x, str))
            )
        elif name == "indent" and strings:
            width = next((v for v in values[1:] if isinstance(v, int | str)), 4)
            prefix = width if type(width) is int else len(str(width))
            self.check_size(len(strings[0]) + (strings[0].count("\n") + 1) * prefix)

    def check_format(self, template: str) -> None:
        """Before formatting with ``template``: no width or precision beyond the limit."""
        for number in _FORMAT_NUMBER.findall(template):
            if len(number) > 9 or int(number) > self.max_chars:
                raise ChatTemplateError(
                    f"the chat template formats with a width of {number}, more than the limit "
                    f"of {self.max_chars}; fix the template"
                )


class _BoundedLoop:
    """A ``{% for %}`` loop's iterable that looks at the clock on every iteration."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterable = iterable

    def __len__(self) -> int:  # so that loop.length and loop.last work as before
        return len(self._iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        budget = _budget()
        for item in self._iterable:
            if budget is not None:
                budget.check_time()
            yield item


_current = threading.local()  # .budget: the _Budget of the render running in this thread


def _budget() -> _Budget | None:
    budget: _Budget | None = getattr(_current, "budget", None)
    return budget


def _callable_name(obj: Any) -> str:
    return str(getattr(obj, "__name__", type(obj).__name__))


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, holding every operation of a render to that render's `_Budget`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        budget.check_binop(operator, left, right)
        return budget.checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        owner = getattr(__obj, "__self__", None)
        bound = (owner,) if isinstance(owner, str | list | tuple) else ()
        budget.check_call(_callable_name(__obj), (*bound, *args), kwargs)
        return budget.checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        """Every ``str.format`` goes through here (Jinja wraps it on access)."""
        owner, budget = getattr(value, "__self__", None), _budget()
        name = getattr(value, "__name__", "")
        if budget is not None and isinstance(owner, str) and name in ("format", "format_map"):
            budget.check_format(owner)
        return super().wrap_str_format(value)

    def getattr(self, obj: Any, attribute: str) -> Any:
        value = super().getattr(obj, attribute)
        budget = _budget()
        return value if budget is None else budget.checked(value)

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        budget = _budget()
        return value if budget is None else budget.checked(value)


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return function(*args, **kwargs)
        budget.check_call(name, args, kwargs)
        return budget.checked(function(*args, **kwargs))

    return bounded


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_LOOP_FILTER] = _BoundedLoop
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    tree = env.parse(template)
    for loop in tree.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Filter(
            loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno
        )
    return env.from_string(tree)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str,
    eos_token: str,
    max_chars: int = MAX_RENDERED_CHARS,
    timeout: float = RENDER_TIMEOUT,
    **extra: Any,
) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) with a Jinja chat template.

    Args:
        template: the template source (``tokenizer.chat_template`` of a GGUF file).
        add_generation_prompt: end with the header of an assistant turn.
        bos_token: the text of the BOS token, for templates that write it.
        eos_token: the text of the EOS token.
        max_chars: the most characters the render may write, or hold in any one value.
        timeout: the most seconds the render may take.
        extra: further template variables (``tools``, ``date_string``, ...).

    Raises:
        ChatTemplateError: the template raised an exception, is not valid Jinja, or went over
            its budget of time or size.
    """
    previous = _budget()
    _current.budget = _Budget(max_chars, timeout)
    try:
        compiled = _compile(template)
        parts, size = [], 0
        for part in compiled.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        ):
            size += len(part)
            if size > max_chars:
                raise ChatTemplateError(
                    f"the chat template wrote more than {max_chars} characters; fix the "
                    "template or send a shorter chat"
                )
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc
    except Exception as exc:  # the template's own code failed: a bad template, not a bug here
        raise ChatTemplateError(
            f"the chat template failed to render: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _current.budget = previous
