"""Whether a loaded plugin fits its interface: the checks `stagerun.plugins` runs on it.

A transport, backend or drafter is checked against its interface in `stagerun.abc` without
calling it: it must be a class with no abstract methods left, have the members stagerun uses,
coroutine or plain functions as required, taking the parameters stagerun passes. Each check
returns the problems it found as phrases ("its connect() must be an async def") that the
registry joins into the `PluginError` naming the plugin.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _check_method(
    cls: type,
    name: str,
    *,
    coroutine: bool,
    positional: tuple[str, ...] = (),
    keywords: tuple[str, ...] = (),
) -> list[str]:
    fn = inspect.getattr_static(cls, name, None)
    if fn is None:
        return [f"it has no {name}()"]
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if not callable(fn):
        return [f"its {name} is not a method"]
    if getattr(fn, "__isabstractmethod__", False):
        return [f"its {name}() is abstract (not implemented)"]
    if inspect.iscoroutinefunction(fn) != coroutine:
        kind = "an async def" if coroutine else "a plain (blocking) def"
        return [f"its {name}() must be {kind}"]
    params = parameters(fn)
    if params is None:
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    problems = []
    ordered = [p for p in params.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in ordered)
    if not var_positional and len(ordered) < 1 + len(positional):
        problems.append(
            f"its {name}() takes too few arguments (stagerun passes {', '.join(positional)})"
        )
    for keyword in keywords:
        p = params.get(keyword)
        if p is None or p.kind is inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"its {name}() lacks the keyword parameter {keyword!r}")
    return problems


def _class_problems(obj: Any) -> list[str]:
    if not inspect.isclass(obj):
        return [f"it is a {type(obj).__name__}, not a class"]
    abstract = sorted(getattr(obj, "__abstractmethods__", ()))
    if abstract:
        return [f"it leaves abstract methods unimplemented: {', '.join(abstract)}"]
    return []


def _validate_transport(obj: Any) -> list[str]:
    problems = _class_problems(obj)
    if problems:
        return problems
    schemes = getattr(obj, "schemes", None)
    if not (
        isinstance(schemes, tuple) and schemes and all(isinstance(s, str) and s for s in schemes)
    ):
        problems.append("its schemes must be a non-empty tuple of strings, like ('tcp',)")
    problems += _check_method(
        obj, "connect", coroutine=True, positional=("address",), keywords=("timeout",)
    )
    problems += _check_method(
        obj, "serve", coroutine=True, positional=("address", "handler"), keywords=("task_status",)
    )
    return problems


def _validate_backend(obj: Any) -> list[str]:
    problems = _class_problems(obj)
    if problems:
        return problems
    problems += _check_method(
        obj, "__init__", coroutine=False, positional=("model", "layers"), keywords=("threads",)
    )
    for prop in ("layers", "is_first", "is_last"):
        if inspect.getattr_static(obj, prop, None) is None:
            problems.append(f"it has no {prop} property")
    problems += _check_method(obj, "new_cache", coroutine=False)
    problems += _check_method(
        obj,
        "forward",
        coroutine=False,
        positional=("cache", "position"),
        keywords=("tokens", "hidden", "logits", "should_stop"),
    )
    return problems


def _validate_drafter(obj: Any) -> list[str]:
    problems = _class_problems(obj)
    if problems:
        return problems
    problems += _check_method(obj, "begin", coroutine=False, positional=("prompt",))
    problems += _check_method(obj, "commit", coroutine=False, positional=("tokens",))
    problems += _check_method(obj, "propose", coroutine=False, positional=("context", "max_tokens"))
    create = inspect.getattr_static(obj, "create", None)
    if create is not None and not isinstance(create, classmethod):
        problems.append("its create must be a classmethod taking the drafter options")
    return problems


# By plugin kind; model families are checked by `stagerun.model.make_family` instead.
VALIDATORS: dict[str, Callable[[Any], list[str]]] = {
    "transports": _validate_transport,
    "backends": _validate_backend,
    "drafters": _validate_drafter,
}
