"""The stage end of a lane, sans-IO: every message read from upstream becomes commands.

Theory of operation: `StageLane` is what one upstream lane connection of a stage remembers --
the sessions it opened, the verify window being computed (and whether a ``Cancel`` named it),
the windows the last stage has answered, and the ``Ack``\\ s it owes upstream -- and the one
place that decides what a message makes the stage do, reading the lane's table
(`stagerun._proto._lane.RULES`). The Trio shell (`stagerun._stage._worker.LaneWorker`) feeds
it each message and carries out the commands it returns, in order; where carrying one out has
an outcome (a session opened or refused, a compute done, failed or stopped, an ``Ack`` read
from downstream), the shell reports it and carries out what comes back. Nothing here does
I/O or reads a clock: the shell passes the times in.

Sessions are the shell's own objects (``S``), kept here by request id so the lane's state
lives in one place. A message no honest upstream sends (a reply, a ``Configure`` past
`StageLane.max_sessions`) raises `ProtocolError`: the shell closes the lane.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeAlias, TypeVar

import attrs

from .._errors import ProtocolError
from ._lane import Owes, fails_upstream, is_reply, rule_for
from ._messages import (
    Ack,
    ActivationMessage,
    Cancel,
    Configure,
    Decode,
    Message,
    Prefill,
    Probe,
    Remember,
    StageStats,
    Stop,
    Trim,
    Verify,
)

__all__ = [
    "AckUp",
    "Close",
    "Command",
    "Compute",
    "DropQueued",
    "Fail",
    "Open",
    "OwedAck",
    "PassOn",
    "RelayUp",
    "RememberBlocks",
    "Reply",
    "SendCancelled",
    "SendDown",
    "SendStatus",
    "StageLane",
    "TrimCache",
]

S = TypeVar("S")

_ONE_STAGE = StageStats(stage_count=1)  # what a stage reports of a message it does not compute


@attrs.define
class OwedAck:
    """An ``Ack`` this stage owes upstream once the downstream acknowledges ``request_id``.

    It is owed before its message goes down: the downstream's ``Ack`` can arrive before the
    write returns, and must find it. The shell fills in the write's figures after (``stats``
    with its ``forward_write_us``, ``sent`` when the write returned).
    """

    request_id: int
    stats: StageStats
    sent: float  # when the message went downstream, on the shell's clock (seconds)
    cached: int = 0  # a Configure's: the prefix positions this stage restored


# --- commands: what the shell carries out -------------------------------------------------------


@attrs.frozen
class Open:
    """Open a session for ``message`` (the last stage binds its return connection first).

    The shell reports back with `StageLane.opened` or `StageLane.refused`.
    """

    message: Configure


@attrs.frozen
class Close(Generic[S]):
    """Drop a session's KV; ``summarize`` when the request ended (a ``Stop``)."""

    request_id: int
    session: S
    summarize: bool


@attrs.frozen
class TrimCache(Generic[S]):
    """Cut a session's KV back to ``position``."""

    session: S
    position: int


@attrs.frozen
class Compute(Generic[S]):
    """Run ``message`` through the stage's layers.

    The shell reports back with `StageLane.computed`, `StageLane.compute_failed` or
    `StageLane.compute_stopped`.
    """

    message: ActivationMessage
    session: S
    activations: Any  # the frame's activations (None on the first stage's tokens)


@attrs.frozen
class SendDown(Generic[S]):
    """Send the computed activations of ``message`` downstream.

    ``owed`` is the ``Ack`` owed upstream for it (already queued), None when the last stage
    answers it with predictions instead.
    """

    message: ActivationMessage
    session: S
    output: Any  # the activations the compute produced
    stats: StageStats  # what the compute reports
    owed: OwedAck | None


@attrs.frozen
class PassOn:
    """Send a message that carries no activations downstream.

    ``owed`` as for `SendDown`. ``fresh_session`` at the start of a request on an idle
    downstream (it owes no acks): a connection that died while the lane was idle may be
    replaced, since the request has no state yet. A hop that still owes acks is not idle: the
    bytes waiting on it are those acks, not a sign of death (replacing it would lose them and
    pair every later ack with the wrong message).
    """

    message: Message
    owed: OwedAck | None
    fresh_session: bool = False


@attrs.frozen
class AckUp:
    """Acknowledge ``request_id`` upstream."""

    request_id: int
    stats: StageStats
    cached: int = 0


@attrs.frozen
class RelayUp:
    """Pass a reply from further down upstream unchanged (an ``Error``)."""

    reply: Message


@attrs.frozen
class Reply(Generic[S]):
    """Last stage: answer ``message`` with predictions on the return connection."""

    message: ActivationMessage
    session: S
    output: Any  # the last layer's activations, for the engine to sample from
    stats: StageStats


@attrs.frozen
class SendCancelled:
    """Last stage: tell stage 0 which cancelled windows will never be answered."""

    request_id: int
    epoch: int
    window_ids: tuple[int, ...]


@attrs.frozen
class SendStatus:
    """Answer a ``Probe`` with this stage's status."""

    request_id: int


@attrs.frozen
class RememberBlocks(Generic[S]):
    """Keep the session's prefix blocks the stage does not hold yet."""

    session: S
    prefix: tuple[int, ...]


@attrs.frozen
class Fail:
    """Report a failure to stage 0: ``upstream``, or else on the return connection."""

    request_id: int
    text: str
    upstream: bool


@attrs.frozen
class DropQueued:
    """Drop the queued verify windows a ``Cancel`` names (read ahead, not yet carried out)."""

    request_id: int
    window_ids: frozenset[int]

    def names(self, message: Message) -> bool:
        return (
            isinstance(message, Verify)
            and message.request_id == self.request_id
            and message.window_id in self.window_ids
        )


Command: TypeAlias = (
    "Open | Close[Any] | TrimCache[Any] | Compute[Any] | SendDown[Any] | PassOn | AckUp"
    " | RelayUp | Reply[Any] | SendCancelled | SendStatus | RememberBlocks[Any] | Fail"
    " | DropQueued"
)


# --- the state ----------------------------------------------------------------------------------


@attrs.define
class StageLane(Generic[S]):
    """What one upstream lane of a stage holds, and what each message makes the stage do.

    ``is_last`` says whether this is the last stage (it answers instead of passing on);
    ``max_sessions`` bounds the sessions one lane may hold open (stage 0 runs one request
    per lane at a time).
    """

    is_last: bool
    max_sessions: int
    sessions: dict[int, S] = attrs.field(factory=dict)
    # The verify window being carried out (from its dispatch to the end of its compute), and
    # whether a Cancel named it meanwhile: its compute stops at the next layer boundary.
    current: Verify | None = None
    current_cancelled: bool = False
    # Last stage: the windows of each request already answered (a Cancel answers the rest).
    replied: dict[int, set[int]] = attrs.field(factory=dict)
    # Acks owed upstream, in the order their messages went down (the downstream acks them so).
    owed: deque[OwedAck] = attrs.field(factory=deque)

    def receive(
        self, message: Message, activations: Any = None, *, now: float = 0.0
    ) -> list[Command]:
        """The commands for one message read from upstream, in the order to carry them out.

        ``now`` is the shell's clock, for the acks this makes the stage owe.

        Raises:
            ProtocolError: a message no honest upstream sends.
        """
        if is_reply(message):
            raise ProtocolError(
                f"{type(message).__name__} is a reply; the upstream of a lane sends requests"
            )
        rid = message.request_id
        if isinstance(message, Configure):
            return self._configure(message)
        if isinstance(message, Prefill | Decode | Verify):
            return self._activations(message, activations)
        if isinstance(message, Trim):
            trim: list[Command] = []
            if (session := self.sessions.get(rid)) is not None:
                trim.append(TrimCache(session, message.position))
            return [*trim, *self._onward(message, now=now)]
        if isinstance(message, Stop):
            stop: list[Command] = []
            if (ended := self.sessions.pop(rid, None)) is not None:
                stop.append(Close(rid, ended, summarize=True))
            self.replied.pop(rid, None)
            return [*stop, *self._onward(message, now=now)]
        if isinstance(message, Cancel):
            if not self.is_last:
                return self._onward(message, now=now)
            # the last stage answers in place of the predictions it will never send
            answered = self.replied.get(rid, set())
            unanswered = tuple(w for w in message.window_ids if w not in answered)
            return [SendCancelled(rid, message.epoch, unanswered)]
        if isinstance(message, Remember):
            remember = self._onward(message, now=now)
            if (session := self.sessions.get(rid)) is not None:
                remember.append(RememberBlocks(session, message.prefix))
            return remember
        if isinstance(message, Probe):
            return self._onward(message, now=now)
        raise ProtocolError(f"no rule for a {type(message).__name__} read from upstream")

    def read_ahead(self, cancel: Cancel) -> list[Command]:
        """A ``Cancel`` as it is read, before the queue ahead of it is carried out.

        Stage 0 cancels only windows it has sent, and the lane is ordered, so every window a
        ``Cancel`` names is queued, being computed, done, or was dropped upstream and never
        comes: nothing needs remembering for later (Cancels cannot grow the lane).
        """
        drop = DropQueued(cancel.request_id, frozenset(cancel.window_ids))
        if self.current is not None and drop.names(self.current):
            self.current_cancelled = True
        return [drop]

    def opened(self, message: Configure, session: S, *, cached: int, now: float) -> list[Command]:
        """The shell opened the session ``message`` asked for, restoring ``cached`` positions."""
        self.sessions[message.request_id] = session
        return self._onward(message, cached=cached, fresh_session=True, now=now)

    def refused(self, message: Configure, text: str) -> list[Command]:
        """The shell could not open the session: stage 0 hears why, and its prefill is refused."""
        return [Fail(message.request_id, text, upstream=True)]

    def computed(
        self, message: ActivationMessage, output: Any, stats: StageStats, *, now: float
    ) -> list[Command]:
        """The compute of ``message`` is done: what to do with its ``output``."""
        self._computed(message)
        session = self.sessions[message.request_id]
        predicts = rule_for(message).owes is Owes.PREDICTIONS
        if not self.is_last:
            owed = None if predicts else self._owe(message.request_id, stats, now)
            return [SendDown(message, session, output, stats, owed)]
        if not predicts:
            return [AckUp(message.request_id, stats)]
        if isinstance(message, Verify):
            self.replied.setdefault(message.request_id, set()).add(message.window_id)
        return [Reply(message, session, output, stats)]

    def compute_failed(self, message: ActivationMessage, text: str) -> list[Command]:
        """The compute of ``message`` was refused or failed: stage 0 hears it where it listens."""
        self._computed(message)
        return [self._fail(message, text)]

    def compute_stopped(self, message: ActivationMessage) -> list[Command]:
        """A ``Cancel`` stopped the compute of ``message``: nothing goes on."""
        self._computed(message)
        return []

    def downstream_replied(self, reply: Message, *, now: float, index: int) -> list[Command]:
        """A reply read from downstream: an ``Ack`` is merged into the one owed, in order.

        ``index`` is this stage's; a prefill chunk's ``Ack`` names the hop below it as its
        edge (its write and its wait), for stage 0's chunk planning. Anything else (an
        ``Error`` from further down) travels up unchanged.
        """
        owed = self.owed.popleft() if self.owed else None
        if not isinstance(reply, Ack) or owed is None:
            return [RelayUp(reply)]
        wait_us = max(0, round((now - owed.sent) * 1e6))
        own = owed.stats
        if own.slowest_tokens:  # a prefill chunk: this stage's edge is this hop
            own = attrs.evolve(
                own, edge_write_us=own.forward_write_us, edge_wait_us=wait_us, edge_stage=index
            )
        stats = own.merge(reply.stats)
        stats = attrs.evolve(stats, downstream_wait_us=stats.downstream_wait_us + wait_us)
        cached = min(owed.cached, reply.cached)  # what every stage from here on holds
        return [AckUp(owed.request_id, stats, cached)]

    def close(self) -> list[Command]:
        """The lane is over: every session it holds is dropped."""
        closing: list[Command] = [Close(rid, s, False) for rid, s in self.sessions.items()]
        self.sessions.clear()
        return closing

    # --- rows -----------------------------------------------------------------------------------

    def _configure(self, message: Configure) -> list[Command]:
        rid = message.request_id
        if rid not in self.sessions and len(self.sessions) >= self.max_sessions:
            raise ProtocolError(
                f"Configure for request {rid} would open more than {self.max_sessions} requests"
                " on one lane; a lane carries one request at a time"
            )
        replaced = self.sessions.pop(rid, None)
        closing: list[Command] = [] if replaced is None else [Close(rid, replaced, False)]
        return [*closing, Open(message)]

    def _activations(self, message: ActivationMessage, activations: Any) -> list[Command]:
        session = self.sessions.get(message.request_id)
        if session is None:
            text = f"request {message.request_id} was not configured on this lane"
            return [self._fail(message, text)]
        if isinstance(message, Verify):
            self.current, self.current_cancelled = message, False
        return [Compute(message, session, activations)]

    def _onward(
        self, message: Message, *, cached: int = 0, fresh_session: bool = False, now: float
    ) -> list[Command]:
        """What the table says of a message this stage has done its part of (not a compute)."""
        rule = rule_for(message)
        if rule.owes is Owes.ACK:
            return [
                self._ack(message, _ONE_STAGE, cached=cached, fresh_session=fresh_session, now=now)
            ]
        if rule.owes is Owes.STATUS:
            return [SendStatus(message.request_id)]
        if rule.owes is Owes.NOTHING:
            passed = rule.passed_on and not self.is_last
            return [PassOn(message, owed=None)] if passed else []
        raise ProtocolError(f"a {type(message).__name__} is answered only after a compute")

    def _ack(
        self,
        message: Message,
        own: StageStats,
        *,
        cached: int = 0,
        fresh_session: bool = False,
        now: float,
    ) -> Command:
        """An acked message: the last stage acks it; the others pass it on, owing the ack."""
        if self.is_last:
            return AckUp(message.request_id, own, cached)
        idle = not self.owed  # no acks in flight: the downstream connection is idle
        owed = self._owe(message.request_id, own, now, cached)
        return PassOn(message, owed, fresh_session=fresh_session and idle)

    def _owe(self, request_id: int, stats: StageStats, now: float, cached: int = 0) -> OwedAck:
        owed = OwedAck(request_id, stats, now, cached)
        self.owed.append(owed)
        return owed

    def _fail(self, message: Message, text: str) -> Fail:
        upstream = fails_upstream(message, is_last=self.is_last)
        return Fail(message.request_id, text, upstream=upstream)

    def _computed(self, message: ActivationMessage) -> None:
        if isinstance(message, Verify):  # the window being computed is done with
            self.current, self.current_cancelled = None, False
