"""The torch backend's KV cache: one session's keys and values on one stage, on the device."""

from __future__ import annotations

import torch

__all__ = ["TorchKVCache"]

_CHUNK = 256  # first KV allocation, in tokens


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
