"""One request on stage 0, as an object: its ids, cache, committed tokens, text and timings.

Theory of operation: `Request.run` is the recovery loop. Each attempt checks out a lane, sends
``Configure`` and prefills the committed tokens (the prompt, and after a recovery every token
generated so far: `replay_context`) from the longest prefix that stage 0 and every stage hold
in their prefix caches (`Request.first_token`), then decodes, plainly or through pipelined
verify windows (`stagerun._driver._speculative`), and at the end has every stage remember the
blocks it computed (`Request.remember`). A lane failure replaces the
lane; `RecoveryPolicy` says how many failures the request survives and how long it waits for
a fresh lane, and the next attempt starts under a new request id (a new chain session on
every stage). Tokens are committed one by one (`Request.commit`): text assembly with stop
strings happens there, so a recovery never emits a token twice. `Request.completion` turns
the finished request into a `Completion` with its timings and summary spans.

Stage 0's own compute is its engine's (`stagerun._engine.StageEngine`), like any stage's: the
request opens a session on it for each attempt, restored from stage 0's prefix cache and
bounded by its budget. The rest of the way is a `stagerun._driver._route.Route`: a lane of
the pool, or, with one stage, the engine answering what stage 0 computes.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol

import attrs
import numpy as np
import trio

from .. import _proto, _spans, telemetry
from .._decide import SpeculationTimings
from .._decide._prefill import ChunkPolicy, FixedChunks
from .._decide._windows import telemetry_attributes
from .._engine import Session, StageEngine
from .._errors import (
    LaneError,
    RecoveryFailedError,
    StageError,
    StageGivenUpError,
)
from .._text import TextAssembler
from ..abc import Drafter
from ..model import ModelFile
from ._config import RecoveryPolicy, SpeculationConfig
from ._forced import GrammarDrafter
from ._lanes import LanePool
from ._live import LiveRequest
from ._logprobs import LogprobRows, scored_prompt
from ._prefill import PrefillReport
from ._route import SCORING_CHUNK, LaneRoute, LocalRoute, PrefillSettings, Route
from ._speculative import SpeculativeDecode
from ._supervise import given_up
from ._timings import PrefillTimings, RecoveryTimings, Timings
from ._values import Completion, StageInfo, TokenChunk, TokenLogprob

log = logging.getLogger("stagerun.pipeline")

Emit = Callable[[TokenChunk], Awaitable[Any]]


def replay_context(prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
    """What a request prefills on a fresh lane: the prompt, then every token committed so far.

    A module-level function so that the recovery tests can swap in a wrong replay (one that
    drops a token, or the prompt) and see their equality check fail.
    """
    return [*prompt_ids, *generated]


class StageZero(Protocol):
    """What a request uses of its pipeline (`stagerun.Pipeline` is one)."""

    model: ModelFile
    stages: list[StageInfo]
    pool: LanePool | None
    recovery: RecoveryPolicy
    speculation: SpeculationConfig
    wire_dtype: _proto.ActivationDType
    prefill_policy: ChunkPolicy
    prefill_credit: int
    engine: StageEngine  # stage 0's compute, prefix cache and session budget

    def prefix_names(
        self, tokens: Sequence[int], cache_salt: str | None, blocks: int | None = None
    ) -> list[int]:
        """The names of ``tokens``'s whole blocks (the first ``blocks``), keyed by the salt."""
        ...

    def make_drafter(self, config: SpeculationConfig) -> Drafter:
        """A drafter for ``config`` (per request, or the pipeline's shared one)."""
        ...


@attrs.define
class _Attempt:
    """The failures so far, and what recovering from them cost."""

    breaks: int = 0
    wait_ms: float = 0.0


class Request:
    """One generation: validated at construction, run once with `run`."""

    def __init__(
        self,
        pipeline: StageZero,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: _proto.SamplingParams,
        emit: Emit,
        *,
        stop: str | Sequence[str] = (),
        ignore_eog: bool = False,
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
        label: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if max_tokens < (0 if sampling.prompt_logprobs >= 0 else 1):
            raise ValueError(
                f"max_tokens must be at least 1 (0 only to score the prompt), got {max_tokens}"
            )
        context = pipeline.model.config.context_length
        if len(prompt_ids) >= context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}"
            )
        config = speculation or pipeline.speculation
        if drafter is None and config.enabled:
            drafter = pipeline.make_drafter(config)
        if drafter is not None and not config.enabled:
            config = attrs.evolve(config, drafter="ngram")  # an explicit drafter turns it on
        self.pipeline = pipeline
        self.engine = pipeline.engine
        self.prompt_ids = prompt_ids
        self.max_tokens = min(max_tokens, context - len(prompt_ids))
        self.sampling = sampling
        self.emit = emit
        self.label = label
        self.cache_salt = cache_salt  # shares cached prefixes only with the same salt
        self.speculation = config
        self.drafter = drafter
        self.eog = frozenset[int]() if ignore_eog else pipeline.model.config.eog_ids
        self.request_id = secrets.randbits(62)
        self.live = LiveRequest(self.request_id)  # what the web page's timeline shows of it
        self.generated: list[int] = []
        # with logprobs asked for: the last stage's rows by the position they predict, and
        # the committed tokens' (`note`, `commit`)
        self.logprob_rows = LogprobRows() if sampling.logprobs >= 0 else None
        # with prompt_logprobs: each prompt token's (the first has none)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.session: Session  # on stage 0, for the attempt running (`attempt`)
        # What the request measures of itself, by concern (see `Timings`).
        self.prefill_timings = PrefillTimings()
        self.recovery_timings = RecoveryTimings()
        self.speculation_timings: SpeculationTimings | None = None
        # What the pipeline counts of this request (`stagerun.Pipeline` adds them up).
        self.recoveries = 0
        self.recovery_failed = False
        self.last_prefill: PrefillReport | None = None
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self._decoder = pipeline.model.tokenizer.stream_decoder()
        self._assembler = TextAssembler(stop)

    @property
    def wire_dtype(self) -> _proto.ActivationDType:
        return self.pipeline.wire_dtype

    @property
    def vocab_size(self) -> int:
        return self.pipeline.model.config.vocab_size

    def __repr__(self) -> str:
        return (
            f"<Request id={self.request_id} prompt={len(self.prompt_ids)} "
            f"generated={len(self.generated)}/{self.max_tokens}>"
        )

    # -- the steps ----------------------------------------------------------------------------

    async def run(self) -> Completion:
        """Generate to the end, recovering from lane failures; return the `Completion`."""
        await self._draft_from_grammar()
        pool = self.pipeline.pool
        if pool is None:
            return await self.completion(await self.attempt(LocalRoute(self.engine)))
        attempt = _Attempt()
        while True:
            try:
                async with pool.checkout(self.request_id) as lane:
                    eog_stop = await self.attempt(LaneRoute(lane, self._prefill_settings()))
                break
            except (LaneError, StageError) as exc:
                await self.recover(exc, attempt)
        return await self.completion(eog_stop)

    async def _draft_from_grammar(self) -> None:
        """A request with a grammar drafts its forced tokens (`GrammarDrafter`).

        Speculation is turned on for it if it was off (windows then carry forced tokens
        only), unless ``SpeculationConfig.forced`` is False.
        """
        grammars = self.engine.grammars
        if not self.sampling.grammar or not self.speculation.forced or grammars is None:
            return
        matcher = await trio.to_thread.run_sync(grammars.matcher, self.sampling.grammar)
        self.drafter = GrammarDrafter(matcher, self.drafter)
        if not self.speculation.enabled:
            self.speculation = attrs.evolve(self.speculation, drafter="ngram")

    def _prefill_settings(self) -> PrefillSettings:
        pipeline = self.pipeline
        assert pipeline.pool is not None
        if self.sampling.prompt_logprobs >= 0:  # every row's logits: small chunks
            return PrefillSettings(
                policy=FixedChunks(SCORING_CHUNK),
                credit=pipeline.prefill_credit,
                wire_dtype=pipeline.wire_dtype,
                estimate=None,
            )
        return PrefillSettings(
            policy=pipeline.prefill_policy,
            credit=pipeline.prefill_credit,
            wire_dtype=pipeline.wire_dtype,
            estimate=pipeline.pool.prefill_transport,
        )

    async def attempt(self, route: Route) -> bool:
        """One attempt on a fresh session and route: decode, then remember; True on EOG.

        The session on stage 0 is closed whichever way the attempt ends.
        """
        context = replay_context(self.prompt_ids, self.generated)
        self.session = self.engine.open(self.request_id, self.sampling, len(self.prompt_ids))
        try:
            await self.engine.constrain(self.session)  # a one-stage pipeline samples here
            names: list[int] = []
            # positions restored from a prefix cache would not be scored: recompute them
            if self.engine.prefix_cache is not None and self.sampling.prompt_logprobs < 0:
                names = self.pipeline.prefix_names(
                    context, self.cache_salt, blocks=(len(context) - 1) // _proto.PREFIX_BLOCK
                )
                restored = await self.engine.restore(self.session, names)
                names = names[: restored // _proto.PREFIX_BLOCK]
            eog_stop = await self.decode(route, context, names)
            await self.remember(route)
            return eog_stop
        finally:
            self.engine.close(self.session)

    def note(self, reply: _proto.Predictions, first: int) -> None:
        """Keep ``reply``'s log-probabilities, whose first row predicts ``first``."""
        if self.logprob_rows is not None:
            self.logprob_rows.note(reply, first)

    async def commit(self, token: int) -> bool:
        """Emit one generated token; True when a stop string ended generation."""
        logprob = None
        if self.logprob_rows is not None:
            position = len(self.prompt_ids) + len(self.generated)
            logprob = self.logprob_rows.commit(token, position)
        self.generated.append(token)
        text = self._assembler.push(self._decoder.push(token))
        await self.emit(TokenChunk(token, text, logprob))
        return self._assembler.stopped

    def load(self) -> float:
        """How busy stage 0's compute has been in the last second (0..1)."""
        return self.engine.batcher.recent_busy()

    async def compute(self, message: _proto.ActivationMessage) -> np.ndarray[Any, Any]:
        """Stage 0's own layers for ``message``, on this request's session."""
        out, _stats = await self.engine.compute(self.session, message)
        return out

    async def decode(self, route: Route, context: list[int], names: list[int]) -> bool:
        """Prefill ``context`` from the restored blocks ``names``, then decode; True on EOG.

        A first attempt prefills the prompt; after a recovery the prompt and every token
        generated so far are replayed, and decoding continues from there.
        """
        replay_start = time.perf_counter()
        first = await self.first_token(route, context, names)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        else:  # a recovery: the replay took this long
            self.recovery_timings.replay_ms += (time.perf_counter() - replay_start) * 1000.0
        if self.max_tokens == 0 or first in self.eog:  # a prompt scored only, or ended at once
            await self.remember(route, context, len(context))
            return self.max_tokens > 0
        stopped = await self.commit(first)
        # the context's blocks, for later requests, once its first token is on its way (the
        # copy took 16 ms of a new prompt's time to first token under 16 streams)
        await self.remember(route, context, len(context))
        if stopped or len(self.generated) >= self.max_tokens:
            return False
        if self.drafter is not None:
            spec_timings, reason = await SpeculativeDecode(self, route, [*context, first]).run()
            self.speculation_timings = spec_timings  # after a recovery: the last stretch's
            return reason == "eog"
        return await self.decode_plain(route, first, len(context))

    async def first_token(self, route: Route, context: list[int], names: list[int]) -> int:
        """Prefill ``context`` and return the token that follows it.

        The prefill starts from the longest prefix that stage 0 and every stage hold in their
        prefix caches (stage 0 restored ``names``; the route asks the stages for the same).
        `decode` has every stage remember the context's blocks once the token is sent.
        """
        prefilled = await route.prefill(self, context, names)
        if prefilled.reply is not None:
            self.note(prefilled.reply, len(context))
            if self.sampling.prompt_logprobs >= 0:
                self.prompt_logprobs = scored_prompt(prefilled.reply, self.prompt_ids)
        timings = self.prefill_timings
        timings.prefix_cached_tokens = prefilled.start  # of the last prefill
        if prefilled.report is not None:
            self.last_prefill = prefilled.report
            timings.chunks = (timings.chunks or 0) + prefilled.report.chunks
        return prefilled.token

    async def remember(
        self, route: Route, tokens: Sequence[int] | None = None, length: int = 0
    ) -> None:
        """Keep the whole blocks of the first ``length`` positions on every stage.

        By default, at the end of the request: every committed token but the last, which was
        never fed (a later turn of a chat starts with them). Stage 0 keeps its own, and the
        route has the stages keep theirs.
        """
        if self.engine.prefix_cache is None:
            return
        if tokens is None:
            tokens = replay_context(self.prompt_ids, self.generated)
            length = len(tokens) - 1
        held = tokens[: min(length, self.session.cache.length)]
        names = self.pipeline.prefix_names(held, self.cache_salt)
        await self.engine.remember(self.session, names)
        if names:
            await route.remember(self.request_id, names)

    async def decode_plain(self, route: Route, token: int, position: int) -> bool:
        """One token per round trip from ``token`` at ``position``; True if EOG ended it."""
        tel = telemetry.current()
        while True:
            step_start = telemetry.now_ns() if tel.debug_enabled else 0
            token = await self.decode_step(route, token, position)
            if step_start:
                _spans.decode_token(self.request_id, len(self.generated), position, step_start)
            position += 1
            if token in self.eog:
                return True
            if await self.commit(token) or len(self.generated) >= self.max_tokens:
                return False

    async def decode_step(self, route: Route, token: int, position: int) -> int:
        """One plain decode step: feed ``token`` at ``position``, return the next token."""
        message = _proto.Decode(request_id=self.request_id, position=position, tokens=(token,))
        await route.send(message, await self.compute(message), self.wire_dtype)
        reply = await route.receive_predictions(self.request_id)
        self.note(reply, position + 1)
        return int(reply.tokens[-1])

    async def recover(self, failure: LaneError | StageError, attempt: _Attempt) -> None:
        """Count a lane failure and wait for a fresh lane, or fail the request.

        Raises:
            RecoveryFailedError: one failure too many, or no lane opened in time (with
                ``max_breaks=0`` the failure itself is raised).
        """
        policy = self.pipeline.recovery
        attempt.breaks += 1
        if attempt.breaks > policy.max_breaks:
            self.recovery_failed = True
            if policy.max_breaks == 0:
                raise failure
            raise RecoveryFailedError(
                f"the pipeline failed {attempt.breaks} times during this request "
                f"(the limit is {policy.max_breaks}); last failure: {failure}"
            ) from failure
        self._fail_if_given_up(failure)
        log.warning(
            "request %d: lane failed after %d tokens (%s); recovering",
            self.request_id,
            len(self.generated),
            failure,
        )
        started = time.perf_counter()
        await self._await_lane(policy, failure)
        attempt.wait_ms += (time.perf_counter() - started) * 1000.0
        self.recovery_timings.recoveries = attempt.breaks
        self.recovery_timings.wait_ms = attempt.wait_ms
        self.recoveries += 1
        self.live.recovered()
        self.request_id = secrets.randbits(62)  # a new chain session on every stage

    async def _await_lane(self, policy: RecoveryPolicy, failure: Exception) -> None:
        """Wait, with backoff, until a fresh lane through the whole pipeline opens.

        The lane is returned to the pool, so the retried request checks it out at once.
        """
        pool = self.pipeline.pool
        assert pool is not None
        delay = policy.backoff
        last: Exception = failure
        with trio.move_on_after(policy.timeout):
            while True:
                await trio.sleep(delay)
                try:
                    await pool.ensure_idle_lane()
                except LaneError as exc:
                    last = exc
                    self._fail_if_given_up(failure)
                    delay = min(delay * 2, policy.max_backoff)
                    continue
                return
        self.recovery_failed = True
        raise RecoveryFailedError(
            f"no working lane through the pipeline within {policy.timeout:g}s of a failure "
            f"({failure}); last error: {last}"
        ) from failure

    def _fail_if_given_up(self, failure: Exception) -> None:
        """No recovery can come once the supervisor gave a stage up: fail now, not after
        ``RecoveryPolicy.timeout``."""
        reason = given_up(self.pipeline.stages)
        if reason is not None:
            self.recovery_failed = True
            raise StageGivenUpError(f"cannot recover the request: {reason}") from failure

    # -- the end ------------------------------------------------------------------------------

    async def completion(self, eog_stop: bool) -> Completion:
        """Flush the held-back text and sum up: the `Completion`, and its summary spans."""
        assert self.t_first is not None
        tail = self._assembler.flush(self._decoder.flush())
        if tail:
            await self.emit(TokenChunk(-1, tail))
        t_end = time.perf_counter()
        stopped = eog_stop or self._assembler.stopped
        finish: Literal["stop", "length"] = "stop" if stopped else "length"
        timings = self.timings(t_end)
        self._summary_spans(t_end, timings, finish)
        return Completion(
            text=self._assembler.text,
            token_ids=self.generated,
            prompt_token_ids=list(self.prompt_ids),
            finish_reason=finish,
            timings=timings,
            logprobs=None if self.logprob_rows is None else self.logprob_rows.committed,
            prompt_logprobs=self.prompt_logprobs,
        )

    def timings(self, t_end: float) -> Timings:
        """The prompt's and the decode's times, with every section the request filled in."""
        assert self.t_first is not None
        return Timings(
            prompt_n=len(self.prompt_ids),
            prompt_ms=(self.t_first - self.t_start) * 1000.0,
            predicted_n=len(self.generated),
            predicted_ms=(t_end - self.t_first) * 1000.0,
            prefill=self.prefill_timings,
            recovery=self.recovery_timings,
            speculation=self.speculation_timings,
        )

    def _summary_spans(self, t_end: float, timings: Timings, finish: str) -> None:
        tel = telemetry.current()
        if not tel.enabled:
            return
        assert self.t_first is not None
        start_ns = telemetry.now_ns() - int((t_end - self.t_start) * 1e9)
        first_ns = start_ns + int((self.t_first - self.t_start) * 1e9)
        n = len(self.generated)
        windows = None
        if self.drafter is not None:
            speculation = timings.speculation
            windows = {} if speculation is None else telemetry_attributes(speculation.windows)
        _spans.decode_finished(
            self.request_id, first_ns, n, elapsed_ms=timings.predicted_ms, windows=windows
        )
        summary = {
            "prompt_token_count": len(self.prompt_ids),
            "completion_token_count": n,
            "prompt_ms": timings.prompt_ms,
            "decode_ms": timings.predicted_ms,
            "finish_reason": finish,
            "recoveries": timings.recovery.recoveries,
            "stages": len(self.pipeline.stages),
            "elapsed_ms": (t_end - self.t_start) * 1000.0,
        }
        _spans.generation_summary(self.request_id, start_ns, summary, self.label)
