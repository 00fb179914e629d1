"""`Pipeline`: runs requests on stage 0 over the lanes of a started pipeline.

Theory of operation: stage 0 lives in the calling process. It owns the tokenizer, the first
layer range and a `LanePool` to the rest of the pipeline (started or joined by
`stagerun._driver._launch.open_pipeline`). A request checks out a lane and sends ``Configure``, then,
without waiting for its ack, the prompt in planned prefill chunks (`stagerun._driver._prefill`;
the last chunk asks the last stage for a prediction). It then decodes one token per round
trip: stage 0 computes its layers for the newest token and sends the activations; the
prediction comes straight back from the last stage. On success the pool ends the request with
``Stop``; on any failure (or cancellation) the lane is replaced, and `RecoveryPolicy` decides
whether the request resumes on a new lane by replaying its committed tokens. With a drafter,
decoding goes through pipelined verify windows instead (`stagerun._driver._speculative`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import numpy as np
import trio

from .. import _proto, plugins, telemetry
from .._decide._prefill import (
    AdaptiveRamp,
    ChunkPolicy,
    FixedChunks,
    ScheduleChunks,
    parse_chunk_policy,
)
from .._decide._sampling import sample_token
from .._errors import LaneError, RecoveryFailedError, StageError
from .._text import TextAssembler
from .._util import single_exceptions
from .._wire._connect import alternatives, open_connection
from ..abc import ComputeBackend, Drafter
from ..model import ModelFile
from ._lanes import Lane, LanePool
from ._prefill import PrefillReport, send_prefill
from ._speculative import SpeculationConfig, decode_speculative
from ._values import (
    AddressHealth,
    Completion,
    DrafterContext,
    GenerationStream,
    RecoveryPolicy,
    StageHealth,
    StageInfo,
    TokenChunk,
)

DEFAULT_PREFILL_CHUNK = "adaptive"
DEFAULT_PREFILL_CREDIT = 3  # prefill chunks in flight past stage 0, unacknowledged

log = logging.getLogger("stagerun.pipeline")


def replay_context(prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
    """What a request prefills on a fresh lane: the prompt, then every token committed so far.

    A module-level function so that the recovery tests can swap in a wrong replay (one that
    drops a token, or the prompt) and see their equality check fail.
    """
    return [*prompt_ids, *generated]


class Pipeline:
    """A running pipeline; use `open_pipeline` to get one."""

    def __init__(
        self,
        model: ModelFile,
        backend0: ComputeBackend,
        stages: list[StageInfo],
        pool: LanePool | None,
        *,
        wire_dtype: _proto.ActivationDType,
        prefill_chunk: int | str | ChunkPolicy = "adaptive",
        prefill_credit: int = DEFAULT_PREFILL_CREDIT,
        speculation: SpeculationConfig | None = None,
        recovery: RecoveryPolicy | None = None,
    ) -> None:
        self.model = model
        self.recovery = recovery or RecoveryPolicy()
        self.recoveries = 0  # lane failures survived, over every request
        self.recovery_failures = 0
        self.speculation = speculation or SpeculationConfig()
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.stages = stages
        self.pool = pool
        self.wire_dtype = wire_dtype
        self.prefill_policy = (
            prefill_chunk
            if isinstance(prefill_chunk, (FixedChunks, ScheduleChunks, AdaptiveRamp))
            else parse_chunk_policy(str(prefill_chunk))
        )
        if prefill_credit < 1:
            raise ValueError(f"prefill_credit must be at least 1, got {prefill_credit}")
        self.prefill_credit = prefill_credit
        self.last_prefill: PrefillReport | None = None
        self._backend0 = backend0
        self._compute_lock = trio.Lock()
        self._shared_drafters: dict[tuple[str, str | None], Drafter] = {}

    def __repr__(self) -> str:
        layout = ",".join(f"{lo}-{hi}" for lo, hi in (s.layers for s in self.stages))
        return f"<Pipeline model={self.config.name!r} stages={len(self.stages)} layers={layout} pool={self.pool!r}>"

    async def check_health(self, timeout: float = 1.0) -> list[StageHealth]:
        """Probe every stage at once: a handshake must complete within ``timeout`` seconds."""
        results: list[StageHealth] = [StageHealth(self.stages[0], "ready")]
        probes: dict[str, AddressHealth] = {}

        async def probe(address: str) -> None:
            start = time.perf_counter()
            try:
                stream = await open_connection(
                    address,
                    role=_proto.Role.LANE,
                    connect_timeout=timeout,
                    ready_timeout=timeout,
                )
            except LaneError as exc:
                probes[address] = AddressHealth(address, "unreachable", error=str(exc))
                return
            await stream.aclose_forcefully()
            elapsed = (time.perf_counter() - start) * 1000.0
            probes[address] = AddressHealth(address, "ready", latency_ms=elapsed)

        each = {info.index: alternatives(info.address or "") for info in self.stages[1:]}
        async with trio.open_nursery() as nursery:
            for addresses in each.values():
                for address in addresses:
                    nursery.start_soon(probe, address)
        for info in self.stages[1:]:
            primary, *standbys = (probes[a] for a in each[info.index])
            serving = next((p.address for p in (primary, *standbys) if p.state == "ready"), None)
            health = StageHealth(
                info,
                primary.state,
                error=primary.error,
                latency_ms=primary.latency_ms,
                standbys=tuple(standbys),
                serving=serving,
            )
            results.append(health)
        return results

    def encode_prompt(
        self, prompt: str | Sequence[int] | Sequence[dict[str, str]], *, chat: bool = False
    ) -> list[int]:
        """Token ids for a prompt: text, ids, or (with ``chat``) text or a list of messages."""
        if isinstance(prompt, str):
            if chat:
                return self.model.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return self.model.apply_chat_template(items)  # type: ignore[arg-type]
        return [int(t) for t in items]  # type: ignore[call-overload]

    @asynccontextmanager
    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        *,
        max_tokens: int = 128,
        sampling: _proto.SamplingParams | None = None,
        chat: bool = False,
        stop: Sequence[str] = (),
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
        label: str | None = None,
    ) -> AsyncIterator[GenerationStream]:
        """Stream a generation: ``async with p.generate(...) as s: async for chunk in s``.

        Text that could be the start of a ``stop`` string is held back until it is decided;
        a stop string ends the request cleanly and is not part of the text. Leaving the block
        early cancels the request (its lane is replaced, not reused). ``label`` (the server
        passes the HTTP request id) goes into the request's telemetry summary as
        ``stagerun.request_label``.
        """
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        params = sampling or _proto.SamplingParams()
        send, receive = trio.open_memory_channel[TokenChunk](64)
        stream = GenerationStream(receive)

        async def run() -> None:
            async with send:
                try:
                    stream.result = await self._run(
                        prompt_ids,
                        max_tokens,
                        params,
                        send.send,
                        stop=stop,
                        speculation=speculation,
                        drafter=drafter,
                        label=label,
                    )
                except Exception as exc:  # handed to the consumer, not lost in a group
                    stream.error = exc

        with single_exceptions():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                try:
                    yield stream
                finally:
                    if stream.result is None and stream.error is None:
                        nursery.cancel_scope.cancel(reason="generation stream left early")
        if stream.error is not None and not stream.error_raised:
            stream.error_raised = True
            raise stream.error

    async def complete(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        *,
        max_tokens: int = 128,
        sampling: _proto.SamplingParams | None = None,
        chat: bool = False,
        on_token: Callable[[TokenChunk], Any] | None = None,
        stop: Sequence[str] = (),
        ignore_eog: bool = False,
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
    ) -> Completion:
        """Run one request to the end and return its `Completion`.

        ``speculation`` overrides the pipeline's speculative settings for this request;
        ``drafter`` supplies a drafter object (any object with ``begin``, ``commit`` and
        ``propose``), which turns speculation on.

        ``ignore_eog`` keeps generating past end-of-generation tokens (benchmarks use it to
        produce exactly ``max_tokens``).
        """
        prompt_ids = self.encode_prompt(prompt, chat=chat)

        async def emit(chunk: TokenChunk) -> None:
            if on_token is not None:
                on_token(chunk)

        return await self._run(
            prompt_ids,
            max_tokens,
            sampling or _proto.SamplingParams(),
            emit,
            stop=stop,
            ignore_eog=ignore_eog,
            speculation=speculation,
            drafter=drafter,
        )

    async def _compute0(
        self,
        cache: Any,
        position: int,
        tokens: Sequence[int],
        logits: Literal["last", "all"] = "last",
        *,
        request_id: int | None = None,
        window_id: int | None = None,
    ) -> np.ndarray[Any, Any]:
        ids = np.asarray(tokens, dtype=np.int64)
        backend = self._backend0
        async with self._compute_lock:
            started = telemetry.now_ns()
            out = await trio.to_thread.run_sync(
                lambda: backend.forward(cache, position, tokens=ids, logits=logits)
            )
        tel = telemetry.current()
        if tel.debug_enabled and request_id is not None:
            attributes: dict[str, Any] = {
                "llama_stage.stage_index": 0,
                "llama_stage.request_id": request_id,
                "llama_stage.pos_start": position,
                "llama_stage.token_count": len(ids),
                "llama_stage.elapsed_ms": (telemetry.now_ns() - started) / 1e6,
            }
            if window_id is not None:
                attributes["llama_stage.verify_window_id"] = window_id
            tel.debug_span("stage.binary_llama_decode", started, attributes)
        return out

    async def _run(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: _proto.SamplingParams,
        emit: Callable[[TokenChunk], Any],
        *,
        stop: Sequence[str] = (),
        ignore_eog: bool = False,
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
        label: str | None = None,
    ) -> Completion:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        context = self.config.context_length
        if len(prompt_ids) >= context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}"
            )
        max_tokens = min(max_tokens, context - len(prompt_ids))
        config = speculation or self.speculation
        if drafter is None and config.enabled:
            drafter = self._make_drafter(config)
        if drafter is not None and not config.enabled:
            config = attrs.evolve(config, drafter="ngram")  # an explicit drafter turns it on
        request_id = secrets.randbits(62)
        decoder = self.tokenizer.stream_decoder()
        assembler = TextAssembler(stop)
        eog = frozenset[int]() if ignore_eog else self.config.eog_ids
        generated: list[int] = []
        cache = self._backend0.new_cache()
        t_start = time.perf_counter()
        extra: dict[str, Any] = {}

        async def commit(token: int) -> bool:
            """Emit one generated token; True when a stop string ended generation."""
            generated.append(token)
            await emit(TokenChunk(token, assembler.push(decoder.push(token))))
            return assembler.stopped

        async def compute(
            position: int, tokens: Sequence[int], logits: str, window_id: int | None = None
        ) -> Any:
            return await self._compute0(
                cache,
                position,
                tokens,
                logits,  # type: ignore[arg-type]
                request_id=request_id,
                window_id=window_id,
            )

        t_first: float | None = None

        async def decode(lane: Lane | None) -> bool:
            """Prefill the committed tokens, then decode; True if EOG ended generation.

            A first call prefills the prompt; after a recovery the prompt and every token
            generated so far are replayed, and decoding continues from there.
            """
            nonlocal t_first
            context = replay_context(prompt_ids, generated)
            replay_start = time.perf_counter()
            first = await self._first_token(lane, request_id, cache, context, sampling, extra)
            if t_first is None:
                t_first = time.perf_counter()
            else:  # a recovery: the replay took this long
                extra["recovery_replay_ms"] += (time.perf_counter() - replay_start) * 1000.0
            if first in eog:
                return True
            if await commit(first) or len(generated) >= max_tokens:
                return False
            if drafter is not None:
                spec_timings, reason = await decode_speculative(
                    lane=lane,
                    request_id=request_id,
                    history=[*context, first],
                    prompt_len=len(prompt_ids),
                    max_tokens=max_tokens,
                    eog=eog,
                    sampling=sampling,
                    config=config,
                    drafter=drafter,
                    compute0=compute,
                    wire_dtype=self.wire_dtype,
                    on_commit=commit,
                )
                extra.update(spec_timings)  # after a recovery: the last stretch's figures
                return reason == "eog"
            token, position = first, len(context)
            tel = telemetry.current()
            while True:
                step_start = telemetry.now_ns() if tel.debug_enabled else 0
                token = await self._decode_step(lane, request_id, cache, token, position, sampling)
                if tel.debug_enabled:
                    step = len(generated)
                    tel.debug_span(
                        "stage.openai_decode_token",
                        step_start,
                        {
                            "llama_stage.request_id": request_id,
                            "llama_stage.decode_step": step,
                            "llama_stage.pos_start": position,
                            "llama_stage.token_phase": "cold"
                            if step == 1
                            else "warmup"
                            if step < 8
                            else "steady",
                        },
                    )
                position += 1
                if token in eog:
                    return True
                if await commit(token) or len(generated) >= max_tokens:
                    return False

        if self.pool is None:
            eog_stop = await decode(None)
        else:
            policy = self.recovery
            breaks = 0
            while True:
                try:
                    async with self.pool.checkout(request_id) as lane:
                        # Not waited for here: the stages handle frames in order, so the
                        # prefill follows at once and `_prefill` reads this ack with its own
                        # (a round trip of the whole chain less before the first token).
                        await lane.send(
                            _proto.Configure(
                                request_id=request_id,
                                return_key=lane.return_key,
                                prompt_len=len(prompt_ids),
                                sampling=sampling,
                            )
                        )
                        eog_stop = await decode(lane)
                    break
                except (LaneError, StageError) as exc:
                    breaks += 1
                    if breaks > policy.max_breaks:
                        self.recovery_failures += 1
                        if policy.max_breaks == 0:
                            raise
                        raise RecoveryFailedError(
                            f"the pipeline failed {breaks} times during this request "
                            f"(the limit is {policy.max_breaks}); last failure: {exc}"
                        ) from exc
                    log.warning(
                        "request %d: lane failed after %d tokens (%s); recovering",
                        request_id,
                        len(generated),
                        exc,
                    )
                    started = time.perf_counter()
                    await self._await_lane(policy, exc)
                    extra["recoveries"] = breaks
                    extra["recovery_wait_ms"] = extra.get("recovery_wait_ms", 0.0) + (
                        (time.perf_counter() - started) * 1000.0
                    )
                    extra.setdefault("recovery_replay_ms", 0.0)
                    self.recoveries += 1
                    request_id = secrets.randbits(62)  # a new chain session on every stage
        assert t_first is not None
        tail = assembler.flush(decoder.flush())
        if tail:
            await emit(TokenChunk(-1, tail))
        t_end = time.perf_counter()
        n = len(generated)
        decode_ms = (t_end - t_first) * 1000.0
        timings: dict[str, Any] = {
            "prompt_n": len(prompt_ids),
            "prompt_ms": (t_first - t_start) * 1000.0,
            "prompt_per_second": len(prompt_ids) * 1000.0 / max((t_first - t_start) * 1000.0, 1e-9),
            "predicted_n": n,
            "predicted_ms": decode_ms,
            "predicted_per_second": (n - 1) * 1000.0 / decode_ms
            if n > 1 and decode_ms > 0
            else 0.0,
        }
        timings.update(extra)
        finish: Literal["stop", "length"] = "stop" if eog_stop or assembler.stopped else "length"
        tel = telemetry.current()
        if tel.enabled:
            start_ns = telemetry.now_ns() - int((t_end - t_start) * 1e9)
            first_ns = start_ns + int((t_first - t_start) * 1e9)
            tel.span(
                "stage.openai_decode",
                first_ns,
                {
                    "llama_stage.request_id": request_id,
                    "llama_stage.token_count": n,
                    "llama_stage.speculative": drafter is not None,
                    "llama_stage.elapsed_ms": decode_ms,
                },
            )
            tel.span(
                "stage.openai_generation_summary",
                start_ns,
                {
                    "llama_stage.request_id": request_id,
                    "llama_stage.prompt_token_count": len(prompt_ids),
                    "llama_stage.completion_token_count": n,
                    "llama_stage.prompt_ms": timings["prompt_ms"],
                    "llama_stage.decode_ms": decode_ms,
                    "llama_stage.finish_reason": finish,
                    "llama_stage.recoveries": int(extra.get("recoveries", 0)),
                    "llama_stage.stages": len(self.stages),
                    "llama_stage.elapsed_ms": (t_end - t_start) * 1000.0,
                    **({"stagerun.request_label": label} if label is not None else {}),
                },
            )
        return Completion(
            text=assembler.text,
            token_ids=generated,
            prompt_token_ids=list(prompt_ids),
            finish_reason=finish,
            timings=timings,
        )

    async def _await_lane(self, policy: RecoveryPolicy, failure: Exception) -> None:
        """Wait, with backoff, until a fresh lane through the whole pipeline opens.

        The lane is returned to the pool, so the retried request checks it out at once.

        Raises:
            RecoveryFailedError: no lane opened within ``policy.timeout``.
        """
        assert self.pool is not None
        delay = policy.backoff
        last: Exception = failure
        with trio.move_on_after(policy.timeout):
            while True:
                await trio.sleep(delay)
                try:
                    await self.pool.ensure_idle_lane()
                except LaneError as exc:
                    last = exc
                    delay = min(delay * 2, policy.max_backoff)
                    continue
                return
        self.recovery_failures += 1
        raise RecoveryFailedError(
            f"no working lane through the pipeline within {policy.timeout:g}s of a failure "
            f"({failure}); last error: {last}"
        ) from failure

    def _make_drafter(self, config: SpeculationConfig) -> Drafter:
        cls = plugins.drafter(config.drafter)
        options = DrafterContext(self.model, config.draft_model)
        create = getattr(cls, "create", None)
        if getattr(cls, "per_request", True):
            made: Drafter = create(options) if create is not None else cls()
            return made
        key = (config.drafter, config.draft_model)
        drafter = self._shared_drafters.get(key)
        if drafter is None:  # shared by the pipeline's requests (a model takes seconds to load)
            drafter = create(options) if create is not None else cls()
            self._shared_drafters[key] = drafter
        return drafter

    async def _first_token(
        self,
        lane: Lane | None,
        request_id: int,
        cache: Any,
        prompt_ids: list[int],
        sampling: _proto.SamplingParams,
        timings: dict[str, Any] | None = None,
    ) -> int:
        if lane is None:
            logits = await self._compute0(cache, 0, prompt_ids, request_id=request_id)
            return sample_token(logits[-1], sampling, len(prompt_ids))

        async def compute(position: int, tokens: Sequence[int]) -> np.ndarray[Any, Any]:
            return await self._compute0(
                cache, position, tokens, logits="all", request_id=request_id
            )

        report = await send_prefill(
            lane,
            request_id,
            prompt_ids,
            compute0=compute,
            policy=self.prefill_policy,
            credit=self.prefill_credit,
            wire_dtype=self.wire_dtype,
            estimate=self.pool.prefill_transport if self.pool is not None else None,
            configure_owed=True,  # `_run` sent Configure just before, without waiting
        )
        self.last_prefill = report
        if timings is not None:
            timings["prefill_chunks"] = timings.get("prefill_chunks", 0) + report.chunks
        reply = await lane.receive_predictions(request_id)
        return int(reply.tokens[-1])

    async def _decode_step(
        self,
        lane: Lane | None,
        request_id: int,
        cache: Any,
        token: int,
        position: int,
        sampling: _proto.SamplingParams,
    ) -> int:
        """One plain decode step: feed ``token`` at ``position``, return the next token."""
        if lane is None:
            logits = await self._compute0(cache, position, [token], request_id=request_id)
            return sample_token(logits[-1], sampling, position + 1)
        hidden = await self._compute0(cache, position, [token], request_id=request_id)
        await lane.send(
            _proto.Decode(request_id=request_id, position=position, tokens=(token,)),
            hidden,
            self.wire_dtype,
        )
        reply = await lane.receive_predictions(request_id)
        return int(reply.tokens[-1])
