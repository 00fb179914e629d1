"""The connection handshake: hello, READY, refusal, and every way they can go wrong."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerun._errors import ProtocolError
from stagerun._proto import (
    HELLO_SIZE,
    MAX_REFUSAL_REASON,
    NEED_DATA,
    PROTOCOL_VERSION,
    Hello,
    Ready,
    ReadyDecoder,
    Refused,
    Role,
    decode_hello,
    encode_hello,
    encode_ready,
    encode_refusal,
)

FAST = settings(max_examples=200, deadline=None)


def hello_bytes(
    magic: bytes = b"STGR", version: int = PROTOCOL_VERSION, role: int = 1, flags: int = 0,
    key: int = 0,
) -> bytes:  # fmt: skip
    return struct.pack("<4sHBBQ", magic, version, role, flags, key)


# --- hello ---------------------------------------------------------------------------------------


def test_hello_wire_layout() -> None:
    assert HELLO_SIZE == 16
    assert encode_hello(Role.LANE) == b"STGR\x07\x00\x01\x00" + bytes(8)
    assert encode_hello(Role.RETURN, 0x0102030405060708) == (
        b"STGR\x07\x00\x02\x00\x08\x07\x06\x05\x04\x03\x02\x01"
    )


@FAST
@given(st.integers(0, 2**64 - 1))
def test_return_hello_round_trip(key: int) -> None:
    hello = decode_hello(encode_hello(Role.RETURN, key))
    assert hello == Hello(version=PROTOCOL_VERSION, role=Role.RETURN, flags=0, key=key)
    assert hello.role is Role.RETURN


def test_lane_hello_round_trip() -> None:
    hello = decode_hello(bytearray(encode_hello(Role.LANE)))
    assert hello == Hello(version=PROTOCOL_VERSION, role=Role.LANE, flags=0, key=0)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (hello_bytes()[:-1], "a hello is 16 bytes long, got 15"),
        (hello_bytes() + b"\x00", "got 17"),
        (b"", "got 0"),
        (b"GET / HTTP/1.1\r\n", r"not a stagerun peer: its hello starts with b'GET '"),
        (hello_bytes(magic=b"STGX"), "not a stagerun peer"),
        (
            hello_bytes(version=8),
            "^peer speaks stagerun protocol version 8, this stage speaks version 7.$",
        ),
        (hello_bytes(version=0), "version 0, this stage speaks version 7"),
        (hello_bytes(role=0), "unknown role 0"),
        (hello_bytes(role=3), "unknown role 3"),
        (hello_bytes(flags=4), "unknown flags 0x04"),
        (hello_bytes(role=1, key=5), "a lane hello must carry key 0, got 5"),
    ],
)
def test_bad_hello(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_hello(data)


@pytest.mark.parametrize(
    ("role", "key", "match"),
    [
        (3, 0, "is not a valid Role"),
        (Role.RETURN, -1, r"\[0, 2\*\*64\), got -1"),
        (Role.RETURN, 2**64, "got 18446744073709551616"),
        (Role.RETURN, 1.0, "got 1.0"),
        (Role.LANE, 5, "a lane hello carries key 0, got 5"),
    ],
)
def test_encode_hello_rejects_bad_arguments(role: Role, key: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_hello(role, key)


@FAST
@given(st.binary(min_size=HELLO_SIZE, max_size=HELLO_SIZE))
def test_random_hello_bytes(data: bytes) -> None:
    try:
        hello = decode_hello(data)
    except ProtocolError:
        return
    assert encode_hello(hello.role, hello.key) == data


# --- READY and refusal ---------------------------------------------------------------------------


def events(decoder: ReadyDecoder, data: bytes, *, step: int) -> list[object]:
    seen: list[object] = []
    for i in range(0, len(data), step):
        decoder.receive_data(data[i : i + step])
        seen.append(decoder.next_event())
    return seen


def test_ready_wire_layout() -> None:
    assert encode_ready() == b"SRDY\x07\x00\x00\x00"
    assert encode_refusal("no") == b"SRFS\x07\x00\x02\x00no"


@pytest.mark.parametrize("step", [1, 3, 100])
def test_ready_round_trip(step: int) -> None:
    decoder = ReadyDecoder()
    seen = events(decoder, encode_ready(), step=step)
    assert seen[:-1] == [NEED_DATA] * (len(seen) - 1)
    assert seen[-1] == Ready()
    assert decoder.next_event() == Ready()  # the event stays
    assert decoder.trailing_data == b""
    assert repr(decoder) == "<ReadyDecoder state=ready buffered=8>"


@FAST
@given(st.text(min_size=1, max_size=250), st.sampled_from([1, 2, 7, 1000]))  # <= 1000 bytes
def test_refusal_round_trip(reason: str, step: int) -> None:
    data = encode_refusal(reason)
    seen = events(ReadyDecoder(), data, step=step)
    assert seen[:-1] == [NEED_DATA] * (len(seen) - 1)
    assert seen[-1] == Refused(reason.encode("utf-8", "replace").decode("utf-8"))


def test_long_refusal_reason_is_cut_at_a_character_boundary() -> None:
    data = encode_refusal("é" * 600)  # 1200 bytes of UTF-8
    assert len(data) == 8 + MAX_REFUSAL_REASON
    decoder = ReadyDecoder()
    decoder.receive_data(data)
    assert decoder.next_event() == Refused("é" * 512)
    odd = encode_refusal("a" + "é" * 600)  # the cut falls inside a character
    decoder = ReadyDecoder()
    decoder.receive_data(odd)
    assert decoder.next_event() == Refused("a" + "é" * 511)


def test_refusal_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="needs a reason"):
        encode_refusal("")


def test_empty_refusal_from_the_wire_is_accepted() -> None:
    decoder = ReadyDecoder()
    decoder.receive_data(b"SRFS\x07\x00\x00\x00")
    assert decoder.next_event() == Refused("")


@pytest.mark.parametrize("reply", [encode_ready(), encode_refusal("busy")])
def test_bytes_after_the_reply_are_not_consumed(reply: bytes) -> None:
    decoder = ReadyDecoder()
    decoder.receive_data(reply + b"\x01\x02")
    event = decoder.next_event()
    assert event is not NEED_DATA
    assert decoder.trailing_data == b"\x01\x02"
    decoder.receive_data(b"\x03")
    assert decoder.next_event() == event
    assert decoder.trailing_data == b"\x01\x02\x03"


def test_trailing_data_is_empty_until_the_reply_is_complete() -> None:
    decoder = ReadyDecoder()
    decoder.receive_data(encode_refusal("busy")[:-1])
    assert decoder.next_event() is NEED_DATA
    assert decoder.trailing_data == b""
    assert repr(decoder) == "<ReadyDecoder state=waiting buffered=11>"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"H", r"not a stagerun peer: it answered b'H' instead of b'SRDY' or b'SRFS'"),
        (b"SRX", "not a stagerun peer"),
        (b"HTTP/1.1 400 Bad Request\r\n", "it answered b'HTTP'"),
        (b"SRDY\x08\x00\x00\x00", "^peer speaks stagerun protocol version 8, this stage speaks"),
        (b"SRFS\x09\x00\x02\x00no", "version 9, this stage speaks version 7"),
        (b"SRDY\x07\x00\x01\x00x", "READY reply carries no reason, got a 1-byte one"),
        (b"SRFS\x07\x00\x01\x04", "1025-byte reason, more than the limit of 1024"),
        (b"SRFS\x07\x00\x02\x00\xff\xfe", "refusal reason is not valid UTF-8"),
    ],
)
def test_bad_reply(data: bytes, match: str) -> None:
    decoder = ReadyDecoder()
    decoder.receive_data(data)
    with pytest.raises(ProtocolError, match=match):
        decoder.next_event()
    assert "state=failed" in repr(decoder)
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.next_event()
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.receive_data(b"more")


def test_garbage_is_refused_from_the_first_byte() -> None:
    decoder = ReadyDecoder()
    decoder.receive_data(b"S")
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(b"X")
    with pytest.raises(ProtocolError, match="b'SX'"):
        decoder.next_event()


@FAST
@given(st.lists(st.binary(max_size=12), max_size=6))
def test_random_reply_bytes(chunks: list[bytes]) -> None:
    decoder = ReadyDecoder()
    try:
        for chunk in chunks:
            decoder.receive_data(chunk)
            event = decoder.next_event()
            assert event is NEED_DATA or isinstance(event, Ready | Refused)
    except ProtocolError:
        pass
