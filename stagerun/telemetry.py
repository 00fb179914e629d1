"""Telemetry: named events and spans, queued without ever blocking inference.

Theory of operation: code that wants to be seen calls `Telemetry.event` (a point in time) or
`Telemetry.span` (a start and an end, in nanoseconds since the epoch) with a name from the
original runtime's vocabulary (``stage.openai_downstream_connect``...) and attributes under
``llama_stage.*`` or ``stagerun.*``. The call builds a small record and appends it to a bounded
queue; a full queue drops the record and counts it (``stagerun.telemetry_dropped_events``
rides on every later record). That is all the hot path pays; it takes no Trio checkpoint and no
I/O, so it is safe from Trio tasks and from compute threads alike.

`Telemetry.run` is a Trio task that drains the queue into the sinks: `JsonLinesSink` (one JSON
object per line, to a file or stderr) and `OpenTelemetrySink` (spans through
``opentelemetry-api``; they go nowhere until the application installs an SDK and exporter,
``pip install stagerun[otel]``). A sink that fails is counted
(``stagerun.telemetry_export_errors``), never raised into the pipeline.

Levels: ``off`` records nothing, ``summary`` records lane-pool events and one span per request
phase (prefill, decode, each verify window, the request), ``debug`` adds a span per prefill
chunk, per decode token and per message a stage receives, computes and forwards.

Privacy: records carry ids, counts, sizes and durations only -- never prompt or completion
text, token ids, file paths or addresses. `Telemetry.emit` strips attributes whose names say
otherwise (an attribute named ``prompt``, ``text``, ``token_ids``, ``address``...): such an
attribute is dropped from the record and counted in ``privacy_dropped``.

Configuration from the environment (what ``stagerun serve``/``stage`` use):

========================== =========================================================
``STAGERUN_TELEMETRY``      ``off`` (default), ``summary`` or ``debug``
``STAGERUN_TELEMETRY_JSONL`` a file to append JSON lines to, or ``stderr``
``STAGERUN_TELEMETRY_OTEL`` ``1``: also emit through OpenTelemetry
``STAGERUN_TELEMETRY_QUEUE`` queue capacity in records (default 1024)
========================== =========================================================

With ``STAGERUN_TELEMETRY_OTEL=1`` and no tracer provider set up by the application (the case
of the command line), the OpenTelemetry SDK is set up from the standard variables:
``OTEL_TRACES_EXPORTER`` ``otlp`` (default; ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the other
``OTEL_EXPORTER_OTLP_*`` variables apply), ``console`` (spans as JSON on stderr) or ``none``;
``OTEL_SERVICE_NAME`` (default ``stagerun``). It needs ``pip install 'stagerun[otel]'``.
JSON lines still go to ``STAGERUN_TELEMETRY_JSONL``, or to stderr when it is not set.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal, Protocol, TextIO

import attrs
import trio

__all__ = [
    "LEVELS",
    "JsonLinesSink",
    "OpenTelemetrySink",
    "Record",
    "Sink",
    "Telemetry",
    "configure_from_env",
    "current",
    "draining",
    "set_current",
]

Level = Literal["off", "summary", "debug"]
LEVELS: tuple[Level, ...] = ("off", "summary", "debug")
DEFAULT_QUEUE_CAPACITY = 1024
DRAIN_INTERVAL = 0.05  # seconds between drains when records trickle in
_FORBIDDEN = frozenset(
    {"prompt", "text", "completion", "content", "messages", "token_ids", "tokens", "path",
     "address", "url"}
)  # fmt: skip


def now_ns() -> int:
    """Nanoseconds since the epoch (the clock every record uses)."""
    return time.time_ns()


@attrs.frozen
class Record:
    """One event (``end_ns == start_ns + 1``) or span."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.name,
            "attributes": dict(self.attributes),
            "start_time_unix_nanos": self.start_ns,
            "end_time_unix_nanos": self.end_ns,
        }


class Sink(Protocol):
    """Where drained records go; ``write`` runs in the drain task, never on the hot path."""

    def write(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


class JsonLinesSink:
    """One JSON object per record and line, to a stream, ``"stderr"``, or a file path.

    A file is opened for appending and each drain is one ``write`` system call of whole lines,
    so several processes (stage 0 and the stages it starts) can share one trace file without
    tearing each other's lines.
    """

    def __init__(self, target: str | TextIO) -> None:
        self._stream: TextIO | None = None
        self._fd: int | None = None
        if target == "stderr":
            self._stream = sys.stderr
        elif isinstance(target, str):
            try:
                self._fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ValueError(
                    f"cannot open the telemetry file {target}: {exc.strerror or exc}; "
                    "create its folder or give another path"
                ) from None
        else:
            self._stream = target

    def write(self, records: Sequence[Record]) -> None:
        lines = "".join(json.dumps(r.to_json()) + "\n" for r in records)
        if self._fd is None:
            assert self._stream is not None
            self._stream.write(lines)
            self._stream.flush()
            return
        data = memoryview(lines.encode())
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class OpenTelemetrySink:
    """Each record becomes an OpenTelemetry span (an event: a 1 ns span), kind INTERNAL.

    Uses ``opentelemetry-api`` only; spans are exported by whatever SDK the application set
    up (none: they are dropped by the API's no-op tracer).
    """

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        from opentelemetry import trace

        self._provider = provider  # one this sink set up: flushed and shut down on close
        self._tracer = tracer or (provider or trace.get_tracer_provider()).get_tracer("stagerun")

    def write(self, records: Sequence[Record]) -> None:
        for record in records:
            span = self._tracer.start_span(
                record.name,
                start_time=record.start_ns,
                attributes={k: _otel_value(v) for k, v in record.attributes.items()},
            )
            span.end(end_time=record.end_ns)

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # exports what is batched


def _otel_sdk_provider(env: Mapping[str, str]) -> Any:
    """A tracer provider from the standard ``OTEL_*`` variables, or None if one is set up.

    Raises:
        ValueError: the SDK (or the exporter asked for) is not installed, or an unknown
            exporter is named.
    """
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # the application configured OpenTelemetry itself
    hint = "pip install 'stagerun[otel]'"
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace import export as sdk_export
    except ImportError:
        raise ValueError(f"STAGERUN_TELEMETRY_OTEL needs the OpenTelemetry SDK: {hint}") from None
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    service = env.get("OTEL_SERVICE_NAME", "stagerun")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter_name == "console":
        provider.add_span_processor(
            sdk_export.SimpleSpanProcessor(sdk_export.ConsoleSpanExporter(out=sys.stderr))
        )
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(f"OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: {hint}") from None
        provider.add_span_processor(sdk_export.BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter_name != "none":
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}; use otlp, console or none")
    return provider


def _otel_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return list(value)
    return "" if value is None else str(value)


class Telemetry:
    """A bounded record queue and the sinks it drains into.

    Args:
        level: ``off``, ``summary`` or ``debug``.
        sinks: where records go.
        capacity: records the queue holds before it drops.
        common: attributes added to every record (``stagerun.run_id`` is added for you).
    """

    def __init__(
        self,
        level: Level = "off",
        sinks: Sequence[Sink] = (),
        *,
        capacity: int = DEFAULT_QUEUE_CAPACITY,
        common: Mapping[str, Any] | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"telemetry level must be one of {', '.join(LEVELS)}, not {level!r}")
        if capacity < 1:
            raise ValueError(f"the telemetry queue needs room for 1 record, not {capacity}")
        self.level: Level = level
        self.sinks = list(sinks)
        self.capacity = capacity
        self.common = {"stagerun.run_id": secrets.token_hex(8), **(common or {})}
        self.dropped = 0
        self.privacy_dropped = 0  # attributes refused because their names could carry user data
        self.export_errors = 0
        self.emitted = 0
        self._queue: collections.deque[Record] = collections.deque()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<Telemetry level={self.level} queued={len(self._queue)} dropped={self.dropped} "
            f"sinks={len(self.sinks)}>"
        )

    @property
    def enabled(self) -> bool:
        return self.level != "off"

    @property
    def debug_enabled(self) -> bool:
        return self.level == "debug"

    # -- the hot path ----------------------------------------------------------------------

    def emit(self, name: str, attributes: Mapping[str, Any], start_ns: int, end_ns: int) -> None:
        """Queue one record; drop and count it when the queue is full. Never blocks."""
        if self.level == "off":
            return
        if any(key.rsplit(".", 1)[-1] in _FORBIDDEN for key in attributes):
            # never raised into inference: the attribute is dropped, and counted
            attributes = {
                k: v for k, v in attributes.items() if k.rsplit(".", 1)[-1] not in _FORBIDDEN
            }
            self.privacy_dropped += 1
        with self._lock:
            if len(self._queue) >= self.capacity:
                self.dropped += 1
                return
            attrs_out = {**self.common, **attributes}
            if self.dropped:
                attrs_out["stagerun.telemetry_dropped_events"] = self.dropped
            if self.export_errors:
                attrs_out["stagerun.telemetry_export_errors"] = self.export_errors
            self._queue.append(Record(name, start_ns, max(end_ns, start_ns + 1), attrs_out))
            self.emitted += 1

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """A point event at summary level."""
        if self.level != "off":
            start = now_ns()
            self.emit(name, attributes, start, start + 1)

    def span(
        self, name: str, start_ns: int, attributes: Mapping[str, Any], end_ns: int | None = None
    ) -> None:
        """A finished span at summary level (``end_ns`` defaults to now)."""
        if self.level != "off":
            self.emit(name, attributes, start_ns, end_ns if end_ns is not None else now_ns())

    def debug_span(
        self, name: str, start_ns: int, attributes: Mapping[str, Any], end_ns: int | None = None
    ) -> None:
        """A finished span at debug level only."""
        if self.level == "debug":
            self.emit(name, attributes, start_ns, end_ns if end_ns is not None else now_ns())

    @contextmanager
    def timed(
        self, name: str, *, debug: bool = False, **attributes: Any
    ) -> Iterator[dict[str, Any]]:
        """Record the ``with`` block as a span; the yielded dict takes more attributes."""
        extra: dict[str, Any] = {}
        if self.level == "off" or (debug and self.level != "debug"):
            yield extra
            return
        start = now_ns()
        try:
            yield extra
        except BaseException as exc:
            extra["llama_stage.error"] = type(exc).__name__
            raise
        finally:
            extra.setdefault("llama_stage.elapsed_ms", (now_ns() - start) / 1e6)
            self.emit(name, extra, start, now_ns())

    # -- draining -----------------------------------------------------------------------------

    def take(self) -> list[Record]:
        """Everything queued, oldest first (the queue is empty afterwards)."""
        with self._lock:
            records = list(self._queue)
            self._queue.clear()
        return records

    def flush(self) -> None:
        """Write everything queued to the sinks now (blocking; not for the hot path)."""
        records = self.take()
        if not records:
            return
        for sink in self.sinks:
            try:
                sink.write(records)
            except Exception:
                self.export_errors += 1

    async def run(self, *, interval: float = DRAIN_INTERVAL) -> None:
        """Drain into the sinks until cancelled, then flush what is left and close them."""
        try:
            while True:
                await trio.sleep(interval)
                if self._queue:
                    await trio.to_thread.run_sync(self.flush)
        finally:
            self.flush()  # synchronous: runs even when cancelled
            for sink in self.sinks:
                sink.close()


@asynccontextmanager
async def draining(telemetry: Telemetry) -> AsyncIterator[Telemetry]:
    """Run ``telemetry``'s drain task for the duration of the block (flushes at the end)."""
    if not telemetry.enabled:
        yield telemetry
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(telemetry.run)
        try:
            yield telemetry
        finally:
            nursery.cancel_scope.cancel()


_current = Telemetry("off")


def current() -> Telemetry:
    """The process's telemetry (``off`` until configured)."""
    return _current


def set_current(telemetry: Telemetry) -> Telemetry:
    """Make ``telemetry`` the process's; returns the previous one."""
    global _current
    previous, _current = _current, telemetry
    return previous


def configure_from_env(
    environ: Mapping[str, str] | None = None, *, common: Mapping[str, Any] | None = None
) -> Telemetry:
    """A `Telemetry` from ``$STAGERUN_TELEMETRY*`` (see the module docstring), made current.

    Raises:
        ValueError: an unknown level, a bad queue size, or a JSON-lines file that cannot be
            opened.
    """
    env = os.environ if environ is None else environ
    level = env.get("STAGERUN_TELEMETRY", "off").strip().lower() or "off"
    if level not in LEVELS:
        raise ValueError(f"STAGERUN_TELEMETRY={level!r}; use one of {', '.join(LEVELS)}")
    try:
        capacity = int(env.get("STAGERUN_TELEMETRY_QUEUE", str(DEFAULT_QUEUE_CAPACITY)))
    except ValueError:
        raise ValueError("STAGERUN_TELEMETRY_QUEUE must be a whole number of records") from None
    telemetry = Telemetry(level, capacity=capacity, common=common)  # checks before opening
    sinks = telemetry.sinks
    if level != "off":  # off opens nothing (a sink holds a file until the drain task closes it)
        try:
            target = env.get("STAGERUN_TELEMETRY_JSONL")
            if target:
                sinks.append(JsonLinesSink(target))
            else:
                sinks.append(JsonLinesSink("stderr"))
            if env.get("STAGERUN_TELEMETRY_OTEL", "") not in ("", "0"):
                sinks.append(OpenTelemetrySink(provider=_otel_sdk_provider(env)))
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
    set_current(telemetry)
    return telemetry
