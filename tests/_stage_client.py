"""An honest client of one stage, for tests that must show a stage still serves."""

from __future__ import annotations

import numpy as np
import trio

from stagerun import _proto as proto
from stagerun._wire._connect import open_connection
from stagerun.backends import NumpyBackend


async def honest_request(address: str, backend: NumpyBackend) -> None:
    """A last stage at ``address`` takes a Configure and a prefill, and predicts one token."""
    key = 99
    back = await open_connection(
        address, role=proto.Role.RETURN, key=key, connect_timeout=2, ready_timeout=2
    )
    lane = await open_connection(address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2)
    try:
        with trio.fail_after(10):
            configure = proto.Configure(
                request_id=1, return_key=key, prompt_len=3, sampling=proto.SamplingParams()
            )
            await lane.send(configure, timeout=5)
            assert isinstance((await lane.receive(timeout=5)).message, proto.Ack)
            hidden = np.zeros((3, backend.d_model), np.float32)
            prefill = proto.Prefill(
                request_id=1, chunk_index=0, position=0, tokens=(1, 2, 3), predict=True
            )
            await lane.send(prefill, hidden, "f32", timeout=5)
            reply = (await back.receive(timeout=5)).message
            assert isinstance(reply, proto.Predictions) and len(reply.tokens) == 1
    finally:
        await lane.aclose_forcefully()
        await back.aclose_forcefully()
