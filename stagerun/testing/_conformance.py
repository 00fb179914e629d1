"""Conformance suites for plugins: what a transport, a backend or a drafter must do.

A plugin author calls these from their own tests, as stagerun does for its built-ins::

    async def test_my_transport() -> None:
        await check_transport(MyTransport(), "myscheme://127.0.0.1:0")

    def test_my_backend(model: ModelFile) -> None:
        check_backend(MyBackend, model)

    def test_my_drafter() -> None:
        check_drafter(MyDrafter)

Theory of operation: each suite runs a fixed list of named checks against the plugin through
its public interface only (`stagerun.abc`), using stagerun's own frame codec and handshake
where the runtime would. The first check that fails raises `AssertionError` whose message
starts with the suite and the check's name (``check_transport: a 1 MiB frame, both ways at
once: ...``) and says what was expected; an unexpected exception inside a check is reported the same way (chained), and
so is a hang: every transport check runs under a deadline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs
import numpy as np
import trio
import trio.testing

from .. import _proto
from .._errors import ComputeCancelled, LaneBrokenError, LaneHandshakeError, ProtocolError
from .._framed import FrameStream, client_handshake, server_handshake
from ..abc import Transport

__all__ = ["check_backend", "check_drafter", "check_transport"]

_RECEIVE_SIZE = 1 << 18  # what stagerun's lanes ask receive_some for


# --- shared machinery -------------------------------------------------------------------------


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _first_assertion(exc: BaseException) -> AssertionError | None:
    return next((e for e in _leaves(exc) if isinstance(e, AssertionError)), None)


@attrs.define
class _Check:
    """One named check in progress; ``progress`` says how far it got (for a hang)."""

    suite: str
    name: str
    progress: str = ""

    def fail(self, detail: str) -> NoReturn:
        raise AssertionError(f"{self.suite}: {self.name}: {detail}")


@contextlib.contextmanager
def _checking(suite: str, name: str, timeout: float | None = None) -> Iterator[_Check]:
    """Run a check; anything but an AssertionError becomes one that names the check."""
    check = _Check(suite, name)
    try:
        if timeout is None:
            yield check
        else:
            with trio.fail_after(timeout):
                yield check
    except trio.TooSlowError as exc:
        so_far = f" ({check.progress})" if check.progress else ""
        check_failed = AssertionError(
            f"{suite}: {name}: did not finish within {timeout:g}s{so_far}"
        )
        raise check_failed from exc
    except BaseException as exc:
        found = _first_assertion(exc)
        if found is not None:
            if found is exc:
                raise
            raise found from None
        if not isinstance(exc, Exception):
            raise
        leaf = _leaves(exc)[0]
        raise AssertionError(f"{suite}: {name}: raised {type(leaf).__name__}: {leaf}") from exc


# --- transports -------------------------------------------------------------------------------


@attrs.define
class _Accepted:
    stream: trio.abc.Stream
    peer: object
    done: trio.Event = attrs.field(factory=trio.Event)


class _TransportChecks:
    def __init__(self, transport: Transport, address: str, timeout: float) -> None:
        self.transport = transport
        self.address = address
        self.timeout = timeout
        self.bound = ""
        self._accepted_in, self._accepted = trio.open_memory_channel[_Accepted](math.inf)

    def check(self, name: str) -> contextlib.AbstractContextManager[_Check]:
        return _checking("check_transport", name, self.timeout)

    async def handler(self, stream: trio.abc.Stream, peer: str) -> None:
        accepted = _Accepted(stream, peer)
        self._accepted_in.send_nowait(accepted)
        try:
            await accepted.done.wait()
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
                    # A client that holds an idle connection (a pooled lane) and reads nothing
                    # must not keep a cancelled serve() from returning.
                    idle, _accepted = await self._open()

                    async def watchdog() -> None:
                        nonlocal late
                        await trio.sleep(self.timeout)
                        late = True
                        await trio.aclose_forcefully(idle)

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
            leaf = _leaves(exc)[0]
            raise AssertionError(
                f"check_transport: serve: serve() or the connection handler raised "
                f"{type(leaf).__name__}: {leaf}"
            ) from exc
        if late:
            raise AssertionError(
                f"check_transport: serve stops when cancelled: serve() did not return within "
                f"{self.timeout:g}s of being cancelled while a client held an idle connection "
                "(it returned only once that client closed)"
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
                    f"serve() reported {bound!r}, which is not a {'/'.join(self.transport.schemes)}:// "
                    "address; report the address clients should dial"
                )
            if self.address.endswith(":0") and bound.endswith(":0"):
                check.fail(f"serve() reported {bound!r}: report the port really bound, not 0")
            self.bound = bound

    async def _open(self) -> tuple[trio.abc.Stream, _Accepted]:
        with self.check("connect") as check:
            client = await self.transport.connect(self.bound, timeout=self.timeout)
            for method in ("send_all", "receive_some", "aclose"):
                if not callable(getattr(client, method, None)):
                    check.fail(f"connect() returned {client!r}, which has no {method}()")
        with self.check("the handler runs for each connection") as check:
            check.progress = f"connected to {self.bound}, but serve() never called the handler"
            accepted = await self._accepted.receive()
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
        small = _small_frames(300)
        large = [_large_frame()]
        for name, frames in (("many small frames", small), ("a 1 MiB frame", large)):
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


def _same(got: np.ndarray[Any, Any] | None, sent: np.ndarray[Any, Any] | None) -> bool:
    if got is None or sent is None:
        return got is None and sent is None
    return bool(np.array_equal(got, sent))


def _probes(stream: trio.abc.Stream) -> bool:
    """Whether stagerun can tell a dead idle connection of this stream from a live one."""
    return callable(getattr(stream, "is_live", None)) or hasattr(stream, "socket")


def _small_frames(count: int) -> list[tuple[_proto.Message, np.ndarray[Any, Any] | None]]:
    frames: list[tuple[_proto.Message, np.ndarray[Any, Any] | None]] = []
    for i in range(count):
        if i % 3 == 0:
            frames.append((_proto.Ack(request_id=i), None))
        else:
            row = np.full((1, 32), i, dtype=np.float32)
            frames.append((_proto.Decode(request_id=1, position=i, tokens=(i,)), row))
    return frames


def _large_frame() -> tuple[_proto.Message, np.ndarray[Any, Any] | None]:
    activations = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
    prefill = _proto.Prefill(
        request_id=2, chunk_index=0, position=0, tokens=tuple(range(256)), predict=True
    )
    return prefill, activations


async def _send_frames(
    stream: trio.abc.Stream, frames: list[tuple[_proto.Message, np.ndarray[Any, Any] | None]]
) -> None:
    for message, activations in frames:
        await stream.send_all(_proto.encode_frame(message, activations))


async def _receive_frames(
    stream: trio.abc.Stream,
    frames: list[tuple[_proto.Message, np.ndarray[Any, Any] | None]],
    check: _Check,
    way: str,
) -> None:
    decoder = _proto.FrameDecoder()
    received = 0
    for i, (message, activations) in enumerate(frames):
        while True:
            try:
                frame = decoder.next_frame()
            except ProtocolError as exc:
                check.fail(f"{way}: frame {i} of {len(frames)} arrived malformed: {exc}")
            if isinstance(frame, _proto.Frame):
                break
            check.progress = f"{way}: frame {i} of {len(frames)}, {received} bytes so far"
            data = await stream.receive_some(_RECEIVE_SIZE)
            if not data:
                check.fail(f"{way}: the stream ended after {i} of {len(frames)} frames")
            received += len(data)
            decoder.receive_data(data)
        if frame.message != message or not _same(frame.activations, activations):
            check.fail(f"{way}: frame {i} of {len(frames)} arrived changed: {frame!r}")
    if decoder.pending_bytes:
        check.fail(f"{way}: {decoder.pending_bytes} bytes arrived after the last frame")


async def check_transport(
    transport: Transport, address: str | None = None, *, timeout: float = 10.0
) -> None:
    """Check that ``transport`` can carry stagerun lanes.

    Serves on ``address`` (a free port or name: ``tcp://127.0.0.1:0``, ``mem://0``; by
    default the transport's ``local_address("127.0.0.1")``) and checks that: ``serve``
    reports a dialable address of one of its schemes; ``connect`` reaches the handler, with
    a peer name, and connections are kept apart; bytes and whole
    frames (many small ones, and 1 MiB ones both ways at once) arrive intact and in order
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

    Raises:
        AssertionError: a check failed; the message names it.
    """
    if address is None:
        local_address = getattr(transport, "local_address", None)
        address = local_address("127.0.0.1") if callable(local_address) else "tcp://127.0.0.1:0"
    await _TransportChecks(transport, str(address), timeout).run()


# --- backends ---------------------------------------------------------------------------------

BackendFactory = Callable[..., Any]
"""``factory(model, layers)`` returns a `stagerun.abc.ComputeBackend` for ``layers``."""


def _relative_error(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    scale = max(float(np.abs(b).max()), 1e-6)
    return float(np.abs(a.astype(np.float64) - b).max() / scale)


class _BackendChecks:
    def __init__(self, factory: BackendFactory, model: Any, tolerance: float) -> None:
        self.factory = factory
        self.model = model
        self.tolerance = tolerance
        c = model.config
        self.n_layers, self.d_model, self.vocab = int(c.n_layers), int(c.d_model), int(c.vocab_size)
        rng = np.random.default_rng(1234)
        self.prompt = [int(t) for t in rng.integers(0, self.vocab, 12)]
        self.other = [int(t) for t in rng.integers(0, self.vocab, 12)]

    def check(self, name: str) -> contextlib.AbstractContextManager[_Check]:
        return _checking("check_backend", name)

    def build(self, lo: int, hi: int) -> Any:
        with self.check(f"build layers [{lo}, {hi})") as check:
            backend = self.factory(self.model, (lo, hi))
            layers = tuple(backend.layers)
            if layers != (lo, hi):
                check.fail(f"backend.layers is {layers}, not {(lo, hi)}")
            if bool(backend.is_first) != (lo == 0) or bool(backend.is_last) != (
                hi == self.n_layers
            ):
                check.fail(
                    f"is_first={backend.is_first} is_last={backend.is_last} for layers "
                    f"[{lo}, {hi}) of {self.n_layers}"
                )
            if backend.new_cache().length != 0:
                check.fail("new_cache() is not empty (its length is not 0)")
        return backend

    def outputs(self, check: _Check, out: Any, rows: int, last: bool, what: str) -> Any:
        width = self.vocab if last else self.d_model
        kind = "logits" if last else "hidden states"
        if not isinstance(out, np.ndarray):
            check.fail(f"{what} returned a {type(out).__name__}, not a numpy array")
        if out.dtype != np.float32:
            check.fail(f"{what} returned {kind} of dtype {out.dtype}, not float32")
        if out.shape != (rows, width):
            check.fail(f"{what} returned {kind} of shape {out.shape}, not {(rows, width)}")
        if not np.isfinite(out).all():
            check.fail(f"{what} returned {kind} that are not all finite")
        return out

    def run_chain(self, check: _Check, ranges: Sequence[tuple[int, int]]) -> Any:
        x: Any = None
        for lo, hi in ranges:
            backend = self.build(lo, hi)
            cache = backend.new_cache()
            last = hi == self.n_layers
            what = f"forward() of layers [{lo}, {hi})"
            if lo == 0:
                out = backend.forward(cache, 0, tokens=self.prompt, logits="all")
            else:
                sent = x.copy()
                out = backend.forward(cache, 0, hidden=x, logits="all")
                if not np.array_equal(sent, x):
                    check.fail(f"{what} modified the hidden states it was given")
            x = self.outputs(check, out, len(self.prompt), last, what)
            if cache.length != len(self.prompt):
                check.fail(
                    f"after {what} on {len(self.prompt)} tokens the cache length is {cache.length}"
                )
        return x

    def assert_close(self, check: _Check, got: Any, want: Any, what: str) -> None:
        error = _relative_error(got, want)
        if not error <= self.tolerance:
            check.fail(f"{what} differ by {error:.3g} (relative), more than {self.tolerance:g}")

    def run(self) -> None:
        n, prompt = self.n_layers, self.prompt
        with self.check("logits of one stage") as check:
            full = self.build(0, n)
            reference = self.run_chain(check, [(0, n)])
            last = self.outputs(
                check, full.forward(full.new_cache(), 0, tokens=prompt), 1, True, 'logits="last"'
            )
            self.assert_close(
                check, last, reference[-1:], 'logits="last" and the last row of "all"'
            )
        splits = []
        if n >= 2:
            splits.append([(0, n // 2), (n // 2, n)])
        if n >= 3:
            splits.append([(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)])
        for ranges in splits:
            with self.check(f"layer split {ranges}") as check:
                got = self.run_chain(check, ranges)
                self.assert_close(check, got, reference, "its last-stage logits and one stage's")
        with self.check("decode after prefill") as check:
            cache, k = full.new_cache(), len(prompt) // 2
            out = self.outputs(check, full.forward(cache, 0, tokens=prompt[:k]), 1, True, "prefill")
            self.assert_close(check, out, reference[k - 1 : k], f"prefill of {k} tokens")
            for pos in range(k, len(prompt)):
                what = f"decode at position {pos}"
                out = full.forward(cache, pos, tokens=prompt[pos : pos + 1])
                self.assert_close(
                    check, self.outputs(check, out, 1, True, what), reference[pos : pos + 1], what
                )
        with self.check("KV cache trim and recompute") as check:
            cache, p = full.new_cache(), len(prompt) - 4
            full.forward(cache, 0, tokens=prompt)
            full.forward(cache, p, tokens=self.other[:4])  # a longer cache is trimmed first
            out = full.forward(cache, p, tokens=prompt[p:], logits="all")
            self.assert_close(check, out, reference[p:], "recomputed positions after a rewrite")
            cache.trim(len(prompt) + 100)
            if cache.length != len(prompt):
                check.fail(f"trim past the end changed the length to {cache.length}")
            cache.trim(p)
            if cache.length != p:
                check.fail(f"trim({p}) left the cache length at {cache.length}")
            out = full.forward(cache, p, tokens=prompt[p:], logits="all")
            self.assert_close(check, out, reference[p:], "recomputed positions after trim()")
        with self.check("caches are independent") as check:
            mine, theirs = full.new_cache(), full.new_cache()
            full.forward(mine, 0, tokens=prompt[:-1])
            full.forward(theirs, 0, tokens=self.other)
            out = full.forward(mine, len(prompt) - 1, tokens=prompt[-1:])
            self.assert_close(
                check, out, reference[-1:], "a cache's result after another cache ran"
            )
        self.check_should_stop(full, reference)
        self.check_bad_inputs(full, splits)

    def check_should_stop(self, full: Any, reference: Any) -> None:
        prompt, n = self.prompt, self.n_layers
        with self.check("should_stop cancels the compute") as check:
            cache = full.new_cache()
            full.forward(cache, 0, tokens=prompt[:4])
            polls = 0

            def count() -> bool:
                nonlocal polls
                polls += 1
                return False

            full.forward(full.new_cache(), 0, tokens=prompt, should_stop=count)
            if polls < n - 1:
                check.fail(f"should_stop was polled {polls} times in {n} layers, not between each")
            # Between layers: a one-layer range may never poll, a two-layer one polls once.
            stops: list[tuple[str, Callable[[], bool]]] = []
            if n >= 2:
                stops.append(("always", lambda: True))
            if n >= 3:
                calls = iter(range(10**9))
                stops.append(("from its second poll", lambda: next(calls) >= 1))
            for when, should_stop in stops:
                try:
                    full.forward(cache, 4, tokens=prompt[4:], should_stop=should_stop)
                except ComputeCancelled:
                    pass
                else:
                    check.fail(f"should_stop returning True {when} did not raise ComputeCancelled")
                if cache.length != 4:
                    check.fail(
                        f"after a stop at position 4 the cache length is {cache.length}, not 4"
                    )
            out = full.forward(cache, 4, tokens=prompt[4:], logits="all")
            self.assert_close(check, out, reference[4:], "the compute rerun after a stop")

    def check_bad_inputs(self, full: Any, splits: Sequence[Sequence[tuple[int, int]]]) -> None:
        prompt, v, d = self.prompt, self.vocab, self.d_model
        hidden = np.zeros((2, d), np.float32)
        cache = full.new_cache()
        full.forward(cache, 0, tokens=prompt[:3])
        cases: list[tuple[str, Callable[[], object]]] = [
            ("hidden on the first stage", lambda: full.forward(cache, 3, hidden=hidden)),
            (
                "both tokens and hidden",
                lambda: full.forward(cache, 3, tokens=[1, 2], hidden=hidden),
            ),
            ("no tokens", lambda: full.forward(cache, 3, tokens=[])),
            ("a token id equal to the vocab size", lambda: full.forward(cache, 3, tokens=[v])),
            ("a negative token id", lambda: full.forward(cache, 3, tokens=[-1])),
            ("logits='first'", lambda: full.forward(cache, 3, tokens=[1], logits="first")),
            ("a position past the cache (a gap)", lambda: full.forward(cache, 5, tokens=[1])),
            ("a negative position", lambda: full.forward(cache, -1, tokens=[1])),
            ("layers past the model", lambda: self.factory(self.model, (0, self.n_layers + 1))),
            ("an empty layer range", lambda: self.factory(self.model, (1, 1))),
            ("a negative first layer", lambda: self.factory(self.model, (-1, self.n_layers))),
        ]
        if splits:
            lo, hi = splits[0][1]
            later = self.factory(self.model, (lo, hi))
            other = later.new_cache()
            cases += [
                ("tokens on a non-first stage", lambda: later.forward(other, 0, tokens=[1])),
                (
                    "hidden of the wrong width",
                    lambda: later.forward(other, 0, hidden=np.zeros((2, d + 1), np.float32)),
                ),
                ("one-dimensional hidden", lambda: later.forward(other, 0, hidden=np.zeros(d))),
            ]
        for what, call in cases:
            with self.check(f"ValueError on {what}") as check:
                try:
                    call()
                except ValueError:
                    pass
                except Exception as exc:
                    check.fail(f"raised {type(exc).__name__} ({exc}) instead of ValueError")
                else:
                    check.fail("no error was raised")
                if cache.length != 3:
                    check.fail(f"the cache length changed from 3 to {cache.length}")


def check_backend(factory: BackendFactory, model: Any, *, tolerance: float = 1e-4) -> None:
    """Check that a compute backend runs layer ranges of ``model`` as stagerun expects.

    Checks that: ``layers``, ``is_first`` and ``is_last`` match the range; outputs are float32
    of the right shapes (``[T, d_model]`` hidden states, logits ``[T, vocab]`` for
    ``logits="all"`` and ``[1, vocab]`` for ``"last"``); the model split in 2 and 3 stages gives
    one stage's logits; decoding one token at a time after a prefill gives the prefill's
    logits; a longer cache is trimmed by ``forward`` and by ``trim``, and recomputing gives the
    same result; two caches do not interfere; ``should_stop`` is polled between layers and
    raises `stagerun.ComputeCancelled` with the cache back at the position; bad inputs raise
    ValueError and leave the cache alone. Logits must agree within ``tolerance`` (relative to
    the largest logit).

    Args:
        factory: ``factory(model, (lo, hi))`` builds a backend, e.g. the backend class.
        model: the model to run, an open `stagerun.model.ModelFile` (the tiny one from
            `write_tiny_model` will do).
        tolerance: the largest relative difference allowed between logits.

    Raises:
        AssertionError: a check failed; the message names it.
    """
    _BackendChecks(factory, model, tolerance).run()


# --- drafters ---------------------------------------------------------------------------------

# Repetitive, so lookup drafters find matches; and the end of the shortened prompt that
# "begin resets the drafter" starts the next request with (26..29, 5, 6) recurs in the
# continuation followed by 40, so a drafter that remembers the first request proposes otherwise.
_PROMPT = (5, 6, 7, 8, 9) * 2 + tuple(range(20, 30)) + (5, 6, 7, 8, 9)
_CONTINUATION = (*range(20, 30), 5, 6, *range(40, 45), 5, 6, 7, 8, 9, 20, 21, 22)
_DEFAULT_TOKENS = _PROMPT + _CONTINUATION


def _proposal(check: _Check, drafter: Any, context: Sequence[int], max_tokens: int) -> list[int]:
    out = drafter.propose(list(context), max_tokens)
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        check.fail(f"propose() returned a {type(out).__name__}, not a sequence of token ids")
    for token in out:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            check.fail(f"propose() returned {token!r} among its tokens; ids are ints >= 0")
    if len(out) > max(max_tokens, 0):
        check.fail(f"propose(context, max_tokens={max_tokens}) returned {len(out)} tokens")
    return [int(t) for t in out]


def check_drafter(
    factory: Callable[[], Any],
    tokens: Sequence[int] = _DEFAULT_TOKENS,
    *,
    vocab_size: int | None = None,
) -> None:
    """Check that a drafter proposes drafts the way stagerun calls it.

    Plays a request: ``begin`` with the first half of ``tokens`` as the prompt, ``commit``
    the rest in pieces, and ``propose`` after each, also with contexts that run past what was
    committed (drafts of windows still in flight). Checks that: the drafter has ``begin``,
    ``commit`` and ``propose``; ``propose`` returns a sequence (maybe empty) of at most
    ``max_tokens`` ids >= 0 (and < ``vocab_size`` if given), none for ``max_tokens=0``; two
    drafters fed the same calls propose the same, and asking twice gives the same answer;
    ``begin`` forgets the previous request.

    Args:
        factory: ``factory()`` returns a new drafter; a lambda can pass arguments (an oracle's
            reference tokens, a draft model).
        tokens: a request's tokens, prompt then continuation; the default repeats itself so
            that lookup drafters find matches.
        vocab_size: if given, every proposed id must be below it.

    Raises:
        AssertionError: a check failed; the message names it.
    """
    tokens = [int(t) for t in tokens]
    half = max(1, len(tokens) // 2)
    prompt, rest = tokens[:half], tokens[half:]
    with _checking("check_drafter", "interface") as check:
        drafter, twin = factory(), factory()
        for method in ("begin", "commit", "propose"):
            if not callable(getattr(drafter, method, None)):
                check.fail(f"{drafter!r} has no {method}()")
        for flag in ("blocking", "per_request"):
            value = getattr(drafter, flag, True)
            if not isinstance(value, bool):
                check.fail(f"its {flag} is {value!r}, not a bool")
    with _checking("check_drafter", "a request") as check:
        drafter.begin(prompt)
        twin.begin(prompt)
        committed = list(prompt)
        steps = [rest[i : i + 3] for i in range(0, len(rest), 3)] or [[]]
        for piece in steps:
            for width in (0, 1, 4, 16):
                # Drafts of windows still in flight run past what was committed: right ones,
                # and wrong ones.
                right = committed + tokens[len(committed) : len(committed) + 2]
                wrong = [*committed, prompt[0], prompt[0]]
                for ctx in (committed, right, wrong):
                    first = _proposal(check, drafter, ctx, width)
                    if width == 0 and first:
                        check.fail(f"propose(context, max_tokens=0) returned {first}")
                    if vocab_size is not None and any(t >= vocab_size for t in first):
                        check.fail(
                            f"propose() returned ids >= the vocab size {vocab_size}: {first}"
                        )
                    again = _proposal(check, drafter, ctx, width)
                    other = _proposal(check, twin, ctx, width)
                    if again != first or other != first:
                        check.fail(
                            f"not deterministic: the same propose() gave {first}, then {again}, "
                            f"and {other} from a second drafter fed the same calls"
                        )
            drafter.commit(piece)
            twin.commit(piece)
            committed += piece
    with _checking("check_drafter", "begin resets the drafter") as check:
        short = prompt[: max(1, len(prompt) - 3)]
        fresh = factory()
        drafter.begin(short)
        fresh.begin(short)
        for width in (1, 4, 16):
            got, want = (
                _proposal(check, drafter, short, width),
                _proposal(check, fresh, short, width),
            )
            if got != want:
                check.fail(
                    f"after begin() a used drafter proposed {got}, a fresh one {want}: "
                    "begin() must forget the previous request"
                )
