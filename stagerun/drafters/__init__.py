"""Drafters propose tokens for speculative decoding; the target verifies every one.

A drafter is plain blocking code with three methods: ``begin(prompt)`` at the start of a
request, ``commit(tokens)`` when tokens are committed, and ``propose(context, max_tokens)``
returning up to ``max_tokens`` guesses for what follows ``context``.
"""

from ._draft_model import DraftModelDrafter as DraftModelDrafter
from ._ngram import NgramDrafter as NgramDrafter
from ._oracle import OracleDrafter as OracleDrafter

__all__ = ["DraftModelDrafter", "NgramDrafter", "OracleDrafter"]
