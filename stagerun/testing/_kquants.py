"""Writing K-quant blocks (Q4_K, Q5_K, Q6_K), which gguf-py can read but not write.

Most published GGUF files store their matrices in K-quants, so test files need them too.
These are plain round-to-nearest quantizers of ggml's block layouts (``block_q4_K``,
``block_q5_K``, ``block_q6_K`` in ggml-common.h), not llama.cpp's error-minimizing search:
their blocks are valid and decode (with gguf-py or llama.cpp) to within a quantization
step of the input, which is all a test file needs. 256 values make a super-block:

* Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit minimum
  (packed into 12 bytes) relative to the super-block's float16 ``d`` and ``dmin``; a value is
  ``d * scale * q - dmin * min`` with ``q`` of 4 bits (Q4_K) or 5 (Q5_K, its fifth bit in
  ``qh``).
* Q6_K: sixteen sub-blocks of 16, each with a signed 8-bit scale relative to ``d``; a value
  is ``d * scale * (q - 32)`` with ``q`` of 6 bits (4 in ``ql``, 2 in ``qh``).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["K_QUANTS", "quantize_k"]

QK_K: Final = 256
K_QUANTS: Final = ("Q4_K", "Q5_K", "Q6_K")

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def quantize_k(values: npt.ArrayLike, kind: str) -> U8:
    """``values`` (rows of a multiple of 256) as ``kind`` blocks: ``uint8 [rows, bytes]``."""
    x = np.asarray(values, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} values, not {x.shape}.")
    blocks = x.reshape(-1, QK_K)
    if kind == "Q6_K":
        packed = _q6_k(blocks)
    elif kind in ("Q4_K", "Q5_K"):
        packed = _q45_k(blocks, bits=4 if kind == "Q4_K" else 5)
    else:
        raise ValueError(f"unknown K-quant {kind!r}; expected one of {', '.join(K_QUANTS)}.")
    return packed.reshape(x.shape[0], -1)


def _f16(x: F32) -> U8:
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _super_scale(per_sub: F32, levels: int) -> tuple[F32, npt.NDArray[np.int64]]:
    """A float16 super-block scale and the sub-blocks' scales in ``0..levels`` against it."""
    d = np.asarray(per_sub.max(axis=1) / levels, np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)[:, None]
    quantized = np.clip(np.rint(per_sub / safe), 0, levels).astype(np.int64)
    return d, quantized


def _q45_k(blocks: F32, *, bits: int) -> U8:
    n = blocks.shape[0]
    top = (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)  # a value is scale * q - min, min >= 0
    high = sub.max(axis=2)
    d, sc = _super_scale((high - low) / top, 63)
    dmin, mn = _super_scale(-low, 63)
    step = (d[:, None] * sc)[:, :, None]
    offset = (dmin[:, None] * mn)[:, :, None]
    q = np.clip(np.rint((sub + offset) / np.where(step > 0, step, 1.0)), 0, top).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    sc8, mn8 = sc.astype(np.uint8), mn.astype(np.uint8)
    scales[:, 0:4] = sc8[:, :4] | ((sc8[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn8[:, :4] | ((mn8[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc8[:, 4:] & 0x0F) | ((mn8[:, 4:] & 0x0F) << 4)
    # byte k of pair j: sub-block 2j's value k in the low nibble, 2j+1's in the high one
    nibbles = q & 0x0F
    qs = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(n, 128).astype(np.uint8)
    parts: list[U8] = [_f16(d), _f16(dmin), scales]
    if bits == 5:  # bit s of byte k: the fifth bit of sub-block s's value k
        fifth = (q >> 4) & 1
        qh = np.zeros((n, 32), np.uint8)
        for s in range(8):
            qh |= fifth[:, s] << s
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(blocks: F32) -> U8:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 32.0  # a value is scale * (q - 32), q - 32 in -32..31
    d = np.asarray(scale.max(axis=1) / 127.0, np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, None]), 0, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    signed = np.clip(np.rint(sub / np.where(step > 0, step, 1.0)), -32, 31).astype(np.int16)
    q = (signed + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 values
    ql = np.zeros((n, 2, 64), np.uint8)
    qh = np.zeros((n, 2, 32), np.uint8)
    for j in range(2):  # value j*64 + c of a half: low nibble (j=0) or high (j=1) of ql[c]
        ql |= (q[:, :, j * 64 : (j + 1) * 64] & 0x0F) << (4 * j)
    for s in range(4):  # value s*32 + c of a half: bits 2s, 2s+1 of qh[c]
        qh |= ((q[:, :, s * 32 : (s + 1) * 32] >> 4) & 0x03) << (2 * s)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16(d)], axis=1
    )
