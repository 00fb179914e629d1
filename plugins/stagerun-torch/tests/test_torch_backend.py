"""The torch backend computes what the numpy reference computes, on any layer range."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from stagerun_torch import TorchBackend, TorchInt4Backend
from stagerun_torch._backend import _cpu_takes_bfloat16
from stagerun_torch._matrices import HAS_ONEDNN, Dense, Int4, OneDNN, silu_mul, unpack_q4

from stagerun import ComputeCancelled, plugins
from stagerun.abc import ForwardItem
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile, open_model
from stagerun.testing import check_backend, write_tiny_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a lighthouse by the sea, there lived",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelFile:
    return open_model(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1"])
def tiny_q4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelFile:
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    return open_model(write_tiny_model(path, weights=request.param))


def test_registered_as_the_torch_backends() -> None:
    plugins.refresh()
    assert plugins.backend("torch") is TorchBackend
    assert plugins.backend("torch-int4") is TorchInt4Backend


def test_int4_blocks_unpack_to_the_dequantized_weights(tiny_q4: ModelFile) -> None:
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        q, scale, zero = unpack_q4(tiny_q4.quantized(name))
        group = np.repeat(np.arange(scale.shape[1]), 32)
        rebuilt = (q - 8) * scale[:, group] + zero[:, group]
        np.testing.assert_allclose(rebuilt, tiny_q4.load_tensor(name), rtol=0, atol=1e-6)


def test_int4_passes_the_backend_conformance_suite(tiny_q4: ModelFile) -> None:
    check_backend(lambda model, layers, threads=None: TorchInt4Backend(model, layers), tiny_q4)


def test_int4_agrees_with_numpy_on_the_same_blocks(tiny_q4: ModelFile) -> None:
    ids = list(range(5, 40))
    want = NumpyBackend(tiny_q4).forward(
        NumpyBackend(tiny_q4).new_cache(), 0, tokens=ids, logits="all"
    )
    int4 = TorchInt4Backend(tiny_q4)
    got = int4.forward(int4.new_cache(), 0, tokens=ids, logits="all")
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999
    # The tiny model's logits have close runners-up (it is built to vary): the top-1 may flip
    # where the lead is small, never where it is clear.
    top2 = np.sort(want, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.25 * want.std()
    agree = got.argmax(-1) == want.argmax(-1)
    assert agree[clear].all() and clear.sum() >= 5
    assert agree.mean() >= 0.9


def test_int4_refuses_other_block_types_and_devices(tiny: ModelFile) -> None:
    from stagerun import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"need Q4_0 or Q4_1 .* is F32"):
        TorchInt4Backend(tiny)
    with pytest.raises(ValueError, match="int4 weights run on the CPU only"):
        TorchBackend(tiny, device="cuda", weights="int4")
    with pytest.raises(ValueError, match="weights must be 'float' or 'int4'"):
        TorchBackend(tiny, weights="int8")


def test_passes_the_backend_conformance_suite(tiny: ModelFile) -> None:
    check_backend(
        lambda model, layers, threads=None: TorchBackend(model, layers, device="cpu"), tiny
    )


def test_half_precision_is_refused_on_the_cpu(tiny: ModelFile) -> None:
    with pytest.raises(ValueError, match="float16 is for CUDA"):
        TorchBackend(tiny, device="cpu", dtype="float16")


def test_should_stop_leaves_the_cache_at_the_position(tiny: ModelFile) -> None:
    backend = TorchBackend(tiny, device="cpu")
    cache = backend.new_cache()
    backend.forward(cache, 0, tokens=[1, 2, 3])
    with pytest.raises(ComputeCancelled):
        backend.forward(cache, 3, tokens=[4], should_stop=lambda: True)
    assert cache.length == 3


# --- batches ----------------------------------------------------------------------------------


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Set torch's intra-op threads for a test (process-wide), restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _rows_differ(product: Callable[[torch.Tensor], torch.Tensor], width: int) -> dict[int, int]:
    """``{batch size: rows that differ from the row alone}``, rows at random offsets."""
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((160, width), dtype=np.float32))
    with torch.inference_mode():
        alone = torch.cat([product(x[r : r + 1]) for r in range(x.shape[0])])
        differ = {}
        for n in [*range(2, 41), 63, 64, 65, 127, 128, 129, 160]:
            start = int(rng.integers(0, x.shape[0] - n + 1))
            rows = (product(x[start : start + n]) != alone[start : start + n]).any(dim=1)
            if rows.any():
                differ[n] = int(rows.sum())
    return differ


def _weights(rows: int, cols: int) -> torch.Tensor:
    rng = np.random.default_rng(rows * cols)
    return torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05)


# The default model's shapes (out, in): Q/K/V fused, ffn_down; the head's input width.
SHAPES = [(960, 576), (576, 1536)]


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN")
@pytest.mark.parametrize("n_threads", [1, 2, 5])
def test_matrix_rows_do_not_depend_on_the_batch(
    threads: Callable[[int], None], n_threads: int
) -> None:
    """Measured: unblocked, oneDNN's one-row path (ffn_down) and its bfloat16 kernel past 32
    rows give other sums; `in_blocks` keeps every call to shapes that agree."""
    threads(n_threads)
    rng = np.random.default_rng(3)
    for out, width in SHAPES:
        assert _rows_differ(OneDNN(_weights(out, width), torch.float32), width) == {}
        assert _rows_differ(Dense(_weights(out, width)), width) == {}
        q = rng.integers(0, 16, (out, width)).astype(np.int32)
        scale = rng.random((out, width // 32), dtype=np.float32) * 0.01
        assert _rows_differ(Int4(q, scale, scale), width) == {}
    if _cpu_takes_bfloat16(torch.device("cpu")):  # the int4 head's kernel, where it exists
        assert _rows_differ(OneDNN(_weights(4096, 576), torch.bfloat16), 576) == {}


@pytest.mark.parametrize("n_threads", [2, 5])
@pytest.mark.parametrize("width", [1536, 1500])
def test_silu_rows_do_not_depend_on_the_batch(
    threads: Callable[[int], None], n_threads: int, width: int
) -> None:
    """Measured: one F.silu over 128 rows of 1536 on 5 threads gave 4 rows other values."""
    threads(n_threads)
    assert _rows_differ(lambda gu: silu_mul(gu[:, :width], gu[:, width:]), 2 * width) == {}


def test_a_batch_must_not_share_a_cache(tiny: ModelFile) -> None:
    backend = TorchBackend(tiny, device="cpu")
    cache = backend.new_cache()
    with pytest.raises(ValueError, match="share a KV cache"):
        backend.forward_batch([ForwardItem(cache, 0, [1]), ForwardItem(cache, 0, [2])])
    assert backend.forward_batch([]) == []


def _solo_and_batched(backend: TorchBackend, seed: int) -> tuple[list[Any], list[Any]]:
    """Twelve sessions' next forwards (1 to 130 rows), alone and as one shuffled batch."""
    rng = np.random.default_rng(seed)
    sizes = [1, 7, 1, 40, 3, 1, 130, 2, 1, 1, 64, 33]
    filled = [int(p) for p in rng.integers(0, 30, len(sizes))]

    def rows(n: int) -> dict[str, Any]:
        if backend.is_first:
            return {"tokens": rng.integers(0, backend.vocab_size, n)}
        return {"hidden": rng.standard_normal((n, backend.d_model)).astype(np.float32)}

    before = [rows(p) for p in filled]
    new = [rows(n) for n in sizes]

    def caches() -> list[Any]:
        made = [backend.new_cache() for _ in sizes]
        for cache, p, kw in zip(made, filled, before, strict=True):
            if p:
                backend.forward(cache, 0, **kw)
        return made

    logits: list[Literal["last", "all"]] = ["all" if k % 3 else "last" for k in range(len(sizes))]
    solo = [
        backend.forward(c, p, logits=lg, **kw)
        for c, p, kw, lg in zip(caches(), filled, new, logits, strict=True)
    ]
    order = [int(k) for k in rng.permutation(len(sizes))]
    made = caches()
    items = [ForwardItem(made[k], filled[k], logits=logits[k], **new[k]) for k in order]
    batched: list[Any] = [None] * len(sizes)
    for k, result in zip(order, backend.forward_batch(items), strict=True):
        batched[k] = result
    return solo, batched


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", [1, 2, 5])
@pytest.mark.parametrize("backend_class", [TorchBackend, TorchInt4Backend])
def test_a_batch_is_bitwise_its_items_alone_on_the_default_model(
    smollm2: ModelFile, threads: Callable[[int], None], n_threads: int, backend_class: type
) -> None:
    threads(n_threads)
    for layers in [(0, 3), (27, 30)]:
        solo, batched = _solo_and_batched(backend_class(smollm2, layers), seed=layers[0])
        for k, (want, got) in enumerate(zip(solo, batched, strict=True)):
            assert np.array_equal(got, want), (layers, k, float(np.abs(got - want).max()))


@pytest.mark.slow
def test_float32_logits_match_numpy_on_the_default_model(smollm2: ModelFile) -> None:
    torch_backend = TorchBackend(smollm2, device="cpu")
    numpy_backend = NumpyBackend(smollm2)
    tokenizer = smollm2.tokenizer
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        want = numpy_backend.forward(numpy_backend.new_cache(), 0, tokens=ids, logits="all")
        got = torch_backend.forward(torch_backend.new_cache(), 0, tokens=ids, logits="all")
        relative = np.abs(got - want).max() / np.abs(want).max()
        assert relative < 1e-3, (prompt, relative)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow
def test_int4_logits_agree_with_numpy_on_the_default_model(smollm2: ModelFile) -> None:
    """The llama.cpp bar: correlation >= 0.999 and top-1 on >= 95% of positions."""
    int4 = TorchInt4Backend(smollm2)
    numpy_backend = NumpyBackend(smollm2)
    got, want = [], []
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.encode(prompt)
        want.append(numpy_backend.forward(numpy_backend.new_cache(), 0, tokens=ids, logits="all"))
        got.append(int4.forward(int4.new_cache(), 0, tokens=ids, logits="all"))
    g, w = np.concatenate(got), np.concatenate(want)
    assert np.corrcoef(g.ravel(), w.ravel())[0, 1] >= 0.999
    assert (g.argmax(-1) == w.argmax(-1)).mean() >= 0.95


@pytest.mark.slow
def test_split_stages_match_numpy_stage_by_stage(smollm2: ModelFile) -> None:
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    hidden_t: np.ndarray | None = None
    hidden_n: np.ndarray | None = None
    for lo, hi in [(0, 10), (10, 20), (20, 30)]:
        tb, nb = TorchBackend(smollm2, (lo, hi), device="cpu"), NumpyBackend(smollm2, (lo, hi))
        kw_t = {"tokens": ids} if lo == 0 else {"hidden": hidden_t}
        kw_n = {"tokens": ids} if lo == 0 else {"hidden": hidden_n}
        hidden_t = tb.forward(tb.new_cache(), 0, logits="all", **kw_t)
        hidden_n = nb.forward(nb.new_cache(), 0, logits="all", **kw_n)
    assert hidden_t is not None and hidden_n is not None
    assert np.abs(hidden_t - hidden_n).max() / np.abs(hidden_n).max() < 1e-3


@pytest.fixture(scope="module")
def smollm2() -> ModelFile:
    return open_model("smollm2")


async def test_mixed_pipeline_equals_numpy(tiny: ModelFile) -> None:
    from stagerun import open_pipeline

    outputs = []
    for backends in (["numpy"] * 3, ["numpy", "torch", "numpy"], ["torch", "numpy", "torch"]):
        async with open_pipeline(tiny, stages=3, backends=backends) as pipeline:
            result = await pipeline.complete("The lighthouse keeper", max_tokens=12)
            outputs.append(result.token_ids)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


async def test_backends_must_match_the_stages(tiny: ModelFile) -> None:
    from stagerun import open_pipeline

    with pytest.raises(ValueError, match="3 stages need 3 backends, got 2"):
        async with open_pipeline(tiny, stages=3, backends=["numpy", "torch"]):
            pass


async def test_device_goes_to_the_backends_that_take_one(tiny: ModelFile) -> None:
    from stagerun import open_pipeline

    async with open_pipeline(tiny, stages=2, backends=["numpy", "torch"], device="cpu") as p:
        assert (await p.complete("The lighthouse", max_tokens=4)).token_ids
    with pytest.raises(ValueError, match=r"--device cpu needs a backend with a device"):
        async with open_pipeline(tiny, stages=2, device="cpu"):
            pass
    with pytest.raises(plugins.PluginError, match="the numpy backend has no device option"):
        plugins.build_backend("numpy", tiny, None, threads=None, device="cpu")
    built = plugins.build_backend("torch", tiny, (0, 2), threads=None, device="cpu")
    assert str(built.device) == "cpu"


def test_stage_command_takes_a_device(tiny: ModelFile) -> None:
    from stagerun._cli._main import build_parser

    args = build_parser().parse_args(
        ["stage", "--layers", "0:2", "--backend", "torch", "--device", "cpu"]
    )
    assert args.device == "cpu" and args.backend == "torch"
    args = build_parser().parse_args(
        ["generate", "x", "--backends", "numpy,torch", "--device", "cpu"]
    )
    assert args.device == "cpu" and args.backends == ("numpy", "torch")


@pytest.mark.slow
def test_the_cuda_smoke_script_runs_its_checks_on_the_cpu() -> None:
    """The GPU script's logic, run where CI can run it; on a GPU host it takes no argument."""
    script = pathlib.Path(__file__).parents[1] / "scripts" / "cuda_smoke.sh"
    done = subprocess.run(
        ["bash", str(script), "cpu"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "float32: relative difference" in done.stdout
    assert done.stdout.rstrip().endswith("SMOKE OK on cpu")
