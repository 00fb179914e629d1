"""A stage's accepted connections: which to close when a limit is reached, or when idle.

`ConnectionTable` is bookkeeping only (`stagerun._stage._server.StageServer` closes what it
names): connections in their handshake, oldest first, and all connections, quietest first.
`TrackedStream` wraps an accepted stream so that every byte it carries marks it active.
`connect_downstream` opens a lane's hop to the next stage, with the stage's own secret and
deadlines (`StageConfig`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import trio

from .. import _proto
from .._engine._config import StageConfig
from .._errors import LaneHandshakeError
from .._wire._connect import open_connection
from .._wire._framed import FrameStream

__all__ = ["Connection", "ConnectionTable", "TrackedStream", "connect_downstream"]


@attrs.define(eq=False)
class Connection:
    """One accepted connection: when it last carried a byte, and the scope that closes it."""

    peer: str
    last_active: float
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    in_use: Callable[[], bool] = lambda: False  # quiet, but not idle (see _close_idle_connections)


class ConnectionTable:
    """A stage's open connections, quietest first; it decides which to close to make room.

    Bookkeeping only: `admit` says which connections to close, the server closes them.
    """

    def __init__(self, *, max_connections: int, max_handshakes: int) -> None:
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self._quiet: dict[Connection, None] = {}  # least recently active first
        self._handshaking: dict[Connection, None] = {}  # oldest first

    def __repr__(self) -> str:
        return (
            f"<ConnectionTable open={len(self._quiet)}/{self.max_connections} "
            f"handshaking={len(self._handshaking)}/{self.max_handshakes}>"
        )

    def __len__(self) -> int:
        return len(self._quiet)

    @property
    def handshaking(self) -> int:
        return len(self._handshaking)

    def admit(self, conn: Connection) -> list[tuple[Connection, str]]:
        """Add a new connection, in its handshake; the ones to close for room, and why."""
        victims: list[tuple[Connection, str]] = []
        while len(self._handshaking) >= self.max_handshakes:
            oldest = next(iter(self._handshaking))
            victims.append((oldest, f"over {self.max_handshakes} handshakes in progress"))
            self.discard(oldest)
        while len(self._quiet) >= self.max_connections:
            # A handshake in progress costs no honest peer its lane; else the quietest goes.
            quietest = next(iter(self._handshaking), None) or next(iter(self._quiet))
            victims.append((quietest, f"over {self.max_connections} connections open"))
            self.discard(quietest)
        self._quiet[conn] = None
        self._handshaking[conn] = None
        return victims

    def established(self, conn: Connection) -> None:
        """``conn`` finished its handshake."""
        self._handshaking.pop(conn, None)

    def touch(self, conn: Connection, now: float) -> None:
        """``conn`` carried bytes at ``now``: it is the least quiet now."""
        if conn in self._quiet:  # not once it is closed
            del self._quiet[conn]
            self._quiet[conn] = None  # to the end: dicts keep insertion order
            conn.last_active = now

    def discard(self, conn: Connection) -> None:
        self._quiet.pop(conn, None)
        self._handshaking.pop(conn, None)

    def quietest(self) -> Connection | None:
        return next(iter(self._quiet), None)

    def quiet_since(self, cutoff: float) -> list[Connection]:
        """The connections that carried nothing after ``cutoff``, quietest first."""
        return list(itertools.takewhile(lambda conn: conn.last_active <= cutoff, self._quiet))


class TrackedStream(trio.abc.Stream):
    """An accepted stream that tells its stage's `ConnectionTable` when it carries bytes.

    The stage never probes the connections it accepted (`FrameStream.is_live` is for those
    a peer opened), so this passes on only what a stream must have.
    """

    def __init__(self, stream: trio.abc.Stream, conn: Connection, table: ConnectionTable):
        self._stream = stream
        self._conn = conn
        self._table = table

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._table.touch(self._conn, trio.current_time())
        await self._stream.send_all(data)
        self._table.touch(self._conn, trio.current_time())

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._stream.receive_some(max_bytes)
        self._table.touch(self._conn, trio.current_time())
        return data

    async def aclose(self) -> None:
        await self._stream.aclose()


async def connect_downstream(config: StageConfig) -> FrameStream:
    """Open a lane's hop to the next stage, with the stage's secret and deadlines, retrying
    while the next stage is still starting."""
    assert config.downstream is not None
    deadline = trio.current_time() + config.downstream_retry_window
    while True:
        try:
            return await open_connection(
                config.downstream,
                role=_proto.Role.LANE,
                connect_timeout=config.downstream_connect_timeout,
                ready_timeout=config.downstream_ready_timeout,
                link=config.link,
                secret=config.resolve_secret(),
            )
        except LaneHandshakeError:
            if trio.current_time() >= deadline:
                raise
            await trio.sleep(0.1)
