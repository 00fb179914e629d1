"""Running one admitted completion request as an ASGI response, streaming or not.

Theory of operation: `GenerationResponse` is a Starlette response whose ``__call__`` opens a
nursery with three tasks. One waits for the request's admission ticket, runs
``pipeline.generate`` and hands each message of the answer to a writer task, which alone
calls ``send``; the third watches ``receive()`` and, on ``http.disconnect``, cancels the
nursery with a reason. Cancelling leaves the generate block early, which cancels the request
in the pipeline: its lane is closed and replaced, never reused half-way. The ticket (a slot
and the KV bytes it reserved) is released as soon as generation ends, before the last HTTP
write, so a slow client does not hold back the next request; the outer ``finally`` releases
it on every other path (release is idempotent).

Two deadlines bound a request. The request deadline (``request_timeout`` from its arrival,
queue wait included) ends generation with a 504, or with an error event once streaming has
begun. The write deadline bounds how long generation waits for the client to take the
previous message: a client that stops reading makes ``send`` block once the socket's buffers
are full, and the generation task gives up after ``write_timeout`` (cancelling the request
and releasing its ticket) rather than wait with it. Generation never calls ``send`` itself
because a deadline around ``send`` is not enough: hypercorn writes to the socket inside a
shielded cancel scope, so a blocked ``send`` cannot be cancelled at all. The writer task stays
blocked until the connection is closed under it; `stagerun serve` sets ``TCP_USER_TIMEOUT``
on its sockets so that the kernel does that after the same ``write_timeout``.

The status line is sent with the first piece of output (or the error), not before: a
request that fails before it produced anything (a dead stage, a reply timeout) still gets its
proper HTTP status (502, 504) in the error envelope. A failure after output has begun is
reported as one last SSE event carrying the envelope, and the stream ends without
``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from .._driver._policies import SpeculationConfig
from .._driver._values import Completion, TokenLogprob
from .._errors import LaneError, LaneTimeoutError, StageError, StageGivenUpError, StagerunError
from ._admission import Ticket
from ._clients import client_of, prefix_salt
from ._openai import ApiError
from ._responses import DONE_EVENT, Choice, ResponseShape, echo_entries, entries, sse_event

if TYPE_CHECKING:
    from ._state import ServerState

log = logging.getLogger("stagerun.server")

OnText = Callable[[str, list[TokenLogprob]], Awaitable[None]]
"""Called with each piece of streamed text and the logprobs of the tokens it completes."""

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
        case StageGivenUpError():  # retrying will not help until someone fixes the stage
            return ApiError(
                502, f"the pipeline cannot serve: {exc}", type="api_error", code="stage_failed"
            )
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


class ClientTooSlowError(Exception):
    """The client took none of its answer for the write timeout: the request is given up."""


async def _write_all(messages: trio.MemoryReceiveChannel[Message], send: Send) -> None:
    async with messages:
        async for message in messages:
            await send(message)


class GenerationResponse(Response):
    """Runs an admitted request to the end, or until the client goes away or falls behind."""

    def __init__(
        self,
        state: ServerState,
        shape: ResponseShape,
        choices: list[Choice],
        *,
        max_tokens: int,
        ticket: Ticket,
        label: str | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self.label = label  # the HTTP request id, for the request's telemetry
        self.state = state
        self.shape = shape
        self.choices = choices
        self.max_tokens = max_tokens
        self.ticket = ticket
        self._started = False
        self._finished = False
        self._outbox: trio.MemorySendChannel[Message] | None = None
        self._deadline = 0.0  # trio.current_time() when the request runs out of time
        self._unshown: list[TokenLogprob] = []  # logprobs of tokens no streamed text showed
        self._cache_salt = shape.request.cache_salt  # with the client's domain: `__call__`

    def __repr__(self) -> str:
        return (
            f"<GenerationResponse {self.shape.id} {self.ticket!r} "
            f"started={self._started} finished={self._finished}>"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # `RequestContext` starts the request's clock when the request arrives.
        deadline = scope.get("stagerun.deadline")
        if not isinstance(deadline, float):
            deadline = trio.current_time() + self.state.http.request_timeout
        self._deadline = deadline
        self._cache_salt = prefix_salt(
            client_of(scope).prefix_domain, self.shape.request.cache_salt
        )
        outbox, inbox = trio.open_memory_channel[Message](0)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                async with trio.open_nursery() as writing:
                    writing.start_soon(_write_all, inbox, send)
                    async with outbox:
                        self._outbox = outbox
                        try:
                            await (self._stream() if self.shape.request.stream else self._whole())
                        except ClientTooSlowError as exc:
                            # Nothing more reaches this client. The unfinished response closes
                            # the connection once the writer's blocked send returns.
                            log.warning("request %s given up: %s", self.label or self.shape.id, exc)
                            writing.cancel_scope.cancel(reason=f"{self.shape.id}: {exc}")
                nursery.cancel_scope.cancel(reason="response complete")
        finally:
            self.ticket.release()

    async def _deliver(self, message: Message) -> None:
        """Hand ``message`` to the writer, waiting at most the write timeout for it."""
        assert self._outbox is not None
        timeout = self.state.http.write_timeout
        try:
            with trio.fail_after(timeout):
                await self._outbox.send(message)
        except trio.TooSlowError:
            raise ClientTooSlowError(
                f"its client took none of the answer for {timeout:g} s (the write timeout)"
            ) from None

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self._finished:
            self.state.metrics.disconnects += 1
            scope.cancel(reason=f"client of {self.shape.id} disconnected")

    def _speculation(self) -> SpeculationConfig | None:
        """The request's ``speculative`` over the server's settings (None: the server's).

        ``false`` decodes plainly (no drafter, no forced drafts); ``true`` speculates with the
        server's drafter, or prompt lookup (``ngram``) when the server has none.
        """
        wanted = self.shape.request.speculative
        config = self.state.pipeline.speculation
        if wanted is None:
            return None
        if not wanted:
            return attrs.evolve(config, drafter="off", forced=False)
        return config if config.drafter != "off" else attrs.evolve(config, drafter="ngram")

    async def _run(self, choice: Choice, on_text: OnText | None) -> Completion:
        """Generate ``choice``; the ticket is released after the last choice's generation."""
        await self.ticket.wait()  # at once once admitted
        pending: list[TokenLogprob] = []  # of tokens whose text has not shown yet
        try:
            async with self.state.pipeline.generate(
                choice.prompt_ids,
                max_tokens=self.max_tokens,
                sampling=choice.sampling,
                stop=self.shape.request.stop,
                label=self.label,
                cache_salt=self._cache_salt,
                speculation=self._speculation(),
            ) as stream:
                async for chunk in stream:
                    if chunk.logprob is not None:
                        pending.append(chunk.logprob)
                    if on_text is not None and chunk.text:
                        await on_text(chunk.text, pending)
                        pending = []
        finally:
            if choice is self.choices[-1]:
                self.ticket.release()  # the lane is back in the pool: let the next one run
        assert stream.result is not None
        self._unshown = pending
        result = stream.result
        self.state.metrics.observe_tokens(len(result.prompt_token_ids), len(result.token_ids))
        self.state.metrics.observe_timings(result.timings)
        return result

    async def _generate(self, choice: Choice, on_text: OnText | None) -> Completion | ApiError:
        """The completion, or the error to answer with; within the request's deadline."""
        with trio.move_on_at(self._deadline):
            try:
                return await self._run(choice, on_text)
            except ClientTooSlowError:
                raise
            except Exception as exc:
                return api_error_from(exc)
        timeout = self.state.http.request_timeout
        log.warning("request %s ran past the request timeout (%g s)", self.label, timeout)
        return ApiError(
            504,
            f"the request did not finish within the server's request timeout ({timeout:g} s); "
            "ask for fewer max_tokens, or retry when the server is less busy",
            type="api_error",
            code="request_timeout",
        )

    async def _send_error(self, error: ApiError) -> None:
        self._finished = True
        headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        for message in json_message(error.status, error.envelope(), headers):
            await self._deliver(message)

    async def _whole(self) -> None:
        answers = []
        for choice in self.choices:  # one after another: later ones restore the prompt
            result = await self._generate(choice, None)
            if isinstance(result, ApiError):
                await self._send_error(result)
                return
            answers.append((choice, result))
        self._finished = True
        for message in json_message(200, self.shape.final(answers), JSON_HEADERS):
            await self._deliver(message)

    async def _stream(self) -> None:
        started = False

        async def event(payload: dict[str, Any], *, more: bool = True) -> None:
            nonlocal started
            if not started:
                started = self._started = True
                await self._deliver(
                    {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                )
            await self._deliver(
                {"type": "http.response.body", "body": sse_event(payload), "more_body": more}
            )

        results = []
        for choice in self.choices:
            result = await self._stream_choice(choice, event)
            if result is None:
                return
            results.append(result)
        if self.shape.request.include_usage:
            await event(self.shape.usage_chunk(results))
        self._finished = True
        await self._deliver({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})

    async def _stream_choice(
        self, choice: Choice, event: Callable[..., Awaitable[None]]
    ) -> Completion | None:
        """Stream one choice's chunks; None when it failed (the error was sent)."""
        shape, index = self.shape, choice.index
        opening = shape.first_chunk(index)
        offset = 0  # of the chunk's first token in the completion's text (completions')
        if choice.echo is not None:
            opening = shape.text_chunk(choice.echo, index=index)
            offset = len(choice.echo)

        async def on_text(text: str, logprobs: list[TokenLogprob]) -> None:
            nonlocal offset, opening
            if opening is not None:
                await event(opening)
                opening = None
            wanted = entries(logprobs) if choice.sampling.logprobs >= 0 else None
            await event(shape.text_chunk(text, wanted, offset, index=index))
            offset += shape.spelled_length(entries(logprobs) or [])

        result = await self._generate(choice, None if shape.holds_text else on_text)
        if isinstance(result, ApiError):
            if not self._started:
                await self._send_error(result)
            else:
                self._finished = True
                await event(result.envelope(), more=False)
            return None
        if opening is not None:
            await event(opening)
        finish: str = result.finish_reason
        unshown = entries(self._unshown) or []
        if shape.holds_text:  # the tool calls are parsed from the whole answer
            chunks, finish = shape.held_chunks(result, index)
            for chunk in chunks:
                await event(chunk)
            unshown = []
        if choice.echo is not None and choice.sampling.logprobs >= 0:
            # the prompt's logprobs come once it was scored: in a chunk of their own, at the end
            await event(shape.text_chunk("", echo_entries(choice, result), 0, index=index))
        await event(shape.finish_chunk(finish, unshown, offset, index=index))
        return result
