"""Activation payload codecs: f32, f16 and q8 (row-scaled int8), always decoded to float32.

Theory of operation
-------------------
Activations cross a hop as a token-major ``[rows, cols]`` matrix (one row per token, ``cols`` =
the model width). The frame header carries the layout (dtype, rows, cols); the payload is raw
little-endian bytes whose length follows from the layout alone (:func:`activation_nbytes`), so
the decoder can check it before reading anything.

* ``f32``: the float32 values as they are. Non-finite values pass through unchanged; decoding
  uses ``np.frombuffer``, so the result is a read-only view of the payload (no copy).
* ``f16``: IEEE half precision (numpy's round-to-nearest-even cast). Values beyond +-65504
  become +-inf and NaN stays NaN, as in the original runtime: f16 halves the payload, and a
  model whose activations overflow it should use f32 or q8.
* ``q8``: first ``rows`` float32 scales, then ``rows * cols`` int8 values. A row's scale is
  ``max|x| / 127`` (1.0 for an all-zero row); each value is ``x / scale`` rounded half away
  from zero and clamped to [-127, 127]; decoding multiplies back, so every element is within
  half a scale step of the original (give or take float32's smallest normal number, 1.2e-38,
  for a row so small that its scale is subnormal). Non-finite input cannot be scaled, so
  encoding it raises ``ValueError`` instead of sending garbage. Decoding refuses
  (``ProtocolError``) a scale that is not positive and finite, or so large that
  ``127 * scale`` would overflow, and the int8 value -128: so a decoded q8 matrix is always
  finite.

Encoding errors are ``ValueError`` (the caller passed a bad array); decoding errors about the
payload are ``ProtocolError`` (the peer sent bad bytes).
"""

from typing import Final, Literal, TypeAlias, cast, get_args

import numpy as np
import numpy.typing as npt

from .._errors import ProtocolError

ActivationDType: TypeAlias = Literal["f32", "f16", "q8"]
"""The wire encodings of an activation matrix."""

ACTIVATION_DTYPES: Final[tuple[ActivationDType, ...]] = get_args(ActivationDType)

_F32: Final = np.dtype("<f4")
_F16: Final = np.dtype("<f2")
_Q8_MAX: Final = 127


def _largest_q8_scale() -> np.float32:
    """The largest float32 scale whose 127 steps stay finite: decoding can never overflow."""
    scale = np.float32(float(np.finfo(np.float32).max) / _Q8_MAX)
    with np.errstate(over="ignore"):
        while not np.isfinite(scale * np.float32(_Q8_MAX)):
            scale = np.nextafter(scale, np.float32(0))
    return scale


_Q8_MAX_SCALE: Final = _largest_q8_scale()


def _unknown_dtype(dtype: object) -> ValueError:
    return ValueError(
        f"unknown activation dtype {dtype!r}; expected one of {', '.join(ACTIVATION_DTYPES)}."
    )


def parse_activation_dtype(text: str) -> ActivationDType:
    """Return ``text`` as an :data:`ActivationDType` (for command lines and config files).

    Raises:
        ValueError: ``text`` is not one of ``f32``, ``f16``, ``q8``.
    """
    if text not in ACTIVATION_DTYPES:
        raise _unknown_dtype(text)
    return text


def activation_nbytes(dtype: ActivationDType, rows: int, cols: int) -> int:
    """Return the exact payload length of a ``[rows, cols]`` matrix encoded as ``dtype``.

    Raises:
        ValueError: unknown dtype, or negative rows or cols.
    """
    if rows < 0 or cols < 0:
        raise ValueError(f"activation shape [{rows}, {cols}] must not be negative.")
    if dtype == "f32":
        return 4 * rows * cols
    if dtype == "f16":
        return 2 * rows * cols
    if dtype == "q8":
        return 4 * rows + rows * cols
    raise _unknown_dtype(dtype)


def _check_array(array: object) -> npt.NDArray[np.float32]:
    if not isinstance(array, np.ndarray):
        raise ValueError(f"activations must be a numpy array, got {type(array).__name__}.")
    if array.dtype != np.float32 or array.ndim != 2:
        raise ValueError(
            f"activations must be a 2-D float32 [tokens, width] array, "
            f"got {array.dtype} with shape {array.shape}."
        )
    if array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"activations must not be empty, got shape {array.shape}.")
    return cast(npt.NDArray[np.float32], array)


def _quantize_q8(array: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    finite = np.isfinite(array)
    if not finite.all():
        row, col = (int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(
            f"q8 cannot encode non-finite activations (row {row}, column {col} is "
            f"{array[row, col]}); send f32 or f16 instead."
        )
    rows, cols = array.shape
    out = np.empty(4 * rows + rows * cols, dtype=np.uint8)
    scales = out[: 4 * rows].view(_F32)
    np.divide(np.abs(array).max(axis=1), np.float32(_Q8_MAX), out=scales)
    # An all-zero row gets scale 1.0; so does a row so tiny that max/127 underflows to zero.
    scales[scales == 0] = 1.0
    # Rows within a few ulps of float32's max: 127 * scale must stay finite (clamping absorbs it).
    np.minimum(scales, _Q8_MAX_SCALE, out=scales)
    ratio = array / scales[:, None]
    # Half away from zero, exactly: the fractional part of a float is exact, unlike ``x + 0.5``.
    whole = np.trunc(ratio)
    whole += np.where(np.abs(ratio - whole) >= 0.5, np.sign(ratio), 0)
    np.clip(whole, -_Q8_MAX, _Q8_MAX, out=whole)
    out[4 * rows :].view(np.int8).reshape(rows, cols)[...] = whole
    return out


def activation_buffer(
    array: npt.NDArray[np.float32], dtype: ActivationDType
) -> npt.NDArray[np.uint8]:
    """Encode ``array`` into a flat byte array, without the final copy into ``bytes``.

    :func:`encode_frame` writes this straight into the frame; f32 input that is already
    C-contiguous and little-endian is not copied at all.

    Raises:
        ValueError: ``array`` is not a non-empty 2-D float32 array, the dtype is unknown, or
            q8 was asked to encode NaN or infinity.
    """
    array = _check_array(array)
    if dtype == "f32":
        encoded = np.ascontiguousarray(array, dtype=_F32)
    elif dtype == "f16":
        with np.errstate(over="ignore"):  # overflow to +-inf is the documented f16 behaviour
            encoded = np.ascontiguousarray(array.astype(_F16))
    elif dtype == "q8":
        return _quantize_q8(array)
    else:
        raise _unknown_dtype(dtype)
    return encoded.reshape(-1).view(np.uint8)


def encode_activations(array: npt.NDArray[np.float32], dtype: ActivationDType) -> bytes:
    """Encode a float32 ``[rows, cols]`` array as the ``dtype`` wire payload.

    Raises:
        ValueError: ``array`` is not a non-empty 2-D float32 array, the dtype is unknown, or
            q8 was asked to encode NaN or infinity.
    """
    return activation_buffer(array, dtype).tobytes()


def decode_activations(
    payload: bytes | bytearray | memoryview, dtype: ActivationDType, rows: int, cols: int
) -> npt.NDArray[np.float32]:
    """Decode a ``dtype`` payload into a float32 ``[rows, cols]`` array.

    For f32 the result is a view of ``payload`` (read-only when ``payload`` is ``bytes``);
    f16 and q8 return a new array.

    Raises:
        ValueError: unknown dtype, or rows or cols below 1.
        ProtocolError: the payload length does not match the layout, or a q8 scale is not a
            positive finite number.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"activation shape [{rows}, {cols}] must be at least [1, 1].")
    expected = activation_nbytes(dtype, rows, cols)
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size != expected:
        raise ProtocolError(
            f"{dtype} activations of shape [{rows}, {cols}] need {expected} bytes, got {size}."
        )
    if dtype == "f32":
        values = np.frombuffer(payload, dtype=_F32).reshape(rows, cols)
        return values.astype(np.float32, copy=False)
    if dtype == "f16":
        return np.frombuffer(payload, dtype=_F16).reshape(rows, cols).astype(np.float32)
    scales = np.frombuffer(payload, dtype=_F32, count=rows)
    bad = ~((scales > 0) & (scales <= _Q8_MAX_SCALE))  # NaN fails both comparisons
    if bad.any():
        row = int(np.argmax(bad))
        raise ProtocolError(
            f"q8 activations carry scale {scales[row]} for row {row}; a scale must be a "
            f"positive finite number no larger than {_Q8_MAX_SCALE}."
        )
    quantized = np.frombuffer(payload, dtype=np.int8, offset=4 * rows).reshape(rows, cols)
    if quantized.min() < -_Q8_MAX:
        row = int(np.argmax((quantized < -_Q8_MAX).any(axis=1)))
        raise ProtocolError(f"q8 activations hold -128 in row {row}; values lie in [-127, 127].")
    result = quantized.astype(np.float32)
    result *= scales.astype(np.float32)[:, None]
    return result
