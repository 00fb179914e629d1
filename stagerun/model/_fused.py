"""The weights of a block as the runtimes multiply them, shared by every backend that packs.

Three rewrites that change no result, done once at load time:

* Projections that share an input are fused: Q, K and V into one ``(out, in)`` matrix, gate and
  up into another.
* RoPE order: the GGUF converter permuted Q/K so that llama.cpp's interleaved pairs
  ``(2i, 2i+1)`` rotate together. Permuting the rows of W_q and W_k within each head turns
  those pairs into the halves ``(i, i + head_dim/2)``, which rotate with contiguous slices; the
  dot products q.k, and so attention, do not change.
* The attention scale 1/sqrt(head_dim) goes into W_q and, with ``fold_norms``, each RMSNorm gain
  into the columns of the matrix that follows the norm.

`QuantizedTensor` rows are the same rows, still in their GGUF blocks, for a backend that keeps
the file's quantization (a row permutation and a scale by a constant keep a block a block;
folding a per-column gain does not, so such a backend applies the norm gains itself).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from ._gguf import LayerWeights, ModelConfig

__all__ = ["FusedLayer", "fuse_layer", "qk_row_order"]

F32 = npt.NDArray[np.float32]


@attrs.frozen(eq=False)
class FusedLayer:
    """One block's four matrices, float32 ``(out, in)``.

    ``qkv`` rows are ``[W_q / sqrt(head_dim); W_k; W_v]`` with the Q and K rows of each head in
    RoPE-halves order; ``gate_up`` rows are ``[W_gate; W_up]``.
    """

    qkv: F32
    wo: F32
    gate_up: F32
    down: F32
    attn_norm: F32
    ffn_norm: F32
    qkv_bias: F32 | None = None  # qwen2: ``[b_q; b_k; b_v]``, in the rows' order and scale
    q_norm: F32 | None = None  # qwen3: the per-head RMSNorm gains, the attention scale in q's
    k_norm: F32 | None = None
    post_attn_norm: F32 | None = None  # gemma: the gains of the norms on the block's outputs
    post_ffn_norm: F32 | None = None


def qk_row_order(config: ModelConfig, heads: int) -> npt.NDArray[np.intp]:
    """Row indices that put the Q (or K) rows of ``heads`` heads in RoPE-halves order."""
    hd = config.head_dim
    within = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    order: npt.NDArray[np.intp] = (np.arange(heads)[:, None] * hd + within[None, :]).reshape(-1)
    return order


def fuse_layer(lw: LayerWeights, config: ModelConfig, *, fold_norms: bool = True) -> FusedLayer:
    """Fuse, reorder and scale one block's weights (see the module docstring).

    A family whose file keeps the halves order (``rope_interleaved`` False: Qwen) is not
    reordered. With query and key norms (Qwen3) the attention scale goes into the query
    norm's gains, since the norm would undo it in W_q.
    """
    family = config.family
    scale = np.float32(1.0 / np.sqrt(config.head_dim))
    hd = config.head_dim
    q_rows, k_rows = np.arange(config.n_heads * hd), np.arange(config.n_kv_heads * hd)
    within = np.arange(hd)
    if family.rope_interleaved:
        q_rows = qk_row_order(config, config.n_heads)
        k_rows = qk_row_order(config, config.n_kv_heads)
        within = qk_row_order(config, 1)
    q_scale = np.float32(1.0) if family.qk_norm else scale
    wq = lw.wq[q_rows] * q_scale
    wk = lw.wk[k_rows]
    qkv = np.concatenate([wq, wk, lw.wv])
    bias = None
    if lw.bq is not None and lw.bk is not None and lw.bv is not None:
        bias = np.concatenate([lw.bq[q_rows] * q_scale, lw.bk[k_rows], lw.bv])
    q_norm = k_norm = None
    if lw.q_norm is not None and lw.k_norm is not None:
        q_norm = (lw.q_norm[within] * scale).astype(np.float32)
        k_norm = lw.k_norm[within].astype(np.float32)
    gate_up = np.concatenate([lw.w_gate, lw.w_up])
    if fold_norms:
        qkv *= lw.attn_norm[None, :]
        gate_up *= lw.ffn_norm[None, :]
    return FusedLayer(
        qkv=qkv.astype(np.float32, copy=False),
        wo=lw.wo,
        gate_up=gate_up.astype(np.float32, copy=False),
        down=lw.w_down,
        attn_norm=lw.attn_norm,
        ffn_norm=lw.ffn_norm,
        qkv_bias=None if bias is None else bias.astype(np.float32),
        q_norm=q_norm,
        k_norm=k_norm,
        post_attn_norm=lw.post_attn_norm,
        post_ffn_norm=lw.post_ffn_norm,
    )
