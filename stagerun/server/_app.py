"""The HTTP application: OpenAI-compatible routes, health and metrics, on Starlette.

Theory of operation: `create_app` wires a running `Pipeline` into a Starlette app. The outer
`RequestContext` ASGI wrapper gives every request an id (the client's ``x-request-id`` or a
new one, echoed in the response), refuses a ``Host`` the server does not answer for (421), a
missing or wrong API key on ``/v1/*`` (401) and a ``/v1/*`` POST that is not JSON (415), gives
the body ``body_timeout`` seconds to arrive (408), starts the request's ``request_timeout``
clock, and records the status and duration of every answer. A completion handler parses and checks the request (pure code in
`_openai`), tokenizes the prompt, asks `Admission` for a ticket that reserves the KV cache
the request can grow to (400 when it could never fit ``--kv-budget``, 429 when the line is
full) and returns a `GenerationResponse` that does the rest. Every error leaves in the OpenAI
envelope.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._driver._pipeline import Pipeline
from .._driver._supervise import NOT_SERVING, StageProcess, is_serving
from .._driver._values import StageHealth
from .._proto import SamplingParams
from ._admission import (
    Admission,
    Ticket,
    default_kv_budget,
    kv_bytes_per_token,
    prompt_char_limit,
)
from ._generation import GenerationResponse, json_message
from ._metrics import CONTENT_TYPE, BusySampler, Metrics, tick_summary
from ._openai import (
    ApiError,
    GenerationRequest,
    Kind,
    error_envelope,
    parse_generation_request,
    parse_json_body,
    too_long,
)
from ._responses import ResponseShape
from ._state import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_WRITE_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
    AllowedHosts,
    ServerState,
)

log = logging.getLogger("stagerun.server")

ENDPOINTS = frozenset(
    {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
)
# What a /v1/* POST must say it sends. A web page can POST text/plain, form data or no type at
# all to any server without the browser asking the server first (a CORS "simple request").
JSON_MEDIA_TYPE = "application/json"


def create_app(
    pipeline: Pipeline,
    *,
    model_id: str | None = None,
    model_aliases: Iterable[str] = (),
    max_batch: int | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    kv_budget: int | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
    max_tokens_limit: int = MAX_TOKENS_LIMIT,
    allowed_hosts: AllowedHosts | Iterable[str] | None = None,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
) -> ASGIApp:
    """The ASGI app serving ``pipeline``.

    Args:
        model_id: the id ``/v1/models`` reports (default: the model's name).
        model_aliases: further ids requests may name (the ``--model`` string, the file name).
        max_batch: requests generating at once (default: the lane pool's capacity, or 1);
            at most the lane pool's capacity, so every running request finds a lane.
        max_queue: requests that may wait for a slot and budget before the server answers 429.
        kv_budget: bytes of KV cache the running requests may reserve together (default:
            `default_kv_budget` of the model and ``max_batch``).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_tokens_default: the tokens a chat request that names no ``max_tokens`` gets
            (a completion request gets OpenAI's 16).
        max_tokens_limit: the most tokens any request generates; a larger ``max_tokens``
            is cut to it (the reply then ends with ``finish_reason: "length"``).
        allowed_hosts: the ``Host`` headers answered (`AllowedHosts`, or entries for
            `AllowedHosts.parse`); others get 421. None (the default, for an app embedded
            behind a server of your own) checks nothing; `stagerun serve` passes its bound
            address and the loopback names.
        request_timeout: seconds a generation request may take from its arrival, queue wait
            included; then it ends with 504 (or an error event, once streaming).
        write_timeout: seconds generation waits for the client to take the previous piece
            of its answer; then the request is cancelled and its slot released.
        body_timeout: seconds the request body may take to arrive; then 408.
    """
    for name, seconds in (
        ("request_timeout", request_timeout),
        ("write_timeout", write_timeout),
        ("body_timeout", body_timeout),
    ):
        if not seconds > 0:
            raise ValueError(f"{name} must be more than 0 seconds, got {seconds}")
    if allowed_hosts is not None and not isinstance(allowed_hosts, AllowedHosts):
        allowed_hosts = AllowedHosts.parse(allowed_hosts)
    if not 1 <= max_tokens_default <= max_tokens_limit:
        raise ValueError(
            f"the default max_tokens ({max_tokens_default}) must be between 1 and the "
            f"limit ({max_tokens_limit})"
        )
    max_batch = _checked_max_batch(pipeline, max_batch)
    if kv_budget is None:
        kv_budget = default_kv_budget(pipeline.config, max_batch)
    name = model_id or pipeline.config.name
    metrics = Metrics()
    state = ServerState(
        pipeline=pipeline,
        admission=Admission(max_batch, max_queue, kv_budget, on_start=metrics.observe_running),
        model_id=name,
        model_aliases=frozenset({*model_aliases, pipeline.config.name}) - {name},
        kv_bytes_per_token=kv_bytes_per_token(pipeline.config),
        metrics=metrics,
        max_body_bytes=max_body_bytes,
        max_tokens_default=max_tokens_default,
        max_tokens_limit=max_tokens_limit,
        request_timeout=request_timeout,
        write_timeout=write_timeout,
        body_timeout=body_timeout,
    )
    app = Starlette(
        routes=[
            Route("/v1/models", _models, methods=["GET"]),
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
            Route("/health", _health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: _api_error_response,
            HTTPException: _http_error_response,
            Exception: _internal_error_response,
        },
    )
    app.state.stagerun = state
    app.state.busy = {"health": BusySampler(pipeline), "metrics": BusySampler(pipeline)}
    return RequestContext(app, state, api_key=api_key, allowed_hosts=allowed_hosts)


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


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.stagerun
    return state


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"there is no {request.url.path}; see docs/api.md for the endpoints"
        body = error_envelope(message, code="not_found")
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; use {exc.headers and exc.headers.get('Allow')}"
        body = error_envelope(message, code="method_not_allowed")
    else:
        body = error_envelope(str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    body = error_envelope(f"internal error: {type(exc).__name__}", type="api_error")
    return JSONResponse(body, status_code=500)


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(
        413,
        f"the request body is larger than {limit} bytes; shorten the prompt",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    # str.isdigit takes '²', which int() refuses; 20 digits or more is beyond any limit
    if length.isascii() and length.isdigit() and (len(length) >= 20 or int(length) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: no traceback in the log for a client's leaving
        raise ApiError(400, "the client left before its request body ended") from None
    return b"".join(chunks)


async def _models(request: Request) -> Response:
    state = _state(request)
    entry = {
        "id": state.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "stagerun",
        "context_length": state.pipeline.config.context_length,
    }
    return JSONResponse({"object": "list", "data": [entry]})


async def _completions(request: Request) -> Response:
    return await _generation(request, "completion")


async def _chat_completions(request: Request) -> Response:
    return await _generation(request, "chat")


async def _prompt_ids(state: ServerState, req: GenerationRequest) -> tuple[list[int], str]:
    """The prompt's token ids, and the request field they came from.

    Token ids are checked against the vocabulary here. Text is bounded by characters first
    (`prompt_char_limit`: a longer one could never fit the context), then rendered (a chat) and
    tokenized in a tokenizer thread (`Admission.tokenize`, 429 when its line is full), so
    neither a long prompt nor a slow chat template holds up the event loop.
    """
    pipeline = state.pipeline
    prompt = req.prompt
    if isinstance(prompt, tuple):
        vocab = pipeline.config.vocab_size
        for i, token in enumerate(prompt):
            if token >= vocab:
                raise ApiError(
                    400,
                    f"token id {token} at prompt[{i}] is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                )
        return list(prompt), "prompt"
    context = pipeline.config.context_length
    limit = prompt_char_limit(pipeline.tokenizer, context)
    param = "messages" if req.kind == "chat" else "prompt"

    def bounded(text: str) -> str:
        if len(text) > limit:
            why = f", which no text over {limit} characters fits"
            raise too_long(len(text), "characters", context, param, why)
        return text

    def tokenize() -> list[int]:  # in a worker thread
        if req.kind == "completion":
            return pipeline.encode_prompt(prompt)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        # ModelFile.apply_chat_template's two steps, with the bound between them
        text = bounded(pipeline.render_chat(messages))
        return pipeline.tokenizer.encode(text, special=True, add_bos=False)

    if req.kind == "completion":
        bounded(prompt)
    try:
        ids = await state.admission.tokenize(tokenize)
    except ValueError as exc:  # a chat template that refuses the messages
        raise ApiError(400, str(exc), param="messages") from exc
    if ids is None:
        raise ApiError(
            429,
            f"the server is busy ({state.admission.tokenizing} prompts being tokenized); "
            "retry after a second",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    return ids, param


async def _generation(request: Request, kind: Kind) -> Response:
    state = _state(request)
    body = await _read_body(request, state.max_body_bytes)
    context = state.pipeline.config.context_length
    req = parse_generation_request(parse_json_body(body), kind, context_length=context)
    state.check_model(req.model)
    prompt_ids, param = await _prompt_ids(state, req)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty after tokenization: give some text", param=param)
    if len(prompt_ids) >= context:
        raise too_long(len(prompt_ids), "tokens", context, param)
    room = min(context - len(prompt_ids), state.max_tokens_limit)
    if req.max_tokens is not None:
        max_tokens = min(req.max_tokens, room)
    elif kind == "completion":
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    else:
        max_tokens = min(state.max_tokens_default, room)
    sampling = SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=secrets.randbits(63) if req.seed is None else req.seed,
    )
    ticket = _admit(state, len(prompt_ids), max_tokens)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    shape = ResponseShape(req, prefix + secrets.token_hex(12), req.model)
    return GenerationResponse(
        state,
        shape,
        prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        ticket=ticket,
        label=request.scope.get("stagerun.request_id"),
    )


def _admit(state: ServerState, prompt_tokens: int, max_tokens: int) -> Ticket:
    """A ticket reserving the KV cache of (prompt + max_tokens) tokens, or the refusal."""
    adm = state.admission
    tokens = prompt_tokens + max_tokens
    reserve = tokens * state.kv_bytes_per_token
    if adm.never_fits(reserve):
        fits = (adm.kv_budget or 0) // max(state.kv_bytes_per_token, 1)
        raise ApiError(
            400,
            f"the request needs KV cache for {tokens} tokens ({prompt_tokens} of prompt + "
            f"max_tokens {max_tokens}, {reserve} bytes) but the server's --kv-budget "
            f"({adm.kv_budget} bytes) holds {fits} tokens; shorten the prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    ticket = adm.try_admit(reserve)
    if ticket is None:
        raise ApiError(
            429,
            f"the server is busy ({adm.running} requests running, {adm.queued} waiting); "
            "retry after a second",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    return ticket


def _busy(request: Request, endpoint: Literal["health", "metrics"]) -> dict[int, float]:
    """Each stage's busy fraction since ``endpoint``'s previous call (see `BusySampler`)."""
    sampler: BusySampler = request.app.state.busy[endpoint]
    return sampler.sample()


def _stage_entries(
    pipeline: Pipeline, health: Sequence[StageHealth], busy: dict[int, float]
) -> list[dict[str, Any]]:
    """``/health``'s stages: each probe, its ``busy`` fraction, and stage 0's ``batch``.

    A supervised stage whose process is not running has that process's state as its own
    (``starting``, ``restarting``, ``failed``; the handshake's result is kept as ``probe``):
    whatever answers on its address then is not that process.
    """
    entries = [h.to_json() for h in health]
    for h, entry in zip(health, entries, strict=True):
        process = h.stage.process
        if isinstance(process, StageProcess) and process.state in NOT_SERVING:
            entry["probe"], entry["state"] = entry["state"], process.state
        if entry["index"] in busy:
            entry["busy"] = round(busy[entry["index"]], 4)
        if entry["index"] == 0:
            entry["batch"] = tick_summary(pipeline.scheduler)
    return entries


async def _health(request: Request) -> Response:
    state = _state(request)
    health = await state.pipeline.check_health(timeout=state.health_timeout)
    busy = _busy(request, "health")
    healthy = all(is_serving(h) for h in health)
    pool = state.pipeline.pool
    lanes = None
    if pool is not None:
        lanes = {
            "capacity": pool.capacity,
            "idle": pool.idle,
            "busy": pool.busy,
            "replaced": pool.replaced,
            "replace_failures": pool.replace_failures,
        }
    adm = state.admission
    body = {
        "status": "ok" if healthy else "unhealthy",
        "model": state.model_id,
        "stages": _stage_entries(state.pipeline, health, busy),
        "lanes": lanes,
        "requests": {
            "running": adm.running,
            "queued": adm.queued,
            "max_batch": adm.max_batch,
            "max_queue": adm.max_queue,
            "rejected": adm.rejected,
            "kv_reserved_bytes": adm.reserved,
            "kv_budget_bytes": adm.kv_budget,
        },
    }
    return JSONResponse(body, status_code=200 if healthy else 503)


async def _metrics(request: Request) -> Response:
    state = _state(request)
    health = await state.pipeline.check_health(timeout=state.health_timeout)
    text = state.metrics.render(
        admission=state.admission,
        pool=state.pipeline.pool,
        health=health,
        pipeline=state.pipeline,
        busy=_busy(request, "metrics"),
    )
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= 200 and value.isascii() and value.isprintable()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


class RequestContext:
    """ASGI wrapper: request ids, the Host, API key and content type checks, the body's
    deadline, the request's clock, and per-request metrics."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        *,
        api_key: str | None,
        allowed_hosts: AllowedHosts | None = None,
    ) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.allowed_hosts = allowed_hosts

    def __repr__(self) -> str:
        hosts = "any" if self.allowed_hosts is None else "checked"
        return (
            f"<RequestContext auth={'on' if self.api_key else 'off'} hosts={hosts} "
            f"{self.state.admission!r}>"
        )

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or not scope["path"].startswith("/v1/"):
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self.api_key.encode()
                )
        return False

    def _refusal(self, scope: Scope) -> ApiError | None:
        """Why the request is answered without reaching the app, if it is (decide, then do)."""
        if self.allowed_hosts is not None:
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            for host in hosts:  # none at all is HTTP/1.0, which no browser sends
                if not self.allowed_hosts.allows(host):
                    return ApiError(
                        421,
                        f"this server does not answer for the host {host!r}; use its address, "
                        "or start it with --allowed-hosts naming that host",
                        code="invalid_host",
                    )
        if not self._authorized(scope):
            return ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        if scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            given = _header(scope, b"content-type")
            media_type = (given or "").partition(";")[0].strip().lower()
            if media_type != JSON_MEDIA_TYPE:
                return ApiError(
                    415,
                    f"the request body must be JSON, sent with 'Content-Type: {JSON_MEDIA_TYPE}'"
                    f" (got {'no Content-Type' if given is None else repr(given)})",
                    code="unsupported_media_type",
                )
        return None

    def _body_in_time(self, receive: Receive) -> Receive:
        """``receive``, but the whole request body must arrive within ``body_timeout``.

        A body that does not is answered 408 (raised as `ApiError` to whoever reads it) and
        the connection is closed; once the body is in, ``receive`` waits as long as it likes
        (for ``http.disconnect``).
        """
        timeout = self.state.body_timeout
        deadline = trio.current_time() + timeout
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            with trio.move_on_at(deadline):
                message = await receive()
                complete = message["type"] != "http.request" or not message.get("more_body")
                return message
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout:g} s (the server's body "
                "timeout); send the whole request at once",
                code="request_timeout",
                headers={"connection": "close"},
            )

        return receive_in_time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (_header(scope, b"x-request-id") or "").strip()
        if not _valid_request_id(request_id):
            request_id = str(uuid.uuid4())
        scope["stagerun.request_id"] = request_id
        scope["stagerun.deadline"] = trio.current_time() + self.state.request_timeout
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, self._body_in_time(receive), send_with_id)
            else:
                headers = [
                    (b"content-type", b"application/json"),
                    *((k.encode(), v.encode()) for k, v in refusal.headers.items()),
                ]
                for message in json_message(refusal.status, refusal.envelope(), headers):
                    await send_with_id(message)
        finally:
            path = scope["path"]
            endpoint = path if path in ENDPOINTS else "other"
            self.state.metrics.observe_request(endpoint, status, time.perf_counter() - started)
