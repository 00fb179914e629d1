"""Telling clients apart: whose key a request presented, and whose cached prefixes it shares.

`RequestContext` decides a request's `Client` once, before the app sees it, and leaves it in
the ASGI scope (`client_of` reads it back). Two things follow from it:

- **Detail.** ``/metrics`` and the detailed ``/health`` show stage addresses, process ids and
  cache counts: on a server with API keys only a request that presents one sees them (unless
  ``metrics_auth`` is ``none``); anyone else gets ``/health``'s status alone.
- **Prefix domains.** The prefix cache names a request's blocks with a key mixed from the
  pipeline's secret salt and the request's salt (`stagerun._proto._prefix`), so requests with
  different salts never share a block, and a request learns nothing of other salts' prompts,
  neither from ``prefix_cached_tokens`` nor from its time to first token. The salt the server
  passes is `prefix_salt`: the client's domain (the key it presented, or its IP address on a
  server without keys) together with the request's own ``cache_salt``. A client therefore
  cannot name another's domain, whatever salt it sends. ``prefix_share="global"`` leaves the
  domain out: every request with the same ``cache_salt`` (or none) shares, as before.
"""

from __future__ import annotations

import hashlib
import json

import attrs
from starlette.types import Scope

CLIENT_KEY = "stagerun.client"  # where `RequestContext` leaves the `Client` in the scope


@attrs.frozen
class Client:
    """Who sent a request, as far as the server can tell.

    Attributes:
        authorized: it presented one of the server's API keys, or the server has none.
        detail: it may see ``/metrics`` and the detailed ``/health`` (it is authorized, or
            ``metrics_auth`` is ``none``).
        prefix_domain: whose cached prefixes it shares: ``key:<digest>`` of the key it
            presented, ``address:<ip>`` on a server without keys, None when ``prefix_share`` is
            ``global`` (see `prefix_salt`).
    """

    authorized: bool
    detail: bool
    prefix_domain: str | None


def client_of(scope: Scope) -> Client:
    """The `Client` that `RequestContext` found for the request of ``scope``.

    An app run without `RequestContext` around it tells no clients apart: each request sees
    the detail, and all share one prefix domain.
    """
    client = scope.get(CLIENT_KEY)
    if isinstance(client, Client):
        return client
    return Client(authorized=True, detail=True, prefix_domain=None)


def key_domain(key: str) -> str:
    """The prefix domain of an API key: a digest, so the key itself goes nowhere else."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def prefix_salt(domain: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's cached prefixes are named with (``Pipeline.generate``'s
    ``cache_salt``): its client's domain and its own ``cache_salt`` together, so that two
    domains never share whatever salts they send, and salts still split one domain. None is
    the pipeline's own salt (no domain, no salt)."""
    if domain is None:
        return cache_salt
    return json.dumps([domain, cache_salt])
