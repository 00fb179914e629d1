"""The sessions of one batched forward of the torch backend (`TorchBackend.forward_batch`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stagerun import ComputeCancelled
from stagerun.abc import ForwardItem
from stagerun.backends import poll_stops

__all__ = ["Batch"]


class Batch:
    """The sessions of one batched forward: their stacked rows, and which are still live.

    ``h`` holds the live items' rows one item after another; ``cos``/``sin`` the RoPE tables
    at those rows' positions (``[R, 1, head_dim/2]``, to broadcast over the heads); ``masks``
    each item's causal mask (None for one row: it sees the whole cache).
    """

    def __init__(
        self,
        inputs: list[torch.Tensor],
        items: Sequence[ForwardItem],
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.items = items
        self.sizes = [x.shape[0] for x in inputs]
        self.cancelled: list[ComputeCancelled | None] = [None] * len(items)
        self.h = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
        device = self.h.device
        self.masks = [
            _causal(it.position, n, device) for it, n in zip(items, self.sizes, strict=True)
        ]
        self._live = list(range(len(items)))
        self._positions = torch.cat(
            [
                torch.arange(it.position, it.position + n)
                for it, n in zip(items, self.sizes, strict=True)
            ]
        ).to(device)
        self._tables = tables
        self._gather()

    def __repr__(self) -> str:
        return f"<Batch items={len(self.items)} live={len(self._live)} rows={self.h.shape[0]}>"

    @property
    def live(self) -> bool:
        return bool(self._live)

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
        self._gather()

    def _gather(self) -> None:
        """The RoPE tables at the live rows' positions."""
        cos, sin = self._tables
        self.cos = cos[self._positions][:, None, :]
        self.sin = sin[self._positions][:, None, :]


def _causal(position: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Row ``t`` of ``n`` new rows from ``position`` sees the cache and new rows up to itself."""
    if n == 1:
        return None
    seen = torch.arange(position + n, device=device)[None, :]
    return seen <= position + torch.arange(n, device=device)[:, None]
