"""The speculation controller: decides which verify windows to open and what each reply commits.

Theory of operation
-------------------
The controller owns one request's decode after prefill. It holds the committed history
(prompt plus generated tokens; the last one, ``c``, is committed but not yet fed to the model)
and a :class:`~._windows.VerifyWindowScheduler` whose FIFO is the single record of the windows
in flight. It never does I/O and never reads a clock; a Trio shell drives it (decide, then do):

1. **Fill.** Before each fill the shell passes in stage 0's load reading
   (:meth:`~SpeculationController.observe_load`). While
   :meth:`SpeculationController.next_draft_request` returns a :class:`DraftRequest`, the shell
   asks its drafter for ``drafts`` tokens following ``context`` (none when ``drafts`` is 0) and
   hands them to :meth:`~SpeculationController.open_window`, which returns a
   :class:`SendWindow` to carry out (stage-0 compute + ``Verify`` on the lane). With no live
   window in flight the window *starts an epoch*: inputs ``[c, d1..dk]`` at the position of
   ``c``. Otherwise (depth above 1) it is a *continuation chunk* of the current epoch, drafted on
   the assumption that every live window before it is fully accepted: inputs ``[e1..em]`` at
   the next position, so chunks never overlap. A continuation that gets no drafts is a horizon
   miss, and filling pauses until the next reply.
2. **Reply.** :meth:`~SpeculationController.on_predictions` takes a window's predictions (one
   per input row) and returns commands. A stale window's reply is consumed (counted, never
   committed); :meth:`~SpeculationController.on_cancelled` takes the last stage's
   ``Cancelled`` list of stale windows that will never be answered (and a reply for a later
   window proves the same of stale windows still queued before it). A live
   window is judged by :func:`~._verdict.accept_window` against its verdict vector (its own
   predictions when it starts an epoch, else the previous chunk's boundary plus them). A verdict
   that ends generation (EOG, budget) gives :class:`Commit` + :class:`Finish`; a wrong draft gives
   :class:`Commit` (accepted drafts + the target's correction) + :class:`NewEpoch` (the later
   windows now stale, to ``Cancel``, and the position the next epoch restarts from). A full
   accept whose bonus token the next chunk guessed commits the drafts only and keeps the bonus
   as that chunk's boundary; any other full accept commits the bonus too, and a dependent chunk
   that guessed differently goes stale behind a :class:`NewEpoch`.

Committed tokens are always entries of the target's verdict vectors, so the output equals plain
decoding of the target. Drafts are bounded so that fully accepted windows never overshoot the
token budget. Live windows always belong to the current epoch and queue behind every stale
window, and after each reply plus a fill at least one live window is in flight until the request
finishes, so a shell that waits for the next reply never waits on a cancelled window alone.

With ``adaptive=True`` the draft width follows the original's draft-model policy: doubled after
a full accept, one more after a tail reject (up to the configured width), one less after an
early reject. The rest of the policy is the controller's `SpeculationPolicy`
(`stagerun._decide._pace`), fed from here: the live windows in flight follow the full-accept
rate (`DepthControl`), depth and drafts shrink as stage 0's load rises
(`speculation_share`), and drafting is switched off for the rest of the request once it is
measured not to pay (`SpeculationPolicy.judge_drafting`). Without ``adaptive`` the
configured depth and width always apply.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import attrs

from .._errors import VerifyWindowError
from ._commands import (
    Command,
    Commit,
    DraftRequest,
    Finish,
    FinishReason,
    NewEpoch,
    SendWindow,
    WindowTimings,
)
from ._measured import SpeculationTimings
from ._pace import ADAPTIVE_INITIAL_WIDTH, SpeculationPolicy
from ._verdict import (
    SpeculationStats,
    Verdict,
    VerdictKind,
    accept_window,
    compose_target_predictions,
)
from ._windows import VerifyWindow, VerifyWindowScheduler

MAX_CERTAIN_DRAFTS = 32
"""Drafts certain to be accepted (a grammar's forced tokens) one window carries at most."""


class SpeculationController:
    """Pure decision core of speculative decoding for one request.

    Args:
        history: prompt plus the tokens generated so far (at least the first one).
        prompt_len: how many tokens of ``history`` are prompt.
        max_tokens: the most tokens generation may produce, counting those already generated.
        eog: end-of-generation token ids.
        depth: verify windows kept in flight at most (1: serial).
        width: drafts per window at most (0: plain decoding through windows).
        adaptive: let the width and depth follow measured acceptance and stage 0's load, and
            switch drafting off once it does not pay (see `SpeculationPolicy`).
        initial_width: the width of the first windows (default ``width``); with ``adaptive``
            a small start grows with well-accepted windows, like a TCP slow start
            (:meth:`for_request` starts adaptive requests so).
        now_ms: the time the request's occupancy accounting starts from.
    """

    def __init__(
        self,
        history: Sequence[int],
        *,
        prompt_len: int,
        max_tokens: int,
        eog: Collection[int] = (),
        depth: int = 1,
        width: int = 4,
        adaptive: bool = False,
        initial_width: int | None = None,
        now_ms: float = 0.0,
    ) -> None:
        if not 0 <= prompt_len < len(history):
            raise ValueError(
                f"history must hold the prompt ({prompt_len} tokens) and the first generated "
                f"token, got {len(history)} tokens"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if width < 0:
            raise ValueError(f"window width must be at least 0, got {width}")
        self.scheduler = VerifyWindowScheduler(depth, now_ms=now_ms)
        self._history = list(history)
        self._prompt_len = prompt_len
        self._max_tokens = max_tokens
        self._eog = frozenset(eog)
        self._max_width = width
        if initial_width is not None and not 0 <= initial_width <= width:
            raise ValueError(f"initial width must be within 0..{width}, got {initial_width}")
        self._width = width if initial_width is None else initial_width
        self._adaptive = adaptive
        self._epoch = 0
        self._boundary: int | None = None
        self._horizon_dry = False
        self._stats = SpeculationStats()
        self.policy = SpeculationPolicy(depth, adaptive=adaptive, generated=self.generated_count)
        self.finish_reason: FinishReason | None = None
        if self._history[-1] in self._eog:
            self.finish_reason = "eog"
        elif self.generated_count >= max_tokens:
            self.finish_reason = "length"

    @classmethod
    def for_request(
        cls,
        history: Sequence[int],
        *,
        prompt_len: int,
        max_tokens: int,
        eog: Collection[int] = (),
        depth: int = 1,
        width: int = 4,
        adaptive: bool = False,
        now_ms: float = 0.0,
    ) -> SpeculationController:
        """The controller of one request's decode, as the runtime starts it: an adaptive
        request starts with ``ADAPTIVE_INITIAL_WIDTH`` drafts per window (at most ``width``)
        and earns the rest; any other starts at ``width``."""
        return cls(
            history,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            eog=eog,
            depth=depth,
            width=width,
            adaptive=adaptive,
            initial_width=min(ADAPTIVE_INITIAL_WIDTH, width) if adaptive else None,
            now_ms=now_ms,
        )

    def __repr__(self) -> str:
        stale = sum(window.stale for window in self.scheduler.in_flight)
        return (
            f"<SpeculationController epoch={self._epoch} "
            f"generated={self.generated_count}/{self._max_tokens} "
            f"in_flight={self.scheduler.in_flight_len()} stale={stale} width={self._width} "
            f"finished={self.finish_reason}>"
        )

    # --- state ---------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(self._history)

    @property
    def generated(self) -> tuple[int, ...]:
        """The committed tokens after the prompt."""
        return tuple(self._history[self._prompt_len :])

    @property
    def generated_count(self) -> int:
        return len(self._history) - self._prompt_len

    @property
    def epoch(self) -> int:
        """The epoch of the newest window that started one (0 before any)."""
        return self._epoch

    @property
    def width(self) -> int:
        return self._width

    @property
    def drafting(self) -> bool:
        """False once drafting was switched off for the rest of the request (not paying)."""
        return self.policy.drafting

    @property
    def window_limit(self) -> int:
        """Live windows the request may keep in flight now (its depth, under load and
        acceptance when adaptive)."""
        return self.policy.window_limit()

    @property
    def shortest_round_trip_ms(self) -> float | None:
        """The shortest window round trip measured so far (None before the first reply)."""
        shortest = self.policy.pace.shortest_round_trip_ms
        return None if math.isinf(shortest) else shortest

    def stats(self) -> SpeculationStats:
        return attrs.evolve(self._stats, width=self._width)

    def measured(self, now_ms: float) -> SpeculationTimings:
        """What the request's speculation measured, as of ``now_ms``."""
        return SpeculationTimings(
            stats=self.stats(),
            windows=self.scheduler.stats(now_ms),
            drafting_switched_off=not self.drafting,
            shortest_window_ms=self.shortest_round_trip_ms,
        )

    def timings(self, now_ms: float) -> dict[str, Any]:
        """The speculative entries of the response's ``timings`` map, as of ``now_ms``."""
        return self.measured(now_ms).to_json()

    def _live(self) -> list[VerifyWindow]:
        return [window for window in self.scheduler.in_flight if not window.stale]

    # --- filling the pipeline ------------------------------------------------------------------

    def observe_load(self, load: float, *, now_ms: float) -> None:
        """Take stage 0's load reading (0..1, the share of the last second its ticks computed)
        as windows are about to open, at ``now_ms``.

        An adaptive request keeps fewer live windows in flight and asks for fewer drafts the
        busier stage 0 is (`speculation_share`), and none from 90% busy on. Drafting is also
        judged here, as of ``now_ms``: it is switched off for the rest of the request once it
        is measured not to pay (`SpeculationPolicy.judge_drafting`).
        """
        self.policy.observe_load(load)
        self.policy.judge_drafting(self._stats, self.generated_count, now_ms)

    def next_draft_request(self) -> DraftRequest | None:
        """The drafts the next window needs, or None when no window should open now."""
        if self.finished or not self.scheduler.has_capacity():
            return None
        remaining = self._max_tokens - self.generated_count
        live = self._live()
        if not live:
            max_drafts = min(self._width, remaining - 1)
            return DraftRequest(
                context=tuple(self._history),
                max_drafts=max_drafts,
                position=len(self._history),
                starts_epoch=True,
                drafts=self.policy.drafts_for(max_drafts),
                room=min(MAX_CERTAIN_DRAFTS, remaining - 1),
            )
        if len(live) >= self.policy.window_limit():
            return None
        if self._horizon_dry or not self.scheduler.supports_pipelining(self._width):
            return None
        optimistic = [token for window in live for token in window.proposal]
        # Room for the drafts of this chunk plus the bonus token of a full accept.
        max_drafts = min(self._width, remaining - len(optimistic) - 1)
        if max_drafts < 1:
            return None
        last = live[-1]
        return DraftRequest(
            context=(*self._history, *optimistic),
            max_drafts=max_drafts,
            position=last.base_position + len(last.inputs),
            starts_epoch=False,
            drafts=self.policy.drafts_for(max_drafts),
            room=min(MAX_CERTAIN_DRAFTS, remaining - len(optimistic) - 1),
        )

    def open_window(
        self, drafts: Sequence[int], *, now_ms: float, certain: int = 0
    ) -> SendWindow | None:
        """Open the window :meth:`next_draft_request` asked for, with the drafter's tokens.

        Drafts beyond ``max_drafts`` are ignored, except that the first ``certain`` (tokens
        the target is sure to produce, such as a grammar's forced ones) may fill the
        request's ``room``. A continuation with no drafts opens nothing (a horizon miss) and
        returns None; filling then pauses until the next reply.

        Raises:
            VerifyWindowError: no window may open now (finished, or the pipeline is full).
        """
        request = self.next_draft_request()
        if request is None:
            raise VerifyWindowError(
                f"no verify window may open now: {self!r} (call next_draft_request first)"
            )
        limit = max(request.max_drafts, min(certain, request.room))
        proposal = tuple(int(token) for token in drafts[:limit])
        if request.starts_epoch:
            self._epoch += 1
            base = len(self._history) - 1
            inputs = (self._history[-1], *proposal)
        else:
            self.scheduler.record_horizon_refill(len(proposal))
            if not proposal:
                self._horizon_dry = True
                return None
            base = request.position
            inputs = proposal
        window = self.scheduler.open(
            base,
            base - self._prompt_len,
            now_ms=now_ms,
            epoch=self._epoch,
            inputs=inputs,
            proposal=proposal,
            starts_epoch=request.starts_epoch,
        )
        self.policy.pace.opened(window.id, now_ms)
        return SendWindow(window)

    # --- replies -------------------------------------------------------------------------------

    def on_predictions(
        self,
        window_id: int,
        tokens: Sequence[int],
        *,
        now_ms: float,
        timings: WindowTimings | None = None,
    ) -> list[Command]:
        """Take the predictions of window ``window_id``; return the commands they lead to.

        ``timings`` is what the window cost, counted when the window turns out to be stale
        (without it, its round trip; see `WindowTimings`).

        Raises:
            VerifyWindowError: the reply is out of order, for no window in flight, or its
                length does not match the window's inputs.
        """
        window = self.scheduler.peek_reply(window_id)
        predictions = tuple(tokens)
        if not window.stale and len(predictions) != len(window.inputs):
            raise VerifyWindowError(
                f"verify window {window.id} (epoch {window.epoch}, position "
                f"{window.base_position}) returned {len(predictions)} tokens for "
                f"{len(window.inputs)} inputs"
            )
        round_trip = self.policy.pace.replied(window_id, now_ms)
        dropped = self.scheduler.discard_stale_before(window_id, now_ms=now_ms)
        self.policy.pace.forget([w.id for w in dropped])
        self.scheduler.complete_next(window_id, now_ms=now_ms)
        self._horizon_dry = False
        if window.stale:
            cost = _stale_cost(timings, round_trip or 0.0)
            self.scheduler.record_stale_execution(*attrs.astuple(cost))
            return []
        if window.starts_epoch:
            target = predictions
        else:
            assert self._boundary is not None, f"continuation {window} without a boundary"
            target = compose_target_predictions(self._boundary, predictions, len(window.proposal))
        self._boundary = None
        verdict = accept_window(
            window.proposal,
            target,
            remaining=self._max_tokens - self.generated_count,
            eog=self._eog,
        )
        self._observe(verdict, len(window.proposal))
        later = self._live()
        if (
            verdict.kind is VerdictKind.FULL_ACCEPT
            and not verdict.stop
            and later
            and later[0].proposal[:1] == verdict.tokens[-1:]
        ):
            # The next chunk of this epoch guessed the bonus token: keep it as its boundary.
            self._boundary = verdict.tokens[-1]
            return self._commit(window.id, verdict.tokens[:-1])
        commands = self._commit(window.id, verdict.tokens)
        if verdict.stop:
            last = verdict.tokens[-1]
            return commands + self._finish("eog" if last in self._eog else "length")
        if verdict.rejected or later:
            stale = self.scheduler.mark_epoch_stale(window.epoch)
            self.scheduler.mark_recovery_epoch(len(stale))
            ids = tuple(w.id for w in stale)
            restart = len(self._history) - 1
            commands.append(
                NewEpoch(
                    stale_epoch=window.epoch,
                    epoch=self._epoch + 1,
                    cancel_window_ids=ids,
                    restart_position=restart,
                    reason=f"window {window.id} diverged at position {restart} "
                    f"(epoch {window.epoch}); stale windows {list(ids)}",
                )
            )
        return commands

    def on_cancelled(self, window_ids: Sequence[int], *, now_ms: float) -> tuple[int, ...]:
        """Account for the windows the last stage's ``Cancelled`` says will get no reply.

        Returns the ids that were still in flight. Their slots are free again: fill next.

        Raises:
            VerifyWindowError: a listed window is not stale.
        """
        dropped = self.scheduler.discard_cancelled(window_ids, now_ms=now_ms)
        self.policy.pace.forget(window_ids)
        return tuple(window.id for window in dropped)

    @property
    def drained(self) -> bool:
        """Finished, and no window's reply or cancellation is still owed."""
        return self.finished and self.scheduler.in_flight_len() == 0

    def finish(self, reason: FinishReason = "stop") -> list[Command]:
        """End generation early (stop string, client gone); returns [] if already finished."""
        if self.finished:
            return []
        return self._finish(reason)

    def _commit(self, window_id: int, tokens: tuple[int, ...]) -> list[Command]:
        if not tokens:
            return []
        self._history.extend(tokens)
        return [Commit(window_id=window_id, tokens=tokens)]

    def _finish(self, reason: FinishReason) -> list[Command]:
        stale = self.scheduler.mark_epoch_stale(self._epoch)
        self.scheduler.mark_stale(len(stale))
        self._boundary = None
        self.finish_reason = reason
        return [
            Finish(
                reason=reason,
                epoch=self._epoch,
                cancel_window_ids=tuple(window.id for window in stale),
                pending_window_ids=tuple(window.id for window in self.scheduler.in_flight),
            )
        ]

    def _observe(self, verdict: Verdict, proposed: int) -> None:
        before = self._stats
        self._stats = self._stats.observe(verdict, proposed)
        self.policy.observe_windows(before, self._stats)
        if not self._adaptive or self._max_width == 0:
            return
        if verdict.kind is VerdictKind.FULL_ACCEPT:
            self._width = min(self._width * 2, self._max_width)
        elif verdict.kind is VerdictKind.TAIL_REJECT:
            self._width = min(self._width + 1, self._max_width)
        elif verdict.kind is VerdictKind.EARLY_REJECT:
            self._width = max(self._width - 1, 1)


def _stale_cost(timings: WindowTimings | None, round_trip_ms: float) -> WindowTimings:
    """What a stale window cost: the shell's timings, with the round trip the controller
    measured as its verify time unless the shell gave one."""
    if timings is None:
        return WindowTimings(verify_elapsed_ms=round_trip_ms)
    if timings.verify_elapsed_ms:
        return timings
    return attrs.evolve(timings, verify_elapsed_ms=round_trip_ms)
