"""`SamplingParams`: how the last stage picks a request's tokens, as ``Configure`` carries it.

Its validators keep every value within what the sampler can take (`stagerun._decide._sampling`
applies them), so a peer's out-of-range temperature or penalty is a `ProtocolError` at the
wire like any bad field (see `stagerun._proto._messages`).
"""

from typing import Any, Final

import attrs

from ._fields import (
    _ID_LIMIT,
    _KEY_LIMIT,
    _TOKEN_LIMIT,
    _as_float,
    _as_tuple,
    _bounded_str,
    _finite_float,
    _int_in,
    _int_tuple,
    _show,
)

MAX_LOGIT_BIAS: Final = 1024  # tokens one request may bias (OpenAI allows 300)
MAX_BIAS: Final = 100.0  # OpenAI's range, -100..100: -100 bans a token, 100 all but forces it
MAX_TOP_LOGPROBS: Final = 20  # alternatives per token (OpenAI's limit)
MAX_PENALTY: Final = 2.0  # OpenAI's range for presence and frequency penalties, -2..2
MAX_REPETITION_PENALTY: Final = 100.0
MAX_GRAMMAR_CHARS: Final = 128 * 1024  # a grammar's text, in llguidance's form
MAX_PROMPT_TOP_LOGPROBS: Final = 20  # alternatives per prompt token scored


def _as_floats(value: Any) -> Any:
    """A list or tuple of numbers as a tuple of floats (ints accepted, never bools)."""
    if type(value) in (list, tuple):
        return tuple(float(v) if type(v) is int else v for v in value)
    return value


@attrs.frozen
class SamplingParams:
    """How the last stage picks the next token.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens; 0 turns the filter off.
        top_p: nucleus sampling mass in (0, 1]; 1 turns the filter off.
        seed: seed of the request's random generator, in [0, 2**64).
        min_p: keep only tokens at least this fraction as likely as the most likely one
            (after temperature and top-k); 0 turns the filter off.
        bias_ids, bias_values: OpenAI's ``logit_bias``: ``bias_values[i]`` (-100..100) is added
            to the logit of token ``bias_ids[i]`` before anything else, greedy included.
        logprobs: -1 asks for no log-probabilities; 0..20 for the sampled token's and that
            many most likely alternatives' (of the model's raw distribution), per token.
        presence_penalty, frequency_penalty: OpenAI's (-2..2), over the generated tokens:
            ``presence`` is subtracted from the logit of each token generated so far,
            ``frequency`` times the number of times it was.
        repetition_penalty: the multiplicative penalty (> 0; 1 is off) on every token of the
            last ``repetition_last_n`` tokens of the context, prompt included (0: all of it):
            a positive logit is divided by it, a negative one multiplied.
        prompt_logprobs: -1 scores nothing; 0..20 has the last stage report each prompt
            token's raw log-probability after the tokens before it, with that many most
            likely alternatives (the reply to the prefill carries them).
        grammar: constrains the generated text (empty: none), in llguidance's grammar form;
            the last stage masks every token it does not allow.
    """

    temperature: float = attrs.field(default=0.0, converter=_as_float, validator=_finite_float)
    top_k: int = attrs.field(default=0, validator=_int_in(_ID_LIMIT))
    top_p: float = attrs.field(default=1.0, converter=_as_float, validator=_finite_float)
    seed: int = attrs.field(default=0, validator=_int_in(_KEY_LIMIT))
    min_p: float = attrs.field(default=0.0, converter=_as_float, validator=_finite_float)
    bias_ids: tuple[int, ...] = attrs.field(
        default=(),
        converter=_as_tuple,
        validator=_int_tuple(limit=_TOKEN_LIMIT, max_len=MAX_LOGIT_BIAS, non_empty=False),
    )
    bias_values: tuple[float, ...] = attrs.field(default=(), converter=_as_floats)
    logprobs: int = attrs.field(default=-1)
    presence_penalty: float = attrs.field(default=0.0, converter=_as_float, validator=_finite_float)
    frequency_penalty: float = attrs.field(
        default=0.0, converter=_as_float, validator=_finite_float
    )
    repetition_penalty: float = attrs.field(
        default=1.0, converter=_as_float, validator=_finite_float
    )
    repetition_last_n: int = attrs.field(default=0, validator=_int_in(_TOKEN_LIMIT))
    prompt_logprobs: int = attrs.field(default=-1)
    grammar: str = attrs.field(
        default="", validator=_bounded_str(MAX_GRAMMAR_CHARS), repr=lambda g: repr(g[:60])
    )

    @property
    def penalized(self) -> bool:
        """Whether any penalty depends on the tokens before the one sampled."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @logprobs.validator
    def _check_logprobs(self, attribute: "attrs.Attribute[int]", value: object) -> None:
        if type(value) is not int or not -1 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"SamplingParams.logprobs must be an int in [-1, {MAX_TOP_LOGPROBS}], "
                f"got {_show(value)}."
            )

    @prompt_logprobs.validator
    def _check_prompt_logprobs(self, attribute: "attrs.Attribute[int]", value: object) -> None:
        if type(value) is not int or not -1 <= value <= MAX_PROMPT_TOP_LOGPROBS:
            raise ValueError(
                f"SamplingParams.prompt_logprobs must be an int in [-1, "
                f"{MAX_PROMPT_TOP_LOGPROBS}], got {_show(value)}."
            )

    @presence_penalty.validator
    @frequency_penalty.validator
    def _check_penalty(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"SamplingParams.{attribute.name} must be in [-2, 2], got {value}.")

    @repetition_penalty.validator
    def _check_repetition(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if not 0 < value <= MAX_REPETITION_PENALTY:
            raise ValueError(f"SamplingParams.repetition_penalty must be in (0, 100], got {value}.")

    @temperature.validator
    def _check_temperature(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if value < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {value}.")

    @top_p.validator
    def _check_top_p(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if not 0 < value <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {value}.")

    @min_p.validator
    def _check_min_p(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if not 0 <= value <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {value}.")

    @bias_values.validator
    def _check_bias(self, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if type(value) is not tuple or len(value) != len(self.bias_ids):
            raise ValueError(
                f"SamplingParams.bias_values must be a tuple of {len(self.bias_ids)} floats, "
                f"one per bias id, got {_show(value)}."
            )
        for v in value:
            if type(v) is not float or not -MAX_BIAS <= v <= MAX_BIAS:
                raise ValueError(
                    f"SamplingParams.bias_values must be floats in [-100, 100], got {_show(v)}."
                )
        if len(set(self.bias_ids)) != len(self.bias_ids):
            raise ValueError("SamplingParams.bias_ids must not repeat a token.")
