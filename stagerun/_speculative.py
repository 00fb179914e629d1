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

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

from . import _proto
from ._lanes import Lane
from ._proto import (
    Commit,
    Finish,
    NewEpoch,
    SendWindow,
    SpeculationController,
    response_timings,
    speculation_timings,
)
from ._sampling import sample_rows

DRAFTERS = ("off", "ngram", "draft-model")


class Drafter(Protocol):
    def begin(self, prompt: Sequence[int]) -> None: ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Sequence[int]: ...


@attrs.frozen
class SpeculationConfig:
    """How a pipeline speculates.

    Attributes:
        drafter: ``off``, ``ngram`` (prompt lookup) or ``draft-model``.
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
        if self.drafter not in DRAFTERS:
            raise ValueError(
                f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}"
            )
        if not 1 <= self.depth <= _proto.MAX_VERIFY_WINDOW_DEPTH:
            raise ValueError(
                f"depth must be within 1..{_proto.MAX_VERIFY_WINDOW_DEPTH}, got {self.depth}"
            )
        if not 1 <= self.window <= 32:
            raise ValueError(f"window must be within 1..32 draft tokens, got {self.window}")
        if self.drafter == "draft-model" and not self.draft_model:
            raise ValueError("the draft-model drafter needs a draft model (--draft-model)")

    @property
    def enabled(self) -> bool:
        return self.drafter != "off"


# Drafting stops for a request whose acceptance stays below this after this many windows:
# each window then costs a (wider) forward and returns about one token, like plain decoding.
ADAPTIVE_MIN_WINDOWS = 4
ADAPTIVE_MIN_ACCEPT_RATE = 0.15
# Adaptive requests start narrow and shallow and earn width and depth with accepted drafts:
# a window that is wrong from its first draft costs little, and no continuation windows are
# drafted behind a branch that keeps diverging (they would only go stale).
ADAPTIVE_INITIAL_WIDTH = 2


class DepthControl:
    """How many live windows an adaptive request may keep in flight (pure bookkeeping).

    Starts at 1; a fully accepted window allows one more (up to the configured depth), a
    window rejected at its first draft goes back to 1, a later rejection takes one away.
    """

    def __init__(self, depth: int, *, adaptive: bool) -> None:
        self.max_depth = depth
        self.allowed = 1 if adaptive else depth
        self.adaptive = adaptive

    def observe(self, before: _proto.SpeculationStats, after: _proto.SpeculationStats) -> None:
        if not self.adaptive:
            return
        if after.full_accept_windows > before.full_accept_windows:
            self.allowed = min(self.allowed + 1, self.max_depth)
        elif (after.early_reject_windows + after.early_reject_stop_windows) > (
            before.early_reject_windows + before.early_reject_stop_windows
        ):
            self.allowed = 1
        elif after.tail_reject_windows > before.tail_reject_windows:
            self.allowed = max(self.allowed - 1, 1)


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

    async def send(window: _proto.VerifyWindow) -> None:
        inputs = list(window.inputs)
        if lane is None:
            logits = await compute0(window.base_position, inputs, "all")
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
        hidden = await compute0(window.base_position, inputs, "last")
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

    async def apply(commands: list[_proto.Command]) -> None:
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
                proposal = await trio.to_thread.run_sync(
                    drafter.propose, request.context, request.max_drafts
                )
            opened = controller.open_window(proposal, now_ms=now_ms())
            if opened is None:
                return  # no drafts for a continuation: wait for the next reply
            await apply([opened])

    await fill()
    while not controller.drained:
        if lane is None:
            reply: _proto.Predictions | _proto.Cancelled = local_replies.popleft()
        else:
            reply = await lane.receive_reply(request_id)
        before = controller.stats()
        if isinstance(reply, _proto.Cancelled):
            controller.on_cancelled(reply.window_ids, now_ms=now_ms())
        else:
            await apply(controller.on_predictions(reply.window_id, reply.tokens, now_ms=now_ms()))
        stats = controller.stats()
        depth.observe(before, stats)
        if (
            drafting
            and config.adaptive
            and stats.windows >= ADAPTIVE_MIN_WINDOWS
            and stats.accept_rate < ADAPTIVE_MIN_ACCEPT_RATE
        ):
            drafting = False  # measured not to pay: plain decoding through windows
        await fill()
    timings: dict[str, Any] = {}
    timings.update(speculation_timings(controller.stats()))
    timings.update(response_timings(controller.scheduler.stats(now_ms())))
    timings["draft_n"] = controller.stats().proposed
    timings["draft_n_accepted"] = controller.stats().accepted
    timings["speculative_drafting_switched_off"] = not drafting
    return timings, controller.finish_reason
