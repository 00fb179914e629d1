"""SpeculationController + VerifyWindowScheduler under a Hypothesis state machine.

The machine plays every part around the controller: a drafter that is sometimes right and
sometimes wrong, stage 0 (which computes a window when it is sent), the pipeline's FIFO with a
last stage that keeps a position-addressed KV cache, ``Cancel`` messages that arrive late or
never reach a window in time, the last stage's ``Cancelled`` answers (or, for a peer that sends
none, replies that a cancellation swallows), and a clock. The "target
model" is a hash of the history, so the sequence plain decoding would produce is known. The
invariant is the speculative-decoding promise: committed tokens are exactly the target's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stagerun._decide import (
    Command,
    Commit,
    Finish,
    NewEpoch,
    SendWindow,
    SpeculationController,
    VerifyWindow,
    WindowTimings,
)

VOCAB = 8
EOG_TOKEN = VOCAB - 1


def target_next(history: Sequence[int]) -> int:
    """The target model: a deterministic hash of the length and the last three tokens."""
    x = len(history)
    for token in history[-3:]:
        x = (x * 31 + token + 7) % 1009
    return x % VOCAB


def plain_decode(prompt: Sequence[int], max_tokens: int, eog: frozenset[int]) -> list[int]:
    history, out = list(prompt), list[int]()
    while len(out) < max_tokens:
        out.append(target_next(history))
        history.append(out[-1])
        if out[-1] in eog:
            break
    return out


# --- the state machine -------------------------------------------------------------------------


@attrs.frozen
class Predicted:
    """A ``Predictions`` reply on the return connection."""

    window_id: int
    tokens: tuple[int, ...]


@attrs.frozen
class CancelledReply:
    """The last stage's ``Cancelled``: windows it will never answer."""

    window_ids: tuple[int, ...]


class SpeculativePipeline(RuleBasedStateMachine):
    """A controller driven through random drafts, cancellations, reply losses and time.

    With ``answers_cancel`` the last stage answers every ``Cancel`` with ``Cancelled`` (as
    stagerun's stages do); without it, cancelled windows just vanish and may even swallow a
    reply already computed, which the controller must survive too.
    """

    @initialize(
        prompt=st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=4),
        depth=st.integers(1, 8),
        width=st.integers(0, 6),
        max_tokens=st.integers(1, 40),
        eog=st.sampled_from([frozenset(), frozenset({EOG_TOKEN})]),
        adaptive=st.booleans(),
        answers_cancel=st.booleans(),
    )
    def start(
        self,
        prompt: list[int],
        depth: int,
        width: int,
        max_tokens: int,
        eog: frozenset[int],
        adaptive: bool,
        answers_cancel: bool,
    ) -> None:
        self.answers_cancel = answers_cancel
        self.expected = plain_decode(prompt, max_tokens, eog)
        self.max_tokens = max_tokens
        self.eog = eog
        self.depth = depth
        self.now = 0.0
        self.controller = SpeculationController(
            [*prompt, self.expected[0]],
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            eog=eog,
            depth=depth,
            width=width,
            adaptive=adaptive,
        )
        self.output = [self.expected[0]]
        self.kv0: list[int] = list(prompt)  # stage 0's cache, updated when a window is sent
        self.kv: list[int] = list(prompt)  # the last stage's cache
        self.queue: list[tuple[VerifyWindow, list[int]]] = []  # sent, not yet computed
        self.replies: list[Predicted | CancelledReply] = []  # on the return connection
        self.pending_cancels: list[int] = []
        self.cancelled: set[int] = set()
        self.went_stale: set[int] = set()
        self.last_id = 0
        self.stopped_by_runtime = False
        self.live_replies = 0
        self.stale_replies = 0

    # -- carrying out commands --

    def apply(self, commands: list[Command]) -> None:
        for command in commands:
            match command:
                case SendWindow(window=window):
                    assert window.id > self.last_id
                    self.last_id = window.id
                    assert window.base_position <= len(self.kv0), "gap in stage 0's cache"
                    context = self.kv0[: window.base_position]
                    self.kv0 = [*context, *window.inputs]
                    self.queue.append((window, context))
                case Commit(window_id=window_id, tokens=tokens):
                    assert window_id not in self.went_stale, f"stale window {window_id} committed"
                    self.output.extend(tokens)
                case NewEpoch(cancel_window_ids=ids) | Finish(cancel_window_ids=ids):
                    self.pending_cancels.extend(ids)
                    self.went_stale.update(ids)
        self.went_stale.update(w.id for w in self.controller.scheduler.in_flight if w.stale)

    def propose(self, context: Sequence[int], count: int, data: st.DataObject | None) -> list[int]:
        drafts: list[int] = []
        if data is not None:
            count = data.draw(st.integers(0, count), label="drafts")
        for index in range(count):
            right = target_next([*context, *drafts])
            wrong = data.draw(st.integers(0, 3), label="wrong") == 0 if data else index % 3 == 2
            drafts.append((right + 1) % VOCAB if wrong else right)
        return drafts

    def fill(self, data: st.DataObject | None) -> None:
        while (request := self.controller.next_draft_request()) is not None:
            assert request.context[: len(self.controller.history)] == self.controller.history
            drafts = self.propose(request.context, request.max_drafts, data)
            send = self.controller.open_window(drafts, now_ms=self.now)
            if send is None:
                break
            self.apply([send])
        live = [w for w in self.controller.scheduler.in_flight if not w.stale]
        assert self.controller.finished or live, "nothing live in flight: the request would hang"

    def compute(self) -> None:
        window, context = self.queue.pop(0)
        base = window.base_position
        assert base <= len(self.kv) and self.kv[:base] == context, "stage caches disagree"
        self.kv = [*context, *window.inputs]
        predictions = [target_next(self.kv[: base + i + 1]) for i in range(len(window.inputs))]
        self.replies.append(Predicted(window.id, tuple(predictions)))

    def deliver(self) -> None:
        reply = self.replies.pop(0)
        if isinstance(reply, CancelledReply):
            accounted = self.controller.on_cancelled(reply.window_ids, now_ms=self.now)
            assert set(accounted) <= set(reply.window_ids) <= self.went_stale
            return
        window_id, predictions = reply.window_id, reply.tokens
        stale = window_id in self.went_stale
        cost = WindowTimings(drain_ms=1.0, verify_elapsed_ms=2.0)
        commands = self.controller.on_predictions(
            window_id, predictions, now_ms=self.now, timings=cost
        )
        self.apply(commands)
        self.live_replies += not stale
        self.stale_replies += stale

    def deliver_cancels(self) -> None:
        if not self.pending_cancels:
            return
        self.cancelled.update(self.pending_cancels)
        self.pending_cancels.clear()
        unanswered = tuple(w.id for w, _ in self.queue if w.id in self.cancelled)
        self.queue = [(w, c) for w, c in self.queue if w.id not in self.cancelled]
        if self.answers_cancel:
            self.replies.append(CancelledReply(unanswered))

    # -- rules --

    @rule(data=st.data())
    def fill_pipeline(self, data: st.DataObject) -> None:
        self.fill(data)

    @precondition(lambda self: self.queue)
    @rule()
    def compute_next(self) -> None:
        self.compute()

    @precondition(lambda self: self.replies)
    @rule(data=st.data())
    def deliver_reply(self, data: st.DataObject) -> None:
        self.deliver()
        if data.draw(st.booleans(), label="cancel at once"):
            self.deliver_cancels()

    @precondition(lambda self: self.queue and not self.replies)
    @rule(data=st.data())
    def fast_round_trip(self, data: st.DataObject) -> None:
        # The reply overtakes the computation of the windows queued behind it.
        self.compute()
        self.deliver_reply(data)

    @precondition(lambda self: self.pending_cancels)
    @rule()
    def cancel_reaches_the_stages(self) -> None:
        self.deliver_cancels()

    def swallowable(self) -> list[int]:
        if self.answers_cancel:
            return []
        return [
            i
            for i, reply in enumerate(self.replies)
            if isinstance(reply, Predicted) and reply.window_id in self.cancelled
        ]

    @precondition(lambda self: self.swallowable())
    @rule(data=st.data())
    def cancel_swallows_a_reply(self, data: st.DataObject) -> None:
        del self.replies[data.draw(st.sampled_from(self.swallowable()))]

    @rule(dt=st.integers(0, 50))
    def advance_clock(self, dt: int) -> None:
        self.now += dt

    @rule(data=st.data())
    def runtime_stops(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9)) == 0:  # a stop string or a client gone, now and then
            self.stopped_by_runtime |= not self.controller.finished
            self.apply(self.controller.finish("stop"))

    # -- invariants --

    @invariant()
    def committed_tokens_are_the_targets_own(self) -> None:
        assert self.output == self.expected[: len(self.output)]
        assert list(self.controller.generated) == self.output
        assert len(self.output) <= self.max_tokens

    @invariant()
    def counters_are_consistent(self) -> None:
        scheduler = self.controller.scheduler
        stats = scheduler.stats(self.now)
        assert stats.opened_windows == stats.completed_windows + stats.in_flight
        assert stats.stale_discarded <= stats.stale_marked
        assert stats.in_flight <= stats.max_in_flight <= self.depth
        assert stats.occupancy_total_ms == pytest.approx(self.now)
        assert stats.opened_windows == self.last_id
        assert self.controller.stats().windows == self.live_replies
        assert stats.stale_drain_ms == self.stale_replies  # 1 ms each; dropped ones cost 0
        assert stats.stale_verify_elapsed_ms == 2 * self.stale_replies

    @invariant()
    def stale_windows_queue_ahead_of_live_ones(self) -> None:
        in_flight = self.controller.scheduler.in_flight
        flags = [w.stale for w in in_flight]
        assert flags == sorted(flags, reverse=True)
        live = [w for w in in_flight if not w.stale]
        assert all(w.epoch == self.controller.epoch for w in live)
        assert [w.id for w in in_flight] == sorted(w.id for w in in_flight)
        for before, after in itertools.pairwise(live):
            assert not after.starts_epoch
            assert after.base_position == before.base_position + len(before.inputs)

    @invariant()
    def finish_reasons_are_honest(self) -> None:
        reason = self.controller.finish_reason
        if reason == "eog":
            assert self.output[-1] in self.eog
        elif reason == "length":
            assert len(self.output) == self.max_tokens

    def teardown(self) -> None:
        # Run what is left to the end: the output must be exactly plain decoding's.
        if not hasattr(self, "controller"):
            return
        # One window computed and one reply delivered per turn, so cancellations still race.
        for _ in range(50 * self.max_tokens + 50):
            if self.controller.finished:
                break
            self.fill(None)
            if self.queue:
                self.compute()
            if self.replies:
                self.deliver()
            self.deliver_cancels()
        assert self.controller.finished
        if not self.stopped_by_runtime:
            assert self.output == self.expected
        if self.answers_cancel:
            # Every window is answered or listed as cancelled: stage 0 never waits on a guess.
            self.deliver_cancels()
            while self.queue:
                self.compute()
            while self.replies:
                self.deliver()
            assert self.controller.drained
            stats = self.controller.scheduler.stats(self.now)
            assert stats.stale_marked == stats.stale_discarded
            assert stats.opened_windows == stats.completed_windows


SpeculativePipeline.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, derandomize=True
)
TestSpeculativePipeline = SpeculativePipeline.TestCase
