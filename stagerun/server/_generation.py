"""Running one admitted completion request as an ASGI response, streaming or not.

Theory of operation: `GenerationResponse` is a Starlette response whose ``__call__`` opens a
nursery with two tasks. One waits for the request's admission ticket, runs
``pipeline.generate`` and sends the answer through ``send``; the other watches ``receive()``
and, on ``http.disconnect``, cancels the nursery with a reason. Cancelling leaves the
generate block early, which cancels the request in the pipeline: its lane is closed and
replaced, never reused half-way. The ticket (a slot and the KV bytes it reserved) is released
as soon as generation ends, before the last HTTP write, so a slow client does not hold back
the next request; the outer ``finally`` releases it on every other path (release is
idempotent).

The status line is sent with the first piece of output (or the error), not before: a
request that fails before it produced anything (a dead stage, a reply timeout) still gets its
proper HTTP status (502, 504) in the error envelope. A failure after output has begun is
reported as one last SSE event carrying the envelope, and the stream ends without
``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import trio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from .._driver._values import Completion
from .._errors import LaneError, LaneTimeoutError, StageError, StagerunError
from .._proto import SamplingParams
from ._admission import Ticket
from ._openai import ApiError
from ._responses import DONE_EVENT, ResponseShape, sse_event

if TYPE_CHECKING:
    from ._state import ServerState

log = logging.getLogger("stagerun.server")

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def api_error_from(exc: Exception) -> ApiError:
    """Translate a pipeline failure into the error a client sees."""
    match exc:
        case ApiError():
            return exc
        case LaneTimeoutError():
            return ApiError(
                504,
                f"a pipeline stage did not answer in time ({exc}); retry later",
                type="api_error",
                code="upstream_timeout",
            )
        case LaneError() | StageError():
            return ApiError(
                502,
                f"a pipeline stage failed ({exc}); retry later",
                type="api_error",
                code="upstream_error",
            )
        case ValueError():
            return ApiError(400, str(exc))
        case StagerunError():
            return ApiError(500, str(exc), type="api_error")
        case _:
            log.error("request failed unexpectedly", exc_info=exc)
            return ApiError(500, f"internal error: {type(exc).__name__}", type="api_error")


def json_message(status: int, payload: Any, headers: list[tuple[bytes, bytes]]) -> list[Message]:
    body = json.dumps(payload, ensure_ascii=False).encode()
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        },
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


class GenerationResponse(Response):
    """Runs an admitted request to the end, or until the client goes away."""

    def __init__(
        self,
        state: ServerState,
        shape: ResponseShape,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        sampling: SamplingParams,
        ticket: Ticket,
        label: str | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self.label = label  # the HTTP request id, for the request's telemetry
        self.state = state
        self.shape = shape
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.ticket = ticket
        self._started = False
        self._finished = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                if self.shape.request.stream:
                    await self._stream(send)
                else:
                    await self._whole(send)
                nursery.cancel_scope.cancel(reason="response complete")
        finally:
            self.ticket.release()

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self._finished:
            self.state.metrics.disconnects += 1
            scope.cancel(reason=f"client of {self.shape.id} disconnected")

    async def _run(self, on_text: Any) -> Completion:
        await self.ticket.wait()
        stream_text = on_text is not None
        try:
            async with self.state.pipeline.generate(
                self.prompt_ids,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                stop=self.shape.request.stop,
                label=self.label,
            ) as stream:
                async for chunk in stream:
                    if stream_text and chunk.text:
                        await on_text(chunk.text)
        finally:
            self.ticket.release()  # the lane is back in the pool: let the next one run
        assert stream.result is not None
        result = stream.result
        self.state.metrics.observe_tokens(len(result.prompt_token_ids), len(result.token_ids))
        self.state.metrics.observe_timings(result.timings)
        return result

    async def _send_error(self, send: Send, error: ApiError) -> None:
        self._finished = True
        headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        for message in json_message(error.status, error.envelope(), headers):
            await send(message)

    async def _whole(self, send: Send) -> None:
        try:
            result = await self._run(None)
        except Exception as exc:
            await self._send_error(send, api_error_from(exc))
            return
        self._finished = True
        for message in json_message(200, self.shape.final(result), JSON_HEADERS):
            await send(message)

    async def _stream(self, send: Send) -> None:
        first = self.shape.first_chunk()

        async def event(payload: dict[str, Any], *, more: bool = True) -> None:
            nonlocal first
            if not self._started:
                self._started = True
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            if first is not None:
                opening, first = first, None
                await event(opening)
            await send(
                {"type": "http.response.body", "body": sse_event(payload), "more_body": more}
            )

        async def on_text(text: str) -> None:
            await event(self.shape.text_chunk(text))

        try:
            result = await self._run(on_text)
        except Exception as exc:
            error = api_error_from(exc)
            if not self._started:
                await self._send_error(send, error)
            else:
                self._finished = True
                await event(error.envelope(), more=False)
            return
        await event(self.shape.finish_chunk(result.finish_reason))
        if self.shape.request.include_usage:
            await event(self.shape.usage_chunk(result))
        self._finished = True
        await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})
