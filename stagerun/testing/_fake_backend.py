"""A deterministic compute backend with integer arithmetic, for fast pipeline tests.

Theory of operation: hidden states carry small integers, which float32 holds exactly, so
splitting the layers across stages changes nothing, bit for bit (as long as activations travel
as ``f32``; ``f16`` and ``q8`` round them and the backend says so). Row ``t`` of a hidden state
is ``[token, position, mix, 0, ...]``. Every layer is a toy attention: its cache keeps, per
position, the running sum (mod vocab) of the tokens it has seen, and the layer adds that prefix
sum to ``mix``. So a stale or untrimmed cache changes the answer, as it would in a real model,
while the result stays a closed form: after all ``L`` layers the greedy next token after
``context`` is::

    (context[-1] + (len(context) - 1) + L * sum(context)) % vocab

`FakeBackend.next_token` computes it, so a test can predict a whole greedy decode. Only the
model's config is read (``n_layers``, ``d_model``, ``vocab_size``, ``context_length``), never
its weights: any object with such a ``config`` will do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from .._errors import ComputeCancelled, LayerRangeError
from ..abc import ComputeBackend
from ..backends._inputs import check_positions, stage_input

if TYPE_CHECKING:
    from ..model import ModelFile

__all__ = ["FakeBackend", "FakeKVCache"]

F32 = npt.NDArray[np.float32]
_TOKEN, _POSITION, _MIX = 0, 1, 2
_WIDTH = 3  # columns in use; d_model must be at least this
_PEAK = np.float32(8.0)  # the greedy token's logit; every other logit is 0


class _Config(Protocol):
    @property
    def n_layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_length(self) -> int: ...


class _Configured(Protocol):
    @property
    def config(self) -> _Config: ...


class FakeKVCache:
    """Per-layer prefix sums of the tokens at positions ``0..length-1``."""

    def __init__(self, layers: tuple[int, int], capacity: int) -> None:
        self.layers = layers
        self.length = 0
        self._sums = np.zeros((layers[1] - layers[0], capacity), np.int64)

    def __repr__(self) -> str:
        lo, hi = self.layers
        return f"<FakeKVCache length={self.length} layers=[{lo}, {hi})>"

    def trim(self, position: int) -> None:
        """Forget every position at and after ``position`` (no-op past the end)."""
        if position < 0:
            raise ValueError(f"cannot trim the KV cache to negative position {position}.")
        self.length = min(self.length, position)


class FakeBackend(ComputeBackend):
    """Runs layers ``lo..hi-1`` of a toy model whose greedy output is known in advance.

    Args:
        model: a `stagerun.model.ModelFile` (or anything with a ``config`` carrying
            ``n_layers``, ``d_model`` >= 3, ``vocab_size`` and ``context_length``).
        layers: ``(lo, hi)``, half-open; None runs every layer.
        threads: accepted for the interface and checked, never used.
    """

    def __init__(
        self,
        model: ModelFile | _Configured,
        layers: tuple[int, int] | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        c = model.config
        self.model = model
        self.n_layers, self.d_model, self.vocab_size = c.n_layers, c.d_model, c.vocab_size
        self.context_length = c.context_length
        lo, hi = layers if layers is not None else (0, c.n_layers)
        if not 0 <= lo < hi <= c.n_layers:
            raise LayerRangeError(
                f"layer range [{lo}, {hi}) is not a non-empty part of [0, {c.n_layers}); "
                f"the model has {c.n_layers} layers."
            )
        if c.d_model < _WIDTH:
            raise ValueError(f"the fake backend needs d_model >= {_WIDTH}, not {c.d_model}.")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}.")
        self._lo, self._hi, self.threads = lo, hi, threads

    def __repr__(self) -> str:
        return (
            f"<FakeBackend layers=[{self._lo}, {self._hi}) of {self.n_layers} "
            f"first={self.is_first} last={self.is_last}>"
        )

    @property
    def layers(self) -> tuple[int, int]:
        return (self._lo, self._hi)

    @property
    def is_first(self) -> bool:
        """This stage takes token ids."""
        return self._lo == 0

    @property
    def is_last(self) -> bool:
        """This stage returns logits."""
        return self._hi == self.n_layers

    def next_token(self, context: Sequence[int]) -> int:
        """The greedy token a full pipeline predicts after ``context`` (see the module doc)."""
        if not context:
            raise ValueError("the context must hold at least one token.")
        total = sum(int(t) for t in context)
        return (int(context[-1]) + len(context) - 1 + self.n_layers * total) % self.vocab_size

    def new_cache(self) -> FakeKVCache:
        """An empty cache for one request on this stage."""
        return FakeKVCache(self.layers, self.context_length)

    def forward(
        self,
        cache: FakeKVCache,
        position: int,
        *,
        tokens: Sequence[int] | npt.ArrayLike | None = None,
        hidden: npt.ArrayLike | None = None,
        logits: Literal["last", "all"] = "last",
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Run this stage's layers on positions ``position..position+T-1``.

        Same contract as `stagerun.backends.NumpyBackend.forward`: ``tokens`` on the first
        stage, ``hidden`` ``[T, d_model]`` on the others; a longer cache is trimmed first;
        ``should_stop`` is polled before every layer.

        Returns:
            float32 hidden states ``[T, d_model]``, or on the last stage logits ``[T, vocab]``
            (``logits="all"``) or ``[1, vocab]``: 8.0 at the greedy token, 0 elsewhere.

        Raises:
            ComputeCancelled: ``should_stop()`` returned True; the cache is back at ``position``.
            ValueError: bad inputs, a cache of another layer range, or a position that leaves
                a gap in the cache or runs past the context length.
        """
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {logits!r}.")
        h = self._input(tokens, hidden)
        n = h.shape[0]
        self._check_position(cache, position, n)
        cache.trim(position)
        ids = h[:, _TOKEN].astype(np.int64)
        end = position + n
        for i in range(self._hi - self._lo):
            if should_stop is not None and should_stop():
                cache.trim(position)
                raise ComputeCancelled(
                    f"compute at position {position} stopped before layer {self._lo + i}."
                )
            sums = cache._sums[i]
            before = int(sums[position - 1]) if position > 0 else 0
            sums[position:end] = (before + np.cumsum(ids)) % self.vocab_size
            h[:, _MIX] = (h[:, _MIX].astype(np.int64) + sums[position:end]) % self.vocab_size
            cache.length = end  # layer by layer, so a stop must trim
        h[:, _POSITION] = np.arange(position, end)
        if not self.is_last:
            return h
        rows = h if logits == "all" else h[-1:]
        target = rows[:, _TOKEN].astype(np.int64) + rows[:, _POSITION].astype(np.int64)
        target = (target + rows[:, _MIX].astype(np.int64)) % self.vocab_size
        out = np.zeros((rows.shape[0], self.vocab_size), np.float32)
        out[np.arange(rows.shape[0]), target] = _PEAK
        return out

    def _input(self, tokens: object, hidden: object) -> F32:
        rows = stage_input(
            tokens,
            hidden,
            first=self.is_first,
            lo=self._lo,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
        )
        if self.is_first:
            h = np.zeros((rows.size, self.d_model), np.float32)
            h[:, _TOKEN] = rows
            return h
        h = rows
        used = h[:, :_WIDTH]
        if not (
            np.array_equal(used, np.round(used))
            and used.min() >= 0
            and used[:, [_TOKEN, _MIX]].max() < self.vocab_size
        ):
            raise ValueError(
                "`hidden` is not the fake backend's: its first columns must hold token ids "
                "(were the activations sent as f16 or q8? the fake backend needs f32)."
            )
        return h

    def _check_position(self, cache: object, position: int, n: int) -> None:
        if not isinstance(cache, FakeKVCache) or cache.layers != self.layers:
            raise ValueError("this cache was not made by a fake backend of this layer range.")
        check_positions(cache.length, position, n, self.context_length)
