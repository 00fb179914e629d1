"""Length-prefixed frames: a msgpack header describing one message, then its raw activations.

Theory of operation
-------------------
A frame is::

    <II prefix: header_len, payload_len> | header (msgpack map) | payload (raw activations)

The header is ``{"kind": ..., "fields": {...}}`` plus, for the kinds in
:data:`CARRIES_ACTIVATIONS`, ``"layout": {"dtype": ..., "rows": ..., "cols": ...}`` where rows is
the number of tokens in the message. The payload never goes through msgpack: the encoder joins
the numpy buffer straight into the frame, and the decoder hands it to numpy.

:class:`FrameDecoder` is sans-IO in the h11 style: the caller feeds whatever bytes arrived with
:meth:`~FrameDecoder.receive_data` and pulls frames with :meth:`~FrameDecoder.next_frame` until
it returns :data:`NEED_DATA`. It moves through three states per frame, and each check happens as
early as the bytes allow:

* ``prefix``: with 8 bytes in hand, both lengths are checked against the limits, so an
  oversized frame is refused before any of it is buffered;
* ``header``: once the header is complete it is parsed and validated (kind, fields, layout,
  that the payload length is exactly what the layout needs, and that the float32 array it
  decodes to -- up to 4x a q8 payload -- is within ``max_decoded_bytes``), before the payload
  is waited for;
* ``payload``: the payload's bytes are kept as the chunks they arrived in, and joined once
  the last one is in.

Prefixes and headers wait in one ``bytearray``; consuming them deletes them from the front,
which CPython does without moving the rest (the buffer keeps an offset), so reading many frames
from one chunk or one byte at a time stays linear. A buffer with an offset grows by copying
itself whole, so the first bytes received after a cut start a fresh buffer from what is left
(less than a frame's header). A payload never grows a buffer: an 18 MiB payload arriving in
256 KiB reads would be copied again at each growth, and the allocator keeps the old copies'
memory, so a stage holding partial frames would hold much more than their bytes. As chunks,
a partial payload holds what has arrived and no more; whole, it is copied once (f32 into the
array's own memory, f16 and q8 into one buffer they decode from), or not at all when it came
in one chunk the decoder owns. The first malformed frame
puts the decoder in the ``failed`` state: every later call raises :class:`ProtocolError`, since
the stream is out of step and the connection has to be dropped.
"""

import itertools
import struct
from typing import Any, Final

import attrs
import msgpack
import numpy as np
import numpy.typing as npt

from .._errors import ProtocolError
from ._activations import (
    ACTIVATION_DTYPES,
    ActivationDType,
    activation_buffer,
    activation_nbytes,
    decode_activations,
)
from ._fields import _show
from ._messages import (
    CARRIES_ACTIVATIONS,
    MESSAGE_TYPES,
    ActivationMessage,
    Message,
    structure_message,
    unstructure_message,
)

PREFIX_SIZE: Final = 8
MAX_HEADER_BYTES: Final = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES: Final = 512 << 20
MAX_ACTIVATION_COLS: Final = 65536

_PREFIX: Final = struct.Struct("<II")
_MAX_U32: Final = 0xFFFFFFFF
_HEADER_KEYS: Final = frozenset({"kind", "fields"})
_HEADER_KEYS_WITH_LAYOUT: Final = frozenset({"kind", "fields", "layout"})
_LAYOUT_KEYS: Final = frozenset({"dtype", "rows", "cols"})
_SHOWN_KEYS: Final = 6  # of a map with the wrong keys, in an error message
# A parsed header waiting for its payload holds its token ids: an int and a tuple slot each
# (a 3-byte msgpack int becomes 36 bytes: a 65,536-token header 2.3 MiB, its bytes 192 KiB).
_PARSED_TOKEN_BYTES: Final = 36
_Layout = tuple[ActivationDType, int, int]


class _Sentinel(type):
    def __repr__(cls) -> str:
        return cls.__name__


class NEED_DATA(metaclass=_Sentinel):
    """Returned (the class itself, never an instance) when more bytes must arrive first."""


def _array_repr(array: npt.NDArray[np.float32] | None) -> str:
    return "None" if array is None else f"<{array.dtype} {list(array.shape)}>"


@attrs.frozen(eq=False)
class Frame:
    """One decoded frame: a message and, for Prefill/Decode/Verify, its float32 activations.

    Attributes:
        message: the validated message.
        activations: ``[len(message.tokens), width]`` float32 for messages that carry
            activations, else None. Decoded frames own a writable array.
    """

    message: Message
    activations: npt.NDArray[np.float32] | None = attrs.field(default=None, repr=_array_repr)


def encode_frame(
    message: Message,
    activations: npt.NDArray[np.float32] | None = None,
    dtype: ActivationDType = "f32",
) -> bytes:
    """Encode ``message`` (and its activations, encoded as ``dtype``) into one frame.

    Raises:
        ValueError: activations are missing for a Prefill/Decode/Verify or given for another
            kind, their row count differs from the number of tokens, they are wider than
            ``MAX_ACTIVATION_COLS``, or the header or payload exceeds the frame limits.
    """
    header: dict[str, Any] = {"kind": message.kind, "fields": unstructure_message(message)}
    if isinstance(message, ActivationMessage):
        if activations is None:
            raise ValueError(f"a {message.kind} frame needs activations, got None.")
        payload = activation_buffer(activations, dtype)
        rows, cols = activations.shape
        if rows != len(message.tokens):
            raise ValueError(
                f"a {message.kind} frame with {len(message.tokens)} tokens needs "
                f"{len(message.tokens)} activation rows, got {rows}."
            )
        if cols > MAX_ACTIVATION_COLS:
            raise ValueError(
                f"activations are {cols} wide, more than the limit of {MAX_ACTIVATION_COLS}."
            )
        if payload.nbytes > _MAX_U32:
            raise ValueError(f"a {payload.nbytes}-byte payload does not fit in one frame.")
        header["layout"] = {"dtype": dtype, "rows": rows, "cols": cols}
    elif activations is not None:
        raise ValueError(f"a {message.kind} frame carries no activations, got an array.")
    else:
        payload = None
    packed: bytes = msgpack.packb(header)
    if len(packed) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the {message.kind} header packs to {len(packed)} bytes, "
            f"more than the limit of {MAX_HEADER_BYTES}."
        )
    if payload is None:
        return _PREFIX.pack(len(packed), 0) + packed
    return b"".join((_PREFIX.pack(len(packed), payload.nbytes), packed, payload.data))


def _show_keys(mapping: dict[Any, Any]) -> str:
    """The first few keys of a rejected map, each cut short (a header can hold 100,000)."""
    shown = [_show(key) for key in itertools.islice(mapping, _SHOWN_KEYS)]
    return ", ".join(shown) + (", ..." if len(mapping) > _SHOWN_KEYS else "")


def _parse_layout(value: object, kind: str, tokens: int) -> _Layout:
    if type(value) is not dict:
        raise ProtocolError(f"the {kind} frame's layout must be a map, got {_show(value)}.")
    if value.keys() != _LAYOUT_KEYS:
        raise ProtocolError(
            f"the {kind} frame's layout must have exactly the keys dtype, rows and cols, "
            f"got {_show_keys(value)}."
        )
    dtype, rows, cols = value["dtype"], value["rows"], value["cols"]
    if type(dtype) is not str or dtype not in ACTIVATION_DTYPES:
        raise ProtocolError(
            f"the {kind} frame's activation dtype {_show(dtype)} is not one of "
            f"{', '.join(ACTIVATION_DTYPES)}."
        )
    if type(rows) is not int or rows != tokens:
        raise ProtocolError(
            f"the {kind} frame carries {tokens} tokens but its layout announces "
            f"{_show(rows)} activation rows."
        )
    if type(cols) is not int or not 1 <= cols <= MAX_ACTIVATION_COLS:
        raise ProtocolError(
            f"the {kind} frame's activation width {_show(cols)} is outside "
            f"[1, {MAX_ACTIVATION_COLS}]."
        )
    return dtype, rows, cols


def _parse_header(data: bytearray, payload_len: int) -> tuple[Message, _Layout | None]:
    try:
        header = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"the frame header is not valid msgpack ({exc}).") from exc
    if type(header) is not dict:
        raise ProtocolError(f"the frame header must be a msgpack map, got {_show(header)}.")
    if "kind" not in header:
        raise ProtocolError("the frame header has no 'kind' entry.")
    kind = header["kind"]
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(
            f"the frame header names unknown message kind {_show(kind)}; "
            f"expected one of {', '.join(MESSAGE_TYPES)}."
        )
    carries = cls in CARRIES_ACTIVATIONS
    expected = _HEADER_KEYS_WITH_LAYOUT if carries else _HEADER_KEYS
    if header.keys() != expected:
        raise ProtocolError(
            f"a {kind} frame header must have exactly the entries {', '.join(sorted(expected))}, "
            f"got {_show_keys(header)}."
        )
    message = structure_message(kind, header["fields"])
    if not isinstance(message, ActivationMessage):
        if payload_len:
            raise ProtocolError(
                f"a {kind} frame carries no activations but announces a {payload_len}-byte payload."
            )
        return message, None
    layout = _parse_layout(header["layout"], kind, len(message.tokens))
    needed = activation_nbytes(*layout)
    if payload_len != needed:
        dtype, rows, cols = layout
        raise ProtocolError(
            f"a {kind} frame with {dtype} activations of shape [{rows}, {cols}] needs a "
            f"{needed}-byte payload but announces {payload_len} bytes."
        )
    return message, layout


class FrameDecoder:
    """Turns a byte stream into :class:`Frame` values; does no I/O (see the module docstring).

    Args:
        max_payload_bytes: the largest activation payload accepted in one frame.
        max_decoded_bytes: the largest float32 array one frame's activations may decode to
            (default ``max_payload_bytes``): f16 doubles on decoding and q8 nearly quadruples,
            so a payload under the limit could still cost four times its size.
    """

    def __init__(
        self,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_decoded_bytes: int | None = None,
    ) -> None:
        if max_decoded_bytes is None:
            max_decoded_bytes = max_payload_bytes
        for name, value in (
            ("max_payload_bytes", max_payload_bytes),
            ("max_decoded_bytes", max_decoded_bytes),
        ):
            if type(value) is not int or not 0 <= value <= _MAX_U32:
                raise ValueError(f"{name} must be in [0, {_MAX_U32}], got {value!r}.")
        self._max_payload_bytes = max_payload_bytes
        self._max_decoded_bytes = max_decoded_bytes
        self._limit_note = ""
        self._buffer = bytearray()  # prefixes and headers, and bytes past the payload in hand
        self._consumed = False  # frames were cut off the front since the last receive_data
        self._chunks: list[bytes | bytearray] = []  # the current frame's payload, so far
        self._received = 0  # bytes in those chunks
        self._header_len = -1  # -1: the prefix of the next frame has not been read yet
        self._payload_len = 0
        self._parsed: tuple[Message, _Layout | None] | None = None
        self._failure: str | None = None
        self._frames = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet returned as part of a whole frame."""
        if self._parsed is None:
            return len(self._buffer)
        return len(self._buffer) + PREFIX_SIZE + self._header_len + self._received

    @property
    def held_bytes(self) -> int:
        """Memory the frame in progress holds: its bytes, and its parsed header's token ids."""
        parsed = self._parsed
        tokens = 0 if parsed is None else len(getattr(parsed[0], "tokens", ()))
        return self.pending_bytes + _PARSED_TOKEN_BYTES * tokens

    @property
    def bytes_wanted(self) -> int:
        """Bytes still to arrive before the decoder can take its next step (after
        :meth:`next_frame` returned :data:`NEED_DATA`): the prefix, the header, or the rest of
        the frame, as far as the bytes in hand tell."""
        if self._parsed is not None:
            return self._payload_len - self._received
        end = PREFIX_SIZE if self._header_len < 0 else PREFIX_SIZE + self._header_len
        return max(0, end - len(self._buffer))

    def limit_payloads(self, max_payload_bytes: int, *, note: str = "") -> None:
        """Change the payload limit (and the decoded one with it) for frames whose prefix has
        not been read yet; ``note`` ends the error that refuses a frame over it."""
        if type(max_payload_bytes) is not int or not 0 <= max_payload_bytes <= _MAX_U32:
            raise ValueError(
                f"max_payload_bytes must be in [0, {_MAX_U32}], got {max_payload_bytes!r}."
            )
        self._max_payload_bytes = self._max_decoded_bytes = max_payload_bytes
        self._limit_note = note

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes that arrived from the peer.

        Raises:
            ProtocolError: the decoder already failed on an earlier frame.
        """
        self._check_usable()
        missing = self._payload_len - self._received if self._parsed is not None else 0
        if missing > 0:  # payload bytes go to the chunks, whatever follows to the buffer
            if len(data) <= missing:
                self._chunks.append(data if type(data) is bytes else bytes(data))
                self._received += len(data)
                return
            self._chunks.append(bytes(memoryview(data)[:missing]))
            self._received += missing
            data = memoryview(data)[missing:]
        if self._consumed:  # see the module docstring: grow from a buffer with no offset
            self._buffer = bytearray(self._buffer)
            self._consumed = False
        self._buffer += data

    def discard(self, reason: str) -> None:
        """Drop every byte held and fail: the connection is being closed (``reason``)."""
        self._buffer, self._chunks, self._received = bytearray(), [], 0
        self._failure = reason

    def next_frame(self) -> Frame | type[NEED_DATA]:
        """Return the next whole frame, or :data:`NEED_DATA` if its bytes have not all arrived.

        Raises:
            ProtocolError: the frame is malformed or over a limit (or an earlier one was).
        """
        self._check_usable()
        try:
            return self._next_frame()
        except ProtocolError as exc:
            self._failure = str(exc)
            raise

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ProtocolError(
                f"this frame decoder already failed and cannot be used again: {self._failure}"
            )

    def _next_frame(self) -> Frame | type[NEED_DATA]:
        buffer = self._buffer
        if self._header_len < 0:
            if len(buffer) < PREFIX_SIZE:
                return NEED_DATA
            header_len, payload_len = _PREFIX.unpack_from(buffer)
            if not 0 < header_len <= MAX_HEADER_BYTES:
                raise ProtocolError(
                    f"a frame announces a {header_len}-byte header; a header must hold "
                    f"1 to {MAX_HEADER_BYTES} bytes."
                )
            if payload_len > self._max_payload_bytes:
                raise ProtocolError(
                    f"a frame announces a {payload_len}-byte payload, more than the limit of "
                    f"{self._max_payload_bytes} bytes{self._limit_note}."
                )
            self._header_len, self._payload_len = header_len, payload_len
        if self._parsed is None:
            header_end = PREFIX_SIZE + self._header_len
            if len(buffer) < header_end:
                return NEED_DATA
            self._parsed = _parse_header(buffer[PREFIX_SIZE:header_end], self._payload_len)
            self._check_decoded_size(*self._parsed)
            # What the buffer holds of the payload becomes its first chunk.
            taken = min(len(buffer) - header_end, self._payload_len)
            if taken:
                self._chunks.append(buffer[header_end : header_end + taken])
                self._received = taken
            del buffer[: header_end + taken]
            self._consumed = True
        if self._received < self._payload_len:
            return NEED_DATA
        message, layout = self._parsed
        activations = None if layout is None else self._decode_payload(layout)
        self._chunks, self._received = [], 0
        self._header_len, self._payload_len, self._parsed = -1, 0, None
        self._frames += 1
        return Frame(message, activations)

    def _check_decoded_size(self, message: Message, layout: _Layout | None) -> None:
        # Before the payload is waited for: the layout says what it will decode to.
        if layout is None:
            return
        dtype, rows, cols = layout
        decoded = activation_nbytes("f32", rows, cols)
        if decoded > self._max_decoded_bytes:
            raise ProtocolError(
                f"a {message.kind} frame's {dtype} activations of shape [{rows}, {cols}] "
                f"decode to {decoded} bytes of float32, more than the limit of "
                f"{self._max_decoded_bytes} bytes."
            )

    def _decode_payload(self, layout: _Layout) -> npt.NDArray[np.float32]:
        dtype, rows, cols = layout
        chunks = self._chunks
        payload = chunks[0] if len(chunks) == 1 else bytearray().join(chunks)
        # f32 decodes to a view of what it is given, so it needs a writable buffer of its own
        # (a joined one, or one cut from the decoder's buffer); f16 and q8 build a new array.
        if dtype == "f32" and type(payload) is not bytearray:
            payload = bytearray(payload)
        return decode_activations(payload, dtype, rows, cols)

    def __repr__(self) -> str:
        if self._failure is not None:
            state = "failed"
        elif self._header_len < 0:
            state = "prefix"
        else:
            state = "header" if self._parsed is None else "payload"
            frame_len = PREFIX_SIZE + self._header_len + self._payload_len
            state = f"{state} frame_bytes={frame_len}"
        return f"<FrameDecoder state={state} buffered={self.pending_bytes} frames={self._frames}>"


def decode_frame(
    data: bytes | bytearray | memoryview,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_decoded_bytes: int | None = None,
) -> Frame:
    """Decode ``data`` that must hold exactly one frame (one websocket message, say).

    The limits are `FrameDecoder`'s.

    Raises:
        ProtocolError: the frame is malformed, truncated, or followed by more bytes.
    """
    decoder = FrameDecoder(max_payload_bytes=max_payload_bytes, max_decoded_bytes=max_decoded_bytes)
    decoder.receive_data(data)
    frame = decoder.next_frame()
    if not isinstance(frame, Frame):
        raise ProtocolError(f"{decoder.pending_bytes} bytes hold only part of a frame.")
    if decoder.pending_bytes:
        raise ProtocolError(f"{decoder.pending_bytes} bytes follow the frame.")
    return frame
