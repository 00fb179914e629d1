"""Model families: what sets one architecture's blocks apart from llama's, as data.

A family is how a GGUF file of one ``general.architecture`` lays out and runs its blocks: a
`Family` of traits that every backend reads from `stagerun.model.ModelConfig.family`. The
loader (`stagerun.model.ModelFile`) reads the tensors the traits name for a layer range and
the per-model numbers the file's metadata holds (window, RoPE bases and scaling, softcaps);
the backends run the traits. A backend that does not run a trait refuses the model by name.

The traits, and who needs them:

* ``rope_interleaved``: the GGUF converter permuted llama's (and Mistral's) Q/K rows so that
  llama.cpp rotates the pairs ``(2i, 2i+1)``; Qwen's, Phi-3's and Gemma's files keep Hugging
  Face's order, whose RoPE rotates the halves ``(i, i + head_dim/2)`` (llama.cpp's NEOX mode).
* ``attention_bias``: Qwen2 adds a bias to the Q, K and V projections (``attn_q.bias``...).
* ``qk_norm``: Qwen3 and Gemma 3 RMS-normalize each head's query and key over ``head_dim``
  before RoPE (``attn_q_norm.weight``, ``attn_k_norm.weight``).
* ``fused_qkv`` / ``fused_gate_up``: Phi-3 stores Q, K and V as one matrix (``attn_qkv``) and
  the gate and up projections as one (``ffn_up``, gate rows first, no ``ffn_gate``).
* ``post_norms``: Gemma normalizes the attention and MLP outputs again before adding them to
  the residual stream (``post_attention_norm``, ``post_ffw_norm``).
* ``activation``: the gated MLP's ``silu`` (SwiGLU) or Gemma's ``gelu_tanh`` (GeGLU).
* ``embedding_scale``: Gemma multiplies the embeddings by ``sqrt(d_model)``.
* ``sliding_window_pattern``: with a sliding window in the file, which layers use it: 0 for
  every layer (Mistral, Phi-3), or ``n`` for all but every ``n``-th (Gemma 3: 6, five local
  layers then a global one; Gemma 2: 2).
* ``local_rope_base``: the RoPE base of the local layers when it differs from the file's
  (Gemma 3: 10,000 against 1,000,000 for the global ones); ``{arch}.rope.freq_base_swa``
  in the file wins.
* ``chat_template``: a Jinja template to use when a file of this family carries none.

Gemma's converter stores its norms' ``1 + w`` (Hugging Face's convention is ``w``), so its
RMSNorms are llama's over the stored gains. Mistral's files are ``llama`` files (llama.cpp and
gguf-py know no ``mistral`` architecture), and a llama file that declares a sliding window
gets it on every layer.

More families come from plugins: an entry point in the ``stagerun.architectures`` group whose
name is the architecture and whose object is a `Family` (or a callable returning one); see
docs/models.md and `stagerun.plugins.family`.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "make_family"]

ACTIVATIONS: Final = ("silu", "gelu_tanh")


def _check_pattern(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0 or value == 1:
        raise ValueError(f"{attribute.name} must be 0 (every layer) or at least 2, not {value}.")


@attrs.frozen
class Family:
    """One architecture's block layout (see the module docstring for each trait)."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))
    rope_interleaved: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    post_norms: bool = False
    activation: Literal["silu", "gelu_tanh"] = attrs.field(
        default="silu", validator=attrs.validators.in_(ACTIVATIONS)
    )
    embedding_scale: bool = False
    sliding_window_pattern: int = attrs.field(default=0, validator=_check_pattern)
    local_rope_base: float | None = None
    chat_template: str | None = attrs.field(default=None, repr=False)

    def layer_tensors(self) -> tuple[str, ...]:
        """The per-block tensors this family's files hold, by their name after ``blk.N.``."""
        attention = ("attn_qkv.weight",) if self.fused_qkv else (
            "attn_q.weight", "attn_k.weight", "attn_v.weight",
        )  # fmt: skip
        ffn = ("ffn_up.weight",) if self.fused_gate_up else ("ffn_gate.weight", "ffn_up.weight")
        names = ("attn_norm.weight", *attention, "attn_output.weight", "ffn_norm.weight", *ffn)
        names += ("ffn_down.weight",)
        if self.attention_bias:
            names += ("attn_q.bias", "attn_k.bias", "attn_v.bias")
        if self.qk_norm:
            names += ("attn_q_norm.weight", "attn_k_norm.weight")
        if self.post_norms:
            names += ("post_attention_norm.weight", "post_ffw_norm.weight")
        return names

    def is_local(self, layer: int, window: int) -> bool:
        """Whether block ``layer`` attends through the sliding window of ``window`` positions."""
        if window <= 0:
            return False
        n = self.sliding_window_pattern
        return n == 0 or layer % n < n - 1


LLAMA: Final = Family("llama")
QWEN2: Final = Family("qwen2", rope_interleaved=False, attention_bias=True)
QWEN3: Final = Family("qwen3", rope_interleaved=False, qk_norm=True)
PHI3: Final = Family("phi3", rope_interleaved=False, fused_qkv=True, fused_gate_up=True)
GEMMA3: Final = Family(
    "gemma3",
    rope_interleaved=False,
    qk_norm=True,
    post_norms=True,
    activation="gelu_tanh",
    embedding_scale=True,
    sliding_window_pattern=6,
    local_rope_base=10_000.0,
)

FAMILIES: Final[dict[str, Family]] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, PHI3, GEMMA3)}
"""The built-in families, by ``general.architecture`` (also registered as entry points)."""


def make_family(obj: Any, name: str) -> tuple[Any, list[str]]:
    """A family plugin's `Family` (a factory is called first), and what is wrong with it.

    ``name`` is the entry point's: the architecture the family must be named after.
    """
    if not isinstance(obj, Family) and callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            return obj, [f"calling it failed: {type(exc).__name__}: {exc}"]
    if not isinstance(obj, Family):
        return obj, [f"it is a {type(obj).__name__}, not a stagerun.model.Family"]
    if obj.name != name:
        return obj, [
            f"its Family is named {obj.name!r}, but it is registered for the {name!r} "
            "architecture; the two must be the same"
        ]
    return obj, []
