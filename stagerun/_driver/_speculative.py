"""The Trio shell of speculative decoding: carries out the controller's decisions.

Theory of operation: `SpeculationController` (sans-IO, in `stagerun._decide`) decides which
verify windows to open, how many drafts each may carry and what each reply commits, and owns
the request's speculation policy (adaptive depth and width, the share left under load, the
switch-off of drafting that doesn't pay); this module only does the I/O and feeds it the
replies, the load readings and the times. It keeps up to the controller's window limit in
flight on the request's lane, each drafted on the assumption that the earlier ones are
accepted. When a draft diverges the controller commits the target's
correction and returns a `NewEpoch`: the shell sends one ``Cancel`` for the stale windows and
opens the next epoch's windows at once, without waiting for stale replies. Stages drop stale
windows still queued and stop a stale compute at the next layer; the last stage answers the
``Cancel`` with ``Cancelled`` for every window it will never answer, and stale replies that
were already on their way are consumed and counted, never committed. Stage 0's own KV cache
and every stage's are trimmed by the authoritative position each ``Verify`` carries.

Committed tokens are always the target's own predictions, sampled on the last stage from a
random stream keyed by (seed, position), so the output equals plain decoding.

With one stage the route is a `stagerun._driver._route.LocalRoute`: each window is answered
as it is sent.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import trio

from .. import _decide, _proto, _spans, telemetry
from .._decide import (
    Commit,
    Finish,
    NewEpoch,
    SendWindow,
    SpeculationController,
    SpeculationTimings,
    WindowTimings,
)
from .._errors import LaneError, StageError
from .._util import one_failure, single_exceptions
from ..abc import Drafter
from ._config import SpeculationConfig
from ._forced import GrammarDrafter
from ._live import LiveRequest
from ._route import Route

_Reply = _proto.Predictions | _proto.Cancelled


def _window_spans(
    tel: telemetry.Telemetry,
    request_id: int,
    reply: _proto.Predictions | _proto.Cancelled,
    opened_ns: dict[int, tuple[int, int]],
    accepted: int,
    stale: bool,
) -> None:
    """One ``stage.openai_decode_verify_window`` span per window that came back or was dropped.

    ``stale``: the window was already stale when its reply arrived (a cancelled window always
    is), so its work on every stage was wasted.
    """
    cancelled = isinstance(reply, _proto.Cancelled)
    ids = reply.window_ids if isinstance(reply, _proto.Cancelled) else (reply.window_id,)
    for window_id in ids:
        opened = opened_ns.pop(window_id, None)
        if opened is None:
            continue
        start, inputs = opened
        _spans.verify_window(
            request_id, window_id, start, inputs, accepted, cancelled=cancelled, stale=stale
        )


log = logging.getLogger("stagerun.speculative")
_WARNED: set[str] = set()  # drafters already said to propose impossible ids


class Speculating(Protocol):
    """What speculative decoding uses of its request (`stagerun._driver._request.Request`)."""

    request_id: int
    prompt_ids: list[int]
    max_tokens: int
    eog: frozenset[int]
    sampling: _proto.SamplingParams
    speculation: SpeculationConfig
    drafter: Drafter | None

    @property
    def wire_dtype(self) -> _proto.ActivationDType: ...

    async def compute(self, message: _proto.ActivationMessage) -> Any:
        """Stage 0's own layers for ``message``."""

    def note(self, reply: _proto.Predictions, first: int) -> None:
        """Keep a live window's rows (log-probabilities), whose first predicts ``first``."""

    async def commit(self, token: int) -> bool:
        """Emit one committed token; True when generation must end (a stop string)."""

    def load(self) -> float:
        """How busy stage 0's compute has been lately (0..1): the pipeline's load."""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: every draft is a token id below it."""

    @property
    def live(self) -> LiveRequest:
        """The request's record for the web page (its windows, as they open and settle)."""


class SpeculativeDecode:
    """One request's speculative decoding: the controller's commands carried out on a lane.

    `run` opens the windows the controller asks for (`fill`), reads every reply the moment it
    arrives (`_read_replies`), hands it to the controller (`_on_reply`) and carries out what
    comes back (`apply`): windows to send, tokens to commit, stale windows to cancel. On one
    stage the route answers each window as it is sent.
    """

    def __init__(self, request: Speculating, lane: Route, history: list[int]) -> None:
        """Decode after prefill; ``history`` is the prompt plus the first generated token,
        which was already committed."""
        config = request.speculation
        assert request.drafter is not None
        drafter = request.drafter
        prompt_len = len(request.prompt_ids)
        self.lane = lane
        self.request = request
        self.request_id = request.request_id
        self.eog = request.eog
        self.config = config
        self.drafter = drafter
        self._started = time.perf_counter()
        self.controller = SpeculationController.for_request(
            history,
            prompt_len=prompt_len,
            max_tokens=request.max_tokens,
            eog=request.eog,
            depth=config.depth,
            width=config.window,
            adaptive=config.adaptive,
            now_ms=0.0,
        )
        if lane.direct_return:  # predictions come back on a return path stage 0 opened
            self.controller.scheduler.mark_direct_prediction_return(upstream_opened=True)
        drafter.begin(history[:prompt_len])
        drafter.commit(history[prompt_len:])
        self._tel = telemetry.current()
        self._opened_ns: dict[int, tuple[int, int]] = {}  # window id -> (opened at, inputs)
        # window id -> (stage 0's compute, its write, when the write ended), in ms: what a
        # window turning out stale cost stage 0 (the controller counts it; see WindowTimings)
        self._costs: dict[int, tuple[float, float, float]] = {}

    def __repr__(self) -> str:
        return (
            f"<SpeculativeDecode request={self.request_id} in_flight={self._live_in_flight()} "
            f"allowed={self.controller.window_limit} drafting={self.controller.drafting}>"
        )

    def now_ms(self) -> float:
        return (time.perf_counter() - self._started) * 1000.0

    async def run(self) -> tuple[SpeculationTimings, str | None]:
        """Decode until the controller is drained; return the speculative timing keys for the
        response and why generation ended (``eog``, ``length`` or ``stop``)."""
        # The reader and the sender often see one broken lane at once: that is one lane failure.
        with single_exceptions(), one_failure((LaneError, StageError)):
            async with trio.open_nursery() as nursery:
                send_channel, replies = trio.open_memory_channel[tuple[_Reply, float]](math.inf)
                nursery.start_soon(self._read_replies, self.lane, send_channel)
                await self.fill()
                while not self.controller.drained:
                    await self._on_reply(*await replies.receive())
                    await self.fill()
                nursery.cancel_scope.cancel()  # the reader waits for a reply that will not come
        return self.timings(), self.controller.finish_reason

    async def _read_replies(
        self,
        lane: Route,
        channel: trio.MemorySendChannel[tuple[_Reply, float]],
    ) -> None:
        # Replies are read the moment they arrive, also while stage 0 drafts and computes the
        # next window: a reply read late would be committed late (and an emulated link, which
        # starts a frame's delay when it is read, would charge the wait twice).
        while True:
            reply = await lane.receive_reply(self.request_id)
            channel.send_nowait((reply, self.now_ms()))  # and when it arrived

    async def _on_reply(
        self, reply: _proto.Predictions | _proto.Cancelled, arrived_ms: float
    ) -> None:
        controller = self.controller
        before = controller.stats()
        was_stale = isinstance(reply, _proto.Predictions) and any(
            w.stale and w.id == reply.window_id for w in controller.scheduler.in_flight
        )
        live = self.request.live
        if isinstance(reply, _proto.Cancelled):
            for window_id in reply.window_ids:
                self._costs.pop(window_id, None)
            controller.on_cancelled(reply.window_ids, now_ms=self.now_ms())
            live.settled(reply.window_ids, "cancelled")
        else:
            timings = self._window_timings(reply.window_id, arrived_ms)
            if not was_stale:
                self.request.note(reply, reply.position + 1)
            await self.apply(
                controller.on_predictions(
                    reply.window_id, reply.tokens, now_ms=self.now_ms(), timings=timings
                )
            )
            accepted = controller.stats().accepted - before.accepted
            live.settled((reply.window_id,), "stale" if was_stale else "verified", accepted)
        if self._tel.enabled:
            _window_spans(
                self._tel,
                self.request_id,
                reply,
                self._opened_ns,
                controller.stats().accepted - before.accepted,
                was_stale,
            )

    def _window_timings(self, window_id: int, arrived_ms: float) -> WindowTimings | None:
        """What window ``window_id`` cost stage 0, for the controller's stale-work counters.

        Replies come in window order, so the costs of earlier windows (answered, or dropped
        unanswered) are forgotten too: the map holds only windows in flight.
        """
        cost = self._costs.pop(window_id, None)
        for earlier in [w for w in self._costs if w < window_id]:
            del self._costs[earlier]
        if cost is None:
            return None
        compute_ms, write_ms, sent_ms = cost
        return WindowTimings(
            drain_ms=max(0.0, self.now_ms() - arrived_ms),  # read, then waiting to be handled
            stage0_compute_ms=compute_ms,
            forward_write_ms=write_ms,
            downstream_wait_ms=max(0.0, arrived_ms - sent_ms),
        )

    def _live_in_flight(self) -> int:
        return sum(not window.stale for window in self.controller.scheduler.in_flight)

    async def fill(self) -> None:
        """Open the windows the controller asks for, with the drafts it asks for.

        The controller first takes stage 0's load reading: how many windows open and how many
        drafts each carries is its decision (under load both shrink; see
        `SpeculationController.observe_load`).
        """
        self.controller.observe_load(self.request.load(), now_ms=self.now_ms())
        forcing = isinstance(self.drafter, GrammarDrafter)
        while (request := self.controller.next_draft_request()) is not None:
            proposal: Sequence[int] = ()
            certain = 0
            if request.drafts > 0 or forcing:  # forced tokens are worth a window at any load
                proposal = await self._propose(request.context, request.drafts)
                certain = self.drafter.certain if isinstance(self.drafter, GrammarDrafter) else 0
            opened = self.controller.open_window(proposal, now_ms=self.now_ms(), certain=certain)
            if opened is None:
                return  # no drafts for a continuation: wait for the next reply
            await self.apply([opened])

    async def _propose(self, context: Sequence[int], max_drafts: int) -> Sequence[int]:
        if getattr(self.drafter, "blocking", True):
            proposal = await trio.to_thread.run_sync(self.drafter.propose, context, max_drafts)
        else:
            proposal = self.drafter.propose(context, max_drafts)  # microseconds: no thread hop
        return self._possible(proposal)

    def _possible(self, proposal: Sequence[int]) -> Sequence[int]:
        """``proposal`` cut at its first id that is not a token of the model (said once).

        Such a draft could never be accepted, and the stages would refuse it: the window
        carries the drafts before it, and decoding goes on.
        """
        vocab = self.request.vocab_size
        for i, token in enumerate(proposal):
            if (
                isinstance(token, bool)
                or not isinstance(token, int | np.integer)
                or not (0 <= token < vocab)
            ):
                name = type(self.drafter).__name__
                if name not in _WARNED:
                    _WARNED.add(name)
                    log.warning(
                        "drafter %s proposed %r, not a token id of this model (0..%d): its "
                        "proposals are cut there",
                        name,
                        token,
                        vocab - 1,
                    )
                return proposal[:i]
        return proposal

    async def apply(self, commands: list[_decide.Command]) -> None:
        """Carry out the controller's commands, in order (a stop string adds a Finish)."""
        queue = deque(commands)
        while queue:
            command = queue.popleft()
            match command:
                case SendWindow(window=window):
                    await self.send(window)
                case Commit(tokens=tokens):
                    self.drafter.commit(tokens)
                    for token in tokens:
                        if token in self.eog:
                            break  # the controller finishes right after this commit
                        if await self.request.commit(token):
                            queue.extend(self.controller.finish("stop"))
                            break
                case NewEpoch(stale_epoch=epoch, cancel_window_ids=ids):
                    await self.cancel(epoch, ids)
                case Finish(epoch=epoch, cancel_window_ids=ids):
                    await self.cancel(epoch, ids)

    async def send(self, window: _decide.VerifyWindow) -> None:
        """Compute stage 0's part of ``window`` and send it (or verify it here, alone)."""
        if self._tel.enabled:
            self._opened_ns[window.id] = (telemetry.now_ns(), len(window.inputs))
        self.request.live.opened(window.id, len(window.proposal))
        message = _proto.Verify(
            request_id=self.request_id,
            window_id=window.id,
            epoch=window.epoch,
            position=window.base_position,
            tokens=tuple(window.inputs),
        )
        # Stage 0's own rows: logits on a one-stage pipeline (the route samples them),
        # hidden states otherwise.
        started = self.now_ms()
        out = await self.request.compute(message)
        computed = self.now_ms()
        await self.lane.send(message, out, self.request.wire_dtype)
        sent = self.now_ms()
        self._costs[window.id] = (computed - started, sent - computed, sent)

    async def cancel(self, epoch: int, window_ids: tuple[int, ...]) -> None:
        if window_ids:
            await self.lane.send(
                _proto.Cancel(request_id=self.request_id, epoch=epoch, window_ids=window_ids)
            )

    def timings(self) -> SpeculationTimings:
        """What the request's speculation measured."""
        return self.controller.measured(self.now_ms())
