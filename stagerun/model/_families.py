"""Model families: what sets one architecture's blocks apart from llama's, as data.

A family is how a GGUF file of one ``general.architecture`` lays out and runs its blocks. The
built-in ones differ from llama in three traits so far:

* ``rope_interleaved``: the GGUF converter permuted llama's (and Mistral's) Q/K rows so that
  llama.cpp rotates the pairs ``(2i, 2i+1)``; Qwen's files keep Hugging Face's order, whose
  RoPE rotates the halves ``(i, i + head_dim/2)`` (llama.cpp's NEOX mode);
* ``attention_bias``: Qwen2 adds a bias to the Q, K and V projections (``attn_q.bias``...);
* ``qk_norm``: Qwen3 RMS-normalizes each head's query and key over ``head_dim`` before RoPE
  (``attn_q_norm.weight``, ``attn_k_norm.weight``).

Mistral's files are ``llama`` files (llama.cpp and gguf-py know no ``mistral`` architecture);
a file that declares a sliding window is refused until windows are supported.

The backends read a model's traits from its `stagerun.model.ModelConfig`; a backend that does
not run a trait refuses the model by name.
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["FAMILIES", "Family"]


@attrs.frozen
class Family:
    """One architecture's block layout (see the module docstring)."""

    name: str
    rope_interleaved: bool = True
    attention_bias: bool = False
    qk_norm: bool = False

    def extra_tensors(self) -> tuple[str, ...]:
        """The per-block tensors beyond llama's, by their name after ``blk.N.``."""
        names: tuple[str, ...] = ()
        if self.attention_bias:
            names += ("attn_q.bias", "attn_k.bias", "attn_v.bias")
        if self.qk_norm:
            names += ("attn_q_norm.weight", "attn_k_norm.weight")
        return names


FAMILIES: Final[dict[str, Family]] = {
    family.name: family
    for family in (
        Family("llama"),
        Family("qwen2", rope_interleaved=False, attention_bias=True),
        Family("qwen3", rope_interleaved=False, qk_norm=True),
    )
}
"""The built-in families, by ``general.architecture``."""
