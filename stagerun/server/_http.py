"""The HTTP server's accept loop: hypercorn per connection, a bound on connections in front.

Theory of operation: hypercorn parses and answers each connection (its `TCPServer`), but it
has no option to bound how many are open, and none for a write deadline. `serve_http` is
hypercorn's trio worker with its own accept loop. `ConnectionLimit` decides, synchronously at
each accept, whether the new connection is served, served after the longest idle connection
is closed to make room, or refused with a 503; `CountRequests` tells it which connections
have a request in flight (those are never closed to make room). The listening sockets carry
``TCP_USER_TIMEOUT``: hypercorn writes to the socket inside a shielded cancel scope, so a
write to a client that stopped reading cannot be cancelled, and only the kernel closing the
socket under it frees the connection.
"""

from __future__ import annotations

import contextlib
import functools
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
from starlette.types import ASGIApp, Receive, Scope, Send

from ._openai import error_envelope

log = logging.getLogger("stagerun.serve")
# Seconds between two warnings that the limit is reached: a flood must not flood the log too.
WARN_EVERY = 10.0
# Seconds a refused connection gets to take its 503; it is closed then, read or not.
REFUSAL_WRITE_TIMEOUT = 1.0

Peer = tuple[str, int]  # a connection's client address, as hypercorn puts it in the scope


@attrs.define(eq=False)
class _Connection:
    peer: Peer | None
    scope: trio.CancelScope
    requests: int = 0  # in flight on it (HTTP/2 may have several)
    counted: bool = True  # among the limit's open connections


class ConnectionLimit:
    """At most ``limit`` open HTTP connections; at the limit the longest idle one makes room.

    A connection is idle while no request is in flight on it: before its first request head is
    complete (a slow or silent client) and between keep-alive requests. So connections that
    never get to a request cannot keep others out. One with a request in flight is never
    closed to make room (the request's own deadlines bound it); when every connection has one,
    a new connection is answered 503 and closed.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the connection limit must be at least 1, got {limit}")
        self.limit = limit
        self.evicted = 0
        self.refused = 0
        self._idle: dict[_Connection, None] = {}  # longest idle first
        self._by_peer: dict[Peer, _Connection] = {}
        self._open = 0
        self._warned = -float("inf")

    def __repr__(self) -> str:
        return (
            f"<ConnectionLimit open={self._open}/{self.limit} idle={len(self._idle)} "
            f"evicted={self.evicted} refused={self.refused}>"
        )

    def open(self, peer: Peer | None, scope: trio.CancelScope) -> _Connection | None:
        """Count a new connection in (None: refuse it); at the limit, cancel the longest idle
        connection's ``scope`` to make room."""
        if self._open >= self.limit:
            if not self._idle:
                self.refused += 1
                self._warn(f"all {self.limit} connections have a request in flight")
                return None
            victim = next(iter(self._idle))
            self._forget(victim)
            victim.scope.cancel(reason=f"connection limit {self.limit}: idle longest")
            self.evicted += 1
            self._warn(f"{self.limit} connections open; closing the longest idle ones")
        connection = _Connection(peer, scope)
        self._open += 1
        self._idle[connection] = None
        if peer is not None:
            self._by_peer[peer] = connection
        return connection

    def close(self, connection: _Connection) -> None:
        self._forget(connection)  # (an evicted one is forgotten already)

    def request_started(self, peer: Peer) -> None:
        connection = self._by_peer.get(peer)
        if connection is not None:
            connection.requests += 1
            self._idle.pop(connection, None)

    def request_finished(self, peer: Peer) -> None:
        connection = self._by_peer.get(peer)
        if connection is not None:
            connection.requests -= 1
            if connection.requests == 0:
                self._idle[connection] = None

    def _forget(self, connection: _Connection) -> None:
        if not connection.counted:
            return
        connection.counted = False
        self._open -= 1
        self._idle.pop(connection, None)
        if connection.peer is not None and self._by_peer.get(connection.peer) is connection:
            del self._by_peer[connection.peer]

    def _warn(self, what: str) -> None:
        now = trio.current_time()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            log.warning("%s (%r); raise --max-connections or the open-file limit", what, self)


class CountRequests:
    """ASGI wrapper telling a `ConnectionLimit` which connections have a request in flight."""

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
        try:
            await self.app(scope, receive, send)
        finally:
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
                gone = (trio.BrokenResourceError, trio.ClosedResourceError)
                with trio.move_on_after(REFUSAL_WRITE_TIMEOUT), contextlib.suppress(*gone):
                    await stream.send_all(BUSY_RESPONSE)
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
