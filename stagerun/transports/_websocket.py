"""Websocket transport: lanes that cross proxies and firewalls which only pass HTTP.

Theory of operation: a lane is one websocket connection and every frame is one binary
message, so the frame codec, the handshake and the lane logic are the same as over TCP. Each
side wraps its connection in a `trio.abc.Stream` whose ``send_all`` sends one message and whose
``receive_some`` returns message bytes, which stagerun's frame decoder takes as it takes TCP
bytes.

The server is trio-websocket's: its message size limit is raised to the largest frame the codec
accepts, its receive buffer to 256 KiB (a 1-token f32 frame is ~2.4 KB; a prefill chunk of 256
tokens ~600 KB), and it keeps a few messages queued so a stage's reader never stalls the socket.
The client speaks the same protocol through wsproto (which trio-websocket is built on), driven
by the lane's own reads: trio-websocket's client needs a nursery that outlives the connection
to run its reader task, while a lane is an object in a pool. This way a websocket lane needs no
background task and is cancel-safe exactly like a TCP one: a cancelled ``receive_some`` loses
nothing, because bytes read from the socket are parsed before the next checkpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio
import trio_websocket
import wsproto
from wsproto import events as ws_events
from wsproto.connection import ConnectionState
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from .._errors import LaneHandshakeError
from .._proto import DEFAULT_MAX_PAYLOAD_BYTES
from .._proto._frames import MAX_HEADER_BYTES, PREFIX_SIZE
from .._wire._address import format_address
from .._wire._framed import socket_is_idle
from ..abc import ConnectionHandler, Transport
from ._tcp import open_tcp
from ._tls import TlsStream, client_context, server_context

__all__ = ["WebSocketTransport"]

MAX_MESSAGE_BYTES = PREFIX_SIZE + MAX_HEADER_BYTES + DEFAULT_MAX_PAYLOAD_BYTES
RECEIVE_BUFFER_BYTES = 256 * 1024
SERVER_MESSAGE_QUEUE = 8
LANE_PATH = "/stagerun/lane"
# An upgrade must complete, and a closing peer answer the close, within these (seconds); an
# idle pooled lane is not read until it is checked out, so its close reply may never come.
CONNECT_TIMEOUT = 10.0
DISCONNECT_TIMEOUT = 2.0


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


class _ServerStream(trio.abc.Stream):
    """An accepted trio-websocket connection as a stream of message bytes."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._leftover = b""
        self._eof = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._ws.send_message(bytes(data))
        except trio_websocket.ConnectionClosed as exc:
            raise trio.BrokenResourceError("the websocket is closed") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._leftover and not self._eof:
            try:
                message = await self._ws.get_message()
            except trio_websocket.ConnectionClosed:
                self._eof = True
            else:
                if isinstance(message, str):
                    await self._ws.aclose(code=1003, reason="stagerun lanes carry binary frames")
                    raise trio.BrokenResourceError("the peer sent a text message on a lane")
                self._leftover = message
        else:
            await trio.lowlevel.checkpoint()
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
        self._control = bytearray()  # pongs and close replies to send with the next write
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
            out = self._ws.send(ws_events.BytesMessage(data=bytes(data)))
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
            if self._ws.state is ConnectionState.OPEN:
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    await self._stream.send_all(
                        bytes(self._control) + self._ws.send(ws_events.CloseConnection(code=1000))
                    )
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
        """Accept websocket lanes on ``address``; each one runs ``handler(stream, peer)``."""
        host, port, path = parse_ws_address(address)
        ssl_context = server_context() if self.secure else None

        async def handle(request: trio_websocket.WebSocketRequest) -> None:
            if request.path != path:
                await request.reject(404, body=f"stagerun lanes are served at {path}".encode())
                return
            ws = await request.accept()
            remote = ws.remote
            peer = (
                format_address(self.schemes[0], str(remote.address), remote.port)
                if isinstance(remote, trio_websocket.Endpoint)
                else "ws://<unknown>"
            )
            stream = _ServerStream(ws)
            try:
                await handler(stream, peer)
            finally:
                # The client answers a close only when it next reads or writes: an idle pooled
                # lane may never answer, so the close is bounded.
                with trio.move_on_after(DISCONNECT_TIMEOUT) as scope:
                    scope.shield = True
                    await ws.aclose()

        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: trio_websocket.serve_websocket(
                    handle,
                    host,
                    port,
                    ssl_context,
                    message_queue_size=SERVER_MESSAGE_QUEUE,
                    max_message_size=MAX_MESSAGE_BYTES,
                    receive_buffer_size=RECEIVE_BUFFER_BYTES,
                    connect_timeout=CONNECT_TIMEOUT,
                    disconnect_timeout=DISCONNECT_TIMEOUT,
                    task_status=task_status,
                )
            )
            bound = server.port
            suffix = "" if path == LANE_PATH else path
            task_status.started(format_address(self.schemes[0], host, bound) + suffix)


class SecureWebSocketTransport(WebSocketTransport):
    """Lanes over websockets on TLS: ``wss://HOST:PORT[/PATH]``.

    Certificates as for ``tls://`` (`stagerun.transports._tls`): the stage serves with
    ``$STAGERUN_TLS_CERT``/``$STAGERUN_TLS_KEY``, a connecting stage trusts ``$STAGERUN_TLS_CA``.
    """

    schemes: ClassVar[tuple[str, ...]] = ("wss",)
    secure: ClassVar[bool] = True

    def __repr__(self) -> str:
        return "<SecureWebSocketTransport>"
