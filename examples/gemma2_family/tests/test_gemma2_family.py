"""The example family plugin: found through its entry point, conformant, and right.

`make test` installs it like a third party's package (``pip install -e``).
"""

from __future__ import annotations

import pathlib
import warnings

import attrs
import numpy as np
import pytest
from stagerun_gemma2 import GEMMA2

from stagerun import open_pipeline, plugins
from stagerun.backends import NumpyBackend
from stagerun.model import open_model
from stagerun.testing import check_family, write_tiny_model

SOFTCAPS = {"attn_softcap": 50.0, "final_softcap": 30.0}  # Gemma 2's own, as its files say
IDS = [5, 17, 99, 130, 44, 250, 3, 9, 77, 12, 200, 31] * 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma2") / "g.gguf", family=GEMMA2, **SOFTCAPS)


def test_the_entry_point_registers_the_family() -> None:
    plugins.refresh()
    assert plugins.family("gemma2") is GEMMA2
    info = next(i for i in plugins.installed("architectures") if i.name == "gemma2")
    assert info.distribution.startswith("stagerun-gemma2") and info.status == "loaded"


def test_the_family_passes_the_conformance_suite(tmp_path: pathlib.Path) -> None:
    check_family(GEMMA2, directory=tmp_path, **SOFTCAPS)


def test_its_logits_match_transformers(tiny: pathlib.Path) -> None:
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = open_model(tiny)
    assert model.config.family is GEMMA2 and model.config.attn_softcap == 50.0
    backend = NumpyBackend(model)
    ours = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(tiny.parent, gguf_file=tiny.name)
        config.head_dim = config.hidden_size // config.num_attention_heads
        config.query_pre_attn_scalar = config.head_dim  # llama.cpp's 1/sqrt(head_dim)
        config.pad_token_id = None
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
        hf = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
        tensors = load_gguf_checkpoint(str(tiny), return_tensors=True, model_to_load=hf)
        missing, unexpected = hf.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    hf.eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].numpy()
    error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    assert error < 1e-4, f"relative difference {error:.3g}"
    # the oracle can fail: without the softcaps the logits are elsewhere
    own, model.config = model.config, attrs.evolve(model.config, attn_softcap=0.0)
    try:
        uncapped = NumpyBackend(model)
        off = uncapped.forward(uncapped.new_cache(), 0, tokens=IDS)
    finally:
        model.config = own
    assert np.abs(off[-1] - theirs[-1]).max() / np.abs(theirs).max() > 1e-3


async def test_three_stages_give_one_stage_s_tokens(tiny: pathlib.Path) -> None:
    outputs = []
    for layers in ([(0, 4)], [(0, 1), (1, 3), (3, 4)]):
        async with open_pipeline(tiny, layers=layers) as pipeline:
            result = await pipeline.complete(IDS, max_tokens=24, ignore_eog=True)
            outputs.append(result.token_ids)
    assert len(set(outputs[0])) > 4  # varied, so a wrong split would show
    assert outputs[1] == outputs[0]


def test_a_file_without_a_template_gets_gemma_s(tiny: pathlib.Path) -> None:
    model = open_model(tiny)
    own, model.chat_template = model.chat_template, None
    try:
        text = model.render_chat([{"role": "user", "content": "hi"}])
    finally:
        model.chat_template = own
    assert text.endswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.llama_cpp
def test_torch_and_llama_cpp_run_it_too(tiny: pathlib.Path) -> None:
    """The backends run the plugin's traits; llama.cpp split in three (its own Gemma 2)."""
    import gc

    from stagerun_llamacpp import LlamaCppBackend
    from stagerun_torch import TorchBackend

    model = open_model(tiny)
    numpy_backend = NumpyBackend(model)
    want = numpy_backend.forward(numpy_backend.new_cache(), 0, tokens=IDS, logits="all")
    torch_backend = TorchBackend(model, device="cpu")
    got = torch_backend.forward(torch_backend.new_cache(), 0, tokens=IDS, logits="all")
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    stages = [LlamaCppBackend(model, r) for r in ((0, 1), (1, 3), (3, 4))]
    out = stages[0].forward(stages[0].new_cache(), 0, tokens=IDS, logits="all")
    for stage in stages[1:]:
        out = stage.forward(stage.new_cache(), 0, hidden=out, logits="all")
    del stages
    gc.collect()
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-2  # llama.cpp's float16 paths
    assert (out.argmax(axis=1) == want.argmax(axis=1)).mean() > 0.9
