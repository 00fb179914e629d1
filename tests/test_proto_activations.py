"""Activation codecs: f32 exact, f16 IEEE half, q8 row-scaled int8 with half-away-from-zero."""

import struct

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stagerun._errors import ProtocolError
from stagerun._proto import (
    ACTIVATION_DTYPES,
    ActivationDType,
    activation_nbytes,
    decode_activations,
    encode_activations,
    parse_activation_dtype,
)

FAST = settings(max_examples=200, deadline=None)
# q8 is within half a step of the input, give or take float32's smallest normal number when
# a row is so small that its scale is subnormal (and so loses bits).
TINY = np.finfo(np.float32).tiny

shapes = st.tuples(st.integers(1, 6), st.integers(1, 40))


def arrays(elements: st.SearchStrategy[float]) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    return hnp.arrays(np.float32, shapes, elements=elements)


def round_trip(array: npt.NDArray[np.float32], dtype: ActivationDType) -> npt.NDArray[np.float32]:
    rows, cols = array.shape
    payload = encode_activations(array, dtype)
    assert len(payload) == activation_nbytes(dtype, rows, cols)
    decoded = decode_activations(payload, dtype, rows, cols)
    assert decoded.dtype == np.float32 and decoded.shape == (rows, cols)
    return decoded


@FAST
@given(arrays(st.floats(width=32)))
def test_f32_is_bit_exact_including_non_finite(array: npt.NDArray[np.float32]) -> None:
    assert round_trip(array, "f32").tobytes() == array.tobytes()


@FAST
@given(arrays(st.floats(-65504, 65504, width=32)))
def test_f16_is_ieee_half(array: npt.NDArray[np.float32]) -> None:
    decoded = round_trip(array, "f16")
    np.testing.assert_array_equal(decoded, array.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(decoded, array, rtol=2**-11, atol=2**-24)


def test_f16_overflow_becomes_infinity_and_nan_stays() -> None:
    array = np.array([[1e5, -1e5, np.nan, np.inf]], dtype=np.float32)
    decoded = round_trip(array, "f16")
    assert decoded[0, 0] == np.inf and decoded[0, 1] == -np.inf
    assert np.isnan(decoded[0, 2]) and decoded[0, 3] == np.inf


@FAST
@given(arrays(st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_q8_is_within_half_a_step_of_f32_in_every_row(array: npt.NDArray[np.float32]) -> None:
    """By value against the exact f32 decode: a row's worst error is half its wire scale.

    The scale on the wire is ``max|row| / 127``, so the bound is ``max|row| / 254`` per row.
    """
    exact = round_trip(array, "f32")
    decoded = round_trip(array, "q8")
    wire_scales = np.array(q8_parts(encode_activations(array, "q8"), len(array))[0], np.float32)
    row_max = np.abs(array).max(axis=1)
    expected = row_max / np.float32(127)
    expected[expected == 0] = 1  # an all-zero row, or one whose max / 127 underflows
    np.testing.assert_allclose(wire_scales, expected, rtol=1e-6)
    row_error = np.abs(decoded - exact).max(axis=1)
    assert np.all(row_error <= wire_scales * (0.5 + 1e-5) + TINY), (row_error, wire_scales)
    assert np.all(row_error <= row_max / 254 * (1 + 1e-5) + TINY), (row_error, row_max)


def q8_parts(payload: bytes, rows: int) -> tuple[list[float], list[int]]:
    scales = list(struct.unpack(f"<{rows}f", payload[: 4 * rows]))
    values = list(np.frombuffer(payload[4 * rows :], dtype=np.int8).tolist())
    return scales, values


def test_q8_rounds_half_away_from_zero() -> None:
    # max|x| = 127 makes the scale exactly 1.0, so x / scale is x itself.
    row = [127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 2.4999998]
    payload = encode_activations(np.array([row], dtype=np.float32), "q8")
    scales, values = q8_parts(payload, 1)
    assert scales == [1.0]
    assert values == [127, 1, -1, 2, -2, 3, -3, 0, 0, 2]


def test_q8_layout_scales_first_then_int8() -> None:
    array = np.array([[0.0, 0.0], [-254.0, 127.0], [1e-45, 0.0]], dtype=np.float32)
    payload = encode_activations(array, "q8")
    assert len(payload) == 3 * 4 + 3 * 2
    scales, values = q8_parts(payload, 3)
    # An all-zero row has scale 1.0; so does a row whose max/127 underflows to zero.
    assert scales == [1.0, 2.0, 1.0]
    assert values == [0, 0, -127, 64, 0, 0]  # 63.5 rounds away from zero
    np.testing.assert_array_equal(
        decode_activations(payload, "q8", 3, 2), [[0, 0], [-254, 128], [0, 0]]
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_q8_refuses_non_finite_input(bad: float) -> None:
    array = np.zeros((2, 3), dtype=np.float32)
    array[1, 2] = bad
    with pytest.raises(ValueError, match=f"row 1, column 2 is {bad}"):
        encode_activations(array, "q8")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, 3e38])
def test_q8_refuses_a_bad_scale_from_the_wire(scale: float) -> None:
    payload = struct.pack("<2f", 1.0, scale) + bytes(4)
    with pytest.raises(ProtocolError, match="for row 1; a scale must be a positive finite"):
        decode_activations(payload, "q8", 2, 2)


@pytest.mark.parametrize("dtype", ACTIVATION_DTYPES)
@pytest.mark.parametrize("delta", [-1, 1])
def test_payload_length_must_match_exactly(dtype: ActivationDType, delta: int) -> None:
    size = activation_nbytes(dtype, 2, 3) + delta
    with pytest.raises(ProtocolError, match=f"need {size - delta} bytes, got {size}"):
        decode_activations(bytes(size), dtype, 2, 3)


def test_decode_accepts_memoryview_and_bytearray() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    payload = encode_activations(array, "f32")
    np.testing.assert_array_equal(decode_activations(memoryview(payload), "f32", 2, 3), array)
    writable = decode_activations(bytearray(payload), "f32", 2, 3)
    writable[0, 0] = 5  # a bytearray payload gives a writable view
    assert decode_activations(payload, "f32", 2, 3).flags.writeable is False


def test_activation_nbytes() -> None:
    assert activation_nbytes("f32", 3, 576) == 3 * 576 * 4
    assert activation_nbytes("f16", 3, 576) == 3 * 576 * 2
    assert activation_nbytes("q8", 3, 576) == 3 * 4 + 3 * 576
    assert activation_nbytes("q8", 0, 576) == 0
    with pytest.raises(ValueError, match="unknown activation dtype 'i4'"):
        activation_nbytes("i4", 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be negative"):
        activation_nbytes("f32", -1, 1)


@pytest.mark.parametrize(
    ("array", "match"),
    [
        ([[1.0]], "numpy array"),
        (np.zeros((1, 2), np.float64), "float32"),
        (np.zeros((1, 2, 3), np.float32), "2-D"),
        (np.zeros((0, 2), np.float32), "must not be empty"),
        (np.zeros((1, 2), ">f4"), "float32"),
    ],
)
@pytest.mark.parametrize("dtype", ACTIVATION_DTYPES)
def test_encode_rejects_bad_arrays(array: object, match: str, dtype: ActivationDType) -> None:
    with pytest.raises(ValueError, match=match):
        encode_activations(array, dtype)  # type: ignore[arg-type]


def test_decode_rejects_bad_layout_arguments() -> None:
    with pytest.raises(ValueError, match="at least"):
        decode_activations(b"", "f32", 0, 1)
    with pytest.raises(ValueError, match="unknown activation dtype"):
        decode_activations(b"", "bf16", 1, 1)  # type: ignore[arg-type]


def test_parse_activation_dtype() -> None:
    assert [parse_activation_dtype(name) for name in ("f32", "f16", "q8")] == ["f32", "f16", "q8"]
    with pytest.raises(ValueError, match="expected one of f32, f16, q8"):
        parse_activation_dtype("F32")


def test_q8_near_float32_max_stays_finite() -> None:
    top = np.finfo(np.float32).max
    array = np.array([[top, -top, top / 2]], dtype=np.float32)
    decoded = round_trip(array, "q8")
    assert np.isfinite(decoded).all()
    assert np.all(np.abs(decoded - array) <= top / 127 * 0.5)


def test_q8_refuses_minus_128_from_the_wire() -> None:
    payload = struct.pack("<2f", 1.0, 1.0) + bytes([0, 1, 0x80, 5])
    with pytest.raises(ProtocolError, match="-128 in row 1"):
        decode_activations(payload, "q8", 2, 2)
