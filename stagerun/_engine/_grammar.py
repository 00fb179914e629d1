"""Grammars for constrained decoding, on llguidance: compiled once, matched per request.

Theory of operation: a request's grammar travels as llguidance's own grammar text (what
`llguidance.LLMatcher.grammar_from_json_schema` and friends give; stage 0 builds and checks
it, see `stagerun.server._grammars`), in ``SamplingParams.grammar``. The stage that samples
compiles it into a matcher for the request (`Grammars.matcher`, in a worker thread: a large
grammar takes milliseconds to compile, and llguidance's parser limits bound it), over the
model's vocabulary (`Grammars` builds llguidance's tokenizer once, from the model's). The
same grammar asked for again (a schema many requests share) is a copy of the compiled one.

A `GrammarMatcher` is the `stagerun._engine._sampler.Grammar` the request's `RowSampler`
moves along its history: it consumes the generated tokens, rolls back what a stale window
or a ``Trim`` took back, and gives the tokens allowed next as a bool mask. llguidance was
chosen for this on measurements (docs/benchmarks.md, "Grammar engines"): a mask in about
10 µs on a 49k vocabulary and 15 µs on a 262k one, rollback, forced tokens, and no torch.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import llguidance
import numpy as np

from ..model import ModelFile
from ..model._tokenizer import Tokenizer

__all__ = ["GrammarError", "GrammarMatcher", "Grammars", "model_grammars"]

COMPILED_KEPT = 16  # compiled grammars kept for reuse, per stage


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that failed (one plain sentence)."""


class GrammarMatcher:
    """One request's position in its grammar, over a vocabulary of ``vocab`` tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab

    def __repr__(self) -> str:
        return f"<GrammarMatcher vocab={self.vocab} stopped={self._matcher.is_stopped()}>"

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts one after another from here."""
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0

    def consume(self, tokens: list[int]) -> None:
        """Advance over ``tokens`` (all accepted by `valid_prefix`)."""
        if tokens and not self._matcher.consume_tokens(tokens):
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens consumed."""
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"the grammar could not roll back: {self._matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar admits as the only continuation from here (maybe none)."""
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def allowed(self) -> np.ndarray[Any, Any]:
        """The tokens allowed next, as a ``[vocab]`` bool array."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        if mask.shape[0] < self.vocab:  # tokens the tokenizer does not know: never allowed
            mask = np.concatenate([mask, np.zeros(self.vocab - mask.shape[0], bool)])
        if not mask.any():
            raise GrammarError(f"the grammar allows no token: {self._matcher.get_error()}")
        return mask


class Grammars:
    """Compiles grammars over one model's vocabulary; thread-safe (compiles run in threads).

    Args:
        tokenizer: the model's tokenizer.
        vocab: the model's vocabulary size (its logits' width).
    """

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        self._tokenizer = tokenizer
        self.vocab = vocab
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )

    def __repr__(self) -> str:
        return f"<Grammars vocab={self.vocab} kept={len(self._compiled)}>"

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a quarter second)."""
        with self._lock:
            if self._ll is None:
                tokenizer = self._tokenizer
                eos = tokenizer.eos_id
                if eos is None:
                    eos = min(tokenizer.eog_ids, default=0)
                self._ll = llguidance.LLTokenizer(tokenizer.to_json(), eos_token=eos)
            return self._ll

    def check(self, grammar: str) -> None:
        """Raise `GrammarError` naming what is wrong with ``grammar``, if anything (blocking).

        It is compiled, and kept: the request's own matchers are copies of it.
        """
        self.matcher(grammar)

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A matcher at the start of ``grammar`` (blocking: call it in a worker thread)."""
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
                return GrammarMatcher(pristine.deep_copy(), self.vocab)
        compiled = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            first = (compiled.get_error().strip().splitlines() or ["unknown error"])[0]
            raise GrammarError(f"the grammar does not compile: {first[:500]}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return GrammarMatcher(compiled.deep_copy(), self.vocab)


def model_grammars(backend: Any) -> Grammars | None:
    """Grammars over the vocabulary of the model a last stage's ``backend`` runs.

    None for a stage that does not sample, or a backend that does not say its model (the
    built-in ones do, as ``backend.model``): that stage refuses requests with a grammar.
    """
    model = getattr(backend, "model", None)
    if not backend.is_last or not isinstance(model, ModelFile):
        return None
    return Grammars(model.tokenizer, model.config.vocab_size)
