"""Lanes and the lane pool: stage 0's persistent paths through the pipeline.

Theory of operation (semantics of the original ``PersistentStageLanePool``):

* A `Lane` is a connection down to stage 1 plus a return connection to the last stage,
  bound together by a random ``return_key`` (see docs/architecture.md). Lane ids come from a
  counter and are never reused, so a replacement lane is always told apart from the one it
  replaces.
* The pool connects ``capacity`` lanes at start, one after another, with the long connect
  deadline and a 20 s READY deadline; any failure fails the start.
* `LanePool.checkout` pops the most recently returned lane (LIFO), probes it (EOF or any
  unsolicited byte means dead), and otherwise connects a fresh lane with the short 3 s connect
  and READY deadlines, so a dead stage fails a new request in seconds, not half a minute.
* A request that succeeds ends with ``Stop`` + ``Ack`` and the lane goes back on the stack. A
  request that fails in any way skips the graceful ``Stop`` (a dead peer would turn a bounded
  failure into an unbounded wait): the lane is closed first, so the stage reclaims its
  sessions, and a replacement is connected with the short deadlines. If that fails too the
  pool is one lane short, and later checkouts connect on demand.
* Steady-state reads and writes time out after ``STAGERUN_STAGE_REPLY_TIMEOUT_SECS`` (default
  30, clamped to 1..3600).
* The pool keeps the EWMA prefill transport estimate shared by its requests.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from .. import _proto, _spans, telemetry
from .._decide._prefill import PrefillTransportEstimate
from .._errors import LaneBrokenError, LaneError, LaneTimeoutError, StageError
from .._wire._connect import (
    DEFAULT_CONNECT_TIMEOUT,
    ENV_SECRET,
    EnvSecret,
    alternatives,
    open_connection,
    stage_reply_timeout,
)
from .._wire._framed import NO_EMULATION, FrameStream, LinkEmulation
from ..telemetry import now_ns

log = logging.getLogger("stagerun.lanes")

LANE_READY_TIMEOUT = 20.0
LANE_STEADY_CONNECT_TIMEOUT = 3.0


class Lane:
    """One path through the pipeline: down to stage 1, and back from the last stage directly.

    ``down`` is the connection to stage 1 (requests go down it, acks come up it);
    ``returns`` are the return connections, one per candidate last stage.
    """

    def __init__(
        self,
        lane_id: int,
        down: FrameStream,
        returns: FrameStream | Sequence[FrameStream],
        *,
        return_key: int,
        reply_timeout: float,
    ) -> None:
        self.id = lane_id
        self.down = down
        # One return connection per candidate last stage (the primary and its standbys): the
        # one the chain reaches binds its connection by key, the others stay parked.
        self.returns = [returns] if isinstance(returns, FrameStream) else list(returns)
        if not self.returns:
            raise ValueError("a lane needs at least one return connection")
        self.return_key = return_key
        self.reply_timeout = reply_timeout

    def __repr__(self) -> str:
        return f"<Lane id={self.id} down={self.down!r} returns={self.returns!r}>"

    @property
    def primary_return(self) -> FrameStream:
        """The return connection to the primary last stage."""
        return self.returns[0]

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
    ) -> None:
        tel = telemetry.current()
        if activations is None or not tel.debug_enabled:
            await self.down.send(message, activations, dtype, timeout=self.reply_timeout)
            return
        started = telemetry.now_ns()
        await self.down.send(message, activations, dtype, timeout=self.reply_timeout)
        _spans.activations_sent(message, int(activations.nbytes), started)

    async def request_ack(self, message: _proto.Message) -> _proto.Ack:
        """Send a message that the chain acknowledges, and wait for the merged ``Ack``."""
        await self.send(message)
        return await self.receive_ack()

    async def receive_ack(self) -> _proto.Ack:
        frame = await self.down.receive(timeout=self.reply_timeout)
        reply = frame.message
        match _proto.check_reply(_proto.Owes.ACK, reply, on_return=False):
            case _proto.ReplyCheck.TAKEN:
                assert isinstance(reply, _proto.Ack)
                return reply
            case _proto.ReplyCheck.REFUSED:
                assert isinstance(reply, _proto.Error)
                raise StageError(f"stage {reply.stage_index}: {reply.message}")
        raise LaneBrokenError(
            f"lane {self.id}: expected an Ack from {self.down.peer}, got {type(reply).__name__}"
        )

    async def receive_predictions(self, request_id: int) -> _proto.Predictions:
        """Wait for the next ``Predictions`` on the return connection (see `receive_reply`)."""
        reply = await self.receive_reply(request_id)
        if not isinstance(reply, _proto.Predictions):
            raise LaneBrokenError(f"lane {self.id}: unexpected {type(reply).__name__} reply")
        return reply

    async def receive_reply(self, request_id: int) -> _proto.Predictions | _proto.Cancelled:
        """Wait for the next reply for ``request_id`` on the return connection.

        The connection down the lane is watched at the same time: a stage that fails reports an
        ``Error`` upstream, and a broken one means the chain is gone. A reply
        for another request means the lane's state is confused: it raises `StageError`.
        """
        outcome: list[tuple[FrameStream, _proto.Frame | BaseException]] = []

        async def watch(stream: FrameStream, cancel_scope: trio.CancelScope) -> None:
            try:
                outcome.append((stream, await stream.receive()))
            except LaneError as exc:
                outcome.append((stream, exc))
            cancel_scope.cancel()

        try:
            with trio.fail_after(self.reply_timeout):
                async with trio.open_nursery() as nursery:
                    for ret in self.returns:
                        nursery.start_soon(watch, ret, nursery.cancel_scope)
                    nursery.start_soon(watch, self.down, nursery.cancel_scope)
        except trio.TooSlowError as exc:
            raise LaneTimeoutError(
                f"lane {self.id}: no prediction from {self.primary_return.peer} within "
                f"{self.reply_timeout:g}s"
            ) from exc
        stream, result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        reply = result.message
        on_return = stream is not self.down
        match _proto.check_reply(_proto.Owes.PREDICTIONS, reply, on_return=on_return):
            case _proto.ReplyCheck.TAKEN:
                assert isinstance(reply, (_proto.Predictions, _proto.Cancelled))
                if reply.request_id != request_id:
                    raise StageError(
                        f"lane {self.id}: a reply for request {reply.request_id} arrived "
                        f"while request {request_id} was running"
                    )
                return reply
            case _proto.ReplyCheck.REFUSED:
                assert isinstance(reply, _proto.Error)
                raise StageError(f"stage {reply.stage_index}: {reply.message}")
        raise LaneBrokenError(
            f"lane {self.id}: unexpected {type(reply).__name__} from {stream.peer}"
        )

    def is_live(self) -> bool:
        return self.down.is_live() and all(ret.is_live() for ret in self.returns)

    async def aclose_forcefully(self) -> None:
        # Shielded: in a cancelled context the first close's checkpoint would raise
        # Cancelled and leave the second connection open.
        with trio.CancelScope(shield=True):
            await self.down.aclose_forcefully()
            for ret in self.returns:
                await ret.aclose_forcefully()


class LanePool:
    """A LIFO pool of lanes from stage 0 through the pipeline.

    Args:
        downstream: address of stage 1.
        last_stage: address of the last stage (defaults to ``downstream``).
        capacity: lanes connected at start (the request concurrency it is sized for).
        connect_timeout: connect deadline for the lanes opened at start.
        secret: the lane secret (default: this process's, `stagerun._wire._auth.lane_secret`).
    """

    def __init__(
        self,
        downstream: str,
        *,
        last_stage: str | None = None,
        capacity: int = 1,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        ready_timeout: float = LANE_READY_TIMEOUT,
        steady_timeout: float = LANE_STEADY_CONNECT_TIMEOUT,
        reply_timeout: float | None = None,
        link: LinkEmulation = NO_EMULATION,
        secret: bytes | EnvSecret | None = ENV_SECRET,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"lane pool capacity must be at least 1, got {capacity}")
        self.downstream = downstream
        self.last_stage = last_stage or downstream
        self.capacity = capacity
        self.connect_timeout = connect_timeout
        self.ready_timeout = ready_timeout
        self.steady_timeout = steady_timeout
        self.reply_timeout = stage_reply_timeout() if reply_timeout is None else reply_timeout
        self.link = link
        self.secret = secret
        self.prefill_transport = PrefillTransportEstimate()
        self._idle: list[Lane] = []
        self._busy = 0
        self._next_id = 0
        self.replaced = 0
        self.replace_failures = 0

    def __repr__(self) -> str:
        return (
            f"<LanePool capacity={self.capacity} idle={len(self._idle)} busy={self._busy} "
            f"next_id={self._next_id}>"
        )

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def busy(self) -> int:
        return self._busy

    async def start(self) -> None:
        """Connect ``capacity`` lanes, one after another; any failure fails the start."""
        started = now_ns()
        for _ in range(self.capacity):
            lane = await self.connect_lane(self.connect_timeout, self.ready_timeout)
            self._idle.append(lane)
        _spans.pool_ready(self.capacity, started)
        log.debug("lane pool ready: %r", self)

    async def connect_lane(self, connect_timeout: float, ready_timeout: float) -> Lane:
        """Open a new lane with a fresh, never reused id."""
        lane_id = self._next_id
        self._next_id += 1
        started = now_ns()
        lane = await self._connect_lane(lane_id, connect_timeout, ready_timeout)
        _spans.lane_connected(lane_id, self.capacity, started)
        return lane

    async def _connect_lane(
        self, lane_id: int, connect_timeout: float, ready_timeout: float
    ) -> Lane:
        key = secrets.randbits(64)
        down = await open_connection(
            self.downstream,
            role=_proto.Role.LANE,
            connect_timeout=connect_timeout,
            ready_timeout=ready_timeout,
            link=self.link,
            secret=self.secret,
        )
        returns: list[FrameStream] = []
        failure: LaneError | None = None
        try:
            for candidate in alternatives(self.last_stage):  # the last stage and its standbys
                try:
                    returns.append(
                        await open_connection(
                            candidate,
                            role=_proto.Role.RETURN,
                            key=key,
                            connect_timeout=connect_timeout,
                            ready_timeout=ready_timeout,
                            link=self.link,
                            secret=self.secret,
                        )
                    )
                except LaneError as exc:
                    failure = exc
            if not returns:
                assert failure is not None
                raise failure
        except BaseException:
            with trio.CancelScope(shield=True):
                await down.aclose_forcefully()
                for ret in returns:
                    await ret.aclose_forcefully()
            raise
        return Lane(lane_id, down, returns, return_key=key, reply_timeout=self.reply_timeout)

    @asynccontextmanager
    async def checkout(self, request_id: int) -> AsyncIterator[Lane]:
        """Lend a lane for one request.

        On a clean exit the pool sends ``Stop`` for ``request_id``, waits for the ``Ack`` and
        puts the lane back; on any exception (cancellation included) the lane is closed
        without ``Stop`` and replaced.
        """
        started = now_ns()
        lane = self._idle.pop() if self._idle else None
        reused = lane is not None
        if lane is not None and not lane.is_live():
            log.info("lane %d was dead at checkout; connecting a fresh one", lane.id)
            await lane.aclose_forcefully()
            lane, reused = None, False
        if lane is None:
            lane = await self.connect_lane(self.steady_timeout, self.steady_timeout)
        _spans.lane_checked_out(request_id, lane.id, self.capacity, started, reused=reused)
        self._busy += 1
        try:
            try:
                yield lane
            except BaseException:
                await self._retire(lane)
                raise
            try:
                await lane.request_ack(_proto.Stop(request_id=request_id))
            except (LaneError, StageError) as exc:
                log.info("lane %d failed to stop cleanly (%s); replacing it", lane.id, exc)
                _spans.lane_return_failed(lane.id, request_id, exc)
                await self._retire(lane)
            else:
                self._idle.append(lane)
        finally:
            self._busy -= 1

    async def _retire(self, lane: Lane) -> None:
        with trio.CancelScope(shield=True):
            await lane.aclose_forcefully()
            await self.replace_lane(lane.id)

    async def replace_lane(self, retired_lane_id: int) -> None:
        """Connect a replacement for a retired lane with the short deadlines."""
        try:
            lane = await self.connect_lane(self.steady_timeout, self.steady_timeout)
        except LaneError as exc:
            self.replace_failures += 1
            log.warning("could not replace lane %d: %s", retired_lane_id, exc)
            _spans.lane_replace_failed(retired_lane_id, exc)
            return
        self.replaced += 1
        log.info("lane %d replaced by lane %d", retired_lane_id, lane.id)
        _spans.lane_replaced(retired_lane_id, lane.id)
        self._idle.append(lane)

    async def ensure_idle_lane(self) -> None:
        """Make sure a live lane waits on the stack, connecting one if none does.

        Raises:
            LaneError: no lane could be connected (with the short deadlines).
        """
        for lane in list(self._idle):
            if lane.is_live():
                return
            self._idle.remove(lane)
            await lane.aclose_forcefully()
        lane = await self.connect_lane(self.steady_timeout, self.steady_timeout)
        self._idle.append(lane)

    async def aclose(self) -> None:
        """Close every idle lane (lanes still lent out are closed by their requests)."""
        lanes, self._idle = self._idle, []
        for lane in lanes:
            await lane.aclose_forcefully()

    async def __aenter__(self) -> LanePool:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()
