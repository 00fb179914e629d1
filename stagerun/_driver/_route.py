"""A request's way through the stages after stage 0: a lane of the pool, or none at all.

Theory of operation: a request on stage 0 computes its own layers through stage 0's engine,
then hands each message to its `Route`, which takes it the rest of the way and brings back
what the last stage answers. `Request` and the speculative decoder see nothing else, so a
request takes the same steps on one stage as on many:

* `LaneRoute` is a lane checked out of the pool: ``Configure`` and the prompt's chunks go
  down it (`stagerun._driver._prefill.send_prefill`), every later stage computes and the last
  one answers on the lane's return connection.
* `LocalRoute` is a one-stage pipeline, where stage 0 is the last stage too: what it computes
  are logits, and the engine answers them at once, as a last stage would (`StageEngine.answer`:
  sampled by position from the request's seed). Its prefill is one compute of the prompt,
  not chunks; windows are answered as they are sent, so nothing is ever in flight to cancel.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import attrs
import numpy as np
import trio

from .. import _proto
from .._decide._prefill import ChunkPolicy, PrefillTransportEstimate
from .._engine import Session, StageEngine
from ._lanes import Lane
from ._prefill import PrefillReport, send_prefill

__all__ = ["SCORING_CHUNK", "LaneRoute", "LocalRoute", "Prefilled", "Prefilling", "Route"]

SCORING_CHUNK = 64
"""Prompt tokens per prefill chunk of a request that scores its prompt: the last stage
computes every row's logits for it (64 rows of a 262k vocabulary are 67 MB)."""


class Prefilling(Protocol):
    """What a route's prefill uses of its request (`stagerun._driver._request.Request`)."""

    request_id: int
    prompt_ids: list[int]
    sampling: _proto.SamplingParams
    session: Session  # the request's session on stage 0, restored from its prefix cache

    async def compute(self, message: _proto.ActivationMessage) -> np.ndarray[Any, Any]:
        """Stage 0's own layers for ``message``, on the request's session."""
        ...


@attrs.frozen
class Prefilled:
    """How a prefill went: the token that follows the context, where it started, its chunks."""

    token: int
    start: int  # the positions before it were restored from the prefix caches
    report: PrefillReport | None = None  # None: one compute on stage 0, no lane
    reply: _proto.Predictions | None = None  # the last stage's answer to the last chunk


class Route(Protocol):
    """A request's way from stage 0 through the later stages and back."""

    direct_return: bool  # predictions come back on a return connection stage 0 opened

    async def prefill(self, request: Prefilling, context: list[int], names: list[int]) -> Prefilled:
        """Prefill ``context``, whose blocks ``names`` stage 0 restored; the next token."""
        ...

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
    ) -> None:
        """Send ``message`` (with stage 0's output for it) on its way."""
        ...

    async def receive_predictions(self, request_id: int) -> _proto.Predictions: ...

    async def receive_reply(self, request_id: int) -> _proto.Predictions | _proto.Cancelled: ...

    async def remember(self, request_id: int, names: list[int]) -> None:
        """Have every later stage keep the blocks ``names`` of the request's cache."""
        ...


@attrs.frozen
class PrefillSettings:
    """How a lane's prefill is chunked and sent (`PipelineConfig`'s, and the pool's estimate)."""

    policy: ChunkPolicy
    credit: int
    wire_dtype: _proto.ActivationDType
    estimate: PrefillTransportEstimate | None


class LaneRoute:
    """A route over a lane of the pool: the later stages compute and the last one answers."""

    direct_return = True

    def __init__(self, lane: Lane, settings: PrefillSettings) -> None:
        self.lane = lane
        self.settings = settings

    def __repr__(self) -> str:
        return f"<LaneRoute lane={self.lane.id}>"

    async def prefill(self, request: Prefilling, context: list[int], names: list[int]) -> Prefilled:
        """Configure the request on the lane and prefill ``context`` from the cached prefix.

        When stage 0 restored some blocks, ``Configure`` asks every stage for the same, and
        their ``Ack`` says how far all of them got (a stage that was restarted, or evicted
        some, holds less): the prefill starts there. Without a prefix to ask about, the ack
        is not waited for: the stages handle frames in order, so the prefill follows at once
        and `send_prefill` reads that ack with its own (a round trip of the whole chain less).
        """
        lane = self.lane
        await lane.send(
            _proto.Configure(
                request_id=request.request_id,
                return_key=lane.return_key,
                prompt_len=len(request.prompt_ids),
                sampling=request.sampling,
                prefix=tuple(names),
            )
        )
        start = 0
        if names:
            start = min(len(names) * _proto.PREFIX_BLOCK, (await lane.receive_ack()).cached)
        settings = self.settings
        report = await send_prefill(
            lane,
            request.request_id,
            context,
            compute0=request.compute,
            policy=settings.policy,
            credit=settings.credit,
            wire_dtype=settings.wire_dtype,
            estimate=settings.estimate,
            start=start,
            configure_owed=not names,
        )
        reply = await lane.receive_predictions(request.request_id)
        return Prefilled(int(reply.tokens[-1]), start, report, reply)

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
    ) -> None:
        await self.lane.send(message, activations, dtype)

    async def receive_predictions(self, request_id: int) -> _proto.Predictions:
        return await self.lane.receive_predictions(request_id)

    async def receive_reply(self, request_id: int) -> _proto.Predictions | _proto.Cancelled:
        return await self.lane.receive_reply(request_id)

    async def remember(self, request_id: int, names: list[int]) -> None:
        """``Remember`` is not acknowledged: the stages copy while stage 0 goes on."""
        await self.lane.send(_proto.Remember(request_id=request_id, prefix=tuple(names)))


class LocalRoute:
    """A one-stage pipeline's route: stage 0's engine answers what stage 0 computes."""

    direct_return = False

    def __init__(self, engine: StageEngine) -> None:
        self.engine = engine
        self._session: Session | None = None
        self._send, self._replies = trio.open_memory_channel[_proto.Predictions](math.inf)

    def __repr__(self) -> str:
        return f"<LocalRoute replies={self._replies.statistics().current_buffer_used}>"

    async def prefill(self, request: Prefilling, context: list[int], names: list[int]) -> Prefilled:
        """One compute of the rest of ``context`` (as one stage alone computes it).

        A request that scores its prompt computes it in chunks of `SCORING_CHUNK` (every
        row's logits are computed then, and a whole prompt's would not fit in memory).
        """
        self._session = request.session
        start = len(names) * _proto.PREFIX_BLOCK
        scoring = request.sampling.prompt_logprobs >= 0
        step = SCORING_CHUNK if scoring else len(context) - start
        index, position = 0, start
        while True:
            end = min(position + step, len(context))
            message = _proto.Prefill(
                request_id=request.request_id,
                chunk_index=index,
                position=position,
                tokens=tuple(context[position:end]),
                predict=end == len(context),
            )
            logits = await request.compute(message)
            if message.predict:
                break
            index, position = index + 1, end
        answer = self.engine.answer(request.session, message, logits)
        return Prefilled(answer.tokens[-1], start, None, answer)

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
    ) -> None:
        """Answer a ``Decode`` or ``Verify`` whose ``activations`` are stage 0's logits."""
        if isinstance(message, _proto.Cancel):
            return  # every window was answered when it was sent
        if not isinstance(message, _proto.Decode | _proto.Verify) or activations is None:
            raise TypeError(f"a one-stage pipeline has no next stage to send {message!r} to")
        assert self._session is not None, "a request prefills before it decodes"
        self._send.send_nowait(self.engine.answer(self._session, message, activations))

    async def receive_predictions(self, request_id: int) -> _proto.Predictions:
        return await self._replies.receive()

    async def receive_reply(self, request_id: int) -> _proto.Predictions | _proto.Cancelled:
        return await self._replies.receive()

    async def remember(self, request_id: int, names: list[int]) -> None:
        """Stage 0 is every stage: it has kept the blocks already."""
