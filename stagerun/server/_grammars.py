"""Structured output: the request fields that constrain an answer, as one llguidance grammar.

Theory of operation: clients ask for constrained text under many names. `parse_constraint`
takes each (OpenAI's ``response_format``, llama-server's ``json_schema`` and ``grammar``,
vLLM's ``structured_outputs`` and its older ``guided_*`` fields), refuses a request that
asks under two of them, and turns the one it asked for into llguidance's grammar text:

* a JSON schema (``json_schema``, ``json``, ``guided_json``) or any JSON object
  (``json_object``) through llguidance's JSON compiler, compact (no optional whitespace, so
  the fixed parts are forced tokens);
* a regular expression (``regex``), a choice among strings (``choice``: a grammar of the
  quoted alternatives);
* a grammar (``grammar``) in GBNF (llama.cpp's) or Lark (llguidance's own).

The handler then compiles it once over the model's vocabulary in a tokenizer thread
(`stagerun.server._completions.check_constraint`),
so a grammar that does not compile is a 400 naming the field, before any stage sees it. The
grammar travels to the last stage in ``SamplingParams.grammar``, where every row of every
verify window is masked by it (`stagerun._engine._sampler`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from .._proto._sampling_params import MAX_GRAMMAR_CHARS
from ._api_values import invalid, json_type

__all__ = ["CONSTRAINT_FIELDS", "Constraint", "parse_constraint"]

CONSTRAINT_FIELDS = (
    "response_format",
    "json_schema",
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
"""Every field that asks for constrained output (at most one per request)."""

_JSON_OPTIONS: Any = {"whitespace_flexible": False}
MAX_CHOICES = 1024
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@attrs.frozen
class Constraint:
    """A request's grammar in llguidance's form, and the field that asked for it."""

    param: str
    grammar: str = attrs.field(repr=lambda g: repr(g[:60]))


def parse_constraint(data: Mapping[str, Any]) -> Constraint | None:
    """The grammar the request's fields ask for, or None (unconstrained)."""
    found: list[Constraint] = []
    for name in CONSTRAINT_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        constraint = _from_field(name, value)
        if constraint is not None:
            found.append(constraint)
    if len(found) > 1:
        names = " and ".join(repr(c.param) for c in found)
        raise invalid(f"{names} both constrain the answer: send one of them", found[1].param)
    if not found:
        return None
    if len(found[0].grammar) > MAX_GRAMMAR_CHARS:
        raise invalid(
            f"'{found[0].param}' makes a grammar of {len(found[0].grammar)} characters, more "
            f"than the limit of {MAX_GRAMMAR_CHARS}",
            found[0].param,
        )
    return found[0]


def _from_field(name: str, value: Any) -> Constraint | None:
    match name:
        case "response_format":
            return _response_format(value)
        case "json_schema" | "guided_json":
            return _schema(name, value)
        case "grammar" | "guided_grammar":
            return _grammar(name, value)
        case "guided_regex":
            return _regex(name, value)
        case "guided_choice":
            return _choice(name, value)
        case _:
            return _structured_outputs(value)


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object, not {json_type(value)}", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        schema = value.get("schema")
        return _schema(f"{param}.schema", schema if schema is not None else {"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid(f"'{param}.json_schema' must be an object", f"{param}.json_schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON
            schema = {}
        return _schema(f"{param}.json_schema.schema", schema)
    raise invalid(
        f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
        f"{param}.type",
    )


def _structured_outputs(value: Any) -> Constraint | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object, not {json_type(value)}", param)
    kinds = [key for key in _STRUCTURED_KINDS if key in value]
    unknown = [key for key in value if key not in (*_STRUCTURED_KINDS, "whitespace_pattern")]
    if unknown:
        raise invalid(f"'{param}.{_short(unknown[0])}' is not supported", param)
    if len(kinds) != 1:
        raise invalid(
            f"'{param}' must hold one of json, regex, choice, grammar, json_object", param
        )
    kind, item = kinds[0], value[kinds[0]]
    where = f"{param}.{kind}"
    match kind:
        case "json":
            return _schema(where, item)
        case "regex":
            return _regex(where, item)
        case "choice":
            return _choice(where, item)
        case "grammar":
            return _grammar(where, item)
        case _:
            return _schema(where, {"type": "object"}) if item else None


def _schema(param: str, value: Any) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise invalid(f"'{param}' is not a JSON schema (not valid JSON)", param) from None
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be a JSON schema object, not {json_type(value)}", param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise invalid(f"'{param}' is not a usable JSON schema: {_first_line(exc)}", param) from None
    return Constraint(param, grammar)


def _regex(param: str, value: Any) -> Constraint:
    if not isinstance(value, str) or not value:
        raise invalid(f"'{param}' must be a non-empty regular expression string", param)
    return Constraint(param, llguidance.LLMatcher.grammar_from_regex(value))


def _choice(param: str, value: Any) -> Constraint:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_CHOICES
        or not all(isinstance(item, str) and item for item in value)
    ):
        raise invalid(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param)
    lark = "start: " + " | ".join(json.dumps(item) for item in value)
    return Constraint(param, llguidance.LLMatcher.grammar_from_lark(lark))


def _grammar(param: str, value: Any) -> Constraint:
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"'{param}' must be a grammar (GBNF or Lark) string", param)
    try:
        lark = any_to_lark(value)
    except Exception as exc:  # the converter raises its own error types, and plain ones
        raise invalid(
            f"'{param}' is not a GBNF or Lark grammar: {_first_line(exc)}", param
        ) from None
    return Constraint(param, llguidance.LLMatcher.grammar_from_lark(lark))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]
