"""The torch backend computes what the numpy reference computes, on any layer range."""

from __future__ import annotations

import numpy as np
import pytest
from stagerun_torch import TorchBackend

from stagerun import ComputeCancelled, plugins
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


def test_registered_as_the_torch_backend() -> None:
    plugins.refresh()
    assert plugins.backend("torch") is TorchBackend


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
    from stagerun._cli import build_parser

    args = build_parser().parse_args(
        ["stage", "--layers", "0:2", "--backend", "torch", "--device", "cpu"]
    )
    assert args.device == "cpu" and args.backend == "torch"
    args = build_parser().parse_args(
        ["generate", "x", "--backends", "numpy,torch", "--device", "cpu"]
    )
    assert args.device == "cpu" and args.backends == ("numpy", "torch")
