"""Fuzzing a live stage: random and mutated handshakes and frames must not hurt it.

Every example starts a real stage (the tiny model's last layers, over TCP on loopback), throws
a handful of hostile connections at it, then checks that it is still up: an honest lane
completes a prefill and gets its prediction. Hostile input ends only its own connection, as a
refused handshake or a lane closed for a `ProtocolError`; nothing is computed from it, and no
announced length makes the stage wait for (or buffer) more than the frame limits allow.

`test_fuzz_lane.py` goes past the handshake, to the stage's message handling and compute.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import trio
from _stage_client import honest_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerun import _proto as proto
from stagerun._stage._server import StageServer
from stagerun._wire._connect import open_connection
from stagerun.backends import NumpyBackend

HELLO = proto.encode_hello(proto.Role.LANE)


def _valid_frames(d_model: int) -> list[bytes]:
    hidden = np.ones((3, d_model), np.float32)
    configure = proto.Configure(
        request_id=7, return_key=1, prompt_len=3, sampling=proto.SamplingParams()
    )
    prefill = proto.Prefill(
        request_id=7, chunk_index=0, position=0, tokens=(1, 2, 3), predict=False
    )
    return [
        proto.encode_frame(configure),
        proto.encode_frame(prefill, hidden, "f16"),
        proto.encode_frame(proto.Stop(request_id=7)),
    ]


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for index, value in flips:
        if out:
            out[index % len(out)] = value
    return bytes(out if cut is None else out[: cut % (len(out) + 1)])


hostile_payloads = st.one_of(
    st.binary(max_size=256),  # noise, including a noisy hello
    st.binary(max_size=256).map(lambda b: HELLO + b),  # a good hello, then noise
    st.tuples(  # a good hello, then a mutated or truncated real frame
        st.integers(0, 2),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
        st.one_of(st.none(), st.integers(0, 10_000)),
    ).map(lambda t: ("frame", *t)),
    st.tuples(  # a good hello, then a prefix announcing huge header / payload lengths
        st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)
    ).map(lambda t: HELLO + struct.pack("<II", *t)),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payloads=st.lists(hostile_payloads, min_size=1, max_size=6))
def test_a_live_stage_survives_hostile_connections(
    last_stage_backend: NumpyBackend, payloads: list[object]
) -> None:
    backend = last_stage_backend
    frames = _valid_frames(backend.d_model)

    def render(payload: object) -> bytes:
        if isinstance(payload, tuple):
            _, which, flips, cut = payload
            return HELLO + _mutate(frames[which], flips, cut)
        assert isinstance(payload, bytes)
        return payload

    async def main() -> None:
        server = StageServer(backend, index=1, secret=None)
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            for payload in payloads:
                stream = await trio.open_tcp_stream(host, int(port))
                try:
                    await stream.send_all(render(payload))
                    # The stage either closes on us or waits for the rest of a frame that
                    # never comes; it must never answer with more than a handshake reply.
                    with trio.move_on_after(0.3):
                        while await stream.receive_some(65536):
                            pass
                except trio.BrokenResourceError:
                    pass  # reset by the stage: it closed with our bytes unread
                finally:
                    await trio.aclose_forcefully(stream)
            # Still up: an honest lane gets a prediction for a real prefill.
            await honest_request(address, backend)
            assert server.computes == 1, "hostile input reached the backend"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_malformed_frames_are_counted_as_protocol_errors(last_stage_backend: NumpyBackend) -> None:
    async def main() -> None:
        server = StageServer(last_stage_backend, index=1, secret=None)
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            for garbage in (struct.pack("<II", 2**31, 0), struct.pack("<II", 4, 0) + b"\xc1" * 4):
                stream = await trio.open_tcp_stream(host, int(port))
                await stream.send_all(HELLO + garbage)
                with trio.fail_after(2):  # refused at once, not after waiting for 2 GB
                    while await stream.receive_some(4096):
                        pass
                await trio.aclose_forcefully(stream)
            await trio.sleep(0.1)
            assert server.protocol_errors == 2
            await honest_request(address, last_stage_backend)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_refused_configure_refuses_the_prefill_sent_right_behind_it(
    last_stage_backend: NumpyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0 sends the prefill without waiting for Configure's ack: if the last stage could
    not bind the return connection, the prefill must be refused too, never computed."""
    monkeypatch.setattr("stagerun._stage._server.SINK_WAIT_SECONDS", 0.2)

    async def main() -> None:
        server = StageServer(last_stage_backend, index=1, secret=None)
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            lane = await open_connection(
                address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2
            )
            try:
                with trio.fail_after(10):
                    configure = proto.Configure(
                        request_id=5, return_key=1234, prompt_len=3,
                        sampling=proto.SamplingParams(),
                    )  # fmt: skip
                    await lane.send(configure, timeout=5)  # no RETURN connection for key 1234
                    prefill = proto.Prefill(
                        request_id=5, chunk_index=0, position=0, tokens=(1, 2, 3), predict=True
                    )
                    hidden = np.zeros((3, last_stage_backend.d_model), np.float32)
                    await lane.send(prefill, hidden, "f32", timeout=5)
                    first = (await lane.receive(timeout=5)).message
                    second = (await lane.receive(timeout=5)).message
            finally:
                await lane.aclose_forcefully()
            assert isinstance(first, proto.Error) and "no return connection" in first.message
            assert isinstance(second, proto.Error) and "not configured" in second.message
            assert server.computes == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
