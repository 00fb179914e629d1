"""Websocket transport: lanes that cross proxies and firewalls which only pass HTTP.

Theory of operation: a lane is one websocket connection carrying binary messages, so the
frame codec, the handshake and the lane logic are the same as over TCP. Each side wraps its
connection in a `trio.abc.Stream` whose ``send_all`` sends the bytes as one or more messages of
at most `MAX_MESSAGE_BYTES` and whose ``receive_some`` returns message bytes, which stagerun's
frame decoder takes as it takes TCP bytes: message boundaries mean nothing to it, so a frame of
any size the codec accepts crosses as several messages.

Messages are small because a websocket message is buffered whole before anything reads it, and
the first one arrives before the lane handshake: its size is what any peer that can reach the
port makes a stage hold. The server (trio-websocket's) refuses a larger message with close code
1009 while assembling it, and reads at most `SERVER_MESSAGE_QUEUE` messages ahead of the lane.
So one connection, authenticated or not, holds at most queue + 2 whole messages (queued, handed
over by the reader, being read by the lane) plus one socket read: 4 x 256 KiB + 64 KiB, about
1.1 MiB (one message more for the instant trio-websocket joins a message's parts).

The stage sees a connection only once it is upgraded, so this module bounds upgrades itself:
`MAX_UPGRADES` at once (one more closes the oldest), each within `CONNECT_TIMEOUT` (h11 caps the
request head at 16 KiB); a refused upgrade is closed at once.

The client speaks the same protocol through wsproto (which trio-websocket is built on), driven
by the lane's own reads: trio-websocket's client needs a nursery that outlives the connection
to run its reader task, while a lane is an object in a pool. This way a websocket lane needs no
background task and is cancel-safe exactly like a TCP one: a cancelled ``receive_some`` loses
nothing, because bytes read from the socket are parsed before the next checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import trio
import trio_websocket
import wsproto
from wsproto import events as ws_events
from wsproto.connection import ConnectionState
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from .._errors import LaneHandshakeError
from .._wire._address import format_address
from .._wire._framed import socket_is_idle
from ..abc import ConnectionHandler, Transport
from ._slots import Slots
from ._tcp import open_tcp
from ._tls import TlsStream, client_context, server_context

__all__ = ["WebSocketTransport"]

log = logging.getLogger("stagerun.transports")

# The largest websocket message sent or accepted: what one message makes the receiver buffer
# before it reads a byte. 256 KiB keeps a decode frame (~2.4 KB) in one message and splits a
# 512-token f32 prefill chunk (1.2 MB) into five, at 14 bytes of websocket framing each.
MAX_MESSAGE_BYTES = 256 * 1024
# Bytes read from the socket at a time, by trio-websocket's reader and by the client.
RECEIVE_BUFFER_BYTES = 64 * 1024
# Whole messages the server may read ahead of the lane: enough to keep the socket draining while
# the lane decodes, few enough to keep the bound above near 1 MiB per connection.
SERVER_MESSAGE_QUEUE = 2
LANE_PATH = "/stagerun/lane"
# An upgrade must complete, and a closing peer answer the close, within these (seconds); an
# idle pooled lane is not read until it is checked out, so its close reply may never come.
CONNECT_TIMEOUT = 10.0
DISCONNECT_TIMEOUT = 2.0
# Connections in their websocket upgrade at once, at most; one more closes the oldest. The stage
# bounds a connection only once it is upgraded; an honest peer upgrades in one round trip, so a
# flood of stalled upgrades holds this many sockets, each with at most a 16 KiB request head
# (h11's cap) and one socket read, and no more.
MAX_UPGRADES = 64


def parse_ws_address(address: str) -> tuple[str, int, str]:
    """``ws://HOST:PORT[/path]`` (or ``wss://``) into host, port and path (default
    ``/stagerun/lane``)."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ws", "wss"):
        raise ValueError(f"websocket address {address!r} must look like ws://HOST:PORT[/PATH]")
    hostport, slash, path = rest.partition("/")
    host, colon, port_text = hostport.rpartition(":")
    if not colon or not port_text.isdigit():
        raise ValueError(f"websocket address {address!r} must look like ws://HOST:PORT[/PATH]")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"websocket address {address!r} has port {port} outside 0..65535")
    return host.strip("[]") or "127.0.0.1", port, "/" + path if slash else LANE_PATH


def _messages(data: bytes | bytearray | memoryview) -> Iterator[bytes]:
    """``data`` cut into websocket messages of at most `MAX_MESSAGE_BYTES` (none if empty)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), MAX_MESSAGE_BYTES):
        yield bytes(view[start : start + MAX_MESSAGE_BYTES])


class _ServerStream(trio.abc.Stream):
    """An accepted trio-websocket connection as a stream of message bytes."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._leftover = b""
        self._eof = False
        self._send_lock = trio.StrictFIFOLock()  # one send_all's messages stay together

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with self._send_lock:
                for message in _messages(data):
                    await self._ws.send_message(message)
        except trio_websocket.ConnectionClosed as exc:
            raise trio.BrokenResourceError("the websocket is closed") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._leftover or self._eof:
            await trio.lowlevel.checkpoint()
        while not self._leftover and not self._eof:  # an empty message is not the end
            try:
                message = await self._ws.get_message()
            except trio_websocket.ConnectionClosed:
                self._eof = True
            else:
                if isinstance(message, str):
                    await self._ws.aclose(code=1003, reason="stagerun lanes carry binary frames")
                    raise trio.BrokenResourceError("the peer sent a text message on a lane")
                self._leftover = message
        size = len(self._leftover) if max_bytes is None else max_bytes
        data, self._leftover = self._leftover[:size], self._leftover[size:]
        return data

    async def aclose(self) -> None:
        await self._ws.aclose()


class _ClientStream(trio.abc.Stream):
    """A client websocket over a TCP stream, driven by wsproto from ``receive_some``."""

    def __init__(self, stream: trio.SocketStream | TlsStream, ws: wsproto.WSConnection) -> None:
        self._stream = stream
        self._ws = ws
        self._pending = bytearray()  # message bytes received, not yet returned
        self._message_bytes = 0  # of the message being received, so far
        self._control = bytearray()  # pongs and close frames to send with the next write
        self._eof = False
        self._send_lock = trio.StrictFIFOLock()

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._stream.socket

    def is_live(self) -> bool:
        """Idle, open, nothing unsolicited waiting (see `stagerun.abc.Transport`)."""
        if self._eof or self._pending or self._ws.state is not ConnectionState.OPEN:
            return False
        probe = getattr(self._stream, "is_live", None)  # a TLS stream knows better
        return bool(probe()) if callable(probe) else socket_is_idle(self._stream.socket)

    def _take_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, ws_events.BytesMessage):
                # wsproto hands over a message in parts as they arrive: count them, so that an
                # oversized message is refused before it is held, as the server refuses one.
                self._message_bytes += len(event.data)
                if self._message_bytes > MAX_MESSAGE_BYTES:
                    self._eof = True
                    reason = f"message larger than {MAX_MESSAGE_BYTES} bytes"
                    self._control += self._ws.send(ws_events.CloseConnection(1009, reason))
                    raise trio.BrokenResourceError(
                        f"the peer sent a websocket message larger than {MAX_MESSAGE_BYTES} "
                        "bytes (a stagerun peer splits frames into smaller messages)"
                    )
                if event.message_finished:
                    self._message_bytes = 0
                self._pending += event.data
            elif isinstance(event, ws_events.Ping):
                self._control += self._ws.send(event.response())
            elif isinstance(event, ws_events.CloseConnection):
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    self._control += self._ws.send(event.response())
                self._eof = True
            elif isinstance(event, ws_events.TextMessage):
                raise trio.BrokenResourceError("the peer sent a text message on a lane")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            out = b"".join(
                self._ws.send(ws_events.BytesMessage(data=message)) for message in _messages(data)
            )
        except LocalProtocolError as exc:
            raise trio.ClosedResourceError("the websocket is closing") from exc
        async with self._send_lock:
            if self._control:
                out, self._control = bytes(self._control) + out, bytearray()
            await self._stream.send_all(out)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._pending and not self._eof:
            data = await self._stream.receive_some(RECEIVE_BUFFER_BYTES)
            # No checkpoint from here to the return: a cancellation cannot lose these bytes.
            try:
                self._ws.receive_data(bytes(data) if data else None)
                self._take_events()
            except RemoteProtocolError as exc:
                raise trio.BrokenResourceError(f"websocket protocol error: {exc}") from exc
            if not data:
                self._eof = True
        if not self._pending:
            await trio.lowlevel.checkpoint()
            return b""
        size = len(self._pending) if max_bytes is None else max_bytes
        out = bytes(self._pending[:size])
        del self._pending[:size]
        if not out:
            await trio.lowlevel.checkpoint()
        return out

    async def aclose(self) -> None:
        try:
            out = bytes(self._control)  # with a close already queued, if a read refused one
            if self._ws.state is ConnectionState.OPEN:
                out += self._ws.send(ws_events.CloseConnection(code=1000))
            if out:
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    await self._stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, LocalProtocolError):
            pass
        finally:
            await self._stream.aclose()


class WebSocketTransport(Transport):
    """Lanes over websockets: ``ws://HOST:PORT[/PATH]`` (``wss://``: `SecureWebSocketTransport`)."""

    schemes: ClassVar[tuple[str, ...]] = ("ws",)
    secure: ClassVar[bool] = False

    def __repr__(self) -> str:
        return "<WebSocketTransport>"

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Open a websocket to ``address`` and complete the HTTP upgrade within ``timeout``."""
        host, port, path = parse_ws_address(address)
        where = format_address(self.schemes[0], host, port) + path
        stream: Any = None
        try:
            with trio.fail_after(timeout):
                tcp = await open_tcp(host, port)
                stream = tcp
                if self.secure:
                    tls = trio.SSLStream(tcp, client_context(), server_hostname=host)
                    try:
                        await tls.do_handshake()
                    except trio.BrokenResourceError as exc:
                        raise LaneHandshakeError(
                            f"TLS handshake with {where} failed: {exc.__cause__ or exc}"
                        ) from exc
                    stream = TlsStream(tls)
                ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
                await stream.send_all(
                    ws.send(ws_events.Request(host=f"{host}:{port}", target=path))
                )
                client = _ClientStream(stream, ws)
                while True:
                    data = await stream.receive_some(RECEIVE_BUFFER_BYTES)
                    if not data:
                        raise LaneHandshakeError(
                            f"{where} closed the connection during the upgrade"
                        )
                    ws.receive_data(data)
                    for event in ws.events():
                        if isinstance(event, ws_events.AcceptConnection):
                            client._take_events()  # frames that came with the upgrade reply
                            return client
                        if isinstance(event, ws_events.RejectConnection):
                            raise LaneHandshakeError(
                                f"{where} refused the websocket upgrade (HTTP {event.status_code})"
                            )
        except trio.TooSlowError as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise LaneHandshakeError(
                f"could not open a websocket to {where} within {timeout:g}s"
            ) from exc
        except OSError as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise LaneHandshakeError(
                f"could not connect to {where}: {exc.strerror or exc}"
            ) from exc
        except (RemoteProtocolError, trio.BrokenResourceError) as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise LaneHandshakeError(f"the websocket upgrade with {where} failed: {exc}") from exc
        except BaseException:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept websocket lanes on ``address``; each one runs ``handler(stream, peer)``.

        The stage sees a connection once its upgrade is done; until then this bounds it: at
        most `MAX_UPGRADES` upgrade at once (one more closes the oldest), each for at most
        `CONNECT_TIMEOUT` seconds, and a refused upgrade is closed at once.
        """
        host, port, path = parse_ws_address(address)
        scheme = self.schemes[0]
        if self.secure:
            listeners: list[trio.abc.Listener[Any]] = list(
                await trio.open_ssl_over_tcp_listeners(
                    port, server_context(), host=host, https_compatible=True
                )
            )
        else:
            listeners = list(await trio.open_tcp_listeners(port, host=host))
        upgrading = Slots(MAX_UPGRADES, "websocket upgrades")

        async def upgrade(
            nursery: trio.Nursery, stream: trio.abc.Stream, peer: str
        ) -> trio_websocket.WebSocketRequest | None:
            with upgrading.slot(peer):  # cancelled to make room for a newer upgrade
                try:
                    with trio.fail_after(CONNECT_TIMEOUT):
                        return await trio_websocket.wrap_server_stream(
                            nursery,
                            stream,
                            message_queue_size=SERVER_MESSAGE_QUEUE,
                            max_message_size=MAX_MESSAGE_BYTES,
                            receive_buffer_size=RECEIVE_BUFFER_BYTES,
                        )
                except trio.TooSlowError:
                    log.info(
                        "closing the connection from %s: no websocket upgrade within %gs",
                        peer,
                        CONNECT_TIMEOUT,
                    )
            return None

        async def lane(request: trio_websocket.WebSocketRequest, peer: str) -> None:
            if request.path != path:
                await request.reject(404, body=f"stagerun lanes are served at {path}".encode())
                return
            ws = await request.accept()
            try:
                await handler(_ServerStream(ws), peer)
            finally:
                # The client answers a close only when it next reads or writes: an idle pooled
                # lane may never answer, so the close is bounded.
                with trio.move_on_after(DISCONNECT_TIMEOUT) as scope:
                    scope.shield = True
                    await ws.aclose()

        async def on_connection(stream: trio.abc.Stream) -> None:
            peer = _peer(stream, scheme)
            try:
                async with trio.open_nursery() as nursery:  # runs trio-websocket's reader
                    request = await upgrade(nursery, stream, peer)
                    if request is not None:
                        await lane(request, peer)
                    nursery.cancel_scope.cancel(reason="the connection is done")
            finally:
                await trio.aclose_forcefully(stream)

        bound = _bound_port(listeners[0])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, on_connection, listeners)
            suffix = "" if path == LANE_PATH else path
            task_status.started(format_address(scheme, host, bound) + suffix)


def _socket_of(stream: trio.abc.Stream | trio.abc.Listener[Any]) -> Any:
    """The socket under a (TLS) socket stream or listener, or None."""
    inner = getattr(stream, "transport_stream", None) or getattr(stream, "transport_listener", None)
    return getattr(inner if inner is not None else stream, "socket", None)


def _peer(stream: trio.abc.Stream, scheme: str) -> str:
    try:
        host, port = _socket_of(stream).getpeername()[:2]
    except (AttributeError, OSError):
        return f"{scheme}://<unknown>"
    return format_address(scheme, host, port)


def _bound_port(listener: trio.abc.Listener[Any]) -> int:
    port: int = _socket_of(listener).getsockname()[1]
    return port


class SecureWebSocketTransport(WebSocketTransport):
    """Lanes over websockets on TLS: ``wss://HOST:PORT[/PATH]``.

    Certificates as for ``tls://`` (`stagerun.transports._tls`): the stage serves with
    ``$STAGERUN_TLS_CERT``/``$STAGERUN_TLS_KEY``, a connecting stage trusts ``$STAGERUN_TLS_CA``.
    """

    schemes: ClassVar[tuple[str, ...]] = ("wss",)
    secure: ClassVar[bool] = True

    def __repr__(self) -> str:
        return "<SecureWebSocketTransport>"
