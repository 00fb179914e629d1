"""`check_backend`'s batch checks: a batched forward gives each item its own forward's result.

Theory of operation: a few sessions' caches are filled to different positions, then each runs
its next forward alone (`ComputeBackend.forward`), and again, from caches filled the same way,
all together through `stagerun.abc.run_batch` (a backend's own ``forward_batch`` where it has
one, else one forward after another), in two orders. Each item's result must equal its solo
result, bitwise unless the suite was given a ``batch_tolerance``, and so must the next decode
step on its cache (the keys and values the batch wrote). Then one item's ``should_stop`` fires
mid-batch: that item alone is cancelled, its cache back at its position, and the others'
results are still their solo results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs
import numpy as np

from ..._errors import ComputeCancelled
from ...abc import ForwardItem, run_batch
from ._common import _Check

if TYPE_CHECKING:
    import contextlib


class _BackendChecks(Protocol):
    """What the batch checks use of `check_backend`'s suite (`_backend._BackendChecks`)."""

    batch_tolerance: float

    def check(self, name: str) -> contextlib.AbstractContextManager[_Check]: ...

    def outputs(self, check: _Check, out: Any, rows: int, last: bool, what: str) -> Any: ...


__all__ = ["check_batches"]

Inputs = Callable[[int, int, int], dict[str, Any]]
"""``inputs(sequence, a, b)``: the forward keywords for rows ``a..b-1`` of a sequence."""


@attrs.frozen
class _Case:
    """One session of the batch: ``filled`` rows of a sequence cached, ``rows`` new ones."""

    name: str
    sequence: int
    filled: int
    position: int
    rows: int
    logits: Literal["last", "all"]

    def item(self, cache: Any, inputs: Inputs, **kw: Any) -> ForwardItem:
        new = inputs(self.sequence, self.position, self.position + self.rows)
        return ForwardItem(cache, self.position, logits=self.logits, **new, **kw)


# Every case leaves a row of its sequence (12 long) for the decode step after it.
_CASES = (
    _Case("a 4-row prefill at position 5", 0, 5, 5, 4, "all"),
    _Case("a 7-row prompt on an empty cache", 1, 0, 0, 7, "last"),
    _Case("a one-row decode at position 8", 1, 8, 8, 1, "last"),
    _Case('a one-row decode at position 3, logits="all"', 0, 3, 3, 1, "all"),
    _Case("2 rows at position 6 of a cache holding 10", 0, 10, 6, 2, "all"),
)
_ORDERS = (tuple(range(len(_CASES))), (4, 2, 0, 3, 1))


class _Solo:
    """Each case's results alone: its forward, and the decode step after it."""

    def __init__(self, batches: _BatchChecks) -> None:
        self.results: list[Any] = []
        self.decodes: list[Any] = []
        for case in _CASES:
            cache = batches.filled(case)
            self.results.append(batches.forward_of(case.item(cache, batches.inputs)))
            self.decodes.append(batches.decode(case, cache))


class _BatchChecks:
    """The batch checks on one backend (a layer range), its inputs given by ``inputs``."""

    def __init__(self, checks: _BackendChecks, backend: Any, inputs: Inputs, where: str) -> None:
        self.checks, self.backend, self.inputs, self.where = checks, backend, inputs, where
        self.last = bool(backend.is_last)
        self.tolerance = checks.batch_tolerance

    def filled(self, case: _Case) -> Any:
        cache = self.backend.new_cache()
        if case.filled:
            self.backend.forward(cache, 0, **self.inputs(case.sequence, 0, case.filled))
        return cache

    def forward_of(self, item: ForwardItem) -> Any:
        return self.backend.forward(
            item.cache,
            item.position,
            tokens=item.tokens,
            hidden=item.hidden,
            logits=item.logits,
            should_stop=item.should_stop,
        )

    def decode(self, case: _Case, cache: Any) -> Any:
        end = case.position + case.rows
        return self.backend.forward(cache, end, **self.inputs(case.sequence, end, end + 1))

    def batch(
        self, order: Sequence[int], stops: dict[int, Callable[[], bool]] | None = None
    ) -> tuple[list[Any], list[Any]]:
        """Run the cases as one batch in ``order``: ``(results, caches)``, in case order.

        ``stops`` gives some cases a ``should_stop``.
        """
        stops = stops or {}
        caches = [self.filled(case) for case in _CASES]
        items = [_CASES[k].item(caches[k], self.inputs, should_stop=stops.get(k)) for k in order]
        got = run_batch(self.backend, items)
        results: list[Any] = [None] * len(_CASES)
        for k, result in zip(order, got, strict=True):
            results[k] = result
        return results, caches

    def same(self, check: _Check, got: Any, want: Any, what: str) -> None:
        """Fail unless ``got`` is ``want``: bitwise, or within the suite's batch tolerance."""
        if isinstance(got, ComputeCancelled):
            check.fail(f"{what} was cancelled ({got}) though its should_stop never fired")
        rows = want.shape[0]
        self.checks.outputs(check, got, rows, self.last, what)
        if self.tolerance == 0:
            if not np.array_equal(got, want):
                gap = float(np.abs(got.astype(np.float64) - want).max())
                check.fail(
                    f"{what} differs from the same forward alone by up to {gap:.3g} "
                    "(a batch must not change an item's result; not bitwise equal)"
                )
            return
        scale = max(float(np.abs(want).max()), 1e-6)
        error = float(np.abs(got.astype(np.float64) - want).max()) / scale
        if not error <= self.tolerance:
            check.fail(
                f"{what} differs from the same forward alone by {error:.3g} (relative), "
                f"more than the batch tolerance {self.tolerance:g}"
            )

    def run(self) -> None:
        with self.checks.check(f"a batch equals separate forwards ({self.where})") as check:
            solo = _Solo(self)
            for order in _ORDERS:
                results, caches = self.batch(order)
                for k, case in enumerate(_CASES):
                    what = f"item {order.index(k)} ({case.name}) of a batch in order {list(order)}"
                    self.same(check, results[k], solo.results[k], what)
                    length = case.position + case.rows
                    if caches[k].length != length:
                        check.fail(f"after {what} the cache length is {caches[k].length}")
                    self.same(
                        check,
                        self.decode(case, caches[k]),
                        solo.decodes[k],
                        f"the decode after {what}",
                    )
        self.check_stop(solo)

    def check_stop(self, solo: _Solo) -> None:
        lo, hi = (int(x) for x in self.backend.layers)
        if hi - lo < 2:
            return  # one layer: a backend may never poll
        name = f"should_stop cancels one item of a batch ({self.where})"
        with self.checks.check(name) as check:
            stopper = 4  # its cache held more than its position: it must be trimmed back
            counted = 0

            def count() -> bool:
                nonlocal counted
                counted += 1
                return False

            self.batch(_ORDERS[1], {stopper: count})
            polls = iter(range(10**9))
            # mid-batch where the backend polls more than once (between layers or graphs)
            first = 1 if counted >= 2 else 0

            def should_stop() -> bool:
                return next(polls) >= first

            results, caches = self.batch(_ORDERS[1], {stopper: should_stop})
            case = _CASES[stopper]
            if not isinstance(results[stopper], ComputeCancelled):
                check.fail(
                    f"the result of {case.name}, whose should_stop returned True, is a "
                    f"{type(results[stopper]).__name__}, not the ComputeCancelled"
                )
            if caches[stopper].length != case.position:
                check.fail(
                    f"after a stop of {case.name} its cache length is "
                    f"{caches[stopper].length}, not {case.position}"
                )
            for k, other in enumerate(_CASES):
                if k != stopper:
                    what = f"{other.name}, batched beside an item that stopped,"
                    self.same(check, results[k], solo.results[k], what)


def check_batches(checks: _BackendChecks, backend: Any, inputs: Inputs, where: str) -> None:
    """Run the batch checks on ``backend``, whose inputs for a sequence's rows ``inputs`` gives."""
    _BatchChecks(checks, backend, inputs, where).run()
