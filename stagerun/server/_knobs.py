"""The sampling fields of a generation request: temperature to penalties and logprobs.

Part of the OpenAI request surface (`._openai`): `parse_knobs` checks the fields that say how
tokens are picked and what is reported of them, and `Knobs.sampling_params` turns them into
the `SamplingParams` the last stage samples with. Pure: no I/O.

Names from other servers are taken where clients send them: llama.cpp's ``repeat_penalty``
and ``repeat_last_n`` beside vLLM's ``repetition_penalty`` (sending both is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._proto import SamplingParams
from .._proto._sampling_params import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS
from ._api_values import Kind, invalid, json_type, optional_bool, optional_int, optional_number

__all__ = ["Knobs", "parse_knobs"]

# The smallest temperature above 0: logits / temperature must stay finite in float64 (5e-324
# makes them inf and the probabilities NaN); below it, sampling is greedy but for near-ties.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's limit
# top_k beyond any vocabulary (token ids are below 2**31 on the wire) keeps every token, as 0
# does; larger integers would not fit the wire's int64.
MAX_TOP_K = 2**31 - 1
# llama.cpp's default window of its ``repeat_penalty`` (tokens of the context it counts)
DEFAULT_REPEAT_LAST_N = 64


@attrs.frozen
class Knobs:
    """How a request's tokens are picked, and what is reported of them (defaults: OpenAI's).

    ``logprobs`` is -1 for none, else how many alternatives each token reports (0..20).
    ``repetition_last_n`` is the context tokens the repetition penalty counts (0: all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_last_n: int = 0

    def sampling_params(self, seed: int) -> SamplingParams:
        """The settings the last stage samples with, under ``seed``."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            min_p=self.min_p,
            bias_ids=tuple(token for token, _ in self.logit_bias),
            bias_values=tuple(bias for _, bias in self.logit_bias),
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            repetition_last_n=self.repetition_last_n,
        )


def parse_knobs(data: Mapping[str, Any], kind: Kind) -> Knobs:
    """The sampling fields of a ``completion`` or ``chat`` body, checked."""
    temperature, top_p, top_k = _sampling(data)
    repetition, last_n = _repetition(data)
    return Knobs(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=_min_p(data),
        logit_bias=_logit_bias(data.get("logit_bias")),
        logprobs=_logprobs(data, kind),
        presence_penalty=_penalty(data, "presence_penalty"),
        frequency_penalty=_penalty(data, "frequency_penalty"),
        repetition_penalty=repetition,
        repetition_last_n=last_n,
    )


def _sampling(data: Mapping[str, Any]) -> tuple[float, float, int]:
    """The request's temperature, top_p and top_k (defaults 1, 1 and 0: every token)."""
    temperature = optional_number(data, "temperature")
    if temperature is not None and not (
        temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        raise invalid(
            f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}: 0 (greedy) or at least "
            f"{MIN_TEMPERATURE:g}, got {temperature}",
            "temperature",
        )
    top_p = optional_number(data, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid(f"'top_p' must be greater than 0 and at most 1, got {top_p}", "top_p")
    top_k = optional_int(data, "top_k", minimum=-1)
    if top_k is not None and top_k > MAX_TOP_K:
        raise invalid(
            f"'top_k' must be at most {MAX_TOP_K}, got {top_k}: send 0 to keep every token",
            "top_k",
        )
    return (
        1.0 if temperature is None else temperature,
        1.0 if top_p is None else top_p,
        max(top_k or 0, 0),  # -1, the older way of saying off (vLLM), is 0
    )


def _min_p(data: Mapping[str, Any]) -> float:
    min_p = optional_number(data, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise invalid(f"'min_p' must be between 0 and 1, got {min_p}", "min_p")
    return min_p or 0.0


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (JSON keys, so strings) to biases in -100..100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid(f"'logit_bias' must be an object, not {json_type(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(
            f"'logit_bias' biases {len(value)} tokens, more than {MAX_LOGIT_BIAS}", "logit_bias"
        )
    out = []
    for key, bias in value.items():
        where = f"logit_bias.{key[:32]}"
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"'logit_bias' keys must be token ids, got {key[:32]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid(f"'{where}' must be a number from -100 to 100", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _logprobs(data: Mapping[str, Any], kind: Kind) -> int:
    """Chat's ``logprobs`` (true/false) with ``top_logprobs``, or completions' ``logprobs: n``."""
    top = MAX_TOP_LOGPROBS
    if kind == "chat":
        wanted = optional_bool(data, "logprobs")
        n = optional_int(data, "top_logprobs", minimum=0)
        if n is not None and n > top:
            raise invalid(f"'top_logprobs' must be at most {top}, got {n}", "top_logprobs")
        if n and not wanted:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (n or 0) if wanted else -1
    n = optional_int(data, "logprobs", minimum=0)
    if n is not None and n > top:
        raise invalid(f"'logprobs' must be at most {top}, got {n}", "logprobs")
    return -1 if n is None else n


def _penalty(data: Mapping[str, Any], name: str) -> float:
    value = optional_number(data, name)
    if value is not None and not -2.0 <= value <= 2.0:
        raise invalid(f"'{name}' must be between -2 and 2, got {value}", name)
    return value or 0.0


def _repetition(data: Mapping[str, Any]) -> tuple[float, int]:
    """The repetition penalty and the context tokens it counts (0: all of them).

    vLLM's ``repetition_penalty`` counts the whole context; llama.cpp's ``repeat_penalty``
    the last ``repeat_last_n`` (64 by default, -1 for all, 0 turns the penalty off).
    """
    vllm = optional_number(data, "repetition_penalty")
    llama = optional_number(data, "repeat_penalty")
    if vllm is not None and llama is not None:
        raise invalid("send 'repetition_penalty' or 'repeat_penalty', not both", "repeat_penalty")
    name = "repeat_penalty" if llama is not None else "repetition_penalty"
    penalty = llama if llama is not None else vllm
    if penalty is not None and not 0.0 < penalty <= MAX_REPETITION_PENALTY:
        raise invalid(
            f"'{name}' must be greater than 0 and at most {MAX_REPETITION_PENALTY:g}, got "
            f"{penalty}",
            name,
        )
    last_n = optional_int(data, "repeat_last_n", minimum=-1)
    if last_n is None:
        last_n = DEFAULT_REPEAT_LAST_N if llama is not None else -1
    if last_n == 0 or penalty is None:
        return 1.0, 0
    return penalty, min(max(last_n, 0), MAX_TOP_K)
