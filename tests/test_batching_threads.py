"""The tick batcher's threads and upkeep: which thread a tick computes on (quick ticks on the
event loop's), a compute that shows no progress, freed memory given back, no cycles left.

Split from test_batching.py, whose `Recorder` and `_item` these tests share.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from test_batching import Recorder, _item

from stagerun._engine._batcher import TickBatcher
from stagerun.abc import ForwardItem
from stagerun.backends import GgmlBackend, NumpyBackend
from stagerun.testing import write_tiny_model


async def test_ticks_give_freed_memory_back_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagerun._engine import _batcher

    calls: list[float] = []
    monkeypatch.setattr(_batcher, "release_free_memory", lambda: calls.append(1.0))
    monkeypatch.setattr(_batcher, "TRIM_SECONDS", 0.0)
    batcher = TickBatcher(Recorder(), inline_seconds=0.0)  # every tick in a worker thread
    await batcher.forward(_item(1))
    await batcher.forward(_item(1))
    assert len(calls) == 2
    monkeypatch.setattr(_batcher, "TRIM_SECONDS", 3600.0)
    await batcher.forward(_item(1))
    assert len(calls) == 2  # rate-limited
    monkeypatch.setattr(_batcher, "TRIM_SECONDS", 0.0)
    inline = TickBatcher(Recorder())
    for _ in range(3):
        await inline.forward(_item(1))
    assert inline.inline_ticks == 2
    assert len(calls) == 3  # the first tick's thread trims; the loop never does


class ThreadRecorder(Recorder):
    """A `Recorder` that also notes the thread each tick ran on."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.threads: list[bool] = []  # True: the Trio thread

    def forward_batch(self, items: list[ForwardItem]) -> list[Any]:
        self.threads.append(threading.current_thread() is threading.main_thread())
        return super().forward_batch(items)


async def test_quick_ticks_of_one_small_forward_run_on_the_trio_thread() -> None:
    backend = ThreadRecorder()
    batcher = TickBatcher(backend, inline_seconds=0.05)
    for rows in (1, 1, 8, 8, 9):  # each size is measured once in a thread
        await batcher.forward(_item(rows))
    await batcher.forward(_item(1), prefill=True)
    async with trio.open_nursery() as nursery:  # two sessions in one tick
        for _ in range(2):
            nursery.start_soon(batcher.forward, _item(1))
    # 9 rows, a prefill chunk and two sessions are not small
    assert backend.threads == [False, True, False, True, False, False, False]
    assert batcher.inline_ticks == 2 and backend.calls[-1] == [1, 1]
    off = ThreadRecorder()
    unbounded = TickBatcher(off, inline_seconds=0.0)
    for _ in range(3):
        await unbounded.forward(_item(1))
    assert off.threads == [False] * 3


async def test_an_inline_tick_waits_for_the_loop_to_run_what_is_ready() -> None:
    # Stage 0's token reaches its client through several tasks: an inline tick that held the
    # loop before they ran would write every token one step late. And a loop that stays busy
    # gets no inline tick at all: it goes to a worker thread.
    backend = ThreadRecorder()
    batcher = TickBatcher(backend, inline_seconds=0.05)
    await batcher.forward(_item(1))  # measures, in a thread
    hops: list[int] = []
    seen_at_compute: list[int] = []
    inner = backend.forward_batch

    def forward_batch(items: list[ForwardItem]) -> list[Any]:
        seen_at_compute.append(len(hops))
        return inner(items)

    backend.forward_batch = forward_batch  # type: ignore[method-assign]

    async def relay(hops_left: int) -> None:  # a token handed from task to task
        for _ in range(hops_left):
            await trio.lowlevel.checkpoint()
            hops.append(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay, 6)
        await batcher.forward(_item(1))
    assert seen_at_compute == [6] and backend.threads[-1] is True

    async def spin(seconds: float) -> None:  # never blocked for long
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spin, 0.05)
        await trio.lowlevel.checkpoint()
        await batcher.forward(_item(1))
    assert backend.threads[-1] is False and batcher.inline_ticks == 1


async def test_a_tick_that_shows_no_progress_is_stalled_and_one_that_does_is_not() -> None:
    # Progress is the tick's start and each layer boundary (the backend asks should_stop);
    # a stage server refuses handshakes past STALL_SECONDS of none (test_hostile_lane.py).
    gate = threading.Event()

    class Hung(Recorder):
        def forward_batch(self, items: list[ForwardItem]) -> list[Any]:
            if self.delay:  # a backend that reaches a layer boundary every 20 ms
                for _ in range(int(self.delay / 0.02)):
                    threading.Event().wait(0.02)
                    assert all(item.should_stop is not None for item in items)
                    for item in items:
                        item.should_stop()  # type: ignore[misc]
            else:
                gate.wait(10)
            return super().forward_batch(items)

    backend = Hung()
    batcher = TickBatcher(backend, inline_seconds=0.0)
    assert batcher.stalled_for() == 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.forward, _item(1))
        await trio.sleep(0.3)
        assert 0.25 < batcher.stalled_for() < 5
        assert batcher.stalled_for(now=time.perf_counter() + 100) > 100
        gate.set()
    assert batcher.stalled_for() == 0.0
    backend.delay = 0.6  # a long tick, but one that moves
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.forward, _item(1))
        await trio.sleep(0.4)
        assert batcher.stalled_for() < 0.2


async def test_a_lone_sessions_decode_step_holds_the_loop_for_longer() -> None:
    # Over inline_seconds, a decode step still runs on the Trio thread while its session is
    # the only one the stage serves (up to LONE_INLINE_SECONDS): not a verify window of one
    # row, not beside another session (one that only prefilled counts), not once it takes
    # longer than that, and never with inline_seconds 0.
    backend = ThreadRecorder(delay=0.02)
    batcher = TickBatcher(backend, inline_seconds=0.005)
    mine, other = object(), object()

    def step(cache: object) -> ForwardItem:
        return ForwardItem(cache, 0, hidden=np.ones((1, 4), np.float32))

    await batcher.forward(step(mine))  # measured in a thread
    await batcher.forward(step(mine))
    await batcher.forward(step(mine), window=True)
    await batcher.forward(step(other), prefill=True)
    await batcher.forward(step(mine))  # two sessions served
    batcher.forget(other)
    await batcher.forward(step(mine))
    backend.delay = 0.08  # over the bound: this one inline, the next in a thread
    await batcher.forward(step(mine))
    await batcher.forward(step(mine))
    assert backend.threads == [False, True, False, False, False, True, True, False]
    assert batcher.inline_ticks == 3
    off = ThreadRecorder(delay=0.02)
    never = TickBatcher(off, inline_seconds=0.0)
    for _ in range(3):
        await never.forward(step(mine))
    assert off.threads == [False] * 3


async def test_ticks_that_turn_slow_go_back_to_a_worker_thread() -> None:
    backend = ThreadRecorder()
    batcher = TickBatcher(backend, inline_seconds=0.02)
    await batcher.forward(_item(1))
    await batcher.forward(_item(1))
    backend.delay = 0.1  # over the bound: the very next tick of its size goes to a thread
    await batcher.forward(_item(1))
    await batcher.forward(_item(1))
    assert backend.threads == [False, True, True, False]
    await batcher.forward(_item(2))  # another size has its own estimate: measured first
    assert backend.threads[-1] is False
    backend.delay = 0.0  # quick again: the estimate falls back under the bound in time
    for _ in range(12):
        await batcher.forward(_item(1))
    assert backend.threads[5:7] == [False, False] and backend.threads[-1] is True
    with pytest.raises(ValueError, match="inline_seconds"):
        TickBatcher(backend, inline_seconds=-1.0)


async def test_a_quiet_spell_after_a_session_ends_gives_freed_memory_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An idle server runs no tick that would trim: after a session's end, the batcher trims
    # once no tick has run for IDLE_TRIM_SECONDS (not while other sessions still compute).
    from stagerun._engine import _batcher

    calls: list[float] = []
    trimmed = threading.Event()

    def trim() -> None:
        calls.append(time.perf_counter())
        trimmed.set()

    monkeypatch.setattr(_batcher, "release_free_memory", trim)
    monkeypatch.setattr(_batcher, "TRIM_SECONDS", 3600.0)
    monkeypatch.setattr(_batcher, "IDLE_TRIM_SECONDS", 0.3)
    batcher = TickBatcher(Recorder())
    ended, going_on = _item(1), _item(1)
    await batcher.forward(ended)
    batcher.forget(ended.cache)
    busy_until = time.perf_counter() + 1.0
    while time.perf_counter() < busy_until:
        await batcher.forward(going_on)
        await trio.sleep(0.02)
    assert calls == []  # ticks went on
    last_tick = time.perf_counter()
    assert await trio.to_thread.run_sync(trimmed.wait, 5.0)
    assert len(calls) == 1 and calls[0] - last_tick >= 0.3
    # nor while a long tick computes, however long no other tick starts
    monkeypatch.setattr(_batcher, "IDLE_TRIM_SECONDS", 0.05)
    slow = TickBatcher(Recorder(delay=0.5))
    slow.forget(object())
    trimmed.clear()
    await slow.forward(_item(1))
    ended = time.perf_counter()
    assert await trio.to_thread.run_sync(trimmed.wait, 5.0)
    assert len(calls) == 2 and calls[1] >= ended


async def test_a_quiet_spell_also_has_the_backend_release_what_ended_sessions_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The ggml backend keeps an ended session's KV slot in memory till asked (its pages
    # would otherwise be freed on the event loop and faulted in again by the next session).
    from stagerun._engine import _batcher

    order: list[str] = []
    done = threading.Event()

    class Releasing(Recorder):
        def release_memory(self) -> int:
            order.append("backend")
            return 0

    def trim() -> None:
        order.append("heap")
        done.set()

    monkeypatch.setattr(_batcher, "release_free_memory", trim)
    monkeypatch.setattr(_batcher, "IDLE_TRIM_SECONDS", 0.05)
    batcher = TickBatcher(Releasing())
    ended = _item(1)
    await batcher.forward(ended)
    batcher.forget(ended.cache)
    assert await trio.to_thread.run_sync(done.wait, 5.0)
    assert order == ["backend", "heap"]


async def test_a_finished_forward_leaves_no_cycle_behind() -> None:
    # A job's item once stopped through a closure over the job: job -> item -> closure -> job,
    # so every finished forward's cache and output (a last stage's logits, 1 MiB a row) waited
    # for the cycle collector, which an idle server does not run: Gemma 3's held 35 MiB.
    class Cache:
        pass

    batcher = TickBatcher(Recorder())
    cache = Cache()
    gc.disable()
    try:
        out = await batcher.forward(ForwardItem(cache, 0, hidden=np.ones((1, 4), np.float32)))
        refs = [weakref.ref(cache), weakref.ref(out)]
        del cache, out
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_a_session_forgotten_outside_a_trio_run_leaves_the_trims_working() -> None:
    batcher = TickBatcher(Recorder())
    batcher.forget(object())  # nothing to wait in: no trim, and no flag left set
    assert not batcher._trimming


def test_releasing_free_memory_finds_glibc_here() -> None:
    from stagerun import _util

    _util.release_free_memory()  # glibc's malloc_trim on Linux; nothing elsewhere
    _util.release_free_memory()
    assert _util._libc, "malloc_trim was not found: stage memory would only grow"


def test_stage0_gathers_one_group_on_numpy_and_two_on_ggml(tmp_path: Path) -> None:
    from stagerun._driver._pipeline import gather_groups
    from stagerun.model import open_model

    model = open_model(write_tiny_model(tmp_path / "m.gguf"))
    assert gather_groups(NumpyBackend(model)) == 1  # one weight read per step for all
    assert gather_groups(GgmlBackend(model, threads=1)) == 2  # two groups keep stages busy
