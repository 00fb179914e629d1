"""One stage's layers of a llama GGUF model in PyTorch, on CUDA or the CPU.

Theory of operation: the weights come from stagerun's own GGUF loader (dequantized to float32),
packed the way the numpy reference packs them, so both compute the same function:

* Q, K and V are one ``(out, in)`` matrix, gate and up another; RMSNorm gains are folded into
  the columns of the matrix that follows the norm and 1/sqrt(head_dim) into W_q.
* Q/K rows are permuted once per head so that RoPE rotates contiguous halves.
* Attention is ``scaled_dot_product_attention`` over the cached keys with grouped-query heads
  (``enable_gqa``) and, for several new tokens, a causal mask offset by the cache length.
* The KV cache is preallocated on the device and grows by doubling.

On the CPU, torch's matrix multiply handles a few rows (a verify window) with little more
memory traffic than one row, where numpy's OpenBLAS path needs panel tricks; on CUDA the stage
runs on the GPU and only activations cross to the host. Float32 by default; ``dtype="float16"``
(or ``bfloat16``) is an opt-in on CUDA.

The backend is blocking code called from one worker thread at a time. ``threads`` sets torch's
intra-op threads for the process (torch has one setting per process).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from stagerun import ComputeCancelled
from stagerun.abc import ComputeBackend
from stagerun.backends import check_positions, stage_input
from stagerun.model import LayerWeights, ModelFile, open_model

__all__ = ["TorchBackend", "TorchKVCache"]

DEVICE_ENV = "STAGERUN_TORCH_DEVICE"
DTYPE_ENV = "STAGERUN_TORCH_DTYPE"
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
    __slots__ = ("w_down", "w_gu", "w_o", "w_qkv")

    def __init__(
        self, w_qkv: torch.Tensor, w_o: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor
    ) -> None:
        self.w_qkv, self.w_o, self.w_gu, self.w_down = w_qkv, w_o, w_gu, w_down


class TorchBackend(ComputeBackend):
    """Runs blocks ``lo..hi-1`` of a llama GGUF model with PyTorch.

    Args:
        model: an open ModelFile, a model name (``smollm2``) or a GGUF path.
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: torch intra-op threads (process-wide); None leaves torch's setting alone.
        device: ``cpu``, ``cuda``, ``cuda:1``...; default `default_device()`.
        dtype: ``float32`` (default, ``$STAGERUN_TORCH_DTYPE``), or ``float16``/``bfloat16``
            on CUDA.
    """

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        self.model = model if isinstance(model, ModelFile) else open_model(model)
        c = self.model.config
        lo, hi = layers if layers is not None else (0, c.n_layers)
        self.model.check_layers(lo, hi)
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be at least 1, not {threads}.")
            torch.set_num_threads(threads)
        self.threads = threads
        self.device = torch.device(device or default_device())
        dtype_name = dtype or os.environ.get(DTYPE_ENV) or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype_name!r}.")
        if dtype_name != "float32" and self.device.type == "cpu":
            raise ValueError(
                f"{dtype_name} is for CUDA; on the CPU the torch backend runs float32."
            )
        self.dtype = _DTYPES[dtype_name]
        self._lo, self._hi = lo, hi
        w = self.model.load_weights(lo, hi, embeddings=lo == 0, head=hi == c.n_layers)
        with torch.inference_mode():
            self._layers = [self._pack_layer(lw) for lw in w.layers]
            self._embd = self._tensor(w.token_embd) if w.token_embd is not None else None
            self._head = None
            if w.output is not None and w.output_norm is not None:
                self._head = self._tensor(w.output * w.output_norm[None, :])
            hd, half = c.head_dim, c.head_dim // 2
            inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) * 2.0 / hd))
            angles = np.arange(c.context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
            self._cos = self._tensor(np.cos(angles))  # [position, half]
            self._sin = self._tensor(np.sin(angles))
        self._eps = c.rms_eps

    def _tensor(self, array: npt.NDArray[Any]) -> torch.Tensor:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # a view of the mapped GGUF file: torch wants its own
            array = array.copy()
        return torch.from_numpy(array).to(self.device, self.dtype)

    def _pack_layer(self, lw: LayerWeights) -> _Layer:
        c = self.config
        hd = c.head_dim
        perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])

        def halves(m: npt.NDArray[np.float32], heads: int) -> npt.NDArray[np.float32]:
            return m.reshape(heads, hd, -1)[:, perm, :].reshape(heads * hd, -1)

        wq = halves(lw.wq, c.n_heads) * np.float32(1.0 / np.sqrt(hd))
        qkv = np.concatenate([wq, halves(lw.wk, c.n_kv_heads), lw.wv]) * lw.attn_norm[None, :]
        gu = np.concatenate([lw.w_gate, lw.w_up]) * lw.ffn_norm[None, :]
        return _Layer(
            self._tensor(qkv), self._tensor(lw.wo), self._tensor(gu), self._tensor(lw.w_down)
        )

    def __repr__(self) -> str:
        return (
            f"<TorchBackend layers=[{self._lo}, {self._hi}) of {self.config.n_layers} "
            f"device={self.device} dtype={str(self.dtype).removeprefix('torch.')}>"
        )

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def layers(self) -> tuple[int, int]:
        return (self._lo, self._hi)

    @property
    def is_first(self) -> bool:
        return self._lo == 0

    @property
    def is_last(self) -> bool:
        return bool(self._hi == self.config.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.config.d_model)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

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
        """Run this stage's layers on new positions (see `stagerun.abc.ComputeBackend`)."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}.")
        if not isinstance(cache, TorchKVCache):
            raise ValueError("this cache was not made by a TorchBackend.")
        with torch.inference_mode():
            h = self._input(tokens, hidden)
            n = h.shape[0]
            self._check_position(cache, position, n)
            cache.trim(position)
            cache.reserve(position + n)
            for i, layer in enumerate(self._layers):
                if should_stop is not None and should_stop():
                    raise ComputeCancelled(
                        f"compute at position {position} stopped before layer {self._lo + i}."
                    )
                h = self._block(layer, i, cache, position, h)
            cache.length = position + n
            if self._head is None:
                out = h
            else:
                rows = h if logits == "all" else h[-1:]
                out = F.linear(self._norm(rows), self._head)
            return out.to("cpu", torch.float32).numpy()

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

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _block(
        self, layer: _Layer, i: int, cache: TorchKVCache, pos: int, h: torch.Tensor
    ) -> torch.Tensor:
        c = self.config
        n, hd, n_kv, n_heads = h.shape[0], c.head_dim, c.n_kv_heads, c.n_heads
        end = pos + n
        qkv = F.linear(self._norm(h), layer.w_qkv)
        cos = self._cos[pos:end, None, :]
        sin = self._sin[pos:end, None, :]
        q = self._rope(qkv[:, : n_heads * hd].view(n, n_heads, hd), cos, sin)
        k = self._rope(qkv[:, n_heads * hd : (n_heads + n_kv) * hd].view(n, n_kv, hd), cos, sin)
        v = qkv[:, (n_heads + n_kv) * hd :].view(n, n_kv, hd)
        cache.k[i, :, pos:end] = k.transpose(0, 1)
        cache.v[i, :, pos:end] = v.transpose(0, 1)
        keys = cache.k[i, :, :end].unsqueeze(0)  # [1, n_kv, L, hd]
        values = cache.v[i, :, :end].unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, hd]
        mask = None
        if n > 1:
            mask = torch.arange(end, device=h.device)[None, :] <= (
                pos + torch.arange(n, device=h.device)[:, None]
            )
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=1.0, enable_gqa=n_heads != n_kv
        )
        h = h + F.linear(attn[0].transpose(0, 1).reshape(n, n_heads * hd), layer.w_o)
        gu = F.linear(self._norm(h), layer.w_gu)
        g, u = gu[:, : c.d_ff], gu[:, c.d_ff :]
        return h + F.linear(F.silu(g) * u, layer.w_down)
