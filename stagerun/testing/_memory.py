"""An in-process transport: lanes over in-memory streams, for tests that need no sockets.

Theory of operation: ``serve("mem://NAME", handler)`` registers NAME in a process-wide table
of listeners for as long as it runs; ``connect("mem://NAME")`` looks NAME up, makes a connected
pair of `MemoryStream` ends, starts ``handler(server_end, peer)`` as a task of the serving
nursery (so a handler's crash crashes ``serve``, as with trio's ``serve_listeners``), and
returns the client end. NAME ``0`` or nothing picks a fresh unique name, reported through
``task_status.started``, like port 0 for TCP.

Each direction of a pair is an unbounded byte buffer: ``send_all`` appends the whole write at
once and never waits for the reader, so two peers that both send a large frame before reading
cannot deadlock (a bounded in-memory pipe would), and a frame is never torn by a cancel: it
is either written whole or not at all. ``receive_some`` checks for cancellation before it
takes any bytes and takes them without a checkpoint afterwards, so it is cancel-safe.
"""

from __future__ import annotations

import itertools
import operator
from typing import ClassVar

import trio

from .._errors import LaneHandshakeError
from ..abc import ConnectionHandler, Transport

__all__ = ["MemoryStream", "MemoryTransport", "memory_stream_pair", "parse_memory_address"]

_SCHEME = "mem"


def parse_memory_address(address: str) -> str:
    """Return the NAME of ``mem://NAME`` (empty for ``mem://``).

    Raises:
        ValueError: the address is not a ``mem://`` address.
    """
    scheme, sep, name = address.partition("://")
    if not sep or scheme != _SCHEME or "/" in name:
        raise ValueError(f"memory transport address {address!r} must look like mem://NAME")
    return name


class _Pipe:
    """One direction of a pair: an unbounded buffer, written by one end and read by the other."""

    __slots__ = ("data", "lot", "reader_closed", "writer_closed")

    def __init__(self) -> None:
        self.data = bytearray()
        self.writer_closed = False  # the reader sees EOF once the data is drained
        self.reader_closed = False  # the writer's next send_all is a broken pipe
        self.lot = trio.lowlevel.ParkingLot()


class MemoryStream(trio.abc.Stream):
    """One end of an in-memory connection (see `memory_stream_pair`).

    Follows trio's stream conventions: ``receive_some`` returns ``b""`` once the peer closed
    and everything it sent was read; ``send_all`` to a peer that closed raises
    `trio.BrokenResourceError`; using a closed end raises `trio.ClosedResourceError`.
    """

    def __init__(self, incoming: _Pipe, outgoing: _Pipe, *, name: str) -> None:
        self.name = name
        self._incoming = incoming
        self._outgoing = outgoing
        self._closed = False
        self._sending = False
        self._receiving = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MemoryStream {self.name} {state} unread={len(self._incoming.data)}>"

    def is_live(self) -> bool:
        """True while idle and healthy: open, peer still there, no unsolicited bytes waiting."""
        pipe = self._incoming
        return not (self._closed or pipe.data or pipe.writer_closed or self._outgoing.reader_closed)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            await trio.lowlevel.checkpoint()
            if self._closed:
                raise trio.ClosedResourceError("this end of the memory stream is closed")
            pipe = self._outgoing
            if pipe.reader_closed:
                raise trio.BrokenResourceError("the peer closed the memory stream")
            if data:
                pipe.data += data
                pipe.lot.unpark_all()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("this end of the memory stream is closed")

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)  # TypeError for a float, as trio's streams
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._receiving = True
        try:
            pipe = self._incoming
            if self._closed:
                await trio.lowlevel.checkpoint()
                raise trio.ClosedResourceError("this end of the memory stream is closed")
            if pipe.data or pipe.writer_closed:
                # Cancellation is checked before any byte is taken: a cancelled call loses nothing.
                await trio.lowlevel.checkpoint()
            while not pipe.data and not pipe.writer_closed and not self._closed:
                await pipe.lot.park()
            if self._closed:
                raise trio.ClosedResourceError("this end of the memory stream was closed")
            size = len(pipe.data) if max_bytes is None else min(max_bytes, len(pipe.data))
            chunk = bytes(pipe.data[:size])
            del pipe.data[:size]
            return chunk
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._outgoing.writer_closed = True
            self._outgoing.lot.unpark_all()
            self._incoming.reader_closed = True
            self._incoming.data.clear()
            self._incoming.lot.unpark_all()  # a receive_some of ours in another task fails
        await trio.lowlevel.checkpoint()


def memory_stream_pair(name: str = "memory") -> tuple[MemoryStream, MemoryStream]:
    """A connected pair of `MemoryStream` ends: ``(client, server)``.

    Unlike `trio.testing.memory_stream_pair`, each end also has ``is_live()``, the probe
    stagerun uses on idle pooled lanes.
    """
    up, down = _Pipe(), _Pipe()
    return (
        MemoryStream(down, up, name=f"{name} (client end)"),
        MemoryStream(up, down, name=f"{name} (server end)"),
    )


class _Listener:
    __slots__ = ("handler", "nursery", "token")

    def __init__(
        self, handler: ConnectionHandler, nursery: trio.Nursery, token: trio.lowlevel.TrioToken
    ) -> None:
        self.handler = handler
        self.nursery = nursery
        self.token = token


class MemoryTransport(Transport):
    """Lanes between Trio tasks of one process: ``mem://NAME``.

    A drop-in for `stagerun.transports.TcpTransport` in tests: every stage of a pipeline can
    run in one Trio run with no sockets at all. Names are shared by every instance in the
    process; a name is served by one ``serve`` at a time.
    """

    schemes: ClassVar[tuple[str, ...]] = (_SCHEME,)
    _listeners: ClassVar[dict[str, _Listener]] = {}
    _names: ClassVar[itertools.count[int]] = itertools.count(1)
    _clients: ClassVar[itertools.count[int]] = itertools.count(1)

    def __repr__(self) -> str:
        return f"<MemoryTransport serving={sorted(self._listeners)}>"

    def local_address(self, host: str) -> str:
        """``mem://0``: a fresh name (there is no host)."""
        return f"{_SCHEME}://0"

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        """Connect to the ``serve`` running under ``address``'s name (never waits).

        Raises:
            LaneHandshakeError: nothing serves that name in this Trio run.
        """
        await trio.lowlevel.checkpoint()
        name = parse_memory_address(address)
        listener = self._listeners.get(name)
        if listener is None:
            raise LaneHandshakeError(
                f"could not connect to {address}: nothing is serving that name in this process"
            )
        if listener.token is not trio.lowlevel.current_trio_token():
            raise LaneHandshakeError(
                f"could not connect to {address}: it is served by another Trio run"
            )
        client_id = next(self._clients)
        client, server = memory_stream_pair(f"{address} #{client_id}")
        listener.nursery.start_soon(listener.handler, server, f"mem://client-{client_id}")
        return client

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``address``'s name until cancelled; ``mem://0`` picks a fresh name.

        Raises:
            OSError: the name is already being served (like a port already bound).
        """
        name = parse_memory_address(address)
        if name in ("", "0"):
            name = f"anon-{next(self._names)}"
            while name in self._listeners:
                name = f"anon-{next(self._names)}"
        if name in self._listeners:
            raise OSError(f"mem://{name} is already being served")
        async with trio.open_nursery() as nursery:
            self._listeners[name] = _Listener(handler, nursery, trio.lowlevel.current_trio_token())
            try:
                task_status.started(f"{_SCHEME}://{name}")
                await trio.sleep_forever()
            finally:
                del self._listeners[name]
