"""The pipeline view's live timeline (issue 33): each stage's recent work, probed and joined
with stage 0's record of the request's windows, on stage 0's clock.

The parts first (the stage's ring, the wire field, stage 0's record, the document), then a
real three-stage pipeline served over HTTP: while a speculative request runs, ``/ui/state``
shows its computes on every stage, each verify window's work between the moment stage 0 sent
it and the moment its answer came back, and the work of the windows that went stale drawn as
stale on every stage.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _served_app import served_app

from stagerun import SamplingParams, SpeculationConfig, _proto, open_pipeline
from stagerun._driver._clocks import StageClocks
from stagerun._driver._live import KEEP_FINISHED, LiveRequest, RequestLog
from stagerun._driver._values import StageHealth, StageInfo, StageWork
from stagerun._engine._recent import RecentWork
from stagerun._engine._recent import clock_id as own_clock_id
from stagerun._errors import ProtocolError
from stagerun._proto._messages import structure_message, unstructure_message
from stagerun.drafters import OracleDrafter
from stagerun.server._ui import STATE_INTERVAL
from stagerun.server._ui_timeline import HORIZON_MS, recent_batches, timeline
from stagerun.testing import write_tiny_model

PROMPT = "the cat sat on the mat. the cat sat on the"
TOKENS = 96
HOP_MS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("timeline") / "tiny.gguf"
    return write_tiny_model(path, n_layers=6, context_length=4096)


def test_a_stage_keeps_the_latest_computes_of_each_request() -> None:
    recent = RecentWork(size=5)
    for i in range(4):
        recent.computed(7, 100 * i, 100 * i + 50, i, 2)
        recent.computed(9, 100 * i + 50, 100 * i + 90, 0, 1)
    assert len(recent) == 5  # the ring forgot the oldest three
    assert recent.of(7) == (200, 250, 2, 0, 2, 300, 350, 3, 0, 2)
    assert recent.of(9, limit=2) == (250, 290, 0, 0, 1, 350, 390, 0, 0, 1)
    recent.stopped(7, 400, 390, 5)  # a clock read out of order never makes a negative span
    assert recent.of(7, limit=1) == (400, 400, 5, _proto.SPAN_STALE, 0)
    assert recent.of(0) == () and recent.of(8) == ()


def test_a_status_carries_spans_and_refuses_malformed_ones() -> None:
    status = _proto.Status(
        request_id=3, stage_index=1, clock_ns=10**12, ticks=9, tick_items=14,
        spans=(5, 9, 1, _proto.SPAN_COMPUTE, 2, 9, 12, 2, _proto.SPAN_STALE, 0),
    )  # fmt: skip
    assert structure_message("status", unstructure_message(status)) == status
    bad: list[tuple[tuple[int, ...], str]] = [
        ((1, 2, 3, 0), "5 ints per span"),
        ((9, 5, 1, 0, 1), "must end after it starts"),
        ((5, 9, 1, 2, 1), "of kind 0 or 1"),
        ((-1, 9, 1, 0, 1), r"must be an int in \[0"),
        ((1, 2, 0, 0, 1) * (_proto.MAX_STATUS_SPANS + 1), "more than the limit"),
    ]
    for spans, match in bad:
        fields = unstructure_message(status) | {"spans": list(spans)}
        with pytest.raises(ProtocolError, match=match):
            structure_message("status", fields)


def test_a_probed_stage_s_spans_move_onto_the_prober_s_clock() -> None:
    status = _proto.Status(
        request_id=3, stage_index=2, ticks=4, tick_items=6, spans=(100, 150, 1, 0, 2)
    )
    work = StageWork.from_status(status, offset_ns=-40)
    assert work == StageWork(4, 6, ((60, 110, 1, 0, 2),))


def test_stage_0_keeps_its_running_requests_and_the_last_that_ended() -> None:
    log = RequestLog()
    assert log.latest() is None
    first, second = LiveRequest(11), LiveRequest(12)
    log.begin(first)
    log.begin(second)
    assert (first.number, second.number) == (1, 2) and log.latest() is second
    second.opened(1, drafts=3)
    second.opened(2, drafts=3)
    second.settled((1,), "verified", accepted=2)
    second.settled((2, 99), "cancelled")  # 99 was never opened: nothing to settle
    assert [(w.window_id, w.outcome, w.accepted) for w in second.windows] == [
        (1, "verified", 2),
        (2, "cancelled", 0),
    ]
    assert all(w.settled_ns >= w.opened_ns for w in second.windows)
    log.end(second)
    assert log.latest() is first and not second.running  # the one running comes first
    log.end(first)
    assert log.latest() is first
    for rid in range(100, 100 + KEEP_FINISHED):
        record = LiveRequest(rid)
        log.begin(record)
        log.end(record)
    assert log.latest() is record and second not in log._finished


def _health(*spans: tuple[tuple[int, int, int, int, int], ...]) -> list[StageHealth]:
    return [
        StageHealth(StageInfo(i, (i, i + 1), None), "ready", work=StageWork(10, 20, s))
        for i, s in enumerate(spans)
    ]


def test_the_document_marks_the_work_of_stale_windows_on_every_stage() -> None:
    record = LiveRequest(5, number=3, started_ns=1_000_000_000)
    now = 1_500_000_000
    ms = 1_000_000
    stage0 = ((1_100 * ms, 1_110 * ms, 1, 0, 1), (1_120 * ms, 1_130 * ms, 2, 0, 1))
    stage1 = ((1_112 * ms, 1_125 * ms, 1, 0, 2), (1_131 * ms, 1_140 * ms, 2, 1, 1))
    record.opened(1, drafts=2)
    record.opened(2, drafts=2)
    record.settled((1,), "verified", accepted=1)
    record.settled((2,), "stale")
    times = ((1_095, 1_150), (1_115, 1_160))
    for window, (opened, settled) in zip(record.windows, times, strict=True):
        window.opened_ns, window.settled_ns = opened * ms, settled * ms
    doc = timeline(record, _health(stage0, stage1), now)
    assert doc is not None and doc["request"] == 3 and doc["running"]
    assert doc["start_ms"] == -500.0 and doc["since_ms"] == -500.0 and doc["end_ms"] is None
    assert doc["stages"][0] == [[-400.0, -390.0, "compute", 1, 1], [-380.0, -370.0, "stale", 2, 1]]
    assert [s[2] for s in doc["stages"][1]] == ["compute", "stale"]
    assert doc["windows"] == [
        [1, -405.0, -350.0, "verified", 2, 1, 0],
        [2, -385.0, -340.0, "stale", 2, 0, 0],
    ]
    assert timeline(None, _health(stage0), now) is None
    # a long request shows its last HORIZON_MS only
    late = 1_125 * ms + int(HORIZON_MS * ms)  # the horizon starts inside the second span
    assert timeline(record, _health(stage0, stage1), late)["stages"][0] == [  # type: ignore[index]
        [-HORIZON_MS - 5.0, -HORIZON_MS + 5.0, "stale", 2, 1]
    ]


def test_after_a_recovery_a_compute_is_matched_with_its_own_attempt_s_windows() -> None:
    ms = 1_000_000
    record = LiveRequest(5, number=1, started_ns=1_000 * ms)
    record.opened(1, drafts=2)
    record.recovered()  # window 1 of the first attempt was lost with its lane
    record.opened(1, drafts=2)
    record.settled((1,), "verified", accepted=2)
    first, second = record.windows
    assert (first.outcome, first.attempt) == ("cancelled", 0)
    assert (second.outcome, second.attempt) == ("verified", 1)
    record.recoveries[0] = 1_100 * ms
    spans = ((1_050 * ms, 1_060 * ms, 1, 0, 1), (1_150 * ms, 1_160 * ms, 1, 0, 1))
    doc = timeline(record, _health(spans), 1_200 * ms)
    assert doc is not None and [s[2] for s in doc["stages"][0]] == ["stale", "compute"]
    assert [w[6] for w in doc["windows"]] == [0, 1] and doc["recoveries"] == [-100.0]


def test_the_batch_size_of_each_stage_between_two_probes() -> None:
    before = _health((), ())
    after = [
        StageHealth(h.stage, "ready", work=StageWork(h.work.ticks + 4, h.work.tick_items + k))  # type: ignore[union-attr]
        for h, k in zip(before, (4, 10), strict=True)
    ]
    assert recent_batches(before, after) == {0: 1.0, 1: 2.5}
    assert recent_batches(None, after) == {} and recent_batches(after, after) == {}


async def _poll_until(client: httpx.AsyncClient, done: Any) -> dict[str, Any]:
    with trio.fail_after(30):
        while True:
            state = (await client.get("/ui/state")).json()
            if done(state):
                return state  # type: ignore[no-any-return]
            await trio.sleep(0.2)


def _check_causality(doc: dict[str, Any], hop_ms: float) -> None:
    """Stage k computes a window at least k link delays after stage 0 sent it; a verified
    window's answer came back a link delay after the last stage computed it. So a stage's
    clock mapped a few milliseconds off is caught. (1 ms: the clocks' rounding.)"""
    windows = {w[0]: w for w in doc["windows"]}
    last = len(doc["stages"]) - 1
    checked = 0
    for stage, spans in enumerate(doc["stages"]):
        for start, end, kind, window, _batch in spans:
            if window not in windows:
                continue
            _id, opened, settled, outcome, *_ = windows[window]
            assert start >= opened + stage * hop_ms - 1, (stage, window, start, opened)
            if outcome == "verified" and stage == last:
                assert end <= settled - hop_ms + 1, (stage, window, end, settled)
            assert (kind == "stale") == (outcome in ("stale", "cancelled")), (stage, window)
            checked += 1
    assert checked >= 3 * len(doc["windows"]) // 2, (checked, len(doc["windows"]))


async def test_the_view_shows_a_speculative_request_on_every_stage(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=3) as pipeline:
        plain = await pipeline.complete(PROMPT, max_tokens=TOKENS, sampling=SamplingParams())
        assert len(plain.token_ids) == TOKENS and len(set(plain.token_ids)) > 8
    reference = plain.prompt_token_ids + plain.token_ids
    # Emulated links: long enough to be seen running by snapshots a second apart.
    async with (
        open_pipeline(tiny, stages=3, hop_delay_ms=HOP_MS) as pipeline,
        served_app(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        drafter = OracleDrafter(reference, error_rate=0.4, vocab_size=pipeline.config.vocab_size)
        speculation = SpeculationConfig("ngram", depth=4, window=3, adaptive=False)
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def run() -> None:
                result = await pipeline.complete(
                    PROMPT, max_tokens=TOKENS, speculation=speculation, drafter=drafter
                )
                assert result.token_ids == plain.token_ids
                done.set()

            nursery.start_soon(run)
            live = await _poll_until(
                client,
                lambda s: (
                    s["timeline"]["running"]
                    and s["timeline"]["request"] == 1
                    and all(s["timeline"]["stages"])
                ),
            )
            assert live["timeline"]["end_ms"] is None
            await done.wait()
        start = time.monotonic()
        ended = await _poll_until(client, lambda s: not s["timeline"]["running"])
        assert time.monotonic() - start <= 2 * STATE_INTERVAL + 1
        doc = ended["timeline"]
        assert doc["request"] == 1 and doc["end_ms"] <= 0 and doc["start_ms"] < doc["end_ms"]
        outcomes = [w[3] for w in doc["windows"]]
        assert "verified" in outcomes and ("stale" in outcomes or "cancelled" in outcomes)
        assert all(len(spans) >= 4 for spans in doc["stages"]), doc["stages"]
        for spans in doc["stages"]:
            # a span that ends inside the horizon is kept whole (a slow run outlasts it)
            assert all(s[0] <= s[1] and doc["since_ms"] <= s[1] <= 0 and s[4] >= 0 for s in spans)
        _check_causality(doc, HOP_MS)
        assert all(s["recent_batch"] is None or s["recent_batch"] >= 1 for s in ended["stages"])


def test_a_stage_s_clock_offset_narrows_to_the_fastest_probe_and_follows_a_new_host() -> None:
    clocks = StageClocks()
    # the stage's clock is 1000 behind ours: it read c while our clock read c + 1000
    assert clocks.offset("a", asked_ns=5_000, clock_ns=4_100, answered_ns=5_400) == 1_100
    assert clocks.offset("a", asked_ns=9_000, clock_ns=7_975, answered_ns=9_100) == 1_075
    # a slow probe widens nothing: the fastest round trip's bounds stay
    assert clocks.offset("a", asked_ns=20_000, clock_ns=20_925, answered_ns=25_000) == 1_075
    # bounds that miss the kept ones: another clock answers there now
    assert clocks.offset("a", asked_ns=30_000, clock_ns=40_000, answered_ns=30_010) == -9_995
    assert clocks.offset("b", asked_ns=1, clock_ns=1, answered_ns=3) == 1
    # a stage on this host since its boot reads this very clock
    assert clocks.offset("c", 10, 4, 20, clock_id=own_clock_id()) == 0
    assert own_clock_id() != 0  # Linux names it
    assert clocks.offset("c", 10, 4, 20, clock_id=own_clock_id() + 1) == 11
