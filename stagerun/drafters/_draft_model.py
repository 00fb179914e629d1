"""Drafting with a second (smaller, or the same) model of the same vocabulary.

The draft model runs in stage 0's process with the reference numpy backend and its own KV
cache. Each proposal first trims that cache to the longest prefix it shares with the query
context (the drafts of a rejected window are simply cut away), feeds the rest of the context in
one forward, then decodes greedily one token at a time. Blocking code: the runtime calls it
from a worker thread. A pipeline shares one instance (loading a model takes seconds) among its
requests: the cache is only a cache, re-synced to each query, and a lock keeps two requests'
worker threads from using it at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from ..abc import Drafter, DrafterOptions
from ..backends import NumpyBackend
from ..model import ModelFile, open_model


class DraftModelDrafter(Drafter):
    """Greedy drafts from a GGUF model that shares the target's vocabulary."""

    name = "draft-model"
    per_request = False  # loading a model takes seconds: one per pipeline, shared

    @classmethod
    def create(cls, options: DrafterOptions) -> DraftModelDrafter:
        if not options.draft_model:
            raise ValueError("the draft-model drafter needs a draft model (--draft-model)")
        return cls(options.draft_model, target_vocab_size=options.target.config.vocab_size)

    def __init__(
        self,
        model: ModelFile | str | os.PathLike[str],
        *,
        target_vocab_size: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.model = model if isinstance(model, ModelFile) else open_model(model)
        vocab = self.model.config.vocab_size
        if target_vocab_size is not None and vocab != target_vocab_size:
            raise ValueError(
                f"the draft model has a vocabulary of {vocab} tokens but the target has "
                f"{target_vocab_size}; a draft model must share the target's vocabulary"
            )
        self.backend = NumpyBackend(self.model, threads=threads)
        self._cache = self.backend.new_cache()
        self._fed: list[int] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<DraftModelDrafter model={self.model.config.name!r} fed={len(self._fed)}>"

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # the cache re-syncs to whatever context the next proposal brings

    def commit(self, tokens: Sequence[int]) -> None:
        pass  # the cache follows whatever context the next proposal brings

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        with self._lock:
            return self._propose(context, max_tokens)

    def _propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or not context:
            return []
        limit = self.model.config.context_length - 1
        if len(context) + max_tokens > limit:
            max_tokens = limit - len(context)
            if max_tokens <= 0:
                return []
        shared = 0
        for a, b in zip(self._fed, context, strict=False):
            if a != b:
                break
            shared += 1
        shared = min(shared, len(context) - 1)  # always feed at least the last token
        self._fed = list(context[:shared])
        pending = np.asarray(context[shared:], dtype=np.int64)
        drafts: list[int] = []
        position = shared
        for _ in range(max_tokens):
            logits = self.backend.forward(self._cache, position, tokens=pending)
            token = int(np.argmax(logits[-1]))
            self._fed.extend(int(t) for t in pending)
            position += len(pending)
            drafts.append(token)
            pending = np.asarray([token], dtype=np.int64)
        return drafts
