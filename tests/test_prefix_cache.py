"""The prefix cache: block names, the LRU store, the backend's exact restore, and pipelines
whose output is the same with the cache on or off, after evictions, restarts and recoveries.

Every end-to-end test compares a run with the cache against one without, on the tiny model
(whose greedy and seeded outputs vary with the context: `_oracle.assert_varied`), and checks
that the cache was really used (positions restored), so an equality that held only because
nothing was cached would fail.
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio
from _oracle import assert_varied
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerun import SamplingParams, SpeculationConfig, TokenChunk, _proto, open_pipeline
from stagerun._engine._budget import SessionBudget
from stagerun._engine._prefix import PrefixCache
from stagerun._engine._session import Session
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

BLOCK = _proto.PREFIX_BLOCK


# --- block names ---------------------------------------------------------------------------


def test_a_block_name_stands_for_the_whole_prefix_before_it() -> None:
    tokens = list(range(3, 3 + 5 * BLOCK + BLOCK - 1))
    names = _proto.prefix_chain(tokens, b"k" * 16)
    assert len(names) == 5  # the partial last block is never named
    changed = [99, *tokens[1:]]
    assert not set(_proto.prefix_chain(changed, b"k" * 16)) & set(names)
    later = [*tokens[: 3 * BLOCK], 99, *tokens[3 * BLOCK + 1 :]]
    assert _proto.prefix_chain(later, b"k" * 16)[:3] == names[:3]
    assert _proto.prefix_chain(later, b"k" * 16)[3:] != names[3:]
    assert not set(_proto.prefix_chain(tokens, b"j" * 16)) & set(names)  # another pipeline
    assert _proto.prefix_chain(tokens, b"k" * 16, blocks=2) == names[:2]


def test_configure_and_remember_carry_a_bounded_list_of_names() -> None:
    too_many = tuple(range(_proto.MAX_PREFIX_NAMES + 1))
    with pytest.raises(ValueError, match="more than the limit"):
        _proto.Remember(request_id=1, prefix=too_many)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        _proto.Configure(request_id=1, return_key=2, prompt_len=3, prefix=(2**64,))


# --- the store -----------------------------------------------------------------------------


class _Fake:
    def __init__(self, nbytes: int = 100) -> None:
        self.nbytes = nbytes


def test_lookup_restores_the_longest_run_from_the_first_block() -> None:
    cache = PrefixCache(10_000)
    blocks = {name: _Fake() for name in (1, 2, 3)}
    for name, block in blocks.items():
        assert cache.insert(name, block)
    assert cache.lookup([1, 2, 3, 4]) == [blocks[1], blocks[2], blocks[3]]
    assert cache.lookup([1, 5, 3]) == [blocks[1]]  # a gap ends the run: 3 is another prefix
    assert cache.lookup([7, 1]) == []
    assert (cache.hits, cache.misses) == (2, 1)
    assert (cache.hit_tokens, cache.lookup_tokens) == (4 * BLOCK, 9 * BLOCK)
    assert cache.missing([1, 2, 8, 9], length=3 * BLOCK + BLOCK - 1) == [2]


def test_eviction_is_least_recently_used_and_keeps_first_blocks_longest() -> None:
    cache = PrefixCache(300)  # room for three blocks
    for name in (1, 2, 3):
        cache.insert(name, _Fake())
    cache.lookup([1, 2, 3])  # touched last first: 1 is now the most recent
    cache.insert(4, _Fake())
    assert 3 not in cache and {1, 2, 4} <= set(cache._blocks)
    assert cache.evicted_blocks == 1 and cache.bytes == 300
    assert not cache.insert(5, _Fake(301))  # larger than the whole cache
    assert cache.bytes == 300


def test_running_requests_take_kv_room_back_from_the_cache() -> None:
    budget = SessionBudget(max_kv_tokens=4 * BLOCK)
    cache = PrefixCache(10**9, budget=budget)
    for name in range(4):
        assert cache.insert(name, _Fake())
    assert budget.cached_tokens == 4 * BLOCK
    session = Session(cache=None, sampling=_proto.SamplingParams(), prompt_len=0)
    assert budget.open() is None
    assert budget.grow(session, 3 * BLOCK) is None  # three blocks evicted for it
    assert len(cache) == 1 and cache.evicted_blocks == 3
    assert budget.grow(session, 4 * BLOCK) is None  # and the last one
    assert len(cache) == 0
    assert budget.grow(session, 4 * BLOCK + 1) is not None  # the cache gave all it had
    assert not cache.insert(9, _Fake())  # never at the expense of a running request
    assert budget.kv_tokens == 4 * BLOCK and budget.cached_tokens == 0


# --- the numpy backend's part --------------------------------------------------------------


def _logits(backend: NumpyBackend, tokens: Sequence[int], chunks: Sequence[int]) -> np.ndarray:
    cache, at, out = backend.new_cache(), 0, None
    for size in chunks:
        out = backend.forward(cache, at, tokens=tokens[at : at + size])
        at += size
    assert at == len(tokens) and out is not None
    return out


def test_a_row_computes_bitwise_the_same_whatever_chunk_it_comes_in(
    smollm2: ModelFile,
) -> None:
    """Attention sums over fixed key blocks: chunking a prompt changes no bit of its logits."""
    backend = NumpyBackend(smollm2, (0, smollm2.config.n_layers))
    tokens = random.Random(0).choices(range(100, 40000), k=300)
    whole = _logits(backend, tokens, [300])
    for chunks in ([80, 220], [37, 100, 163], [299, 1], [64, 64, 64, 64, 44]):
        assert np.array_equal(_logits(backend, tokens, chunks), whole), chunks


def test_restored_blocks_continue_bitwise_like_the_cache_they_came_from(
    tiny_model: ModelFile,
) -> None:
    backend = NumpyBackend(tiny_model)
    tokens = random.Random(1).choices(range(3, 250), k=5 * BLOCK + BLOCK - 1)
    source = backend.new_cache()
    backend.forward(source, 0, tokens=tokens[: 4 * BLOCK + BLOCK - 1])
    blocks = [backend.export_kv(source, i * BLOCK, (i + 1) * BLOCK) for i in range(4)]
    source.trim(0)  # the copies do not change with their source
    backend.forward(source, 0, tokens=tokens[:5])
    restored = backend.new_cache()
    backend.import_kv(restored, blocks)
    assert restored.length == 4 * BLOCK
    got = backend.forward(restored, 4 * BLOCK, tokens=tokens[4 * BLOCK :])
    assert np.array_equal(got, _logits(backend, tokens, [len(tokens)]))
    with pytest.raises(ValueError, match="empty cache"):
        backend.import_kv(restored, blocks)


# --- whole pipelines -----------------------------------------------------------------------


def _conversation(seed: int, turns: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(rng.randrange(20, 90))]
    asks = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 24))] for _ in range(turns)]
    return system, asks


async def _chat(
    pipeline: Any,
    system: list[int],
    asks: list[list[int]],
    *,
    tokens: int = 12,
    sampling: SamplingParams | None = None,
    speculation: SpeculationConfig | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Each turn's output, and the positions each turn started from the cache."""
    context, outputs, cached = list(system), [], []
    for ask in asks:
        context += ask
        result = await pipeline.complete(
            context,
            max_tokens=tokens,
            ignore_eog=True,
            sampling=sampling or SamplingParams(),
            speculation=speculation,
        )
        outputs.append(result.token_ids)
        cached.append(int(result.timings.get("prefix_cached_tokens", 0)))
        context += result.token_ids
    return outputs, cached


async def _reference(
    path: pathlib.Path, system: list[int], asks: list[list[int]], **options: Any
) -> list[list[int]]:
    """The conversation's outputs with the cache off, checked varied (the oracle)."""
    async with open_pipeline(path, stages=3, prefix_cache=False) as plain:
        want, _ = await _chat(plain, system, asks, **options)
    assert_varied([t for turn in want for t in turn])
    return want


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    stages=st.sampled_from([1, 3]),
    seeded=st.booleans(),
    speculative=st.booleans(),
)
def test_outputs_are_the_same_with_the_cache_on_and_off(
    tiny_model_path: pathlib.Path, seed: int, stages: int, seeded: bool, speculative: bool
) -> None:
    system, asks = _conversation(seed, turns=3)
    sampling = SamplingParams(temperature=0.9, seed=seed) if seeded else SamplingParams()
    speculation = SpeculationConfig("ngram", depth=2, window=3) if speculative else None

    async def run(on: bool) -> tuple[list[list[int]], list[int]]:
        async with open_pipeline(tiny_model_path, stages=stages, prefix_cache=on) as pipeline:
            return await _chat(pipeline, system, asks, sampling=sampling, speculation=speculation)

    with_cache, cached = trio.run(run, True)
    without, none = trio.run(run, False)
    assert_varied([t for turn in without for t in turn])
    assert with_cache == without
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]) and not any(none)


async def test_the_first_token_is_sent_before_the_prompt_s_blocks_are_kept(
    tiny_model_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copying a new prompt's blocks into the cache took 16 ms of its time to first token
    # under 16 streams; it waits until the token is on its way (the copy reads positions
    # no decode step writes).
    from stagerun._engine._engine import StageEngine

    events: list[str] = []
    remember = StageEngine.remember

    async def recorded(self: StageEngine, session: Session, names: Any) -> None:
        events.append(f"remember {len(names)}")
        await remember(self, session, names)

    monkeypatch.setattr(StageEngine, "remember", recorded)
    async with open_pipeline(tiny_model_path, stages=1) as pipeline:
        prompt = list(range(3, 3 + 3 * BLOCK + 1))
        await pipeline.complete(
            prompt, max_tokens=3, ignore_eog=True, on_token=lambda c: events.append("token")
        )
        again = await pipeline.complete(prompt, max_tokens=1, ignore_eog=True)
    assert events[:3] == ["token", "remember 3", "token"], events
    assert again.timings.prefill.prefix_cached_tokens == 3 * BLOCK  # it was kept all the same


async def test_a_tiny_cache_evicts_and_the_output_stays_the_same(
    tiny_model_path: pathlib.Path,
) -> None:
    system, asks = _conversation(7, turns=5)
    want = await _reference(tiny_model_path, system, asks)
    async with open_pipeline(tiny_model_path, stages=3, prefix_cache_mb=1) as pipeline:
        per_block = pipeline.engine.backend.export_kv(_filled(pipeline), 0, BLOCK).nbytes
        pipeline.prefix_cache.max_bytes = 3 * per_block  # three blocks on stage 0
        got, cached = await _chat(pipeline, system, asks)
        assert got == want
        assert pipeline.prefix_cache.evicted_blocks > 0 and len(pipeline.prefix_cache) <= 3
        assert max(cached) <= 3 * BLOCK  # never more than the cache can hold


def _filled(pipeline: Any) -> Any:
    cache = pipeline.engine.backend.new_cache()
    pipeline.engine.backend.forward(cache, 0, tokens=list(range(3, 3 + BLOCK)))
    return cache


async def test_a_stage_without_the_prefix_makes_the_request_recompute_it(
    tiny_model: ModelFile, tiny_model_path: pathlib.Path
) -> None:
    """A middle stage that keeps no cache says so (0 positions), and everyone recomputes."""
    from stagerun._stage._server import serve_stage

    system, asks = _conversation(11, turns=3)
    want = await _reference(tiny_model_path, system, asks)
    async with trio.open_nursery() as nursery:
        last = await nursery.start(
            lambda task_status: serve_stage(
                NumpyBackend(tiny_model, (3, 4)), index=2, task_status=task_status
            )
        )
        middle = await nursery.start(
            lambda task_status: serve_stage(
                NumpyBackend(tiny_model, (2, 3)),
                index=1,
                downstream=last,
                prefix_cache_bytes=0,
                task_status=task_status,
            )
        )
        async with open_pipeline(
            tiny_model_path, layers=[(0, 2), (2, 3), (3, 4)], remote=[middle, last]
        ) as pipeline:
            got, cached = await _chat(pipeline, system, asks)
            health = await pipeline.check_health()
        nursery.cancel_scope.cancel()
    assert got == want
    assert cached == [0, 0, 0]
    assert pipeline.prefix_cache.hits == 2  # stage 0 had it, and asked for it
    assert [h.prefix_cache.enabled for h in health] == [True, False, True]


@pytest.mark.slow
async def test_a_restarted_stage_lost_its_cache_and_the_conversation_goes_on(
    tiny_model_path: pathlib.Path,
) -> None:
    system, asks = _conversation(3, turns=4)
    want = await _reference(tiny_model_path, system, asks)
    async with open_pipeline(tiny_model_path, stages=3, mode="processes") as pipeline:
        got, cached = await _chat(pipeline, system, asks[:2])
        process = pipeline.stages[1].process
        old = process.pid
        os.kill(old, signal.SIGKILL)
        with trio.fail_after(30):
            while process.pid in (None, old) or process.state != "running":  # noqa: ASYNC110 (another process's restart)
                await trio.sleep(0.05)
        context = [*system, *asks[0], *got[0], *asks[1], *got[1]]
        more, more_cached = await _chat(pipeline, context, asks[2:])
        health = await pipeline.check_health()
    assert got + more == want
    assert cached[1] > 0
    assert more_cached[0] == 0  # stage 1 holds nothing now: everything was recomputed
    assert more_cached[1] > 0  # and what the next turn needs is cached again
    assert health[1].prefix_cache is not None and health[1].prefix_cache.hits == 1


@pytest.mark.slow
async def test_a_request_from_a_cached_prefix_recovers_from_a_killed_stage(
    tiny_model_path: pathlib.Path,
) -> None:
    system, asks = _conversation(5, turns=2)
    tokens = 40
    want = await _reference(tiny_model_path, system, asks, tokens=tokens)
    assert_varied(want[1])
    async with open_pipeline(tiny_model_path, stages=3, mode="processes") as pipeline:
        first, _ = await _chat(pipeline, system, asks[:1], tokens=tokens)
        victim = pipeline.stages[1].process.pid
        seen = 0

        def on_token(chunk: TokenChunk) -> None:
            nonlocal seen
            seen += 1
            if seen == 12:
                os.kill(victim, signal.SIGKILL)

        result = await pipeline.complete(
            [*system, *asks[0], *first[0], *asks[1]],
            max_tokens=tokens,
            ignore_eog=True,
            on_token=on_token,
        )
    assert first[0] == want[0]
    assert result.token_ids == want[1]
    assert result.timings["recoveries"] == 1
    # it started from the cache, and the replay after the kill recomputed all of it
    assert pipeline.prefix_cache.hits >= 2 and result.timings["prefix_cached_tokens"] == 0


def test_the_chat_template_renders_turn_n_plus_1_after_turn_n_token_for_token(
    smollm2: ModelFile,
) -> None:
    """What makes a chat's later turns hit: their prompt starts with the earlier prompt and
    answer, token for token (SmolLM2's ChatML template, with an answer tokenized alone)."""
    model = smollm2
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three rivers in Europe."},
    ]
    first = model.apply_chat_template(messages)
    answer = "The Danube, the Rhine and the Seine."
    answer_ids = model.tokenizer.encode(answer)
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Which is the longest?"},
    ]
    second = model.apply_chat_template(messages)
    assert second[: len(first) + len(answer_ids)] == first + answer_ids
    assert len(second) > len(first) + len(answer_ids) + 5


async def test_metrics_and_health_show_each_stage_s_prefix_cache(
    tiny_model_path: pathlib.Path,
) -> None:
    import httpx
    from test_metrics_batch import _samples, http_server

    system = "You are terse. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    async with (
        open_pipeline(tiny_model_path, stages=3) as pipeline,
        http_server(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        for _ in range(3):  # the same system prompt: the second and third start from it
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        samples = _samples((await client.get("/metrics")).text)
        stages = (await client.get("/health")).json()["stages"]
    for index, stage in enumerate(stages):
        cache = stage["prefix_cache"]
        assert cache["enabled"] and cache["hits"] == 2 and cache["blocks"] > 0
        assert cache["hit_rate"] > 0.5
        label = f'{{stage="{index}"}}'
        assert samples[f"stagerun_prefix_cache_hits_total{label}"] == 2
        assert samples[f"stagerun_prefix_cache_bytes{label}"] == cache["bytes"] > 0
        assert samples[f"stagerun_prefix_cache_max_bytes{label}"] == 512 << 20
        assert samples[f"stagerun_prefix_cache_hit_tokens_total{label}"] == cache["hit_tokens"]
    assert stages[0]["prefix_cache"]["misses"] == 1  # the first request found nothing


async def test_requests_share_cached_prefixes_only_with_the_same_cache_salt(
    tiny_model_path: pathlib.Path,
) -> None:
    system, asks = _conversation(13, turns=1)
    prompt = [*system, *asks[0]]
    async with open_pipeline(tiny_model_path, stages=2) as pipeline:

        async def cached(salt: str | None) -> int:
            result = await pipeline.complete(prompt, max_tokens=4, cache_salt=salt)
            return int(result.timings["prefix_cached_tokens"])

        assert await cached("alice") == 0
        assert await cached("bob") == 0  # alice's blocks are not bob's
        assert await cached(None) == 0  # nor the pipeline's own
        assert await cached("alice") > 0
        assert await cached(None) > 0


def test_the_api_takes_a_cache_salt_and_checks_it() -> None:
    from stagerun.server._openai import ApiError, parse_generation_request

    body = {"model": "m", "prompt": "hi"}
    assert parse_generation_request(body, "completion").cache_salt is None
    salted = parse_generation_request({**body, "cache_salt": "tenant-7"}, "completion")
    assert salted.cache_salt == "tenant-7"
    for bad in (7, "", "x" * 257):
        with pytest.raises(ApiError, match="cache_salt"):
            parse_generation_request({**body, "cache_salt": bad}, "completion")
