"""Stage 0's batch sizes and every stage's busy fraction, in /metrics and /health.

The histogram is built from the batcher's Counter at scrape time; the busy fractions come
from `BusySampler` (stage 0's busy seconds, a stage process's CPU time from ``/proc``), here
on a fake clock first, then from a real 3-stage pipeline of processes behind the HTTP app.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from _served_app import served_app

from stagerun import open_pipeline
from stagerun._driver._config import SupervisionPolicy
from stagerun._driver._supervise import StageProcess, running_pids
from stagerun._driver._values import StageInfo
from stagerun.server._metrics import BATCH_BUCKETS, BusySampler, Histogram, cpu_seconds

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_the_batch_size_histogram_from_a_counter_is_cumulative() -> None:
    sizes = collections.Counter({1: 3, 3: 2, 100: 1})
    lines = Histogram.from_counts(sizes, BATCH_BUCKETS).lines("h", "Items per tick.")
    assert lines == [
        "# HELP h Items per tick.",
        "# TYPE h histogram",
        'h_bucket{le="1"} 3',
        'h_bucket{le="2"} 3',
        'h_bucket{le="4"} 5',
        'h_bucket{le="8"} 5',
        'h_bucket{le="16"} 5',
        'h_bucket{le="32"} 5',
        'h_bucket{le="64"} 5',
        'h_bucket{le="+Inf"} 6',
        "h_sum 109",
        "h_count 6",
    ]


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_reads_this_process_from_proc() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc here")
    before = cpu_seconds(os.getpid())
    assert before is not None and before >= 0
    times = os.times()
    assert abs(before - (times.user + times.system)) < 0.1  # the utime and stime fields
    _burn(0.3)
    after = cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.2
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert cpu_seconds(pid_max + 1) is None


def _process(index: int, pid: int, state: Any = "running") -> StageProcess:
    process = StageProcess(index, ["stage"], "127.0.0.1:0", SupervisionPolicy())
    process.pid, process.state = pid, state
    return process


def test_busy_fractions_cover_the_time_since_the_previous_sample() -> None:
    now = [100.0]
    cpu = {41: 5.0, 42: 1.0}
    batcher = SimpleNamespace(busy_seconds=2.0)
    stage1, stage2 = _process(1, 41), _process(2, 42)
    stages = [
        StageInfo(0, (0, 2), None),
        StageInfo(1, (2, 4), "127.0.0.1:1", 41, process=stage1),
        StageInfo(2, (4, 6), "127.0.0.1:2", 42, process=stage2),
        StageInfo(3, (6, 8), "127.0.0.1:3", os.getpid()),  # inproc: no process of its own
    ]
    pipeline: Any = SimpleNamespace(batcher=batcher, stages=stages)
    sampler = BusySampler(pipeline, clock=lambda: now[0], cpu=cpu.get)
    assert running_pids(stages) == {1: 41, 2: 42}
    now[0], batcher.busy_seconds, cpu[41], cpu[42] = 104.0, 3.0, 7.0, 9.0
    assert sampler.sample() == {0: 0.25, 1: 0.5, 2: 2.0}  # stage 2 on two threads
    now[0], batcher.busy_seconds = 106.0, 6.0  # a long tick ended in this window
    stage1.state = "restarting"
    assert sampler.sample() == {0: 1.0, 2: 0.0}
    now[0], cpu[43] = 110.0, 1.0
    stage1.pid, stage1.state = 43, "running"  # restarted: all of its CPU is in this window
    assert sampler.sample() == {0: 0.0, 1: 0.25, 2: 0.0}
    now[0], cpu[44], stage2.pid = 112.0, 1.0, 44  # restarted between two samples
    assert sampler.sample() == {0: 0.0, 1: 0.0, 2: 0.5}
    del cpu[44]  # gone from /proc
    now[0] = 113.0
    assert sampler.sample() == {0: 0.0, 1: 0.0}


@asynccontextmanager
async def http_server(pipeline: Any) -> AsyncIterator[str]:
    async with served_app(pipeline) as url:
        yield url


def _samples(text: str) -> dict[str, float]:
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


async def test_metrics_and_health_show_batches_and_busy_stages(tiny_model_path: Path) -> None:
    async with (
        open_pipeline(tiny_model_path, stages=3, mode="processes", capacity=2) as pipeline,
        http_server(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                body = {**CHAT, "max_tokens": 8}
                nursery.start_soon(
                    functools.partial(client.post, "/v1/chat/completions", json=body)
                )
        samples = _samples((await client.get("/metrics")).text)
        ticks = pipeline.batcher.ticks
        assert ticks > 0
        assert samples["stagerun_stage0_ticks_total"] == ticks
        assert samples["stagerun_stage0_rows_total"] == pipeline.batcher.rows
        assert samples["stagerun_stage0_batch_size_count"] == ticks
        assert samples['stagerun_stage0_batch_size_bucket{le="+Inf"}'] == ticks
        assert samples["stagerun_stage0_batch_size_sum"] == pipeline.batcher.items
        for stage in range(3):
            assert samples[f'stagerun_stage_busy_ratio{{stage="{stage}"}}'] >= 0
        health = (await client.get("/health")).json()
        stage0, stage1, stage2 = health["stages"]
        assert stage0["batch"] == {
            "ticks": ticks,
            "mean_items_per_tick": round(pipeline.batcher.items / ticks, 3),
        }
        assert 0 <= stage0["busy"] <= 1
        assert stage1["busy"] >= 0 and stage2["busy"] >= 0
        assert "batch" not in stage1
        assert stage1["pid"] == running_pids(pipeline.stages)[1]
