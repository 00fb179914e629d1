"""Token sampling on the last stage.

Theory of operation: the random stream for the token that will occupy absolute position ``p``
is derived from ``(seed, p)`` alone, never from how many draws came before. A stale
speculative window therefore cannot shift the randomness of later tokens, and plain and
speculative decoding pick the same token wherever they see the same logits.

``logit_bias`` is added to the raw logits first, so it steers greedy decoding too (OpenAI's
rule: -100 bans a token). Temperature 0 is greedy (argmax, lowest id on ties). Otherwise:
scale by 1/temperature, keep the top-k logits (k = 0 keeps all), then the tokens at least
``min_p`` times as probable as the most probable one, then the smallest prefix of the sorted
candidates whose probability mass reaches top-p, and draw one with the position's generator.
Every step depends on the row's logits and the request's parameters alone, so a row gives the
same token alone, batched or in a speculative window. A temperature so
small that the scaled logits overflow (5e-324) is greedy too, which is the limit it tends to:
dividing on would make every probability NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._proto import SamplingParams


def position_generator(seed: int, position: int) -> np.random.Generator:
    """The generator that samples the token at absolute ``position``."""
    return np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFFFFFF, position]))


def sample_token(logits: np.ndarray[Any, Any], params: SamplingParams, position: int) -> int:
    """Pick one token from a ``[vocab]`` row of logits for absolute ``position``."""
    if params.bias_ids:
        logits = logits.astype(np.float64)  # a copy: the caller's row stays as it was
        ids = np.asarray(params.bias_ids)
        inside = ids < logits.shape[0]
        logits[ids[inside]] += np.asarray(params.bias_values)[inside]
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        scaled = logits.astype(np.float64) / params.temperature
    if np.isinf(scaled.max()):
        return int(np.argmax(logits))
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        candidates = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    else:
        candidates = np.arange(vocab)
    # Sort by logit descending, then id ascending, so ties never depend on partition order.
    order = np.lexsort((candidates, -scaled[candidates]))
    candidates = candidates[order]
    values = scaled[candidates]
    probs = np.exp(values - values[0])
    if params.min_p > 0.0:  # probs[0] is the most probable, before normalising: 1
        keep = int(np.count_nonzero(probs >= params.min_p))
        candidates, probs = candidates[:keep], probs[:keep]
    probs /= probs.sum()
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        candidates, probs = candidates[:keep], probs[:keep]
        probs = probs / probs.sum()
    draw = position_generator(params.seed, position).random()
    index = int(np.searchsorted(np.cumsum(probs), draw, side="right"))
    return int(candidates[min(index, len(candidates) - 1)])


def sample_rows(
    logits: np.ndarray[Any, Any], params: SamplingParams, first_position: int
) -> list[int]:
    """Sample each row of ``[T, vocab]`` logits; row ``i`` is for ``first_position + i``."""
    return [sample_token(row, params, first_position + i) for i, row in enumerate(logits)]
