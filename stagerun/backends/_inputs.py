"""Checks every compute backend makes on a forward's input, in one place.

Backends (the built-ins and plugins alike) call `stage_input` and `check_positions` so that a
bad call fails the same way, with the same message, whichever backend runs the stage; and
`forward_one` and `poll_stops` so that a batched forward treats its items the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ComputeCancelled
from ..abc import ForwardItem

__all__ = ["check_positions", "forward_one", "poll_stops", "stage_input"]


def stage_input(
    tokens: object,
    hidden: object,
    *,
    first: bool,
    lo: int,
    vocab_size: int,
    d_model: int,
) -> npt.NDArray[Any]:
    """A forward's rows: int64 token ids ``[T]`` on the first stage, else hidden ``[T, d_model]``.

    Hidden states come back as a new float32 array (the caller's is never modified).

    Raises:
        ValueError: the wrong input for the stage's place, an empty or non-integer token list,
            an id outside the vocabulary, or hidden states of the wrong shape or holding NaN
            or infinity (a compute on them could only give garbage).
    """
    if first:
        if tokens is None or hidden is not None:
            raise ValueError("the first stage takes `tokens` and no `hidden`.")
        ids = np.asarray(tokens).reshape(-1)
        if ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError("`tokens` must be a non-empty sequence of integer token ids.")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}).")
        return ids.astype(np.int64, copy=False)
    if hidden is None or tokens is not None:
        raise ValueError(f"the non-first stage (layers from {lo}) takes `hidden`.")
    h = np.array(hidden, dtype=np.float32, copy=True)
    if h.ndim != 2 or h.shape[0] == 0 or h.shape[1] != d_model:
        raise ValueError(f"`hidden` must be [T, {d_model}] with T >= 1, not {h.shape}.")
    finite = np.isfinite(h)
    if not finite.all():
        row, col = (int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(
            f"`hidden` holds {h[row, col]} at row {row}, column {col}: activations must be "
            "finite (f16 overflows to infinity beyond +-65504; send such activations as f32)."
        )
    return h


def check_positions(
    length: int, position: int, n: int, limit: int, *, limit_name: str = "the context length"
) -> None:
    """``n`` new positions from ``position`` fit a cache holding ``length`` of at most ``limit``.

    Raises:
        ValueError: a negative position, a gap after the cached positions, or past ``limit``.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, not {position}.")
    if length < position:
        raise ValueError(
            f"position {position} leaves a gap: the KV cache holds only {length} tokens."
        )
    if position + n > limit:
        raise ValueError(f"positions up to {position + n} exceed {limit_name} {limit}.")


def forward_one(backend: Any, item: ForwardItem) -> npt.NDArray[Any]:
    """``forward`` as a batch of one: ``backend.forward_batch([item])``'s result, or its
    `ComputeCancelled` raised. A backend whose ``forward`` is this computes the same for a
    session alone as in a batch."""
    (result,) = backend.forward_batch([item])
    if isinstance(result, ComputeCancelled):
        raise result
    out: npt.NDArray[Any] = result
    return out


def poll_stops(
    items: Sequence[ForwardItem], live: Sequence[int], layer: int
) -> dict[int, ComputeCancelled]:
    """Ask each live item of a batch whether to stop before ``layer``.

    The ones that say so, by index, each with the `ComputeCancelled` it ends with; their
    caches are trimmed back to their positions. The caller drops their rows.
    """
    stopped: dict[int, ComputeCancelled] = {}
    for k in live:
        item = items[k]
        if item.should_stop is not None and item.should_stop():
            item.cache.trim(item.position)
            stopped[k] = ComputeCancelled(
                f"compute at position {item.position} stopped before layer {layer}."
            )
    return stopped
