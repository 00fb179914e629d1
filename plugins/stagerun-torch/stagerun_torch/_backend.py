"""One stage's layers of a llama GGUF model in PyTorch, on CUDA or the CPU.

Theory of operation: the weights come from stagerun's own GGUF loader (dequantized to float32),
packed the way the numpy reference packs them, so both compute the same function:

* Q, K and V are one ``(out, in)`` matrix, gate and up another; RMSNorm gains are folded into
  the columns of the matrix that follows the norm and 1/sqrt(head_dim) into W_q.
* Q/K rows are permuted once per head so that RoPE rotates contiguous halves.
* Attention is ``scaled_dot_product_attention`` over the cached keys with grouped-query heads
  (``enable_gqa``) and, for several new tokens, a causal mask offset by the cache length.
* The KV cache is preallocated on the device and grows by doubling.
* Several sessions run as one batch (`TorchBackend.forward_batch`): their rows are stacked
  for the matrix products, the norms and the MLP; the attention runs per session against its
  own cache. The products run in fixed row blocks and the SiLU in single-thread slices
  (`_matrices`), so a session's result is bitwise the same alone and in any batch. `forward`
  is a batch of one.

On the CPU, torch's matrix multiply handles a few rows (a verify window) with little more
memory traffic than one row, where numpy's OpenBLAS path needs panel tricks; on CUDA the stage
runs on the GPU and only activations cross to the host. Float32 by default; ``dtype="float16"``
(or ``bfloat16``) is an opt-in on CUDA.

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

from ._batch import Batch
from ._matrices import HAS_ONEDNN, Dense, Matrix, OneDNN, host, int4, silu_mul, unpack_q4

__all__ = ["TorchBackend", "TorchInt4Backend", "TorchKVCache"]

DEVICE_ENV = "STAGERUN_TORCH_DEVICE"
DTYPE_ENV = "STAGERUN_TORCH_DTYPE"
WEIGHTS_ENV = "STAGERUN_TORCH_WEIGHTS"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CHUNK = 256  # first KV allocation, in tokens


def default_device() -> str:
    """``$STAGERUN_TORCH_DEVICE``, else ``cuda`` when a GPU is visible, else ``cpu``."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


class TorchKVCache:
    """Keys and values of one request on one stage: ``[layers, n_kv, capacity, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        max_length: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.length = 0
        self._max = max_length
        self._layers, self._n_kv, self._hd = n_layers, n_kv, head_dim
        self._device, self._dtype = device, dtype
        self.k = torch.empty((n_layers, n_kv, 0, head_dim), device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)

    def __repr__(self) -> str:
        return f"<TorchKVCache length={self.length} capacity={self.capacity} {self._device}>"

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = min(max(needed, 2 * self.capacity, _CHUNK), max(needed, self._max))
        shape = (self._layers, self._n_kv, cap, self._hd)
        for name in ("k", "v"):
            new = torch.empty(shape, device=self._device, dtype=self._dtype)
            new[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
            setattr(self, name, new)


class _Layer:
    __slots__ = ("attn_norm", "ffn_norm", "w_down", "w_gu", "w_o", "w_qkv")

    def __init__(
        self,
        w_qkv: Matrix,
        w_o: Matrix,
        w_gu: Matrix,
        w_down: Matrix,
        attn_norm: torch.Tensor | None = None,
        ffn_norm: torch.Tensor | None = None,
    ) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down
        self.attn_norm, self.ffn_norm = attn_norm, ffn_norm


class TorchBackend(GgufLayers, ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model with PyTorch.

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
    """

    default_weights: ClassVar[str] = "float"

    families: ClassVar[frozenset[str] | None] = frozenset({"llama"})  # no biases, q/k norms yet

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
            self._embd = self._tensor(w.token_embd) if w.token_embd is not None else None
            self._head: Matrix | None = None
            if w.output is not None and w.output_norm is not None:
                head_dtype = torch.bfloat16 if self.weights == "int4" else self.dtype
                self._head = self._matrix(w.output * w.output_norm[None, :], head_dtype)
            hd, half = c.head_dim, c.head_dim // 2
            inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) * 2.0 / hd))
            angles = np.arange(c.context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
            self._cos = self._tensor(np.cos(angles))  # [position, half]
            self._sin = self._tensor(np.sin(angles))
        self._eps = c.rms_eps

    def _tensor(self, array: npt.NDArray[Any]) -> torch.Tensor:
        return host(array).to(self.device, self.dtype)

    def _matrix(self, w: npt.NDArray[np.float32], dtype: torch.dtype) -> Matrix:
        if self.device.type == "cpu" and HAS_ONEDNN:
            return OneDNN(host(w), dtype)
        return Dense(self._tensor(w))

    def _float_layer(self, lw: LayerWeights) -> _Layer:
        f = fuse_layer(lw, self.config)
        qkv, wo, gate_up, down = (
            self._matrix(m, self.dtype) for m in (f.qkv, f.wo, f.gate_up, f.down)
        )
        return _Layer(qkv, wo, gate_up, down)

    def _int4_layer(self, i: int) -> _Layer:
        c = self.config
        q = self.model.quantized
        name = f"blk.{i}.{{}}.weight".format
        qkv = int4(
            unpack_q4(q(name("attn_q")), qk_row_order(c, c.n_heads), scale=c.head_dim**-0.5),
            unpack_q4(q(name("attn_k")), qk_row_order(c, c.n_kv_heads)),
            unpack_q4(q(name("attn_v"))),
        )
        gu = int4(unpack_q4(q(name("ffn_gate"))), unpack_q4(q(name("ffn_up"))))
        norms = [self._tensor(self.model.load_tensor(name(n))) for n in ("attn_norm", "ffn_norm")]
        return _Layer(
            qkv,
            int4(unpack_q4(q(name("attn_output")))),
            gu,
            int4(unpack_q4(q(name("ffn_down")))),
            *norms,
        )

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
            batch = Batch(inputs, items, (self._cos, self._sin))
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
        half = hd // 2
        qkv = layer.w_qkv(self._norm(h, layer.attn_norm)).view(h.shape[0], n_heads + 2 * n_kv, hd)
        # RoPE on the Q and K heads at once: their rows are in halves order (fuse_layer)
        qk = qkv[:, : n_heads + n_kv]
        x1, x2 = qk[..., :half], qk[..., half:]
        cos, sin = batch.cos, batch.sin
        qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        v = qkv[:, n_heads + n_kv :]
        parts = [
            self._attend(i, batch.items[k], qk[a:b], v[a:b], batch.masks[k])
            for k, (a, b) in batch.spans()
        ]
        h = h + layer.w_o(parts[0] if len(parts) == 1 else torch.cat(parts))
        gu = layer.w_gu(self._norm(h, layer.ffn_norm))
        batch.h = h + layer.w_down(silu_mul(gu[:, : c.d_ff], gu[:, c.d_ff :]))

    def _attend(
        self,
        i: int,
        item: ForwardItem,
        qk: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One session's attention in layer ``i``: its new K/V cached, its rows' outputs."""
        c = self.config
        n, n_heads, cache = qk.shape[0], c.n_heads, item.cache
        pos, end = item.position, item.position + n
        cache.k[i, :, pos:end] = qk[:, n_heads:].transpose(0, 1)
        cache.v[i, :, pos:end] = v.transpose(0, 1)
        keys = cache.k[i, :, :end].unsqueeze(0)  # [1, n_kv, L, hd]
        values = cache.v[i, :, :end].unsqueeze(0)
        query = qk[:, :n_heads].transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, hd]
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=1.0, enable_gqa=n_heads != c.n_kv_heads
        )
        return attn[0].transpose(0, 1).reshape(n, n_heads * c.head_dim)


class TorchInt4Backend(TorchBackend):
    """`TorchBackend` with ``weights="int4"``: the GGUF's 4-bit blocks on the CPU."""

    default_weights: ClassVar[str] = "int4"
