"""One stage's layers of a GGUF model of any family in PyTorch, on CUDA or the CPU.

Theory of operation: the weights come from stagerun's own GGUF loader (dequantized to float32,
K-quants included), packed the way the numpy reference packs them, so both compute the same
function, trait for trait (`stagerun.model.Family`):

* Q, K and V are one ``(out, in)`` matrix, gate and up another (Phi-3's fused tensors are
  split by the loader and fused again); RMSNorm gains are folded into the columns of the
  matrix that follows the norm and 1/sqrt(head_dim) into W_q, or into the query norm's gains
  when the family normalizes each head's query and key (Qwen3, Gemma 3). Qwen2's Q/K/V
  biases are added after the product.
* Q/K rows of an interleaved-RoPE file (llama) are permuted once per head so that RoPE
  rotates contiguous halves; other families' files already are in halves order.
* RoPE tables (`RopeTable`) are shared by the layers of one setting: local layers have their
  own base, global ones the linear scale and Llama 3's frequency divisors.
* Attention is ``scaled_dot_product_attention`` over the cached keys with grouped-query heads
  (``enable_gqa``) and, for several new tokens, a causal mask offset by the cache length; a
  local (sliding-window) layer's rows see only the keys their window reaches (the keys before
  the first row's window are left out of the call). With a score softcap the attention is
  computed by hand (`attention`).
* Gemma's post-norms normalize a block output before it joins the residual stream, its GELU
  replaces the SiLU, its embeddings are scaled by sqrt(d_model) (folded into the table), and
  a final softcap bounds the logits.
* The KV cache is preallocated on the device and grows by doubling.
* Several sessions run as one batch (`TorchBackend.forward_batch`): their rows are stacked
  for the matrix products, the norms and the MLP; the attention runs per session against its
  own cache. The products run in fixed row blocks and the activations and the logit softcap
  in single-thread slices (`_matrices`), so a session's result is bitwise the same alone and
  in any batch. `forward` is a batch of one.

Int4 weights (``weights="int4"``, backend ``torch-int4``) are the file's own Q4_0/Q4_1 blocks,
rows reordered and scaled as `fuse_layer` does (Phi-3's fused matrices are row slices of one
tensor); the norm gains stay apart, since folding a gain into a column changes the blocks.
Every family runs so; a file with any other block matrix (Q8_0, the K-quants...) is refused,
naming the float ``torch`` backend.

On the CPU, torch's matrix multiply handles a few rows (a verify window) with little more
memory traffic than one row, where numpy's OpenBLAS path needs panel tricks; on CUDA the stage
runs on the GPU and only activations cross to the host. Float32 by default; ``dtype="float16"``
(or ``bfloat16``) is an opt-in on CUDA. The family traits were checked against numpy on the
CPU only: the code is device-agnostic, but untested on CUDA.

The backend is blocking code called from one worker thread at a time. ``threads`` sets torch's
intra-op threads for the process (torch has one setting per process).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from stagerun import ComputeCancelled
from stagerun.abc import ComputeBackend, ForwardItem
from stagerun.backends import GgufLayers, check_positions, forward_one, stage_input
from stagerun.model import LayerWeights, ModelFile, fuse_layer, qk_row_order

from ._attention import RopeTable, attention
from ._batch import Batch
from ._cache import TorchKVCache
from ._matrices import (
    HAS_ONEDNN,
    Dense,
    Matrix,
    OneDNN,
    gelu_tanh_mul,
    host,
    int4,
    silu_mul,
    softcap,
    unpack_q4,
)

__all__ = ["TorchBackend", "TorchInt4Backend"]

DEVICE_ENV = "STAGERUN_TORCH_DEVICE"
DTYPE_ENV = "STAGERUN_TORCH_DTYPE"
WEIGHTS_ENV = "STAGERUN_TORCH_WEIGHTS"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> str:
    """``$STAGERUN_TORCH_DEVICE``, else ``cuda`` when a GPU is visible, else ``cpu``."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


class _Layer:
    """One block: its four matrices, and the gains and biases its family has (else None).

    ``attn_norm``/``ffn_norm`` are None where the gains are folded into the matrices (float
    weights); ``q_norm`` carries the attention scale when there are query norms (`fuse_layer`).
    """

    __slots__ = (
        "attn_norm", "ffn_norm", "k_norm", "post_attn", "post_ffn", "q_norm", "qkv_bias",
        "w_down", "w_gu", "w_o", "w_qkv",
    )  # fmt: skip

    def __init__(
        self,
        w_qkv: Matrix,
        w_o: Matrix,
        w_gu: Matrix,
        w_down: Matrix,
        *,
        attn_norm: torch.Tensor | None = None,
        ffn_norm: torch.Tensor | None = None,
        qkv_bias: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        post_attn: torch.Tensor | None = None,
        post_ffn: torch.Tensor | None = None,
    ) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down
        self.attn_norm, self.ffn_norm = attn_norm, ffn_norm
        self.qkv_bias, self.q_norm, self.k_norm = qkv_bias, q_norm, k_norm
        self.post_attn, self.post_ffn = post_attn, post_ffn


class TorchBackend(GgufLayers, ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a GGUF model of any family with PyTorch.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: torch intra-op threads (process-wide); None leaves torch's setting alone.
        device: ``cpu``, ``cuda``, ``cuda:1``...; default `default_device()`.
        dtype: ``float32`` (default, ``$STAGERUN_TORCH_DTYPE``), or ``float16``/``bfloat16``
            on CUDA.
        weights: ``float`` (default, ``$STAGERUN_TORCH_WEIGHTS``): dequantized to ``dtype``;
            ``int4`` (CPU only): the GGUF's own Q4_0/Q4_1 blocks through torch's int4 kernel,
            with bfloat16 matmul inputs; the backend ``torch-int4`` is this setting.

    Raises:
        UnsupportedModelError: with int4 weights, a block matrix is not Q4_0/Q4_1.
    """

    default_weights: ClassVar[str] = "float"

    families: ClassVar[frozenset[str] | None] = None  # every family: it runs their traits

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        weights: str | None = None,
    ) -> None:
        c = self._open_layers(model, layers, threads)
        lo, hi = self._lo, self._hi
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = threads
        self.device = torch.device(device or default_device())
        dtype_name = dtype or os.environ.get(DTYPE_ENV) or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype_name!r}.")
        if dtype_name != "float32" and self.device.type == "cpu":
            raise ValueError(
                f"{dtype_name} is for CUDA; on the CPU the torch backend runs float32 "
                "(or int4 weights: backend 'torch-int4')."
            )
        self.dtype = _DTYPES[dtype_name]
        self.weights = weights or os.environ.get(WEIGHTS_ENV) or self.default_weights
        if self.weights not in ("float", "int4"):
            raise ValueError(f"weights must be 'float' or 'int4', not {self.weights!r}.")
        if self.weights == "int4" and self.device.type != "cpu":
            raise ValueError(
                f"int4 weights run on the CPU only; on {self.device} use float weights "
                "(dtype float16 or bfloat16 to halve the memory)."
            )
        w = self.model.load_weights(
            lo, hi, embeddings=lo == 0, head=hi == c.n_layers, blocks=self.weights == "float"
        )
        with torch.inference_mode():
            if self.weights == "int4":
                self._layers = [self._int4_layer(i) for i in range(lo, hi)]
            else:
                self._layers = [self._float_layer(lw) for lw in w.layers]
            self._embd = None
            if w.token_embd is not None:
                table = w.token_embd
                if c.family.embedding_scale:  # Gemma's sqrt(d_model) goes into the table
                    table = table * np.float32(np.sqrt(c.d_model))
                self._embd = self._tensor(table)
            self._head: Matrix | None = None
            if w.output is not None and w.output_norm is not None:
                head_dtype = torch.bfloat16 if self.weights == "int4" else self.dtype
                if head_dtype == torch.bfloat16 and not _cpu_takes_bfloat16(self.device):
                    head_dtype = torch.float32  # oneDNN's bfloat16 needs AVX-512 (or AVX-NE)
                self._head = self._matrix(w.output * w.output_norm[None, :], head_dtype)
        self._eps = c.rms_eps
        self._gelu = c.family.activation == "gelu_tanh"
        factors = self.model.rope_factors()
        tables: dict[tuple[float, float, bool], RopeTable] = {}
        self._ropes: list[RopeTable] = []  # per layer of the stage, shared by equal settings
        self._windows: list[int] = []  # per layer: its sliding window, 0 for none
        for layer in range(lo, hi):
            key = c.layer_rope(layer)
            base, scale, scaled = key
            local = c.is_local(layer)
            if key not in tables:
                tables[key] = RopeTable(
                    c.head_dim,
                    base,
                    scale,
                    factors if scaled else None,
                    limit=c.context_length,
                    device=self.device,
                    dtype=self.dtype,
                )
            self._ropes.append(tables[key])
            self._windows.append(c.sliding_window if local else 0)

    def _tensor(self, array: npt.NDArray[Any]) -> torch.Tensor:
        return host(array).to(self.device, self.dtype)

    def _matrix(self, w: npt.NDArray[np.float32], dtype: torch.dtype) -> Matrix:
        if self.device.type == "cpu" and HAS_ONEDNN:
            return OneDNN(host(w), dtype)
        return Dense(self._tensor(w))

    def _vector(self, array: npt.NDArray[Any] | None) -> torch.Tensor | None:
        return None if array is None else self._tensor(array)

    def _float_layer(self, lw: LayerWeights) -> _Layer:
        f = fuse_layer(lw, self.config)
        qkv, wo, gate_up, down = (
            self._matrix(m, self.dtype) for m in (f.qkv, f.wo, f.gate_up, f.down)
        )
        v = self._vector
        return _Layer(
            qkv,
            wo,
            gate_up,
            down,
            qkv_bias=v(f.qkv_bias),
            q_norm=v(f.q_norm),
            k_norm=v(f.k_norm),
            post_attn=v(f.post_attn_norm),
            post_ffn=v(f.post_ffn_norm),
        )

    def _int4_layer(self, i: int) -> _Layer:
        """Block ``i`` from its 4-bit blocks: the rows as `fuse_layer` orders and scales them.

        Phi-3's fused matrices are row slices of one tensor (``attn_qkv``; ``ffn_up`` is
        already ``[gate; up]``). The norm gains stay apart: folding a gain into a column
        would change the blocks.
        """
        c, family = self.config, self.config.family
        q, vector = self.model.quantized, self.model.load_tensor
        name = f"blk.{i}.{{}}".format
        hd, n_q, n_k = c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q_rows, k_rows, within = np.arange(n_q), np.arange(n_k), np.arange(hd)
        if family.rope_interleaved:
            q_rows, k_rows = qk_row_order(c, c.n_heads), qk_row_order(c, c.n_kv_heads)
            within = qk_row_order(c, 1)
        scale = np.float32(1.0 / np.sqrt(hd))
        q_scale = np.float32(1.0) if family.qk_norm else scale  # else in q_norm's gains
        if family.fused_qkv:
            fused = q(name("attn_qkv.weight"))
            qkv = int4(
                unpack_q4(fused, q_rows, scale=float(q_scale)),
                unpack_q4(fused, n_q + k_rows),
                unpack_q4(fused, n_q + n_k + np.arange(n_k)),
            )
        else:
            qkv = int4(
                unpack_q4(q(name("attn_q.weight")), q_rows, scale=float(q_scale)),
                unpack_q4(q(name("attn_k.weight")), k_rows),
                unpack_q4(q(name("attn_v.weight"))),
            )
        if family.fused_gate_up:
            gu = int4(unpack_q4(q(name("ffn_up.weight"))))
        else:
            gu = int4(unpack_q4(q(name("ffn_gate.weight"))), unpack_q4(q(name("ffn_up.weight"))))
        layer = _Layer(
            qkv,
            int4(unpack_q4(q(name("attn_output.weight")))),
            gu,
            int4(unpack_q4(q(name("ffn_down.weight")))),
            attn_norm=self._tensor(vector(name("attn_norm.weight"))),
            ffn_norm=self._tensor(vector(name("ffn_norm.weight"))),
        )
        if family.attention_bias:
            b = [vector(name(f"attn_{x}.bias")) for x in "qkv"]
            layer.qkv_bias = self._tensor(
                np.concatenate([b[0][q_rows] * q_scale, b[1][k_rows], b[2]])
            )
        if family.qk_norm:
            layer.q_norm = self._tensor(vector(name("attn_q_norm.weight"))[within] * scale)
            layer.k_norm = self._tensor(vector(name("attn_k_norm.weight"))[within])
        if family.post_norms:
            layer.post_attn = self._tensor(vector(name("post_attention_norm.weight")))
            layer.post_ffn = self._tensor(vector(name("post_ffw_norm.weight")))
        return layer

    def __repr__(self) -> str:
        return (
            f"<TorchBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"device={self.device} dtype={str(self.dtype).removeprefix('torch.')} "
            f"weights={self.weights}>"
        )

    def new_cache(self) -> TorchKVCache:
        c = self.config
        return TorchKVCache(
            self._hi - self._lo, c.n_kv_heads, c.head_dim, c.context_length, self.device, self.dtype
        )

    def forward(
        self,
        cache: Any,
        position: int,
        *,
        tokens: npt.ArrayLike | Sequence[int] | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Run this stage's layers on new positions (see `stagerun.abc.ComputeBackend`).

        This is `forward_batch` of one item: a session computes the same alone as in a batch.
        """
        return forward_one(self, ForwardItem(cache, position, tokens, hidden, logits, should_stop))

    def forward_batch(
        self, items: Sequence[ForwardItem]
    ) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
        """Several sessions in one pass: rows stacked for the matrices, attention per session.

        Every item is checked before any cache changes. ``should_stop`` is polled per item
        before every layer: an item that stops leaves the batch there, its cache back at its
        position, and its result is the `ComputeCancelled`; the others go on. Each item's
        result is bitwise what it would be alone (see `_matrices`).
        """
        if not items:
            return []
        if len({id(item.cache) for item in items}) != len(items):
            raise ValueError("two items of one batched forward share a KV cache.")
        with torch.inference_mode():
            inputs = [self._start(item) for item in items]
            for item, x in zip(items, inputs, strict=True):
                item.cache.trim(item.position)
                item.cache.reserve(item.position + x.shape[0])
            end = max(item.position + x.shape[0] for item, x in zip(items, inputs, strict=True))
            for table in self._ropes:
                table.reach(end)
            batch = Batch(inputs, items)
            for i, layer in enumerate(self._layers):
                batch.poll(self._lo + i)
                if not batch.live:
                    break
                self._block(layer, i, batch)
            return self._finish(batch)

    def _start(self, item: ForwardItem) -> torch.Tensor:
        """An item's input rows on the device, its arguments and cache checked."""
        if item.logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {item.logits!r}.")
        if not isinstance(item.cache, TorchKVCache):
            raise ValueError("this cache was not made by a TorchBackend.")
        h = self._input(item.tokens, item.hidden)
        self._check_position(item.cache, item.position, h.shape[0])
        return h

    def _finish(self, batch: Batch) -> list[np.ndarray[Any, Any] | ComputeCancelled]:
        """Each live item's output on the host: its hidden rows, or on the last stage logits."""
        picked: list[torch.Tensor] = []
        for k, item in enumerate(batch.items):
            if batch.cancelled[k] is None:
                item.cache.length = item.position + batch.sizes[k]
                rows = batch.rows_of(k)
                picked.append(rows if self._head is None or item.logits == "all" else rows[-1:])
        outputs: list[np.ndarray[Any, Any]] = []
        if picked:
            out = torch.cat(picked) if len(picked) > 1 else picked[0]
            if self._head is not None:
                out = self._head(self._norm(out))
                if self.config.final_softcap:
                    out = softcap(out, self.config.final_softcap)
            rows_out = out.to("cpu", torch.float32).numpy()
            bounds = np.cumsum([0] + [p.shape[0] for p in picked])
            outputs = [rows_out[a:b] for a, b in itertools.pairwise(bounds)]
        live = iter(outputs)
        return [r if r is not None else next(live) for r in batch.cancelled]

    def _input(self, tokens: object, hidden: object) -> torch.Tensor:
        rows = stage_input(
            tokens,
            hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        if self.is_first:
            assert self._embd is not None
            return self._embd[torch.from_numpy(rows).to(self.device)]
        return torch.from_numpy(rows).to(self.device, self.dtype)

    def _check_position(self, cache: TorchKVCache, position: int, n: int) -> None:
        c = self.config
        if (cache._layers, cache._n_kv, cache._hd) != (
            self._hi - self._lo,
            c.n_kv_heads,
            c.head_dim,
        ):
            raise ValueError("this KV cache was made by a backend with another layer range.")
        check_positions(cache.length, position, n, c.context_length)

    def _norm(self, h: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        return F.rms_norm(h, (h.shape[-1],), gain, self._eps)

    def _block(self, layer: _Layer, i: int, batch: Batch) -> None:
        """Layer ``i`` on every live row of ``batch``: ``batch.h`` becomes its output."""
        c = self.config
        h, hd, n_kv, n_heads = batch.h, c.head_dim, c.n_kv_heads, c.n_heads
        half, nqk = hd // 2, n_heads + n_kv
        qkv = layer.w_qkv(self._norm(h, layer.attn_norm))
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qkv = qkv.view(h.shape[0], nqk + n_kv, hd)
        qk = qkv[:, :nqk]
        if layer.q_norm is not None and layer.k_norm is not None:
            queries = self._norm(qk[:, :n_heads], layer.q_norm)
            qk = torch.cat([queries, self._norm(qk[:, n_heads:], layer.k_norm)], dim=1)
        # RoPE on the Q and K heads at once: their rows are in halves order (fuse_layer)
        x1, x2 = qk[..., :half], qk[..., half:]
        cos, sin = batch.rope(self._ropes[i])
        qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        v = qkv[:, nqk:]
        window = self._windows[i]
        parts = [
            self._attend(i, batch.items[k], qk[a:b], v[a:b], *batch.keys(k, window))
            for k, (a, b) in batch.spans()
        ]
        out = layer.w_o(parts[0] if len(parts) == 1 else torch.cat(parts))
        h = h + self._post_norm(out, layer.post_attn)
        gu = layer.w_gu(self._norm(h, layer.ffn_norm))
        act = (gelu_tanh_mul if self._gelu else silu_mul)(gu[:, : c.d_ff], gu[:, c.d_ff :])
        batch.h = h + self._post_norm(layer.w_down(act), layer.post_ffn)

    def _post_norm(self, out: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
        """A block output as it joins the residual stream: normalized first, if the family says."""
        return out if gain is None else self._norm(out, gain)

    def _attend(
        self,
        i: int,
        item: ForwardItem,
        qk: torch.Tensor,
        v: torch.Tensor,
        first: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One session's attention in layer ``i``: its new K/V cached, its rows' outputs.

        The rows see the keys from ``first`` on, as ``mask`` says (`visible_keys`).
        """
        c = self.config
        n, n_heads, cache = qk.shape[0], c.n_heads, item.cache
        pos, end = item.position, item.position + n
        cache.k[i, :, pos:end] = qk[:, n_heads:].transpose(0, 1)
        cache.v[i, :, pos:end] = v.transpose(0, 1)
        keys, values = cache.k[i, :, first:end], cache.v[i, :, first:end]  # [n_kv, L, hd]
        query = qk[:, :n_heads].transpose(0, 1)  # [n_heads, T, hd]
        attn = attention(query, keys, values, mask, c.attn_softcap)
        return attn.transpose(0, 1).reshape(n, n_heads * c.head_dim)


class TorchInt4Backend(TorchBackend):
    """`TorchBackend` with ``weights="int4"``: the GGUF's 4-bit blocks on the CPU."""

    default_weights: ClassVar[str] = "int4"


def _cpu_takes_bfloat16(device: torch.device) -> bool:
    """Whether oneDNN can prepack a bfloat16 matrix here (not on AVX2-only CPUs)."""
    if device.type != "cpu" or not HAS_ONEDNN:
        return True
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True
