"""The OpenAI error envelope, and checks of single JSON values that every parser uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "ApiError",
    "Kind",
    "error_envelope",
    "invalid",
    "json_type",
    "optional_bool",
    "optional_int",
    "optional_number",
    "required",
]


Kind = Literal["completion", "chat"]
"""Which endpoint a generation request came to: ``/v1/completions`` or chat."""


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


def required(data: Mapping[str, Any], name: str) -> Any:
    if name not in data or data[name] is None:
        raise invalid(f"'{name}' is required", name)
    return data[name]


def json_type(value: Any) -> str:
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


def optional_int(data: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, not {json_type(value)}", name)
    if minimum is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def optional_number(data: Mapping[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{name}' must be a number, not {json_type(value)}", name)
    return float(value)


def optional_bool(data: Mapping[str, Any], name: str, prefix: str = "") -> bool | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(
            f"'{prefix}{name}' must be true or false, not {json_type(value)}", prefix + name
        )
    return value
