"""The lane of a one-stage pipeline: stage 0 is the last stage too.

What stage 0 computes there are logits. `LocalLane` takes the messages a request would send to
the next stage and answers them as a pipeline's last stage does: it samples the logits by
position from the request's seed (the rule of `stagerun._stage._worker`) and hands back the
same `Predictions`. So a request takes the same steps on one stage as on many; only its prefill
differs (one compute of the whole prompt, not chunks, see `Request.first_token`). Windows are
verified as they are sent, so nothing is ever in flight to cancel.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import trio

from .. import _proto
from .._decide._sampling import sample_rows


class LocalLane:
    """Samples what stage 0 computes, as the last stage of a pipeline would."""

    def __init__(self, sampling: _proto.SamplingParams) -> None:
        self.sampling = sampling
        self._send, self._replies = trio.open_memory_channel[_proto.Predictions](math.inf)

    def __repr__(self) -> str:
        return f"<LocalLane replies={self._replies.statistics().current_buffer_used}>"

    async def send(
        self,
        message: _proto.Message,
        activations: np.ndarray[Any, Any] | None = None,
        dtype: _proto.ActivationDType = "f32",
    ) -> None:
        """Answer a ``Decode`` or ``Verify`` whose ``activations`` are stage 0's logits."""
        if isinstance(message, _proto.Cancel):
            return  # every window was answered when it was sent
        if not isinstance(message, _proto.Decode | _proto.Verify) or activations is None:
            raise TypeError(f"a one-stage pipeline has no next stage to send {message!r} to")
        last_position = message.position + (len(message.tokens) - activations.shape[0])
        self._send.send_nowait(
            _proto.Predictions(
                request_id=message.request_id,
                window_id=getattr(message, "window_id", 0),
                position=message.position,
                tokens=tuple(sample_rows(activations, self.sampling, last_position + 1)),
            )
        )

    async def receive_predictions(self, request_id: int) -> _proto.Predictions:
        return await self._replies.receive()

    async def receive_reply(self, request_id: int) -> _proto.Predictions | _proto.Cancelled:
        return await self._replies.receive()
