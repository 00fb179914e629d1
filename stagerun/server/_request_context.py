"""The ASGI wrapper around every request: `RequestContext`.

It gives every request an id (the client's ``x-request-id`` or a new one, echoed in the
response), refuses a ``Host`` the server does not answer for (421), a missing or wrong API key
on ``/v1/*`` (401), and on ``/metrics`` too unless ``metrics_auth`` is ``none``, and a ``/v1/*``
POST that is not JSON (415), gives the body ``body_timeout`` seconds to arrive (408), starts
the request's ``request_timeout`` clock, and records the status and duration of every answer.

It also decides who the client is, for the handlers behind it (a `Client`, left in the scope;
see `._clients`): whether it presented a key, so that ``/health`` shows its detail only to a
request that may see it, and the domain whose cached prefixes it may share (its key, else its
IP address), so that no client learns of another's prompts through the prefix cache.
"""

from __future__ import annotations

import hmac
import time
import uuid

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._clients import CLIENT_KEY, Client, key_domain
from ._generation import json_message
from ._hosts import AllowedHosts
from ._openai import ApiError
from ._state import ServerState

ENDPOINTS = frozenset(
    {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
     "/tokenize", "/detokenize"}
)  # fmt: skip
# Paths behind the API key, whose POSTs must be JSON: the OpenAI API and the tokenizer's.
GUARDED_PATHS = ("/v1/", "/tokenize", "/detokenize")
# Paths behind the API key unless --metrics-auth is none (/health answers everyone, but shows
# its detail only to a request with a key).
MONITORING_PATHS = ("/metrics",)
# What a /v1/* POST must say it sends. A web page can POST text/plain, form data or no type at
# all to any server without the browser asking the server first (a CORS "simple request").
JSON_MEDIA_TYPE = "application/json"


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= 200 and value.isascii() and value.isprintable()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


class RequestContext:
    """ASGI wrapper: request ids, the Host, API key and content type checks, the body's
    deadline, the request's clock, per-request metrics, and who the client is (`Client`).

    The API keys, the prefix sharing and who sees the monitoring endpoints are
    ``state.http``'s (`HttpConfig.api_keys`, ``prefix_share``, ``metrics_auth``).
    """

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        *,
        allowed_hosts: AllowedHosts | None = None,
    ) -> None:
        self.app = app
        self.state = state
        self.allowed_hosts = allowed_hosts
        self._keys = [(key.encode(), key_domain(key)) for key in state.http.api_keys]
        self._guarded: tuple[str, ...] = GUARDED_PATHS
        if state.http.metrics_auth == "key":
            self._guarded += MONITORING_PATHS

    def __repr__(self) -> str:
        hosts = "any" if self.allowed_hosts is None else "checked"
        http = self.state.http
        return (
            f"<RequestContext keys={len(self._keys)} hosts={hosts} "
            f"prefix_share={http.prefix_share} metrics_auth={http.metrics_auth} "
            f"{self.state.admission!r}>"
        )

    def _presented_key(self, scope: Scope) -> str | None:
        """The prefix domain of the API key the request presents; None if it presents none of
        the server's keys. Every key is compared, in constant time, whichever matches."""
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    token = given.strip()
                break
        found = None
        for key, domain in self._keys:
            if hmac.compare_digest(token, key):
                found = domain
        return found

    def client(self, scope: Scope) -> Client:
        """Who sent the request of ``scope`` (decide, then do)."""
        http = self.state.http
        if self._keys:
            key = self._presented_key(scope)
            authorized = key is not None
            domain = key or "no-key"  # (refused before it could use the cache)
        else:  # no keys: a client is its address (behind a proxy, that is the proxy's)
            address = scope.get("client")
            domain = f"address:{address[0] if address else 'unknown'}"
            authorized = True
        return Client(
            authorized=authorized,
            detail=authorized or http.metrics_auth == "none",
            prefix_domain=None if http.prefix_share == "global" else domain,
        )

    def _refusal(self, scope: Scope, client: Client) -> ApiError | None:
        """Why the request is answered without reaching the app, if it is (decide, then do)."""
        if self.allowed_hosts is not None:
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            for host in hosts:  # none at all is HTTP/1.0, which no browser sends
                if not self.allowed_hosts.allows(host):
                    return ApiError(
                        421,
                        f"this server does not answer for the host {host!r}; use its address, "
                        "or start it with --allowed-hosts naming that host",
                        code="invalid_host",
                    )
        path = scope["path"]
        if not client.authorized and path.startswith(self._guarded):
            why = ""
            if path.startswith(MONITORING_PATHS):
                why = " (or start the server with --metrics-auth none to open it to everyone)"
            return ApiError(
                401,
                f"missing or wrong API key: send the header 'Authorization: Bearer <key>'{why}",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        if scope["method"] == "POST" and scope["path"].startswith(GUARDED_PATHS):
            given = _header(scope, b"content-type")
            media_type = (given or "").partition(";")[0].strip().lower()
            if media_type != JSON_MEDIA_TYPE:
                return ApiError(
                    415,
                    f"the request body must be JSON, sent with 'Content-Type: {JSON_MEDIA_TYPE}'"
                    f" (got {'no Content-Type' if given is None else repr(given)})",
                    code="unsupported_media_type",
                )
        return None

    def _body_in_time(self, receive: Receive) -> Receive:
        """``receive``, but the whole request body must arrive within ``body_timeout``.

        A body that does not is answered 408 (raised as `ApiError` to whoever reads it) and
        the connection is closed; once the body is in, ``receive`` waits as long as it likes
        (for ``http.disconnect``).
        """
        timeout = self.state.http.body_timeout
        deadline = trio.current_time() + timeout
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            with trio.move_on_at(deadline):
                message = await receive()
                complete = message["type"] != "http.request" or not message.get("more_body")
                return message
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout:g} s (the server's body "
                "timeout); send the whole request at once",
                code="request_timeout",
                headers={"connection": "close"},
            )

        return receive_in_time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (_header(scope, b"x-request-id") or "").strip()
        if not _valid_request_id(request_id):
            request_id = str(uuid.uuid4())
        scope["stagerun.request_id"] = request_id
        scope["stagerun.deadline"] = trio.current_time() + self.state.http.request_timeout
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            client = scope[CLIENT_KEY] = self.client(scope)
            refusal = self._refusal(scope, client)
            if refusal is None:
                await self.app(scope, self._body_in_time(receive), send_with_id)
            else:
                headers = [
                    (b"content-type", b"application/json"),
                    *((k.encode(), v.encode()) for k, v in refusal.headers.items()),
                ]
                for message in json_message(refusal.status, refusal.envelope(), headers):
                    await send_with_id(message)
        finally:
            path = scope["path"]
            if path in ENDPOINTS:
                endpoint = path
            else:
                endpoint = "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
            self.state.metrics.observe_request(endpoint, status, time.perf_counter() - started)
