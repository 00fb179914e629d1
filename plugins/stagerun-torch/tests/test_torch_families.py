"""Every model family and trait runs in torch as in the numpy reference.

The oracle is `stagerun.backends.NumpyBackend` on the same tiny file, over a prompt longer
than every sliding window in the files. That it can fail is shown by mutants: the torch
backend with one trait switched off (a window ignored, a RoPE table swapped, a softcap
dropped...) must move the logits well past the tolerance on the file that has the trait.
"""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from stagerun_torch import TorchBackend, TorchInt4Backend, _backend
from stagerun_torch._attention import RopeTable, attention
from stagerun_torch._matrices import gelu_tanh_mul, softcap

from stagerun import UnsupportedModelError
from stagerun.abc import ForwardItem
from stagerun.backends import NumpyBackend
from stagerun.model import FAMILIES, ModelFile, open_model
from stagerun.testing import check_backend, write_tiny_model

TINY_FAMILIES = tuple(FAMILIES)  # write_tiny_model writes every built-in family

# name: write_tiny_model's arguments
CASES: dict[str, dict[str, Any]] = {
    **{family: {"family": family} for family in TINY_FAMILIES},
    "llama-linear-rope": {"rope_scaling": 2.0},
    "llama-rope-factors": {"rope_factors": True},
    "llama-window": {"sliding_window": 24},
    "gemma3-softcaps": {"family": "gemma3", "attn_softcap": 50.0, "final_softcap": 30.0},
    # Gemma 2's caps (above) barely bend the tiny model's logits (|logit| < 2): these do
    "gemma3-tight-softcaps": {"family": "gemma3", "attn_softcap": 5.0, "final_softcap": 1.0},
}
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 279, 72)]
TOLERANCE = 1e-4  # relative to the largest logit; measured: 2e-6..6e-6
MOVED = 1e-3  # what a mutant must move the logits by, at least


def _relative(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _logits(backend: Any, ids: list[int] = PROMPT) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = backend.forward(backend.new_cache(), 0, tokens=ids, logits="all")
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def models(folder: pathlib.Path) -> dict[str, ModelFile]:
    return {name: open_model(write_tiny_model(folder / f"{name}.gguf", **kw))
            for name, kw in CASES.items()}  # fmt: skip


@pytest.fixture(scope="module")
def reference(models: dict[str, ModelFile]) -> dict[str, np.ndarray[Any, Any]]:
    return {name: _logits(NumpyBackend(model)) for name, model in models.items()}


def test_the_prompt_is_longer_than_every_window(models: dict[str, ModelFile]) -> None:
    windows = {name: m.config.sliding_window for name, m in models.items()}
    assert windows["gemma3"] > 0 and windows["llama-window"] == 24
    assert all(w < len(PROMPT) for w in windows.values())
    assert [models["gemma3"].config.is_local(i) for i in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize("name", CASES)
def test_logits_match_numpy(
    name: str, models: dict[str, ModelFile], reference: dict[str, np.ndarray[Any, Any]]
) -> None:
    got = _logits(TorchBackend(models[name], device="cpu"))
    assert _relative(got, reference[name]) < TOLERANCE, name


@pytest.mark.parametrize("name", CASES)
def test_three_stages_give_the_unsplit_logits(name: str, models: dict[str, ModelFile]) -> None:
    model = models[name]
    whole = _logits(TorchBackend(model, device="cpu"))
    bounds = np.linspace(0, model.config.n_layers, 4).round().astype(int)
    out: Any = None
    for lo, hi in itertools.pairwise(bounds):
        stage = TorchBackend(model, (int(lo), int(hi)), device="cpu")
        kw = {"tokens": PROMPT} if lo == 0 else {"hidden": out}
        out = stage.forward(stage.new_cache(), 0, logits="all", **kw)
    assert np.array_equal(out, whole), name


def test_decoding_past_the_window_matches_numpy(models: dict[str, ModelFile]) -> None:
    """One token at a time: a decode row sees its window through the keys it is given."""
    model = models["gemma3-softcaps"]
    tb, nb = TorchBackend(model, device="cpu"), NumpyBackend(model)
    tc, nc = tb.new_cache(), nb.new_cache()
    tb.forward(tc, 0, tokens=PROMPT[:30])
    nb.forward(nc, 0, tokens=PROMPT[:30])
    for p in range(30, len(PROMPT)):
        got = tb.forward(tc, p, tokens=[PROMPT[p]])
        want = nb.forward(nc, p, tokens=[PROMPT[p]])
        assert _relative(got, want) < TOLERANCE, p


# --- the oracle can fail ------------------------------------------------------------------

Mutant = Callable[[TorchBackend, pytest.MonkeyPatch], None]


def _no_window(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(b, "_windows", [0] * len(b._windows))


def _one_rope_base(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(b, "_ropes", [b._ropes[-1]] * len(b._ropes))  # gemma3: every layer global


def _plain_rope(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    c = b.config
    plain = RopeTable(c.head_dim, c.rope_base, 1.0, None, limit=512, device=b.device, dtype=b.dtype)
    mp.setattr(b, "_ropes", [plain] * len(b._ropes))


def _no_score_cap(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(_backend, "attention", lambda q, k, v, m, cap: attention(q, k, v, m, 0.0))


def _no_logit_cap(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(_backend, "softcap", lambda x, cap: x)


def _silu(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(b, "_gelu", False)


def _no_embedding_scale(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
    assert b._embd is not None
    mp.setattr(b, "_embd", b._embd / b.config.d_model**0.5)


def _drop(*names: str) -> Mutant:
    def mutate(b: TorchBackend, mp: pytest.MonkeyPatch) -> None:
        for layer in b._layers:
            for attr in names:
                mp.setattr(layer, attr, None)

    mutate.__name__ = f"_no_{'_'.join(names)}"
    return mutate


MUTANTS: list[tuple[str, Mutant]] = [
    ("gemma3", _no_window),
    ("llama-window", _no_window),
    ("gemma3", _one_rope_base),
    ("llama-linear-rope", _plain_rope),
    ("llama-rope-factors", _plain_rope),
    ("gemma3-softcaps", _no_score_cap),
    ("gemma3-tight-softcaps", _no_score_cap),
    ("gemma3-tight-softcaps", _no_logit_cap),
    ("gemma3", _silu),
    ("gemma3", _no_embedding_scale),
    ("gemma3", _drop("post_attn", "post_ffn")),
    ("qwen3", _drop("q_norm", "k_norm")),
    ("qwen2", _drop("qkv_bias")),
]


@pytest.mark.parametrize(("name", "mutant"), MUTANTS, ids=lambda x: getattr(x, "__name__", x))
def test_a_backend_without_the_trait_fails_the_oracle(
    name: str,
    mutant: Mutant,
    models: dict[str, ModelFile],
    reference: dict[str, np.ndarray[Any, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = TorchBackend(models[name], device="cpu")
    mutant(backend, monkeypatch)
    assert _relative(_logits(backend), reference[name]) > MOVED


# --- conformance and batches -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "gemma3-softcaps", "phi3", "qwen2"])
def test_passes_the_backend_conformance_suite(name: str, models: dict[str, ModelFile]) -> None:
    """Batches included: each session's result bitwise its own alone."""
    check_backend(
        lambda model, layers, threads=None: TorchBackend(model, layers, device="cpu"),
        models[name],
    )


@pytest.mark.parametrize("n_threads", [1, 2, 5])
@pytest.mark.parametrize("width", [279, 1500, 2048])
def test_gelu_and_softcap_rows_do_not_depend_on_the_batch(n_threads: int, width: int) -> None:
    """Measured: F.gelu over a contiguous [R, 1500] on one thread moves most rows with R, and
    goes parallel from 16384 elements (row 58 of 117 rows of 279 moved on 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        _check_rows(width)
    finally:
        torch.set_num_threads(before)


def _check_rows(width: int) -> None:
    rng = np.random.default_rng(width)
    x = torch.from_numpy(3 * rng.standard_normal((160, 2 * width), dtype=np.float32))
    ops: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t: gelu_tanh_mul(t[:, :width], t[:, width:]),
        lambda t: softcap(t[:, :width].contiguous(), 30.0),
    ]
    for op in ops:
        alone = torch.cat([op(x[r : r + 1]) for r in range(x.shape[0])])
        for n in [2, 3, 7, 16, 21, 33, 58, 59, 64, 117, 118, 127, 160]:
            start = int(rng.integers(0, x.shape[0] - n + 1))
            assert torch.equal(op(x[start : start + n]), alone[start : start + n]), n


def _solo_and_batched(backend: TorchBackend, seed: int) -> tuple[list[Any], list[Any]]:
    """Sessions' next forwards (1 to 130 rows, past windows and slices), alone and batched."""
    rng = np.random.default_rng(seed)
    sizes = [1, 7, 1, 40, 3, 130, 2, 1, 64, 33]
    filled = [int(p) for p in rng.integers(0, 60, len(sizes))]

    def rows(n: int) -> dict[str, Any]:
        if backend.is_first:
            return {"tokens": rng.integers(0, backend.vocab_size, n)}
        return {"hidden": rng.standard_normal((n, backend.d_model)).astype(np.float32)}

    before, new = [rows(p) for p in filled], [rows(n) for n in sizes]
    logits: list[Any] = ["all" if k % 3 else "last" for k in range(len(sizes))]

    def caches() -> list[Any]:
        made = [backend.new_cache() for _ in sizes]
        for cache, p, kw in zip(made, filled, before, strict=True):
            if p:
                backend.forward(cache, 0, **kw)
        return made

    solo = [backend.forward(c, p, logits=lg, **kw)
            for c, p, kw, lg in zip(caches(), filled, new, logits, strict=True)]  # fmt: skip
    order = [int(k) for k in rng.permutation(len(sizes))]
    made = caches()
    items = [ForwardItem(made[k], filled[k], logits=logits[k], **new[k]) for k in order]
    batched: list[Any] = [None] * len(sizes)
    for k, result in zip(order, backend.forward_batch(items), strict=True):
        batched[k] = result
    return solo, batched


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("name", ["gemma3-softcaps", "qwen3", "llama-window"])
def test_a_batch_is_bitwise_its_items_alone(
    name: str, n_threads: int, models: dict[str, ModelFile]
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        for layers in [(0, models[name].config.n_layers), (1, 3)]:
            backend = TorchBackend(models[name], layers, device="cpu")
            solo, batched = _solo_and_batched(backend, seed=layers[0])
            for k, (want, got) in enumerate(zip(solo, batched, strict=True)):
                assert np.array_equal(got, want), (layers, k, float(np.abs(got - want).max()))
    finally:
        torch.set_num_threads(before)


# --- int4 and other block types --------------------------------------------------------------


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_q4(request: pytest.FixtureRequest, folder: pathlib.Path) -> ModelFile:
    family = request.param
    return open_model(write_tiny_model(folder / f"{family}-q4.gguf", family=family, weights="Q4_0"))


def test_int4_runs_every_family_close_to_numpy(family_q4: ModelFile) -> None:
    """bfloat16 activations against float32: the llama.cpp bar of the int4 tests."""
    want = _logits(NumpyBackend(family_q4))
    got = _logits(TorchInt4Backend(family_q4))
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_int4_on_gemma3_passes_the_conformance_suite(folder: pathlib.Path) -> None:
    path = write_tiny_model(folder / "gemma3-caps-q4.gguf", family="gemma3", weights="Q4_1",
                            attn_softcap=50.0, final_softcap=30.0)  # fmt: skip
    check_backend(lambda model, layers, threads=None: TorchInt4Backend(model, layers),
                  open_model(path))  # fmt: skip


def test_other_block_types_run_float_and_int4_refuses_them(folder: pathlib.Path) -> None:
    model = open_model(write_tiny_model(folder / "phi3-q8.gguf", family="phi3", weights="Q8_0"))
    want = _logits(NumpyBackend(model))
    assert _relative(_logits(TorchBackend(model, device="cpu")), want) < TOLERANCE
    with pytest.raises(UnsupportedModelError, match=r"attn_qkv.weight is Q8_0\. Use .*'torch'"):
        TorchInt4Backend(model)


@pytest.mark.slow
def test_the_real_gemma3_matches_numpy_past_its_window() -> None:
    """Gemma 3 270M's first six blocks (five local, one global; K-quants dequantized by
    stagerun): hidden states over 600 positions, past its window of 512."""
    model = open_model("gemma3-270m")
    assert model.config.sliding_window == 512
    ids = [int(t) for t in np.random.default_rng(1).integers(1000, 200_000, 600)]
    nb, tb = NumpyBackend(model, (0, 6)), TorchBackend(model, (0, 6), device="cpu")
    want = nb.forward(nb.new_cache(), 0, tokens=ids)
    got = tb.forward(tb.new_cache(), 0, tokens=ids)
    assert _relative(got, want) < TOLERANCE  # measured 8.9e-6 (all 18 blocks' logits: 3.3e-6)
    tb._windows = [0] * 6
    assert _relative(tb.forward(tb.new_cache(), 0, tokens=ids), want) > MOVED  # 5.3e-2
    with pytest.raises(UnsupportedModelError, match=r"need Q4_0 or Q4_1 .* Use .*'torch'"):
        TorchInt4Backend(model, (0, 6))
