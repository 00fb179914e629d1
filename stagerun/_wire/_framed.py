"""Whole frames over a Trio byte stream, and the lane handshake on top of it.

Theory of operation: the protocol core (`stagerun._proto`) turns bytes into frames and back
without any I/O. `FrameStream` is the thin Trio shell around it: `send` encodes and writes a
whole frame, `receive` reads until the decoder yields one. Reads are cancel-safe (bytes already
received stay in the decoder); a write that is interrupted half-way leaves the peer with a torn
frame, so the stream marks itself broken and refuses further use.

The handshake is symmetric to the wire description in docs/architecture.md: the client sends a
fixed-size hello and waits for READY (or a refusal with a reason); the server reads the hello
with a deadline, refuses anything it does not understand before reading further, and answers.
Every failure is translated into the `LaneError` tree at this boundary.

On a stage, what a peer's partial frames make it hold is bounded twice: a frame over the
stream's payload limit is refused from its prefix (`FrameStream.limit_payloads`), and with a
`PartialFrames` account every read of a frame in progress is charged to the stage's
`stagerun._wire._budget.PartialFrameBudget` before it is made. Such a stream reads a frame's
bytes only as they arrive, at most 256 KiB at a time, and between frames at most 4 KiB (charged
when it lands), so an idle connection holds no room.
"""

from __future__ import annotations

import errno
import math
import secrets
import socket
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import trio

from .. import _proto
from .._errors import (
    LaneBrokenError,
    LaneHandshakeError,
    LaneTimeoutError,
    ProtocolError,
)
from ._budget import PartialFrames

_RECEIVE_SIZE = 1 << 18
# A budgeted stream's read when it holds nothing: a decode frame (~2.4 KB) in one read, and the
# most an idle connection's next read brings in before it is charged.
_IDLE_READ = 4096
#: Seconds a stage gives a connecting peer to finish its side of the handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 10.0


def socket_is_idle(sock: Any) -> bool:
    """True when a connected socket has no byte waiting and is not at EOF (a non-blocking peek)."""
    try:
        probe = socket.fromfd(sock.fileno(), sock.family, sock.type)
    except OSError:
        return False
    try:
        probe.setblocking(False)
        try:
            probe.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError as exc:
            return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
        return False  # EOF (b"") or stale bytes
    finally:
        probe.close()


@attrs.frozen
class LinkEmulation:
    """A WAN link emulated on loopback: each frame is delivered ``delay_s`` after it arrived,
    and, with a bandwidth cap, no sooner than the link could have carried it.

    Applied where frames are received, so frames in flight overlap as on a real link (a
    sender-side sleep would serialize them and hide what pipelining buys).
    """

    delay_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None

    @property
    def active(self) -> bool:
        return self.delay_s > 0 or self.bandwidth_bytes_per_s is not None


NO_EMULATION = LinkEmulation()


class FrameStream:
    """A trio stream that carries whole stagerun frames.

    Args:
        stream: the connected byte stream.
        peer: a human-readable name of the other end, used in error messages.
        leftover: bytes already read past the handshake; they are parsed as frames.
        max_payload_bytes: the largest activation payload accepted from the peer.
        partial: this connection's account in its stage's budget for partial frames (None:
            reads are not budgeted, as on the connections a stage or stage 0 dials).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        peer: str,
        leftover: bytes = b"",
        max_payload_bytes: int = _proto.DEFAULT_MAX_PAYLOAD_BYTES,
        link: LinkEmulation = NO_EMULATION,
        partial: PartialFrames | None = None,
    ) -> None:
        self.stream = stream
        self.peer = peer
        self.partial = partial
        self._decoder = _proto.FrameDecoder(max_payload_bytes=max_payload_bytes)
        if partial is not None:
            partial.drop = self._decoder.discard
        if leftover:
            self._decoder.receive_data(leftover)
        self._broken: str | None = None
        self._closed = False
        self._send_lock = trio.Lock()
        self.link = link
        self._chunk_time = trio.current_time()
        self._link_free_at = 0.0
        self._ready: tuple[_proto.Frame, float] | None = None  # decoded, not yet delivered

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<FrameStream peer={self.peer} {state} pending={self._decoder.pending_bytes}>"

    @property
    def broken(self) -> bool:
        return self._broken is not None or self._closed

    def limit_payloads(self, max_payload_bytes: int, *, note: str = "") -> None:
        """Accept payloads of at most ``max_payload_bytes`` in frames not yet begun; ``note``
        ends the error that refuses a larger one (it says why the limit is what it is)."""
        self._decoder.limit_payloads(max_payload_bytes, note=note)

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
        *,
        timeout: float = math.inf,
    ) -> None:
        """Encode and write one frame; a failure or a cancel mid-write breaks the stream."""
        await self.send_bytes(_proto.encode_frame(message, activations, dtype), timeout=timeout)

    async def send_bytes(self, data: bytes, *, timeout: float = math.inf) -> None:
        """Write one already-encoded frame (forwarding reuses encoded frames)."""
        self._check_usable()
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled: raise before any byte goes
        try:  # uncontended, the lock is taken without a trip through the scheduler
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            finished = False
            try:
                with trio.fail_after(timeout):
                    await self.stream.send_all(data)
                finished = True
            except trio.TooSlowError as exc:
                self._broken = "write timed out"
                raise LaneTimeoutError(
                    f"writing to {self.peer} took longer than {timeout:g}s"
                ) from exc
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._broken = "write failed"
                raise LaneBrokenError(f"connection to {self.peer} lost while writing") from exc
            finally:
                if not finished and self._broken is None:
                    # Cancelled half-way: the peer may hold a torn frame.
                    self._broken = "write cancelled mid-frame"
        finally:
            self._send_lock.release()

    async def receive(self, *, timeout: float = math.inf) -> _proto.Frame:
        """Read the next whole frame.

        Raises:
            LaneBrokenError: the peer closed the connection or sent a malformed frame.
            LaneTimeoutError: no whole frame arrived within ``timeout`` seconds.
        """
        self._check_usable()
        try:
            with trio.fail_after(timeout):
                if self._ready is None:
                    frame = await self._next_frame()
                    self._ready = (frame, self._delivery_time(frame))
                frame, deliver_at = self._ready
                if deliver_at > trio.current_time():
                    await trio.sleep_until(deliver_at)  # cancel-safe: the frame stays ready
                self._ready = None
                return frame
        except trio.TooSlowError as exc:
            raise LaneTimeoutError(f"{self.peer} sent no reply within {timeout:g}s") from exc
        except ProtocolError as exc:
            self._broken = "protocol error"
            raise LaneBrokenError(f"{self.peer} sent a malformed frame: {exc}") from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._broken = "read failed"
            raise LaneBrokenError(f"connection to {self.peer} lost while reading") from exc

    async def _next_frame(self) -> _proto.Frame:
        decoder, partial = self._decoder, self.partial
        while True:
            frame = decoder.next_frame()
            if isinstance(frame, _proto.Frame):
                if partial is not None:
                    partial.settle(decoder.held_bytes)  # the frame is the caller's now
                return frame
            size = _RECEIVE_SIZE if partial is None else await self._budgeted_read(partial)
            data = await self.stream.receive_some(size)
            if not data:
                self._broken = "closed by peer"
                raise LaneBrokenError(f"{self.peer} closed the connection")
            self._chunk_time = trio.current_time()
            if partial is not None:
                self._check_not_evicted(partial)  # its decoder was emptied meanwhile
            decoder.receive_data(data)
            if partial is not None:
                partial.settle(decoder.held_bytes)

    def _check_not_evicted(self, partial: PartialFrames) -> None:
        if partial.evicted is not None:
            self._broken = "closed to make room"
            raise LaneBrokenError(f"connection to {self.peer} closed: {partial.evicted}")

    async def _budgeted_read(self, partial: PartialFrames) -> int:
        """The next read's size, its room reserved in the stage's budget for partial frames."""
        decoder = self._decoder
        while True:
            self._check_not_evicted(partial)
            partial.settle(decoder.held_bytes)
            if not decoder.pending_bytes:
                return _IDLE_READ  # charged when it lands: an idle connection holds no room
            granted = partial.reserve(min(_RECEIVE_SIZE, max(decoder.bytes_wanted, _IDLE_READ)))
            if granted:
                return granted
            if partial.budget.only_holder(partial):
                self._broken = "over the partial-frame budget"
                raise LaneBrokenError(
                    f"{self.peer} sent a frame larger than the stage's budget for partial "
                    f"frames ({partial.budget.max_bytes} bytes; raise --max-partial-bytes)"
                )
            await partial.budget.wait_for_room()  # closed holders finish their reads

    def _delivery_time(self, frame: _proto.Frame) -> float:
        if not self.link.active:
            return 0.0
        # Frames decoded now were completed by the most recent chunk read.
        deliver_at = self._chunk_time + self.link.delay_s
        if self.link.bandwidth_bytes_per_s:
            size = 64 + (frame.activations.nbytes if frame.activations is not None else 0)
            deliver_at = (
                max(deliver_at, self._link_free_at) + size / self.link.bandwidth_bytes_per_s
            )
            self._link_free_at = deliver_at
        return deliver_at

    def is_live(self) -> bool:
        """Probe an idle stream without consuming anything.

        A stream is dead if it is broken or has undelivered bytes; then the transport's stream
        decides (its ``is_live()``, or a peek at its ``socket``: EOF or any readable byte
        means dead, since an idle lane must have nothing unsolicited waiting).
        """
        if self.broken or self._decoder.pending_bytes or self._ready is not None:
            return False
        probe = getattr(self.stream, "is_live", None)
        if callable(probe):
            return bool(probe())
        sock = getattr(self.stream, "socket", None)
        if sock is None:
            return True
        return socket_is_idle(sock)

    async def aclose(self) -> None:
        self._closed = True
        await self.stream.aclose()

    async def aclose_forcefully(self) -> None:
        """Close at once, even from a cancelled context (no graceful shutdown)."""
        self._closed = True
        await trio.aclose_forcefully(self.stream)

    def _check_usable(self) -> None:
        if self._closed:
            raise LaneBrokenError(f"connection to {self.peer} is closed")
        if self._broken is not None:
            raise LaneBrokenError(f"connection to {self.peer} is broken ({self._broken})")


async def client_handshake(
    stream: trio.abc.Stream,
    *,
    peer: str,
    role: _proto.Role,
    key: int = 0,
    ready_timeout: float,
    link: LinkEmulation = NO_EMULATION,
    secret: bytes | None = None,
) -> FrameStream:
    """Send the hello (and, with a ``secret``, authenticate both ways); wait for READY.

    Returns the stream ready for frames.
    """
    decoder = _proto.ReadyDecoder()
    hello = _proto.encode_hello(role, key, auth=secret is not None)
    client_nonce = secrets.token_bytes(_proto.NONCE_SIZE) if secret is not None else b""

    async def reply() -> _proto.Ready | _proto.Refused | _proto.Challenge:
        while True:
            event = decoder.next_event()
            if event is not _proto.NEED_DATA:
                return event  # type: ignore[return-value]
            data = await stream.receive_some(4096)
            if not data:
                raise LaneHandshakeError(f"{peer} closed the connection before it became ready")
            decoder.receive_data(data)

    try:
        with trio.fail_after(ready_timeout):
            await stream.send_all(hello + client_nonce)
            event = await reply()
            if secret is not None and isinstance(event, _proto.Ready):
                raise LaneHandshakeError(
                    f"{peer} accepted the lane without authenticating itself; it has no lane "
                    "secret, so stagerun will not send it anything"
                )
            if isinstance(event, _proto.Challenge):
                if secret is None:
                    raise ProtocolError("the stage sent a challenge that was not asked for.")
                want = _proto.auth_proof(secret, "server", hello, client_nonce, event.nonce)
                if not _proto.proofs_match(want, event.proof):
                    raise LaneHandshakeError(
                        f"{peer} failed to prove it holds the lane secret; refusing to use it"
                    )
                trailing = decoder.trailing_data
                decoder = _proto.ReadyDecoder()
                decoder.receive_data(trailing)
                proof = _proto.auth_proof(secret, "client", hello, client_nonce, event.nonce)
                await stream.send_all(proof)
                event = await reply()
                if isinstance(event, _proto.Challenge):
                    raise ProtocolError("the stage sent a second challenge.")
    except trio.TooSlowError as exc:
        raise LaneHandshakeError(
            f"{peer} did not become ready within {ready_timeout:g}s "
            "(is a stagerun stage listening there?)"
        ) from exc
    except ProtocolError as exc:
        raise LaneHandshakeError(f"{peer} answered the handshake wrongly: {exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise LaneHandshakeError(f"connection to {peer} lost during the handshake") from exc
    if isinstance(event, _proto.Refused):
        raise LaneHandshakeError(f"{peer} refused the lane: {event.reason}")
    return FrameStream(stream, peer=peer, leftover=decoder.trailing_data, link=link)


async def server_handshake(
    stream: trio.abc.Stream,
    *,
    peer: str,
    hello_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    check: Callable[[_proto.Hello], str | None] | None = None,
    link: LinkEmulation = NO_EMULATION,
    secret: bytes | None = None,
    max_payload_bytes: int = _proto.DEFAULT_MAX_PAYLOAD_BYTES,
    partial: PartialFrames | None = None,
) -> tuple[FrameStream, _proto.Hello]:
    """Read and check the client's hello, authenticate it, answer READY; return the stream.

    With a ``secret``, a client must authenticate (see `stagerun._proto` handshake) before
    anything else is read. A bad hello, a failed authentication, or a hello that ``check``
    objects to (it returns a reason) gets a refusal and raises `LaneHandshakeError`.

    ``hello_timeout`` bounds everything the client sends (hello, nonce and proof), so a peer
    that connects and stalls holds the connection for that long at most. ``max_payload_bytes``
    and ``partial`` are the stream's (`FrameStream`).
    """

    waiting_for = "hello"

    async def read_exactly(n: int, what: str) -> bytes:
        nonlocal waiting_for
        waiting_for = what
        buf = bytearray()
        while len(buf) < n:
            data = await stream.receive_some(n - len(buf))
            if not data:
                raise LaneHandshakeError(f"{peer} closed the connection before its {what}")
            buf += data
        return bytes(buf)

    try:
        with trio.fail_after(hello_timeout):
            raw = await read_exactly(_proto.HELLO_SIZE, "hello")
            try:
                hello = _proto.decode_hello(raw)
            except ProtocolError as exc:
                await _refuse(stream, str(exc))
                raise LaneHandshakeError(f"refused {peer}: {exc}") from exc
            authenticated = bool(hello.flags & _proto.FLAG_AUTH)
            if secret is not None and not authenticated:
                reason = "this stage requires lane authentication (a shared secret)"
                await _refuse(stream, reason)
                raise LaneHandshakeError(f"refused {peer}: {reason}")
            if authenticated:
                client_nonce = await read_exactly(_proto.NONCE_SIZE, "nonce")
                if secret is None:
                    reason = "this stage has no lane secret and cannot authenticate"
                    await _refuse(stream, reason)
                    raise LaneHandshakeError(f"refused {peer}: {reason}")
                nonce = secrets.token_bytes(_proto.NONCE_SIZE)
                mine = _proto.auth_proof(secret, "server", raw, client_nonce, nonce)
                await stream.send_all(_proto.encode_challenge(nonce, mine))
                proof = await read_exactly(_proto.PROOF_SIZE, "proof")
                want = _proto.auth_proof(secret, "client", raw, client_nonce, nonce)
                if not _proto.proofs_match(want, proof):
                    await _refuse(stream, "authentication failed")
                    raise LaneHandshakeError(f"refused {peer}: wrong lane secret")
    except trio.TooSlowError as exc:
        raise LaneHandshakeError(
            f"{peer} did not send its {waiting_for} within {hello_timeout:g}s"
        ) from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise LaneHandshakeError(f"connection to {peer} lost during the handshake") from exc
    objection = check(hello) if check is not None else None
    if objection is not None:
        await _refuse(stream, objection)
        raise LaneHandshakeError(f"refused {peer}: {objection}")
    try:
        await stream.send_all(_proto.encode_ready())
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise LaneHandshakeError(f"connection to {peer} lost during the handshake") from exc
    framed = FrameStream(
        stream, peer=peer, link=link, max_payload_bytes=max_payload_bytes, partial=partial
    )
    return framed, hello


async def _refuse(stream: trio.abc.Stream, reason: str) -> None:
    try:
        with trio.move_on_after(1):
            await stream.send_all(_proto.encode_refusal(reason))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
