"""What the transport suite sends and checks on the wire: frames of every size, compared."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from ... import _proto
from ..._errors import ProtocolError
from ._common import _RECEIVE_SIZE, _Check


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


def _large_frame(payload_bytes: int) -> tuple[_proto.Message, np.ndarray[Any, Any] | None]:
    """A prefill frame whose activations take at least ``payload_bytes`` (rows of 4 bytes x
    cols, cols chosen so that the rows come out whole)."""
    cols = 576 if payload_bytes % (576 * 4) == 0 else 1
    rows = -(-payload_bytes // (cols * 4))
    while rows > _proto.MAX_TOKENS_PER_MESSAGE:  # wider rows for a larger frame
        cols *= 2
        rows = -(-payload_bytes // (cols * 4))
    rng = np.random.default_rng(payload_bytes)
    activations = rng.standard_normal((rows, cols), dtype=np.float32)
    tokens = tuple(i % 1000 for i in range(rows))
    prefill = _proto.Prefill(request_id=2, chunk_index=0, position=0, tokens=tokens, predict=True)
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
