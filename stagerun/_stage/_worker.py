"""One upstream lane on a stage: its frames carried out in order, forwarded or answered.

Theory of operation: `LaneWorker` runs for as long as one upstream ``LANE`` connection (see
`stagerun._stage._server.StageServer`). A reader task takes frames off the connection as they arrive
and queues them; the worker carries them out one at a time: compute through the stage's
backend, then forward the activations downstream (middle stages; the downstream connection is
opened on the first message) or, on the last stage, sample and send ``Predictions`` over the
chain's return connection. A message that expects an ``Ack`` is forwarded and the worker moves
on; a relay task acknowledges upstream when the downstream acknowledges, merging this stage's
stats. When the upstream goes away, the worker drops its sessions and closes its downstream
(and the bound return connection), so the break travels down the chain.

A frame that no honest upstream sends -- a malformed one, a reply kind, a request over the
lane's session limit -- is a `ProtocolError`: the lane closes and the stage counts it
(``protocol_errors``). A well-formed request that cannot be carried out (an unknown request,
a gap in the positions, activations of the wrong width or not finite) is answered with an
``Error`` and the lane carries on. What one lane holds is bounded: at most
`MAX_SESSIONS_PER_LANE` sessions (a lane carries one request at a time), and a ``Cancel``
leaves nothing behind but its effect on the windows it names that this stage holds.

What a peer can make a stage hold is bounded too. The reader queues at most
`MAX_QUEUED_FRAMES` frames, or `MAX_QUEUED_BYTES` of them, then stops reading until the worker
has carried one out: TCP then stalls the peer, whatever it sends. Every write (upstream,
downstream, on the return connection) has the stage's ``reply_timeout``: a peer that does not
read its replies has its lane closed when a write to it has waited that long. The sessions
of all lanes together are limited by the stage's `SessionBudget` (how many, and the KV
positions they reach): a ``Configure`` or a compute past it gets an ``Error``, and the
other lanes carry on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, assert_never

import attrs
import numpy as np
import trio

from .. import _proto, telemetry
from .._engine import Session, SessionRefused, StopCheck
from .._engine._session import compute_attributes, us_since
from .._errors import (
    ComputeCancelled,
    LaneError,
    ProtocolError,
    StageError,
    StagerunError,
)
from .._wire._framed import FrameStream
from ..telemetry import Telemetry, now_ns
from ._connections import connect_downstream
from ._context import StageContext
from ._queue import MAX_QUEUED_BYTES, MAX_QUEUED_FRAMES, FrameQueue

__all__ = ["LaneWorker"]

log = logging.getLogger("stagerun.stage")

MAX_SESSIONS_PER_LANE = 4  # stage 0 runs one request per lane; a little slack, never more


@attrs.define
class _OwedAck:
    """An ``Ack`` this stage owes upstream once the downstream acknowledges ``request_id``.

    It is queued before its message goes down: the downstream's ``Ack`` can arrive before
    the write returns, and must find it (the write's figures are filled in after).
    """

    request_id: int
    stats: _proto.StageStats
    sent: float  # when the message went downstream (perf_counter)
    cached: int = 0  # a Configure's: the prefix positions this stage restored


class LaneWorker:
    """Carries out the frames of one upstream lane connection, in order.

    A reader task takes frames off the connection as they arrive and queues them; the worker
    carries them out one at a time. Reading ahead is what makes cancellation cheap: a
    ``Cancel`` is applied the moment it is read, so stale windows still in the queue are
    dropped unseen and a stale window being computed stops at its next layer boundary.

    Reading ahead is bounded (`MAX_QUEUED_FRAMES`, `MAX_QUEUED_BYTES`): with a full queue
    the reader waits, and a ``Cancel`` behind it is read once the worker has carried out a
    frame. What stage 0 keeps in flight on a lane is well below the bound, so an honest
    lane's Cancels are always read at once.
    """

    def __init__(self, server: StageContext, upstream: FrameStream) -> None:
        self.server = server
        self.up = upstream
        self.down: FrameStream | None = None
        self.sink: FrameStream | None = None
        self.sessions: dict[int, Session] = {}
        self._queue = FrameQueue(max_frames=MAX_QUEUED_FRAMES, max_bytes=MAX_QUEUED_BYTES)
        # The verify window being carried out (from its dispatch to the end of its compute),
        # and whether a Cancel named it meanwhile: its compute stops at the next layer.
        self._current: _proto.Verify | None = None
        self._current_cancelled = False
        self._replied: dict[int, set[int]] = {}  # last stage: windows already answered
        # Acks owed upstream, in order: the downstream acks them first (see _relay_acks).
        self._owed: deque[_OwedAck] = deque()
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._read_upstream)
                await self._work()
                nursery.cancel_scope.cancel()
        except* LaneError as group:  # a nursery wraps whatever its tasks raise
            for exc in group.exceptions:
                if isinstance(exc.__cause__, ProtocolError):
                    self.server.protocol_errors += 1
                log.info("stage %d: lane from %s ended: %s", self.server.index, self.up.peer, exc)
        finally:
            for session in self.sessions.values():
                self.server.engine.close(session)
            self.sessions.clear()
            with trio.CancelScope(shield=True):
                if self.down is not None:
                    await self.down.aclose_forcefully()
                if self.sink is not None:
                    await self.sink.aclose_forcefully()
                await self.up.aclose_forcefully()

    async def _read_upstream(self) -> None:
        try:
            while True:
                await self._queue.wait_for_room()  # else the peer waits (TCP back-pressure)
                started = now_ns()
                frame = await self.up.receive()
                tel = telemetry.current()
                if tel.debug_enabled:
                    tel.debug_span(
                        "stage.binary_recv",
                        started,
                        {
                            "llama_stage.stage_index": self.server.index,
                            "llama_stage.message_kind": frame.message.kind,
                            "llama_stage.request_id": frame.message.request_id,
                        },
                    )
                if isinstance(frame.message, _proto.Cancel):
                    self._apply_cancel(frame.message)
                self._queue.put(frame)
        except LaneError as exc:  # upstream went away: the chain is over once the queue is done
            if isinstance(exc.__cause__, ProtocolError):
                self.server.protocol_errors += 1
                log.info("stage %d: %s", self.server.index, exc)
        finally:
            self._queue.close()

    async def _work(self) -> None:
        while (frame := await self._queue.get()) is not None:
            try:
                await self._dispatch(frame)
            except ProtocolError as exc:  # the upstream is out of step: this lane is over
                self.server.protocol_errors += 1
                log.info("stage %d: lane from %s: %s", self.server.index, self.up.peer, exc)
                return

    def _apply_cancel(self, cancel: _proto.Cancel) -> None:
        """Drop the named windows still queued; flag the one being computed, if named.

        Stage 0 cancels only windows it has sent, and the lane is ordered, so by the time a
        ``Cancel`` is read every window it names is queued, being carried out, done, or was
        dropped upstream and never comes: nothing needs remembering for later (so Cancels
        cannot grow the lane, whatever they name).
        """
        named = frozenset(cancel.window_ids)

        def stale(message: _proto.Message) -> bool:
            return (
                isinstance(message, _proto.Verify)
                and message.request_id == cancel.request_id
                and message.window_id in named
            )

        self.server.engine.stale_dropped += self._queue.drop(stale)
        if self._current is not None and stale(self._current):
            self._current_cancelled = True

    async def _downstream(self, *, fresh_session: bool = False) -> FrameStream:
        """The next hop; opened on first use.

        At the start of a request (``fresh_session``) a downstream connection that died while
        the lane was idle (the next stage restarted, say) is replaced: no state is lost,
        since the request has none yet. Mid-request a broken hop stays broken. A hop that
        still owes acks is not idle: the bytes waiting on it are those acks, not a sign of
        death (replacing it would lose them and pair every later ack with the wrong message).
        """
        idle = not self._owed
        if self.down is not None and fresh_session and idle and not self.down.is_live():
            await self.down.aclose_forcefully()
            self.down = None
        if self.down is None:
            assert self.server.downstream is not None
            self.down = await connect_downstream(self.server.config)
            assert self._nursery is not None
            self._nursery.start_soon(self._relay_acks, self.down)
        return self.down

    async def _dispatch(self, frame: _proto.Frame) -> None:
        message = frame.message
        match message:
            case _proto.Configure():
                if (
                    message.request_id not in self.sessions
                    and len(self.sessions) >= MAX_SESSIONS_PER_LANE
                ):
                    raise ProtocolError(
                        f"Configure for request {message.request_id} would open more than "
                        f"{MAX_SESSIONS_PER_LANE} requests on one lane; a lane carries one "
                        "request at a time"
                    )
                await self._configure(message)
            case _proto.Prefill() | _proto.Decode() | _proto.Verify():
                await self._forward_pass(message, frame.activations)
            case _proto.Trim():
                session = self.sessions.get(message.request_id)
                if session is not None:
                    session.cache.trim(message.position)
                await self._relay_ack(message, _proto.StageStats(stage_count=1))
            case _proto.Stop():
                ended = self.sessions.pop(message.request_id, None)
                if ended is not None:
                    self.server.engine.close(ended)
                    self.server.engine.summarize(message.request_id, ended)
                self._replied.pop(message.request_id, None)
                await self._relay_ack(message, _proto.StageStats(stage_count=1))
            case _proto.Cancel():
                await self._cancel(message)
            case _proto.Remember():
                await self._remember(message)
            case _proto.Probe():
                cache = self.server.engine.prefix_cache
                stats = cache.stats() if cache is not None else _proto.PrefixStats()
                await self._send_up(
                    _proto.Status(
                        request_id=message.request_id, stage_index=self.server.index, prefix=stats
                    )
                )
            case (
                _proto.Ack()
                | _proto.Predictions()
                | _proto.Cancelled()
                | _proto.Error()
                | _proto.Status()
            ):
                raise ProtocolError(
                    f"{type(message).__name__} is a reply; the upstream of a lane sends requests"
                )
            case _:
                assert_never(message)

    async def _configure(self, message: _proto.Configure) -> None:
        """Open the request's session (replacing one of the same id) and pass it on.

        A refused one (no return connection, or the stage's `SessionBudget` is spent) gets an
        ``Error`` and no session, so the prefill stage 0 sent right behind is refused too.
        """
        rid = message.request_id
        if self.server.is_last:
            try:
                self.sink = await self.server.take_sink(message.return_key)
            except StageError as exc:
                await self._fail(rid, str(exc), upstream=True)
                return
        engine = self.server.engine
        replaced = self.sessions.pop(rid, None)
        if replaced is not None:
            engine.close(replaced)
        try:
            session = engine.open(rid, message.sampling, message.prompt_len)
        except SessionRefused as exc:
            await self._fail(rid, str(exc), upstream=True)
            return
        self.sessions[rid] = session
        cached = await engine.restore(session, message.prefix)
        await self._relay_ack(
            message, _proto.StageStats(stage_count=1), fresh_session=True, cached=cached
        )

    async def _remember(self, message: _proto.Remember) -> None:
        """Keep the request's blocks this stage does not hold yet, and pass the names on."""
        if not self.server.is_last:
            await (await self._downstream()).send(message, timeout=self.server.reply_timeout)
        session = self.sessions.get(message.request_id)
        if session is not None:
            await self.server.engine.remember(session, message.prefix)

    async def _cancel(self, message: _proto.Cancel) -> None:
        if not self.server.is_last:
            await (await self._downstream()).send(message, timeout=self.server.reply_timeout)
            return
        replied = self._replied.get(message.request_id, set())
        unanswered = tuple(w for w in message.window_ids if w not in replied)
        if self.sink is not None:
            await self.sink.send(
                _proto.Cancelled(
                    request_id=message.request_id, epoch=message.epoch, window_ids=unanswered
                ),
                timeout=self.server.reply_timeout,
            )

    async def _relay_ack(
        self,
        message: _proto.Message,
        own: _proto.StageStats,
        *,
        fresh_session: bool = False,
        cached: int = 0,
    ) -> None:
        if self.server.is_last:
            await self._send_up(_proto.Ack(request_id=message.request_id, stats=own, cached=cached))
            return
        try:
            down = await self._downstream(fresh_session=fresh_session)
            self._owed.append(_OwedAck(message.request_id, own, time.perf_counter(), cached))
            await down.send(message, timeout=self.server.reply_timeout)
        except LaneError as exc:
            await self._fail(
                message.request_id, f"downstream stage unreachable: {exc}", upstream=True
            )
            raise

    async def _relay_acks(self, down: FrameStream) -> None:
        """Acknowledge upstream as the downstream acknowledges, merging this stage's stats.

        The worker never waits for a downstream ``Ack``: it forwards and moves on to the next
        frame, so a prefill chunk computes here while the one before it computes further down
        (stage 0 keeps a bounded number of chunks unacknowledged). Acks come back in the order
        the messages went down; ``Error`` replies travel up unchanged. A broken downstream ends
        the lane, and so the break travels up the chain.
        """
        server = self.server
        while True:
            try:
                reply = (await down.receive()).message
            except LaneError as exc:
                if down is self.down:
                    log.info("stage %d: downstream %s ended: %s", server.index, down.peer, exc)
                    assert self._nursery is not None
                    self._nursery.cancel_scope.cancel()
                return  # else the hop was replaced at the start of a request
            owed = self._owed.popleft() if self._owed else None
            if isinstance(reply, _proto.Ack) and owed is not None:
                wait_us = us_since(owed.sent)
                own = owed.stats
                if own.slowest_tokens:  # a prefill chunk: this stage's edge is this hop
                    own = attrs.evolve(
                        own,
                        edge_write_us=own.forward_write_us,
                        edge_wait_us=wait_us,
                        edge_stage=server.index,
                    )
                stats = own.merge(reply.stats)
                stats = attrs.evolve(stats, downstream_wait_us=stats.downstream_wait_us + wait_us)
                cached = min(owed.cached, reply.cached)  # what every stage from here holds
                await self._send_up(
                    _proto.Ack(request_id=owed.request_id, stats=stats, cached=cached)
                )
            else:
                await self._send_up(reply)  # an Error from further down, unchanged

    async def _send_up(self, reply: _proto.Message) -> None:
        """Reply upstream; a peer that has not read its replies for a while loses the lane."""
        await self.up.send(reply, timeout=self.server.reply_timeout)

    async def _forward_pass(
        self, message: _proto.ActivationMessage, activations: np.ndarray[Any, Any] | None
    ) -> None:
        """Compute one message's layers, then forward the activations or reply to stage 0."""
        server = self.server
        wants_predictions = _proto.rule_for(message).owes is _proto.Owes.PREDICTIONS
        # Failures go where stage 0 is listening (the lane's table, `_proto._lane`).
        fail_upstream = _proto.fails_upstream(message, is_last=server.is_last)
        session = self.sessions.get(message.request_id)
        if session is None:
            await self._fail(
                message.request_id,
                f"request {message.request_id} was not configured on this lane",
                upstream=fail_upstream,
            )
            return
        computed = await self._compute(message, activations, session, fail_upstream=fail_upstream)
        if computed is None:
            return
        out, stats = computed
        tel = telemetry.current()
        if not server.is_last:
            await self._forward(message, session, out, stats, tel, owes_ack=not wants_predictions)
        elif not wants_predictions:
            await self._send_up(_proto.Ack(request_id=message.request_id, stats=stats))
        else:
            await self._reply_predictions(message, session, out, stats)

    async def _compute(
        self,
        message: _proto.ActivationMessage,
        activations: np.ndarray[Any, Any] | None,
        session: Session,
        *,
        fail_upstream: bool,
    ) -> tuple[np.ndarray[Any, Any], _proto.StageStats] | None:
        """Run ``message`` through the stage's engine: the output and the stats it reports.

        None when there is nothing to go on with: a verify window that a ``Cancel`` stopped
        (the engine counts it), or a compute that was refused or failed (reported to stage 0).
        """
        stop: StopCheck | None = None
        if isinstance(message, _proto.Verify):
            stop = StopCheck(lambda: self._current_cancelled)
            self._current, self._current_cancelled = message, False
        try:
            return await self.server.engine.compute(session, message, activations, stop=stop)
        except ComputeCancelled:
            return None
        except SessionRefused as exc:
            await self._fail(message.request_id, str(exc), upstream=fail_upstream)
            return None
        except (ValueError, StagerunError) as exc:
            await self._fail(message.request_id, f"compute failed: {exc}", upstream=fail_upstream)
            return None
        finally:
            self._current = None

    async def _forward(
        self,
        message: _proto.ActivationMessage,
        session: Session,
        out: np.ndarray[Any, Any],
        stats: _proto.StageStats,
        tel: Telemetry,
        *,
        owes_ack: bool,
    ) -> None:
        """Send the activations to the next stage; an expected ``Ack`` is owed upstream."""
        server = self.server
        down = await self._downstream()
        write_start = time.perf_counter()
        owed = _OwedAck(message.request_id, stats, write_start) if owes_ack else None
        if owed is not None:
            self._owed.append(owed)
        await down.send(message, out, server.wire_dtype, timeout=server.reply_timeout)
        write_us = us_since(write_start)
        session.forward_write_us += write_us
        stats = attrs.evolve(stats, forward_write_us=write_us)
        if owed is not None:  # unless its Ack came back already
            owed.stats, owed.sent = stats, time.perf_counter()
        if tel.debug_enabled:
            tel.debug_span(
                "stage.binary_downstream_write",
                now_ns() - write_us * 1000,
                {
                    **compute_attributes(server.index, message),
                    "llama_stage.forward_activation_bytes": int(out.nbytes),
                    "llama_stage.elapsed_ms": write_us / 1000.0,
                },
            )

    async def _reply_predictions(
        self,
        message: _proto.ActivationMessage,
        session: Session,
        out: np.ndarray[Any, Any],
        stats: _proto.StageStats,
    ) -> None:
        """Last stage: the engine's answer, sent over the return connection."""
        if isinstance(message, _proto.Verify):
            self._replied.setdefault(message.request_id, set()).add(message.window_id)
        assert self.sink is not None, "the last stage binds its return connection at Configure"
        await self.sink.send(
            self.server.engine.answer(session, message, out, stats),
            timeout=self.server.reply_timeout,
        )

    async def _fail(self, request_id: int, text: str, *, upstream: bool) -> None:
        """Report a failure to stage 0: upstream for acked work, else on the return path."""
        error = _proto.Error(
            request_id=request_id, stage_index=self.server.index, message=text[:4000]
        )
        log.warning("stage %d: %s", self.server.index, text)
        target = self.up if upstream or self.sink is None else self.sink
        await target.send(error, timeout=self.server.reply_timeout)
