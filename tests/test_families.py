"""Model families: every built-in family (and trait) against Hugging Face transformers.

Each family's tiny random GGUF (`write_tiny_model(family=...)`) is checked against Hugging
Face transformers reading the same file: its own dequantizer, tensor mapping and model code,
an implementation independent of ours. Variants cover the traits a family's files may set:
a llama file with a sliding window (Mistral), linear and Llama 3 RoPE scaling. Then the numpy
backend's conformance suite, splits across stages, llama.cpp on the same file, and the
family registry.
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
from stagerun.model import open_model
from stagerun.testing import check_backend, check_family, write_tiny_model

FAMILIES = tuple(BUILT_IN)
# 72 positions: past the tiny windows (40, and 24 for the Mistral-like file) and a key block
IDS = [5, 17, 99, 130, 44, 250, 3, 9, 77, 12, 200, 31] * 6
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 10000.0,
}  # fmt: skip
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def _llama3_factors() -> np.ndarray:
    """Llama 3's divisors as the GGUF converter writes them: HF's frequencies over plain ones."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4)
    config.rope_parameters = dict(LLAMA3_ROPE)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    return np.asarray(plain / scaled.numpy(), np.float32)


# name: (write_tiny_model arguments, what the transformers config needs beyond the file's)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    **{f: ({"family": f, "tied_output": f != "phi3"}, {}) for f in FAMILIES},
    "mistral-window": ({"sliding_window": 24}, {"model_type": "mistral", "sliding_window": 24}),
    "llama-linear-rope": ({"rope_scaling": 2.0}, {"rope_parameters": LINEAR_ROPE}),
    "llama3-rope": ({"rope_factors": "llama3"}, {"rope_parameters": LLAMA3_ROPE}),
    "mistral-window-llama3-rope": (
        {"sliding_window": 24, "rope_factors": "llama3"},
        {"model_type": "mistral", "sliding_window": 24, "rope_parameters": LLAMA3_ROPE},
    ),
}


# Where llama.cpp computes another function than transformers on the same file, or cannot load
# a tiny one; these files are checked against transformers alone.
LLAMA_CPP_DIFFERS = {
    "phi3": "llama.cpp's phi3 vocabulary loader looks up Phi-3's own tokens",
    "mistral-window": "llama.cpp's llama architecture ignores a sliding window",
    "mistral-window-llama3-rope": "llama.cpp's llama architecture ignores a sliding window",
}


def _options(case: str) -> dict[str, Any]:
    """The `write_tiny_model` arguments of a case (Llama 3's divisors computed)."""
    options = dict(CASES[case][0])
    if options.get("rope_factors") == "llama3":
        options["rope_factors"] = _llama3_factors()
    return options


@pytest.fixture(scope="module", params=list(CASES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, write_tiny_model(folder / "tiny.gguf", **_options(request.param))


def _transformers_logits(path: pathlib.Path, ids: list[int], extra: dict[str, Any]) -> np.ndarray:
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        # transformers' GGUF mapping reads no head size for qwen3 (it defaults to 128), and
        # Gemma's query scale (defaults to 256) is llama.cpp's 1/sqrt(head_dim) in the file
        config.head_dim = config.hidden_size // config.num_attention_heads
        if hasattr(config, "query_pre_attn_scalar"):
            config.query_pre_attn_scalar = config.head_dim
        if getattr(config, "pad_token_id", None) is not None:
            config.pad_token_id = None  # phi3's default lies outside the tiny vocabulary
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
        kind = extra.get("model_type")
        if kind is not None:  # the same weights in another family's model (Mistral: llama's)
            fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
            config = transformers.AutoConfig.for_model(kind, **fields)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for key, value in extra.items():
            if key != "model_type":
                setattr(config, key, value)
        if "rope_parameters" in extra:  # the rotary tables are built from the config
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    if "lm_head.weight" in missing:
        model.tie_weights()
    model.eval()
    with torch.no_grad():
        logits: np.ndarray = model(torch.tensor([ids])).logits[0].numpy()
    return logits


@pytest.mark.slow
def test_each_family_s_logits_match_transformers_on_the_same_file(family_model: Any) -> None:
    case, path = family_model
    model = open_model(path)
    assert model.config.family.name == CASES[case][0].get("family", "llama")
    backend = NumpyBackend(model)
    ours = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    reference = _transformers_logits(path, IDS, CASES[case][1])
    error = float(np.abs(ours - reference).max() / np.abs(reference).max())
    assert error < 1e-4, f"{case}: relative difference {error:.3g}"


@pytest.mark.parametrize(
    ("case", "change"),
    [
        ("gemma3", {"sliding_window": 0}),  # the window ignored
        ("gemma3", {"local_rope_base": None}),  # one RoPE base for every layer
        ("mistral-window", {"sliding_window": 0}),
        ("llama-linear-rope", {"rope_scale": 1.0}),
        ("llama3-rope", {"rope_factors": False}),
        ("gemma3", {"family": attrs.evolve(BUILT_IN["gemma3"], activation="silu")}),
        ("gemma3", {"family": attrs.evolve(BUILT_IN["gemma3"], embedding_scale=False)}),
    ],
)
def test_each_trait_matters_to_the_reference(
    case: str, change: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    """The oracle can fail: the file with one trait read wrong is far from transformers."""
    options = _options(case)
    path = write_tiny_model(tmp_path / "m.gguf", **options)
    model = open_model(path)
    model.config = attrs.evolve(model.config, **change)
    backend = NumpyBackend(model)
    wrong = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    reference = _transformers_logits(path, IDS, CASES[case][1])
    assert np.abs(wrong - reference).max() / np.abs(reference).max() > 1e-3


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


@pytest.mark.parametrize("family", FAMILIES)
def test_every_built_in_family_passes_the_family_conformance_suite(
    family: str, tmp_path: pathlib.Path
) -> None:
    check_family(BUILT_IN[family], directory=tmp_path)


@pytest.mark.parametrize("case", [c for c in CASES if c not in FAMILIES])
def test_the_numpy_backend_passes_the_conformance_suite_on_every_variant(
    case: str, tmp_path: pathlib.Path
) -> None:
    """A windowed llama and scaled RoPE (check_family ran the families' own files)."""
    options = _options(case)
    check_backend(NumpyBackend, open_model(write_tiny_model(tmp_path / "m.gguf", **options)))


async def test_a_split_across_stages_gives_one_stage_s_tokens(family_model: Any) -> None:
    family, path = family_model
    n = open_model(path).config.n_layers
    outputs = []
    # gemma3 (6 layers): the middle stage holds local layers only, and the last split falls
    # between a local layer (4) and the global one (5)
    for layers in ([(0, n)], [(0, 2), (2, n - 1), (n - 1, n)]):
        async with open_pipeline(path, layers=layers) as pipeline:
            result = await pipeline.complete(IDS, max_tokens=24, ignore_eog=True)
            outputs.append(result.token_ids)
    assert_varied(outputs[0])
    assert outputs[1] == outputs[0], family


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case", [c for c in CASES if c not in LLAMA_CPP_DIFFERS])
def test_llama_cpp_runs_each_family_split_in_three(case: str, tmp_path: pathlib.Path) -> None:
    """gemma3: the slices hold local layers only, then the global one alone."""
    from stagerun_llamacpp import LlamaCppBackend

    options = _options(case)
    model = open_model(write_tiny_model(tmp_path / "m.gguf", **options))
    full = NumpyBackend(model)
    reference = full.forward(full.new_cache(), 0, tokens=IDS, logits="all")
    n = model.config.n_layers
    stages = [LlamaCppBackend(model, r) for r in ((0, 2), (2, n - 1), (n - 1, n))]
    got = stages[0].forward(stages[0].new_cache(), 0, tokens=IDS, logits="all")
    for stage in stages[1:]:
        got = stage.forward(stage.new_cache(), 0, hidden=got, logits="all")
    del stages  # freed now, not at interpreter exit (llama.cpp's logging is gone then)
    gc.collect()
    family = case
    error = float(np.abs(got - reference).max() / np.abs(reference).max())
    assert error < 1e-2, f"{family}: llama.cpp differs by {error:.3g} (relative)"  # its f16 paths
    assert (got.argmax(axis=1) == reference.argmax(axis=1)).mean() > 0.9


def test_an_unknown_family_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        write_tiny_model(tmp_path / "m.gguf", family="gpt2")
    path = write_tiny_model(tmp_path / "n.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="gemma3, llama, phi3, qwen2, qwen3 models"):
        open_model(path)
