"""Which request fields each endpoint takes: honoured, neutral values only, or harmless.

Every field is either honoured, refused with a 400 that names it, or on a short list of fields
that change nothing an answer holds (`IGNORED_FIELDS`: ``user``, ``metadata`` and friends),
which are logged once each. Fields that ask for something stagerun cannot do yet (``n`` > 1,
``tools``) pass only with their neutral values (``n: 1``, ``tools: []``), since clients send
those by default; a field stagerun does not know at
all (``repetition_penalty``, ``grammar``, ``guided_json``...) is refused rather than dropped,
so that nobody gets unconstrained text believing it constrained. docs/api.md's "Request
fields" tables list the same (tests/test_api_surface.py checks both ways).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ._api_values import Kind as Kind
from ._api_values import invalid
from ._grammars import CONSTRAINT_FIELDS

__all__ = [
    "HONOURED_FIELDS",
    "IGNORED_FIELDS",
    "NEUTRAL_ONLY_FIELDS",
    "check_fields",
]

log = logging.getLogger("stagerun.server")


# Parameters stagerun does not implement, each with the values that ask for nothing (clients
# send those by default), and what to do instead. Any other value is refused by name.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "functions are not supported; leave 'functions' out"),
    "function_call": ((None, "none", "auto"), "functions are not supported; leave it out"),
    "audio": ((None,), "audio output is not supported; leave 'audio' out"),
    "modalities": (
        (None, ["text"]),
        "only text output is supported: send ['text'] or leave it out",
    ),
    "prediction": ((None,), "predicted outputs are not supported; leave 'prediction' out"),
}
_UNSUPPORTED_IN_COMPLETIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "tools are for /v1/chat/completions; leave 'tools' out"),
    "tool_choice": ((None, "none", "auto"), "tools are for /v1/chat/completions"),
    "parallel_tool_calls": ((None, True, False), "send true or false"),
    "suffix": ((None, ""), "suffix is not supported; leave it out"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
}


# The fields each endpoint honours; docs/api.md's "Request fields" table lists the same.
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "cache_salt", "speculative", "min_p", "logit_bias", "logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "repeat_penalty",
           "repeat_last_n", *CONSTRAINT_FIELDS)  # fmt: skip
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
              "parallel_tool_calls")  # fmt: skip
HONOURED_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": frozenset({*_COMMON, *_CHAT_ONLY}),
    "completion": frozenset({*_COMMON, "prompt", "echo"}),
}
_NEUTRAL = tuple(_UNSUPPORTED)
# Fields taken only with the value that asks for nothing (see the tables above).
NEUTRAL_ONLY_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": frozenset(_NEUTRAL),
    "completion": frozenset({*_NEUTRAL, *_UNSUPPORTED_IN_COMPLETIONS}),
}
IGNORED_FIELDS: frozenset[str] = frozenset(
    ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
)
"""Fields that change nothing in an answer (who asks, how a hosted service bills or keeps
it): accepted and ignored, each logged once."""
_logged: set[str] = set()


def _check_names(data: Mapping[str, Any], kind: Kind) -> None:
    """Refuse every field that is neither honoured, neutral-only nor harmless."""
    known = HONOURED_FIELDS[kind] | NEUTRAL_ONLY_FIELDS[kind]
    for name in data:
        if name in known:
            continue
        if name in IGNORED_FIELDS:
            if name not in _logged:
                _logged.add(name)
                log.info("requests' %r field is ignored: it changes nothing in an answer", name)
            continue
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise invalid(
            f"'{shown}' is not a field stagerun's {endpoint} takes (docs/api.md lists them); "
            "leave it out",
            shown,
        )


def _refuse_unsupported(
    data: Mapping[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]]
) -> None:
    for name, (neutral, why) in table.items():
        value = data.get(name)
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            raise invalid(f"'{name}': {why}", name)


def check_fields(data: Mapping[str, Any], kind: Kind) -> None:
    """Refuse, by name, every field that is unknown or asks for something stagerun cannot do."""
    _check_names(data, kind)
    if kind == "completion":
        _refuse_unsupported(data, _UNSUPPORTED_IN_COMPLETIONS)
    _refuse_unsupported(data, _UNSUPPORTED)
