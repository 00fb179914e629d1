"""`Pipeline`: runs requests on stage 0 over the lanes of a started pipeline.

Theory of operation: stage 0 lives in the calling process. It owns the tokenizer, the first
layer range and a `LanePool` to the rest of the pipeline (started or joined by
`stagerun._launch.open_pipeline`). A request checks out a lane and sends ``Configure``, then
the prompt in planned prefill chunks (`stagerun._driver._prefill`; the last chunk asks the last
stage for a prediction). When stage 0's prefix cache holds the prompt's first blocks, the
``Configure`` asks every stage for them and the prefill starts where all of them can
(docs/prefix-cache.md); otherwise its ack is not waited for. It then decodes one token per round
trip: stage 0 computes its layers for the newest token and sends the activations; the
prediction comes straight back from the last stage. On success the pool ends the request with
``Stop``; on any failure (or cancellation) the lane is replaced, and `RecoveryPolicy` decides
whether the request resumes on a new lane by replaying its committed tokens. With a drafter,
decoding goes through pipelined verify windows instead (`stagerun._driver._speculative`).
Each request is a `stagerun._driver._request.Request`; `Pipeline` holds what requests share
(the model, stage 0's engine, the pool, the settings, the counters). Stage 0's engine
(`stagerun._engine.StageEngine`) is the one every stage holds: its tick batcher batches the
requests' stage-0 forwards, its prefix cache and session budget bound what they keep.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from .. import _proto, plugins
from .._decide._prefill import (
    AdaptiveRamp,
    ChunkPolicy,
    FixedChunks,
    ScheduleChunks,
    parse_chunk_policy,
)
from .._engine import (
    DEFAULT_MAX_KV_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_CACHE_MB,
    INLINE_SECONDS,
    Grammars,
    PrefixCache,
    StageEngine,
    TickBatcher,
)
from .._engine._batcher import STALL_SECONDS
from .._errors import LaneError, PipelineClosedError
from .._util import single_exceptions
from .._wire._connect import ENV_SECRET, alternatives, open_connection
from ..abc import ComputeBackend, Drafter
from ..backends import NumpyBackend
from ..model import ModelFile
from ._clocks import StageClocks
from ._config import DEFAULT_PREFILL_CREDIT, RecoveryPolicy, SpeculationConfig
from ._lanes import LanePool
from ._live import RequestLog
from ._prefill import PrefillReport
from ._request import Request
from ._values import (
    AddressHealth,
    Completion,
    DrafterContext,
    GenerationStream,
    StageHealth,
    StageInfo,
    StageWork,
    TokenChunk,
)

log = logging.getLogger("stagerun.pipeline")


def gather_groups(backend: object) -> int:
    """How many groups stage 0's ticks gather the decoding requests into (`TickBatcher`).

    Each group travels down the pipeline together. On numpy, one: every stage computes every
    request's step in one tick, which streams the stage's float32 weights (and the output
    head's) once per step for all of them; measured on 2 cores, 3 stages, 8 clients: 86
    tokens/s against 73 for two groups and 67 without gathering. On ggml a tick costs a
    fifth of that, the hops and the Python around them weigh more, and with one group the
    stages mostly wait for each other (busy 0.36 / 0.34 / 0.51 at 8 clients): two groups in
    flight measured 78.1 / 99.9 tokens/s at 8 / 16 clients against 59.7 / 69.6 for one (three
    groups: 76.0 / 86.5), one run each on 2 cores, 3 stages.
    """
    return 1 if isinstance(backend, NumpyBackend) else 2


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
        max_batch: int | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MB << 20,
        chat_template: str | None = None,
        inline_seconds: float = INLINE_SECONDS,
    ) -> None:
        self.model = model
        self.chat_template = chat_template  # in place of the model's (PipelineConfig's)
        self.recovery = recovery or RecoveryPolicy()
        self.recoveries = 0  # lane failures survived, over every request
        self.live = RequestLog()  # the latest requests, as the web page's timeline shows them
        self._clocks = StageClocks()  # the stages' clocks against this process's
        self.recovery_failures = 0
        self.speculation = speculation or SpeculationConfig()
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.stages = stages
        self.pool = pool
        self.closed = False  # set when its `open_pipeline` block ends
        self.opened_as: str | None = None  # the name or path `open_pipeline` was given
        self._trio_token = trio.lowlevel.current_trio_token()
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
        # Stage 0's compute, bounded like every stage's. Without a prefix cache here no
        # request asks the stages for theirs.
        self.engine = StageEngine(
            backend0,
            index=0,
            max_batch=max_batch,
            gather=gather_groups(backend0),
            max_sessions=max_sessions,
            max_kv_tokens=max_kv_tokens,
            prefix_cache_bytes=prefix_cache_bytes,
            inline_seconds=inline_seconds,
            grammars=Grammars(model.tokenizer, model.config.vocab_size),
        )
        self.prefix_salt = secrets.token_bytes(16)  # keys the block names (`_proto._prefix`)
        self._shared_drafters: dict[tuple[str, str | None], Drafter] = {}

    def __repr__(self) -> str:
        layout = ",".join(f"{lo}-{hi}" for lo, hi in (s.layers for s in self.stages))
        return (
            f"<Pipeline model={self.config.name!r} stages={len(self.stages)} layers={layout} "
            f"pool={self.pool!r}>"
        )

    @property
    def batcher(self) -> TickBatcher:
        """Stage 0's tick batcher (its engine's)."""
        return self.engine.batcher

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Stage 0's prefix cache (its engine's), or None when it is off."""
        return self.engine.prefix_cache

    @property
    def names(self) -> list[str]:
        """What requests may call the model: its own name, and what it was opened as (a
        built-in name like ``smollm2``, or a path and its file name)."""
        names = [self.config.name]
        if self.opened_as:
            names += [self.opened_as, os.path.basename(self.opened_as)]
        return names

    def check_usable(self) -> None:
        """Raise `PipelineClosedError` unless requests may run on this pipeline now.

        A pipeline serves the Trio run that opened it, until its `open_pipeline` block ends.
        """
        if self.closed:
            raise PipelineClosedError(
                "this pipeline is closed: its `async with open_pipeline(...)` block has "
                "ended, and its stages with it; open a new one"
            )
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            token = None
        if token is not self._trio_token:
            raise PipelineClosedError(
                "this pipeline belongs to another trio.run: use it from the Trio run that "
                "opened it (its lanes and stages live there), or open one in this run"
            )

    async def check_health(self, timeout: float = 1.0, *, work_of: int = 0) -> list[StageHealth]:
        """Probe every stage at once: a handshake must complete within ``timeout`` seconds.

        A stage that answers is also asked for its `_proto.Status` (its prefix cache, its
        ticks, and the latest computes of request ``work_of``, if not 0: see `StageWork`).
        A closed pipeline reports every stage ``closed``, probing nothing.
        """
        if self.closed:
            return [
                StageHealth(info, "closed", error="the pipeline is closed") for info in self.stages
            ]
        self.check_usable()
        status = self.engine.status(work_of)  # stage 0's own, as a probe would get it
        own = status.prefix if self.prefix_cache is not None else None
        work = StageWork.from_status(status)
        results = [StageHealth(self.stages[0], "ready", prefix_cache=own, work=work)]
        stall = self.engine.batcher.stall(STALL_SECONDS)
        if stall is not None:  # as a stage server then refuses its handshakes
            error = f"stage 0's {stall}"
            results = [
                StageHealth(self.stages[0], "stalled", error=error, prefix_cache=own, work=work)
            ]
        probes: dict[str, AddressHealth] = {}
        secret = self.pool.secret if self.pool is not None else ENV_SECRET  # the lanes' own

        async def probe(address: str) -> None:
            start = time.perf_counter()
            try:
                stream = await open_connection(
                    address,
                    role=_proto.Role.LANE,
                    connect_timeout=timeout,
                    ready_timeout=timeout,
                    secret=secret,
                )
            except LaneError as exc:
                probes[address] = AddressHealth(address, "unreachable", error=str(exc))
                return
            elapsed = (time.perf_counter() - start) * 1000.0
            status: _proto.PrefixStats | None = None
            work: StageWork | None = None
            try:
                asked = time.perf_counter_ns()
                await stream.send(_proto.Probe(request_id=work_of), timeout=timeout)
                reply = (await stream.receive(timeout=timeout)).message
                if isinstance(reply, _proto.Status):
                    status = reply.prefix
                    answered = time.perf_counter_ns()
                    offset = self._clocks.offset(
                        address, asked, reply.clock_ns, answered, reply.clock_id
                    )
                    work = StageWork.from_status(reply, offset)
            except LaneError:
                pass  # it answered the handshake: ready, with nothing to report
            finally:
                await stream.aclose_forcefully()
            probes[address] = AddressHealth(
                address, "ready", latency_ms=elapsed, prefix_cache=status, work=work
            )

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
                prefix_cache=primary.prefix_cache,
                work=primary.work,
            )
            results.append(health)
        return results

    def encode_prompt(
        self, prompt: str | Sequence[int] | Sequence[dict[str, str]], *, chat: bool = False
    ) -> list[int]:
        """Token ids for a prompt: text, ids, or (with ``chat``) text or a list of messages."""
        if isinstance(prompt, str):
            if chat:
                return self.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return self.apply_chat_template(items)  # type: ignore[arg-type]
        return [int(t) for t in items]  # type: ignore[call-overload]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Messages as the chat template renders them, with the generation prompt unless
        ``add_generation_prompt`` is false.

        The template is the one the pipeline was opened with
        (`PipelineConfig.chat_template`), else the model's. ``extra`` are further template
        variables (``tools``).

        Raises:
            ChatTemplateError: the model has no template and none was given, or the template
                refused the messages.
        """
        return self.model.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            template=self.chat_template,
            **extra,
        )

    @property
    def effective_chat_template(self) -> str | None:
        """The template `render_chat` renders with (None: the model has none)."""
        return self.model.template_for_chat(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of `render_chat` (control tokens as their ids, no BOS added)."""
        return self.tokenizer.encode(self.render_chat(messages), special=True, add_bos=False)

    @asynccontextmanager
    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        *,
        max_tokens: int = 128,
        sampling: _proto.SamplingParams | None = None,
        chat: bool = False,
        stop: str | Sequence[str] = (),
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
        label: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationStream]:
        """Stream a generation: ``async with p.generate(...) as s: async for chunk in s``.

        ``stop`` is a string or a list of them (as OpenAI's). Text that could be the start
        of a stop string is held back until it is decided; a stop string ends the request
        cleanly and is not part of the text. Leaving the block
        early cancels the request (its lane is replaced, not reused). ``label`` (the server
        passes the HTTP request id) goes into the request's telemetry summary as
        ``stagerun.request_label``. Requests share cached prefixes only with requests of the
        same ``cache_salt`` (None is a salt of its own: the pipeline's).
        """
        self.check_usable()
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
                        cache_salt=cache_salt,
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
        stop: str | Sequence[str] = (),
        ignore_eog: bool = False,
        speculation: SpeculationConfig | None = None,
        drafter: Drafter | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Run one request to the end and return its `Completion`.

        ``speculation`` overrides the pipeline's speculative settings for this request;
        ``drafter`` supplies a drafter object (any object with ``begin``, ``commit`` and
        ``propose``), which turns speculation on.

        ``ignore_eog`` keeps generating past end-of-generation tokens (benchmarks use it to
        produce exactly ``max_tokens``). ``cache_salt``: as `generate`'s.
        """
        self.check_usable()
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
            cache_salt=cache_salt,
        )

    async def _run(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: _proto.SamplingParams,
        emit: Callable[[TokenChunk], Any],
        **options: Any,
    ) -> Completion:
        request = Request(self, prompt_ids, max_tokens, sampling, emit, **options)
        self.live.begin(request.live)
        try:
            return await request.run()
        finally:  # what the request counted, whichever way it ended
            self.live.end(request.live)
            self.recoveries += request.recoveries
            self.recovery_failures += request.recovery_failed
            if request.last_prefill is not None:
                self.last_prefill = request.last_prefill

    def _prefix_key(self, cache_salt: str | None) -> bytes:
        """The key of a request's block names: the pipeline's salt, mixed with the request's."""
        if cache_salt is None:
            return self.prefix_salt
        return hashlib.blake2b(cache_salt.encode(), digest_size=16, key=self.prefix_salt).digest()

    def prefix_names(
        self, tokens: Sequence[int], cache_salt: str | None = None, blocks: int | None = None
    ) -> list[int]:
        """The names of the whole blocks of ``tokens`` (the first ``blocks`` of them).

        Names are keyed by the pipeline's salt mixed with ``cache_salt``: requests share
        cached prefixes only with requests of the same salt.
        """
        return _proto.prefix_chain(tokens, self._prefix_key(cache_salt), blocks=blocks)

    def make_drafter(self, config: SpeculationConfig) -> Drafter:
        """A drafter for ``config``: a new one per request, or the pipeline's shared one."""
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
