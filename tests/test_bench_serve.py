"""``stagerun bench serve``: closed-loop streaming clients against a real ``stagerun serve``.

The end-to-end tests run the tiny random model (seconds); the real default model's curve is
``stagerun bench serve`` itself. The comparisons with llama-server and llama.cpp's RPC split
run the binaries ``make test`` builds (marked ``llama_cpp``: conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import struct
from typing import Any

import pytest
import trio

from stagerun._cli._bench import _serve_run
from stagerun._cli._bench._serve import (
    PROMPTS,
    StreamReader,
    cpu_seconds,
    percentile,
    plot_scaling,
    scaling_ratios,
)
from stagerun._cli._bench._servers import llama_command, serve_command, stage_pids
from stagerun._cli._main import main
from stagerun._cli._options import build_parser
from stagerun.backends._ggml import _lib

LLAMA_SERVER = pathlib.Path(__file__).parent.parent / ".cache/llama.cpp/bin/llama-server"
LEVEL_KEYS = {
    "clients", "requests", "completion_tokens", "seconds", "tokens_per_second", "ttft_p50_ms",
    "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "latency_p50_ms", "latency_p99_ms",
    "mismatches", "rejected", "busy", "scaling", "rounds_tokens_per_second",
}  # fmt: skip


def _bench(model: pathlib.Path, *extra: str) -> list[str]:
    return ["bench", "serve", "--model", str(model), "--clients", "1,2", "--tokens", "8",
            "--requests-per-client", "1", "--json", *extra]  # fmt: skip


def _check_curve(curve: dict[str, object], stages: int) -> None:
    levels = curve["levels"]
    assert isinstance(levels, list) and [row["clients"] for row in levels] == [1, 2]
    for row in levels:
        assert set(row) == LEVEL_KEYS
        assert row["requests"] == row["clients"] and row["rejected"] == 0
        assert row["completion_tokens"] >= row["requests"] and row["tokens_per_second"] > 0
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["latency_p99_ms"]
        assert len(row["busy"]) == stages
    assert curve["scaling"] == {"1": 1.0, "2": levels[1]["scaling"]}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads CPU time from /proc (Linux)")
def test_bench_serve_reports_a_curve_with_no_mismatches(
    tiny_model_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_bench(tiny_model_path)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "serve" and report["stages"] == 3
    assert report["prompts"] == 2 and report["mismatches"] == 0
    assert report["llama_server"] is None and report["ggml_library"] is None
    _check_curve(report["stagerun"], stages=3)
    assert all(row["mismatches"] == 0 for row in report["stagerun"]["levels"])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads CPU time from /proc (Linux)")
def test_a_named_ggml_build_serves_every_stage_and_the_report_says_which(
    tiny_model_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
) -> None:
    """`STAGERUN_GGML_LIBRARY` reaches the processes that compute: here it names a copy of
    the wheel's build (the one a tiny float model may run on) a byte longer, whose private
    copy, made where it is loaded, is then found in a fresh `STAGERUN_CACHE`."""
    wheel = pathlib.Path(_lib._wheel_folder())
    build = tmp_path / "build"
    build.mkdir()
    for name in ("libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0"):
        (build / name).write_bytes((wheel / name).read_bytes())
    with (build / "libggml.so.0").open("ab") as main_library:
        main_library.write(b"\0")  # a build of its own: another digest, another private copy
    named = str(build / "libggml.so.0")
    monkeypatch.setenv(_lib.LIBRARY_ENV, named)
    monkeypatch.setenv("STAGERUN_CACHE", str(tmp_path / "cache"))
    assert main(_bench(tiny_model_path, "--stages", "2")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ggml_library"] == named and report["mismatches"] == 0
    _check_curve(report["stagerun"], stages=2)
    (copy,) = (tmp_path / "cache" / "ggml").glob("*/libggmS.so.0")
    assert copy.stat().st_size == (wheel / "libggml.so.0").stat().st_size + 1


@pytest.mark.llama_cpp
def test_bench_serve_runs_the_same_load_against_llama_server(
    tiny_model_path: pathlib.Path, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    png = tmp_path / "serve.png"
    argv = _bench(tiny_model_path, "--compare-llama-server", "--llama-server", str(LLAMA_SERVER),
                  "--stages", "2", "--png", str(png), "--rounds", "2")  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    _check_curve(report["stagerun"], stages=2)
    _check_curve(report["llama_server"], stages=1)  # one process
    assert report["rounds"] == 2
    for curve in (report["stagerun"], report["llama_server"]):
        for row in curve["levels"]:
            rounds = row["rounds_tokens_per_second"]
            assert len(rounds) == 2 and row["tokens_per_second"] == min(rounds)  # lower middle
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_systems_take_turns_round_by_round_each_level_s_servers_up_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three rounds: stagerun then llama-server, then the other way round, then as first;
    every level's llama-server is started before its first round and stopped after its last,
    and the stagerun server is up throughout."""
    events: list[str] = []

    class Target:
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return self.name

        async def complete(self, prompt: int) -> None:
            events.append(f"warm {self.name}")

    @contextlib.asynccontextmanager
    async def server(name: str) -> Any:
        events.append(f"start {name}")
        yield Target(name)
        events.append(f"stop {name}")

    async def stagerun(stack: contextlib.AsyncExitStack, *args: Any) -> tuple[Any, list[str]]:
        return await stack.enter_async_context(server("stagerun")), ["solo"]

    async def llama(stack: contextlib.AsyncExitStack, args: Any, prompts: Any, clients: int,
                    *, rpc: bool) -> Any:  # fmt: skip
        return await stack.enter_async_context(server(f"llama-{clients}"))

    async def solo(target: Any) -> list[str]:
        return ["solo"]

    tps = iter([5.0, 1.0, 3.0, 2.0, 4.0, 6.0] * 2)

    async def level(args: Any, target: Any, clients: int, solo: Any) -> dict[str, Any]:
        events.append(f"measure {target}")
        return {"clients": clients, "tokens_per_second": next(tps), "mismatches": 1,
                "rejected": 0}  # fmt: skip

    for name, fake in (("_stagerun", stagerun), ("_llama", llama), ("_solo", solo),
                       ("_measure_level", level)):  # fmt: skip
        monkeypatch.setattr(_serve_run, name, fake)
    args = build_parser().parse_args(
        ["bench", "serve", "--clients", "1,4", "--rounds", "3", "--compare-llama-server"]
    )
    curves = trio.run(_serve_run.measure_systems, args, ("p",))
    assert events == [
        "start stagerun",
        "start llama-1", "measure stagerun", "measure llama-1", "measure llama-1",
        "measure stagerun", "measure stagerun", "measure llama-1", "stop llama-1",
        "start llama-4", "warm llama-4", "measure stagerun", "measure llama-4", "measure llama-4",
        "measure stagerun", "measure stagerun", "measure llama-4", "stop llama-4",
        "stop stagerun",
    ]  # fmt: skip
    ours, theirs = curves["stagerun"], curves["llama_server"]
    assert curves["llama_rpc"] is None and ours is not None and theirs is not None
    # stagerun measured 5, 2, 4 (median 4), llama-server 1, 3, 6 (median 3); mismatches add up
    assert [r["rounds_tokens_per_second"] for r in ours["levels"]] == [[5.0, 2.0, 4.0]] * 2
    assert [r["tokens_per_second"] for r in ours["levels"]] == [4.0, 4.0]
    assert [r["tokens_per_second"] for r in theirs["levels"]] == [3.0, 3.0]
    assert ours["levels"][0]["mismatches"] == 3


def test_serve_command_passes_the_options_through() -> None:
    args = build_parser().parse_args(
        ["bench", "serve", "--clients", "4,1,2,2", "--hop-delay-ms", "5", "--speculative",
         "ngram", "--window", "3", "--max-batch", "8", "--serve-arg=--max-queue=2"]
    )  # fmt: skip
    assert args.clients == [1, 2, 4]  # sorted, once each
    cmd = serve_command(args, 8123)
    assert cmd[1:5] == ["-P", "-m", "stagerun", "serve"]
    text = " ".join(cmd)
    assert "--port 8123" in text and "--stages 3" in text and "--hop-delay-ms 5" in text
    assert "--speculative ngram" in text and "--window 3" in text and "--max-batch 8" in text
    assert "--max-queue 4" in text and "--depth" not in text and "--parallel" not in text
    assert cmd[-1] == "--max-queue=2"  # last, so it wins over the bench's own


def test_llama_command_gives_every_client_a_slot() -> None:
    args = build_parser().parse_args(["bench", "serve", "--compare-llama-server"])
    cmd = llama_command(args, pathlib.Path("m.gguf"), 4, 9000)
    assert cmd[0].endswith("llama-server")
    pairs = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert pairs == {"-m": "m.gguf", "-np": "4", "-c": "2048", "--host": "127.0.0.1",
                     "--port": "9000", "-t": "2"}  # fmt: skip


@pytest.mark.parametrize("bad", ["", "0,1", "1,x"])
def test_client_counts_must_be_positive_integers(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--clients", bad])
    assert "client counts" in capsys.readouterr().err


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


def test_scaling_ratios_are_over_the_smallest_client_count() -> None:
    assert scaling_ratios({}) == {}
    assert scaling_ratios({4: 30.0, 1: 10.0, 2: 18.0}) == {1: 1.0, 2: 1.8, 4: 3.0}
    assert scaling_ratios({2: 0.0, 4: 5.0}) == {2: 0.0, 4: 0.0}


def test_stream_reader_takes_events_one_byte_at_a_time() -> None:
    events = [
        {"choices": [{"index": 0, "text": "Once", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": " upon", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    reader = StreamReader(started=10.0)
    for i, byte in enumerate(body + b"data: [DONE]\n\n"):
        reader.receive_data(bytes([byte]), 10.0 + i / 1000)
    assert reader.done
    sample = reader.finish(prompt=1, now=11.0)
    assert sample.text == "Once upon" and sample.tokens == 3 and sample.prompt == 1
    assert 0 < sample.ttft_s < sample.latency_s == 1.0
    assert len(sample.gaps_s) == 1 and sample.gaps_s[0] > 0


def test_stream_reader_counts_chunks_without_usage_and_raises_on_errors() -> None:
    reader = StreamReader(started=0.0)
    for n, text in enumerate(["a", "b", "c"]):
        reader.receive_line(f'data: {{"choices": [{{"text": "{text}"}}]}}', float(n + 1))
    assert reader.finish(prompt=0, now=4.0).tokens == 3
    with pytest.raises(Exception, match="failed a streamed request"):
        reader.receive_line('data: {"error": {"message": "stage 1 died"}}', 5.0)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_cpu_time_and_stage_processes_come_from_proc() -> None:
    sum(i * i for i in range(200_000))  # some CPU time of our own
    seconds = cpu_seconds(os.getpid())
    assert seconds is not None and seconds > 0
    assert cpu_seconds(2**22 + 12345) is None  # above pid_max: no such process
    assert stage_pids(os.getpid()) == [os.getpid()]  # no stage children


def test_prompts_are_distinct_open_continuations() -> None:
    assert len(set(PROMPTS)) == len(PROMPTS) >= 16
    assert not any(p.rstrip().endswith(".") for p in PROMPTS)


def test_plot_scaling_draws_both_curves_into_a_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")

    def curve(rates: list[float]) -> dict[str, object]:
        return {"levels": [{"clients": n, "tokens_per_second": r} for n, r in zip(
            [1, 2, 4], rates, strict=True)]}  # fmt: skip

    report = {"model": "tiny", "stages": 3, "tokens": 8, "clients": [1, 2, 4],
              "stagerun": curve([10.0, 18.0, 30.0]), "llama_server": curve([50.0, 90.0, 160.0])}  # fmt: skip  # noqa: E501
    path = tmp_path / "scaling.png"
    plot_scaling(report, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (840, 540)  # 7 x 4.5 inches at 120 dpi


def test_options_serve_lacks_are_found_before_anything_starts() -> None:
    from stagerun._cli._bench._servers import serve_accepts as _serve_accepts

    assert _serve_accepts("--stages") and _serve_accepts("--max-queue")
    assert not _serve_accepts("--no-such-option")


def test_level_report_counts_outputs_that_differ_from_the_solo_run() -> None:
    from stagerun._cli._bench._serve import Sample, level_report

    samples = [
        Sample(prompt=0, text="a b", tokens=2, ttft_s=0.1, gaps_s=(0.05,), latency_s=0.2),
        Sample(prompt=1, text="c X", tokens=2, ttft_s=0.3, gaps_s=(0.07,), latency_s=0.4),
    ]
    totals = {"seconds": 0.5, "busy": [0.5, None], "rejected": 0}
    row = level_report(2, samples, totals, solo=["a b", "c d"])
    assert row["mismatches"] == 1 and row["completion_tokens"] == 4
    assert row["tokens_per_second"] == 8.0 and row["busy"] == [0.5, None]
    assert row["ttft_p50_ms"] == pytest.approx(200.0) and row["itl_p99_ms"] == pytest.approx(69.8)


@pytest.mark.llama_cpp
def test_bench_serve_runs_the_same_load_against_llama_cpp_s_rpc_split(
    tiny_model_path: pathlib.Path, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    """make test builds llama.cpp with RPC (scripts/build.sh): two devices behind delaying
    proxies serve the same load, and the PNG has its curve."""
    png = tmp_path / "serve.png"
    argv = _bench(tiny_model_path, "--compare-rpc", "--stages", "2", "--hop-delay-ms", "2",
                  "--png", str(png))  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    _check_curve(report["stagerun"], stages=2)
    rpc = report["llama_rpc"]
    assert [row["clients"] for row in rpc["levels"]] == [1, 2]
    assert all(row["tokens_per_second"] > 0 and row["rejected"] == 0 for row in rpc["levels"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
