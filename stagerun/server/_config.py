"""Every setting of the HTTP server, declared and checked once: `HttpConfig`.

`create_app` serves with one, and `stagerun serve`'s `ServeOptions` is one (plus the pipeline
it fronts), so a limit, a timeout or a host is checked in one place with one sentence, ``what
@ where``, whoever gives it. A new HTTP setting is a field here with its check in `_CHECKS`,
its flag in `stagerun._cli._options` and its mapping in `stagerun._cli._serve`, and its docs
(docs/api.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from ._hosts import AllowedHosts

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_TOKENS = 512  # a chat request that names no max_tokens
MAX_TOKENS_LIMIT = 4096  # no request generates more, whatever it asks for
DEFAULT_MAX_BATCH = 16  # requests generating at once (--max-batch)
DEFAULT_MAX_QUEUE = 64  # requests waiting for a slot and KV budget before 429 (--max-queue)
# No generation request runs longer, queue wait included (--request-timeout): 4096 tokens at
# under 7 tokens/s still finish; a request stuck behind a hung stage does not live forever.
DEFAULT_REQUEST_TIMEOUT = 600.0
# A client that takes none of its answer for this long loses its request (--write-timeout):
# one that stopped reading would otherwise hold a slot and a lane for as long as it likes.
DEFAULT_WRITE_TIMEOUT = 30.0
# The whole request body must arrive within this, from its headers on (--body-timeout): the
# largest body allowed (4 MiB) needs only ~1.1 Mbit/s; a body that never ends is answered 408.
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_HEALTH_TIMEOUT = 1.0  # /health and /metrics wait this long for each stage's probe


def _whole(least: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= least


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _hosts(entries: Any) -> bool:
    AllowedHosts.parse(entries)  # an entry that is not a host says so itself
    return True


# field -> (its flag, what it must be, its check)
_CHECKS: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "host": ("--host", "an address (a string)", lambda v: isinstance(v, str)),
    "port": ("--port", "within 0..65535", lambda v: _whole(0)(v) and v <= 65535),
    "max_batch": ("--max-batch", "at least 1", _optional(_whole(1))),
    "max_queue": ("--max-queue", "0 or more", _whole(0)),
    "kv_budget": ("--kv-budget", "at least 1 byte", _optional(_whole(1))),
    "max_body_bytes": ("max_body_bytes", "at least 1 byte", _whole(1)),
    "max_tokens_default": ("--max-tokens-default", "at least 1", _whole(1)),
    "max_tokens_limit": ("--max-tokens-limit", "at least 1", _whole(1)),
    "allowed_hosts": ("--allowed-hosts", "host names or addresses", _hosts),
    "request_timeout": ("--request-timeout", "more than 0 seconds", _seconds),
    "write_timeout": ("--write-timeout", "more than 0 seconds", _seconds),
    "body_timeout": ("--body-timeout", "more than 0 seconds", _seconds),
    "health_timeout": ("health_timeout", "more than 0 seconds", _seconds),
    "max_connections": ("--max-connections", "at least 1", _optional(_whole(1))),
}


def _entries(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _hidden(key: str | None) -> str:
    return "None" if key is None else "'<hidden>'"


@attrs.frozen(kw_only=True)
class HttpConfig:
    """How the HTTP server answers; every field has the default `create_app` uses.

    Attributes:
        host: the address ``stagerun serve`` binds (and answers ``Host`` headers for).
        port: its port (0: any free one).
        max_batch: requests generating at once (None: the lane pool's capacity, or 1); at
            most the lane pool's capacity, so every running request finds a lane.
        max_queue: requests that may wait for a slot and budget before the server answers 429.
        kv_budget: bytes of KV cache the running requests may reserve together (None:
            `stagerun.server._admission.default_kv_budget` of the model and ``max_batch``).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        api_key_file: ``stagerun serve`` reads the key from this private file instead.
        max_body_bytes: the largest request body; a larger one is answered 413.
        max_tokens_default: the tokens a chat request that names no ``max_tokens`` gets (a
            completion request gets OpenAI's 16).
        max_tokens_limit: the most tokens any request generates; a larger ``max_tokens`` is
            cut to it (the reply then ends with ``finish_reason: "length"``).
        allowed_hosts: ``Host`` headers ``stagerun serve`` answers beyond its bound address and
            the loopback names (see `stagerun.server._serve.allowed_hosts`).
        request_timeout: seconds a generation request may take from its arrival, queue wait
            included; then it ends with 504 (or an error event, once streaming).
        write_timeout: seconds generation waits for the client to take the previous piece of
            its answer; then the request is cancelled and its slot released.
        body_timeout: seconds the request body may take to arrive; then 408.
        health_timeout: seconds ``/health`` and ``/metrics`` wait for a stage's probe.
        max_connections: HTTP connections open at once (None: what the open-file limit leaves
            room for, at most 1024).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    kv_budget: int | None = None
    api_key: str | None = attrs.field(default=None, repr=_hidden)
    api_key_file: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=_entries)
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    max_connections: int | None = None

    def __attrs_post_init__(self) -> None:
        where = type(self).__name__
        for name, (flag, requirement, check) in _CHECKS.items():
            value = getattr(self, name)
            if not check(value):
                raise ValueError(f"{flag} must be {requirement}, got {value!r} @ {where}.{name}")
        if self.max_tokens_default > self.max_tokens_limit:
            raise ValueError(
                f"the default max_tokens ({self.max_tokens_default}) must be between 1 and the "
                f"limit ({self.max_tokens_limit}) @ {where}.max_tokens_default"
            )

    def replace(self, **changes: Any) -> HttpConfig:
        """A copy with ``changes`` (field names as keywords), checked again."""
        return attrs.evolve(self, **changes)

    @classmethod
    def from_settings(cls, config: HttpConfig | None, settings: dict[str, Any]) -> HttpConfig:
        """``config`` with ``settings`` replaced, or a configuration of ``settings`` alone."""
        if config is None:
            return cls(**settings)
        return config.replace(**settings) if settings else config
