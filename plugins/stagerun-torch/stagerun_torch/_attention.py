"""RoPE tables, the keys a row sees, and one session's attention, for the torch backend.

Theory of operation: a stage's layers share a RoPE table when they share its settings (the
base, the linear scale and Llama 3's frequency divisors), so a Gemma 3 stage holds two, one
for its local layers and one for its global ones. Tables are computed in float64 with numpy,
exactly as the numpy reference computes them, rounded once to the backend's dtype, and grow
by doubling as positions are used.

A row at position ``p`` sees the keys ``0..p``, or with a sliding window of ``w`` the keys
``p-w+1..p``: `visible_keys` gives the first key any new row sees (keys before it are left
out of the call) and a boolean mask over the rest, None when one row sees them all (a decode
step). Attention is ``scaled_dot_product_attention`` (the 1/sqrt(head_dim) is in the
queries), except with a score softcap (Gemma 2's ``cap * tanh(s / cap)`` before the
softmax), which SDPA cannot apply, so the scores are computed by hand. Both run one session
on the shapes of that session alone, so a session computes the same alone as in a batch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ._matrices import host

__all__ = ["RopeTable", "attention", "visible_keys"]

_FIRST_TABLE = 1024  # positions of a table's first allocation; later growth doubles


class RopeTable:
    """``cos``/``sin`` ``[position, head_dim/2]`` of one RoPE setting, on the device.

    Angles are ``(position / scale) * inv_freq``, with ``inv_freq = base^(-2i/head_dim)``
    divided by ``factors`` where given (Llama 3).
    """

    __slots__ = ("_device", "_dtype", "_inv_freq", "_limit", "_scale", "cos", "sin")

    def __init__(
        self,
        head_dim: int,
        base: float,
        scale: float,
        factors: npt.NDArray[np.float32] | None,
        *,
        limit: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        half = head_dim // 2
        inv_freq = 1.0 / (base ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
        if factors is not None:
            inv_freq = inv_freq / factors.astype(np.float64)
        self._inv_freq, self._scale, self._limit = inv_freq, scale, limit
        self._device, self._dtype = device, dtype
        self.cos = torch.empty((0, half), device=device, dtype=dtype)
        self.sin = torch.empty_like(self.cos)

    def __repr__(self) -> str:
        return f"<RopeTable positions={self.cos.shape[0]} scale={self._scale}>"

    def reach(self, positions: int) -> None:
        """Make the tables cover positions ``0..positions-1``."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        n = min(max(positions, 2 * have, _FIRST_TABLE), max(positions, self._limit))
        angles = (np.arange(n, dtype=np.float64) / self._scale)[:, None] * self._inv_freq
        self.cos = host(np.cos(angles)).to(self._device, self._dtype)
        self.sin = host(np.sin(angles)).to(self._device, self._dtype)


def visible_keys(
    position: int, n: int, window: int, device: torch.device
) -> tuple[int, torch.Tensor | None]:
    """The first key that ``n`` new rows from ``position`` see, and which keys from it each sees.

    The mask is ``[n, keys]`` over the keys ``first..position+n-1`` (True: seen); None when a
    single row sees them all. ``window`` 0 is plain causal attention.
    """
    first = max(0, position - window + 1) if window else 0
    if n == 1:
        return first, None
    keys = torch.arange(first, position + n, device=device)[None, :]
    rows = position + torch.arange(n, device=device)[:, None]
    seen = keys <= rows
    if window:
        seen &= keys > rows - window
    return first, seen


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """Grouped-query attention of one session: ``[n_heads, T, hd]`` from ``[n_kv, L, hd]`` keys.

    The queries carry the attention scale. Query head ``h`` reads KV head ``h // group``.
    ``softcap`` (0: none) caps the scores at ``softcap * tanh(s / softcap)``.
    """
    n_heads, t, hd = query.shape
    n_kv, length = keys.shape[0], keys.shape[1]
    if not softcap:
        gqa = n_heads != n_kv
        out = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=mask, scale=1.0, enable_gqa=gqa
        )
        return out[0]
    group = n_heads // n_kv
    scores = torch.bmm(query.reshape(n_kv, group * t, hd), keys.transpose(1, 2))
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n_kv, group, t, length)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(n_kv, group * t, length)
    return torch.bmm(weights, values).view(n_heads, t, hd)
