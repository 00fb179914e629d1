"""Telemetry: the span names and attributes operators rely on, a queue that never blocks."""

from __future__ import annotations

import io
import json
import pathlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pytest
import trio

from stagerun import LaneError, RecoveryPolicy, SpeculationConfig, open_pipeline, telemetry
from stagerun.model import ModelFile

if TYPE_CHECKING:
    from conftest import KillableStage

PROMPT = "The lighthouse keeper counted the ships"


class ListSink:
    def __init__(self) -> None:
        self.records: list[telemetry.Record] = []
        self.written = threading.Event()  # set by the first write, from whichever thread

    def write(self, records: Sequence[telemetry.Record]) -> None:
        self.records.extend(records)
        self.written.set()

    def close(self) -> None:
        pass


@pytest.fixture
def recorded() -> Iterator[tuple[telemetry.Telemetry, ListSink]]:
    sink = ListSink()
    tel = telemetry.Telemetry("debug", [sink], capacity=100_000)
    previous = telemetry.set_current(tel)
    try:
        yield tel, sink
    finally:
        telemetry.set_current(previous)


def named(tel: telemetry.Telemetry, sink: ListSink, name: str) -> list[telemetry.Record]:
    tel.flush()
    return [r for r in sink.records if r.name == name]


async def test_lane_pool_events(
    tiny_model_path: pathlib.Path, recorded: tuple[telemetry.Telemetry, ListSink]
) -> None:
    tel, sink = recorded
    async with open_pipeline(tiny_model_path, stages=3, capacity=2) as pipeline:
        (ready,) = named(tel, sink, "stage.openai_downstream_pool_ready")
        assert ready.attributes["llama_stage.openai_downstream_pool_capacity"] == 2
        connects = named(tel, sink, "stage.openai_downstream_persistent_connect")
        assert [c.attributes["llama_stage.openai_downstream_lane_id"] for c in connects] == [0, 1]
        await pipeline.complete(PROMPT, max_tokens=4)
        (checkout,) = named(tel, sink, "stage.openai_downstream_connect")
        assert checkout.attributes["llama_stage.openai_downstream_persistent"] is True
        assert checkout.attributes["llama_stage.openai_downstream_lane_id"] == 1  # LIFO
        # leaving a stream early retires its lane; a fresh one replaces it
        async with pipeline.generate(PROMPT, max_tokens=50) as stream:
            async for _ in stream:
                break
        (replaced,) = named(tel, sink, "stage.openai_downstream_lane_replaced")
        assert replaced.attributes["llama_stage.openai_downstream_retired_lane_id"] == 1
        assert replaced.attributes["llama_stage.openai_downstream_lane_id"] == 2
    for record in sink.records:
        assert "stagerun.run_id" in record.attributes
        assert record.end_ns > record.start_ns


async def test_a_failed_replacement_is_an_event(
    tiny_model: ModelFile,
    recorded: tuple[telemetry.Telemetry, ListSink],
    killable_stage: KillableStage,
) -> None:
    tel, sink = recorded
    ranges = [(0, 2), (2, 4)]
    async with trio.open_nursery() as nursery:
        address, scope = await killable_stage(nursery)
        async with open_pipeline(
            tiny_model, layers=ranges, remote=[address], recovery=RecoveryPolicy.disabled()
        ) as pipeline:
            with pytest.raises(LaneError):  # the stage dies mid-request; it is not replaced
                await pipeline.complete(
                    PROMPT, max_tokens=40, ignore_eog=True, on_token=lambda _: scope.cancel()
                )
        failed = named(tel, sink, "stage.openai_downstream_lane_replace_failed")
        assert failed and failed[0].attributes["llama_stage.error"] == "LaneHandshakeError"
        nursery.cancel_scope.cancel()


async def test_request_and_stage_spans(
    tiny_model_path: pathlib.Path, recorded: tuple[telemetry.Telemetry, ListSink]
) -> None:
    tel, sink = recorded
    async with open_pipeline(tiny_model_path, stages=3) as pipeline:
        prompt = [3 + i % 270 for i in range(400)]
        result = await pipeline.complete(prompt, max_tokens=12, ignore_eog=True)
    (prefill,) = named(tel, sink, "stage.openai_prefill")
    assert prefill.attributes["llama_stage.token_count"] == 400
    assert prefill.attributes["llama_stage.prefill_chunks"] > 1
    chunks = named(tel, sink, "stage.openai_prefill_chunk")
    assert sum(c.attributes["llama_stage.token_count"] for c in chunks) == 400
    assert {"llama_stage.stage0_compute_ms", "llama_stage.forward_write_ms",
            "llama_stage.downstream_wait_ms"} <= set(chunks[0].attributes)  # fmt: skip
    (decode,) = named(tel, sink, "stage.openai_decode")
    assert decode.attributes["llama_stage.token_count"] == 12
    tokens = named(tel, sink, "stage.openai_decode_token")
    assert [t.attributes["llama_stage.token_phase"] for t in tokens][:2] == ["cold", "warmup"]
    (summary,) = named(tel, sink, "stage.openai_generation_summary")
    assert summary.attributes["llama_stage.completion_token_count"] == len(result.token_ids)
    assert summary.attributes["llama_stage.finish_reason"] == "length"
    request_id = summary.attributes["llama_stage.request_id"]
    assert prefill.attributes["llama_stage.request_id"] == request_id
    # every stage computes, stage 0 included; all but the last write downstream
    computes = named(tel, sink, "stage.binary_llama_decode")
    assert {c.attributes["llama_stage.stage_index"] for c in computes} == {0, 1, 2}
    assert all(c.attributes["llama_stage.request_id"] == request_id for c in computes)
    stage0 = [c for c in computes if c.attributes["llama_stage.stage_index"] == 0]
    # stage 0 computes each prefill chunk, then one forward per decode step but the last
    assert sum(c.attributes["llama_stage.token_count"] for c in stage0) == 400 + 11
    writes = named(tel, sink, "stage.binary_downstream_write")
    assert {w.attributes["llama_stage.stage_index"] for w in writes} == {0, 1}
    assert all(w.attributes["llama_stage.forward_activation_bytes"] > 0 for w in writes)
    # the stages, in this process (inproc): receive and a summary each
    kinds = {
        r.attributes["llama_stage.message_kind"] for r in named(tel, sink, "stage.binary_recv")
    }
    assert {"configure", "prefill", "decode", "stop"} <= kinds
    summaries = named(tel, sink, "stage.binary_request_summary")
    assert {s.attributes["llama_stage.stage_index"] for s in summaries} == {1, 2}
    assert all(s.attributes["llama_stage.token_count"] >= 400 for s in summaries)
    # privacy: no attribute carries text or token ids
    for record in sink.records:
        for key, value in record.attributes.items():
            assert not (isinstance(value, str) and "lighthouse" in value), key
            assert not isinstance(value, (list, tuple)), key


async def test_verify_window_spans(
    tiny_model_path: pathlib.Path, recorded: tuple[telemetry.Telemetry, ListSink]
) -> None:
    tel, sink = recorded
    speculation = SpeculationConfig(drafter="ngram", depth=3, window=3)
    async with open_pipeline(tiny_model_path, stages=3, speculation=speculation) as pipeline:
        await pipeline.complete(PROMPT * 3, max_tokens=40, ignore_eog=True)
    windows = named(tel, sink, "stage.openai_decode_verify_window")
    assert windows
    for window in windows:
        attrs = window.attributes
        assert attrs["llama_stage.verify_window_token_count"] >= 1
        assert attrs["llama_stage.verify_window_accepted"] >= 0
        assert isinstance(attrs["llama_stage.verify_window_cancelled"], bool)
        if attrs["llama_stage.verify_window_stale"]:  # wasted: nothing of it was accepted
            assert attrs["llama_stage.verify_window_accepted"] == 0
    ids = {w.attributes["llama_stage.verify_window_id"] for w in windows}
    assert len(ids) == len(windows)
    # each window's compute on every stage names it, so wasted work can be attributed
    computed = {
        (c.attributes["llama_stage.stage_index"], c.attributes["llama_stage.verify_window_id"])
        for c in named(tel, sink, "stage.binary_llama_decode")
        if "llama_stage.verify_window_id" in c.attributes
    }
    assert {window for stage, window in computed if stage == 0} == ids
    assert {stage for stage, _ in computed} == {0, 1, 2}


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    sink = ListSink()
    tel = telemetry.Telemetry("summary", [sink], capacity=10)
    room = telemetry.Telemetry("summary", [], capacity=200_000)  # never full: every record kept

    def seconds(t: telemetry.Telemetry, first: int) -> float:
        start = time.perf_counter()
        for i in range(first, first + 10_000):
            t.event("stagerun.test", {"llama_stage.seq_id": i})
        return time.perf_counter() - start

    # A full queue costs a lock and a counter: less than queueing the record would. Timed
    # side by side, in alternating rounds, so a busy machine slows both alike.
    full_s = room_s = 0.0
    for first in range(0, 100_000, 10_000):
        full_s += seconds(tel, first)
        room_s += seconds(room, first)
    assert tel.dropped == 100_000 - 10 and tel.emitted == 10
    assert room.dropped == 0 and room.emitted == 100_000
    assert full_s < room_s, (full_s, room_s)
    tel.flush()
    tel.event("stagerun.test", {})
    tel.flush()
    assert sink.records[-1].attributes["stagerun.telemetry_dropped_events"] == 99_990


async def test_generation_goes_on_while_the_queue_overflows(tiny_model_path: pathlib.Path) -> None:
    sink = ListSink()
    tel = telemetry.Telemetry("debug", [sink], capacity=3)
    previous = telemetry.set_current(tel)
    try:
        async with open_pipeline(tiny_model_path, stages=3) as pipeline:
            result = await pipeline.complete(PROMPT, max_tokens=30, ignore_eog=True)
    finally:
        telemetry.set_current(previous)
    assert len(result.token_ids) == 30
    assert tel.dropped > 0 and tel.emitted == 3


def test_json_lines_and_privacy_guard(tmp_path: pathlib.Path) -> None:
    out = io.StringIO()
    tel = telemetry.Telemetry("summary", [telemetry.JsonLinesSink(out)])
    tel.span("stage.openai_prefill", telemetry.now_ns() - 5_000_000, {"llama_stage.token_count": 9})
    tel.flush()
    line = json.loads(out.getvalue())
    assert line["event"] == "stage.openai_prefill"
    assert line["attributes"]["llama_stage.token_count"] == 9
    assert line["end_time_unix_nanos"] - line["start_time_unix_nanos"] >= 5_000_000
    out.truncate(0)
    out.seek(0)
    tel.event("x", {"llama_stage.prompt": "secret", "stagerun.text": "s", "llama_stage.seq_id": 1})
    tel.flush()
    kept = json.loads(out.getvalue())["attributes"]
    assert "llama_stage.prompt" not in kept and "stagerun.text" not in kept
    assert kept["llama_stage.seq_id"] == 1 and tel.privacy_dropped == 1
    path = tmp_path / "t.jsonl"
    configured = telemetry.configure_from_env(
        {"STAGERUN_TELEMETRY": "summary", "STAGERUN_TELEMETRY_JSONL": str(path)}
    )
    try:
        configured.event("stagerun.hello", {"llama_stage.seq_id": 1})
        configured.flush()
        assert json.loads(path.read_text())["event"] == "stagerun.hello"
    finally:
        telemetry.set_current(telemetry.Telemetry("off"))
        for sink in configured.sinks:
            sink.close()
    with pytest.raises(ValueError, match="STAGERUN_TELEMETRY='loud'"):
        telemetry.configure_from_env({"STAGERUN_TELEMETRY": "loud"})


def test_off_records_nothing() -> None:
    sink = ListSink()
    tel = telemetry.Telemetry("off", [sink])
    tel.event("x", {})
    tel.span("y", 0, {})
    with tel.timed("z"):
        pass
    tel.flush()
    assert sink.records == [] and tel.emitted == 0


def test_opentelemetry_sink_exports_spans() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = telemetry.OpenTelemetrySink(provider.get_tracer("stagerun"))
    tel = telemetry.Telemetry("summary", [sink])
    start = telemetry.now_ns() - 2_000_000
    tel.span("stage.openai_decode", start, {"llama_stage.token_count": 7})
    tel.flush()
    (span,) = exporter.get_finished_spans()
    assert span.name == "stage.openai_decode"
    assert span.attributes is not None and span.attributes["llama_stage.token_count"] == 7
    assert span.start_time == start and span.end_time is not None and span.end_time > start


async def test_the_drain_task_writes_while_running_and_flushes_at_the_end() -> None:
    sink = ListSink()
    tel = telemetry.Telemetry("summary", [sink])
    async with telemetry.draining(tel):
        tel.event("a", {})
        # drained within DRAIN_INTERVAL, while running; the generous deadline only catches a hang
        assert await trio.to_thread.run_sync(sink.written.wait, 60)
        assert [r.name for r in sink.records] == ["a"]
        tel.event("b", {})
    assert [r.name for r in sink.records] == ["a", "b"]


def test_a_trace_file_gets_each_drain_in_one_append(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0 and its stage processes append to one file: a drain is one O_APPEND write of
    whole lines, which no other process's append can land inside."""
    import os

    path = tmp_path / "trace.jsonl"
    path.write_text('{"earlier": "line"}\n')
    sink = telemetry.JsonLinesSink(str(path))
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    tel = telemetry.Telemetry("summary", [sink], capacity=1000)
    for i in range(500):
        tel.event("stagerun.test", {"llama_stage.seq_id": i, "stagerun.padding": "x" * 200})
    tel.flush()  # ~150 KB: far past any stream buffer
    sink.close()
    assert len(writes) == 1 and writes[0] > 100_000
    lines = path.read_text().splitlines()
    assert lines[0] == '{"earlier": "line"}'  # appended, not overwritten
    seqs = [json.loads(line)["attributes"]["llama_stage.seq_id"] for line in lines[1:]]
    assert seqs == list(range(500))


def test_configuring_telemetry_leaves_no_file_open(tmp_path: pathlib.Path) -> None:
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    path = str(tmp_path / "t.jsonl")
    before = open_fds()
    for _ in range(20):
        telemetry.configure_from_env(
            {"STAGERUN_TELEMETRY": "off", "STAGERUN_TELEMETRY_JSONL": path}
        )
        with pytest.raises(ValueError, match="whole number"):
            telemetry.configure_from_env(
                {"STAGERUN_TELEMETRY": "debug", "STAGERUN_TELEMETRY_JSONL": path,
                 "STAGERUN_TELEMETRY_QUEUE": "many"}
            )  # fmt: skip
    telemetry.set_current(telemetry.Telemetry("off"))
    assert open_fds() == before


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_trace_file_that_cannot_be_opened_is_one_error_line(
    tmp_path: pathlib.Path, command: str
) -> None:
    import subprocess
    import sys

    missing = tmp_path / "no such folder" / "trace.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "stagerun", command, "--telemetry", "summary",
         "--telemetry-jsonl", str(missing), *(["--port", "0"] if command == "serve" else ["hi"])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        f"stagerun: error: cannot open the telemetry file {missing}: No such file or directory;"
        " create its folder or give another path\n"
    )


def test_opentelemetry_from_the_command_line_exports_through_the_sdk(
    tiny_model_path: pathlib.Path,
) -> None:
    """STAGERUN_TELEMETRY_OTEL=1 sets the SDK up from OTEL_* (here the console exporter)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "STAGERUN_TELEMETRY": "summary", "STAGERUN_TELEMETRY_OTEL": "1",
           "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "stagerun-test"}  # fmt: skip
    command = [sys.executable, "-m", "stagerun", "generate", "--model", str(tiny_model_path),
               "--max-tokens", "4", "hi"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    # The console exporter's span, and the JSON line of the same record (on stderr too).
    assert '"name": "stage.openai_generation_summary"' in result.stderr
    assert '"service.name": "stagerun-test"' in result.stderr
    assert '{"event": "stage.openai_generation_summary"' in result.stderr
    bad = subprocess.run(
        command, capture_output=True, text=True, timeout=120,
        env={**env, "OTEL_TRACES_EXPORTER": "carrier-pigeon"},
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith("stagerun: error: OTEL_TRACES_EXPORTER='carrier-pigeon'")
