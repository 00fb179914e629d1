"""The numpy backend's KV cache of one session, and the blocks it exports and imports."""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
_CHUNK = 256  # first KV allocation, in tokens; later growth doubles
_KEY_BLOCK = 64  # keys per attention block: every sum over keys has this fixed length


class NumpyKVCache:
    """Keys and values of one session on one stage, for positions ``0..length-1``.

    Keys are stored transposed, ``[layers, n_kv, head_dim, capacity]``, and values as
    ``[layers, n_kv, capacity, head_dim]``: a block of keys is then a plain matrix for the
    score gemm (a transposed operand makes OpenBLAS pick kernels by the row count, and a
    row's scores would depend on its chunk). Storage grows in place by doubling, in whole key
    blocks.
    """

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, max_length: int) -> None:
        self.length = 0
        self._max = max_length
        self._shape = (n_layers, n_kv, 0, head_dim)
        self._k: F32 = np.zeros((n_layers, n_kv, head_dim, 0), np.float32)
        self._v: F32 = np.zeros(self._shape, np.float32)

    def __repr__(self) -> str:
        return f"<KVCache length={self.length} capacity={self.capacity} layers={self._shape[0]}>"

    @property
    def capacity(self) -> int:
        return int(self._v.shape[2])

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` positions, in whole key blocks (attention reads whole blocks).

        New room is zeros: the padding of the last block is masked, and must be finite.
        """
        needed = -(-needed // _KEY_BLOCK) * _KEY_BLOCK
        if needed <= self.capacity:
            return
        cap = min(max(needed, 2 * self.capacity, _CHUNK), max(needed, self._max))
        cap = -(-cap // _KEY_BLOCK) * _KEY_BLOCK
        n_layers, n_kv, _, hd = self._shape
        k = np.zeros((n_layers, n_kv, hd, cap), np.float32)
        k[..., : self.length] = self._k[..., : self.length]
        v = np.zeros((n_layers, n_kv, cap, hd), np.float32)
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v


@attrs.frozen(eq=False)
class KVBlock:
    """A copy of one cache's keys and values for a run of positions (`NumpyBackend.export_kv`)."""

    k: F32  # [layers, n_kv, head_dim, positions]
    v: F32  # [layers, n_kv, positions, head_dim]

    @property
    def positions(self) -> int:
        return int(self.v.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
