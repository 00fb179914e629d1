"""The compute backend conformance suite (`check_backend`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._errors import ComputeCancelled
from ..._proto import PREFIX_BLOCK as _BLOCK
from ...abc import exports_kv
from ._batch import check_batches
from ._common import _Check, _checking


def _relative_error(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    scale = max(float(np.abs(b).max()), 1e-6)
    return float(np.abs(a.astype(np.float64) - b).max() / scale)


BackendFactory = Callable[..., Any]
"""``factory(model, (lo, hi))`` builds a backend for a layer range."""


class _BackendChecks:
    def __init__(
        self, factory: BackendFactory, model: Any, tolerance: float, batch_tolerance: float
    ) -> None:
        self.factory = factory
        self.model = model
        self.tolerance = tolerance
        self.batch_tolerance = batch_tolerance
        c = model.config
        self.n_layers, self.d_model, self.vocab = int(c.n_layers), int(c.d_model), int(c.vocab_size)
        rng = np.random.default_rng(1234)
        self.prompt = [int(t) for t in rng.integers(0, self.vocab, 12)]
        self.other = [int(t) for t in rng.integers(0, self.vocab, 12)]

    def check(self, name: str) -> contextlib.AbstractContextManager[_Check]:
        return _checking("check_backend", name)

    def build(self, lo: int, hi: int) -> Any:
        with self.check(f"build layers [{lo}, {hi})") as check:
            backend = self.factory(self.model, (lo, hi))
            layers = tuple(backend.layers)
            if layers != (lo, hi):
                check.fail(f"backend.layers is {layers}, not {(lo, hi)}")
            if bool(backend.is_first) != (lo == 0) or bool(backend.is_last) != (
                hi == self.n_layers
            ):
                check.fail(
                    f"is_first={backend.is_first} is_last={backend.is_last} for layers "
                    f"[{lo}, {hi}) of {self.n_layers}"
                )
            if backend.new_cache().length != 0:
                check.fail("new_cache() is not empty (its length is not 0)")
        return backend

    def outputs(self, check: _Check, out: Any, rows: int, last: bool, what: str) -> Any:
        width = self.vocab if last else self.d_model
        kind = "logits" if last else "hidden states"
        if not isinstance(out, np.ndarray):
            check.fail(f"{what} returned a {type(out).__name__}, not a numpy array")
        if out.dtype != np.float32:
            check.fail(f"{what} returned {kind} of dtype {out.dtype}, not float32")
        if out.shape != (rows, width):
            check.fail(f"{what} returned {kind} of shape {out.shape}, not {(rows, width)}")
        if not np.isfinite(out).all():
            check.fail(f"{what} returned {kind} that are not all finite")
        return out

    def run_chain(self, check: _Check, ranges: Sequence[tuple[int, int]]) -> Any:
        x: Any = None
        for lo, hi in ranges:
            backend = self.build(lo, hi)
            cache = backend.new_cache()
            last = hi == self.n_layers
            what = f"forward() of layers [{lo}, {hi})"
            if lo == 0:
                out = backend.forward(cache, 0, tokens=self.prompt, logits="all")
            else:
                sent = x.copy()
                out = backend.forward(cache, 0, hidden=x, logits="all")
                if not np.array_equal(sent, x):
                    check.fail(f"{what} modified the hidden states it was given")
            x = self.outputs(check, out, len(self.prompt), last, what)
            if cache.length != len(self.prompt):
                check.fail(
                    f"after {what} on {len(self.prompt)} tokens the cache length is {cache.length}"
                )
        return x

    def assert_close(self, check: _Check, got: Any, want: Any, what: str) -> None:
        error = _relative_error(got, want)
        if not error <= self.tolerance:
            check.fail(f"{what} differ by {error:.3g} (relative), more than {self.tolerance:g}")

    def run(self) -> None:
        n, prompt = self.n_layers, self.prompt
        with self.check("logits of one stage") as check:
            full = self.build(0, n)
            reference = self.run_chain(check, [(0, n)])
            last = self.outputs(
                check, full.forward(full.new_cache(), 0, tokens=prompt), 1, True, 'logits="last"'
            )
            self.assert_close(
                check, last, reference[-1:], 'logits="last" and the last row of "all"'
            )
        splits = []
        if n >= 2:
            splits.append([(0, n // 2), (n // 2, n)])
        if n >= 3:
            splits.append([(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)])
        for ranges in splits:
            with self.check(f"layer split {ranges}") as check:
                got = self.run_chain(check, ranges)
                self.assert_close(check, got, reference, "its last-stage logits and one stage's")
        with self.check("decode after prefill") as check:
            cache, k = full.new_cache(), len(prompt) // 2
            out = self.outputs(check, full.forward(cache, 0, tokens=prompt[:k]), 1, True, "prefill")
            self.assert_close(check, out, reference[k - 1 : k], f"prefill of {k} tokens")
            for pos in range(k, len(prompt)):
                what = f"decode at position {pos}"
                out = full.forward(cache, pos, tokens=prompt[pos : pos + 1])
                self.assert_close(
                    check, self.outputs(check, out, 1, True, what), reference[pos : pos + 1], what
                )
        with self.check("KV cache trim and recompute") as check:
            cache, p = full.new_cache(), len(prompt) - 4
            full.forward(cache, 0, tokens=prompt)
            full.forward(cache, p, tokens=self.other[:4])  # a longer cache is trimmed first
            out = full.forward(cache, p, tokens=prompt[p:], logits="all")
            self.assert_close(check, out, reference[p:], "recomputed positions after a rewrite")
            cache.trim(len(prompt) + 100)
            if cache.length != len(prompt):
                check.fail(f"trim past the end changed the length to {cache.length}")
            cache.trim(p)
            if cache.length != p:
                check.fail(f"trim({p}) left the cache length at {cache.length}")
            out = full.forward(cache, p, tokens=prompt[p:], logits="all")
            self.assert_close(check, out, reference[p:], "recomputed positions after trim()")
        with self.check("caches are independent") as check:
            mine, theirs = full.new_cache(), full.new_cache()
            full.forward(mine, 0, tokens=prompt[:-1])
            full.forward(theirs, 0, tokens=self.other)
            out = full.forward(mine, len(prompt) - 1, tokens=prompt[-1:])
            self.assert_close(
                check, out, reference[-1:], "a cache's result after another cache ran"
            )
        self.check_should_stop(full, reference)
        self.check_bad_inputs(full, splits)
        self.check_batches(full, splits)
        if exports_kv(full):
            self.check_kv_export(full)

    def check_kv_export(self, full: Any) -> None:
        """A backend that exports KV blocks: chunking changes nothing, and restores continue
        exactly like the cache they were copied from (`ComputeBackend.export_kv`)."""
        rng = np.random.default_rng(99)
        tokens = [int(t) for t in rng.integers(0, self.vocab, 2 * _BLOCK + 9)]
        n = len(tokens)
        whole = full.forward(full.new_cache(), 0, tokens=tokens, logits="all")
        with self.check("a prompt's logits do not depend on its chunks") as check:
            for chunks in ([n - 1, 1], [5, _BLOCK, n - 5 - _BLOCK], [2 * _BLOCK, n - 2 * _BLOCK]):
                cache, at, rows = full.new_cache(), 0, []
                for size in chunks:
                    rows.append(
                        full.forward(cache, at, tokens=tokens[at : at + size], logits="all")
                    )
                    at += size
                self.assert_exact(check, np.concatenate(rows), whole, f"chunks {chunks}")
        with self.check("export_kv and import_kv restore a prefix exactly") as check:
            source = full.new_cache()
            full.forward(source, 0, tokens=tokens)
            blocks = [full.export_kv(source, i * _BLOCK, (i + 1) * _BLOCK) for i in range(2)]
            if not all(isinstance(getattr(b, "nbytes", None), int) for b in blocks):
                check.fail("export_kv returned a block without an int nbytes")
            full.forward(source, 0, tokens=self.other)  # the copies must not follow it
            restored = full.new_cache()
            full.import_kv(restored, blocks)
            if restored.length != 2 * _BLOCK:
                check.fail(f"import_kv of 2 blocks left the cache length at {restored.length}")
            out = full.forward(restored, 2 * _BLOCK, tokens=tokens[2 * _BLOCK :], logits="all")
            self.assert_exact(check, out, whole[2 * _BLOCK :], "the rows after a restore")

    def assert_exact(self, check: _Check, got: Any, want: Any, what: str) -> None:
        """Bitwise equal, or within ``batch_tolerance`` for a backend that was given one."""
        error = _relative_error(got, want)
        if not (np.array_equal(got, want) or error <= self.batch_tolerance):
            check.fail(f"{what}: logits differ by {error:.3g} (relative) from one whole prefill")

    def check_batches(self, full: Any, splits: Sequence[Sequence[tuple[int, int]]]) -> None:
        """The batch checks (`_batch`) on the whole model, and on a later stage of a split."""
        sequences = [self.prompt, self.other]
        check_batches(
            self,
            full,
            lambda s, a, b: {"tokens": sequences[s][a:b]},
            f"layers [0, {self.n_layers})",
        )
        if not splits:
            return
        (lo0, hi0), (lo, hi) = splits[0][0], splits[0][1]
        first, later = self.build(lo0, hi0), self.build(lo, hi)
        hidden = [first.forward(first.new_cache(), 0, tokens=s, logits="all") for s in sequences]
        check_batches(
            self, later, lambda s, a, b: {"hidden": hidden[s][a:b]}, f"layers [{lo}, {hi})"
        )

    def check_should_stop(self, full: Any, reference: Any) -> None:
        prompt, n = self.prompt, self.n_layers
        with self.check("should_stop cancels the compute") as check:
            cache = full.new_cache()
            full.forward(cache, 0, tokens=prompt[:4])
            polls = 0

            def count() -> bool:
                nonlocal polls
                polls += 1
                return False

            full.forward(full.new_cache(), 0, tokens=prompt, should_stop=count)
            # Between layers, or between graphs of several layers: a one-layer range may
            # never poll, a longer one polls at least once.
            if n >= 2 and polls < 1:
                check.fail(f"should_stop was never polled in {n} layers")
            stops: list[tuple[str, Callable[[], bool]]] = []
            if n >= 2:
                stops.append(("always", lambda: True))
            if polls >= 2:
                calls = iter(range(10**9))
                stops.append(("from its second poll", lambda: next(calls) >= 1))
            for when, should_stop in stops:
                try:
                    full.forward(cache, 4, tokens=prompt[4:], should_stop=should_stop)
                except ComputeCancelled:
                    pass
                else:
                    check.fail(f"should_stop returning True {when} did not raise ComputeCancelled")
                if cache.length != 4:
                    check.fail(
                        f"after a stop at position 4 the cache length is {cache.length}, not 4"
                    )
            out = full.forward(cache, 4, tokens=prompt[4:], logits="all")
            self.assert_close(check, out, reference[4:], "the compute rerun after a stop")

    def check_bad_inputs(self, full: Any, splits: Sequence[Sequence[tuple[int, int]]]) -> None:
        prompt, v, d = self.prompt, self.vocab, self.d_model
        hidden = np.zeros((2, d), np.float32)
        cache = full.new_cache()
        full.forward(cache, 0, tokens=prompt[:3])
        cases: list[tuple[str, Callable[[], object]]] = [
            ("hidden on the first stage", lambda: full.forward(cache, 3, hidden=hidden)),
            (
                "both tokens and hidden",
                lambda: full.forward(cache, 3, tokens=[1, 2], hidden=hidden),
            ),
            ("no tokens", lambda: full.forward(cache, 3, tokens=[])),
            ("a token id equal to the vocab size", lambda: full.forward(cache, 3, tokens=[v])),
            ("a negative token id", lambda: full.forward(cache, 3, tokens=[-1])),
            ("logits='first'", lambda: full.forward(cache, 3, tokens=[1], logits="first")),
            ("a position past the cache (a gap)", lambda: full.forward(cache, 5, tokens=[1])),
            ("a negative position", lambda: full.forward(cache, -1, tokens=[1])),
            ("layers past the model", lambda: self.factory(self.model, (0, self.n_layers + 1))),
            ("an empty layer range", lambda: self.factory(self.model, (1, 1))),
            ("a negative first layer", lambda: self.factory(self.model, (-1, self.n_layers))),
        ]
        if splits:
            lo, hi = splits[0][1]
            later = self.factory(self.model, (lo, hi))
            other = later.new_cache()
            cases += [
                ("tokens on a non-first stage", lambda: later.forward(other, 0, tokens=[1])),
                (
                    "hidden of the wrong width",
                    lambda: later.forward(other, 0, hidden=np.zeros((2, d + 1), np.float32)),
                ),
                ("one-dimensional hidden", lambda: later.forward(other, 0, hidden=np.zeros(d))),
            ]
        for what, call in cases:
            with self.check(f"ValueError on {what}") as check:
                try:
                    call()
                except ValueError:
                    pass
                except Exception as exc:
                    check.fail(f"raised {type(exc).__name__} ({exc}) instead of ValueError")
                else:
                    check.fail("no error was raised")
                if cache.length != 3:
                    check.fail(f"the cache length changed from 3 to {cache.length}")


def check_backend(
    factory: BackendFactory, model: Any, *, tolerance: float = 1e-4, batch_tolerance: float = 0.0
) -> None:
    """Check that a compute backend runs layer ranges of ``model`` as stagerun expects.

    Checks that: ``layers``, ``is_first`` and ``is_last`` match the range; outputs are float32
    of the right shapes (``[T, d_model]`` hidden states, logits ``[T, vocab]`` for
    ``logits="all"`` and ``[1, vocab]`` for ``"last"``); the model split in 2 and 3 stages gives
    one stage's logits; decoding one token at a time after a prefill gives the prefill's logits;
    a longer cache is trimmed by ``forward`` and by ``trim``, and recomputing gives the same
    result; two caches do not interfere; ``should_stop`` is polled (between layers, or groups of
    them) and raises `stagerun.ComputeCancelled` with the cache back at the position; bad inputs
    raise ValueError and leave the cache alone. Logits must agree within ``tolerance`` (relative
    to the largest logit). Then batches (through `stagerun.abc.run_batch`, so a backend without
    its own ``forward_batch`` is checked too): sessions at different positions, prefills and
    one-row decodes, ``logits="all"`` and ``"last"``, on the first stage and on a later one,
    batched in two orders, each get the result of their own ``forward`` and leave their cache as
    it would (the next decode step agrees too); and a ``should_stop`` that fires for one item
    mid-batch cancels that item alone (its result the `stagerun.ComputeCancelled`, its cache
    back at its position) while the others keep their own results. A backend that exports its KV
    cache (`stagerun.abc.ComputeBackend.export_kv`) must also compute a prompt the same whatever
    its chunks, and continue from imported blocks as from the cache they came from.

    Args:
        factory: ``factory(model, (lo, hi))`` builds a backend, e.g. the backend class.
        model: the model to run, an open `stagerun.model.ModelFile` (the tiny one from
            `write_tiny_model` will do).
        tolerance: the largest relative difference allowed between logits.
        batch_tolerance: the largest relative difference allowed between an item's result in
            a batch and alone; 0 (the default) demands bitwise equality, as stagerun promises
            a request; a backend whose kernels round by batch shape (llama.cpp) passes a
            small one.

    Raises:
        AssertionError: a check failed; the message names it.
    """
    _BackendChecks(factory, model, tolerance, batch_tolerance).run()


# --- drafters ---------------------------------------------------------------------------------

# Repetitive, so lookup drafters find matches; and the end of the shortened prompt that
# "begin resets the drafter" starts the next request with (26..29, 5, 6) recurs in the
# continuation followed by 40, so a drafter that remembers the first request proposes otherwise.
