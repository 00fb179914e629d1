"""NumpyBackend: exactness against a naive float64 forward, splits, KV cache, cancellation."""

from __future__ import annotations

import copy
import itertools
import pathlib
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
from threadpoolctl import threadpool_info

from stagerun._errors import ComputeCancelled, LayerRangeError
from stagerun.backends import NumpyBackend, NumpyKVCache, _numpy
from stagerun.model import ModelFile, open_model
from stagerun.testing import write_tiny_model

F32 = npt.NDArray[np.float32]
PROMPT = [17, 42, 99, 3, 250, 7, 120, 64, 5, 200, 11, 33]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def naive_logits(model: ModelFile, ids: Sequence[int]) -> np.ndarray:
    """A plain float64 llama forward (interleaved RoPE, repeated KV heads, no cache)."""
    c = model.config
    w = model.load_weights(0, c.n_layers, embeddings=True, head=True)
    assert w.token_embd is not None and w.output is not None and w.output_norm is not None
    n, hd, group = len(ids), c.head_dim, c.n_heads // c.n_kv_heads
    angles = np.arange(n)[:, None] / c.rope_base ** (np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(v: np.ndarray) -> np.ndarray:
        out = np.empty_like(v)
        a, b = v[..., 0::2], v[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return np.asarray(v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_eps) * g)

    x = w.token_embd[list(ids)].astype(np.float64)
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    for layer in w.layers:
        h = norm(x, layer.attn_norm)
        q = rope((h @ layer.wq.T).reshape(n, c.n_heads, hd))
        k = np.repeat(rope((h @ layer.wk.T).reshape(n, c.n_kv_heads, hd)), group, axis=1)
        v = np.repeat((h @ layer.wv.T).reshape(n, c.n_kv_heads, hd), group, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(n, -1) @ layer.wo.T
        h = norm(x, layer.ffn_norm)
        g, u = h @ layer.w_gate.T, h @ layer.w_up.T
        x = x + (g / (1 + np.exp(-g)) * u) @ layer.w_down.T
    return np.asarray(norm(x, w.output_norm) @ w.output.T)


def split_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(bounds))


def run_stages(
    backends: Sequence[NumpyBackend],
    caches: Sequence[NumpyKVCache],
    position: int,
    tokens: Sequence[int],
    logits: str = "all",
) -> F32:
    x = backends[0].forward(caches[0], position, tokens=tokens, logits=logits)  # type: ignore[arg-type]
    for backend, cache in zip(backends[1:], caches[1:], strict=True):
        assert x.dtype == np.float32 and x.shape == (len(tokens), backend.d_model)
        x = backend.forward(cache, position, hidden=x, logits=logits)  # type: ignore[arg-type]
    return x


def greedy(backend: NumpyBackend, prompt: Sequence[int], n: int) -> list[int]:
    cache = backend.new_cache()
    logits = backend.forward(cache, 0, tokens=prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = backend.forward(cache, len(prompt) + len(out) - 1, tokens=[out[-1]])
    return out


# -- tiny models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: ModelFile) -> NumpyBackend:
    return NumpyBackend(tiny_model)


@pytest.mark.parametrize(
    "shape",
    [
        {},  # GQA 4 heads / 2 KV heads, tied head
        {"n_kv_heads": 4},  # multi-head
        {"n_kv_heads": 1, "tied_output": False},  # multi-query, separate head
        {"n_layers": 3, "d_model": 96, "n_heads": 6, "n_kv_heads": 3, "d_ff": 80, "seed": 5},
    ],
)
def test_matches_naive_reference(tmp_path: pathlib.Path, shape: dict[str, object]) -> None:
    model = open_model(write_tiny_model(tmp_path / "m.gguf", **shape))  # type: ignore[arg-type]
    backend = NumpyBackend(model)
    logits = backend.forward(backend.new_cache(), 0, tokens=PROMPT, logits="all")
    assert logits.dtype == np.float32 and logits.shape == (len(PROMPT), model.config.vocab_size)
    assert rel_err(logits, naive_logits(model, PROMPT)) < 1e-5


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_tiny_split_equivalence(tiny_model: ModelFile, tiny: NumpyBackend, n_stages: int) -> None:
    stages = [NumpyBackend(tiny_model, r) for r in split_ranges(4, n_stages)]
    caches = [s.new_cache() for s in stages]
    whole = tiny.forward(tiny.new_cache(), 0, tokens=[*PROMPT, 9, 8], logits="all")
    split = run_stages(stages, caches, 0, PROMPT)
    split_next = run_stages(stages, caches, len(PROMPT), [9, 8])
    assert rel_err(np.concatenate([split, split_next]), whole) < 1e-5


def test_stage_roles(tiny_model: ModelFile) -> None:
    first, middle, last = (NumpyBackend(tiny_model, r) for r in [(0, 1), (1, 3), (3, 4)])
    assert (first.is_first, first.is_last, middle.is_first, middle.is_last) == (
        True,
        False,
        False,
        False,
    )
    assert (last.is_first, last.is_last, last.layers) == (False, True, (3, 4))
    assert NumpyBackend(tiny_model).layers == (0, 4)
    assert (middle.d_model, middle.vocab_size, middle.config) == (64, 279, tiny_model.config)
    assert "layers=[1, 3) of 4" in repr(middle)
    h = middle.forward(middle.new_cache(), 0, hidden=np.ones((3, 64), np.float32))
    assert h.shape == (3, 64) and h.dtype == np.float32
    assert last.forward(last.new_cache(), 0, hidden=h).shape == (1, 279)
    with pytest.raises(ValueError, match="takes `tokens`"):
        first.forward(first.new_cache(), 0, hidden=h)
    with pytest.raises(ValueError, match="takes `hidden`"):
        middle.forward(middle.new_cache(), 0, tokens=[1, 2])


@pytest.mark.parametrize("layers", [(0, 5), (2, 2), (-1, 3)])
def test_bad_layer_range(tiny_model: ModelFile, layers: tuple[int, int]) -> None:
    with pytest.raises(LayerRangeError, match="4 layers"):
        NumpyBackend(tiny_model, layers)


def test_incremental_decode_equals_full_forward_past_kv_growth(tiny: NumpyBackend) -> None:
    ids = [(i * 37 + 11) % 279 for i in range(300)]
    whole = tiny.forward(tiny.new_cache(), 0, tokens=ids, logits="all")
    cache = tiny.new_cache()
    rows = [tiny.forward(cache, 0, tokens=ids[:200], logits="all")]
    rows += [tiny.forward(cache, p, tokens=ids[p : p + 1]) for p in range(200, 260)]
    rows.append(tiny.forward(cache, 260, tokens=ids[260:263], logits="all"))  # verify window
    rows += [tiny.forward(cache, p, tokens=ids[p : p + 1]) for p in range(263, 300)]
    assert cache.length == 300 and cache.capacity >= 300
    assert rel_err(np.concatenate(rows), whole) < 1e-5


def test_trim_then_recompute(tiny: NumpyBackend) -> None:
    cache = tiny.new_cache()
    tiny.forward(cache, 0, tokens=PROMPT)
    assert cache.length == len(PROMPT)
    cache.trim(100)  # past the end: nothing happens
    assert cache.length == len(PROMPT)
    cache.trim(5)
    assert cache.length == 5
    again = tiny.forward(cache, 5, tokens=[1, 2, 3], logits="all")
    fresh = tiny.forward(tiny.new_cache(), 0, tokens=[*PROMPT[:5], 1, 2, 3], logits="all")
    assert rel_err(again, fresh[5:]) < 1e-6
    # A position behind the cache's end trims implicitly (positions are authoritative).
    rewound = tiny.forward(cache, 6, tokens=[2, 3], logits="all")
    assert cache.length == 8
    assert rel_err(rewound, fresh[6:]) < 1e-6
    with pytest.raises(ValueError, match="negative"):
        cache.trim(-1)


def test_a_gap_is_refused(tiny: NumpyBackend) -> None:
    cache = tiny.new_cache()
    tiny.forward(cache, 0, tokens=[1, 2])
    with pytest.raises(ValueError, match="gap"):
        tiny.forward(cache, 3, tokens=[4])
    with pytest.raises(ValueError, match=">= 0"):
        tiny.forward(cache, -1, tokens=[4])
    assert cache.length == 2


def test_context_length_is_enforced(tiny: NumpyBackend) -> None:
    with pytest.raises(ValueError, match="context length 512"):
        tiny.forward(tiny.new_cache(), 0, tokens=[5] * 513)


def test_bad_inputs(tiny: NumpyBackend, tiny_model: ModelFile) -> None:
    cache = tiny.new_cache()
    with pytest.raises(ValueError, match=r"\[0, 279\)"):
        tiny.forward(cache, 0, tokens=[279])
    with pytest.raises(ValueError, match="non-empty"):
        tiny.forward(cache, 0, tokens=[])
    with pytest.raises(ValueError, match="integer"):
        tiny.forward(cache, 0, tokens=[1.5])
    middle = NumpyBackend(tiny_model, (1, 2))
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        middle.forward(middle.new_cache(), 0, hidden=np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError, match="another layer range"):
        middle.forward(cache, 0, hidden=np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="'last' or 'all'"):
        tiny.forward(cache, 0, tokens=[1], logits="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        NumpyBackend(tiny_model, threads=0)


def test_hidden_input_is_not_modified_and_is_cast(tiny_model: ModelFile) -> None:
    middle = NumpyBackend(tiny_model, (1, 3))
    hidden = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    before = hidden.copy()
    out32 = middle.forward(middle.new_cache(), 0, hidden=hidden)
    assert np.array_equal(hidden, before)
    out64 = middle.forward(middle.new_cache(), 0, hidden=hidden.astype(np.float64))
    assert out64.dtype == np.float32 and np.array_equal(out32, out64)


def test_everything_is_float32(tiny: NumpyBackend) -> None:
    for layer in tiny._layers:
        for name in ("w_qkv", "w_o", "w_gu", "w_down"):
            array = getattr(layer, name).data
            assert array.dtype == np.float32 and array.flags.c_contiguous
    assert tiny._head is not None and tiny._head.data.dtype == np.float32
    assert all(r.cos.dtype == r.sin.dtype == np.float32 for r in tiny._ropes)
    cache = tiny.new_cache()
    for tokens in ([1, 2, 3], np.array([4], dtype=np.int64), (5, 6)):
        out = tiny.forward(cache, cache.length, tokens=tokens)
        assert out.dtype == np.float32
    assert cache._k.dtype == cache._v.dtype == np.float32


def test_should_stop_cancels_and_leaves_the_cache_usable(tiny: NumpyBackend) -> None:
    cache = tiny.new_cache()
    tiny.forward(cache, 0, tokens=PROMPT[:6])
    calls = 0

    def stop_at_layer_2() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    with pytest.raises(ComputeCancelled, match="before layer 2"):
        tiny.forward(cache, 6, tokens=PROMPT[6:], should_stop=stop_at_layer_2)
    assert cache.length == 6
    with pytest.raises(ComputeCancelled):  # also when it trimmed first
        tiny.forward(cache, 3, tokens=[1], should_stop=lambda: True)
    assert cache.length == 3
    resumed = tiny.forward(cache, 3, tokens=PROMPT[3:], logits="all", should_stop=lambda: False)
    fresh = tiny.forward(tiny.new_cache(), 0, tokens=PROMPT, logits="all")
    assert rel_err(resumed, fresh[3:]) < 1e-6


def test_threads_are_limited_per_call_and_restored(tiny_model: ModelFile) -> None:
    def blas_threads() -> int:
        return min(int(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas")

    before = blas_threads()
    seen: list[int] = []

    def record() -> bool:
        seen.append(blas_threads())
        return False

    backend = NumpyBackend(tiny_model, threads=1)
    backend.forward(backend.new_cache(), 0, tokens=[1, 2], should_stop=record)
    assert set(seen) == {1}
    assert blas_threads() == before


def test_greedy_decode_is_deterministic(tiny_model: ModelFile, tiny: NumpyBackend) -> None:
    first = greedy(tiny, PROMPT[:4], 12)
    assert first == greedy(NumpyBackend(tiny_model), PROMPT[:4], 12)
    assert all(0 <= t < 279 for t in first)


def test_kv_cache_repr_and_growth(tiny: NumpyBackend) -> None:
    cache = tiny.new_cache()
    assert (cache.length, cache.capacity) == (0, 0)
    tiny.forward(cache, 0, tokens=[1])
    assert cache.capacity == 256
    k_storage = cache._k
    for p in range(1, 10):
        tiny.forward(cache, p, tokens=[2])
    assert cache._k is k_storage  # decode writes in place
    assert repr(cache) == "<KVCache length=10 capacity=256 layers=4>"


# -- the default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(smollm2: ModelFile) -> list[int]:
    return smollm2.tokenizer.encode("The capital of France is")


@pytest.mark.slow
@pytest.mark.parametrize("n_stages", [2, 3, 5])
def test_split_equivalence(
    smollm2: ModelFile, smollm2_backend: NumpyBackend, prompt_ids: list[int], n_stages: int
) -> None:
    cache = smollm2_backend.new_cache()
    whole = smollm2_backend.forward(cache, 0, tokens=prompt_ids, logits="all")
    next_id = int(whole[-1].argmax())
    whole_next = smollm2_backend.forward(cache, len(prompt_ids), tokens=[next_id])
    stages = [NumpyBackend(smollm2, r, threads=2) for r in split_ranges(30, n_stages)]
    caches = [s.new_cache() for s in stages]
    split = run_stages(stages, caches, 0, prompt_ids)
    split_next = run_stages(stages, caches, len(prompt_ids), [next_id], logits="last")
    assert rel_err(split, whole) < 1e-4
    assert rel_err(split_next, whole_next) < 1e-4


@pytest.mark.slow
def test_real_incremental_equals_full(smollm2_backend: NumpyBackend, prompt_ids: list[int]) -> None:
    ids = [*prompt_ids, 12366, 30, 378, 2682, 314]
    whole = smollm2_backend.forward(smollm2_backend.new_cache(), 0, tokens=ids, logits="all")
    cache = smollm2_backend.new_cache()
    rows = [smollm2_backend.forward(cache, 0, tokens=ids[:4], logits="all")]
    rows.append(smollm2_backend.forward(cache, 4, tokens=ids[4:7], logits="all"))
    rows += [smollm2_backend.forward(cache, p, tokens=[ids[p]]) for p in range(7, len(ids))]
    assert rel_err(np.concatenate(rows), whole) < 1e-4
    cache.trim(6)
    again = smollm2_backend.forward(cache, 6, tokens=ids[6:], logits="all")
    assert rel_err(again, whole[6:]) < 1e-4


@pytest.mark.slow
def test_capital_of_france(
    smollm2: ModelFile, smollm2_backend: NumpyBackend, prompt_ids: list[int]
) -> None:
    text = smollm2.tokenizer.decode(greedy(smollm2_backend, prompt_ids, 6))
    assert "Paris" in text


@pytest.mark.slow
def test_decode_speed_has_no_float64_slowdown(
    smollm2_backend: NumpyBackend, prompt_ids: list[int]
) -> None:
    """Decode stays in float32: well ahead of the same backend made to compute in float64.

    The two are timed side by side, in alternating rounds, so a busy machine slows both; the
    best round of each is compared. Float64 promotion anywhere in a block (which turns every
    matmul into a float64 one) would make them about equal. Measured: float64 decode is
    2.5-2.8x slower on a 2-core AMD EPYC (one decode row padded to a 4-row gemm), about 6x
    on the Xeon this test was first written on.
    """
    promoted = copy.copy(smollm2_backend)
    assert smollm2_backend._embd is not None
    promoted._embd = smollm2_backend._embd.astype(np.float64)  # every activation after it too

    def seconds_per_token(backend: NumpyBackend, steps: int) -> float:
        cache = backend.new_cache()
        backend.forward(cache, 0, tokens=prompt_ids)
        start = time.perf_counter()
        for p in range(len(prompt_ids), len(prompt_ids) + steps):
            logits = backend.forward(cache, p, tokens=[100])
        elapsed = (time.perf_counter() - start) / steps
        assert logits.dtype == (np.float64 if backend is promoted else np.float32)
        return elapsed

    f32, f64 = [], []
    for _ in range(3):
        f32.append(seconds_per_token(smollm2_backend, 4))
        f64.append(seconds_per_token(promoted, 1))
    assert min(f64) > 2 * min(f32), (f32, f64)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 70])
@pytest.mark.parametrize("n_out", [64, 100, 1])
def test_panel_matmul_equals_plain_matmul(rows: int, n_out: int) -> None:
    rng = np.random.default_rng(rows * 1000 + n_out)
    w = rng.standard_normal((48, n_out)).astype(np.float32)
    x = rng.standard_normal((rows, 48)).astype(np.float32)
    got = _numpy._matmul(x, _numpy._Panels(w))
    assert got.shape == (rows, n_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_in", [192, 576])
@pytest.mark.parametrize("rows", [3, 5, 8, 12, 13, 21])
def test_each_row_of_a_product_has_the_bits_it_has_alone(rows: int, n_in: int) -> None:
    """4- and 8-row gemm calls mixed in one product give every row its bits computed alone.

    (16-row calls would not: on AVX2 kernels their rows differ with 192 inputs.)
    """
    rng = np.random.default_rng(rows)
    panels = _numpy._Panels(rng.standard_normal((n_in, 300)).astype(np.float32))
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    together = _numpy._matmul(x, panels)
    alone = np.concatenate([_numpy._matmul(x[i : i + 1], panels) for i in range(rows)])
    assert np.array_equal(together, alone)
