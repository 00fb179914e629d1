"""The ggml backend's KV slabs: sessions in slots, and one attention a layer for many of them.

The sessions of a decode tick whose caches lie in consecutive slots of a slab attend in one
4-D flash attention, each row masked to its own session's keys; what each gets must be
bitwise what it computes alone, whichever slots the sessions hold and however many slabs.
"""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest

from stagerun.abc import ForwardItem
from stagerun.backends import GgmlBackend
from stagerun.backends._ggml import _graph, _kv
from stagerun.model import ModelFile

LAYERS = (0, 3)


def _decode_together(
    backend: GgmlBackend, prompts: list[list[int]], steps: int, drop: int | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """Prefill each prompt in a cache of its own (one more cache before prompt ``drop``,
    given back once all are made: a free slot among theirs), then decode ``steps`` tokens of
    all of them in batched steps: each session's decode outputs, and the number of attention
    groups of each step's graph."""
    caches, hole = [], []
    for n, prompt in enumerate(prompts):
        if n == drop:
            hole.append(backend.new_cache())
        caches.append(backend.new_cache())
        backend.forward(caches[-1], 0, tokens=prompt)
    del hole[:]
    gc.collect()
    outs: list[list[np.ndarray]] = [[] for _ in prompts]
    groups = []
    for t in range(steps):
        items = [
            ForwardItem(c, len(p) + t, tokens=[(7 * t + 3 * k) % 500 + 1])
            for k, (c, p) in enumerate(zip(caches, prompts, strict=True))
        ]
        for k, out in enumerate(backend.forward_batch(items)):
            assert isinstance(out, np.ndarray)
            outs[k].append(out)
        built = next(reversed(backend._graphs.values()))
        groups.append(len(built.groups))
    return [np.concatenate(o) for o in outs], groups


def _decode_alone(backend: GgmlBackend, prompt: list[int], k: int, steps: int) -> np.ndarray:
    cache = backend.new_cache()
    backend.forward(cache, 0, tokens=prompt)
    return np.concatenate(
        [
            backend.forward(cache, len(prompt) + t, tokens=[(7 * t + 3 * k) % 500 + 1])
            for t in range(steps)
        ]
    )


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, 5000, int(rng.integers(5, 90)))) for _ in range(n)]


def test_sessions_in_consecutive_slots_attend_in_one_group_and_each_gets_its_own(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(6)
    together, groups = _decode_together(GgmlBackend(smollm2, LAYERS), prompts, 4)
    assert groups == [1] * 4, "six sessions in slots 0..5: one attention a layer"
    solo = GgmlBackend(smollm2, LAYERS)
    alone = [_decode_alone(solo, p, k, 4) for k, p in enumerate(prompts)]
    assert len({a[-1].tobytes() for a in alone}) == len(alone)  # each session its own
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)
    # the oracle fails when one session's rows see a key past their own
    masks = _graph.attention_masks

    def leaky(positions: np.ndarray, rows: int, keys: int, window: int) -> np.ndarray:
        out = masks(positions, rows, keys, window)
        if len(positions) > 1:  # in a batched step, the last session's next (stale) key
            out[-1, :, positions[-1] + rows] = 0
        return out

    monkeypatch.setattr(_graph, "attention_masks", leaky)
    wrong, _ = _decode_together(GgmlBackend(smollm2, LAYERS), prompts, 4)
    assert not np.array_equal(wrong[-1], alone[-1])
    assert all(np.array_equal(a, b) for a, b in zip(alone[:-1], wrong[:-1], strict=True))


def test_sessions_around_a_free_slot_and_across_slabs_compute_what_each_does_alone(
    smollm2: ModelFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_kv, "SLAB_SLOTS", 4)
    monkeypatch.setattr(_kv.KVSlab.__init__, "__defaults__", (4,))
    prompts = _prompts(7, seed=5)
    backend = GgmlBackend(smollm2, LAYERS)
    together, groups = _decode_together(backend, prompts, 3, drop=2)
    # slots 0 1 _ 3 of the first slab, then 0 1 2 3 of a second one: three groups
    assert len(backend._slabs._slabs) == 2
    assert groups == [3] * 3
    solo = GgmlBackend(smollm2, LAYERS)
    for k, prompt in enumerate(prompts):
        assert np.array_equal(_decode_alone(solo, prompt, k, 3), together[k])


def test_a_slot_given_back_is_taken_again_and_its_pages_freed_when_the_stage_asks(
    smollm2: ModelFile,
) -> None:
    backend = GgmlBackend(smollm2, LAYERS)
    cache, other = backend.new_cache(), backend.new_cache()
    for c in (cache, other):
        backend.forward(c, 0, tokens=list(range(1, 200)))
    slab, slot = cache.slab, cache.slot
    assert cache.nbytes == 2 * 3 * 199 * 192 * 2  # keys and values of 199 positions, 3 layers
    pages = 199 * 192 * 2 // mmap.PAGESIZE  # whole pages a layer's 199 positions fill
    whole = pages * mmap.PAGESIZE // (192 * 2)  # the positions in them
    del cache
    gc.collect()
    assert np.any(slab.k[:, slot, :whole])  # kept till the stage is idle
    freed = backend.release_memory()
    assert freed == 2 * 3 * pages * mmap.PAGESIZE  # keys and values of 3 layers
    # the pages of the positions written are the system's again: zeros once read
    assert not np.any(slab.k[:, slot, :whole]) and not np.any(slab.v[:, slot, :whole])
    assert np.any(slab.k[:, other.slot, :whole])  # a live session's are untouched
    assert backend.release_memory() == 0
    again = backend.new_cache()
    assert again.slot == slot
    del again
    gc.collect()
    assert backend.release_memory() == 0  # a slot taken again was never written: nothing


def test_a_cache_of_another_backend_is_refused(smollm2: ModelFile) -> None:
    one, other = GgmlBackend(smollm2, LAYERS), GgmlBackend(smollm2, LAYERS)
    with pytest.raises(ValueError, match="another backend"):
        one.forward(other.new_cache(), 0, tokens=[1, 2, 3])


def test_a_group_s_decode_over_many_keys_is_the_same_on_one_thread_and_two(
    smollm2: ModelFile,
) -> None:
    """ggml splits a lone row's keys among its threads from 512 keys on; a group's rows (a
    batch of sessions in the attention's fourth dimension) are summed by the row kernel."""
    prompts = _prompts(3, seed=9)
    prompts = [p * (700 // len(p) + 1) for p in prompts]  # 700 keys and more each

    def together(threads: int, row_kernel: bool = True) -> list[np.ndarray]:
        backend = GgmlBackend(smollm2, LAYERS, threads=threads)
        backend._lib.ggml_backend_cpu_set_use_ref(backend._cpu, row_kernel)
        backend._cores.close()  # compute on `threads` whatever else runs on the host
        out, groups = _decode_together(backend, prompts, 2)
        assert groups == [1, 1]
        return out

    one = together(1)
    assert all(np.array_equal(a, b) for a, b in zip(one, together(2), strict=True))
    solo = GgmlBackend(smollm2, LAYERS, threads=2)
    for k, prompt in enumerate(prompts):
        assert np.array_equal(_decode_alone(solo, prompt, k, 2), one[k])
    off = together(2, row_kernel=False)  # the oracle fails without the row kernel
    assert not any(np.array_equal(a, b) for a, b in zip(one, off, strict=True))


def test_a_long_session_attends_apart_from_short_ones_beside_it(smollm2: ModelFile) -> None:
    """A group's rows all read the mask of its longest member: a session with several times
    the keys of its neighbours gets a group of its own, and every result is as alone."""
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(1, 5000, n)) for n in (20, 30, 700, 25)]
    backend = GgmlBackend(smollm2, LAYERS)
    together, groups = _decode_together(backend, prompts, 2)
    assert groups == [3, 3]  # slots 0-1, slot 2 (700 keys), slot 3
    solo = GgmlBackend(smollm2, LAYERS)
    for k, prompt in enumerate(prompts):
        assert np.array_equal(_decode_alone(solo, prompt, k, 2), together[k])
