"""A hostile lane past its handshake cannot make a stage buffer without limit.

The attack, against a live ``stagerun stage`` process on loopback: handshake as a lane,
``Configure``, then a flood of ``Trim`` frames whose ``Ack`` replies are never read, then
wide ``Decode`` frames. A stage that reads ahead without limit queues all of it (and its
worker waits forever to write an ``Ack`` nobody reads). A bounded stage stops reading once
its queue is full, so TCP stalls the peer, and its write deadline closes the lane.

The stage runs in a child process so its peak memory (``VmHWM``) can be read from /proc.
"""

from __future__ import annotations

import os
import pathlib
import struct
import sys
import threading
from typing import Any

import numpy as np
import pytest
import trio
from _processes import start_stage
from _stage_client import honest_request

from stagerun import LaneHandshakeError
from stagerun import _proto as proto
from stagerun._stage._server import StageServer, payload_limit
from stagerun._wire._auth import SECRET_ENV, SECRET_FILE_ENV
from stagerun._wire._connect import REPLY_TIMEOUT_ENV, open_connection
from stagerun._wire._framed import FrameStream
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="reads peak memory from /proc"
)

REPLY_TIMEOUT = 1.0  # the stage's write deadline in the test (the smallest it accepts)
TRIMS = 100_000  # ~21 MB of Acks: more than loopback buffers hold, so the Acks back up
WIDE_FRAMES = 40
WIDE_ROWS, WIDE_COLS = 16, 65536  # 4 MiB of f32 activations a frame
GROWTH_LIMIT_MIB = 64  # what the attack may add to the stage's peak memory
CLOSE_WITHIN = 15.0  # seconds from the first hostile byte until the stage closes the lane
KEY = 4242


def _peak_mib(pid: int) -> float:
    """The process's peak resident memory so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some(65536):
        pass


async def _flood(stream: trio.abc.SendStream, blobs: list[bytes], tail: bytes) -> float:
    """Write ``blobs``, then ``tail`` every 50 ms; the time the stage closed the connection."""
    try:
        for blob in blobs:
            await stream.send_all(blob)
        while True:
            await trio.sleep(0.05)
            await stream.send_all(tail)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return trio.current_time()


@pytest.mark.parametrize("wide_first", [False, True], ids=["trims-first", "wide-first"])
async def test_a_lane_that_never_reads_its_acks_is_closed_and_the_stage_stays_small(
    tiny_model_path: pathlib.Path, last_stage_backend: NumpyBackend, wide_first: bool
) -> None:
    """Trims first: the worker soon waits on an Ack nobody reads, the queue fills, reading
    stops, and the write deadline closes the lane. Wide frames first: the worker refuses them
    as fast as they come, so only the queue's byte bound keeps the stage small."""
    env = {**os.environ, REPLY_TIMEOUT_ENV: f"{REPLY_TIMEOUT:g}"}
    env.pop(SECRET_ENV, None)
    env.pop(SECRET_FILE_ENV, None)
    command = [
        sys.executable, "-m", "stagerun", "stage", "--model", str(tiny_model_path),
        "--layers", "2:4", "--index", "1", "--threads", "1",
    ]  # fmt: skip
    trim = proto.encode_frame(proto.Trim(request_id=1, position=0))
    wide = proto.encode_frame(
        proto.Decode(request_id=1, position=0, tokens=(1,) * WIDE_ROWS),
        np.ones((WIDE_ROWS, WIDE_COLS), np.float32),
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            proc, address = await start_stage(nursery, command, env=env, stderr=bytearray())
            try:
                await honest_request(address, last_stage_backend)  # warm: every path imported
                before = _peak_mib(proc.pid)

                back = await open_connection(
                    address, role=proto.Role.RETURN, key=KEY, connect_timeout=5, ready_timeout=5
                )
                nursery.start_soon(_drain, back.stream)  # only the lane's Acks go unread
                lane = await open_connection(
                    address, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5
                )
                await lane.send(
                    proto.Configure(request_id=1, return_key=KEY, prompt_len=1), timeout=5
                )
                blobs = [trim * TRIMS, *[wide] * WIDE_FRAMES]
                started, closed_at = trio.current_time(), None

                async def attack() -> None:
                    nonlocal closed_at
                    with trio.move_on_after(CLOSE_WITHIN):
                        closed_at = await _flood(
                            lane.stream, blobs[::-1] if wide_first else blobs, trim
                        )

                async with trio.open_nursery() as attacking:
                    attacking.start_soon(attack)
                    await trio.sleep(0.2)
                    await honest_request(address, last_stage_backend)  # served meanwhile
                growth = _peak_mib(proc.pid) - before
                print(
                    f"stage peak memory {before:.0f} MiB -> +{growth:.0f} MiB; lane closed "
                    + ("never" if closed_at is None else f"after {closed_at - started:.2f} s")
                )
                assert growth < GROWTH_LIMIT_MIB, (
                    f"the attack grew the stage's peak memory by {growth:.0f} MiB"
                )
                assert closed_at is not None, f"the lane was still open after {CLOSE_WITHIN} s"
                await lane.aclose_forcefully()
                await back.aclose_forcefully()
                await honest_request(address, last_stage_backend)  # the stage still serves
            finally:
                proc.kill()
                nursery.cancel_scope.cancel()


# -- sessions: what all the lanes of one stage may hold together -------------------------------


async def _lane(address: str, key: int) -> tuple[FrameStream, FrameStream]:
    """A lane to the last stage at ``address`` and its return connection, parked as ``key``."""
    back = await open_connection(
        address, role=proto.Role.RETURN, key=key, connect_timeout=5, ready_timeout=5
    )
    lane = await open_connection(address, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5)
    return lane, back


async def _reply(stream: FrameStream) -> proto.Message:
    return (await stream.receive(timeout=5)).message


async def test_configures_past_the_stage_limit_get_an_error_and_no_lane_closes(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None, max_sessions=3)
    address = await nursery.start(server.serve)
    with trio.fail_after(20):
        lanes = [await _lane(address, key) for key in (1, 2, 3)]
        replies: dict[int, proto.Message] = {}
        for n, (lane, _back) in enumerate(lanes):  # two requests a lane: six, one stage
            for request_id in (10 * n + 1, 10 * n + 2):
                await lane.send(proto.Configure(request_id=request_id, return_key=n + 1,
                                                prompt_len=1), timeout=5)  # fmt: skip
                replies[request_id] = await _reply(lane)
        opened = [rid for rid, reply in replies.items() if isinstance(reply, proto.Ack)]
        refused = [reply for reply in replies.values() if isinstance(reply, proto.Error)]
        assert opened == [1, 2, 11] and len(refused) == 3, replies
        assert all("max_sessions=3" in error.message for error in refused), refused
        assert server.sessions_open == 3 and server.session_budget.sessions == 3
        # No lane was closed: the refused request computes nothing, the lane still answers.
        lane, back = lanes[2]
        hidden = np.ones((1, last_stage_backend.d_model), np.float32)
        await lane.send(proto.Decode(request_id=21, position=0, tokens=(1,)), hidden, timeout=5)
        assert "not configured" in getattr(await _reply(back), "message", "")
        # A Stop gives its session back; the lane that was refused now opens its request.
        await lanes[0][0].send(proto.Stop(request_id=1), timeout=5)
        assert isinstance(await _reply(lanes[0][0]), proto.Ack)
        await lane.send(proto.Configure(request_id=21, return_key=3, prompt_len=1), timeout=5)
        assert isinstance(await _reply(lane), proto.Ack)
        await lane.send(proto.Decode(request_id=21, position=0, tokens=(1,)), hidden, timeout=5)
        assert isinstance(await _reply(back), proto.Predictions)
        assert server.protocol_errors == 0
        for lane, back in lanes:
            await lane.aclose_forcefully()
            await back.aclose_forcefully()
        while server.lanes_open:  # noqa: ASYNC110 -- the server's counters have no events
            await trio.sleep(0.01)
        assert server.session_budget.sessions == server.session_budget.kv_tokens == 0


async def test_kv_positions_past_the_stage_limit_get_an_error_and_the_lane_carries_on(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None, max_kv_tokens=8)
    address = await nursery.start(server.serve)
    d_model = last_stage_backend.d_model

    def prefill(request_id: int, position: int, size: int) -> proto.Prefill:
        return proto.Prefill(request_id=request_id, chunk_index=0, position=position,
                             tokens=(1,) * size, predict=True)  # fmt: skip

    with trio.fail_after(20):
        (a, a_back), (b, b_back) = await _lane(address, 1), await _lane(address, 2)
        for lane, key in ((a, 1), (b, 2)):
            await lane.send(proto.Configure(request_id=key, return_key=key, prompt_len=6),
                            timeout=5)  # fmt: skip
            assert isinstance(await _reply(lane), proto.Ack)
        await a.send(prefill(1, 0, 6), np.ones((6, d_model), np.float32), timeout=5)
        assert isinstance(await _reply(a_back), proto.Predictions)
        # A position far past the cache is a gap: it fails, and charges no more than its rows.
        await b.send(prefill(2, 8000, 2), np.ones((2, d_model), np.float32), timeout=5)
        assert "leaves a gap" in getattr(await _reply(b_back), "message", "")
        await b.send(prefill(2, 0, 6), np.ones((6, d_model), np.float32), timeout=5)
        error = await _reply(b_back)
        assert isinstance(error, proto.Error) and "max_kv_tokens=8" in error.message, error
        assert server.session_budget.kv_tokens == 8
        # The first request ends: its positions are given back, and the second one computes.
        await a.send(proto.Stop(request_id=1), timeout=5)
        assert isinstance(await _reply(a), proto.Ack)
        await b.send(prefill(2, 0, 6), np.ones((6, d_model), np.float32), timeout=5)
        assert isinstance(await _reply(b_back), proto.Predictions)
        assert server.session_budget.kv_tokens == 6 and server.protocol_errors == 0
        for stream in (a, a_back, b, b_back):
            await stream.aclose_forcefully()


def test_a_stage_takes_no_payload_larger_than_its_model_needs(tiny_model: ModelFile) -> None:
    """`stagerun stage` limits a frame's activations to the model's longest honest message
    (the whole context, in float32), far below the wire format's 512 MiB."""
    c = tiny_model.config
    assert payload_limit(tiny_model) == c.context_length * c.d_model * 4
    assert payload_limit(tiny_model) < proto.DEFAULT_MAX_PAYLOAD_BYTES


async def test_a_frame_announcing_more_than_the_limit_is_refused_from_its_prefix(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    """Eight bytes that announce a payload over the stage's limit close the lane at once: the
    stage never waits for (or buffers) the rest."""
    server = StageServer(last_stage_backend, index=1, secret=None, max_payload_bytes=4096)
    address = await nursery.start(server.serve)
    lane = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
    )
    await lane.stream.send_all(struct.pack("<II", 64, 4097))
    with trio.fail_after(5):
        assert await lane.stream.receive_some(4096) == b""  # closed, not waiting for 4 KB
        while server.protocol_errors != 1:  # noqa: ASYNC110 -- a counter, no event
            await trio.sleep(0.01)
    await lane.aclose_forcefully()


# -- a compute that hangs: the liveness probe must see it ---------------------------------------


async def test_a_stage_whose_compute_hangs_refuses_handshakes_until_it_moves_again(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compute thread stuck in its backend left the stage's loop answering handshakes, so
    # the supervisor's liveness probe never killed it. Past its stall timeout without
    # progress the stage now refuses them (the probe's failure), and takes them again once
    # it moves.
    gate = threading.Event()
    computes = last_stage_backend.forward_batch

    def hanging(items: list[Any]) -> list[Any]:
        gate.wait(30)
        return computes(items)

    monkeypatch.setattr(last_stage_backend, "forward_batch", hanging)
    server = StageServer(
        last_stage_backend, index=1, secret=None, inline_compute_ms=0.0, stall_timeout=1.0
    )
    address = await nursery.start(server.serve)
    with trio.fail_after(20):
        lane, back = await _lane(address, 1)
        await lane.send(proto.Configure(request_id=1, return_key=1, prompt_len=1), timeout=5)
        assert isinstance(await _reply(lane), proto.Ack)
        hidden = np.ones((1, last_stage_backend.d_model), np.float32)
        await lane.send(proto.Decode(request_id=1, position=0, tokens=(1,)), hidden, timeout=5)
        probe = await open_connection(
            address, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5
        )
        await probe.aclose_forcefully()  # hanging, but not for long yet
        await trio.sleep(1.3)
        with pytest.raises(LaneHandshakeError, match="no progress for"):
            await open_connection(address, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5)
        gate.set()
        assert isinstance(await _reply(back), proto.Predictions)
        probe = await open_connection(
            address, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5
        )
        await probe.aclose_forcefully()
        for stream in (probe, lane, back):
            await stream.aclose_forcefully()
