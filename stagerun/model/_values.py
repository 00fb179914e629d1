"""What a GGUF model file is read into: its shape (`ModelConfig`) and one stage's weights."""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from ._families import FAMILIES, Family

F32 = npt.NDArray[np.float32]


@attrs.frozen
class ModelConfig:
    """The shape of a model, read from its GGUF metadata."""

    name: str
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    context_length: int
    tied_output: bool
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    family: Family = FAMILIES["llama"]  # the block layout (`stagerun.model._families`)
    sliding_window: int = 0  # positions a local layer sees, itself included; 0: none
    local_rope_base: float | None = None  # the local layers' RoPE base, if not rope_base
    rope_scale: float = 1.0  # linear RoPE scaling of the global layers: positions / scale
    rope_factors: bool = False  # the file has Llama 3's per-frequency divisors (rope_freqs)
    attn_softcap: float = 0.0  # scores become cap * tanh(scores / cap); 0: none (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits

    def is_local(self, layer: int) -> bool:
        """Whether block ``layer`` attends through the sliding window."""
        return self.family.is_local(layer, self.sliding_window)

    def layer_rope(self, layer: int) -> tuple[float, float, bool]:
        """Block ``layer``'s RoPE: base, linear scale, and whether Llama 3's factors apply.

        A local layer of a family with its own local base (Gemma 3) takes that base, unscaled
        (as Hugging Face's and llama.cpp's Gemma 3 do); every other layer takes the file's
        base, scaling and factors, windowed or not (a windowed llama file).
        """
        if self.is_local(layer) and self.local_rope_base is not None:
            return (self.local_rope_base, 1.0, False)
        return (self.rope_base, self.rope_scale, self.rope_factors)


@attrs.frozen(eq=False)
class LayerWeights:
    """One transformer block, float32, matrices as ``(out, in)``."""

    attn_norm: F32
    wq: F32
    wk: F32
    wv: F32
    wo: F32
    ffn_norm: F32
    w_gate: F32
    w_up: F32
    w_down: F32
    bq: F32 | None = None  # the family's extras (`Family.layer_tensors`)
    bk: F32 | None = None
    bv: F32 | None = None
    q_norm: F32 | None = None
    k_norm: F32 | None = None
    post_attn_norm: F32 | None = None
    post_ffn_norm: F32 | None = None


@attrs.frozen(eq=False)
class StageWeights:
    """The weights one stage needs: blocks ``lo..hi-1`` and, maybe, the ends of the model.

    ``output`` is the very same array as ``token_embd`` for a tied model that loads both.
    ``tensor_names`` lists what was dequantized from the file.
    """

    lo: int
    hi: int
    layers: tuple[LayerWeights, ...]
    token_embd: F32 | None
    output_norm: F32 | None
    output: F32 | None
    tensor_names: frozenset[str]


@attrs.frozen(eq=False)
class QuantizedTensor:
    """A 2-D tensor as the file stores it: ``shape[0]`` rows of GGUF blocks.

    ``data`` is a read-only ``uint8`` view of the mapped file, one row of blocks per output row
    (``shape`` is ``(out, in)``, like the dequantized matrices); ``qtype`` is the GGML type
    name (``"Q4_1"``, ``"Q8_0"``, ``"F32"``...).
    """

    name: str
    qtype: str
    shape: tuple[int, int]
    data: npt.NDArray[np.uint8]


@attrs.frozen
class StoredTensor:
    """Where one tensor lies in a GGUF file (`stagerun.model.ModelFile.stored`)."""

    name: str
    qtype: int  # the ggml type number (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K...)
    ne: tuple[int, ...]  # ggml's order: ne[0] is the row length
    offset: int  # bytes from the start of the file
    nbytes: int
