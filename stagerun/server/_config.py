"""Every setting of the HTTP server, declared and checked once: `HttpConfig`.

`create_app` serves with one, and `stagerun serve`'s `ServeOptions` is one (plus the pipeline
it fronts), so a limit, a timeout or a host is checked in one place with one sentence, ``what
@ where``, whoever gives it. A new HTTP setting is a field here with its check in `_CHECKS`,
its flag in `stagerun._cli._http_options` and its mapping in `stagerun._cli._serve`, and its docs
(docs/api.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

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
# Request bodies from one client still arriving after a quarter second (--max-bodies-per-client);
# at most this many, and at most half its connections (--max-connections-per-client).
DEFAULT_MAX_BODIES_PER_CLIENT = 16

PrefixShare = Literal["client", "global"]
"""Whose cached prefixes a request may reuse (`HttpConfig.prefix_share`)."""
MetricsAuth = Literal["key", "none"]
"""Who sees ``/metrics`` and the detailed ``/health`` (`HttpConfig.metrics_auth`)."""
PREFIX_SHARES: tuple[PrefixShare, ...] = ("client", "global")
METRICS_AUTHS: tuple[MetricsAuth, ...] = ("key", "none")


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
    "max_connections_per_client": (
        "--max-connections-per-client",
        "at least 1",
        _optional(_whole(1)),
    ),
    "max_bodies_per_client": ("--max-bodies-per-client", "at least 1", _optional(_whole(1))),
    "prefix_share": ("--prefix-share", "client or global", lambda v: v in PREFIX_SHARES),
    "metrics_auth": ("--metrics-auth", "key or none", lambda v: v in METRICS_AUTHS),
    "ui": ("--no-ui", "True or False", lambda v: isinstance(v, bool)),
}


def _entries(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _hidden(key: str | None) -> str:
    return "None" if key is None else "'<hidden>'"


def _key_text(value: str | Iterable[str] | None) -> str | None:
    """An API key, or several: one per line (a key file's text, or a list of keys)."""
    if value is None or isinstance(value, str):
        return value
    return "\n".join(value)


def api_keys(text: str | None) -> tuple[str, ...]:
    """The keys in ``text``: one per line, surrounding white space stripped; empty lines and
    lines that start with ``#`` (comments) are no keys."""
    if text is None:
        return ()
    lines = (line.strip() for line in text.splitlines())
    return tuple(dict.fromkeys(line for line in lines if line and not line.startswith("#")))


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
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
            ``Authorization: Bearer <key>``. Several keys (one per tenant) are given one per
            line, or as a list; ``#`` lines are comments (`api_keys`).
        api_key_file: ``stagerun serve`` reads the keys from this private file instead.
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
        max_connections_per_client: of those, from one client (an IPv4 address or an IPv6
            /64; None: a quarter of ``max_connections``). Behind a proxy, every client is the
            proxy: raise it.
        max_bodies_per_client: request bodies from one client still arriving a quarter second
            after their request began; one more is answered 429 (None: half
            ``max_connections_per_client``, at most `DEFAULT_MAX_BODIES_PER_CLIENT`).
        prefix_share: whose cached prefixes a request may reuse. ``client`` (the default):
            only those of requests that presented the same API key, or, on a server without
            keys, came from the same IP address; a request's ``cache_salt`` splits that further.
            ``global``: everyone's with the same ``cache_salt`` (or none), which lets a client
            tell from ``prefix_cached_tokens`` or the time to first token what others sent.
        metrics_auth: ``key`` (the default): on a server with API keys, ``/metrics`` and the
            detailed ``/health`` need one, and anyone else gets ``/health``'s status alone.
            ``none``: they are open to everyone.
        ui: serve the web page at ``/`` (a chat, and the pipeline live at ``/ui/state``;
            `stagerun.server._ui`); ``--no-ui`` turns it off.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    kv_budget: int | None = None
    api_key: str | None = attrs.field(default=None, repr=_hidden, converter=_key_text)
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
    max_connections_per_client: int | None = None
    max_bodies_per_client: int | None = None
    prefix_share: PrefixShare = "client"
    metrics_auth: MetricsAuth = "key"
    ui: bool = True

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

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys requests may present (none: no key is needed)."""
        return api_keys(self.api_key)

    def replace(self, **changes: Any) -> HttpConfig:
        """A copy with ``changes`` (field names as keywords), checked again."""
        return attrs.evolve(self, **changes)

    @classmethod
    def from_settings(cls, config: HttpConfig | None, settings: dict[str, Any]) -> HttpConfig:
        """``config`` with ``settings`` replaced, or a configuration of ``settings`` alone."""
        if config is None:
            return cls(**settings)
        return config.replace(**settings) if settings else config
