"""The OpenAI request surface: JSON bodies parsed into typed values, and the error envelope.

Theory of operation: nothing here does I/O. A handler reads the body, calls
`parse_generation_request` (kind ``completion`` or ``chat``) and gets either a frozen
`GenerationRequest` or an `ApiError` that already carries the HTTP status and the
``{"error": {"message", "type", "param", "code"}}`` envelope. Messages say what to fix, and
``param`` names the offending field the way OpenAI does (``messages[1].content``).

Which fields each endpoint takes is `._fields`'s.

Every value that passes is one the code behind can take: integers that fit the wire, a
temperature the sampler can divide by, text a tokenizer can encode, stop strings short enough
to match in linear time. A body Python's ``json`` cannot decode at all (an integer of more than
4,300 digits, arrays nested beyond the recursion limit, ``NaN``) is a 400 like any bad JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

import attrs

from ._api_values import ApiError as ApiError
from ._api_values import error_envelope as error_envelope
from ._api_values import (
    invalid,
    json_type,
    optional_bool,
    optional_int,
    required,
)
from ._fields import Kind as Kind
from ._fields import check_fields
from ._grammars import Constraint, parse_constraint
from ._knobs import Knobs, parse_knobs
from ._tools import Tools, parse_tools

ChatRole = Literal["system", "user", "assistant", "tool"]

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Characters in one stop string: OpenAI documents none; 1,024 holds any delimiter in use, and
# text that might begin a stop string is held back from the stream, so this bounds the delay.
MAX_STOP_CHARS = 1024
_SEED_MODULUS = 2**64
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
_ROLES: dict[str, ChatRole] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@attrs.frozen
class ChatMessage:
    """One chat message, checked; an assistant's ``tool_calls`` are OpenAI's shape."""

    role: ChatRole
    content: str
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None  # of a ``tool`` message: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as a dict (what `_tools.render_messages` and templates take)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@attrs.frozen
class GenerationRequest:
    """One ``/v1/completions`` or ``/v1/chat/completions`` request, checked.

    ``prompt`` is text or token ids for completions; ``messages`` is set for chat.
    ``max_tokens`` is None when the client gave no limit (the handler picks the default).
    ``seed`` is None when the client gave none (the handler draws one).
    """

    kind: Kind
    model: str
    prompt: str | tuple[int, ...] = ""
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    speculative: bool | None = None  # None: the server's speculation settings
    knobs: Knobs = attrs.field(factory=Knobs)
    constraint: Constraint | None = None  # structured output: the grammar it asks for
    tools: Tools | None = None  # chat: the functions it may (or must) call
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completions: every prompt (``prompt``)
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt comes back before each answer


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object."""
    if not body.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8 text: send a JSON object") from None
    except json.JSONDecodeError as exc:
        raise invalid(
            f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno}): send a JSON object"
        ) from None
    except ValueError:  # an integer beyond Python's int-string conversion limit
        raise invalid(
            "the request body holds an integer of more than 4,300 digits: send smaller numbers"
        ) from None
    except RecursionError:
        raise invalid(
            "the request body nests arrays or objects too deeply: send a flatter JSON object"
        ) from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, not {json_type(data)}")
    return data


def parse_generation_request(
    data: Mapping[str, Any], kind: Kind, *, context_length: int | None = None
) -> GenerationRequest:
    """Check a decoded body of ``/v1/completions`` (``completion``) or ``/v1/chat/completions``.

    Args:
        context_length: the model's context, when known: a prompt of that many token ids, or
            more chat messages than that (every chat template writes at least one token per
            message), could never fit, and is refused before its items are checked.
    """
    check_fields(data, kind)
    prompts: tuple[str | tuple[int, ...], ...] = ()
    echo = False
    n = optional_int(data, "n", minimum=1) or 1
    if n > MAX_N:
        raise invalid(f"'n' must be at most {MAX_N}, got {n}", "n")
    model = required(data, "model")
    if not isinstance(model, str) or not model:
        raise invalid(f"'model' must be a non-empty string, not {json_type(model)}", "model")
    prompt: str | tuple[int, ...] = ""
    messages: tuple[ChatMessage, ...] = ()
    if kind == "chat":
        messages = parse_messages(required(data, "messages"), context_length)
        max_tokens = optional_int(data, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = optional_int(data, "max_tokens", minimum=1)
    else:
        prompts = _prompts(required(data, "prompt"), context_length)
        prompt = prompts[0]
        max_tokens = optional_int(data, "max_tokens", minimum=0)
        echo = bool(optional_bool(data, "echo"))
        if max_tokens == 0 and not echo:
            raise invalid("'max_tokens' 0 asks for nothing: send echo, or at least 1", "max_tokens")
    knobs = parse_knobs(data, kind)
    constraint = parse_constraint(data)
    tools = parse_tools(data) if kind == "chat" else None
    if tools is not None and constraint is not None:
        raise invalid(
            f"'{constraint.param}' and 'tools' both constrain the answer: send one",
            constraint.param,
        )
    seed = optional_int(data, "seed")
    stream = optional_bool(data, "stream")
    include_usage = _include_usage(data, bool(stream))
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        seed=None if seed is None else seed % _SEED_MODULUS,
        stop=_stop(data.get("stop")),
        stream=bool(stream),
        include_usage=include_usage,
        cache_salt=_cache_salt(data.get("cache_salt")),
        speculative=optional_bool(data, "speculative"),
        knobs=knobs,
        constraint=constraint,
        tools=tools,
        prompts=prompts,
        n=n,
        echo=echo,
    )


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    """``stream_options.include_usage``: a streamed answer ends with a usage chunk."""
    options = data.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid(
            f"'stream_options' must be an object, not {json_type(options)}", "stream_options"
        )
    return bool(optional_bool(options, "include_usage", "stream_options."))


MAX_CACHE_SALT = 256


def _cache_salt(value: Any) -> str | None:
    """vLLM's ``cache_salt``: requests share cached prefixes only with the same salt."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise invalid(
            f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} characters",
            "cache_salt",
        )
    return checked_text(value, "cache_salt")


def _refuse_constant(name: str) -> NoReturn:
    raise invalid(f"the request body holds {name}, which is not JSON: send a number")


def checked_text(value: str, param: str) -> str:
    """``value``, unless it holds a lone surrogate (JSON allows ``"\\ud800"``, UTF-8 does not)."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise invalid(
                f"'{param}' holds a lone UTF-16 surrogate (\\ud800-\\udfff): send valid "
                "Unicode text",
                param,
            ) from None
    return value


def too_long(length: int, unit: str, context: int, param: str, why: str = "") -> ApiError:
    """The 400 of a prompt that cannot fit the model's context."""
    return invalid(
        f"the prompt is {length} {unit} long but the model's context is {context} tokens"
        f"{why}; shorten the prompt",
        param,
        code="context_length_exceeded",
    )


def token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise invalid(f"token ids must be non-negative integers; {param}[{i}] is not", param)
    return tuple(value)


def _prompts(value: Any, context: int | None) -> tuple[str | tuple[int, ...], ...]:
    """Completions' ``prompt``: a string, token ids, or an array of either (a batch)."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(x, str | list) for x in value):
        if len(value) > MAX_PROMPTS:
            raise invalid(f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS}", "prompt")
        return tuple(_prompt(item, context) for item in value)
    return (_prompt(value, context),)


def _prompt(value: Any, context: int | None) -> str | tuple[int, ...]:
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' is empty: give some text", "prompt")
        return checked_text(value, "prompt")
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str | list):
            return _prompt(value[0], context)
        if not value:
            raise invalid("'prompt' is empty: give some text", "prompt")
        if context is not None and len(value) >= context:
            raise too_long(len(value), "tokens", context, "prompt")
        return token_ids(value, "prompt")
    raise invalid(
        f"'prompt' must be a string or an array of token ids, not {json_type(value)}", "prompt"
    )


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return checked_text(value, param)
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            where = f"{param}[{i}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"only text content parts are supported; {where} is not one", where)
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{where}.text' must be a string", f"{where}.text")
            parts.append(text)
        return checked_text("".join(parts), param)
    raise invalid(f"'{param}' must be a string, not {json_type(value)}", param)


def parse_messages(value: Any, context: int | None) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise invalid(f"'messages' must be an array, not {json_type(value)}", "messages")
    if not value:
        raise invalid("'messages' is empty: send at least one message", "messages")
    if context is not None and len(value) > context:
        raise invalid(
            f"'messages' holds {len(value)} messages but the model's context is {context} "
            "tokens, and every message takes at least one; send fewer messages",
            "messages",
            code="context_length_exceeded",
        )
    out = []
    for i, raw in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"'{where}' must be an object, not {json_type(raw)}", where)
        out.append(_message(raw, where))
    return tuple(out)


def _message(raw: dict[str, Any], where: str) -> ChatMessage:
    role = raw.get("role")
    if role not in _ROLES:
        raise invalid(
            f"'{where}.role' must be one of system, user, assistant or tool, got {role!r}",
            f"{where}.role",
        )
    calls = _tool_calls(raw.get("tool_calls"), where) if role == "assistant" else ()
    if raw.get("content") is None and not calls:
        raise invalid(f"'{where}.content' is required", f"{where}.content")
    content = "" if raw.get("content") is None else _content(raw["content"], f"{where}.content")
    call_id = None
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
            raise invalid(
                f"'{where}.tool_call_id' must be a string of 1 to 256 characters",
                f"{where}.tool_call_id",
            )
    return ChatMessage(_ROLES[role], content, calls, call_id)


def _tool_calls(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    """An assistant turn's ``tool_calls``: ``{id, type: function, function: {name, arguments}}``."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or len(value) > 128:
        raise invalid(
            f"'{where}.tool_calls' must be an array of at most 128 calls", f"{where}.tool_calls"
        )
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
        ):
            raise invalid(
                f"'{at}' must be {{id, type: 'function', function: {{name, arguments}}}} with "
                "a string name and arguments",
                at,
            )
        call_id = call.get("id")
        arguments = checked_text(function.get("arguments", ""), at)
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{i}",
                "type": "function",
                "function": {"name": checked_text(function["name"], at), "arguments": arguments},
            }
        )
    return tuple(calls)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(
            f"'stop' must be a string or an array of strings, not {json_type(value)}", "stop"
        )
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(
            f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise invalid(f"'stop[{i}]' must be a non-empty string", f"stop[{i}]")
        if len(item) > MAX_STOP_CHARS:
            raise invalid(
                f"'stop[{i}]' is {len(item)} characters long; a stop string may have at most "
                f"{MAX_STOP_CHARS}",
                f"stop[{i}]",
            )
    return tuple(items)
