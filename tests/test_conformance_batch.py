"""`check_backend`'s batch checks: the built-ins pass them, and broken batching fails them.

Each broken backend below batches like `NumpyBackend` but gets one thing wrong; the suite must
name the check that catches it, the item and how far off it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from stagerun._errors import ComputeCancelled
from stagerun.abc import ForwardItem, run_batch
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile
from stagerun.testing import FakeBackend, check_backend

Results = list[Any]


class _OneUlpOff(NumpyBackend):
    """The second item of a batch is one float32 step off in one value."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        results: Results = super().forward_batch(items)
        if len(results) > 1 and not isinstance(results[1], ComputeCancelled):
            results[1][0, 0] = np.nextafter(results[1][0, 0], np.float32(np.inf))
        return results


class _FarOff(NumpyBackend):
    """The second item of a batch is 0.01 off everywhere."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        results: Results = super().forward_batch(items)
        if len(results) > 1 and not isinstance(results[1], ComputeCancelled):
            results[1] += np.float32(0.01)
        return results


class _Reversed(NumpyBackend):
    """Results come back in the reverse order of the items."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        return list(reversed(super().forward_batch(items)))


class _StopsEveryone(NumpyBackend):
    """When one item's should_stop fires, every item of the batch is cancelled."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        results: Results = super().forward_batch(items)
        if any(isinstance(r, ComputeCancelled) for r in results):
            for item in items:
                item.cache.trim(item.position)
            return [ComputeCancelled("stopped with the others") for _ in items]
        return results


class _IgnoresStops(NumpyBackend):
    """A batch of several items never polls their should_stop."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        if len(items) > 1:
            items = [ForwardItem(i.cache, i.position, i.tokens, i.hidden, i.logits) for i in items]
        return super().forward_batch(items)


class _ForgetsTheCache(NumpyBackend):
    """A batch computes the right rows but leaves each cache where it was."""

    def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
        lengths = [item.cache.length for item in items]
        results: Results = super().forward_batch(items)
        if len(items) > 1:
            for item, length in zip(items, lengths, strict=True):
                item.cache.length = min(length, item.position)
        return results


@pytest.mark.parametrize(
    ("backend", "match"),
    [
        (
            _OneUlpOff,
            r"check_backend: a batch equals separate forwards \(layers \[0, 4\)\): item 1 "
            r"\(a 7-row prompt on an empty cache\) of a batch in order \[0, 1, 2, 3, 4\] "
            r"differs from the same forward alone by up to \d\.\d+e-07 .*not bitwise equal",
        ),
        (_Reversed, r"a batch equals separate forwards \(layers \[0, 4\)\): item 0 .* shape"),
        (
            _StopsEveryone,
            r"should_stop cancels one item of a batch \(layers \[0, 4\)\): .* was cancelled",
        ),
        (
            _IgnoresStops,
            r"should_stop cancels one item of a batch \(layers \[0, 4\)\): the result of 2 rows "
            r"at position 6 of a cache holding 10, whose should_stop returned True, is a ndarray",
        ),
        (_ForgetsTheCache, r"a batch equals separate forwards .*: after item 0 .* cache length is"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_broken_batching_fails(tiny_model: ModelFile, backend: type, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check_backend(backend, tiny_model)


def test_a_batch_tolerance_admits_small_differences(tiny_model: ModelFile) -> None:
    check_backend(_OneUlpOff, tiny_model, batch_tolerance=1e-6)
    with pytest.raises(AssertionError, match=r"by \d.*\(relative\), more than the batch tol"):
        check_backend(_FarOff, tiny_model, batch_tolerance=1e-6)


def test_the_later_stage_is_checked_too(tiny_model: ModelFile) -> None:
    class _LaterStageOff(_OneUlpOff):
        def forward_batch(self, items: Sequence[ForwardItem]) -> Results:
            if self.is_first:
                return NumpyBackend.forward_batch(self, items)
            return super().forward_batch(items)

    with pytest.raises(AssertionError, match=r"separate forwards \(layers \[2, 4\)\): item 1"):
        check_backend(_LaterStageOff, tiny_model)


def test_backends_without_their_own_batches_pass(tiny_model: ModelFile) -> None:
    """FakeBackend has no forward_batch: run_batch runs its items one after another."""
    check_backend(FakeBackend, tiny_model)
    backend = FakeBackend(tiny_model)
    caches = [backend.new_cache(), backend.new_cache()]
    out = run_batch(backend, [ForwardItem(caches[0], 0, [1, 2]), ForwardItem(caches[1], 0, [3])])
    assert [c.length for c in caches] == [2, 1] and len(out) == 2
