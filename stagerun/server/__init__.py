"""The OpenAI-compatible HTTP server behind ``stagerun serve``.

`create_app` turns a running `stagerun.Pipeline` into an ASGI app served with an `HttpConfig`
(every HTTP setting, checked once); `serve` is the whole
``stagerun serve`` command (pipeline, hypercorn, signals). See docs/api.md.
"""

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

__all__ = [
    "Admission",
    "ApiError",
    "GenerationRequest",
    "HttpConfig",
    "ServeError",
    "ServeOptions",
    "Ticket",
    "create_app",
    "parse_generation_request",
    "serve",
]
