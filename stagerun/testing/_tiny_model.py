"""A tiny random-weight llama GGUF, so tests never need the real model.

The file has the real model's layout -- llama tensor names and keys, a byte-level BPE vocabulary
(the 256 byte tokens, a few merges, ChatML control tokens) and a ChatML chat template -- with
small shapes and seeded random F32 weights, so it loads through ``open_model``, runs in every
backend, and greedy decoding is deterministic. It is well under 1 MB.

The weights are scaled so that the output depends on the input, which is what makes the model
an oracle: a test that compares two runs can only tell a correct replay from a wrong one if a
wrong one (a dropped token, a lost prompt, another seed) changes what comes next. Plain
``N(0, 1)`` embeddings with a tied head do not give that: the current token's own embedding
dominates the residual stream, so its logit stands ~20 above the rest and the model repeats one
token forever. Here, by construction:

* embeddings are small (``embedding_std``), so the residual stream is mostly what the blocks
  computed from the context, not the current token;
* queries are scaled up (``attention_gain``), so each head attends sharply to a few earlier
  positions chosen by content and (through RoPE) by distance, and the context keeps changing
  what comes next instead of settling on a fixed point;
* the output norm's gain (``logit_scale``) sets how peaked the next-token distribution is:
  with the defaults the top token has p ~0.4 at temperature 1, so greedy runs are varied and
  seeded sampling gives a different output for every seed.

``tests/test_tiny_model.py`` asserts these properties (distinct ids per greedy run, different
continuations for different prompts, seeds that matter).
"""

from __future__ import annotations

import os
import pathlib

import attrs
import gguf
import numpy as np
import numpy.typing as npt

from ..model._chat import CHATML_TEMPLATE
from ..model._families import FAMILIES, Family
from ..model._tokenizer import bytes_to_unicode
from ._kquants import K_QUANTS, quantize_k

__all__ = ["TINY_FAMILIES", "TINY_MERGES", "TINY_SPECIAL_TOKENS", "write_tiny_model"]

TINY_FAMILIES = tuple(FAMILIES)
TINY_WINDOW = 40  # the sliding window of a tiny windowed family: shorter than test prompts

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
    ("Ġ", "s"), ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("l", "l"),
    ("Ġ", "c"), ("Ġ", "o"), ("i", "s"), ("Ġ", "b"), ("e", "s"), ("a", "n"),
)  # fmt: skip


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    n_layers: int | None = None,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 128,
    seed: int = 0,
    tied_output: bool = True,
    architecture: str = "llama",
    family: str | Family = "llama",
    context_length: int = 512,
    weights: str = "F32",
    embedding_std: float = 0.05,
    attention_gain: float = 3.0,
    logit_scale: float = 8.0,
    sliding_window: int | None = None,
    rope_scaling: float | None = None,
    rope_factors: bool | npt.ArrayLike = False,
    attn_softcap: float = 0.0,
    final_softcap: float = 0.0,
) -> pathlib.Path:
    """Write a small llama GGUF file with seeded random F32 weights and return its path.

    Args:
        path: the file to write (its folder must exist).
        tied_output: leave out ``output.weight`` so the head reuses the embeddings, like
            SmolLM2; False writes a separate head.
        architecture: ``general.architecture``; anything but ``llama`` makes a file that
            ``open_model`` must refuse (for tests).
        n_layers: blocks; None gives 4, or one whole window pattern (Gemma 3: 6, five local
            layers and a global one) if that is more.
        family: the model family whose layout the file has, a built-in's name (``llama``,
            ``qwen2``, ``qwen3``, ``phi3``, ``gemma3``) or a `stagerun.model.Family` (a
            plugin's); its name is then the file's architecture. The file holds the tensors
            its traits name (`Family.layer_tensors`).
        sliding_window: ``{arch}.attention.sliding_window``; None gives `TINY_WINDOW` to a
            family with a window pattern (Gemma), none to the others.
        rope_scaling: a linear RoPE scaling factor (``rope.scaling.type = linear``).
        rope_factors: write Llama 3's ``rope_freqs.weight``: these ``head_dim/2`` divisors of
            the RoPE frequencies, or True for random ones in 1..8.
        attn_softcap, final_softcap: Gemma 2's softcaps of scores and logits, when not 0.
        weights: the GGML type of the block matrices: ``F32`` (default), a type
            ``gguf.quants`` can quantize (``Q4_0``, ``Q4_1``, ``Q8_0``...), or a K-quant
            (``Q4_K``, ``Q5_K``, ``Q6_K``: d_model and d_ff multiples of 256). Norms and
            embeddings stay F32.
        embedding_std: the standard deviation of the token embeddings (see the module
            docstring); 1.0 with ``attention_gain=1`` and ``logit_scale=1`` gives the old,
            peaked model that repeats one token.
        attention_gain: a factor on the query projections: how sharply heads attend.
        logit_scale: a factor on the output norm's gain: how peaked the logits are.
    """
    qtype = _block_type(weights, d_model=d_model, d_ff=d_ff, n_heads=n_heads, n_kv_heads=n_kv_heads)
    path = pathlib.Path(path)
    tokens, token_types = _tiny_vocabulary()
    family = _family(family)
    n_layers = max(4, family.sliding_window_pattern) if n_layers is None else n_layers
    shape = _Shape(n_layers, d_model, d_ff, n_heads, n_kv_heads, len(tokens), context_length)
    writer = gguf.GGUFWriter(path, architecture if family.name == "llama" else family.name)
    _add_hyperparameters(writer, qtype, weights, shape, family)
    _add_options(writer, family, sliding_window, rope_scaling, attn_softcap, final_softcap)
    _add_tokenizer(writer, tokens, token_types)
    draws = _Draws(writer, qtype, np.random.default_rng(seed))
    _add_embeddings(draws, shape, family, embedding_std, rope_factors)
    for i in range(n_layers):
        _add_block(draws, i, shape, family, attention_gain)
    draws.writer.add_tensor("output_norm.weight", logit_scale * draws.gain(d_model))
    if not tied_output:
        draws.writer.add_tensor("output.weight", draws.matrix(shape.vocab, d_model))
    _write_out(writer)
    return path


@attrs.frozen
class _Shape:
    """The sizes of the tiny model."""

    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _family(family: str | Family) -> Family:
    if isinstance(family, str):
        if family not in FAMILIES:
            raise ValueError(
                f"unknown family {family!r}; expected one of {', '.join(TINY_FAMILIES)}"
            )
        family = FAMILIES[family]
    return family


def _write_out(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _block_type(
    weights: str, *, d_model: int, d_ff: int, n_heads: int, n_kv_heads: int
) -> gguf.GGMLQuantizationType:
    """The GGML type named ``weights``, once the shapes are known to fit it and each other."""
    if d_model % n_heads or n_heads % n_kv_heads or (d_model // n_heads) % 2:
        raise ValueError("d_model must split into an even head_dim, and heads into KV groups.")
    try:
        qtype = gguf.GGMLQuantizationType[weights]
    except KeyError:
        raise ValueError(f"unknown GGML type {weights!r}.") from None
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype != gguf.GGMLQuantizationType.F32 and (d_model % block or d_ff % block):
        raise ValueError(f"{weights} needs d_model and d_ff to be multiples of {block}.")
    return qtype


def _tiny_vocabulary() -> tuple[list[str], list[int]]:
    """The tokens (control tokens, the 256 byte tokens, the merges) and their GGUF types."""
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens = [*TINY_SPECIAL_TOKENS, *byte_tokens, *(a + b for a, b in TINY_MERGES)]
    token_types = [3] * len(TINY_SPECIAL_TOKENS) + [1] * (len(tokens) - len(TINY_SPECIAL_TOKENS))
    return tokens, token_types


def _add_hyperparameters(
    writer: gguf.GGUFWriter,
    qtype: gguf.GGMLQuantizationType,
    weights: str,
    shape: _Shape,
    family: Family,
) -> None:
    """The model's name, file type and shape keys (the family's, as ``general.architecture``)."""
    writer.add_name(f"tiny-random-{family.name}")
    file_type = "ALL_F32" if qtype == gguf.GGMLQuantizationType.F32 else f"MOSTLY_{weights}"
    if file_type in gguf.LlamaFileType.__members__:
        writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_block_count(shape.n_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.d_ff)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    # a family with its own local base gets another global one, so that both matter
    writer.add_rope_freq_base(10000.0 if family.local_rope_base is None else 1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    if family.name != "llama":  # transformers reads Qwen's head size from these, not the width
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)


def _add_options(
    writer: gguf.GGUFWriter,
    family: Family,
    sliding_window: int | None,
    rope_scaling: float | None,
    attn_softcap: float,
    final_softcap: float,
) -> None:
    """The optional keys: the sliding window (None: `TINY_WINDOW` if the family has a window
    pattern), linear RoPE scaling and the softcaps."""
    if sliding_window is None:
        sliding_window = TINY_WINDOW if family.sliding_window_pattern else 0
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    if attn_softcap:
        writer.add_attn_logit_softcapping(attn_softcap)
    if final_softcap:
        writer.add_final_logit_softcapping(final_softcap)


def _add_tokenizer(writer: gguf.GGUFWriter, tokens: list[str], token_types: list[int]) -> None:
    """The byte-level BPE tokenizer with its ChatML control tokens and chat template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([f"{a} {b}" for a, b in TINY_MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


class _Draws:
    """Seeded random tensors, drawn in file order: F32 norms and embeddings, ``qtype`` blocks.

    A family's own tensors (qwen2's biases, qwen3's query and key norms...) are drawn where
    the file holds them, so a llama file is the same whatever families exist; a fused matrix
    (Phi-3's ``attn_qkv``, ``ffn_up``) is the separate draws stacked.
    """

    def __init__(
        self, writer: gguf.GGUFWriter, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
    ) -> None:
        self.writer, self.qtype, self.rng = writer, qtype, rng

    def matrix(self, out: int, inp: int) -> npt.NDArray[np.float32]:
        return np.asarray(self.rng.standard_normal((out, inp)) / np.sqrt(inp), dtype=np.float32)

    def gain(self, n: int) -> npt.NDArray[np.float32]:
        return np.asarray(1.0 + 0.1 * self.rng.standard_normal(n), dtype=np.float32)

    def add_matrix(self, name: str, m: npt.NDArray[np.float32]) -> None:
        """Add the block matrix ``m``, as ``qtype``."""
        qtype = self.qtype
        if qtype == gguf.GGMLQuantizationType.F32:
            self.writer.add_tensor(name, m)
        elif qtype.name in K_QUANTS:  # gguf-py reads K-quants but cannot write them
            self.writer.add_tensor(name, quantize_k(m, qtype.name), raw_dtype=qtype)
        else:
            self.writer.add_tensor(name, gguf.quants.quantize(m, qtype), raw_dtype=qtype)


def _add_embeddings(
    draws: _Draws,
    shape: _Shape,
    family: Family,
    embedding_std: float,
    rope_factors: bool | npt.ArrayLike,
) -> None:
    """The token embeddings, and Llama 3's RoPE factors if asked for."""
    d_model, half = shape.d_model, shape.head_dim // 2
    embeddings = embedding_std * draws.rng.standard_normal((shape.vocab, d_model))
    if family.embedding_scale:  # the model multiplies them by sqrt(d_model): keep them small
        embeddings /= np.sqrt(d_model)
    draws.writer.add_tensor("token_embd.weight", embeddings.astype(np.float32))
    if rope_factors is True:
        rope_factors = draws.rng.uniform(1.0, 8.0, half)
    if rope_factors is not False:
        factors = np.asarray(rope_factors, dtype=np.float32)
        if factors.shape != (half,):
            raise ValueError(f"rope_factors needs {half} divisors, not {factors.shape}.")
        draws.writer.add_tensor("rope_freqs.weight", factors)


def _add_block(draws: _Draws, i: int, shape: _Shape, family: Family, attention_gain: float) -> None:
    """Block ``i``'s tensors, with the family's extras."""
    writer, matrix, gain, add_matrix = draws.writer, draws.matrix, draws.gain, draws.add_matrix
    d_model, d_ff, head_dim = shape.d_model, shape.d_ff, shape.head_dim
    n_heads, n_kv_heads = shape.n_heads, shape.n_kv_heads
    writer.add_tensor(f"blk.{i}.attn_norm.weight", gain(d_model))
    # with query norms the norm's gain, not the matrix, sets how sharply heads attend
    q_gain = 1.0 if family.qk_norm else attention_gain
    q = q_gain * matrix(n_heads * head_dim, d_model)
    k = matrix(n_kv_heads * head_dim, d_model)
    v = matrix(n_kv_heads * head_dim, d_model)
    if family.fused_qkv:
        add_matrix(f"blk.{i}.attn_qkv.weight", np.concatenate([q, k, v]))
    else:
        add_matrix(f"blk.{i}.attn_q.weight", q)
        add_matrix(f"blk.{i}.attn_k.weight", k)
        add_matrix(f"blk.{i}.attn_v.weight", v)
    if family.attention_bias:
        for name, rows in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
            bias = 0.1 * draws.rng.standard_normal(rows * head_dim)
            writer.add_tensor(f"blk.{i}.attn_{name}.bias", bias.astype(np.float32))
    if family.qk_norm:
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", attention_gain * gain(head_dim))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", gain(head_dim))
    add_matrix(f"blk.{i}.attn_output.weight", matrix(d_model, n_heads * head_dim))
    if family.post_norms:
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", gain(d_model))
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", gain(d_model))
    gate, up = matrix(d_ff, d_model), matrix(d_ff, d_model)
    if family.fused_gate_up:
        add_matrix(f"blk.{i}.ffn_up.weight", np.concatenate([gate, up]))
    else:
        add_matrix(f"blk.{i}.ffn_gate.weight", gate)
        add_matrix(f"blk.{i}.ffn_up.weight", up)
    add_matrix(f"blk.{i}.ffn_down.weight", matrix(d_model, d_ff))
    if family.post_norms:
        writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", gain(d_model))
