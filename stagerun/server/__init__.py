"""The OpenAI-compatible HTTP server behind ``stagerun serve``.

`create_app` turns a running `stagerun.Pipeline` into an ASGI app served with an `HttpConfig`
(every HTTP setting, checked once); `serve` is the whole
``stagerun serve`` command (pipeline, hypercorn, signals). See docs/api.md.

Each name is imported from its module on first use: the command line reads the HTTP settings'
defaults (`._config`) in every ``stagerun`` process, stage processes included, which need
neither Starlette nor hypercorn (0.17 s of a process's start).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._admission import Admission as Admission
    from ._admission import Ticket as Ticket
    from ._app import create_app as create_app
    from ._config import HttpConfig as HttpConfig
    from ._openai import ApiError as ApiError
    from ._openai import GenerationRequest as GenerationRequest
    from ._openai import parse_generation_request as parse_generation_request
    from ._serve import ServeError as ServeError
    from ._serve import ServeOptions as ServeOptions
    from ._serve import serve as serve

# each public name -> the module that defines it
_MODULES = {
    "Admission": "_admission",
    "Ticket": "_admission",
    "create_app": "_app",
    "HttpConfig": "_config",
    "ApiError": "_openai",
    "GenerationRequest": "_openai",
    "parse_generation_request": "_openai",
    "ServeError": "_serve",
    "ServeOptions": "_serve",
    "serve": "_serve",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
