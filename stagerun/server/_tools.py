"""Tool calling: ``tools`` and ``tool_choice`` in, the chat rendered with them, calls parsed out.

Theory of operation: a chat request with ``tools`` (and a ``tool_choice`` other than
``none``) is rendered through the model's chat template with the tools, and its answer is
parsed back into OpenAI's ``tool_calls``. How depends on the template (`tool_format`):

* a template that takes ``tools`` writes them its own way, and the model answers in its
  family's format: Hermes/Qwen ``<tool_call>{"name", "arguments"}</tool_call>``, Llama 3's
  bare ``{"name", "parameters"}`` JSON, or Mistral's ``[TOOL_CALLS][...]``. With
  ``required`` or a named function the answer is held to that format by a grammar
  (`tool_grammar`); with ``auto`` the model chooses, and its answer is parsed as it comes.
* a template without ``tools`` (the default model's, Gemma's) gets the generic format, as
  llama-server does: the tools are described in the system message, and the answer is a
  JSON object, either ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"response":
  "..."}``, held to exactly that by a grammar built from the tools' parameter schemas (only
  the tool calls with ``required`` or a named function). Every call then parses, and its
  arguments match the function's schema.

Earlier turns are rendered back the same way: an assistant turn's ``tool_calls`` as the
template expects them (arguments as objects) or, generic, as the JSON the model would have
written; a ``tool`` message as the template's, or as a user turn that gives the result.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import llguidance

from ._api_values import invalid, json_type, optional_bool

__all__ = [
    "ToolFormat",
    "Tools",
    "parse_tool_output",
    "parse_tools",
    "render_messages",
    "tool_format",
    "tool_grammar",
]

ToolFormat = Literal["generic", "hermes", "llama3", "mistral"]
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


@attrs.frozen
class Tools:
    """A request's functions, and which of them the answer must call.

    ``choice`` is ``auto``, ``required`` or one function's name (``none`` leaves the tools
    out of the request altogether).
    """

    functions: tuple[Mapping[str, Any], ...]  # OpenAI's {"type": "function", "function": ...}
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [str(f["function"]["name"]) for f in self.functions]


def parse_tools(data: Mapping[str, Any]) -> Tools | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked."""
    raw = data.get("tools")
    choice = data.get("tool_choice")
    parallel = optional_bool(data, "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' names a tool but 'tools' is empty", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_tool(item, f"tools[{i}]") for i, item in enumerate(raw))
    names = [str(f["function"]["name"]) for f in functions]
    if len(set(names)) != len(names):
        raise invalid("'tools' names a function twice", "tools")
    picked = _choice(choice, names)
    if picked == "none":
        return None
    return Tools(functions, picked, True if parallel is None else parallel)


def _tool(item: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise invalid(f"'{where}' must be an object with type 'function'", where)
    function = item.get("function")
    if not isinstance(function, dict):
        raise invalid(f"'{where}.function' must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(
            f"'{where}.function.description' must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(
            f"'{where}.function.parameters' must be a JSON schema object, not "
            f"{json_type(parameters)}",
            f"{where}.function.parameters",
        )
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or "",
            "parameters": parameters if parameters is not None else {"type": "object"},
        },
    }


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name in names:
            return str(name)
        raise invalid(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    raise invalid(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def tool_format(template: str | None) -> ToolFormat:
    """The format a chat template's model calls tools in (generic if it takes no tools)."""
    if not template or "tools" not in template:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    return "llama3"


# -- rendering --------------------------------------------------------------------------------


def render_messages(
    messages: Sequence[Mapping[str, Any]], tools: Tools | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the template should see them, and its extra variables (``tools``)."""
    if fmt != "generic":
        out = [_native(m) for m in messages]
        return out, ({"tools": list(tools.functions)} if tools is not None else {})
    out = [_generic(m, tools is not None) for m in messages]
    if tools is not None:
        prompt = _generic_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _native(message: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"]["arguments"]),
                },
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _generic(message: Mapping[str, Any], answering_json: bool) -> dict[str, Any]:
    """A message for a template without tools; assistant turns as JSON when the answer is."""
    role, content = message["role"], message["content"]
    if role == "tool":
        return {
            "role": "user",
            "content": f"Result of tool call {message.get('tool_call_id')}: {content}",
        }
    if message.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
            for c in message["tool_calls"]
        ]
        return {"role": role, "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
    if role == "assistant" and answering_json:
        return {"role": role, "content": json.dumps({"response": content}, ensure_ascii=False)}
    return {"role": role, "content": content}


def _generic_prompt(tools: Tools) -> str:
    listed = json.dumps([t["function"] for t in tools.functions], ensure_ascii=False)
    if tools.choice == "auto":
        answer = (
            'Answer with one JSON object: either {"tool_calls": [{"name": ..., '
            '"arguments": {...}}]} to call tools, or {"response": "..."} to answer '
            "directly."
        )
    else:
        answer = (
            'Answer with one JSON object {"tool_calls": [{"name": ..., "arguments": '
            "{...}}]} calling the tools."
        )
    return f"You can call these tools:\n{listed}\n{answer}"


def _arguments(value: Any) -> Any:
    """A call's arguments as an object (templates write them as JSON themselves)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


# -- the grammar -----------------------------------------------------------------------------


def _closed(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters with no properties beyond those named, unless it allows them.

    As OpenAI's strict mode: a model (a small one especially) that may add properties adds
    them until it runs out of tokens, and its call never parses.
    """
    out = dict(parameters)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(tools: Tools, arguments_key: str = "arguments") -> dict[str, Any]:
    functions = [f["function"] for f in tools.functions]
    if tools.choice not in ("auto", "required"):
        functions = [f for f in functions if f["name"] == tools.choice]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, arguments_key: _closed(f["parameters"])},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(tools: Tools, fmt: ToolFormat) -> str | None:
    """The grammar that holds the answer to the format (None: the model answers freely)."""
    call = _call_schema(tools, "parameters" if fmt == "llama3" else "arguments")
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not tools.parallel or tools.choice not in ("auto", "required"):
        calls["maxItems"] = 1  # a named function is called once
    if fmt == "generic":
        called = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if tools.choice == "auto":
            said = {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": False,
            }
            called = {"anyOf": [called, said]}
        return str(llguidance.LLMatcher.grammar_from_json_schema(called, defaults=_JSON_OPTIONS))
    if tools.choice == "auto":
        return None
    schema = json.dumps(call)
    if fmt == "hermes":
        one = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
        lark = f"start: call{'+' if tools.parallel else ''}\ncall: {one}\n"
    elif fmt == "mistral":
        lark = f'start: "[TOOL_CALLS]" %json {json.dumps(calls)}\n'
    else:
        lark = f"start: %json {schema}\n"
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


# -- parsing the answer ----------------------------------------------------------------------


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_tool_output(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text content (None if it only calls) and its calls, in OpenAI's shape.

    Text that does not hold a call in the format (or was cut short) is content.
    """
    if fmt == "generic":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:  # cut short (max_tokens): the calls written whole count
            whole = [_call(c.get("name"), c.get("arguments")) for c in _whole_calls(text)]
            found = [c for c in whole if c is not None]
            return (None, found) if found else (text, [])
        if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
            calls = [
                _call(c.get("name"), c.get("arguments"))
                for c in data["tool_calls"]
                if isinstance(c, dict)
            ]
            return None, [c for c in calls if c is not None]
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            return data["response"], []
        return text, []
    if fmt == "hermes":
        found, rest = [], text
        for match in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
            call = _loaded_call(match.group(1), "arguments")
            if call is not None:
                found.append(call)
                rest = rest.replace(match.group(0), "")
        return (rest.strip() or None) if found else text, found
    if fmt == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        if not marker:
            return text, []
        try:
            items = json.loads(tail)
        except json.JSONDecodeError:
            return text, []
        calls = [_call(i.get("name"), i.get("arguments")) for i in items if isinstance(i, dict)]
        found = [c for c in calls if c is not None]
        return (head.strip() or None) if found else text, found
    stripped = text.removeprefix("<|python_tag|>").strip()
    call = _loaded_call(stripped, "parameters") if stripped.startswith("{") else None
    return (None, [call]) if call is not None else (text, [])


def _whole_calls(text: str) -> list[dict[str, Any]]:
    """The calls written whole at the start of a generic answer that was cut short."""
    prefix = '{"tool_calls":['
    if not text.startswith(prefix):
        return []
    decoder, at = json.JSONDecoder(), len(prefix)
    found: list[dict[str, Any]] = []
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return found
        if isinstance(item, dict):
            found.append(item)
        if text[at : at + 1] != ",":
            return found
        at += 1


def _loaded_call(text: str, arguments_key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters")))
    return _call(data.get("name"), arguments)
