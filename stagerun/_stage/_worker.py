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

What each message makes the stage do is not decided here: the lane's sans-IO core,
`stagerun._proto._stage_lane.StageLane`, turns every message (and every outcome this shell
reports back) into commands, reading the lane's table; this shell carries them out.

A lane's frames carry little activation data (64 KiB) until the reader has read its first
``Configure`` (see "Partial frames" in `stagerun._stage._server`); from then on they may carry
the stage's ``max_payload_bytes``.

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
from typing import assert_never

import attrs
import trio

from .. import _proto
from .. import _spans as spans
from .._engine import Session, SessionRefused, StopCheck
from .._engine._session import us_since
from .._errors import (
    ComputeCancelled,
    LaneError,
    ProtocolError,
    StageError,
    StagerunError,
)
from .._proto import _stage_lane as cmd
from .._proto._stage_lane import StageLane
from .._wire._framed import FrameStream
from ..telemetry import now_ns
from ._connections import connect_downstream
from ._context import StageContext
from ._queue import MAX_QUEUED_BYTES, MAX_QUEUED_FRAMES, FrameQueue

__all__ = ["LaneWorker"]

log = logging.getLogger("stagerun.stage")

MAX_SESSIONS_PER_LANE = 4  # stage 0 runs one request per lane; a little slack, never more


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
        self.sink: FrameStream | None = None  # last stage: the return connection to stage 0
        # What the lane holds (its sessions, the window being computed, acks owed) and what
        # each message makes the stage do: the sans-IO core this shell carries out.
        self.lane: StageLane[Session] = StageLane(
            is_last=server.is_last, max_sessions=MAX_SESSIONS_PER_LANE
        )
        self._queue = FrameQueue(max_frames=MAX_QUEUED_FRAMES, max_bytes=MAX_QUEUED_BYTES)
        self._nursery: trio.Nursery | None = None

    @property
    def sessions(self) -> dict[int, Session]:
        return self.lane.sessions

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
            for closing in self.lane.close():
                assert isinstance(closing, cmd.Close)
                self.server.engine.close(closing.session)
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
                spans.stage_received(self.server.index, frame.message, started)
                if isinstance(frame.message, _proto.Cancel):  # applied the moment it is read
                    await self._carry_out_all(self.lane.read_ahead(frame.message))
                elif isinstance(frame.message, _proto.Configure):  # a lane: activations may come
                    self.up.limit_payloads(self.server.config.max_payload_bytes)
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
                commands = self.lane.receive(
                    frame.message, frame.activations, now=time.perf_counter()
                )
                await self._carry_out_all(commands)
            except ProtocolError as exc:  # the upstream is out of step: this lane is over
                self.server.protocol_errors += 1
                log.info("stage %d: lane from %s: %s", self.server.index, self.up.peer, exc)
                return

    async def _carry_out_all(self, commands: list[cmd.Command]) -> None:
        for command in commands:
            await self._carry_out(command)

    async def _carry_out(self, command: cmd.Command) -> None:
        """Carry out one of the lane's commands (`stagerun._proto._stage_lane`)."""
        server, engine = self.server, self.server.engine
        match command:
            case cmd.Open(message):
                await self._open(message)
            case cmd.Close(request_id, session, summarize):
                engine.close(session)
                if summarize:
                    engine.summarize(request_id, session)
            case cmd.TrimCache(session, position):
                engine.trim(session, position)
            case cmd.Compute():
                await self._compute(command)
            case cmd.SendDown():
                await self._send_down(command)
            case cmd.PassOn():
                await self._pass_on(command)
            case cmd.AckUp(request_id, stats, cached):
                await self._send_up(_proto.Ack(request_id=request_id, stats=stats, cached=cached))
            case cmd.RelayUp(reply):
                await self._send_up(reply)
            case cmd.Reply(message, session, output, stats):
                assert self.sink is not None, "the last stage binds its return connection first"
                try:
                    answer = engine.answer(session, message, output, stats)
                except ValueError as exc:  # a grammar that failed part-way
                    await self._fail(message.request_id, f"sampling failed: {exc}", upstream=False)
                    return
                await self.sink.send(answer, timeout=server.reply_timeout)
            case cmd.SendCancelled(request_id, epoch, window_ids):
                if self.sink is not None:
                    cancelled = _proto.Cancelled(
                        request_id=request_id, epoch=epoch, window_ids=window_ids
                    )
                    await self.sink.send(cancelled, timeout=server.reply_timeout)
            case cmd.SendStatus(request_id):
                await self._send_up(engine.status(request_id))
            case cmd.RememberBlocks(session, prefix):
                await engine.remember(session, prefix)
            case cmd.Fail(request_id, text, upstream):
                await self._fail(request_id, text, upstream=upstream)
            case cmd.DropQueued():
                engine.stale_dropped += self._queue.drop(command.names)
            case _:
                assert_never(command)

    async def _open(self, message: _proto.Configure) -> None:
        """Open the request's session; a refused one gets an ``Error`` and no session.

        Refused (no return connection, or the stage's `SessionBudget` is spent), the prefill
        stage 0 sent right behind is refused too, for want of a session.
        """
        if self.server.is_last:
            try:
                self.sink = await self.server.take_sink(message.return_key)
            except StageError as exc:
                await self._carry_out_all(self.lane.refused(message, str(exc)))
                return
        engine = self.server.engine
        try:
            session = engine.open(message.request_id, message.sampling, message.prompt_len)
        except SessionRefused as exc:
            await self._carry_out_all(self.lane.refused(message, str(exc)))
            return
        try:
            await engine.constrain(session)
        except SessionRefused as exc:
            engine.close(session)
            await self._carry_out_all(self.lane.refused(message, str(exc)))
            return
        cached = await engine.restore(session, message.prefix)
        opened = self.lane.opened(message, session, cached=cached, now=time.perf_counter())
        await self._carry_out_all(opened)

    async def _downstream(self, *, fresh_session: bool = False) -> FrameStream:
        """The next hop; opened on first use, replaced at an idle request start if it died.

        See `stagerun._proto._stage_lane.PassOn` for when a hop may be replaced.
        """
        if self.down is not None and fresh_session and not self.down.is_live():
            await self.down.aclose_forcefully()
            self.down = None
        if self.down is None:
            assert self.server.downstream is not None
            self.down = await connect_downstream(self.server.config)
            assert self._nursery is not None
            self._nursery.start_soon(self._relay_acks, self.down)
        return self.down

    async def _pass_on(self, command: cmd.PassOn) -> None:
        """Send a message without activations downstream; an acked one fails upstream."""
        try:
            down = await self._downstream(fresh_session=command.fresh_session)
            await down.send(command.message, timeout=self.server.reply_timeout)
        except LaneError as exc:
            if command.owed is not None:
                text = f"downstream stage unreachable: {exc}"
                await self._fail(command.message.request_id, text, upstream=True)
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
            now = time.perf_counter()
            await self._carry_out_all(
                self.lane.downstream_replied(reply, now=now, index=server.index)
            )

    async def _send_up(self, reply: _proto.Message) -> None:
        """Reply upstream; a peer that has not read its replies for a while loses the lane."""
        await self.up.send(reply, timeout=self.server.reply_timeout)

    async def _compute(self, command: cmd.Compute[Session]) -> None:
        """Run a message through the stage's engine, then carry out what the lane says next.

        A verify window that a ``Cancel`` names meanwhile stops at its next layer (the engine
        counts it); a compute that is refused or fails is reported to stage 0.
        """
        message, lane = command.message, self.lane
        stop = StopCheck(lambda: lane.current_cancelled) if lane.current is message else None
        try:
            out, stats = await self.server.engine.compute(
                command.session, message, command.activations, stop=stop
            )
        except ComputeCancelled:
            next_commands = lane.compute_stopped(message)
        except SessionRefused as exc:
            next_commands = lane.compute_failed(message, str(exc))
        except (ValueError, StagerunError) as exc:
            next_commands = lane.compute_failed(message, f"compute failed: {exc}")
        else:
            next_commands = lane.computed(message, out, stats, now=time.perf_counter())
        await self._carry_out_all(next_commands)

    async def _send_down(self, command: cmd.SendDown[Session]) -> None:
        """Send the activations downstream; an ``Ack`` owed for them gets the write's figures."""
        server, message, out = self.server, command.message, command.output
        down = await self._downstream()
        write_start = time.perf_counter()
        await down.send(message, out, server.wire_dtype, timeout=server.reply_timeout)
        write_us = us_since(write_start)
        command.session.forward_write_us += write_us
        if command.owed is not None:  # unless its Ack came back already (it finds the owed)
            owed = command.owed
            owed.stats = attrs.evolve(command.stats, forward_write_us=write_us)
            owed.sent = time.perf_counter()
        spans.stage_forwarded(server.index, message, int(out.nbytes), write_us)

    async def _fail(self, request_id: int, text: str, *, upstream: bool) -> None:
        """Report a failure to stage 0: upstream for acked work, else on the return path."""
        error = _proto.Error(
            request_id=request_id, stage_index=self.server.index, message=text[:4000]
        )
        log.warning("stage %d: %s", self.server.index, text)
        target = self.up if upstream or self.sink is None else self.sink
        await target.send(error, timeout=self.server.reply_timeout)
