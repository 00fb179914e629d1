"""The Trio shell of speculative decoding: carries out the controller's decisions.

Theory of operation: `SpeculationController` (sans-IO, in `stagerun._proto`) decides which
verify windows to open and what each reply commits; this module only does the I/O. It keeps
up to ``depth`` windows in flight on the request's lane, each drafted on the assumption that
the earlier ones are accepted. When a draft diverges the controller commits the target's
correction and returns a `NewEpoch`: the shell sends one ``Cancel`` for the stale windows and
opens the next epoch's windows at once, without waiting for stale replies. Stages drop stale
windows still queued and stop a stale compute at the next layer; the last stage answers the
``Cancel`` with ``Cancelled`` for every window it will never answer, and stale replies that
were already on their way are consumed and counted, never committed. Stage 0's own KV cache
and every stage's are trimmed by the authoritative position each ``Verify`` carries.

Committed tokens are always the target's own predictions, sampled on the last stage from a
random stream keyed by (seed, position), so the output equals plain decoding.

With one stage there is no lane: windows are verified locally, one at a time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from .. import _decide, _proto, plugins, telemetry
from .._decide import (
    Commit,
    Finish,
    NewEpoch,
    SendWindow,
    SpeculationController,
    response_timings,
    speculation_timings,
)
from .._decide._pace import (
    ADAPTIVE_INITIAL_WIDTH,
    ADAPTIVE_MIN_ACCEPT_RATE,
    ADAPTIVE_MIN_WINDOWS,
    DepthControl,
    PaceCheck,
)
from .._decide._sampling import sample_rows
from .._errors import LaneError, StageError
from .._util import one_failure, single_exceptions
from ..abc import Drafter
from ._lanes import Lane


@attrs.frozen
class SpeculationConfig:
    """How a pipeline speculates.

    Attributes:
        drafter: ``off``, or a drafter plugin: ``ngram`` (prompt lookup), ``draft-model``, or
            an installed plugin's name.
        depth: verify windows kept in flight per request (1 = serial).
        window: draft tokens per window at most.
        adaptive: let the window width follow acceptance, and stop drafting for a request
            whose acceptance is too low to pay for the windows.
        draft_model: the GGUF (name or path) for ``draft-model``.
    """

    drafter: str = "off"
    depth: int = 4
    window: int = 4
    adaptive: bool = True
    draft_model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.drafter != "off" and self.drafter not in plugins.names("drafters"):
            choices = ", ".join(["off", *plugins.names("drafters")])
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {choices}")
        if not 1 <= self.depth <= _decide.MAX_VERIFY_WINDOW_DEPTH:
            raise ValueError(
                f"depth must be within 1..{_decide.MAX_VERIFY_WINDOW_DEPTH}, got {self.depth}"
            )
        if not 1 <= self.window <= 32:
            raise ValueError(f"window must be within 1..32 draft tokens, got {self.window}")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("the draft-model drafter needs a draft model (--draft-model)")

    @property
    def enabled(self) -> bool:
        return self.drafter != "off"


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
        tel.span(
            "stage.openai_decode_verify_window",
            start,
            {
                "llama_stage.request_id": request_id,
                "llama_stage.verify_window_id": window_id,
                "llama_stage.verify_window_token_count": inputs,
                "llama_stage.verify_window_accepted": 0 if cancelled else accepted,
                "llama_stage.verify_window_cancelled": cancelled,
                "llama_stage.verify_window_stale": cancelled or stale,
                "llama_stage.elapsed_ms": (telemetry.now_ns() - start) / 1e6,
            },
        )


async def decode_speculative(
    *,
    lane: Lane | None,
    request_id: int,
    history: list[int],
    prompt_len: int,
    max_tokens: int,
    eog: frozenset[int],
    sampling: _proto.SamplingParams,
    config: SpeculationConfig,
    drafter: Drafter,
    compute0: Callable[..., Awaitable[Any]],
    wire_dtype: _proto.ActivationDType,
    on_commit: Callable[[int], Awaitable[bool]],
) -> tuple[dict[str, Any], str | None]:
    """Decode after prefill; ``history`` is the prompt plus the first generated token.

    ``on_commit(token)`` emits one committed token and returns True when generation must end
    (a stop string); the first generated token (the last of ``history``) was already
    emitted. Returns the speculative timing keys for the response and why generation ended
    (``eog``, ``length`` or ``stop``).
    """
    started = time.perf_counter()

    def now_ms() -> float:
        return (time.perf_counter() - started) * 1000.0

    controller = SpeculationController(
        history,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        eog=eog,
        depth=config.depth,
        width=config.window,
        adaptive=config.adaptive,
        initial_width=min(ADAPTIVE_INITIAL_WIDTH, config.window) if config.adaptive else None,
        now_ms=0.0,
    )
    depth = DepthControl(config.depth, adaptive=config.adaptive)
    if lane is not None:
        controller.scheduler.mark_direct_prediction_return(upstream_opened=True)
    drafter.begin(history[:prompt_len])
    drafter.commit(history[prompt_len:])
    local_replies: deque[_proto.Predictions] = deque()
    drafting = True
    pace = PaceCheck()
    generated_at_start = controller.generated_count

    tel = telemetry.current()
    opened_ns: dict[int, tuple[int, int]] = {}  # window id -> (opened at, input tokens)

    async def send(window: _decide.VerifyWindow) -> None:
        pace.opened(window.id, now_ms())
        if tel.enabled:
            opened_ns[window.id] = (telemetry.now_ns(), len(window.inputs))
        inputs = list(window.inputs)
        if lane is None:
            logits = await compute0(window.base_position, inputs, "all", window.id)
            tokens = sample_rows(logits, sampling, window.base_position + 1)
            local_replies.append(
                _proto.Predictions(
                    request_id=request_id,
                    window_id=window.id,
                    position=window.base_position,
                    tokens=tokens,
                )
            )
            return
        hidden = await compute0(window.base_position, inputs, "last", window.id)
        await lane.send(
            _proto.Verify(
                request_id=request_id,
                window_id=window.id,
                epoch=window.epoch,
                position=window.base_position,
                tokens=tuple(inputs),
            ),
            hidden,
            wire_dtype,
        )

    async def cancel(epoch: int, window_ids: tuple[int, ...]) -> None:
        if window_ids and lane is not None:
            await lane.send(
                _proto.Cancel(request_id=request_id, epoch=epoch, window_ids=window_ids)
            )

    async def apply(commands: list[_decide.Command]) -> None:
        queue = deque(commands)
        while queue:
            command = queue.popleft()
            match command:
                case SendWindow(window=window):
                    await send(window)
                case Commit(tokens=tokens):
                    drafter.commit(tokens)
                    for token in tokens:
                        if token in eog:
                            break  # the controller finishes right after this commit
                        if await on_commit(token):
                            queue.extend(controller.finish("stop"))
                            break
                case NewEpoch(stale_epoch=epoch, cancel_window_ids=ids):
                    await cancel(epoch, ids)
                case Finish(epoch=epoch, cancel_window_ids=ids):
                    await cancel(epoch, ids)

    def live_in_flight() -> int:
        return sum(not window.stale for window in controller.scheduler.in_flight)

    async def fill() -> None:
        while (
            live_in_flight() < depth.allowed
            and (request := controller.next_draft_request()) is not None
        ):
            proposal: Sequence[int] = ()
            if drafting and request.max_drafts > 0:
                if getattr(drafter, "blocking", True):
                    proposal = await trio.to_thread.run_sync(
                        drafter.propose, request.context, request.max_drafts
                    )
                else:  # a lookup of microseconds: a thread hop would cost more
                    proposal = drafter.propose(request.context, request.max_drafts)
            opened = controller.open_window(proposal, now_ms=now_ms())
            if opened is None:
                return  # no drafts for a continuation: wait for the next reply
            await apply([opened])

    async def read_replies(
        lane: Lane, channel: trio.MemorySendChannel[_proto.Predictions | _proto.Cancelled]
    ) -> None:
        # Replies are read the moment they arrive, also while stage 0 drafts and computes the
        # next window: a reply read late would be committed late (and an emulated link, which
        # starts a frame's delay when it is read, would charge the wait twice).
        while True:
            channel.send_nowait(await lane.receive_reply(request_id))

    # The reader and the sender often see one broken lane at once: that is one lane failure.
    with single_exceptions(), one_failure((LaneError, StageError)):
        async with trio.open_nursery() as nursery:
            replies: trio.MemoryReceiveChannel[_proto.Predictions | _proto.Cancelled] | None = None
            if lane is not None:
                send_channel, replies = trio.open_memory_channel[
                    _proto.Predictions | _proto.Cancelled
                ](math.inf)
                nursery.start_soon(read_replies, lane, send_channel)
            await fill()
            while not controller.drained:
                if replies is None:
                    reply: _proto.Predictions | _proto.Cancelled = local_replies.popleft()
                else:
                    reply = await replies.receive()
                before = controller.stats()
                was_stale = (
                    tel.enabled
                    and isinstance(reply, _proto.Predictions)
                    and any(
                        w.stale and w.id == reply.window_id for w in controller.scheduler.in_flight
                    )
                )
                if isinstance(reply, _proto.Cancelled):
                    pace.forget(reply.window_ids)
                    controller.on_cancelled(reply.window_ids, now_ms=now_ms())
                else:
                    pace.replied(reply.window_id, now_ms())
                    await apply(
                        controller.on_predictions(reply.window_id, reply.tokens, now_ms=now_ms())
                    )
                stats = controller.stats()
                if tel.enabled:
                    _window_spans(
                        tel,
                        request_id,
                        reply,
                        opened_ns,
                        stats.accepted - before.accepted,
                        was_stale,
                    )
                depth.observe(before, stats)
                if (
                    drafting
                    and config.adaptive
                    and sum(stats.proposed_by_position[:1]) >= ADAPTIVE_MIN_WINDOWS
                    and (
                        stats.accept_rate < ADAPTIVE_MIN_ACCEPT_RATE
                        or pace.slower_than_plain(
                            controller.generated_count - generated_at_start, now_ms()
                        )
                    )
                ):
                    drafting = False  # measured not to pay: plain decoding through windows
                await fill()
            nursery.cancel_scope.cancel()  # the reader waits for a reply that will not come
    timings: dict[str, Any] = {}
    timings.update(speculation_timings(controller.stats()))
    timings.update(response_timings(controller.scheduler.stats(now_ms())))
    timings["draft_n"] = controller.stats().proposed
    timings["draft_n_accepted"] = controller.stats().accepted
    timings["speculative_drafting_switched_off"] = not drafting
    if not math.isinf(pace.shortest_round_trip_ms):
        timings["speculative_shortest_window_ms"] = round(pace.shortest_round_trip_ms, 3)
    return timings, controller.finish_reason
