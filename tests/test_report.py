"""``stagerun bench --png``: the per-stage timeline rebuilt from telemetry, and the PNGs."""

from __future__ import annotations

import json
import pathlib
import struct
import sys

import pytest

from stagerun._cli._main import main
from stagerun._cli._report import (
    PALETTE,
    finished_requests,
    load_trace,
    request_timeline,
    requests_timeline,
)
from stagerun.telemetry import Record

MS = 1_000_000  # nanoseconds
T0 = 1_800_000_000_000_000_000


def span(name: str, start_ms: float, end_ms: float, **attributes: object) -> Record:
    return Record(
        name,
        T0 + int(start_ms * MS),
        T0 + int(end_ms * MS),
        {f"llama_stage.{key}": value for key, value in attributes.items()},
    )


def two_stage_request(request_id: int = 7) -> list[Record]:
    """Stage 0 computes windows 1 and 2; window 2 went stale; stage 1 stops one compute."""
    r = request_id
    return [
        span("stage.openai_generation_summary", 0, 100, request_id=r, stages=2),
        span("stage.binary_llama_decode", 10, 20, request_id=r, stage_index=0, verify_window_id=1),
        span("stage.binary_downstream_write", 20, 22, request_id=r, stage_index=0),
        span("stage.binary_llama_decode", 30, 40, request_id=r, stage_index=0, verify_window_id=2),
        span("stage.binary_request_summary", 5, 95, request_id=r, stage_index=1),
        span("stage.binary_llama_decode", 25, 35, request_id=r, stage_index=1, verify_window_id=1),
        span("stage.binary_llama_decode", 45, 48, request_id=r, stage_index=1, compute_stopped=True),  # noqa: E501
        span("stage.openai_decode_verify_window", 10, 50, request_id=r, verify_window_id=1,
             verify_window_stale=False, verify_window_cancelled=False),
        span("stage.openai_decode_verify_window", 30, 60, request_id=r, verify_window_id=2,
             verify_window_stale=True, verify_window_cancelled=False),
    ]  # fmt: skip


def test_the_timeline_splits_each_stage_into_compute_write_wait_and_stale() -> None:
    timeline = request_timeline(two_stage_request())
    assert timeline.stages == 2 and timeline.elapsed_ms == 100
    assert timeline.windows == 2 and timeline.stale_windows == 1
    stage0, stage1 = timeline.totals()
    assert stage0 == {"compute": 10, "write": 2, "wait": 78, "stale": 10}
    # stage 1's request ran from 5 to 95 ms on it; its stopped compute is stale work
    assert stage1 == {"compute": 10, "write": 0, "wait": 77, "stale": 3}
    waits = [(s.start_ms, s.end_ms) for s in timeline.segments if s.stage == 1 and s.kind == "wait"]
    assert waits == [(5, 25), (35, 45), (48, 95)]


def test_a_recovered_request_is_drawn_from_where_its_final_id_begins() -> None:
    records = two_stage_request()
    summary = records[0]
    records[0] = Record(summary.name, summary.start_ns, summary.end_ns,
                        {**summary.attributes, "llama_stage.recoveries": 1})  # fmt: skip
    stage0 = request_timeline(records).totals()[0]
    # the first record under the final id is stage 0's compute at 10 ms: no wait before it
    assert stage0 == {"compute": 10, "write": 2, "wait": 68, "stale": 10}


def test_the_timeline_picks_one_request_out_of_a_shared_trace() -> None:
    later = [
        Record(r.name, r.start_ns + 500 * MS, r.end_ns + 500 * MS, r.attributes)
        for r in two_stage_request(request_id=8)
    ]
    records = two_stage_request(request_id=7) + later
    assert request_timeline(records).request_id == 8  # the last to finish, by default
    earlier = request_timeline(records, request_id=7)
    assert earlier.request_id == 7 and earlier.totals()[0]["compute"] == 10


def shifted(records: list[Record], ms: float) -> list[Record]:
    return [Record(r.name, r.start_ns + int(ms * MS), r.end_ns + int(ms * MS), r.attributes)
            for r in records]  # fmt: skip


def three_requests() -> list[Record]:
    """7 from 0 ms; 8 from 5 ms, its spans overlapping 7's; 9 from 300 ms, overlapping none."""
    return (
        two_stage_request(request_id=7)
        + shifted(two_stage_request(request_id=8), 5)
        + shifted(two_stage_request(request_id=9), 300)
    )


def test_a_stage_is_busy_for_the_union_of_its_requests_compute_not_the_sum() -> None:
    shared = requests_timeline(three_requests())
    assert [t.request_id for t in shared.timelines] == [7, 8, 9]
    assert shared.stages == 2 and shared.elapsed_ms == 400  # from 7's start to 9's end
    # stage 0 computes 10-20 and (stale) 30-40 ms for 7, 5 ms later for 8: 15 + 15 ms
    # together, then 20 ms for 9. Summed, the spans would make 60 ms, not 50.
    # stage 1: 25-40, 45-48 and 50-53 ms, then 13 ms for 9 (summed: 39 ms).
    assert shared.busy_ms() == [50, 34]
    assert shared.busy_fractions() == [50 / 400, 34 / 400]
    # one tick computing two requests: the same spans on both, counted once
    ticked = requests_timeline(two_stage_request(request_id=7) + two_stage_request(request_id=8))
    assert ticked.busy_ms() == [20, 13]


def test_requests_share_one_origin_and_keep_their_order_and_colours() -> None:
    records = three_requests()
    shared = requests_timeline(records)
    later = shared.timelines[1]
    assert (later.request_id, later.start_ms, later.elapsed_ms) == (8, 5, 100)
    assert later.totals() == request_timeline(records, 8).totals()  # the same, moved
    alone = request_timeline(records, 8)
    assert [s.start_ms - 5 for s in later.segments] == [s.start_ms for s in alone.segments]
    # the order the requests began picks their colours, whatever the trace's or the ask's order
    colours = {7: PALETTE[0], 8: PALETTE[1], 9: PALETTE[2]}
    assert shared.colours() == colours
    again = requests_timeline(list(reversed(records)), [9, 7, 8])
    assert again == shared and again.colours() == colours
    assert requests_timeline(records, [9, 8]).colours() == {8: PALETTE[0], 9: PALETTE[1]}
    assert finished_requests(records) == [7, 8, 9]
    with pytest.raises(ValueError, match="no finished request 99"):
        requests_timeline(records, [7, 99])


def write_trace(path: pathlib.Path, records: list[Record]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return path


ONE_REQUEST_REPORT = """\
request: 0 tokens in 100.0 ms, 2 verify windows, 1 stale
stage 0: compute     10.0 ms  write     2.0 ms  wait     78.0 ms  stale    10.0 ms
stage 1: compute     10.0 ms  write     0.0 ms  wait     77.0 ms  stale     3.0 ms
"""


def test_bench_timeline_lays_out_the_requests_of_a_trace(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(write_trace(tmp_path / "trace.jsonl", three_requests()))
    base = ["bench", "timeline", "--from-trace", trace]
    assert main(base) == 0
    assert capsys.readouterr().out == ONE_REQUEST_REPORT  # the last request, as ever
    assert main([*base, "--requests", "1"]) == 0
    assert capsys.readouterr().out == ONE_REQUEST_REPORT
    assert main([*base, "--requests", "2"]) == 0
    assert capsys.readouterr().out == (
        "2 requests on 2 stages in 395.0 ms\n"
        "stage 0: busy     40.0 ms ( 10.1% of the run)\n"
        "stage 1: busy     26.0 ms (  6.6% of the run)\n"
        "request 8: 0 tokens in 100.0 ms from 0.0 ms, 2 verify windows, 1 stale\n"
        "request 9: 0 tokens in 100.0 ms from 295.0 ms, 2 verify windows, 1 stale\n"
    )
    png = tmp_path / "three.png"
    assert main([*base, "--requests", "all", "--json", "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["request_id"] for r in report["requests"]] == [7, 8, 9]
    assert [r["start_ms"] for r in report["requests"]] == [0, 5, 300]
    assert report["per_stage_busy"] == [
        {"busy_ms": 50, "busy_fraction": 0.125},
        {"busy_ms": 34, "busy_fraction": 0.085},
    ]
    width, height = png_size(png)
    assert width > 1000 and height > 400


def test_bench_timeline_refuses_request_counts_it_cannot_lay_out(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(write_trace(tmp_path / "trace.jsonl", three_requests()))
    base = ["bench", "timeline", "--from-trace", trace]
    assert main([*base, "--requests", "4"]) == 2
    assert "holds 3 finished requests, not 4" in capsys.readouterr().err
    assert main([*base, "--requests", "2", "--request-id", "7"]) == 2
    assert "either --request-id or --requests" in capsys.readouterr().err
    assert main(["bench", "timeline", "--requests", "all"]) == 2
    assert "add --from-trace" in capsys.readouterr().err
    assert main(["bench", "timeline", "--requests", "7"]) == 2
    assert "at most 6, one per prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--requests", "0"])
    assert "a count or 'all', not '0'" in capsys.readouterr().err


def test_a_trace_without_what_the_timeline_needs_says_so(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="no finished request"):
        request_timeline([])
    summary_only = two_stage_request()[:1]
    with pytest.raises(ValueError, match="debug level"):
        request_timeline(summary_only)
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"event": "x", "attributes": {}, "start_time_unix_nanos": 1, '
                   '"end_time_unix_nanos": 2}\nnot json\n')  # fmt: skip
    with pytest.raises(ValueError, match=r"trace.jsonl:2: not a telemetry record"):
        load_trace(bad)
    with pytest.raises(ValueError, match=r"cannot read the trace .*missing.jsonl: No such file"):
        load_trace(tmp_path / "missing.jsonl")


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_bench_timeline_traces_every_stage_process_into_one_png(
    tiny_model_path: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.jsonl"
    code = main(["bench", "timeline", "--model", str(tiny_model_path), "--stages", "3",
                 "--hop-delay-ms", "2", "--tokens", "16", "--png", str(png),
                 "--trace", str(trace), "--json"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "processes" and report["tokens"] == 16
    assert len(report["per_stage_ms"]) == 3
    assert all(row["compute"] + row["stale"] > 0 for row in report["per_stage_ms"])
    assert all(row["write"] > 0 for row in report["per_stage_ms"][:2])
    assert report["per_stage_ms"][2]["write"] == 0  # the last stage returns, it doesn't forward
    width, height = png_size(png)
    assert width > 1000 and height > 200
    # three processes appended whole lines to one trace, and it rebuilds the same timeline
    records = load_trace(trace)
    assert len({r.attributes["stagerun.run_id"] for r in records}) == 3
    assert request_timeline(records).totals() == report["per_stage_ms"]
    # an operator draws a request of their own trace the same way, running nothing
    redrawn = tmp_path / "redrawn.png"
    code = main(["bench", "timeline", "--from-trace", str(trace),
                 "--request-id", str(report["request_id"]), "--png", str(redrawn), "--json"])  # fmt: skip  # noqa: E501
    assert code == 0
    again = json.loads(capsys.readouterr().out)
    assert again["per_stage_ms"] == report["per_stage_ms"] and again["tokens"] == 16
    assert png_size(redrawn) == (width, height)


def test_bench_timeline_runs_requests_at_once_and_lays_out_all_of_them(
    tiny_model_path: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.jsonl"
    code = main(["bench", "timeline", "--model", str(tiny_model_path), "--stages", "3",
                 "--hop-delay-ms", "2", "--tokens", "16", "--requests", "2", "--png", str(png),
                 "--trace", str(trace), "--json"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == ["code-edit", "repeat"] and report["stages"] == 3
    requests = report["requests"]
    assert len({r["request_id"] for r in requests}) == 2
    assert [r["tokens"] for r in requests] == [16, 16]
    # they ran at once: each began before the other ended
    assert all(r["start_ms"] < min(q["start_ms"] + q["elapsed_ms"] for q in requests)
               for r in requests)  # fmt: skip
    for stage, busy in enumerate(report["per_stage_busy"]):
        summed = sum(r["per_stage_ms"][stage]["compute"] + r["per_stage_ms"][stage]["stale"]
                     for r in requests)  # fmt: skip
        rounding = 1e-3 * (2 * len(requests) + 1)  # each figure is rounded to the microsecond
        assert 0 < busy["busy_ms"] <= summed + rounding
        assert busy["busy_fraction"] == pytest.approx(busy["busy_ms"] / report["elapsed_ms"], 1e-3)
    assert png_size(png)[0] > 1000
    # the trace holds the warm-up too: the last two to finish are the two requests
    code = main(["bench", "timeline", "--from-trace", str(trace), "--requests", "2", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["requests"] == requests


def test_bench_speculative_sweeps_hop_delays_into_a_png(
    tiny_model_path: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "sweep.png"
    code = main(["bench", "speculative", "--inproc", "--model", str(tiny_model_path),
                 "--stages", "2", "--hop-delays", "0,3", "--tokens", "8", "--rounds", "1",
                 "--png", str(png), "--json"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["hop_delay_ms"] for row in report["sweep"]] == [0, 3]
    for row in report["sweep"]:
        assert set(row["tokens_per_second"]) == {"plain", "depth1", "depth4", "always_wrong"}
        assert row["identical_output"] is True
    assert png_size(png)[0] > 500


def test_without_matplotlib_a_png_is_refused_before_measuring(
    tiny_model_path: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    code = main(["bench", "timeline", "--model", str(tiny_model_path),
                 "--png", str(tmp_path / "x.png")])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "pip install 'stagerun[plot]'" in err
    assert "tracing" not in err  # nothing was started
    assert not (tmp_path / "x.png").exists()


def test_a_sweep_refuses_what_it_would_otherwise_ignore(
    tiny_model_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "speculative", "--inproc", "--model", str(tiny_model_path)]
    with pytest.raises(SystemExit):
        main([*base, "--hop-delays", "0,nan"])
    assert "hop delays must be milliseconds" in capsys.readouterr().err
    assert main([*base, "--hop-delays", "0,5", "--hop-delay-ms", "10"]) == 2
    assert "either --hop-delay-ms or --hop-delays" in capsys.readouterr().err
