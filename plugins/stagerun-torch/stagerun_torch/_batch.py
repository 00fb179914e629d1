"""The sessions of one batched forward of the torch backend (`TorchBackend.forward_batch`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stagerun import ComputeCancelled
from stagerun.abc import ForwardItem
from stagerun.backends import poll_stops

from ._attention import RopeTable, visible_keys

__all__ = ["Batch"]


class Batch:
    """The sessions of one batched forward: their stacked rows, and which are still live.

    ``h`` holds the live items' rows one item after another. `rope` gives a RoPE table at
    those rows' positions, `keys` the keys an item's rows see.
    """

    def __init__(self, inputs: list[torch.Tensor], items: Sequence[ForwardItem]) -> None:
        self.items = items
        self.sizes = [x.shape[0] for x in inputs]
        self.cancelled: list[ComputeCancelled | None] = [None] * len(items)
        self.h = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
        self._live = list(range(len(items)))
        self._positions = torch.cat(
            [
                torch.arange(it.position, it.position + n)
                for it, n in zip(items, self.sizes, strict=True)
            ]
        ).to(self.h.device)
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._keys: dict[tuple[int, int], tuple[int, torch.Tensor | None]] = {}

    def __repr__(self) -> str:
        return f"<Batch items={len(self.items)} live={len(self._live)} rows={self.h.shape[0]}>"

    @property
    def live(self) -> bool:
        return bool(self._live)

    def rope(self, table: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """``table``'s cos and sin at the live rows' positions, ``[R, 1, head_dim/2]``.

        Gathered once per table and live set; the table must reach the batch's positions.
        """
        gathered = self._tables.get(id(table))
        if gathered is None:
            gathered = (
                table.cos[self._positions][:, None, :],
                table.sin[self._positions][:, None, :],
            )
            self._tables[id(table)] = gathered
        return gathered

    def keys(self, k: int, window: int) -> tuple[int, torch.Tensor | None]:
        """Item ``k``'s first visible key and mask, with a sliding ``window`` (0: none)."""
        seen = self._keys.get((k, window))
        if seen is None:
            item = self.items[k]
            seen = visible_keys(item.position, self.sizes[k], window, self.h.device)
            self._keys[(k, window)] = seen
        return seen

    def spans(self) -> list[tuple[int, tuple[int, int]]]:
        """``(item, (first row, end row))`` of each live item in ``h``."""
        spans, row = [], 0
        for k in self._live:
            spans.append((k, (row, row + self.sizes[k])))
            row += self.sizes[k]
        return spans

    def rows_of(self, k: int) -> torch.Tensor:
        """Live item ``k``'s rows in ``h``."""
        return next(self.h[a:b] for j, (a, b) in self.spans() if j == k)

    def poll(self, layer: int) -> None:
        """Ask each live item whether to stop before ``layer``; drop the ones that say so.

        A stopped item's cache is trimmed back to its position and its result is the
        `ComputeCancelled`; the other items' rows stay in ``h``, in order.
        """
        stopping = poll_stops(self.items, self._live, layer)
        if not stopping:
            return
        keep = torch.ones(self.h.shape[0], dtype=torch.bool)
        for k, (a, b) in self.spans():
            if k in stopping:
                keep[a:b] = False
                self.cancelled[k] = stopping[k]
        self._live = [k for k in self._live if k not in stopping]
        keep = keep.to(self.h.device)
        self.h, self._positions = self.h[keep], self._positions[keep]
        self._tables.clear()
