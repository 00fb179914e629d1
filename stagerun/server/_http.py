"""The HTTP server's accept loop: hypercorn per connection, bounds on connections in front.

Theory of operation: hypercorn parses and answers each connection (its `TCPServer`), but it
has no option to bound how many are open, and none for a write deadline. `serve_http` is
hypercorn's trio worker with its own accept loop. `ConnectionLimit` decides, synchronously at
each accept, whether the new connection is served, served after an idle connection is closed
to make room, or refused; `CountRequests` tells it which connections have a request in flight
(those are never closed to make room) and which request bodies are late.

Limits are global and per client (an IPv4 address, or an IPv6 /64: `client_key`). A client at
its own connection limit makes room from its own idle connections first, so it cannot push
everyone else's out. A request body still arriving `BODY_GRACE` after its request began is
*late*; a client may have ``bodies_per_client`` late bodies, and one more is answered 429 and
its connection closed, so slow bodies from one address cannot pin the server's connections
until the body timeout. A refused connection is not turned away blind: its request head is
read for at most `TRIAGE_TIMEOUT` (`MAX_TRIAGE` such connections at once, the oldest gives
way), and a ``GET /health`` is answered there with a liveness answer, every other request with
a 503. So no flood of connections, from any number of addresses, takes ``/health`` away.

The listening sockets carry ``TCP_USER_TIMEOUT``: hypercorn writes to the socket inside a
shielded cancel scope, so a write to a client that stopped reading cannot be cancelled, and
only the kernel closing the socket under it frees the connection.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

import attrs
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._config import DEFAULT_MAX_BODIES_PER_CLIENT
from ._openai import ApiError, error_envelope

log = logging.getLogger("stagerun.serve")
# Seconds between two warnings of one kind: a flood must not flood the log too.
WARN_EVERY = 10.0
# Seconds a refused connection gets to take its 503; it is closed then, read or not.
REFUSAL_WRITE_TIMEOUT = 1.0
# Seconds a request body may take before it counts as late: an honest body arrives with its
# head or right after it, so only slow bodies (and very large ones on slow links) count.
BODY_GRACE = 0.25
# Refused connections whose request head is read (for a GET /health) at once; one more closes
# the oldest, so a silent flood holds at most this many sockets beyond the limit.
MAX_TRIAGE = 16
TRIAGE_TIMEOUT = 1.0  # seconds a refused connection has to send its request head
MAX_TRIAGE_HEAD = 8192  # bytes of it read; a longer head gets the 503

Peer = tuple[str, int]  # a connection's client address, as hypercorn puts it in the scope


def client_key(host: str) -> str:
    """Who a connection's address counts as: an IPv4 address, or the /64 of an IPv6 one (one
    host usually holds a whole /64); an IPv4-mapped IPv6 address is its IPv4 address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network((address.packed, 64), strict=False))
    return str(address)


@attrs.define(eq=False)
class _Connection:
    peer: Peer | None
    client: _Client | None
    scope: trio.CancelScope
    requests: int = 0  # in flight on it (HTTP/2 may have several)
    counted: bool = True  # among the limit's open connections


@attrs.define(eq=False)
class _Client:
    key: str
    connections: int = 0
    late_bodies: int = 0
    idle: dict[_Connection, None] = attrs.field(factory=dict)  # longest idle first


class ConnectionLimit:
    """At most ``limit`` open HTTP connections, ``per_client`` of them from one client, and
    ``bodies_per_client`` late request bodies per client.

    A connection is idle while no request is in flight on it: before its first request head is
    complete (a slow or silent client) and between keep-alive requests. At a limit, the longest
    idle connection makes room: the client's own at its per-client limit, anyone's at the
    global one. A connection with a request in flight is never closed to make room (the
    request's own deadlines bound it); when none is idle the new connection is refused, and
    `serve_http` triages it (`triage`). ``per_client`` and ``bodies_per_client`` None: no
    per-client limit (`stagerun serve` sets both: `for_serve`).
    """

    def __init__(
        self, limit: int, *, per_client: int | None = None, bodies_per_client: int | None = None
    ) -> None:
        named = {"connection": limit, "per-client connection": per_client,
                 "per-client late body": bodies_per_client}  # fmt: skip
        for name, value in named.items():
            if value is not None and value < 1:
                raise ValueError(f"the {name} limit must be at least 1, got {value}")
        self.limit = limit
        self.per_client = per_client
        self.bodies_per_client = bodies_per_client
        self.evicted = 0
        self.refused = 0
        self.late_refused = 0  # late bodies answered 429
        self.liveness_answers = 0  # GET /health answered by the triage
        self._idle: dict[_Connection, None] = {}  # longest idle first
        self._by_peer: dict[Peer, _Connection] = {}
        self._clients: dict[str, _Client] = {}
        self._triage: dict[trio.CancelScope, None] = {}  # oldest first
        self._open = 0
        self._warned: dict[str, float] = {}

    @classmethod
    def for_serve(
        cls, limit: int, per_client: int | None = None, bodies_per_client: int | None = None
    ) -> ConnectionLimit:
        """`stagerun serve`'s limits: by default a quarter of the connections per client, and
        half of those, at most `DEFAULT_MAX_BODIES_PER_CLIENT`, for late bodies."""
        per_client = per_client or max(1, limit // 4)
        bodies = bodies_per_client or max(1, min(DEFAULT_MAX_BODIES_PER_CLIENT, per_client // 2))
        return cls(limit, per_client=per_client, bodies_per_client=bodies)

    def __repr__(self) -> str:
        text = (
            f"<ConnectionLimit open={self._open}/{self.limit} idle={len(self._idle)} "
            f"evicted={self.evicted} refused={self.refused}"
        )
        if self.per_client is not None or self.bodies_per_client is not None:
            late = sum(c.late_bodies for c in self._clients.values())
            text += (
                f" clients={len(self._clients)} per_client={self.per_client} "
                f"late_bodies={late} bodies_per_client={self.bodies_per_client} "
                f"late_refused={self.late_refused}"
            )
        if self._triage or self.liveness_answers:
            text += f" triage={len(self._triage)} liveness_answers={self.liveness_answers}"
        return text + ">"

    def open(self, peer: Peer | None, scope: trio.CancelScope) -> _Connection | None:
        """Count a new connection in (None: refuse it); at a limit, cancel the ``scope`` of the
        longest idle connection (the client's own at its per-client limit) to make room."""
        client = None
        if peer is not None and (self.per_client or self.bodies_per_client) is not None:
            key = client_key(peer[0])
            client = self._clients.get(key) or self._clients.setdefault(key, _Client(key))
        per_client = self.per_client
        if (
            client is not None
            and per_client is not None
            and client.connections >= per_client
            and not self._make_room(client.idle, "--max-connections-per-client")
        ) or (self._open >= self.limit and not self._make_room(self._idle, "--max-connections")):
            if client is not None:
                self._drop_if_unused(client)
            return None
        connection = _Connection(peer, client, scope)
        self._open += 1
        self._idle[connection] = None
        if client is not None:
            client.connections += 1
            client.idle[connection] = None
        if peer is not None:
            self._by_peer[peer] = connection
        return connection

    def _make_room(self, idle: dict[_Connection, None], option: str) -> bool:
        """Close the longest idle of ``idle``; False (a refusal) when there is none."""
        scale = self.limit if option == "--max-connections" else self.per_client
        if not idle:
            self.refused += 1
            self._warn(option, f"{option} {scale} reached, and every connection has a request "
                       "in flight; refusing new ones")  # fmt: skip
            return False
        victim = next(iter(idle))
        self._forget(victim)
        victim.scope.cancel(reason=f"{option} {scale}: idle longest")
        self.evicted += 1
        self._warn(option, f"{option} {scale} reached; closing the longest idle connections")
        return True

    def close(self, connection: _Connection) -> None:
        self._forget(connection)  # (an evicted one is forgotten already)

    def request_started(self, peer: Peer) -> None:
        connection = self._by_peer.get(peer)
        if connection is not None:
            connection.requests += 1
            self._idle.pop(connection, None)
            if connection.client is not None:
                connection.client.idle.pop(connection, None)

    def request_finished(self, peer: Peer) -> None:
        connection = self._by_peer.get(peer)
        if connection is not None:
            connection.requests -= 1
            if connection.requests == 0 and connection.counted:
                self._idle[connection] = None
                if connection.client is not None:
                    connection.client.idle[connection] = None

    def body_late(self, peer: Peer) -> bool:
        """Count a late request body of ``peer``'s client in; False: it has too many (a 429).
        Each True is matched by one `body_done`."""
        connection = self._by_peer.get(peer)
        client = None if connection is None else connection.client
        if client is None or self.bodies_per_client is None:
            return True
        if client.late_bodies >= self.bodies_per_client:
            self.late_refused += 1
            self._warn("--max-bodies-per-client", f"{client.key} has {client.late_bodies} "
                       "request bodies arriving slowly; answering more with 429")  # fmt: skip
            return False
        client.late_bodies += 1
        return True

    def body_done(self, peer: Peer) -> None:
        connection = self._by_peer.get(peer)
        client = None if connection is None else connection.client
        if client is not None and self.bodies_per_client is not None:
            client.late_bodies -= 1
            self._drop_if_unused(client)

    def triage(self, scope: trio.CancelScope) -> None:
        """A refused connection's head is read in ``scope``; past `MAX_TRIAGE` at once, the
        oldest such connection is closed."""
        if len(self._triage) >= MAX_TRIAGE:
            oldest = next(iter(self._triage))
            del self._triage[oldest]
            oldest.cancel(reason=f"{MAX_TRIAGE} refused connections are being read")
        self._triage[scope] = None

    def triage_done(self, scope: trio.CancelScope) -> None:
        self._triage.pop(scope, None)

    def _forget(self, connection: _Connection) -> None:
        if not connection.counted:
            return
        connection.counted = False
        self._open -= 1
        self._idle.pop(connection, None)
        if connection.peer is not None and self._by_peer.get(connection.peer) is connection:
            del self._by_peer[connection.peer]
        client = connection.client
        if client is not None:
            client.connections -= 1
            client.idle.pop(connection, None)
            self._drop_if_unused(client)

    def _drop_if_unused(self, client: _Client) -> None:
        if client.connections == 0 and client.late_bodies == 0:
            self._clients.pop(client.key, None)

    def _warn(self, option: str, what: str) -> None:
        now = trio.current_time()
        if now - self._warned.get(option, -float("inf")) >= WARN_EVERY:
            self._warned[option] = now
            more = " or the open-file limit" if option == "--max-connections" else ""
            log.warning("%s (%r); raise %s%s if this is no flood", what, self, option, more)


def _has_body(scope: Scope) -> bool:
    """Whether a request has a body to come (a length, chunks, or an HTTP/2 POST)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return scope.get("http_version") == "2" and scope["method"] in ("POST", "PUT", "PATCH")


class _BodyWatch:
    """``receive`` for one request: a body not complete `BODY_GRACE` after the request began
    is late, and counts against its client's late bodies until it is complete."""

    def __init__(self, limit: ConnectionLimit, peer: Peer, receive: Receive) -> None:
        self._limit = limit
        self._peer = peer
        self._receive = receive
        self._grace_ends = trio.current_time() + BODY_GRACE
        self._complete = False
        self._counted = False

    async def receive(self) -> Message:
        if not self._complete:
            if not self._counted:
                with trio.move_on_at(self._grace_ends):
                    return self._note(await self._receive())
                if not self._limit.body_late(self._peer):
                    self._complete = True  # it is not read any further
                    raise _late_body_error(self._limit)
                self._counted = True
            return self._note(await self._receive())
        return await self._receive()

    def _note(self, message: Message) -> Message:
        if message["type"] != "http.request" or not message.get("more_body"):
            self.done()
        return message

    def done(self) -> None:
        self._complete = True
        if self._counted:
            self._counted = False
            self._limit.body_done(self._peer)


def _late_body_error(limit: ConnectionLimit) -> ApiError:
    return ApiError(
        429,
        f"this address has {limit.bodies_per_client} request bodies arriving slowly already "
        "(the server's --max-bodies-per-client); send each request whole, then retry",
        type="rate_limit_error",
        code="too_many_slow_bodies",
        headers={"connection": "close", "retry-after": "1"},
    )


class CountRequests:
    """ASGI wrapper telling a `ConnectionLimit` which connections have a request in flight,
    and which bodies are late."""

    def __init__(self, app: ASGIApp, limit: ConnectionLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] != "http" or client is None:
            await self.app(scope, receive, send)
            return
        peer = (str(client[0]), int(client[1]))
        self.limit.request_started(peer)
        watch = _BodyWatch(self.limit, peer, receive) if _has_body(scope) else None
        try:
            await self.app(scope, receive if watch is None else watch.receive, send)
        finally:
            if watch is not None:
                watch.done()
            self.limit.request_finished(peer)


_BUSY_BODY = json.dumps(
    error_envelope(
        "the server has too many connections open; retry in a few seconds",
        type="api_error",
        code="too_many_connections",
    )
).encode()
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_BUSY_BODY), _BUSY_BODY)
)
# What a GET /health refused a connection gets: the server is alive (the accept loop answers),
# and nothing more; the full answer, with the stages' probes, needs a connection.
_LIVENESS_BODY = b'{"status": "ok", "detail": "at the connection limit: liveness only"}'
LIVENESS_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncache-control: no-store\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_LIVENESS_BODY), _LIVENESS_BODY)
)


def is_health_probe(head: bytes) -> bool:
    """Whether a request head asks ``GET /health`` (a query string allowed)."""
    method, _, rest = head.partition(b" ")
    target = rest.partition(b" ")[0]
    return method == b"GET" and target.partition(b"?")[0] == b"/health"


async def _triage(stream: trio.SocketStream, limit: ConnectionLimit) -> None:
    """Answer a refused connection: its request head within `TRIAGE_TIMEOUT`, then the
    liveness answer to a ``GET /health`` and a 503 to anything else."""
    head = b""
    gone = (trio.BrokenResourceError, trio.ClosedResourceError)
    with trio.move_on_after(TRIAGE_TIMEOUT), contextlib.suppress(*gone):
        while b"\r\n\r\n" not in head and len(head) < MAX_TRIAGE_HEAD:
            chunk = await stream.receive_some(MAX_TRIAGE_HEAD - len(head))
            if not chunk:
                break
            head += chunk
    liveness = b"\r\n\r\n" in head and is_health_probe(head)
    with trio.move_on_after(REFUSAL_WRITE_TIMEOUT), contextlib.suppress(*gone):
        await stream.send_all(LIVENESS_RESPONSE if liveness else BUSY_RESPONSE)
    limit.liveness_answers += liveness


def set_write_deadline(sock: socket.socket, seconds: float) -> None:
    """Have the kernel drop a connection whose client takes no data for ``seconds``.

    ``TCP_USER_TIMEOUT`` (Linux) bounds how long sent data may go unacknowledged, and data
    wait in the send buffer because the client's window is shut; accepted sockets inherit it
    from the listening one. Elsewhere a client that stops reading keeps its connection (not
    its slot: the app gives that up after the same time) until it goes away.
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))


async def serve_http(
    app: ASGIApp,
    config: HypercornConfig,
    limit: ConnectionLimit,
    *,
    write_timeout: float,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker (``hypercorn.trio.serve``) with our accept loop in front.

    Each connection is hypercorn's `TCPServer`, as there; what differs is what happens before
    it runs (`ConnectionLimit`, the socket's write deadline). There is no ASGI lifespan: the
    app has no startup or shutdown of its own. The listening sockets are bound before
    ``task_status.started``; after ``shutdown_trigger`` idle connections close, busy ones get
    ``config.graceful_timeout``.
    """
    context = WorkerContext(None)
    wrapped = ASGIWrapper(cast(Any, CountRequests(app, limit)))
    sockets = config.create_sockets()
    listeners, binds = [], []
    for sock in sockets.insecure_sockets:
        set_write_deadline(sock, write_timeout)
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = parse_socket_addr(stream.socket.family, stream.socket.getpeername())
        except OSError:  # gone already
            return
        with trio.CancelScope() as scope:
            connection = limit.open(peer, scope)
            if connection is None:
                limit.triage(scope)
                try:
                    await _triage(stream, limit)
                finally:
                    limit.triage_done(scope)
                return
            try:
                await TCPServer(wrapped, config, context, ConnectionState({}), cast(Any, stream))
            finally:
                limit.close(connection)

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                functools.partial(
                    trio.serve_listeners, handle, listeners, handler_nursery=connections
                )
            )
            task_status.started(binds)
            await shutdown_trigger()
            accepting.cancel_scope.cancel(reason="shutting down")
        await context.terminated.set()  # idle connections close now
        connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
