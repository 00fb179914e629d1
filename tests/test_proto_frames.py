"""Frame encoding and the sans-IO FrameDecoder: round trips, chunking, limits, malformed input."""

import struct
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stagerun._errors import ProtocolError
from stagerun._proto import (
    ACTIVATION_DTYPES,
    CARRIES_ACTIVATIONS,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_ACTIVATION_COLS,
    MAX_HEADER_BYTES,
    NEED_DATA,
    Ack,
    ActivationDType,
    Cancel,
    Cancelled,
    Configure,
    Decode,
    Error,
    Frame,
    FrameDecoder,
    Message,
    Predictions,
    Prefill,
    SamplingParams,
    StageStats,
    Stop,
    Trim,
    Verify,
    decode_frame,
    encode_frame,
)

FAST = settings(max_examples=200, deadline=None)
# q8 is within half a step of the input, give or take float32's smallest normal number when
# a row is so small that its scale is subnormal (and so loses bits).
TINY = np.finfo(np.float32).tiny
SMALL = settings(max_examples=60, deadline=None)

ids = st.integers(0, 2**63 - 1)
keys = st.integers(0, 2**64 - 1)
token_ids = st.integers(0, 2**31 - 1)
tokens = st.lists(token_ids, min_size=1, max_size=6).map(tuple)
stats = st.builds(StageStats, ids, ids, ids, ids, ids)
sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0, 1e6),
    top_k=ids,
    top_p=st.floats(0, 1, exclude_min=True),
    seed=keys,
)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Configure, ids, keys, ids, sampling),
    st.builds(Prefill, ids, ids, ids, tokens, st.booleans()),
    st.builds(Decode, ids, ids, tokens),
    st.builds(Verify, ids, ids, ids, ids, tokens),
    st.builds(Cancel, ids, ids, st.lists(ids, max_size=64).map(tuple)),
    st.builds(Trim, ids, ids),
    st.builds(Stop, ids),
    st.builds(Ack, ids, stats),
    st.builds(Predictions, ids, ids, ids, st.lists(token_ids, max_size=6).map(tuple), stats),
    st.builds(Error, ids, ids, st.text(max_size=100)),
    st.builds(Cancelled, ids, ids, st.lists(ids, max_size=8).map(tuple)),
)


@st.composite
def frames(draw: st.DrawFn) -> tuple[Message, npt.NDArray[np.float32] | None, ActivationDType]:
    """A message, activations that fit it, and a wire dtype (f32 may hold NaN and inf)."""
    message = draw(messages)
    dtype: ActivationDType = draw(st.sampled_from(ACTIVATION_DTYPES))
    if type(message) not in CARRIES_ACTIVATIONS:
        return message, None, dtype
    assert isinstance(message, Prefill | Decode | Verify)
    cols = draw(st.integers(1, 12))
    elements = st.floats(width=32) if dtype == "f32" else st.floats(-6e4, 6e4, width=32)
    array = draw(hnp.arrays(np.float32, (len(message.tokens), cols), elements=elements))
    return message, array, dtype


def assert_same_frame(
    frame: Frame | type[NEED_DATA],
    message: Message,
    array: npt.NDArray[np.float32] | None,
    dtype: ActivationDType,
) -> None:
    assert isinstance(frame, Frame)
    assert frame.message == message
    if array is None:
        assert frame.activations is None
        return
    got = frame.activations
    assert got is not None
    assert got.dtype == np.float32 and got.shape == array.shape
    if dtype == "f32":
        assert got.tobytes() == array.tobytes()  # bit for bit, NaN payloads included
    elif dtype == "f16":
        np.testing.assert_array_equal(got, array.astype(np.float16).astype(np.float32))
        np.testing.assert_allclose(got, array, rtol=2**-11, atol=2**-24)
    else:
        scale = np.abs(array).max(axis=1, keepdims=True) / np.float32(127)
        scale[scale == 0] = 1
        assert np.all(np.abs(got - array) <= scale * (0.5 + 1e-5) + TINY)


def decode_all(decoder: FrameDecoder) -> list[Frame]:
    out = []
    while (frame := decoder.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        out.append(frame)
    return out


def raw_frame(header: Any, payload: bytes = b"", *, payload_len: int | None = None) -> bytes:
    packed: bytes = msgpack.packb(header)
    size = len(payload) if payload_len is None else payload_len
    return struct.pack("<II", len(packed), size) + packed + payload


# --- round trips ----------------------------------------------------------------------------------


@FAST
@given(frames())
def test_round_trip_whole(case: tuple[Message, Any, ActivationDType]) -> None:
    message, array, dtype = case
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(message, array, dtype))
    assert_same_frame(decoder.next_frame(), message, array, dtype)
    assert decoder.next_frame() is NEED_DATA
    assert decoder.pending_bytes == 0


@FAST
@given(frames())
def test_round_trip_one_byte_at_a_time(case: tuple[Message, Any, ActivationDType]) -> None:
    message, array, dtype = case
    data = encode_frame(message, array, dtype)
    decoder = FrameDecoder()
    for i in range(len(data) - 1):
        decoder.receive_data(data[i : i + 1])
        assert decoder.next_frame() is NEED_DATA
        assert decoder.pending_bytes == i + 1
    decoder.receive_data(memoryview(data)[-1:])
    assert_same_frame(decoder.next_frame(), message, array, dtype)
    assert decoder.pending_bytes == 0


@FAST
@given(frames(), frames(), st.data())
def test_round_trip_with_trailing_bytes_of_the_next_frame(
    first: tuple[Message, Any, ActivationDType],
    second: tuple[Message, Any, ActivationDType],
    data: st.DataObject,
) -> None:
    one, two = encode_frame(*first), encode_frame(*second)
    cut = data.draw(st.integers(0, len(two) - 1))
    decoder = FrameDecoder()
    decoder.receive_data(one + two[:cut])
    assert_same_frame(decoder.next_frame(), *first)
    assert decoder.next_frame() is NEED_DATA
    assert decoder.pending_bytes == cut
    decoder.receive_data(bytearray(two[cut:]))
    assert_same_frame(decoder.next_frame(), *second)
    assert decoder.next_frame() is NEED_DATA


@SMALL
@given(st.lists(frames(), min_size=1, max_size=5))
def test_several_frames_in_one_chunk(cases: list[tuple[Message, Any, ActivationDType]]) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"".join(encode_frame(*case) for case in cases))
    decoded = decode_all(decoder)
    assert len(decoded) == len(cases)
    for frame, case in zip(decoded, cases, strict=True):
        assert_same_frame(frame, *case)
    assert decoder.pending_bytes == 0


@FAST
@given(frames(), st.data())
def test_truncated_frame_waits_for_more(
    case: tuple[Message, Any, ActivationDType], data: st.DataObject
) -> None:
    encoded = encode_frame(*case)
    cut = data.draw(st.integers(1, len(encoded) - 1))
    decoder = FrameDecoder()
    decoder.receive_data(encoded[:cut])
    assert decoder.next_frame() is NEED_DATA
    assert decoder.next_frame() is NEED_DATA
    assert decoder.pending_bytes == cut > 0


@pytest.mark.parametrize("dtype", ACTIVATION_DTYPES)
def test_decode_frame_helper(dtype: ActivationDType) -> None:
    message = Decode(request_id=3, position=10, tokens=(5, 6))
    array = np.arange(8, dtype=np.float32).reshape(2, 4)
    data = encode_frame(message, array, dtype)
    assert_same_frame(decode_frame(data), message, array, dtype)
    with pytest.raises(ProtocolError, match="only part of a frame"):
        decode_frame(data[:-1])
    with pytest.raises(ProtocolError, match="3 bytes follow the frame"):
        decode_frame(data + b"abc")


def test_decoded_f32_activations_are_writable_and_independent() -> None:
    message = Decode(request_id=1, position=0, tokens=(1,))
    array = np.ones((1, 4), dtype=np.float32)
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(message, array) + encode_frame(message, array))
    first, second = decode_all(decoder)
    assert first.activations is not None and second.activations is not None
    first.activations[0, 0] = 7  # owns its memory: the decoder's buffer has moved on
    assert second.activations[0, 0] == 1


# --- encoder errors (programming errors: ValueError) ----------------------------------------------


@pytest.mark.parametrize(
    ("message", "array", "dtype", "match"),
    [
        (Decode(1, 0, (1,)), None, "f32", "needs activations"),
        (Stop(1), np.zeros((1, 4), np.float32), "f32", "carries no activations"),
        (Decode(1, 0, (1, 2)), np.zeros((1, 4), np.float32), "f32", "needs 2 activation rows"),
        (Decode(1, 0, (1,)), np.zeros((1, 4), np.float64), "f32", "float32"),
        (Decode(1, 0, (1,)), np.zeros(4, np.float32), "f32", "2-D"),
        (Decode(1, 0, (1,)), np.zeros((1, 4), np.float32), "bf16", "unknown activation dtype"),
        (
            Decode(1, 0, (1,)),
            np.zeros((1, MAX_ACTIVATION_COLS + 1), np.float32),
            "f16",
            "more than the limit",
        ),
    ],
)
def test_encode_frame_rejects_mismatched_activations(
    message: Message, array: Any, dtype: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        encode_frame(message, array, dtype)


def test_encode_frame_accepts_non_contiguous_input() -> None:
    array = np.arange(16, dtype=np.float32).reshape(4, 4).T[:2]
    frame = decode_frame(encode_frame(Decode(1, 0, (1, 2)), array))
    assert frame.activations is not None
    np.testing.assert_array_equal(frame.activations, array)


# --- limits: refused from the prefix alone --------------------------------------------------------


@pytest.mark.parametrize(
    ("header_len", "payload_len", "match"),
    [
        (0, 0, "0-byte header"),
        (MAX_HEADER_BYTES + 1, 0, f"{MAX_HEADER_BYTES + 1}-byte header"),
        (0xFFFFFFFF, 0, "header"),
        (10, DEFAULT_MAX_PAYLOAD_BYTES + 1, f"limit of {DEFAULT_MAX_PAYLOAD_BYTES} bytes"),
        (10, 0xFFFFFFFF, "payload"),
    ],
)
def test_oversized_prefix_is_refused_immediately(
    header_len: int, payload_len: int, match: str
) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack("<II", header_len, payload_len))
    with pytest.raises(ProtocolError, match=match):
        decoder.next_frame()


def test_configured_payload_limit() -> None:
    decoder = FrameDecoder(max_payload_bytes=16)
    decoder.receive_data(encode_frame(Decode(1, 0, (1,)), np.zeros((1, 4), np.float32)))
    assert isinstance(decoder.next_frame(), Frame)
    decoder.receive_data(struct.pack("<II", 10, 17))
    with pytest.raises(ProtocolError, match="17-byte payload, more than the limit of 16"):
        decoder.next_frame()
    with pytest.raises(ValueError, match="max_payload_bytes"):
        FrameDecoder(max_payload_bytes=-1)


# --- malformed headers ----------------------------------------------------------------------------

DECODE_FIELDS = {"request_id": 1, "position": 0, "tokens": [7]}
F32_LAYOUT = {"dtype": "f32", "rows": 1, "cols": 2}


def decode_header(**changes: Any) -> dict[str, Any]:
    header: dict[str, Any] = {"kind": "decode", "fields": DECODE_FIELDS, "layout": F32_LAYOUT}
    header.update(changes)
    return {key: value for key, value in header.items() if value is not ...}


def fields(**changes: Any) -> dict[str, Any]:
    return {key: value for key, value in {**DECODE_FIELDS, **changes}.items() if value is not ...}


BAD_HEADERS: list[tuple[str, Any, int, str]] = [
    ("list header", [1, 2], 0, "must be a msgpack map"),
    ("no kind", {"fields": {}}, 0, "no 'kind' entry"),
    ("unknown kind", {"kind": "reboot", "fields": {}}, 0, "unknown message kind 'reboot'"),
    ("kind not a str", {"kind": 3, "fields": {}}, 0, "unknown message kind 3"),
    ("no fields", {"kind": "stop"}, 0, "exactly the entries"),
    ("extra entry", {"kind": "stop", "fields": {"request_id": 1}, "x": 1}, 0, "'x'"),
    (
        "layout on stop",
        {"kind": "stop", "fields": {"request_id": 1}, "layout": F32_LAYOUT},
        0,
        "exactly",
    ),
    ("no layout on decode", decode_header(layout=...), 8, "exactly the entries"),
    ("payload on stop", {"kind": "stop", "fields": {"request_id": 1}}, 4, "4-byte payload"),
    ("fields not a map", decode_header(fields=[1, 0, [7]]), 8, "fields must be a map"),
    ("missing field", decode_header(fields=fields(position=...)), 8, "missing field 'position'"),
    ("unknown field", decode_header(fields=fields(x=1)), 8, "unknown field 'x'"),
    ("string position", decode_header(fields=fields(position="5")), 8, "position must be an int"),
    ("float id", decode_header(fields=fields(request_id=1.0)), 8, "request_id must be an int"),
    ("bool id", decode_header(fields=fields(request_id=True)), 8, "got True"),
    ("negative position", decode_header(fields=fields(position=-1)), 8, r"\[0, 2\*\*63\), got -1"),
    ("huge position", decode_header(fields=fields(position=2**63)), 8, "2\\*\\*63"),
    ("empty tokens", decode_header(fields=fields(tokens=[])), 0, "must not be empty"),
    ("token too big", decode_header(fields=fields(tokens=[2**31])), 8, r"tokens\[0\]"),
    ("string token", decode_header(fields=fields(tokens=["a"])), 8, r"tokens\[0\]"),
    ("tokens a map", decode_header(fields=fields(tokens={"a": 1})), 8, "tuple of ints"),
    ("layout a list", decode_header(layout=["f32", 1, 2]), 8, "layout must be a map"),
    ("layout extra key", decode_header(layout={**F32_LAYOUT, "x": 1}), 8, "exactly the keys"),
    ("bad dtype", decode_header(layout={**F32_LAYOUT, "dtype": "bf16"}), 8, "'bf16' is not one"),
    ("rows != tokens", decode_header(layout={**F32_LAYOUT, "rows": 2}), 16, "announces 2 activ"),
    ("rows a bool", decode_header(layout={**F32_LAYOUT, "rows": True}), 8, "announces True"),
    ("zero cols", decode_header(layout={**F32_LAYOUT, "cols": 0}), 0, "width 0 is outside"),
    ("wide cols", decode_header(layout={**F32_LAYOUT, "cols": 70000}), 8, "width 70000"),
    ("short payload", decode_header(), 7, "needs a 8-byte payload but announces 7 bytes"),
    ("long payload", decode_header(), 9, "needs a 8-byte payload but announces 9 bytes"),
    (
        "configure with bad sampling",
        {
            "kind": "configure",
            "fields": {
                "request_id": 1,
                "return_key": 2,
                "prompt_len": 3,
                "sampling": {
                    "temperature": -1.0,
                    "top_k": 0,
                    "top_p": 1.0,
                    "seed": 0,
                    "min_p": 0.0,
                    "bias_ids": [],
                    "bias_values": [],
                    "logprobs": -1,
                    "presence_penalty": 0.0,
                    "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0,
                    "repetition_last_n": 0,
                    "prompt_logprobs": -1,
                    "grammar": "",
                },
                "prefix": [],
            },
        },
        0,
        "temperature must be >= 0",
    ),
]


@pytest.mark.parametrize(
    ("header", "payload_len", "match"),
    [case[1:] for case in BAD_HEADERS],
    ids=[case[0] for case in BAD_HEADERS],
)
def test_malformed_header_is_refused_before_the_payload(
    header: Any, payload_len: int, match: str
) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(header, payload_len=payload_len))  # no payload bytes sent
    with pytest.raises(ProtocolError, match=match):
        decoder.next_frame()


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"\xc1", "not valid msgpack"),  # 0xc1 is never used
        (msgpack.packb({"kind": "stop"}) + b"\x00", "not valid msgpack"),  # extra data
        (b"\x81\xa1", "not valid msgpack"),  # truncated map
        (b"\x81\x01\x02", "not valid msgpack"),  # int map key
        (b"\xa2\xff\xfe", "not valid msgpack"),  # invalid utf-8 str
    ],
)
def test_header_that_is_not_msgpack(header: bytes, match: str) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack("<II", len(header), 0) + header)
    with pytest.raises(ProtocolError, match=match):
        decoder.next_frame()


def test_q8_payload_with_bad_scale() -> None:
    header = decode_header(layout={"dtype": "q8", "rows": 1, "cols": 2})
    payload = struct.pack("<f", float("nan")) + b"\x01\x02"
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(header, payload))
    with pytest.raises(ProtocolError, match="scale nan for row 0"):
        decoder.next_frame()


def test_decoder_refuses_use_after_an_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame({"kind": "reboot", "fields": {}}))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        decoder.next_frame()
    assert "state=failed" in repr(decoder)
    with pytest.raises(ProtocolError, match=r"already failed.*unknown message kind"):
        decoder.next_frame()
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.receive_data(encode_frame(Stop(1)))


def test_repr_shows_live_state() -> None:
    data = encode_frame(Decode(1, 0, (1,)), np.zeros((1, 4), np.float32))
    decoder = FrameDecoder()
    assert repr(decoder) == "<FrameDecoder state=prefix buffered=0 frames=0>"
    decoder.receive_data(data[:9])
    assert decoder.next_frame() is NEED_DATA
    assert (
        repr(decoder) == f"<FrameDecoder state=header frame_bytes={len(data)} buffered=9 frames=0>"
    )
    decoder.receive_data(data[9:-1])
    assert decoder.next_frame() is NEED_DATA
    assert "state=payload" in repr(decoder)
    decoder.receive_data(data[-1:])
    assert isinstance(decoder.next_frame(), Frame)
    assert repr(decoder) == "<FrameDecoder state=prefix buffered=0 frames=1>"
    assert repr(NEED_DATA) == "NEED_DATA"


# --- fuzzing: only ProtocolError or NEED_DATA, whatever arrives -----------------------------------


def feed(decoder: FrameDecoder, data: bytes) -> None:
    try:
        decoder.receive_data(data)
        decode_all(decoder)
    except ProtocolError:
        pass


@FAST
@given(st.binary(max_size=300))
def test_random_garbage(data: bytes) -> None:
    feed(FrameDecoder(), data)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["request_id", "position", "tokens", "window_id", "epoch", "chunk_index", "predict", "stats"]
)


@FAST
@given(
    st.sampled_from(["configure", "prefill", "decode", "verify", "cancel", "trim", "stop", "ack"]),
    st.dictionaries(field_names, msgpack_values, max_size=6),
    st.one_of(
        st.none(), st.dictionaries(st.sampled_from(["dtype", "rows", "cols"]), msgpack_values)
    ),
    st.integers(0, 64),
)
def test_random_headers(kind: str, values: dict[str, Any], layout: Any, payload_len: int) -> None:
    header: dict[str, Any] = {"kind": kind, "fields": values}
    if layout is not None:
        header["layout"] = layout
    feed(FrameDecoder(), raw_frame(header, bytes(payload_len)))


@FAST
@given(frames(), st.data())
def test_mutated_frames(case: tuple[Message, Any, ActivationDType], data: st.DataObject) -> None:
    encoded = bytearray(encode_frame(*case))
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.integers(0, len(encoded) - 1))
        encoded[index] = data.draw(st.integers(0, 255))
    feed(FrameDecoder(), bytes(encoded))
