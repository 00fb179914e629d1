"""The HTTP application: OpenAI-compatible routes, health and metrics, on Starlette.

Theory of operation: `create_app` wires a running `Pipeline` into a Starlette app, served
with one `HttpConfig`. The outer `RequestContext` ASGI wrapper (`._request_context`) checks the
host, the API key and the content type, bounds the body's arrival and starts the request's
clock, and tells clients apart (whose API key, which address: `._clients.Client`); the
routes are the completions (`._completions`: parse, tokenize, admit, generate), ``/health``
and ``/metrics`` (`._health`), and the web page at ``/`` (`._ui`). Every error leaves in the
OpenAI envelope.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from .._driver._pipeline import Pipeline
from ._admission import Admission, default_kv_budget, kv_bytes_per_token
from ._completions import chat_completions, completions, models
from ._config import HttpConfig
from ._health import health, metrics
from ._hosts import AllowedHosts
from ._metrics import BusySampler, Metrics
from ._openai import ApiError, error_envelope
from ._request_context import RequestContext
from ._state import ServerState
from ._tokenize import detokenize, model, tokenize
from ._ui import new_snapshot, ui_routes

log = logging.getLogger("stagerun.server")


def create_app(
    pipeline: Pipeline,
    config: HttpConfig | None = None,
    *,
    model_id: str | None = None,
    model_aliases: Iterable[str] = (),
    allowed_hosts: AllowedHosts | Iterable[str] | None = None,
    **settings: Any,
) -> ASGIApp:
    """The ASGI app serving ``pipeline``.

    Args:
        config: the server's settings (`HttpConfig`, which documents them; default
            `HttpConfig()`); ``max_batch`` may not exceed the lane pool's capacity.
        model_id: the id ``/v1/models`` reports (default: the model's name). The names the
            pipeline was opened with (``smollm2``, a path and its file name) are taken too.
        model_aliases: further ids requests may name (the ``--model`` string, the file name).
        allowed_hosts: the ``Host`` headers answered (`AllowedHosts`, or entries for
            `AllowedHosts.parse`); others get 421. None (the default, for an app embedded
            behind a server of your own) checks nothing; `stagerun serve` passes its bound
            address, the loopback names and `HttpConfig.allowed_hosts`.
        settings: `HttpConfig` fields by name, in place of ``config`` or replacing some of
            its settings: ``create_app(pipeline, max_queue=0)``, or ``create_app(pipeline,
            api_key=["tenant-a-key", "tenant-b-key"], prefix_share="client")`` for two
            tenants that share no cached prefixes and see no ``/metrics`` without a key.

    Raises:
        ValueError: a setting is out of range, the API key is empty, or ``max_batch``
            exceeds the lane pool.
    """
    config = HttpConfig.from_settings(config, settings)
    if config.api_key is not None and not config.api_keys:
        # (an unset variable, say): never a quiet "no authentication"
        raise ValueError("the API key is empty (or only comments): give a key, or None")
    if allowed_hosts is not None and not isinstance(allowed_hosts, AllowedHosts):
        allowed_hosts = AllowedHosts.parse(allowed_hosts)
    max_batch = _checked_max_batch(pipeline, config.max_batch)
    kv_budget = config.kv_budget
    if kv_budget is None:
        kv_budget = default_kv_budget(pipeline.config, max_batch)
    name = model_id or pipeline.config.name
    stats = Metrics()
    admission = Admission(max_batch, config.max_queue, kv_budget, on_start=stats.observe_running)
    state = ServerState(
        pipeline=pipeline,
        admission=admission,
        model_id=name,
        model_aliases=frozenset({*model_aliases, *pipeline.names}) - {name},
        kv_bytes_per_token=kv_bytes_per_token(pipeline.config),
        metrics=stats,
        http=config,
    )
    app = Starlette(
        routes=[
            *(ui_routes() if config.ui else []),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: _api_error_response,
            HTTPException: _http_error_response,
            Exception: _internal_error_response,
        },
    )
    app.state.stagerun = state
    app.state.busy = {endpoint: BusySampler(pipeline) for endpoint in ("health", "metrics", "ui")}
    app.state.ui_snapshot = new_snapshot()
    return RequestContext(app, state, allowed_hosts=allowed_hosts)


def _checked_max_batch(pipeline: Pipeline, max_batch: int | None) -> int:
    lanes = pipeline.pool.capacity if pipeline.pool is not None else None
    if max_batch is None:
        return lanes or 1
    if lanes is not None and max_batch > lanes:
        raise ValueError(
            f"max_batch ({max_batch}) is more than the lane pool's {lanes} lanes; start the "
            f"pipeline with capacity={max_batch} or more"
        )
    return max_batch


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"there is no {request.url.path}; see docs/api.md for the endpoints"
        body = error_envelope(message, code="not_found")
    elif exc.status_code == 405:
        allowed = exc.headers and exc.headers.get("Allow")
        message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        body = error_envelope(message, code="method_not_allowed")
    else:
        body = error_envelope(str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    body = error_envelope(f"internal error: {type(exc).__name__}", type="api_error")
    return JSONResponse(body, status_code=500)
