"""The OpenAI request surface: JSON bodies parsed into typed values, and the error envelope.

Theory of operation: nothing here does I/O. A handler reads the body, calls
`parse_generation_request` (kind ``completion`` or ``chat``) and gets either a frozen
`GenerationRequest` or an `ApiError` that already carries the HTTP status and the
``{"error": {"message", "type", "param", "code"}}`` envelope. Messages say what to fix, and
``param`` names the offending field the way OpenAI does (``messages[1].content``).

Unknown fields are ignored (clients send ``user``, ``metadata`` and friends), but fields that
ask for something stagerun cannot do (``n`` > 1, ``logprobs``, ``tools``, ``logit_bias``,
penalties) are refused by name rather than silently dropped; their neutral values (``n: 1``,
``logit_bias: {}``, a penalty of 0) pass, since clients send them by default.

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

Kind = Literal["completion", "chat"]
ChatRole = Literal["system", "user", "assistant"]

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Characters in one stop string: OpenAI documents none; 1,024 holds any delimiter in use, and
# text that might begin a stop string is held back from the stream, so this bounds the delay.
MAX_STOP_CHARS = 1024
# The smallest temperature above 0: logits / temperature must stay finite in float64 (5e-324
# makes them inf and the probabilities NaN); below it, sampling is greedy but for near-ties.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's limit
# top_k beyond any vocabulary (token ids are below 2**31 on the wire) keeps every token, as 0
# does; larger integers would not fit the wire's int64.
MAX_TOP_K = 2**31 - 1
_SEED_MODULUS = 2**64
_ROLES: dict[str, ChatRole] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


class ApiError(Exception):
    """An error answered in the OpenAI envelope.

    Attributes:
        status: the HTTP status code.
        message: one sentence saying what was wrong and what to do.
        type: ``invalid_request_error``, ``rate_limit_error``, ``api_error``, ...
        param: the request field at fault, if any.
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``).
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"<ApiError {self.status} {self.type} param={self.param!r}: {self.message}>"

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, type=self.type, param=self.param, code=self.code)


def error_envelope(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@attrs.frozen
class ChatMessage:
    role: ChatRole
    content: str


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
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None


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
        raise invalid(f"the request body must be a JSON object, not {_json_type(data)}")
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
    model = _required(data, "model")
    if not isinstance(model, str) or not model:
        raise invalid(f"'model' must be a non-empty string, not {_json_type(model)}", "model")
    prompt: str | tuple[int, ...] = ""
    messages: tuple[ChatMessage, ...] = ()
    if kind == "chat":
        messages = _messages(_required(data, "messages"), context_length)
        max_tokens = _optional_int(data, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = _optional_int(data, "max_tokens", minimum=1)
    else:
        prompt = _prompt(_required(data, "prompt"), context_length)
        max_tokens = _optional_int(data, "max_tokens", minimum=1)
        _refuse_unsupported(data, _UNSUPPORTED_IN_COMPLETIONS)
    _refuse_what_cannot_be_done(data)
    temperature, top_p, top_k = _sampling(data)
    seed = _optional_int(data, "seed")
    stream = _optional_bool(data, "stream")
    include_usage = _include_usage(data, bool(stream))
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=None if seed is None else seed % _SEED_MODULUS,
        stop=_stop(data.get("stop")),
        stream=bool(stream),
        include_usage=include_usage,
        cache_salt=_cache_salt(data.get("cache_salt")),
    )


def _refuse_what_cannot_be_done(data: Mapping[str, Any]) -> None:
    """Refuse, by name, the fields that ask for something stagerun cannot do."""
    n = _optional_int(data, "n", minimum=1)
    if n not in (None, 1):
        raise invalid(f"only n=1 is supported, got n={n}: send one request per choice", "n")
    _refuse_unsupported(data, _UNSUPPORTED)
    for penalty in ("presence_penalty", "frequency_penalty"):
        value = _optional_number(data, penalty)
        if value not in (None, 0.0):
            raise invalid(f"'{penalty}' is not supported: leave it out or send 0", penalty)
    fmt = data.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("only response_format {'type': 'text'} is supported", "response_format")


def _sampling(data: Mapping[str, Any]) -> tuple[float, float, int]:
    """The request's temperature, top_p and top_k (defaults 1, 1 and 0: every token)."""
    temperature = _optional_number(data, "temperature")
    if temperature is not None and not (
        temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        raise invalid(
            f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}: 0 (greedy) or at least "
            f"{MIN_TEMPERATURE:g}, got {temperature}",
            "temperature",
        )
    top_p = _optional_number(data, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid(f"'top_p' must be greater than 0 and at most 1, got {top_p}", "top_p")
    top_k = _optional_int(data, "top_k", minimum=0)
    if top_k is not None and top_k > MAX_TOP_K:
        raise invalid(
            f"'top_k' must be at most {MAX_TOP_K}, got {top_k}: send 0 to keep every token",
            "top_k",
        )
    return (
        1.0 if temperature is None else temperature,
        1.0 if top_p is None else top_p,
        top_k or 0,
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
            f"'stream_options' must be an object, not {_json_type(options)}", "stream_options"
        )
    return bool(_optional_bool(options, "include_usage", "stream_options."))


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
    return _text(value, "cache_salt")


def _required(data: Mapping[str, Any], name: str) -> Any:
    if name not in data or data[name] is None:
        raise invalid(f"'{name}' is required", name)
    return data[name]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _optional_int(data: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, not {_json_type(value)}", name)
    if minimum is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _optional_number(data: Mapping[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{name}' must be a number, not {_json_type(value)}", name)
    return float(value)


def _optional_bool(data: Mapping[str, Any], name: str, prefix: str = "") -> bool | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(
            f"'{prefix}{name}' must be true or false, not {_json_type(value)}", prefix + name
        )
    return value


def _refuse_constant(name: str) -> NoReturn:
    raise invalid(f"the request body holds {name}, which is not JSON: send a number")


# Parameters stagerun does not implement, each with the values that ask for nothing (clients
# send those by default), and what to do instead. Any other value is refused by name.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # chat sends a boolean, completions an integer (0 asks for none)
    "logprobs": ((None, False, 0), "logprobs are not supported; leave it out"),
    "top_logprobs": ((None, 0), "logprobs are not supported; leave it out"),
    "logit_bias": ((None, {}), "logit_bias is not supported; leave it out"),
    "tools": ((None, []), "tools are not supported; leave 'tools' out"),
    "tool_choice": ((None, "none", "auto"), "tools are not supported; leave 'tool_choice' out"),
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
    "echo": ((None, False), "echo is not supported; leave it out"),
    "suffix": ((None, ""), "suffix is not supported; leave it out"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
}


def _refuse_unsupported(
    data: Mapping[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]]
) -> None:
    for name, (neutral, why) in table.items():
        value = data.get(name)
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            raise invalid(f"'{name}': {why}", name)


def _text(value: str, param: str) -> str:
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


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise invalid(f"token ids must be non-negative integers; {param}[{i}] is not", param)
    return tuple(value)


def _prompt(value: Any, context: int | None) -> str | tuple[int, ...]:
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' is empty: give some text", "prompt")
        return _text(value, "prompt")
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str | list):
            return _prompt(value[0], context)
        if value and all(isinstance(x, str) for x in value):
            raise invalid(
                f"'prompt' holds {len(value)} prompts but only one per request is supported",
                "prompt",
            )
        if not value:
            raise invalid("'prompt' is empty: give some text", "prompt")
        if context is not None and len(value) >= context:
            raise too_long(len(value), "tokens", context, "prompt")
        return _token_ids(value, "prompt")
    raise invalid(
        f"'prompt' must be a string or an array of token ids, not {_json_type(value)}", "prompt"
    )


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return _text(value, param)
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
        return _text("".join(parts), param)
    raise invalid(f"'{param}' must be a string, not {_json_type(value)}", param)


def _messages(value: Any, context: int | None) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise invalid(f"'messages' must be an array, not {_json_type(value)}", "messages")
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
            raise invalid(f"'{where}' must be an object, not {_json_type(raw)}", where)
        role = raw.get("role")
        if role not in _ROLES:
            raise invalid(
                f"'{where}.role' must be one of system, user or assistant, got {role!r}",
                f"{where}.role",
            )
        if "content" not in raw or raw["content"] is None:
            raise invalid(f"'{where}.content' is required", f"{where}.content")
        out.append(ChatMessage(_ROLES[role], _content(raw["content"], f"{where}.content")))
    return tuple(out)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(
            f"'stop' must be a string or an array of strings, not {_json_type(value)}", "stop"
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
