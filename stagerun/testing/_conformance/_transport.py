"""The transport conformance suite (`check_transport`)."""

from __future__ import annotations

import contextlib
import math
import tracemalloc

import attrs
import numpy as np
import trio
import trio.testing

from ... import _proto
from ..._errors import LaneBrokenError, LaneHandshakeError
from ..._util import first_leaf
from ..._wire._framed import FrameStream, client_handshake, server_handshake
from ...abc import Transport
from ._common import (
    _RECEIVE_SIZE,
    _Check,
    _checking,
    _first_assertion,
)
from ._wire import _large_frame, _probes, _receive_frames, _same, _send_frames, _small_frames


@attrs.define
class _Accepted:
    stream: trio.abc.Stream
    peer: object
    done: trio.Event = attrs.field(factory=trio.Event)


_UNREAD_BYTES = 256 << 20  # written to a peer that reads nothing, in the bounds check
DEFAULT_MAX_FRAME_BYTES = 8192 * 576 * 4
"""The largest activation payload the default model sends (a whole context of SmolLM2's
576-wide float32 rows: 18 MiB)."""


class _TransportChecks:
    def __init__(
        self,
        transport: Transport,
        address: str,
        timeout: float,
        max_frame_bytes: int,
        bounded: bool,
    ) -> None:
        self.bounded = bounded
        self.transport = transport
        self.address = address
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self.bound = ""
        self._accepted_in, self._accepted = trio.open_memory_channel[_Accepted](math.inf)
        self._opened: list[trio.abc.Stream] = []  # closed at the end, whatever happened
        self._over = trio.Event()  # set when serve() overstays its cancel: handlers return

    def check(self, name: str) -> contextlib.AbstractContextManager[_Check]:
        return _checking("check_transport", name, self.timeout)

    async def handler(self, stream: trio.abc.Stream, peer: str) -> None:
        accepted = _Accepted(stream, peer)
        self._accepted_in.send_nowait(accepted)
        try:
            async with trio.open_nursery() as waiting:  # its check is done, or the suite is

                async def until(event: trio.Event) -> None:
                    await event.wait()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(until, accepted.done)
                waiting.start_soon(until, self._over)
        finally:
            await trio.aclose_forcefully(stream)

    async def run(self) -> None:
        with _checking("check_transport", "schemes") as check:
            schemes = getattr(self.transport, "schemes", None)
            if not (
                isinstance(schemes, tuple)
                and schemes
                and all(isinstance(s, str) and s for s in schemes)
            ):
                check.fail(f"schemes must be a non-empty tuple of strings, not {schemes!r}")
        try:
            await self._run_checks()
        finally:
            with trio.CancelScope(shield=True):  # a failed check leaves no socket open
                for stream in self._opened:
                    await trio.aclose_forcefully(stream)
                self._opened.clear()

    async def _run_checks(self) -> None:
        late = False
        try:
            async with trio.open_nursery() as watchdogs:
                async with trio.open_nursery() as nursery:
                    await self._start_serving(nursery)
                    await self._check_bytes()
                    await self._check_frames()
                    await self._check_connections_apart()
                    await self._check_cancel_safety()
                    await self._check_handshake()
                    await self._check_close()
                    if self.bounded:
                        await self._check_bounded()
                    # A client that holds an idle connection (a pooled lane) and reads nothing
                    # must not keep a cancelled serve() from returning.
                    idle, _accepted = await self._open()

                    async def watchdog() -> None:
                        nonlocal late
                        await trio.sleep(self.timeout)
                        late = True
                        await trio.aclose_forcefully(idle)
                        # a serve() that shields its handlers from cancellation waits for
                        # them: the suite's own return now, so the report comes, not a hang
                        self._over.set()

                    watchdogs.start_soon(watchdog)
                    nursery.cancel_scope.cancel(reason="check_transport: done with this server")
                watchdogs.cancel_scope.cancel()
            await trio.aclose_forcefully(idle)
        except BaseException as exc:
            found = _first_assertion(exc)
            if found is not None:
                raise found from None
            if not isinstance(exc, Exception):
                raise
            leaf = first_leaf(exc)
            raise AssertionError(
                f"check_transport: serve: serve() or the connection handler raised "
                f"{type(leaf).__name__}: {leaf}"
            ) from exc
        if late:
            raise AssertionError(
                f"check_transport: serve stops when cancelled: serve() did not return within "
                f"{self.timeout:g}s of being cancelled while a client held an idle connection "
                "(it returned only once that client closed, or its handlers were made to "
                "return: does it shield them from cancellation?)"
            )
        await self._check_dead_address()

    async def _start_serving(self, nursery: trio.Nursery) -> None:
        with self.check("serve reports its address") as check:
            try:
                bound = await nursery.start(self.transport.serve, self.address, self.handler)
            except RuntimeError as exc:
                check.fail(f"serve() returned without calling task_status.started(address): {exc}")
            if not isinstance(bound, str):
                check.fail(f"serve() reported {bound!r}; it must report the address as a str")
            scheme, sep, _rest = bound.partition("://")
            if not sep or scheme not in self.transport.schemes:
                check.fail(
                    f"serve() reported {bound!r}, which is not a "
                    f"{'/'.join(self.transport.schemes)}:// address; report the address clients "
                    "should dial"
                )
            if self.address.endswith(":0") and bound.endswith(":0"):
                check.fail(f"serve() reported {bound!r}: report the port really bound, not 0")
            self.bound = bound

    async def _open(self) -> tuple[trio.abc.Stream, _Accepted]:
        with self.check("connect") as check:
            client = await self.transport.connect(self.bound, timeout=self.timeout)
            self._opened.append(client)
            for method in ("send_all", "receive_some", "aclose"):
                if not callable(getattr(client, method, None)):
                    check.fail(f"connect() returned {client!r}, which has no {method}()")
        with self.check("the handler runs for each connection") as check:
            check.progress = f"connected to {self.bound}, but serve() never called the handler"
            accepted = await self._accepted.receive()
            self._opened.append(accepted.stream)
            if not isinstance(accepted.peer, str) or not accepted.peer:
                check.fail(f"the handler was given peer {accepted.peer!r}; name the other end")
        return client, accepted

    async def _finish(self, client: trio.abc.Stream, accepted: _Accepted) -> None:
        await trio.aclose_forcefully(client)
        accepted.done.set()

    async def _check_bytes(self) -> None:
        client, accepted = await self._open()
        data = b"stagerun conformance bytes " * 40
        for name, sender, receiver in (
            ("bytes client to server", client, accepted.stream),
            ("bytes server to client", accepted.stream, client),
        ):
            with self.check(name) as check:
                await sender.send_all(data)
                got = bytearray()
                while len(got) < len(data):
                    check.progress = f"received {len(got)} of {len(data)} bytes"
                    chunk = await receiver.receive_some(7)
                    if not chunk:
                        check.fail(f"the stream ended after {len(got)} of {len(data)} bytes")
                    if len(chunk) > 7:
                        check.fail(f"receive_some(7) returned {len(chunk)} bytes")
                    got += chunk
                if got != data:
                    check.fail("the bytes received differ from the bytes sent")
        await self._finish(client, accepted)

    async def _check_frames(self) -> None:
        client, accepted = await self._open()
        sizes = sorted({1 << 20, (2 << 20) + 1, self.max_frame_bytes})
        cases = [("many small frames", _small_frames(300))]
        cases += [(f"a frame of {size:,} payload bytes", [_large_frame(size)]) for size in sizes]
        for name, frames in cases:
            # Both directions at once: a transport must be full duplex, and a bounded one would
            # deadlock if both ends sent a big frame before reading.
            with self.check(f"{name}, both ways at once") as check:
                async with trio.open_nursery() as nursery:
                    for sender, receiver, way in (
                        (client, accepted.stream, "client to server"),
                        (accepted.stream, client, "server to client"),
                    ):
                        nursery.start_soon(_send_frames, sender, frames)
                        nursery.start_soon(_receive_frames, receiver, frames, check, way)
        await self._finish(client, accepted)

    async def _check_connections_apart(self) -> None:
        opened = [await self._open() for _ in range(3)]
        with self.check("connections are kept apart") as check:
            for i, (client, _accepted) in enumerate(opened):
                await client.send_all(f"connection {i}".encode())
            for i, (_client, accepted) in enumerate(opened):
                expected = f"connection {i}".encode()
                got = bytearray()
                while len(got) < len(expected):
                    chunk = await accepted.stream.receive_some(_RECEIVE_SIZE)
                    if not chunk:
                        check.fail(f"connection {i} ended early")
                    got += chunk
                if got != expected:
                    check.fail(f"the handler of connection {i} received {bytes(got)!r}")
        for client, accepted in opened:
            await self._finish(client, accepted)

    async def _check_cancel_safety(self) -> None:
        client, accepted = await self._open()
        sent, got = bytearray(), bytearray()
        with self.check("receive_some is cancel-safe") as check:
            # 1. A receive cancelled while nothing is there.
            for _ in range(3):
                with trio.move_on_after(0.02):
                    got += await client.receive_some(_RECEIVE_SIZE)
            for i in range(8):
                chunk = bytes([i]) * (1000 + i)
                # 2. Data arrives just as the waiting receive is cancelled: it is either
                #    returned or left for the next call, never lost.
                async with trio.open_nursery() as nursery:
                    scope = trio.CancelScope()

                    async def receive(
                        scope: trio.CancelScope = scope, got: bytearray = got
                    ) -> None:
                        with scope:
                            got += await client.receive_some(_RECEIVE_SIZE)

                    nursery.start_soon(receive)
                    await trio.testing.wait_all_tasks_blocked(0.01)
                    await accepted.stream.send_all(chunk)
                    sent += chunk
                    scope.cancel()
                # 3. Data waits while a receive runs in an already cancelled scope.
                await accepted.stream.send_all(chunk)
                sent += chunk
                await trio.testing.wait_all_tasks_blocked(0.01)
                with trio.CancelScope() as cancelled:
                    cancelled.cancel()
                    got += await client.receive_some(_RECEIVE_SIZE)
            # Everything was sent already: what does not come soon was lost.
            with trio.move_on_after(self.timeout / 2):
                while len(got) < len(sent):
                    data = await client.receive_some(_RECEIVE_SIZE)
                    if not data:
                        check.fail(f"the stream ended after {len(got)} of {len(sent)} bytes")
                    got += data
            if got != sent:
                check.fail(
                    f"bytes were lost or reordered around cancelled receive_some() calls: "
                    f"received {len(got)} bytes, which differ from the {len(sent)} sent"
                )
        await self._finish(client, accepted)

    async def _check_handshake(self) -> None:
        client, accepted = await self._open()
        with self.check("stagerun handshake and frames over it") as check:
            result: list[tuple[FrameStream, _proto.Hello]] = []

            async def serve_side() -> None:
                result.append(await server_handshake(accepted.stream, peer=str(accepted.peer)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_side)
                lane = await client_handshake(
                    client, peer=self.bound, role=_proto.Role.LANE, ready_timeout=self.timeout
                )
            server, hello = result[0]
            if hello.role != _proto.Role.LANE:
                check.fail(f"the server read a hello for role {hello.role!r}, not LANE")
            decode = _proto.Decode(request_id=7, position=3, tokens=(5,))
            activations = np.arange(64, dtype=np.float32).reshape(1, 64)
            await lane.send(decode, activations)
            frame = await server.receive()
            if frame.message != decode or not _same(frame.activations, activations):
                check.fail(f"a frame sent after the handshake arrived as {frame!r}")
            await server.send(_proto.Ack(request_id=7))
            if (await lane.receive()).message != _proto.Ack(request_id=7):
                check.fail("the reply to a frame sent after the handshake arrived changed")
        await self._finish(client, accepted)

    async def _check_close(self) -> None:
        client, accepted = await self._open()
        with self.check("an idle connection is live") as check:
            await trio.testing.wait_all_tasks_blocked(0.01)
            if _probes(client) and not FrameStream(client, peer=self.bound).is_live():
                check.fail("is_live() is False on a healthy idle connection")
        with self.check("closing the client end is seen by the server") as check:
            await client.aclose()
            try:
                data = await accepted.stream.receive_some(_RECEIVE_SIZE)
            except trio.BrokenResourceError:
                data = b""
            if data:
                check.fail(f"the server received {data[:40]!r} after the client closed")
        accepted.done.set()

        client, accepted = await self._open()
        with self.check("closing the server end is seen by the client") as check:
            lane = FrameStream(client, peer=self.bound)
            # A graceful close may wait for the peer's part (a websocket closing handshake), so
            # the server closes in the background while the client does what a lane would.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accepted.stream.aclose)
                if _probes(client):
                    check.progress = "is_live() stayed True after the server closed"
                    while lane.is_live():  # noqa: ASYNC110 (a synchronous probe: nothing to await)
                        await trio.sleep(0.01)
                check.progress = "the client saw neither EOF nor an error after the server closed"
                try:
                    frame = await lane.receive()
                except LaneBrokenError:
                    pass
                else:
                    check.fail(f"the client received {frame!r} after the server closed")
                check.progress = "the server's aclose() did not return once the client closed"
                await lane.aclose()
        await self._finish(client, accepted)

    async def _check_bounded(self) -> None:
        """What the peer does not read stays bounded: a write blocks, or memory stays flat.

        The client writes compressible bytes (zeros: what an inflating transport turns a
        little into a lot from) while the server reads nothing. A kernel socket buffer
        blocks the writer; a transport that takes in, or inflates into, an unbounded buffer
        of its own grows this process's Python memory, which tracemalloc sees.
        """
        client, accepted = await self._open()
        with self.check("what a peer does not read is bounded") as check:
            tracing = tracemalloc.is_tracing()
            if not tracing:
                tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                chunk, sent = bytes(1 << 20), 0
                with trio.move_on_after(min(self.timeout / 2, 2.0)):
                    while sent < _UNREAD_BYTES:
                        await client.send_all(chunk)
                        sent += len(chunk)
                await trio.sleep(0.1)  # a receiving side that inflates in the background
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                if not tracing:
                    tracemalloc.stop()
            if grown > _UNREAD_BYTES // 4:
                check.fail(
                    f"{sent >> 20} MiB written that the peer never read grew this process by "
                    f"{grown >> 20} MiB: bound what a connection buffers (and inflates) for a "
                    "peer that does not read, so that a slow or hostile peer blocks the "
                    "writer instead"
                )
        await self._finish(client, accepted)

    async def _check_dead_address(self) -> None:
        limit = min(self.timeout, 2.0)
        with _checking("check_transport", "connect to a dead address", limit + 2.0) as check:
            check.progress = f"connect(timeout={limit:g}) did not give up in time"
            try:
                stream = await self.transport.connect(self.bound, timeout=limit)
            except LaneHandshakeError as exc:
                where = self.bound.partition("://")[2]
                if where not in str(exc):
                    check.fail(f"the LaneHandshakeError should name the address: {exc}")
            else:
                await trio.aclose_forcefully(stream)
                check.fail(f"connect() to {self.bound} succeeded after serve() was cancelled")


async def check_transport(
    transport: Transport,
    address: str | None = None,
    *,
    timeout: float = 10.0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    bounded: bool = True,
) -> None:
    """Check that ``transport`` can carry stagerun lanes.

    Serves on ``address`` (a free port or name: ``tcp://127.0.0.1:0``, ``mem://0``; by
    default the transport's ``local_address("127.0.0.1")``) and checks that: ``serve``
    reports a dialable address of one of its schemes; ``connect`` reaches the handler, with
    a peer name, and connections are kept apart; bytes and whole frames (many small ones,
    and ones of 1 MiB, 2 MiB + 1 byte and ``max_frame_bytes`` of activations, both ways at
    once) arrive intact and in order
    through stagerun's frame decoder, each ``send_all`` whole; ``receive_some(n)`` returns at
    most n bytes and is cancel-safe; stagerun's handshake works over it; closing one end is
    seen by the other (``b""``, then `stagerun.LaneBrokenError` from a lane); ``is_live``
    tells live from dead where the stream can be probed; a cancelled ``serve`` returns even
    while a client holds an idle connection; and then ``connect`` to its address raises
    `stagerun.LaneHandshakeError` naming it, in time.

    Args:
        transport: the transport instance under test.
        address: where to serve; None asks the transport (``local_address``).
        timeout: the deadline of each check, in seconds.
        max_frame_bytes: the largest activation payload the transport will carry (default:
            the default model's largest, a whole context of activations: 18 MiB).
        bounded: check that bytes a peer does not read stay bounded (256 MiB of zeros
            written must block, or not grow the process by more than 64 MiB). False only
            for a transport unbounded by design, as the test-only `MemoryTransport` is.

    Whatever the outcome, every connection the suite opened is closed before it returns.

    Raises:
        AssertionError: a check failed; the message names it.
    """
    if address is None:
        local_address = getattr(transport, "local_address", None)
        address = local_address("127.0.0.1") if callable(local_address) else "tcp://127.0.0.1:0"
    checks = _TransportChecks(transport, str(address), timeout, max_frame_bytes, bounded)
    await checks.run()


# --- backends ---------------------------------------------------------------------------------

"""``factory(model, layers)`` returns a `stagerun.abc.ComputeBackend` for ``layers``."""
