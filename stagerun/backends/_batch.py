"""The sessions of one batched forward of the numpy backend, as its layers see them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._errors import ComputeCancelled
from ..abc import ForwardItem
from ._inputs import poll_stops
from ._kernels import _Rope

F32 = npt.NDArray[np.float32]


class _Batch:
    """The sessions of one batched forward: their stacked rows, and which are still live.

    ``h`` holds the live items' rows one item after another; ``cos``/``sin`` the RoPE
    tables at those rows' positions (shaped to broadcast over ``[R, heads, 2, hd/2]``).
    """

    def __init__(self, inputs: list[F32], items: Sequence[ForwardItem]) -> None:
        self._tables: dict[int, tuple[F32, F32]] = {}
        self.items = items
        self.sizes = [x.shape[0] for x in inputs]
        self.cancelled: list[ComputeCancelled | None] = [None] * len(items)
        self.h: F32 = np.concatenate(inputs) if len(inputs) > 1 else inputs[0]
        self._live = list(range(len(items)))
        self._positions = np.concatenate(
            [
                np.arange(it.position, it.position + n)
                for it, n in zip(items, self.sizes, strict=True)
            ]
        )

    @property
    def live(self) -> bool:
        return bool(self._live)

    def rope(self, rope: _Rope) -> tuple[F32, F32]:
        """``rope``'s tables at the live rows' positions (gathered once per live set)."""
        tables = self._tables.get(id(rope))
        if tables is None:
            positions = self._positions
            tables = (rope.cos[positions][:, None], rope.sin[positions][:, None])
            self._tables[id(rope)] = tables
        return tables

    def spans(self) -> list[tuple[int, tuple[int, int]]]:
        """``(item, (first row, end row))`` of each live item in ``h``."""
        spans, row = [], 0
        for k in self._live:
            spans.append((k, (row, row + self.sizes[k])))
            row += self.sizes[k]
        return spans

    def rows_of(self, k: int) -> F32:
        """Live item ``k``'s rows in ``h``."""
        return next(self.h[a:b] for j, (a, b) in self.spans() if j == k)

    def poll(self, layer: int) -> None:
        """Ask each live item whether to stop before ``layer``; drop the ones that say so."""
        stopping = poll_stops(self.items, self._live, layer)
        if stopping:
            keep = np.ones(self.h.shape[0], bool)
            for k, (a, b) in self.spans():
                if k in stopping:
                    keep[a:b] = False
                    self.cancelled[k] = stopping[k]
            self._live = [k for k in self._live if k not in stopping]
            self.h, self._positions = self.h[keep], self._positions[keep]
            self._tables.clear()
