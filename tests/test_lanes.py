"""Lane pool semantics (the original PersistentStageLanePool), over real loopback TCP."""

from __future__ import annotations

import pytest
import trio

from stagerun import _proto
from stagerun._driver._lanes import LANE_READY_TIMEOUT, LanePool
from stagerun._errors import LaneHandshakeError
from stagerun._wire._connect import (
    DEFAULT_REPLY_TIMEOUT,
    REPLY_TIMEOUT_ENV,
    open_connection,
    stage_reply_timeout,
)
from stagerun._wire._framed import FrameStream, server_handshake
from stagerun.transports import TcpTransport


class FakeStage:
    """A minimal downstream: handshakes, parks return connections, acks every request.

    ``behaviour`` may be ``"ack"`` (default), ``"silent_ready"`` (accept, never say READY) or
    ``"mute"`` (READY, then never answer).
    """

    def __init__(self, behaviour: str = "ack") -> None:
        self.behaviour = behaviour
        self.lanes: list[FrameStream] = []
        self.received: list[_proto.Message] = []
        self.address = ""

    async def handle(self, stream: trio.abc.Stream, peer: str) -> None:
        if self.behaviour == "silent_ready":
            await trio.sleep_forever()
        framed, hello = await server_handshake(stream, peer=peer)
        if hello.role == _proto.Role.RETURN:
            try:
                await framed.receive()
            except Exception:
                return
            return
        self.lanes.append(framed)
        while True:
            try:
                frame = await framed.receive()
            except Exception:
                return
            self.received.append(frame.message)
            if self.behaviour == "ack":
                await framed.send(
                    _proto.Ack(request_id=frame.message.request_id, stats=_proto.StageStats())
                )


async def start_fake(nursery: trio.Nursery, behaviour: str = "ack") -> FakeStage:
    fake = FakeStage(behaviour)
    fake.address = await nursery.start(TcpTransport().serve, "tcp://127.0.0.1:0", fake.handle)
    return fake


def test_reply_timeout_from_environment() -> None:
    assert stage_reply_timeout({}) == DEFAULT_REPLY_TIMEOUT == 30.0
    assert stage_reply_timeout({REPLY_TIMEOUT_ENV: "12"}) == 12.0
    assert stage_reply_timeout({REPLY_TIMEOUT_ENV: "0"}) == 1.0
    assert stage_reply_timeout({REPLY_TIMEOUT_ENV: "99999"}) == 3600.0
    assert stage_reply_timeout({REPLY_TIMEOUT_ENV: "soon"}) == 30.0
    assert stage_reply_timeout({REPLY_TIMEOUT_ENV: "nan"}) == 30.0


# Deadlines are checked on Trio's clock: the configured one must have run out (a lower bound a
# busy machine cannot break), and the failure must come long before the default would fire (an
# upper bound of half the default, many times the configured deadline).


async def test_silent_downstream_fails_within_ready_deadline(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, "silent_ready")
    pool = LanePool(fake.address, capacity=1, ready_timeout=0.25)
    started = trio.current_time()
    with pytest.raises(LaneHandshakeError, match=r"did not become ready within 0\.25s"):
        await pool.start()
    assert 0.25 <= trio.current_time() - started < LANE_READY_TIMEOUT / 2


async def test_checkout_connect_uses_short_deadline(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, "silent_ready")
    pool = LanePool(fake.address, capacity=1, steady_timeout=0.2)
    started = trio.current_time()
    with pytest.raises(LaneHandshakeError, match=r"did not become ready within 0\.2s"):
        async with pool.checkout(1):
            pass
    assert 0.2 <= trio.current_time() - started < LANE_READY_TIMEOUT / 2


async def test_nothing_listening_is_a_clear_error() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    pool = LanePool(f"tcp://127.0.0.1:{port}", capacity=1, connect_timeout=1)
    with pytest.raises(LaneHandshakeError, match="could not connect"):
        await pool.start()


async def test_a_stage_and_its_standbys_all_down_names_every_address() -> None:
    ports = []
    for _ in range(2):
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        ports.append(listener.getsockname()[1])
        listener.close()
    primary, standby = (f"tcp://127.0.0.1:{port}" for port in ports)
    with pytest.raises(LaneHandshakeError) as info:
        await open_connection(
            f"{primary},{standby}", role=_proto.Role.LANE, connect_timeout=1, ready_timeout=1
        )
    message = str(info.value)
    assert message.startswith(f"no address of the stage answered ({primary}: could not connect")
    assert f"; {standby}: could not connect" in message


async def test_clean_request_sends_stop_and_reuses_lane_lifo(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=2) as pool:
        assert repr(pool) == "<LanePool capacity=2 idle=2 busy=0 next_id=2>"
        async with pool.checkout(7) as lane:
            assert lane.id == 1  # the most recently pushed lane comes out first
            assert pool.busy == 1
        assert isinstance(fake.received[-1], _proto.Stop)
        assert fake.received[-1].request_id == 7
        async with pool.checkout(8) as again:
            assert again.id == 1  # returned last, lent first
        assert pool.idle == 2 and pool.busy == 0


async def test_dead_pooled_lane_is_replaced_at_checkout(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=1) as pool:
        await fake.lanes[0].aclose()  # the stage drops the idle lane
        await trio.sleep(0.05)
        async with pool.checkout(1) as lane:
            assert lane.id == 1


async def test_lane_with_stale_bytes_is_not_reused(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=1) as pool:
        await fake.lanes[0].send(_proto.Ack(request_id=99, stats=_proto.StageStats()))
        await trio.sleep(0.05)
        async with pool.checkout(1) as lane:
            assert lane.id == 1
        assert not any(getattr(m, "request_id", None) == 99 for m in fake.received)


async def test_failed_request_replaces_lane_without_stop(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=1) as pool:
        with pytest.raises(RuntimeError):
            async with pool.checkout(5) as lane:
                assert lane.id == 0
                raise RuntimeError("request failed")
        assert not any(isinstance(m, _proto.Stop) for m in fake.received)
        assert pool.replaced == 1 and pool.idle == 1
        async with pool.checkout(6) as lane:
            assert lane.id == 1


async def test_cancelled_request_replaces_lane(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=1) as pool:
        with trio.move_on_after(0.05):
            async with pool.checkout(5):
                await trio.sleep_forever()
        assert pool.replaced == 1 and pool.idle == 1 and pool.busy == 0


async def test_unanswered_stop_times_out_and_replaces(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, "mute")
    async with LanePool(fake.address, capacity=1, reply_timeout=0.2) as pool:
        started = trio.current_time()
        async with pool.checkout(3):
            pass
        assert 0.2 <= trio.current_time() - started < DEFAULT_REPLY_TIMEOUT / 2
        assert pool.replaced == 1


async def test_lane_ids_never_repeat(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    async with LanePool(fake.address, capacity=2) as pool:
        seen: list[int] = []

        for i in range(6):
            try:
                async with pool.checkout(i) as lane:
                    seen.append(lane.id)
                    if i % 2:
                        raise KeyError(i)
            except KeyError:
                pass
        # A returned lane keeps its id; every replacement gets an id never used before.
        assert seen == [1, 1, 2, 2, 3, 3]
        assert pool.replaced == 3
        assert repr(pool).endswith("next_id=5>")


async def test_frames_sent_at_once_arrive_whole_and_a_cancelled_send_breaks_nothing() -> None:
    # The send lock is taken without a scheduler trip when free; frames of tasks sending at
    # once must still go out one after the other (the pipe below delivers 1 kB at a time, so
    # every send_all blocks mid-frame), and a send cancelled before it starts breaks nothing.
    import numpy as np
    import trio.testing

    left, right = trio.testing.lockstep_stream_pair()
    sender, receiver = FrameStream(left, peer="a"), FrameStream(right, peer="b")
    rows = {k: np.full((1, 16384), k, np.float32) for k in range(6)}  # 64 kB a frame

    async def send(k: int) -> None:
        await sender.send(_proto.Decode(request_id=k + 1, position=0, tokens=(1,)), rows[k])

    got: dict[int, float] = {}
    async with trio.open_nursery() as nursery:
        for k in rows:
            nursery.start_soon(send, k)
        for _ in rows:
            frame = await receiver.receive(timeout=10)
            assert frame.activations is not None
            got[frame.message.request_id - 1] = float(frame.activations.mean())
    assert got == {k: float(k) for k in rows}
    with trio.CancelScope() as scope:
        scope.cancel()
        await send(0)
    assert not sender.broken
