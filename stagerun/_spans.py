"""Every span and event stagerun emits, declared once: its name, its attributes, its guard.

Theory of operation: a hot path makes one call here per observation and passes plain values;
the function names the span, builds its attributes and checks the debug guard (a debug span
costs one attribute read when debug telemetry is off). The records go to the current
`stagerun.telemetry.Telemetry`. A new span or event is one function in this module; nothing
else in ``stagerun/`` calls ``span``, ``debug_span`` or ``event`` (a test checks).

=============================================  ======  ====================================
name                                           kind    emitted by
=============================================  ======  ====================================
``stage.binary_recv``                          debug   a stage reading a frame off a lane
``stage.binary_llama_decode``                  debug   a stage's compute (done or stopped)
``stage.binary_downstream_write``              debug   activations written downstream
``stage.binary_request_summary``               span    a stage's session, at its ``Stop``
``stage.openai_prefill_chunk``                 debug   stage 0, each prefill chunk
``stage.openai_prefill``                       span    stage 0, a whole prefill
``stage.openai_decode_token``                  debug   stage 0, each plain decode step
``stage.openai_decode``                        span    stage 0, a request's decode
``stage.openai_decode_verify_window``          span    stage 0, each settled verify window
``stage.openai_generation_summary``            span    stage 0, a whole request
``stage.openai_downstream_pool_ready``         span    the lane pool, opened
``stage.openai_downstream_persistent_connect`` span    the lane pool, one lane connected
``stage.openai_downstream_connect``            span    the lane pool, a lane checked out
``stage.openai_downstream_lane_return_failed`` event   a lane that did not stop cleanly
``stage.openai_downstream_lane_replaced``      event   a retired lane's replacement
``stage.openai_downstream_lane_replace_failed`` event  a replacement that failed
=============================================  ======  ====================================

Attribute names keep the ``llama_stage.`` prefix of the runtime stagerun is modelled on, so
one trace viewer reads both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _proto, telemetry
from .telemetry import now_ns

__all__ = [
    "activations_sent",
    "compute_attributes",
    "decode_finished",
    "decode_token",
    "generation_summary",
    "lane_checked_out",
    "lane_connected",
    "lane_replace_failed",
    "lane_replaced",
    "lane_return_failed",
    "pool_ready",
    "prefill_chunk",
    "prefill_finished",
    "stage_computed",
    "stage_forwarded",
    "stage_received",
    "stage_request_summary",
    "stage_stopped",
    "verify_window",
]

_P = "llama_stage."


def _ms_since(start_ns: int) -> float:
    return (now_ns() - start_ns) / 1e6


def compute_attributes(stage_index: int, message: _proto.ActivationMessage) -> dict[str, Any]:
    """What the spans of one computed message say of it (ids, positions, counts)."""
    attributes: dict[str, Any] = {
        "llama_stage.stage_index": stage_index,
        "llama_stage.message_kind": message.kind,
        "llama_stage.request_id": message.request_id,
        "llama_stage.pos_start": message.position,
        "llama_stage.token_count": len(message.tokens),
    }
    if isinstance(message, _proto.Verify):
        attributes["llama_stage.verify_window_id"] = message.window_id
    return attributes


# --- a stage --------------------------------------------------------------------------------


def stage_received(stage_index: int, message: _proto.Message, started_ns: int) -> None:
    """Debug: a stage read ``message`` off its upstream lane."""
    tel = telemetry.current()
    if tel.debug_enabled:
        tel.debug_span(
            "stage.binary_recv",
            started_ns,
            {
                "llama_stage.stage_index": stage_index,
                "llama_stage.message_kind": message.kind,
                "llama_stage.request_id": message.request_id,
            },
        )


def _message_span(
    name: str,
    stage_index: int,
    message: _proto.ActivationMessage,
    seconds: float,
    extra: Mapping[str, Any],
) -> None:
    """A debug span of ``seconds`` ending now, about one computed message (the caller has
    checked the debug guard, so nothing is built when debug telemetry is off)."""
    attributes = {**compute_attributes(stage_index, message), **extra}
    attributes["llama_stage.elapsed_ms"] = seconds * 1000.0
    telemetry.current().debug_span(name, now_ns() - int(seconds * 1e9), attributes)


def stage_computed(
    stage_index: int, message: _proto.ActivationMessage, seconds: float, batch: int
) -> None:
    """Debug: a stage computed ``message`` in a tick of ``seconds`` with ``batch`` items."""
    if telemetry.current().debug_enabled:
        extra = {"llama_stage.batch_size": batch}
        _message_span("stage.binary_llama_decode", stage_index, message, seconds, extra)


def stage_stopped(
    stage_index: int, message: _proto.ActivationMessage, layer: int, seconds: float
) -> None:
    """Debug: a stale verify window's compute stopped before ``layer``."""
    if telemetry.current().debug_enabled:
        extra = {"llama_stage.compute_stopped": True, "llama_stage.compute_stopped_layer": layer}
        _message_span("stage.binary_llama_decode", stage_index, message, seconds, extra)


def stage_forwarded(
    stage_index: int, message: _proto.ActivationMessage, nbytes: int, write_us: int
) -> None:
    """Debug: a middle stage wrote ``nbytes`` of activations downstream in ``write_us``."""
    if telemetry.current().debug_enabled:
        extra = {"llama_stage.forward_activation_bytes": nbytes}
        _message_span("stage.binary_downstream_write", stage_index, message, write_us / 1e6, extra)


def stage_request_summary(
    stage_index: int, request_id: int, started_ns: int, counts: Mapping[str, Any]
) -> None:
    """A stage's session ended: its counts (each ``llama_stage.<name>``)."""
    attributes = {"llama_stage.stage_index": stage_index, "llama_stage.request_id": request_id}
    attributes.update({_P + name: value for name, value in counts.items()})
    telemetry.current().span("stage.binary_request_summary", started_ns, attributes)


# --- stage 0 ----------------------------------------------------------------------------------


def activations_sent(message: _proto.Message, nbytes: int, started_ns: int) -> None:
    """Debug: stage 0 wrote ``nbytes`` of activations down a lane (the caller checks the guard)."""
    attributes: dict[str, Any] = {
        "llama_stage.stage_index": 0,
        "llama_stage.request_id": getattr(message, "request_id", 0),
        "llama_stage.forward_activation_bytes": nbytes,
        "llama_stage.elapsed_ms": _ms_since(started_ns),
    }
    if isinstance(message, _proto.Verify):
        attributes["llama_stage.verify_window_id"] = message.window_id
    telemetry.current().debug_span("stage.binary_downstream_write", started_ns, attributes)


def prefill_chunk(started_ns: int, attributes: Mapping[str, Any]) -> None:
    """Debug: one prefill chunk (``attributes`` named without the prefix)."""
    tel = telemetry.current()
    if tel.debug_enabled:
        named = {_P + name: value for name, value in attributes.items()}
        tel.debug_span("stage.openai_prefill_chunk", started_ns, named)


def prefill_finished(started_ns: int, attributes: Mapping[str, Any]) -> None:
    """A whole prefill, timed to now (``attributes`` named without the prefix)."""
    named = {_P + name: value for name, value in attributes.items()}
    named["llama_stage.elapsed_ms"] = _ms_since(started_ns)
    telemetry.current().span("stage.openai_prefill", started_ns, named)


def decode_token(request_id: int, step: int, position: int, started_ns: int) -> None:
    """Debug: one plain decode step (its phase: cold, warm-up, steady)."""
    tel = telemetry.current()
    if tel.debug_enabled:
        phase = "cold" if step == 1 else "warmup" if step < 8 else "steady"
        tel.debug_span(
            "stage.openai_decode_token",
            started_ns,
            {
                "llama_stage.request_id": request_id,
                "llama_stage.decode_step": step,
                "llama_stage.pos_start": position,
                "llama_stage.token_phase": phase,
            },
        )


def decode_finished(
    request_id: int,
    first_ns: int,
    tokens: int,
    *,
    elapsed_ms: float,
    windows: Mapping[str, Any] | None = None,
) -> None:
    """A request's decode, from its first token; a speculative one's verify-window counters
    (``windows``, already named ``llama_stage.verify_window.*``) ride along."""
    telemetry.current().span(
        "stage.openai_decode",
        first_ns,
        {
            "llama_stage.request_id": request_id,
            "llama_stage.token_count": tokens,
            "llama_stage.speculative": windows is not None,
            "llama_stage.elapsed_ms": elapsed_ms,
            **(windows or {}),
        },
    )


def generation_summary(
    request_id: int, started_ns: int, attributes: Mapping[str, Any], label: str | None
) -> None:
    """A whole request (``attributes`` named without the prefix), with the caller's label."""
    named: dict[str, Any] = {"llama_stage.request_id": request_id}
    named.update({_P + name: value for name, value in attributes.items()})
    if label is not None:
        named["stagerun.request_label"] = label
    telemetry.current().span("stage.openai_generation_summary", started_ns, named)


def verify_window(
    request_id: int,
    window_id: int,
    started_ns: int,
    inputs: int,
    accepted: int,
    *,
    cancelled: bool,
    stale: bool,
) -> None:
    """A verify window settled: accepted, or stale (cancelled or discarded)."""
    telemetry.current().span(
        "stage.openai_decode_verify_window",
        started_ns,
        {
            "llama_stage.request_id": request_id,
            "llama_stage.verify_window_id": window_id,
            "llama_stage.verify_window_token_count": inputs,
            "llama_stage.verify_window_accepted": 0 if cancelled else accepted,
            "llama_stage.verify_window_cancelled": cancelled,
            "llama_stage.verify_window_stale": cancelled or stale,
            "llama_stage.elapsed_ms": _ms_since(started_ns),
        },
    )


# --- the lane pool ------------------------------------------------------------------------------


def pool_ready(capacity: int, started_ns: int) -> None:
    """The lane pool opened its lanes."""
    telemetry.current().span(
        "stage.openai_downstream_pool_ready",
        started_ns,
        {
            "llama_stage.openai_downstream_pool_capacity": capacity,
            "llama_stage.elapsed_ms": _ms_since(started_ns),
        },
    )


def lane_connected(lane_id: int, capacity: int, started_ns: int) -> None:
    """One lane connected, ready handshake included."""
    telemetry.current().span(
        "stage.openai_downstream_persistent_connect",
        started_ns,
        {
            "llama_stage.openai_downstream_lane_id": lane_id,
            "llama_stage.openai_downstream_pool_capacity": capacity,
            "llama_stage.elapsed_ms": _ms_since(started_ns),
        },
    )


def lane_checked_out(
    request_id: int, lane_id: int, capacity: int, started_ns: int, *, reused: bool
) -> None:
    """A request took a lane: a pooled one (``reused``) or a new one."""
    telemetry.current().span(
        "stage.openai_downstream_connect",
        started_ns,
        {
            "llama_stage.openai_downstream_persistent": reused,
            "llama_stage.openai_downstream_lane_id": lane_id,
            "llama_stage.openai_downstream_pool_capacity": capacity,
            "llama_stage.request_id": request_id,
            "llama_stage.elapsed_ms": _ms_since(started_ns),
        },
    )


def lane_return_failed(lane_id: int, request_id: int, error: BaseException) -> None:
    """A lane did not stop cleanly after its request; it is retired."""
    telemetry.current().event(
        "stage.openai_downstream_lane_return_failed",
        {
            "llama_stage.openai_downstream_lane_id": lane_id,
            "llama_stage.request_id": request_id,
            "llama_stage.error": type(error).__name__,
        },
    )


def lane_replace_failed(retired_lane_id: int, error: BaseException) -> None:
    """A retired lane could not be replaced."""
    telemetry.current().event(
        "stage.openai_downstream_lane_replace_failed",
        {
            "llama_stage.openai_downstream_retired_lane_id": retired_lane_id,
            "llama_stage.error": type(error).__name__,
        },
    )


def lane_replaced(retired_lane_id: int, lane_id: int) -> None:
    """A retired lane was replaced by a new one."""
    telemetry.current().event(
        "stage.openai_downstream_lane_replaced",
        {
            "llama_stage.openai_downstream_retired_lane_id": retired_lane_id,
            "llama_stage.openai_downstream_lane_id": lane_id,
        },
    )
