"""What the HTTP handlers share, and the server's request limits."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable

import attrs

from .._driver._pipeline import Pipeline
from ._admission import Admission
from ._metrics import Metrics
from ._openai import ApiError

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


@attrs.define
class ServerState:
    """What the handlers share: the pipeline, admission, metrics and the served model id.

    ``kv_bytes_per_token`` prices a request's reservation: (prompt + max_tokens) tokens.
    """

    pipeline: Pipeline
    admission: Admission
    model_id: str
    model_aliases: frozenset[str]
    kv_bytes_per_token: int = 0
    metrics: Metrics = attrs.field(factory=Metrics)
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    health_timeout: float = 1.0
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    started: int = attrs.field(factory=lambda: int(time.time()))

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.model_aliases:
            raise ApiError(
                404,
                f"the model {model!r} is not served here; use {self.model_id!r} "
                "(GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an allow-list entry) as (name, port): lower case, no brackets.

    None when it is not ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``.
    """
    value = value.strip().lower()
    port: str | None = None
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a name, or a bare IPv6 address as an allow-list entry may give it
        name = value
    if port is not None and not (port.isdigit() and len(port) <= 5):
        return None
    name = name.removesuffix(".")  # "localhost." is "localhost"
    if not name or any(c.isspace() or c in "/@?#" for c in name):
        return None
    return name, None if port is None else int(port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@attrs.frozen
class AllowedHosts:
    """The ``Host`` header values a server answers (see `parse`); the rest get 421.

    A web page can make a browser send requests to a server on ``localhost``, and through DNS
    rebinding even read the answers; the browser then sends the page's own host name. Naming
    the hosts a server answers for stops both.

    Attributes:
        names: host names and addresses answered on any port.
        pairs: (name, port) answered on that port only.
        any_ip: any IP address literal too (a server bound to every address of the machine:
            a rebinding page always names a DNS name, never an address).
        anything: no check at all (the entry ``*``).
    """

    names: frozenset[str] = frozenset()
    pairs: frozenset[tuple[str, int]] = frozenset()
    any_ip: bool = False
    anything: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str], *, any_ip: bool = False) -> AllowedHosts:
        """From entries like ``localhost``, ``api.example.com:443``, ``[::1]``, or ``*``.

        Raises:
            ValueError: an entry is not a host name or address, with an optional port.
        """
        names, pairs, anything = set(), set(), False
        for entry in entries:
            if entry.strip() == "*":
                anything = True
                continue
            split = split_host(entry)
            if split is None:
                raise ValueError(
                    f"{entry!r} is not a host name or address (with an optional :port); "
                    "write e.g. api.example.com, localhost:8000 or [::1]"
                )
            name, port = split
            if port is None:
                names.add(name)
            else:
                pairs.add((name, port))
        return cls(frozenset(names), frozenset(pairs), any_ip, anything)

    def allows(self, host: str) -> bool:
        """Whether a request with this ``Host`` header value is answered."""
        if self.anything:
            return True
        split = split_host(host)
        if split is None:
            return False
        name, port = split
        if name in self.names or (port is not None and (name, port) in self.pairs):
            return True
        return self.any_ip and _is_ip(name)
