"""Rendering chat messages with a model's Jinja chat template, the way Hugging Face does.

The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` on and
the ``loopcontrols`` extension, and gets the helpers templates in the wild call:
``raise_exception(message)``, ``strftime_now(format)`` and a ``tojson`` filter that keeps
non-ASCII text as is. A model file without a template gets ChatML.

A template is code from the model file (or ``--chat-template``), so one render is also held to
a budget, as defence in depth: a deadline (``timeout``) and a size (``max_chars``) that neither
the output nor any value the template makes or reads may exceed. The clock is read on every
iteration of every ``{% for %}`` (each loop's iterable is wrapped when the template compiles),
every call (macros too, so recursion is covered), every attribute lookup and every piece of
output, which are the only ways a template repeats work. Every filter, method and operator is
checked before it runs, from its arguments, so that none can take long or allocate beyond the
budget in one step (`stagerun.model._template_budget` says how); ``~`` and each written piece
are rewritten into bounded filters when the template compiles. Any failure is a
`ChatTemplateError`.
"""

from __future__ import annotations

import datetime
import functools
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

from ._template_budget import MAX_INTEGER_BITS as MAX_INTEGER_BITS
from ._template_budget import MAX_RENDERED_CHARS as MAX_RENDERED_CHARS
from ._template_budget import RENDER_TIMEOUT as RENDER_TIMEOUT
from ._template_budget import ChatTemplateError as ChatTemplateError
from ._template_budget import _Budget

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
_LOOP_FILTER = "_stagerun_bounded_loop"  # wraps the iterable of each {% for %}
_CONCAT_FILTER = "_stagerun_bounded_concat"  # replaces each ``a ~ b``
_WRITE_FILTER = "_stagerun_bounded_write"  # wraps each expression written by {{ }}


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


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
        wrapped = super().wrap_str_format(value)
        owner = getattr(value, "__self__", None)
        if wrapped is None or not isinstance(owner, str):
            return wrapped
        is_map = getattr(value, "__name__", "") == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = _budget()
            if budget is not None:
                mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else None
                budget.check_format(owner, mapping or (*args, *kwargs.values()))
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(bounded, wrapped)

    # Filters look attributes up per item (sort, groupby, map, ...): each lookup reads the clock.
    def getattr(self, obj: Any, attribute: str) -> Any:
        value = super().getattr(obj, attribute)
        budget = _budget()
        if budget is None:
            return value
        budget.check_time()
        return budget.checked(value)

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        budget = _budget()
        if budget is None:
            return value
        budget.check_time()
        return budget.checked(value)


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    # a pass_context (_environment, _eval_context) filter gets that object first, then its input
    passed = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return function(*args, **kwargs)
        budget.check_filter(name, args[passed:], kwargs)
        return budget.checked(function(*args, **kwargs))

    return bounded


def _bounded_concat(parts: Sequence[Any]) -> str:
    """``a ~ b ~ ...`` (Jinja's own ``str_join``), sized before it is joined."""
    budget = _budget()
    return "".join(str(p) for p in parts) if budget is None else budget.concat(parts)


@jinja2.pass_context  # so that Jinja never folds it into a constant when it compiles
def _bounded_write(_context: Any, value: Any) -> Any:
    """Each piece a template writes, at the top or in a macro or block, is charged first."""
    budget = _budget()
    if budget is not None:
        budget.charge_write(value)
    return value


class _Bounds(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template: each loop's iterable, ``~`` and written piece bounded."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        lineno = node.lineno
        node.iter = jinja2.nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        parts = jinja2.nodes.Tuple(node.nodes, "load", lineno=node.lineno)
        return jinja2.nodes.Filter(parts, _CONCAT_FILTER, [], [], None, None, lineno=node.lineno)

    def visit_Output(self, node: jinja2.nodes.Output) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.nodes = [
            jinja2.nodes.Filter(n, _WRITE_FILTER, [], [], None, None, lineno=n.lineno)
            for n in node.nodes
        ]
        return node


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_LOOP_FILTER] = _BoundedLoop
    env.filters[_CONCAT_FILTER] = _bounded_concat
    env.filters[_WRITE_FILTER] = _bounded_write
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    tree = _Bounds().visit(env.parse(template))
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
