"""K-quant files (Q4_K, Q5_K, Q6_K): they load in numpy and torch and compute what llama.cpp does.

gguf-py cannot write K-quants, so `stagerun.testing._kquants` writes them (plain rounding into
ggml's block layouts). ggml's own dequantizer (``ggml_get_type_traits(type)->to_float``, from
llama.cpp's library) decodes those blocks to bitwise the values gguf-py's does, and gguf-py
decodes ggml's reference quantizer's blocks bitwise as ggml does: the layouts are ggml's.
Then a model: the numpy and float torch backends dequantize with gguf-py, llama.cpp multiplies
with its own kernels (on 8-bit activations, so its logits are noisier: 6-7% of the largest
logit on this tiny model even for Q8_0 and Q4_0, which gguf-py writes itself). The real
Gemma 3 270M file (Q4_K and Q6_K among others) is checked against transformers in
test_gemma3.py.
"""

from __future__ import annotations

import ctypes
import gc
import pathlib

import gguf
import numpy as np
import pytest

from stagerun._errors import UnsupportedModelError
from stagerun.backends import NumpyBackend
from stagerun.model import open_model
from stagerun.testing import write_tiny_model
from stagerun.testing._kquants import K_QUANTS, quantize_k

IDS = [5, 17, 99, 130, 44, 250, 3, 9, 77, 12, 200, 31] * 3
# the rms error of plain rounding, relative to the values' rms: about halved per bit
ROUNDING = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.03}


_CONVERT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits, ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", _CONVERT),
        ("from_float_ref", _CONVERT),
    ]


def _ggml_traits(kind: str) -> _TypeTraits:
    import llama_cpp

    lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    traits: _TypeTraits = lib.ggml_get_type_traits(int(gguf.GGMLQuantizationType[kind])).contents
    assert traits.type_name.decode().upper() == kind
    return traits


@pytest.mark.llama_cpp
@pytest.mark.parametrize("kind", K_QUANTS)
def test_our_blocks_are_ggml_s_layout(kind: str) -> None:
    traits, qtype = _ggml_traits(kind), gguf.GGMLQuantizationType[kind]
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    blocks = np.ascontiguousarray(quantize_k(x, kind))
    theirs = np.empty(x.size, np.float32)
    traits.to_float(blocks.ctypes.data, theirs.ctypes.data, x.size)
    assert np.array_equal(gguf.quants.dequantize(blocks, qtype).ravel(), theirs)
    reference = np.empty(blocks.size, np.uint8)  # ggml's own quantizer's blocks
    traits.from_float_ref(x.ctypes.data, reference.ctypes.data, x.size)
    traits.to_float(reference.ctypes.data, theirs.ctypes.data, x.size)
    decoded = gguf.quants.dequantize(reference.reshape(4, -1), qtype).ravel()
    assert np.array_equal(decoded, theirs)
    ours = gguf.quants.dequantize(blocks, qtype).ravel()
    # plain rounding is within 25% of ggml's search for the best scales
    assert np.sqrt(((ours - x.ravel()) ** 2).mean()) < 1.25 * np.sqrt(
        ((theirs - x.ravel()) ** 2).mean()
    )


@pytest.mark.parametrize("kind", K_QUANTS)
def test_blocks_decode_to_within_a_rounding_step(kind: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 2.0, (6, 1))).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    x[1, :32] = np.abs(x[1, :32])  # a sub-block with no negative value
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = quantize_k(x, kind)
    assert blocks.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    y = gguf.quants.dequantize(blocks, qtype)
    assert np.all(y[0, :256] == 0.0)
    error = np.sqrt(((y - x) ** 2).mean(axis=1) / (x**2).mean(axis=1))
    assert error.max() < ROUNDING[kind], f"{kind}: {error}"
    other = quantize_k(x[::-1], kind)  # the oracle can fail: other values, other blocks
    assert np.abs(gguf.quants.dequantize(other, qtype) - x).max() > 0.1


@pytest.fixture(scope="module", params=K_QUANTS)
def kquant_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> pathlib.Path:
    path = tmp_path_factory.mktemp(request.param) / "k.gguf"
    return write_tiny_model(
        path, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, weights=request.param
    )


@pytest.mark.llama_cpp
def test_numpy_torch_and_llama_cpp_agree_on_a_k_quant_file(kquant_model: pathlib.Path) -> None:
    from stagerun_llamacpp import LlamaCppBackend
    from stagerun_torch import TorchBackend, TorchInt4Backend

    model = open_model(kquant_model)
    kinds = {model._tensors[n].tensor_type.name for n in model.tensor_names() if "attn_q" in n}
    assert len(kinds) == 1 and kinds <= set(K_QUANTS)
    numpy_backend = NumpyBackend(model)
    want = numpy_backend.forward(numpy_backend.new_cache(), 0, tokens=IDS, logits="all")
    torch_backend = TorchBackend(model, device="cpu")
    got = torch_backend.forward(torch_backend.new_cache(), 0, tokens=IDS, logits="all")
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    llama = LlamaCppBackend(model)
    theirs = llama.forward(llama.new_cache(), 0, tokens=IDS, logits="all")
    del llama
    gc.collect()
    error = float(np.abs(theirs - want).max() / np.abs(want).max())
    correlation = float(np.corrcoef(theirs.ravel(), want.ravel())[0, 1])
    # llama.cpp's 8-bit activations: 0.08-0.13 here, 0.06-0.07 for Q8_0 and Q4_0
    assert error < 0.2 and correlation > 0.995, f"{kinds}: {error:.3g}, {correlation:.5f}"
    assert (theirs.argmax(axis=1) == want.argmax(axis=1)).mean() > 0.9
    with pytest.raises(UnsupportedModelError, match="Use the float weights"):
        TorchInt4Backend(model, device="cpu")


@pytest.mark.llama_cpp
def test_a_k_quant_file_read_wrong_is_far_from_llama_cpp(tmp_path: pathlib.Path) -> None:
    """The oracle can fail: Q5_K blocks read with Q4_K's layout give other logits."""
    from stagerun_llamacpp import LlamaCppBackend

    path = write_tiny_model(tmp_path / "k.gguf", d_model=256, d_ff=512, weights="Q5_K")
    model = open_model(path)
    llama = LlamaCppBackend(model)
    theirs = llama.forward(llama.new_cache(), 0, tokens=IDS, logits="all")
    del llama
    gc.collect()
    q5 = gguf.GGMLQuantizationType.Q5_K
    wrong = {n: t for n, t in model._tensors.items() if t.tensor_type == q5}
    original = gguf.quants.dequantize

    def misread(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        if qtype != q5:
            return original(data, qtype)
        blocks = data.reshape(-1, 176)
        as_q4 = np.concatenate([blocks[:, :16], blocks[:, 48:]], axis=1)  # drop the fifth bits
        return original(as_q4, gguf.GGMLQuantizationType.Q4_K).reshape(data.shape[0], -1)

    assert wrong
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "dequantize", misread)
        backend = NumpyBackend(model)
    got = backend.forward(backend.new_cache(), 0, tokens=IDS, logits="all")
    assert np.corrcoef(got.ravel(), theirs.ravel())[0, 1] < 0.99
