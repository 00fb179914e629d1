"""The transformer block as ggml operations: what one layer adds to a graph.

`Blocks` holds what every block of a model shares (its numbers, the RoPE mode, the output
head) and writes a block into a `Graph` over stacked rows: norms, projections and the MLP on
all rows at once, attention per group of sessions (`Group`), the way llama.cpp's graphs do. It
computes nothing itself; `GgmlBackend` builds, keeps and runs the graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...model import ModelConfig
from ._graph import Graph, Group, SlabRows
from ._lib import I32, ROPE_NEOX, ROPE_NORMAL


class Layer:
    """The tensors of one block (headers over the mapped file), by role."""

    __slots__ = (
        "attn_norm", "bk", "bq", "bv", "ffn_norm", "k_norm", "post_attn", "post_ffn", "q_norm",
        "rope", "w_down", "w_gate", "w_k", "w_o", "w_q", "w_qkv", "w_up", "w_v", "window",
    )  # fmt: skip

    def __init__(self, get: Callable[[str], Any], prefix: str, fused_qkv: bool,
                 fused_gate_up: bool) -> None:  # fmt: skip
        self.attn_norm = get(prefix + "attn_norm.weight")
        self.w_qkv = get(prefix + "attn_qkv.weight") if fused_qkv else None
        self.w_q = None if fused_qkv else get(prefix + "attn_q.weight")
        self.w_k = None if fused_qkv else get(prefix + "attn_k.weight")
        self.w_v = None if fused_qkv else get(prefix + "attn_v.weight")
        self.w_o = get(prefix + "attn_output.weight")
        self.ffn_norm = get(prefix + "ffn_norm.weight")
        self.w_gate = None if fused_gate_up else get(prefix + "ffn_gate.weight")
        self.w_up = get(prefix + "ffn_up.weight")
        self.w_down = get(prefix + "ffn_down.weight")
        self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
        self.post_attn = self.post_ffn = None
        self.rope: tuple[float, float, bool] = (0.0, 1.0, False)
        self.window = 0


class Blocks:
    """Writes a model's blocks and head into graphs.

    Args:
        lib: the loaded ggml library (`_lib.load`).
        config: the model's numbers and family traits.
        factors: the ``rope_freqs`` tensor (Llama 3's frequency factors), if the model has one.
        out_norm, head_weight: the output norm and head, on the last stage; else None.
        flash: attend with ggml's flash attention kernel, else scores, softmax and values apart.
    """

    def __init__(self, lib: Any, config: ModelConfig, *, factors: Any, out_norm: Any,
                 head_weight: Any, flash: bool = True) -> None:  # fmt: skip
        family = config.family
        self._lib, self.config = lib, config
        self._eps = float(config.rms_eps)
        self._rope_mode = ROPE_NORMAL if family.rope_interleaved else ROPE_NEOX
        self._factors = factors
        self._gelu = family.activation == "gelu_tanh"
        self._kq_scale = float(1.0 / math.sqrt(config.head_dim))
        self._out_norm, self.head_weight = out_norm, head_weight
        self.flash = flash

    def norm(self, g: Graph, x: Any, weight: Any) -> Any:
        lib = self._lib
        return lib.ggml_mul(g.ctx, lib.ggml_rms_norm(g.ctx, x, self._eps), weight)

    def block(self, g: Graph, b: Layer, i: int, x: Any, pos: Any, parts: list[SlabRows],
              groups: list[Group], R: int) -> Any:  # fmt: skip
        """Block ``i`` (local number) on the stacked rows ``x`` ``[d_model, R]`` of the
        sessions in ``parts`` (by slab) and ``groups`` (by attention)."""
        lib, ctx, c = self._lib, g.ctx, self.config
        hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
        cur = self.norm(g, x, b.attn_norm)
        if b.w_qkv is not None:  # Phi-3: one product, then views of its rows
            qkv = lib.ggml_mul_mat(ctx, b.w_qkv, cur)
            row = (nh + 2 * nkv) * hd * 4
            q = lib.ggml_view_3d(ctx, qkv, hd, nh, R, hd * 4, row, 0)
            k = lib.ggml_view_3d(ctx, qkv, hd, nkv, R, hd * 4, row, nh * hd * 4)
            v = lib.ggml_view_2d(ctx, qkv, nkv * hd, R, row, (nh + nkv) * hd * 4)
            v = lib.ggml_cont_2d(ctx, v, nkv * hd, R)
        else:
            q = lib.ggml_mul_mat(ctx, b.w_q, cur)
            k = lib.ggml_mul_mat(ctx, b.w_k, cur)
            v = lib.ggml_mul_mat(ctx, b.w_v, cur)
            if b.bq is not None:
                q = lib.ggml_add(ctx, q, b.bq)
                k = lib.ggml_add(ctx, k, b.bk)
                v = lib.ggml_add(ctx, v, b.bv)
            q = lib.ggml_reshape_3d(ctx, q, hd, nh, R)
            k = lib.ggml_reshape_3d(ctx, k, hd, nkv, R)
        if b.q_norm is not None:
            q = self.norm(g, q, b.q_norm)
            k = self.norm(g, k, b.k_norm)
        base, scale, scaled = b.rope
        factors = self._factors if scaled and self._factors is not None else g.ffi.NULL
        rope = (hd, self._rope_mode, c.context_length, base, 1.0 / scale, 0.0, 1.0, 32.0, 1.0)
        q = lib.ggml_rope_ext(ctx, q, pos, factors, *rope)
        k = lib.ggml_rope_ext(ctx, k, pos, factors, *rope)
        for part in parts:
            self.store(g, i, part, k, v)
        attn = concat_rows(lib, ctx, [self.attend(g, b, i, a, q) for a in groups])
        attn = lib.ggml_mul_mat(ctx, b.w_o, attn)
        if b.post_attn is not None:
            attn = self.norm(g, attn, b.post_attn)
        x = lib.ggml_add(ctx, x, attn)
        cur = self.norm(g, x, b.ffn_norm)
        if b.w_gate is None:  # Phi-3: [gate; up] in one matrix
            up = lib.ggml_mul_mat(ctx, b.w_up, cur)
            act = lib.ggml_geglu(ctx, up) if self._gelu else lib.ggml_swiglu(ctx, up)
        else:
            gate = lib.ggml_mul_mat(ctx, b.w_gate, cur)
            up = lib.ggml_mul_mat(ctx, b.w_up, cur)
            split = lib.ggml_geglu_split if self._gelu else lib.ggml_swiglu_split
            act = split(ctx, gate, up)
        down = lib.ggml_mul_mat(ctx, b.w_down, act)
        if b.post_ffn is not None:
            down = self.norm(g, down, b.post_ffn)
        return lib.ggml_add(ctx, x, down)

    def store(self, g: Graph, i: int, part: SlabRows, k: Any, v: Any) -> None:
        """The new keys and values of ``part``'s rows into block ``i`` of their slab, at the
        rows of their slots and positions, before anything reads the slab."""
        lib, ctx = self._lib, g.ctx
        width = self.config.n_kv_heads * self.config.head_dim
        _, slots, cap, _ = part.slab.shape
        layer = i * slots * cap * width * 2
        for new, slab in ((k, part.k), (v, part.v)):
            rows = lib.ggml_view_2d(ctx, new, width, part.rows, width * 4, part.first * width * 4)
            dst = lib.ggml_view_2d(ctx, slab, width, slots * cap, width * 2, layer)
            g.expand(lib.ggml_set_rows(ctx, dst, rows, part.index))

    def attend(self, g: Graph, b: Layer, i: int, a: Group, q: Any) -> Any:
        """A group's attention in block ``i``: ``[n_heads * head_dim, rows * count]``."""
        lib, ctx, c = self._lib, g.ctx, self.config
        hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
        width, T, B, L = nkv * hd, a.rows, a.count, a.keys
        _, slots, cap, _ = a.part.slab.shape
        at = (i * slots + a.slot) * cap * width * 2  # float16
        # [head_dim, keys, n_kv, sessions]: the sessions' slots lie one capacity apart
        keys = lib.ggml_view_4d(ctx, a.part.k, hd, L, nkv, B, width * 2, hd * 2, cap * width * 2,
                                at)  # fmt: skip
        values = lib.ggml_view_4d(ctx, a.part.v, hd, L, nkv, B, width * 2, hd * 2,
                                  cap * width * 2, at)  # fmt: skip
        # [head_dim, T, n_heads, sessions] of the stacked [head_dim, n_heads, R]
        qs = lib.ggml_view_4d(ctx, q, hd, T, nh, B, nh * hd * 4, hd * 4, T * nh * hd * 4,
                              a.first * nh * hd * 4)  # fmt: skip
        mask, softcap = a.masks[b.window], c.attn_softcap
        if self.flash:
            out = lib.ggml_flash_attn_ext(ctx, qs, keys, values, mask, self._kq_scale, 0.0,
                                          float(softcap or 0.0))  # fmt: skip
            return lib.ggml_reshape_2d(ctx, out, nh * hd, T * B)  # [hd, nh, T, B] already
        assert B == 1, "without flash attention every session attends apart"
        kq = lib.ggml_mul_mat(ctx, keys, qs)  # [L, T, nh]
        if softcap:
            kq = lib.ggml_scale(ctx, kq, self._kq_scale / softcap)
            kq = lib.ggml_scale(ctx, lib.ggml_tanh(ctx, kq), softcap)
            kq = lib.ggml_soft_max_ext(ctx, kq, mask, 1.0, 0.0)
        else:
            kq = lib.ggml_soft_max_ext(ctx, kq, mask, self._kq_scale, 0.0)
        # the value product reads each channel's L values as one row: a transposed copy
        values = lib.ggml_cont_3d(ctx, lib.ggml_permute(ctx, values, 1, 0, 2, 3), L, hd, nkv)
        out = lib.ggml_mul_mat(ctx, values, kq)  # [hd, T, nh]
        out = lib.ggml_permute(ctx, out, 0, 2, 1, 3)  # [hd, nh, T]
        return lib.ggml_cont_2d(ctx, out, nh * hd, T)

    def head(self, g: Graph, x: Any, n_picked: int) -> Any:
        """The logits of ``n_picked`` rows of ``x``, whose indices are the graph's last input."""
        lib, ctx = self._lib, g.ctx
        rows = lib.ggml_get_rows(ctx, x, g.input(I32, n_picked))
        logits = lib.ggml_mul_mat(ctx, self.head_weight, self.norm(g, rows, self._out_norm))
        cap = self.config.final_softcap
        if cap:
            logits = lib.ggml_scale(
                ctx, lib.ggml_tanh(ctx, lib.ggml_scale(ctx, logits, 1 / cap)), cap
            )
        return logits


def concat_rows(lib: Any, ctx: Any, parts: list[Any]) -> Any:
    """The parts ``[n, T_i]`` side by side ``[n, sum T_i]``, joined as a balanced tree."""
    while len(parts) > 1:
        joined = [
            lib.ggml_concat(ctx, a, b, 1) for a, b in zip(parts[::2], parts[1::2], strict=False)
        ]
        parts = joined + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]
