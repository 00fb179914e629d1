"""Batching: which forwards share a tick, the tick batcher, and batch invariance.

The invariance property: whatever else a stage computes beside it -- other sessions arriving
at any time, with prompts of any length, plain decode steps or verify windows, windows
cancelled part-way -- a session's outputs are bitwise the ones it gets alone.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings

from stagerun import ComputeCancelled
from stagerun._decide._ticks import Waiting, choose_tick
from stagerun._engine._batcher import TickBatcher, TickInfo
from stagerun.abc import ForwardItem, run_batch
from stagerun.backends import GgmlBackend, NumpyBackend, _kernels, _numpy
from stagerun.testing import write_tiny_model

# ---------------------------------------------------------------------------------------------
# choose_tick: a pure decision


def W(rows: int, prefill: bool = False, session: object = None) -> Waiting:
    return Waiting(rows, prefill, session if session is not None else object())


def test_a_tick_takes_everything_that_fits_decode_before_prefill() -> None:
    waiting = [W(1), W(64, prefill=True), W(1), W(5), W(300, prefill=True)]
    assert choose_tick(waiting, budget=100) == [0, 1, 2, 3]
    assert choose_tick(waiting, budget=10) == [0, 2, 3]  # the prompts wait, the streams go


def test_the_oldest_forward_always_goes_even_over_the_budget() -> None:
    assert choose_tick([W(700, prefill=True), W(1), W(1)], budget=512) == [0]
    assert choose_tick([W(700, prefill=True), W(1)], budget=701) == [0, 1]
    assert choose_tick([], budget=4) == []
    with pytest.raises(ValueError, match="at least 1"):
        choose_tick([W(1)], budget=0)


def test_a_session_has_one_forward_per_tick_and_keeps_its_order() -> None:
    a, b = object(), object()
    # a's decode step (index 2) must not overtake a's prefill chunk (index 1) left out
    waiting = [W(400, True, b), W(200, True, a), W(1, False, a), W(1, False, b)]
    assert choose_tick(waiting, budget=512) == [0]


# ---------------------------------------------------------------------------------------------
# TickBatcher, on a backend that records what each tick computes


class Recorder:
    """A last-stage backend whose output is the item's rows times 2; it records each call."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[list[int]] = []
        self.delay = delay
        self.lock = threading.Lock()

    def forward(self, cache: Any, position: int, **kw: Any) -> Any:
        return self.forward_batch([ForwardItem(cache, position, **kw)])[0]

    def forward_batch(self, items: list[ForwardItem]) -> list[Any]:
        with self.lock:
            self.calls.append([len(np.asarray(i.hidden)) for i in items])
        if any(np.asarray(i.hidden).shape[1] != 4 for i in items):
            raise ValueError("activations of the wrong width")
        if self.delay:
            threading.Event().wait(self.delay)
        results: list[Any] = []
        for item in items:
            if item.should_stop is not None and item.should_stop():
                results.append(ComputeCancelled("stopped"))
            else:
                results.append(np.asarray(item.hidden, np.float32) * 2)
        return results


def _item(rows: int, width: int = 4, **kw: Any) -> ForwardItem:
    return ForwardItem(object(), 0, hidden=np.ones((rows, width), np.float32), **kw)


async def test_forwards_that_wait_together_share_one_tick() -> None:
    backend = Recorder(delay=0.05)
    batcher = TickBatcher(backend)
    outputs: list[Any] = []
    ticks: dict[int, TickInfo] = {}

    async def one(rows: int) -> None:
        ticks[rows] = TickInfo()
        outputs.append(await batcher.forward(_item(rows), tick=ticks[rows]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 1)
        await trio.sleep(0.01)  # the first tick is running: the rest wait for the next
        for rows in (2, 3, 4):
            nursery.start_soon(one, rows)
    assert [sorted(c) for c in backend.calls] == [[1], [2, 3, 4]]
    assert sorted(o.shape[0] for o in outputs) == [1, 2, 3, 4]
    assert batcher.ticks == 2 and batcher.items == 4 and batcher.rows == 10
    assert batcher.batch_sizes == {1: 1, 3: 1}
    # each forward learns its own tick: the wait for it is not part of its time
    assert [ticks[r].batch for r in (1, 2, 3, 4)] == [1, 3, 3, 3]
    assert ticks[2] == ticks[3] == ticks[4] and ticks[2].started >= ticks[1].started + 0.05
    assert all(0.05 <= t.seconds < 0.5 for t in ticks.values())


async def test_max_items_one_turns_batching_off() -> None:
    backend = Recorder(delay=0.02)
    batcher = TickBatcher(backend, max_items=1)
    async with trio.open_nursery() as nursery:
        for rows in (1, 2, 3):
            nursery.start_soon(batcher.forward, _item(rows))
    assert sorted(map(len, backend.calls)) == [1, 1, 1]


async def test_a_stale_forward_is_dropped_before_its_tick_and_a_faulty_one_fails_alone() -> None:
    backend = Recorder(delay=0.05)
    batcher = TickBatcher(backend)
    results: dict[str, Any] = {}

    async def one(name: str, item: ForwardItem, stale: Any = None) -> None:
        try:
            results[name] = await batcher.forward(item, stale=stale)
        except Exception as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first", _item(1))
        await trio.sleep(0.01)
        nursery.start_soon(one, "stale", _item(2), lambda: True)
        nursery.start_soon(one, "wide", _item(2, width=5))
        nursery.start_soon(one, "honest", _item(3))
    assert isinstance(results["stale"], ComputeCancelled)
    assert isinstance(results["wide"], ValueError)
    assert results["honest"].shape == (3, 4) and results["first"].shape == (1, 4)
    # the stale one never reached the backend; the failed batch was run again item by item
    assert [sorted(c) for c in backend.calls[:2]] == [[1], [2, 3]]
    assert sorted(backend.calls[2:]) == [[2], [3]]


@pytest.mark.parametrize("gather", [1, None])
async def test_stage0_gathers_the_decoding_sessions_into_one_tick(gather: int | None) -> None:
    backend = Recorder(delay=0.02)
    batcher = TickBatcher(backend, gather=gather)
    a, b = _item(1), _item(1)
    await batcher.forward(a)  # each decodes once, apart: they are the decoding sessions
    await batcher.forward(b)
    backend.calls.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.forward, attrs.evolve(a))  # a's next step (its cache)
        await trio.sleep(0.01)  # b's comes later: with gather, a's tick waits for it
        nursery.start_soon(batcher.forward, attrs.evolve(b))
    assert backend.calls == ([[1, 1]] if gather else [[1], [1]])
    # a prefill chunk never waits: prompts are not what ticks gather
    backend.calls.clear()
    with trio.fail_after(0.05):
        await batcher.forward(_item(3), prefill=True)
    assert backend.calls == [[3]]


@pytest.mark.parametrize("forget", [True, False])
async def test_a_tick_does_not_gather_for_a_session_that_ended(forget: bool) -> None:
    backend = Recorder(delay=0.02)
    batcher = TickBatcher(backend, gather=1)
    ended, new = _item(1), _item(1)
    await batcher.forward(ended)
    await batcher.forward(new)
    if forget:
        batcher.forget(ended.cache)  # its request finished: nobody waits for its next step
    batcher.gathered_seconds = 0.0
    await batcher.forward(attrs.evolve(new))
    if forget:
        assert batcher.gathered_seconds == 0.0
    else:  # what this guards against: the tick waits ~3 ticks' time for a ghost
        assert batcher.gathered_seconds > 0.04


async def test_a_forward_cancelled_while_waiting_leaves_the_line() -> None:
    backend = Recorder(delay=0.05)
    batcher = TickBatcher(backend)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.forward, _item(1))
        await trio.sleep(0.01)
        with trio.move_on_after(0.01):
            await batcher.forward(_item(7))
        assert batcher.waiting == 0
    assert backend.calls == [[1]]


# ---------------------------------------------------------------------------------------------
# Batch invariance through the numpy backend


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model's widths (so the row blocks of every product are crossed), 2 layers."""
    return write_tiny_model(
        tmp_path_factory.mktemp("wide") / "wide.gguf",
        n_layers=2,
        d_model=576,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
    )


def _pair(kind: str, model: Path) -> tuple[Any, Any]:
    if kind == "numpy":
        return NumpyBackend(model, (0, 1)), NumpyBackend(model, (1, 2))
    if kind == "ggml":
        return GgmlBackend(model, (0, 1), threads=2), GgmlBackend(model, (1, 2), threads=2)
    from stagerun_torch import TorchBackend, TorchInt4Backend

    cls = TorchBackend if kind == "torch" else TorchInt4Backend
    return cls(model, (0, 1)), cls(model, (1, 2))


@pytest.fixture(scope="module")
def wide_q4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`wide_model` with Q4_0 block matrices, for the int4 backend."""
    return write_tiny_model(
        tmp_path_factory.mktemp("wide4") / "wide4.gguf",
        n_layers=2,
        d_model=576,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        weights="Q4_0",
    )


@pytest.fixture(scope="module", params=["numpy", "torch", "torch-int4", "ggml"])
def backends(
    wide_model: Path, wide_q4_model: Path, request: pytest.FixtureRequest
) -> tuple[Any, Any]:
    # ggml on quantized blocks: its products on Q8 activations are the ones to check
    model = wide_q4_model if request.param in ("torch-int4", "ggml") else wide_model
    return _pair(request.param, model)


@pytest.fixture(scope="module")
def numpy_backends(wide_model: Path) -> tuple[NumpyBackend, NumpyBackend]:
    first, last = _pair("numpy", wide_model)
    return first, last


@attrs.frozen
class Step:
    """One forward of a session: ``rows`` new positions; a verify window keeps ``keep``."""

    rows: int
    window: bool = False
    keep: int = 0  # a window's rows the session keeps (the rest are rejected: trimmed)
    stop_after: int | None = None  # a cancelled window: polls that say go on


@attrs.frozen
class Script:
    arrive: float
    prompt: int
    steps: tuple[Step, ...]
    seed: int


step = st.one_of(
    st.builds(Step, rows=st.just(1)),
    st.builds(
        Step,
        rows=st.integers(2, 12),
        window=st.just(True),
        keep=st.integers(0, 12),
        stop_after=st.one_of(st.none(), st.integers(0, 1)),
    ),
)
script = st.builds(
    Script,
    arrive=st.floats(0, 0.02),
    prompt=st.integers(1, 70),
    steps=st.lists(step, min_size=1, max_size=5).map(tuple),
    seed=st.integers(0, 2**16),
)


def _rows(backend: Any, seed: int, n: int, start: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng([seed, start])
    return rng.integers(0, backend.vocab_size, size=n)


class Session:
    """Runs a script through two stages; records each forward's output."""

    def __init__(self, s: Script, backends: tuple[Any, Any]) -> None:
        self.script = s
        self.backends = backends
        self.caches = [b.new_cache() for b in backends]
        self.outputs: list[Any] = []

    def forwards(self) -> list[tuple[int, np.ndarray[Any, Any], str, Step | None]]:
        """``(position, token ids, logits, step)`` of every forward, in order."""
        first, _ = self.backends
        planned = [(0, _rows(first, self.script.seed, self.script.prompt, 0), "last", None)]
        position = self.script.prompt
        for s in self.script.steps:
            planned.append((position, _rows(first, self.script.seed, s.rows, position),
                            "all" if s.window else "last", s))  # fmt: skip
            position += min(s.keep, s.rows) if s.window else s.rows
            if s.window and s.stop_after is not None:
                position -= min(s.keep, s.rows)  # a stopped window keeps nothing
        return planned

    @staticmethod
    def stop(s: Step | None) -> Any:
        if s is None or s.stop_after is None:
            return None
        polls = iter(range(10_000))
        limit = s.stop_after
        return lambda: next(polls) >= limit

    def end_of(self, position: int, s: Step | None) -> int:
        if s is None or not s.window:
            return -1  # nothing to trim
        return position + (0 if s.stop_after is not None else min(s.keep, s.rows))


def _solo(session: Session) -> list[Any]:
    out: list[Any] = []
    for position, ids, logits, s in session.forwards():
        hidden: Any = ids
        stop = Session.stop(s)  # polled by both stages: it can stop the window in either
        for k, (backend, cache) in enumerate(zip(session.backends, session.caches, strict=True)):
            item = ForwardItem(cache, position, logits=logits, should_stop=stop,
                               **({"tokens": hidden} if k == 0 else {"hidden": hidden}))  # fmt: skip  # noqa: E501
            (hidden,) = run_batch(backend, [item])
            if isinstance(hidden, ComputeCancelled):
                break
        out.append(None if isinstance(hidden, ComputeCancelled) else hidden)
        for cache in session.caches:
            if session.end_of(position, s) >= 0:
                cache.trim(session.end_of(position, s))
    return out


async def _batched(sessions: list[Session]) -> None:
    batchers = [TickBatcher(b) for b in sessions[0].backends]

    async def run(session: Session) -> None:
        await trio.sleep(session.script.arrive)
        for position, ids, logits, s in session.forwards():
            hidden: Any = ids
            stop = Session.stop(s)
            for k, (sched, cache) in enumerate(zip(batchers, session.caches, strict=True)):
                item = ForwardItem(cache, position, logits=logits, should_stop=stop,
                                   **({"tokens": hidden} if k == 0 else {"hidden": hidden}))  # fmt: skip  # noqa: E501
                try:
                    hidden = await sched.forward(item, prefill=s is None)
                except ComputeCancelled:
                    hidden = None
                    break
            session.outputs.append(hidden)
            if session.end_of(position, s) >= 0:
                for cache in session.caches:
                    cache.trim(session.end_of(position, s))

    async with trio.open_nursery() as nursery:
        for session in sessions:
            nursery.start_soon(run, session)
    assert sum(batchers[0].batch_sizes.values()) == batchers[0].ticks


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scripts=st.lists(script, min_size=2, max_size=6))
def test_every_session_computes_bitwise_what_it_computes_alone(
    scripts: list[Script], backends: tuple[Any, Any]
) -> None:
    alone = [_solo(Session(s, backends)) for s in scripts]
    together = [Session(s, backends) for s in scripts]
    trio.run(_batched, together)
    for k, (solo, session) in enumerate(zip(alone, together, strict=True)):
        assert len(solo) == len(session.outputs)
        for j, (a, b) in enumerate(zip(solo, session.outputs, strict=True)):
            assert (a is None) == (b is None), (k, j)
            if a is not None:
                assert np.array_equal(a, b), (k, j, float(np.abs(a - b).max()))


def test_batches_really_form_and_the_oracle_can_tell_sessions_apart(
    backends: tuple[Any, Any],
) -> None:
    """Without batches the property is empty; and different sessions' logits must differ."""
    scripts = [Script(0.0, 5 + k, (Step(1), Step(1), Step(4, True, 2)), seed=k) for k in range(4)]
    sessions = [Session(s, backends) for s in scripts]
    batchers: list[TickBatcher] = []
    original = TickBatcher.__init__

    def spy(self: TickBatcher, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        batchers.append(self)

    TickBatcher.__init__ = spy  # type: ignore[method-assign]
    try:
        trio.run(_batched, sessions)
    finally:
        TickBatcher.__init__ = original  # type: ignore[method-assign]
    assert max(batchers[0].batch_sizes) >= 2, batchers[0].batch_sizes
    last = [s.outputs[-1] for s in sessions]
    assert all(not np.array_equal(last[0], other) for other in last[1:])


def test_unblocked_products_would_break_invariance(
    numpy_backends: tuple[NumpyBackend, NumpyBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row blocks are what keeps a row's result independent of the batch: without them
    (one gemm for all rows) a row computed beside 40 others comes out different."""
    first, _ = numpy_backends
    ids = np.arange(1, 42) % first.vocab_size

    def together_and_alone() -> tuple[Any, Any]:
        c1, c2 = first.new_cache(), first.new_cache()
        batch = first.forward_batch(
            [ForwardItem(c1, 0, tokens=ids[:1]), ForwardItem(c2, 0, tokens=ids[1:])]
        )
        return batch[0], first.forward(first.new_cache(), 0, tokens=ids[:1])

    a, b = together_and_alone()
    assert np.array_equal(a, b)

    def one_gemm(x: Any, w: Any) -> Any:  # every row of a product in one call
        return _kernels._blocked_matmul(x, w, max(1, x.shape[0]))

    monkeypatch.setattr(_numpy, "_matmul", one_gemm)
    a, b = together_and_alone()
    assert not np.array_equal(a, b), "the oracle cannot fail: invariance holds without blocks"


# ---------------------------------------------------------------------------------------------
# A whole pipeline: many requests at once give each the tokens it gets alone


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny6") / "tiny.gguf", n_layers=6)


STORIES = [
    "the cat sat on the mat. the cat sat on the",
    "once upon a time there was a",
    "in the morning the sea was calm and the",
    "a robot walked into the kitchen and",
]


async def test_concurrent_requests_get_their_solo_tokens_greedy_seeded_and_speculative(
    tiny6: Path,
) -> None:
    from stagerun import SamplingParams, SpeculationConfig, open_pipeline

    kinds = [
        (SamplingParams(), None),
        (SamplingParams(temperature=1.0, top_k=50, seed=7), None),
        (SamplingParams(), SpeculationConfig("ngram", depth=3, window=3)),
        (SamplingParams(temperature=0.8, seed=3), SpeculationConfig("ngram", depth=2)),
    ]
    jobs = [(prompt, *kind) for prompt in STORIES for kind in kinds]
    async with open_pipeline(tiny6, stages=3, capacity=len(jobs)) as pipeline:
        solo = []
        for prompt, sampling, spec in jobs:
            done = await pipeline.complete(prompt, max_tokens=24, sampling=sampling,
                                           speculation=spec, ignore_eog=True)  # fmt: skip
            solo.append(done.token_ids)
        assert len({tuple(t) for t in solo}) >= len(jobs) // 2, "the oracle must vary"
        before = pipeline.batcher.batch_sizes.copy()
        together: list[list[int]] = [[] for _ in jobs]

        async def one(k: int) -> None:
            prompt, sampling, spec = jobs[k]
            done = await pipeline.complete(prompt, max_tokens=24, sampling=sampling,
                                           speculation=spec, ignore_eog=True)  # fmt: skip
            together[k] = done.token_ids

        async with trio.open_nursery() as nursery:
            for k in range(len(jobs)):
                nursery.start_soon(one, k)
        batched = pipeline.batcher.batch_sizes - before
    assert max(batched) >= 4, f"the requests were never batched: {batched}"
    for k, (alone, beside) in enumerate(zip(solo, together, strict=True)):
        assert alone == beside, (k, jobs[k][0], jobs[k][1], jobs[k][2])
