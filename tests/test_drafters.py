"""Drafters: prompt lookup, the oracle, and a draft model."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from stagerun.drafters import DraftModelDrafter, NgramDrafter, OracleDrafter
from stagerun.testing import write_tiny_model


def test_ngram_proposes_what_followed_the_longest_earlier_match() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=4)
    d.begin([1, 2, 3, 4, 5, 9, 2, 3, 4, 7])
    # the 4-gram [1, 2, 3, 4] wins over the more recent 3-gram [2, 3, 4]
    assert d.propose([1, 2, 3, 4], 3) == [5, 9, 2]
    # [8, 2, 3, 4] never occurred: [2, 3, 4] did, twice; the most recent is followed by 7
    assert d.propose([8, 2, 3, 4], 3) == [7]
    # only [3, 4] matches when [9, 3, 4] never occurred
    assert d.propose([8, 9, 3, 4], 2) == [7]


def test_ngram_without_a_match_proposes_nothing_and_bounds_proposals() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=3, max_proposal=2)
    d.begin([5, 6, 7, 8, 9, 10])
    assert d.propose([1, 2], 4) == []
    assert d.propose([5, 6], 4) == [7, 8]
    assert d.propose([5, 6], 0) == []


def test_ngram_indexes_committed_tokens_only() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=2)
    d.begin([1, 2])
    optimistic = [1, 2, 3, 1, 2]  # drafts in flight: not in the index
    assert d.propose(optimistic, 3) == []
    d.commit([3])
    assert d.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]


def test_ngram_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=3, max_ngram=2)


def test_oracle_error_rate_is_deterministic() -> None:
    reference = list(range(100, 160))
    perfect = OracleDrafter(reference, vocab_size=1000)
    perfect.begin(reference[:10])
    assert perfect.propose(reference[:10], 5) == reference[10:15]
    wrong = OracleDrafter(reference, error_rate=1.0, vocab_size=1000)
    assert all(
        a != b for a, b in zip(wrong.propose(reference[:10], 5), reference[10:15], strict=True)
    )
    half = OracleDrafter(reference, error_rate=0.5, vocab_size=1000, seed=3)
    guesses = half.propose(reference[:10], 40)
    assert guesses == half.propose(reference[:10], 40)
    misses = sum(a != b for a, b in zip(guesses, reference[10:50], strict=True))
    assert 8 <= misses <= 32


def test_draft_model_self_draft_matches_greedy(tmp_path: Path) -> None:
    from stagerun.backends import NumpyBackend

    path = write_tiny_model(tmp_path / "tiny.gguf")
    target = NumpyBackend(path)
    cache = target.new_cache()
    context = [5, 9, 13, 2]
    logits = target.forward(cache, 0, tokens=context)
    greedy = [int(logits[-1].argmax())]
    for i in range(5):
        logits = target.forward(cache, len(context) + i, tokens=[greedy[-1]])
        greedy.append(int(logits[-1].argmax()))
    drafter = DraftModelDrafter(path, target_vocab_size=target.vocab_size)
    drafter.begin(context)
    assert drafter.propose(context, 6) == greedy
    # after a rejection the drafter re-syncs to the new context
    assert drafter.propose([*context, greedy[0], 7], 2) == drafter.propose(
        [*context, greedy[0], 7], 2
    )
    with pytest.raises(ValueError, match="share the target's vocabulary"):
        DraftModelDrafter(path, target_vocab_size=target.vocab_size + 1)


async def test_a_drafter_proposing_impossible_ids_is_cut_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Drafts beyond the vocabulary are cut where they start; decoding goes on, unchanged."""
    from stagerun import SpeculationConfig, open_pipeline

    class Wild(NgramDrafter):
        def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
            return [*super().propose(context, max_tokens), 10**6][:max_tokens]

    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=2)
    async with open_pipeline(model, stages=2) as pipeline:
        plain = await pipeline.complete("the cat sat on the mat. the cat", max_tokens=16)
        with caplog.at_level(logging.WARNING, logger="stagerun.speculative"):
            wild = await pipeline.complete(
                "the cat sat on the mat. the cat", max_tokens=16, drafter=Wild(),
                speculation=SpeculationConfig("ngram"),
            )  # fmt: skip
    assert wild.token_ids == plain.token_ids
    assert any("drafter Wild proposed 1000000" in r.getMessage() for r in caplog.records)
