"""Raw TCP transport: one trio SocketStream per connection, TCP_NODELAY on.

Trio's SocketStream already disables Nagle's algorithm, so a small decode frame leaves at once;
this module only adds address parsing, connect deadlines and a server that reports the address
it really bound (port 0 picks a free port) through ``task_status.started``.
"""

from __future__ import annotations

import errno
import socket
from functools import partial
from typing import ClassVar

import trio

from .._errors import LaneHandshakeError
from .._wire._address import format_address, parse_address
from ..abc import ConnectionHandler, Transport


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """`trio.open_tcp_stream` with TCP_NODELAY, refusing a connection to itself.

    Dialling a loopback port in the ephemeral range where nothing listens can, rarely, connect
    the socket to itself: the kernel picks that very port as its source, and the SYNs meet
    (seen under load, when a killed stage's port was probed). No stage is there.

    Raises:
        OSError: the connection failed, or it reached itself (``ECONNREFUSED``).
    """
    stream = await trio.open_tcp_stream(host, port)
    try:
        if stream.socket.getsockname() == stream.socket.getpeername():
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, "nothing listens there (the socket connected to itself)"
            )
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


class TcpTransport(Transport):
    """Lanes over raw TCP: ``tcp://HOST:PORT``."""

    schemes: ClassVar[tuple[str, ...]] = ("tcp",)

    def __repr__(self) -> str:
        return "<TcpTransport>"

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Open a connection within ``timeout`` seconds."""
        _scheme, host, port = parse_address(address)
        where = format_address("tcp", host, port)
        try:
            with trio.fail_after(timeout):
                stream = await open_tcp(host, port)
        except trio.TooSlowError as exc:
            raise LaneHandshakeError(f"could not connect to {where} within {timeout:g}s") from exc
        except OSError as exc:
            raise LaneHandshakeError(
                f"could not connect to {where}: {exc.strerror or exc}"
            ) from exc
        return stream

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections forever; each one runs ``handler(stream, peer)`` in its own task."""
        _scheme, host, port = parse_address(address)

        async def handle(stream: trio.SocketStream) -> None:
            try:
                peer_host, peer_port = stream.socket.getpeername()[:2]
                peer = format_address("tcp", peer_host, peer_port)
            except OSError:
                peer = "tcp://<unknown>"
            await handler(stream, peer)

        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, handle, listeners))
            task_status.started(format_address("tcp", bound_host, bound_port))
