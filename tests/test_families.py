"""Model families beyond llama: Qwen2 (attention biases) and Qwen3 (query and key norms).

Each family's tiny random GGUF (`write_tiny_model(family=...)`) is checked against Hugging
Face transformers reading the same file: its own dequantizer, tensor mapping and model code,
an implementation independent of ours. Then the numpy backend's conformance suite, splits
across stages, llama.cpp on the same file, and a clear refusal where a backend does not run
a family.
"""

from __future__ import annotations

import gc
import pathlib
import warnings
from typing import Any

import attrs
import numpy as np
import pytest
from _oracle import assert_varied

from stagerun import open_pipeline
from stagerun._errors import UnsupportedModelError
from stagerun.backends import NumpyBackend
from stagerun.model import FAMILIES as BUILT_IN
from stagerun.model import ModelFile, open_model
from stagerun.testing import check_backend, write_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3")
IDS = [5, 17, 99, 130, 44, 250, 3, 9, 77, 12, 200, 31]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, write_tiny_model(folder / "tiny.gguf", family=request.param)


def _transformers_logits(path: pathlib.Path, ids: list[int]) -> np.ndarray:
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        # transformers' GGUF mapping reads no head size for qwen3 (it defaults to 128)
        config.head_dim = config.hidden_size // config.num_attention_heads
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
        missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.eval()
    with torch.no_grad():
        logits: np.ndarray = model(torch.tensor([ids])).logits[0].numpy()
    return logits


@pytest.mark.slow
def test_each_family_s_logits_match_transformers_on_the_same_file(family_model: Any) -> None:
    family, path = family_model
    model = open_model(path)
    assert model.config.family.name == family
    backend = NumpyBackend(model)
    ours = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    reference = _transformers_logits(path, IDS)
    error = float(np.abs(ours - reference).max() / np.abs(reference).max())
    assert error < 1e-4, f"{family}: relative difference {error:.3g}"


def test_a_family_s_traits_change_its_logits(tmp_path: pathlib.Path) -> None:
    """The oracle can fail: the same draws read as llama would give other logits."""
    path = write_tiny_model(tmp_path / "qwen3.gguf", family="qwen3")
    model = open_model(path)
    backend = NumpyBackend(model)
    want = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    own = model.config
    model.config = attrs.evolve(own, family=BUILT_IN["llama"])  # the file read as llama's
    try:
        other = NumpyBackend(model)
        got = other.forward(other.new_cache(), 0, tokens=IDS, logits="all")
    finally:
        model.config = own
    assert np.abs(got - want).max() > 1e-2


def test_the_numpy_backend_passes_the_conformance_suite_on_every_family(
    family_model: Any,
) -> None:
    _, path = family_model
    check_backend(NumpyBackend, open_model(path))


async def test_a_split_across_stages_gives_one_stage_s_tokens(family_model: Any) -> None:
    family, path = family_model
    outputs = []
    for layers in ([(0, 4)], [(0, 1), (1, 3), (3, 4)]):
        async with open_pipeline(path, layers=layers) as pipeline:
            result = await pipeline.complete(IDS, max_tokens=24, ignore_eog=True)
            outputs.append(result.token_ids)
    assert_varied(outputs[0])
    assert outputs[1] == outputs[0], family


def test_llama_cpp_runs_each_family_split_in_two(family_model: Any) -> None:
    from stagerun_llamacpp import LlamaCppBackend

    family, path = family_model
    model = open_model(path)
    full = NumpyBackend(model)
    reference = full.forward(full.new_cache(), 0, tokens=IDS, logits="all")
    first, last = LlamaCppBackend(model, (0, 2)), LlamaCppBackend(model, (2, 4))
    hidden = first.forward(first.new_cache(), 0, tokens=IDS, logits="all")
    got = last.forward(last.new_cache(), 0, hidden=hidden, logits="all")
    del first, last  # freed now, not at interpreter exit (llama.cpp's logging is gone then)
    gc.collect()
    error = float(np.abs(got - reference).max() / np.abs(reference).max())
    assert error < 1e-2, f"{family}: llama.cpp differs by {error:.3g} (relative)"  # its f16 paths
    assert (got.argmax(axis=1) == reference.argmax(axis=1)).mean() > 0.9


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_torch_backend_refuses_a_family_it_does_not_run(
    family: str, tmp_path: pathlib.Path
) -> None:
    from stagerun_torch import TorchBackend

    model: ModelFile = open_model(write_tiny_model(tmp_path / "m.gguf", family=family))
    with pytest.raises(UnsupportedModelError, match=f"is a {family} model.*numpy"):
        TorchBackend(model, device="cpu")


def test_an_unknown_family_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        write_tiny_model(tmp_path / "m.gguf", family="gpt2")
    path = write_tiny_model(tmp_path / "n.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3"):
        open_model(path)


def test_a_sliding_window_is_refused_until_it_is_supported(tmp_path: pathlib.Path) -> None:
    import gguf

    """A Mistral file is a llama file; one that declares a window would be computed wrong."""
    path = write_tiny_model(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(tmp_path / "window.gguf", "llama")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_sliding_window(128)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="sliding-window attention \\(128 of 512"):
        open_model(tmp_path / "window.gguf")
