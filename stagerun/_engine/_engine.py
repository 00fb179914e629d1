"""`StageEngine`: what a stage does with its requests, apart from any lane.

Theory of operation: every stage, stage 0 included, holds one engine. It owns the stage's
compute (a `TickBatcher`, which batches the forwards of every session tick by tick), its
prefix cache of KV blocks, the `SessionBudget` that bounds what the sessions of all its
requests hold, and the counters of stale work. It is the one home of what a stage does with
a request:

* `open` a session (refused past the budget), and `restore` the longest run of a prefix's
  blocks the stage holds into it;
* `compute` one message's layers on the session's cache (charged to the budget first; a
  verify window that a ``Cancel`` named stops at a layer boundary and is counted as stale);
* `answer`, on the last stage: the next tokens, sampled by position from the request's seed
  (so stale windows never disturb them);
* `remember` the session's whole blocks for later requests, and `close` it.

The lane around it is someone else's: on stages 1.. a `stagerun._stage._worker.LaneWorker`
carries frames in and replies out; on stage 0 a `stagerun._driver._request.Request` builds
the messages it sends down the lane. Neither computes, samples or charges the budget itself.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Literal

import attrs
import numpy as np
import trio

from .. import _proto, _spans
from .._decide._ticks import DEFAULT_TICK_ROWS
from .._errors import ComputeCancelled, StageError
from ..abc import ComputeBackend, ForwardItem, exports_kv
from ._batcher import INLINE_SECONDS, TickBatcher, TickInfo
from ._budget import DEFAULT_MAX_KV_TOKENS, DEFAULT_MAX_SESSIONS, SessionBudget
from ._grammar import GrammarError, Grammars
from ._prefix import DEFAULT_PREFIX_CACHE_MB, PrefixCache, keep_blocks, restore_blocks
from ._recent import RecentWork, clock_id
from ._sampler import RowSampler
from ._session import Session, StopCheck, check_finite, compute_stats

__all__ = ["SessionRefused", "StageEngine"]


class SessionRefused(StageError):
    """The stage's `SessionBudget` turned a request down: no session, or no room to grow."""


class StageEngine:
    """One stage's compute, prefix cache and session budget, shared by all its requests.

    Args:
        backend: the compute backend for this stage's layers.
        index: the stage's position in the pipeline (0 is the driver's).
        max_batch: sessions one tick computes together at most (1: no batching).
        tick_rows: rows one tick computes at most (a larger forward runs alone).
        gather: how many groups decoding sessions travel in (stage 0's, see `TickBatcher`).
        inline_seconds: the longest a tick of one small forward may hold the Trio thread
            (it saves a worker thread's hand-offs; 0: every tick in a worker thread).
        max_sessions: requests open at once on this stage.
        max_kv_tokens: KV positions the caches of all those requests may reach together.
        prefix_cache_bytes: what the prefix cache may hold (0: none). Its KV positions
            come out of ``max_kv_tokens``, and requests take them back when they need them.
            A backend without `ComputeBackend.export_kv` keeps none.
    """

    def __init__(
        self,
        backend: ComputeBackend,
        *,
        index: int,
        max_batch: int | None = None,
        tick_rows: int = DEFAULT_TICK_ROWS,
        gather: int | None = None,
        inline_seconds: float = INLINE_SECONDS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MB << 20,
        grammars: Grammars | None = None,
    ) -> None:
        self.backend = backend
        self.grammars = grammars  # None: requests with a grammar are refused
        self.index = index
        self.budget = SessionBudget(max_sessions=max_sessions, max_kv_tokens=max_kv_tokens)
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_bytes > 0 and exports_kv(backend):
            self.prefix_cache = PrefixCache(prefix_cache_bytes, budget=self.budget)
        self.batcher = TickBatcher(
            backend,
            max_rows=tick_rows,
            max_items=max_batch,
            gather=gather,
            inline_seconds=inline_seconds,
        )
        self.computes = 0  # forwards asked for (a stale one dropped unseen included)
        self.stale_dropped = 0  # stale windows dropped before their compute started
        self.stale_stopped = 0  # stale windows whose compute stopped at a layer boundary
        # ... and the layer each stopped before (strictly inside this stage's layers)
        self.stale_stopped_layers: collections.Counter[int] = collections.Counter()
        self.recent = RecentWork()  # the latest computes, for a probe that asks (the web page)

    def __repr__(self) -> str:
        lo, hi = self.backend.layers
        return (
            f"<StageEngine index={self.index} layers={lo}..{hi} sessions={self.budget.sessions} "
            f"computes={self.computes} stale_dropped={self.stale_dropped} "
            f"stale_stopped={self.stale_stopped}>"
        )

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the model's last layer (and so samples)."""
        return bool(self.backend.is_last)

    def status(self, request_id: int = 0) -> _proto.Status:
        """The stage's answer to a ``Probe``: its prefix cache, its ticks so far, and the
        latest computes of ``request_id`` (none for 0), on its clock (see `RecentWork`)."""
        cache = self.prefix_cache
        return _proto.Status(
            request_id=request_id,
            stage_index=self.index,
            prefix=cache.stats() if cache is not None else _proto.PrefixStats(),
            clock_ns=time.perf_counter_ns(),
            clock_id=clock_id(),
            ticks=self.batcher.ticks,
            tick_items=self.batcher.items,
            spans=self.recent.of(request_id),
        )

    # -- a session's life ---------------------------------------------------------------------

    def open(self, request_id: int, sampling: _proto.SamplingParams, prompt_len: int) -> Session:
        """A new session for ``request_id``, charged to the budget.

        Raises:
            SessionRefused: the stage has as many sessions open as its budget allows.
        """
        refusal = self.budget.open()
        if refusal is not None:
            raise SessionRefused(f"stage {self.index} refused request {request_id}: {refusal}")
        session = Session(cache=self.backend.new_cache(), sampling=sampling, prompt_len=prompt_len)
        if self.is_last:
            session.sampler = RowSampler(sampling, prompt_len)
        return session

    async def constrain(self, session: Session) -> None:
        """Give ``session``'s sampler its grammar's matcher (compiled in a worker thread).

        Raises:
            SessionRefused: the grammar does not compile, or this stage has no vocabulary
                to compile it over.
        """
        grammar = session.sampling.grammar
        if session.sampler is None or not grammar:
            return
        if self.grammars is None:
            raise SessionRefused(
                f"stage {self.index} cannot apply a grammar: it was started without its "
                "model's tokenizer"
            )
        try:
            matcher = await trio.to_thread.run_sync(self.grammars.matcher, grammar)
        except GrammarError as exc:
            raise SessionRefused(f"stage {self.index} refused the grammar: {exc}") from None
        session.sampler.grammar = matcher

    async def restore(self, session: Session, names: tuple[int, ...] | list[int]) -> int:
        """Copy the longest run of ``names`` this stage holds into ``session``'s new cache.

        Returns the positions restored: 0 without a prefix cache, or without room for them
        in the budget (then the request recomputes them, which is never wrong).
        """
        cache = self.prefix_cache
        if cache is None or not names:
            return 0
        if session.sampler is not None:  # the last stage samples after the blocks' tokens
            names = names[: cache.run_with_tokens(names)]
        held = await restore_blocks(
            cache,
            self.backend,
            session.cache,
            names,
            room=lambda positions: self.budget.grow(session, positions) is None,
        )
        if session.sampler is not None and held:
            restored = cache.tokens_of(names[:held])
            assert restored is not None, "the blocks were checked for their tokens"
            session.sampler.restore(restored)
        return held * _proto.PREFIX_BLOCK

    async def remember(self, session: Session, names: tuple[int, ...] | list[int]) -> None:
        """Keep the blocks of ``names`` that ``session``'s cache holds and the stage does not."""
        if self.prefix_cache is not None and names:
            sampler = session.sampler
            tokens = None if sampler is None else list(sampler.history)
            await keep_blocks(self.prefix_cache, self.backend, session.cache, names, tokens)

    def trim(self, session: Session, position: int) -> None:
        """Cut ``session``'s cache, and its sampling history, back to ``position``."""
        session.cache.trim(position)
        if session.sampler is not None:
            session.sampler.trim(position)

    def close(self, session: Session) -> None:
        """End ``session``: what it held goes back to the budget."""
        self.budget.close(session)
        self.batcher.forget(session.cache)

    def summarize(self, request_id: int, session: Session) -> None:
        """The span an ended session reports: its counts, and the stage's stale-work counters."""
        _spans.stage_request_summary(
            self.index,
            request_id,
            session.started_ns,
            {
                "message_count": session.messages,
                "computes": session.computes,
                "token_count": session.tokens,
                "compute_ms": session.compute_us / 1000.0,
                "forward_write_ms": session.forward_write_us / 1000.0,
                "stale_dropped": self.stale_dropped,
                "stale_stopped": self.stale_stopped,
                "stale_stopped_layers": {
                    str(layer): n for layer, n in sorted(self.stale_stopped_layers.items())
                },
            },
        )

    # -- compute and answer -------------------------------------------------------------------

    async def compute(
        self,
        session: Session,
        message: _proto.ActivationMessage,
        hidden: np.ndarray[Any, Any] | None = None,
        *,
        stop: StopCheck | None = None,
    ) -> tuple[np.ndarray[Any, Any], _proto.StageStats]:
        """Run ``message`` through this stage's layers on ``session``'s cache.

        The first stage reads the message's tokens, a later one its ``hidden`` states. A
        verify window computes every row's output (the last stage samples each), anything
        else the last row's. Returns the output and the stats the message reports, whose
        compute time is its tick's, not its wait for the tick.

        Raises:
            SessionRefused: the positions it reaches are past the budget.
            ComputeCancelled: ``stop`` said the window went stale (counted here).
            ValueError, StagerunError: the compute failed, or its output is not finite.
        """
        # The cache can reach no further: a position past its length is a gap, which fails.
        end = min(message.position, session.cache.length) + len(message.tokens)
        refusal = self.budget.grow(session, end)
        if refusal is not None:
            raise SessionRefused(
                f"stage {self.index} has no room for request {message.request_id}: {refusal}"
            )
        scores = session.sampler is not None and session.sampler.scores_prompt
        scoring = isinstance(message, _proto.Prefill) and scores
        verify = isinstance(message, _proto.Verify)
        rows: Literal["all", "last"] = "all" if verify or scoring else "last"
        if self.backend.is_first:
            tokens = np.asarray(message.tokens, dtype=np.int64)
            item = ForwardItem(session.cache, message.position, tokens=tokens, logits=rows)
        else:
            item = ForwardItem(session.cache, message.position, hidden=hidden, logits=rows)
        item = attrs.evolve(item, should_stop=stop)
        if session.sampler is not None:
            session.sampler.record(min(message.position, session.cache.length), message.tokens)
        self.computes += 1
        start, tick = time.perf_counter(), TickInfo()
        try:
            out = await self.batcher.forward(
                item,
                prefill=isinstance(message, _proto.Prefill),
                stale=None if stop is None else stop.cancelled,
                tick=tick,
                window=verify,
            )
        except ComputeCancelled:
            assert stop is not None, "only a verify window's compute is ever stopped"
            ended = time.perf_counter()
            self._count_stopped(message, stop.layers_done, ended - start)
            assert isinstance(message, _proto.Verify)
            self.recent.stopped(
                message.request_id, int(start * 1e9), int(ended * 1e9), message.window_id
            )
            raise
        check_finite(self.backend, out)
        if scoring:  # every row scores the prompt; the answer needs the last one only
            assert session.sampler is not None
            session.sampler.score(message, out)
            out = out[-1:]
        compute_us = int(tick.seconds * 1e6)  # its tick's time, not the wait for it
        session.messages += 1
        session.computes += 1
        session.tokens += len(message.tokens)
        session.compute_us += compute_us
        _spans.stage_computed(self.index, message, tick.seconds, tick.batch)
        started_ns = int(tick.started * 1e9)
        self.recent.computed(
            message.request_id,
            started_ns,
            started_ns + compute_us * 1000,
            message.window_id if isinstance(message, _proto.Verify) else 0,
            tick.batch,
        )
        return out, compute_stats(message, compute_us, self.index)

    def answer(
        self,
        session: Session,
        message: _proto.ActivationMessage,
        out: np.ndarray[Any, Any],
        stats: _proto.StageStats | None = None,
    ) -> _proto.Predictions:
        """The last stage's answer to ``message``: the token after each row of ``out``.

        ``out`` holds the logits of the message's last rows; the token after position ``p``
        is sampled from the request's seed and ``p + 1`` alone, so a stale window's reply
        never changes what a later one samples.
        """
        assert session.sampler is not None, "only the last stage answers"
        rows = session.sampler.answer(message, out)
        scored: tuple[tuple[Any, ...], ...] = ((), (), ())
        if isinstance(message, _proto.Prefill) and session.sampler.scores_prompt:
            scored = session.sampler.take_prompt_scores()
        return _proto.Predictions(
            request_id=message.request_id,
            window_id=message.window_id if isinstance(message, _proto.Verify) else 0,
            position=message.position,
            tokens=rows.tokens,
            stats=stats if stats is not None else _proto.StageStats(),
            logprobs=rows.logprobs,
            top_ids=rows.top_ids,
            top_logprobs=rows.top_logprobs,
            prompt_logprobs=scored[0],
            prompt_top_ids=scored[1],
            prompt_top_logprobs=scored[2],
        )

    def _count_stopped(
        self, message: _proto.ActivationMessage, layers_done: int, seconds: float
    ) -> None:
        """Count a stale compute that stopped at a layer boundary, and where it stopped.

        ``layers_done`` layers ran, so the compute stopped before layer ``lo + layers_done``.
        Before the first layer nothing was computed: that window was dropped before it
        started, like one still queued. Otherwise it stopped part-way, strictly inside the
        stage's layers, and that layer is counted in ``stale_stopped_layers``.
        """
        layer = self.backend.layers[0] + layers_done
        if layers_done == 0:
            self.stale_dropped += 1
        else:
            self.stale_stopped += 1
            self.stale_stopped_layers[layer] += 1
        _spans.stage_stopped(self.index, message, layer, seconds)
