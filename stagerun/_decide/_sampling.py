"""Token sampling on the last stage: the logit processors, the draw, and log-probabilities.

Theory of operation: the random stream for the token that will occupy absolute position ``p``
is derived from ``(seed, p)`` alone, never from how many draws came before. A stale
speculative window therefore cannot shift the randomness of later tokens, and plain and
speculative decoding pick the same token wherever they see the same logits.

The processors run in a fixed order on a float64 copy of the row (`adjust_logits`):

1. ``logit_bias`` is added to the raw logits, so it steers greedy decoding too (OpenAI's
   rule: -100 bans a token);
2. the repetition penalty (HF's and llama.cpp's): each distinct token of the last
   ``repetition_last_n`` tokens of the context, prompt included, has a positive logit divided
   by it and a negative one multiplied;
3. the presence and frequency penalties (OpenAI's): over the tokens *generated* so far,
   ``logit -= frequency * count + presence * (count > 0)``;
4. the grammar's mask: every token it does not allow gets -inf.

Then `sample_token` draws. Temperature 0 is greedy (argmax, lowest id on ties). Otherwise:
scale by 1/temperature, keep the top-k logits (k = 0 keeps all), then the tokens at least
``min_p`` times as probable as the most probable one, then the smallest prefix of the sorted
candidates whose probability mass reaches top-p, and draw one with the position's generator.
Every step depends on the row's logits, the request's parameters and the tokens before the
row alone, so a row gives the same token alone, batched or in a speculative window. A
temperature so small that the scaled logits overflow (5e-324) is greedy too, which is the
limit it tends to: dividing on would make every probability NaN.

Log-probabilities (`row_logprobs`) are those of the model's raw distribution: the
log-softmax of the row as the model computed it, before any processor (vLLM's default
``raw_logprobs``). They do not depend on the sampling settings, so an evaluation harness can
score text with any of them, and they are bitwise the same in every mode that gives the same
logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._proto import SamplingParams

__all__ = ["adjust_logits", "position_generator", "row_logprobs", "sample_token"]


def position_generator(seed: int, position: int) -> np.random.Generator:
    """The generator that samples the token at absolute ``position``."""
    return np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFFFFFF, position]))


def adjust_logits(
    logits: np.ndarray[Any, Any],
    params: SamplingParams,
    *,
    generated: np.ndarray[Any, Any] | None = None,
    recent: Sequence[int] = (),
    allowed: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """The row after the request's processors, as a float64 copy (``logits`` is not changed).

    Args:
        logits: the model's ``[vocab]`` row.
        params: the request's settings.
        generated: per token id, how many times it was generated before this row (the
            presence and frequency penalties'; None when they are off).
        recent: the context tokens the repetition penalty counts.
        allowed: the grammar's mask, a ``[vocab]`` bool array (None: no grammar).
    """
    out = logits.astype(np.float64)
    vocab = out.shape[0]
    if params.bias_ids:
        ids = np.asarray(params.bias_ids)
        inside = ids < vocab
        out[ids[inside]] += np.asarray(params.bias_values)[inside]
    if params.repetition_penalty != 1.0 and len(recent):
        seen = np.unique(np.asarray(recent, dtype=np.int64))
        seen = seen[seen < vocab]
        values = out[seen]
        penalty = params.repetition_penalty
        out[seen] = np.where(values > 0, values / penalty, values * penalty)
    if generated is not None and (params.presence_penalty or params.frequency_penalty):
        counts = generated[:vocab].astype(np.float64)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if allowed is not None:
        out[~allowed[:vocab]] = -np.inf
    return out


def sample_token(logits: np.ndarray[Any, Any], params: SamplingParams, position: int) -> int:
    """Pick one token from a ``[vocab]`` row of logits for absolute ``position``.

    Only ``logit_bias`` of the processors is applied here; a row with history-dependent
    processors goes through `adjust_logits` first (then pass ``params`` without its bias).
    """
    if params.bias_ids:
        logits = adjust_logits(logits, params)
    return draw_token(logits, params, position)


def draw_token(logits: np.ndarray[Any, Any], params: SamplingParams, position: int) -> int:
    """The draw of `sample_token` on a row the processors have already adjusted."""
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
    # Tokens a grammar or a -inf bias ruled out have probability 0: never a candidate.
    keep = int(np.count_nonzero(probs > 0.0))
    if params.min_p > 0.0:  # probs[0] is the most probable, before normalising: 1
        keep = min(keep, int(np.count_nonzero(probs >= params.min_p)))
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


def row_logprobs(
    logits: np.ndarray[Any, Any], token: int, top: int
) -> tuple[float, list[int], list[float]]:
    """The raw log-probability of ``token`` in the row, and the ``top`` most likely tokens'.

    The top tokens come most likely first, the lower id first on ties.
    """
    row = logits.astype(np.float64)
    peak = row.max()
    shifted = row - peak
    logprobs = shifted - np.log(np.exp(shifted).sum())
    if top == 0:
        return float(logprobs[token]), [], []
    best = np.argpartition(-logprobs, top - 1)[:top] if top < row.shape[0] else np.arange(top)
    best = best[np.lexsort((best, -logprobs[best]))]
    return float(logprobs[token]), [int(i) for i in best], [float(logprobs[i]) for i in best]
