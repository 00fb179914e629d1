"""The frames a lane has read and not yet carried out, bounded in frames and in bytes.

`stagerun._stage._worker.LaneWorker`'s reader waits for room before it reads the next frame,
so a peer that sends faster than the stage computes is stalled by TCP instead of making the
stage buffer: what one lane holds is `MAX_QUEUED_FRAMES` frames and about `MAX_QUEUED_BYTES`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from .. import _proto

__all__ = ["MAX_QUEUED_BYTES", "MAX_QUEUED_FRAMES", "FrameQueue", "held_bytes"]

# Stage 0 keeps at most 64 verify windows (MAX_VERIFY_WINDOW_DEPTH) and their Cancels, or
# its prefill credit (3 chunks by default), in flight on a lane: 512 frames is 4x that.
MAX_QUEUED_FRAMES = 512
# What the queued frames may hold (activations, token ids) before the reader pauses: the
# verify windows of any model at the default depth, or the next prefill chunk or two (the
# ones after it wait in TCP: the worker computes one chunk at a time anyway).
MAX_QUEUED_BYTES = 16 << 20
_FRAME_BYTES = 256  # a decoded frame's own objects, roughly (a header-only frame)
_TOKEN_BYTES = 36  # one token id in a message: its int and its slot in the tuple


def held_bytes(frame: _proto.Frame) -> int:
    """Roughly the memory a decoded frame holds while it is queued."""
    tokens = getattr(frame.message, "tokens", ())
    payload = frame.activations.nbytes if frame.activations is not None else 0
    return _FRAME_BYTES + _TOKEN_BYTES * len(tokens) + payload


class FrameQueue:
    """The frames read off a lane and not yet carried out, bounded in frames and in bytes.

    The reader waits for room before it reads a frame (`wait_for_room`), so the queue holds
    at most ``max_frames`` frames, and past ``max_bytes`` by one frame at most. The worker
    waits for a frame (`get`), which is None once the reader has closed the queue and it is
    empty.
    """

    def __init__(self, *, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.bytes = 0
        self.closed = False
        self._frames: deque[_proto.Frame] = deque()
        self._changed = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return (
            f"<FrameQueue frames={len(self._frames)}/{self.max_frames} "
            f"bytes={self.bytes}/{self.max_bytes} closed={self.closed}>"
        )

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def full(self) -> bool:
        return len(self._frames) >= self.max_frames or self.bytes >= self.max_bytes

    async def wait_for_room(self) -> None:
        while self.full:
            await self._changed.park()

    def put(self, frame: _proto.Frame) -> None:
        self._frames.append(frame)
        self.bytes += held_bytes(frame)
        self._changed.unpark_all()

    def close(self) -> None:
        self.closed = True
        self._changed.unpark_all()

    async def get(self) -> _proto.Frame | None:
        while not self._frames:
            if self.closed:
                return None
            await self._changed.park()
        frame = self._frames.popleft()
        self.bytes -= held_bytes(frame)
        self._changed.unpark_all()
        return frame

    def drop(self, unwanted: Callable[[_proto.Message], bool]) -> int:
        """Remove the queued frames whose message is ``unwanted``; how many there were."""
        kept = deque(frame for frame in self._frames if not unwanted(frame.message))
        dropped = len(self._frames) - len(kept)
        if dropped:
            self._frames = kept
            self.bytes = sum(held_bytes(frame) for frame in kept)
            self._changed.unpark_all()
        return dropped
