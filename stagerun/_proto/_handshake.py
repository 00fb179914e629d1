"""The handshake that opens every connection: a fixed-size hello, then READY or a refusal.

Theory of operation
-------------------
The client (the upstream stage) speaks first with a fixed-size hello::

    b"STGR" | u16 protocol version | u8 role | u8 flags | u64 key        (little-endian, 16 bytes)

``role`` says what the connection is for: a ``LANE`` carries frames downstream, a ``RETURN``
connection is parked by the last stage until a ``Configure`` with the same 64-bit ``key`` (the
``return_key``) binds a chain to it. ``flags`` is 0, or ``FLAG_AUTH``.

The server answers with an 8-byte prefix and an optional reason::

    b"SRDY" | u16 version | u16 0                   READY
    b"SRFS" | u16 version | u16 n | n bytes utf-8   refusal (n <= 1024)

Authentication (both sides hold the same secret) is a mutual HMAC-SHA256 challenge-response
that runs before READY, so a peer without the secret never gets to send a frame:

1. the client sets ``FLAG_AUTH`` and sends a 32-byte random nonce right after its hello;
2. the server answers ``b"SCHL" | u16 version | u16 64`` with its own 32-byte nonce and its
   proof ``HMAC(secret, "stagerun-auth-v1 server" | hello | client nonce | server nonce)``;
3. the client checks that proof (a stage without the secret cannot make it, so the client
   never sends activations to an impostor) and sends its proof, the same HMAC labelled
   ``client``;
4. the server checks it in constant time and answers READY, or refuses with "authentication
   failed" and closes. Fresh nonces on both sides make every proof single-use.

A stage with a secret refuses a hello without ``FLAG_AUTH``; a stage without one refuses a hello
with it (and a client with a secret refuses a stage that answers READY without a challenge).

Both sides fail closed on anything unexpected. The magic is checked first (so an HTTP client or
a port scanner reads "not a stagerun peer"), then the version, before any field whose meaning a
later version could change; a version mismatch names both versions.

The server reads exactly :data:`HELLO_SIZE` bytes and calls :func:`decode_hello`. The client
feeds whatever arrives to a :class:`ReadyDecoder`, which rejects garbage from the first wrong
byte and keeps the bytes after the reply in :attr:`ReadyDecoder.trailing_data`: a server sends
nothing unasked, so the caller treats trailing bytes as a broken peer.
"""

import enum
import hashlib
import hmac
import struct
from typing import Final, Literal

import attrs

from .._errors import ProtocolError
from ._frames import NEED_DATA
from ._messages import PROTOCOL_VERSION

HELLO_MAGIC: Final = b"STGR"
READY_MAGIC: Final = b"SRDY"
REFUSAL_MAGIC: Final = b"SRFS"
CHALLENGE_MAGIC: Final = b"SCHL"
MAX_REFUSAL_REASON: Final = 1024
FLAG_AUTH: Final = 0x01
NONCE_SIZE: Final = 32
PROOF_SIZE: Final = 32
_AUTH_LABEL: Final = b"stagerun-auth-v1 "

_HELLO: Final = struct.Struct("<4sHBBQ")
_REPLY: Final = struct.Struct("<4sHH")
HELLO_SIZE: Final = _HELLO.size
REPLY_PREFIX_SIZE: Final = _REPLY.size
_KEY_LIMIT: Final = 2**64


class Role(enum.IntEnum):
    """What a new connection is for."""

    LANE = 1
    """Carries frames from an upstream stage to this one."""
    RETURN = 2
    """Parked by the last stage until a Configure binds a chain to it by key."""


_ROLES: Final = frozenset(int(role) for role in Role)


@attrs.frozen
class Hello:
    """A decoded client hello."""

    version: int
    role: Role
    flags: int
    key: int


@attrs.frozen
class Ready:
    """The server accepted the connection."""


@attrs.frozen
class Challenge:
    """The server wants the client to authenticate, and proved that it holds the secret."""

    nonce: bytes
    proof: bytes


@attrs.frozen
class Refused:
    """The server turned the connection down and said why."""

    reason: str


def encode_hello(role: Role, key: int = 0, *, auth: bool = False) -> bytes:
    """Return the hello for a connection of ``role``.

    Args:
        role: ``Role.LANE`` or ``Role.RETURN``.
        key: the 64-bit return key for ``Role.RETURN``; must be 0 for a lane.
        auth: set ``FLAG_AUTH`` (the client nonce follows the hello).

    Raises:
        ValueError: unknown role, key outside [0, 2**64), or a non-zero key on a lane.
    """
    role = Role(role)
    if type(key) is not int or not 0 <= key < _KEY_LIMIT:
        raise ValueError(f"a hello key must be an int in [0, 2**64), got {key!r}.")
    if role is Role.LANE and key != 0:
        raise ValueError(f"a lane hello carries key 0, got {key}.")
    return _HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, role, FLAG_AUTH if auth else 0, key)


def _version_mismatch(version: int) -> ProtocolError:
    return ProtocolError(
        f"peer speaks stagerun protocol version {version}, "
        f"this stage speaks version {PROTOCOL_VERSION}."
    )


def decode_hello(data: bytes | bytearray | memoryview) -> Hello:
    """Decode and check the :data:`HELLO_SIZE` bytes a client sent first.

    Raises:
        ProtocolError: wrong length, not a stagerun peer, another protocol version, unknown
            role or flags, or a lane hello with a key.
    """
    size = memoryview(data).nbytes
    if size != HELLO_SIZE:
        raise ProtocolError(f"a hello is {HELLO_SIZE} bytes long, got {size}.")
    magic, version, role, flags, key = _HELLO.unpack(data)
    if magic != HELLO_MAGIC:
        raise ProtocolError(
            f"not a stagerun peer: its hello starts with {magic!r} instead of {HELLO_MAGIC!r}."
        )
    if version != PROTOCOL_VERSION:
        raise _version_mismatch(version)
    if role not in _ROLES:
        raise ProtocolError(
            f"the hello asks for unknown role {role}; expected 1 (lane) or 2 (return)."
        )
    if flags & ~FLAG_AUTH:
        raise ProtocolError(
            f"the hello sets unknown flags 0x{flags:02x}; this stage knows only "
            f"0x{FLAG_AUTH:02x} (authentication)."
        )
    if role == Role.LANE and key:
        raise ProtocolError(f"a lane hello must carry key 0, got {key}.")
    return Hello(version=version, role=Role(role), flags=flags, key=key)


def auth_proof(
    secret: bytes,
    side: Literal["client", "server"],
    hello: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    """The HMAC-SHA256 that proves ``side`` holds ``secret`` for this one handshake.

    Raises:
        ValueError: an empty secret, or nonces of the wrong size.
    """
    if not secret:
        raise ValueError("the lane secret is empty.")
    if len(client_nonce) != NONCE_SIZE or len(server_nonce) != NONCE_SIZE:
        raise ValueError(f"handshake nonces are {NONCE_SIZE} bytes long.")
    message = _AUTH_LABEL + side.encode() + hello + client_nonce + server_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def proofs_match(expected: bytes, received: bytes) -> bool:
    """Compare two proofs in constant time."""
    return hmac.compare_digest(expected, received)


def encode_challenge(nonce: bytes, proof: bytes) -> bytes:
    """Return the server's challenge: its nonce and its own proof.

    Raises:
        ValueError: a nonce or proof of the wrong size.
    """
    if len(nonce) != NONCE_SIZE or len(proof) != PROOF_SIZE:
        raise ValueError(
            f"a challenge carries a {NONCE_SIZE}-byte nonce and a {PROOF_SIZE}-byte proof."
        )
    return _REPLY.pack(CHALLENGE_MAGIC, PROTOCOL_VERSION, NONCE_SIZE + PROOF_SIZE) + nonce + proof


def encode_ready() -> bytes:
    """Return the server's READY reply."""
    return _REPLY.pack(READY_MAGIC, PROTOCOL_VERSION, 0)


def encode_refusal(reason: str) -> bytes:
    """Return the server's refusal carrying ``reason``.

    A reason longer than :data:`MAX_REFUSAL_REASON` bytes of UTF-8 is cut at a character
    boundary: a refusal is the last thing said on a connection and must not fail itself.

    Raises:
        ValueError: ``reason`` is empty.
    """
    if not reason:
        raise ValueError("a refusal needs a reason saying what was wrong.")
    encoded = reason.encode("utf-8", errors="replace")
    if len(encoded) > MAX_REFUSAL_REASON:
        encoded = encoded[:MAX_REFUSAL_REASON].decode("utf-8", errors="ignore").encode("utf-8")
    return _REPLY.pack(REFUSAL_MAGIC, PROTOCOL_VERSION, len(encoded)) + encoded


class ReadyDecoder:
    """Reads the server's reply to a hello; does no I/O.

    Feed bytes with :meth:`receive_data` and call :meth:`next_event` until it returns
    :class:`Ready` or :class:`Refused` (it keeps returning that event afterwards). Bytes past
    the reply are never consumed; they are in :attr:`trailing_data`.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._event: Ready | Refused | Challenge | None = None
        self._reply_len = 0
        self._failure: str | None = None

    @property
    def trailing_data(self) -> bytes:
        """Bytes received after the reply (empty until the reply is complete)."""
        return bytes(self._buffer[self._reply_len :]) if self._event is not None else b""

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes that arrived from the server.

        Raises:
            ProtocolError: the decoder already failed.
        """
        self._check_usable()
        self._buffer += data

    def next_event(self) -> Ready | Refused | Challenge | type[NEED_DATA]:
        """Return the reply, or :data:`NEED_DATA` until all of it has arrived.

        Raises:
            ProtocolError: the bytes are not a stagerun reply, or speak another protocol
                version (or an earlier call failed).
        """
        self._check_usable()
        if self._event is not None:
            return self._event
        try:
            return self._next_event()
        except ProtocolError as exc:
            self._failure = str(exc)
            raise

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ProtocolError(
                f"this reply decoder already failed and cannot be used again: {self._failure}"
            )

    def _next_event(self) -> Ready | Refused | Challenge | type[NEED_DATA]:
        buffer = self._buffer
        head = bytes(buffer[:4])
        if not any(m.startswith(head) for m in (READY_MAGIC, REFUSAL_MAGIC, CHALLENGE_MAGIC)):
            raise ProtocolError(
                f"not a stagerun peer: it answered {head!r} instead of {READY_MAGIC!r} "
                f"or {REFUSAL_MAGIC!r}."
            )
        if len(buffer) < REPLY_PREFIX_SIZE:
            return NEED_DATA
        magic, version, length = _REPLY.unpack_from(buffer)
        if version != PROTOCOL_VERSION:
            raise _version_mismatch(version)
        event: Ready | Refused | Challenge
        if magic == CHALLENGE_MAGIC:
            if length != NONCE_SIZE + PROOF_SIZE:
                raise ProtocolError(
                    f"a challenge carries {NONCE_SIZE + PROOF_SIZE} bytes, not {length}."
                )
            if len(buffer) < REPLY_PREFIX_SIZE + length:
                return NEED_DATA
            body = bytes(buffer[REPLY_PREFIX_SIZE : REPLY_PREFIX_SIZE + length])
            event = Challenge(nonce=body[:NONCE_SIZE], proof=body[NONCE_SIZE:])
        elif magic == READY_MAGIC:
            if length:
                raise ProtocolError(f"a READY reply carries no reason, got a {length}-byte one.")
            event = Ready()
        else:
            if length > MAX_REFUSAL_REASON:
                raise ProtocolError(
                    f"a refusal announces a {length}-byte reason, more than the limit of "
                    f"{MAX_REFUSAL_REASON}."
                )
            if len(buffer) < REPLY_PREFIX_SIZE + length:
                return NEED_DATA
            try:
                reason = buffer[REPLY_PREFIX_SIZE : REPLY_PREFIX_SIZE + length].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProtocolError(f"the refusal reason is not valid UTF-8 ({exc}).") from exc
            event = Refused(reason)
        self._event, self._reply_len = event, REPLY_PREFIX_SIZE + length
        return event

    def __repr__(self) -> str:
        if self._failure is not None:
            state = "failed"
        elif self._event is None:
            state = "waiting"
        else:
            state = type(self._event).__name__.lower()
        return f"<ReadyDecoder state={state} buffered={len(self._buffer)}>"
