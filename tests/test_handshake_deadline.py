"""The handshake deadline on both ends, set short so the tests are.

A stage gives a connecting peer ``handshake_timeout`` seconds (`StageServer`, ``stagerun stage
--handshake-timeout``) to send its hello, nonce and proof; a client gives a stage its
``ready_timeout`` (or the pool's ``steady_timeout``) to answer READY. First in memory on a fake
clock, where the deadline is measured exactly; then on real sockets, where the point is that a
stalled peer is dropped (the stage logs the configured deadline) rather than hanging anything,
and that honest lanes still connect. Real waits are bounded generously (`LIMIT`), never tightly.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import re
import sys

import pytest
import trio
import trio.testing
from _processes import start_stage

from stagerun import LaneHandshakeError
from stagerun import _proto as proto
from stagerun._cli._options import build_parser
from stagerun._driver._lanes import LanePool
from stagerun._stage._server import StageServer
from stagerun._wire._connect import open_connection
from stagerun._wire._framed import DEFAULT_HANDSHAKE_TIMEOUT, client_handshake, server_handshake
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

SECRET = b"correct horse battery staple 42"
SHORT = 0.5  # the deadline under test, in seconds
LIMIT = 30.0  # a real-clock bound on a whole wait: failing it means "hung", not "slow"

AUTH_HELLO = proto.encode_hello(proto.Role.LANE, auth=True)
NONCE = b"n" * proto.NONCE_SIZE

# What a stalling client sends before it stops, and what the stage is waiting for then.
STALLS = {
    "nothing": (b"", "hello"),
    "half a hello": (AUTH_HELLO[: proto.HELLO_SIZE // 2], "hello"),
    "a hello, no nonce": (AUTH_HELLO, "nonce"),
    "a hello and nonce, no proof": (AUTH_HELLO + NONCE, "proof"),
}


# -- in memory, on a fake clock ---------------------------------------------------------------


@pytest.mark.parametrize("stall", list(STALLS))
async def test_the_stage_drops_a_stalled_handshake_at_its_deadline(
    autojump_clock: trio.testing.MockClock, stall: str
) -> None:
    sent, waiting_for = STALLS[stall]
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(sent)
    started = trio.current_time()
    with pytest.raises(
        LaneHandshakeError, match=rf"^peer did not send its {waiting_for} within {SHORT:g}s$"
    ):
        await server_handshake(server, peer="peer", hello_timeout=SHORT, secret=SECRET)
    assert trio.current_time() - started == pytest.approx(SHORT)


async def test_the_stage_side_default_is_ten_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert DEFAULT_HANDSHAKE_TIMEOUT == 10.0  # docs/reliability.md, timeouts table
    _client, server = trio.testing.memory_stream_pair()
    started = trio.current_time()
    with pytest.raises(LaneHandshakeError, match="within 10s"):
        await server_handshake(server, peer="peer")
    assert trio.current_time() - started == pytest.approx(10.0)


async def _silent_stage(stream: trio.abc.Stream, *, challenge: bool) -> None:
    """Read the client's hello (and nonce); with ``challenge``, prove the secret; never READY."""
    hello = await _read(stream, proto.HELLO_SIZE)
    if challenge:
        client_nonce = await _read(stream, proto.NONCE_SIZE)
        nonce = b"s" * proto.NONCE_SIZE
        proof = proto.auth_proof(SECRET, "server", hello, client_nonce, nonce)
        await stream.send_all(proto.encode_challenge(nonce, proof))
        await _read(stream, proto.PROOF_SIZE)
    await trio.sleep_forever()


async def _read(stream: trio.abc.Stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        data = await stream.receive_some(n - len(buf))
        assert data, "the client closed the connection early"
        buf += data
    return buf


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "after the proof"])
async def test_a_client_gives_up_on_a_stage_that_never_says_ready(
    autojump_clock: trio.testing.MockClock, secret: bytes | None
) -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _silent_stage(server, challenge=secret is not None))
        started = trio.current_time()
        with pytest.raises(LaneHandshakeError, match=rf"did not become ready within {SHORT:g}s"):
            await client_handshake(
                client, peer="stage", role=proto.Role.LANE, ready_timeout=SHORT, secret=secret
            )
        assert trio.current_time() - started == pytest.approx(SHORT)
        nursery.cancel_scope.cancel()


# -- live, on loopback ------------------------------------------------------------------------


async def _wait_closed(stream: trio.SocketStream) -> None:
    """Return once the peer has closed the connection (EOF or reset)."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


async def test_a_stalled_peer_is_dropped_and_honest_lanes_still_connect(
    tiny_model: ModelFile, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagerun.stage")
    server = StageServer(
        NumpyBackend(tiny_model, (2, 4)), index=1, secret=SECRET, handshake_timeout=SHORT
    )
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            address: str = await nursery.start(server.serve)
            started = trio.current_time()
            stalled = []
            for sent, _waiting_for in STALLS.values():
                stream = await trio.open_tcp_stream(*_host_port(address))
                await stream.send_all(sent)
                stalled.append(stream)
            # the stalled peers hold connections, not the stage: an honest lane gets READY
            lane = await open_connection(
                address, role=proto.Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT,
                secret=SECRET,
            )  # fmt: skip
            for stream in stalled:
                await _wait_closed(stream)
                await stream.aclose()
            assert trio.current_time() - started >= SHORT  # not dropped before the deadline
            assert server.refused == len(STALLS)
            # and after they were dropped, the stage still serves
            again = await open_connection(
                address, role=proto.Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT,
                secret=SECRET,
            )  # fmt: skip
            await lane.aclose_forcefully()
            await again.aclose_forcefully()
            nursery.cancel_scope.cancel()
    dropped = sorted(
        match.group()
        for record in caplog.records
        if (match := re.search(r"did not send its \w+ within \S+s$", record.getMessage()))
    )
    assert dropped == sorted(
        f"did not send its {waiting_for} within {SHORT:g}s"
        for _sent, waiting_for in STALLS.values()
    )


def test_a_stage_refuses_a_handshake_timeout_that_is_not_positive(tiny_model: ModelFile) -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="handshake_timeout must be a positive number"):
            StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, handshake_timeout=bad)


def test_the_command_line_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["stage"]).handshake_timeout == DEFAULT_HANDSHAKE_TIMEOUT
    assert parser.parse_args(["stage", "--handshake-timeout", "2.5"]).handshake_timeout == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["stage", "--handshake-timeout", bad])


async def test_stagerun_stage_drops_a_silent_peer_after_handshake_timeout(
    tiny_model_path: pathlib.Path,
) -> None:
    """``stagerun -v stage --handshake-timeout 0.5``: the option reaches the stage."""
    command = [
        sys.executable, "-m", "stagerun", "-v", "stage", "--model", str(tiny_model_path),
        "--layers", "2:4", "--index", "1", "--handshake-timeout", f"{SHORT:g}",
    ]  # fmt: skip
    with trio.fail_after(4 * LIMIT):  # a Python start on a loaded machine, then the test
        async with trio.open_nursery() as nursery:
            stderr = bytearray()
            proc, address = await start_stage(nursery, command, stderr=stderr)
            silent = await trio.open_tcp_stream(*_host_port(address))
            await _wait_closed(silent)
            await silent.aclose()
            lane = await open_connection(
                address, role=proto.Role.LANE, connect_timeout=LIMIT, ready_timeout=LIMIT,
                secret=None,
            )  # fmt: skip
            await lane.aclose_forcefully()
            proc.terminate()
    assert f"did not send its hello within {SHORT:g}s" in stderr.decode()


async def _tarpit(stream: trio.SocketStream) -> None:
    """A listener that accepts, reads whatever comes, and never answers."""
    while await stream.receive_some(4096):
        pass


async def test_a_client_fails_fast_against_a_listener_that_never_says_ready() -> None:
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, _tarpit, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            address = f"tcp://127.0.0.1:{port}"
            ready = rf"did not become ready within {SHORT:g}s"
            # one connection, as a probe or a middle stage opens it
            with pytest.raises(LaneHandshakeError, match=ready):
                await open_connection(
                    address, role=proto.Role.LANE, connect_timeout=LIMIT, ready_timeout=SHORT,
                    secret=None,
                )  # fmt: skip
            # the lanes a pool opens at start, and those it connects on demand
            with pytest.raises(LaneHandshakeError, match=ready):
                await LanePool(address, ready_timeout=SHORT).start()
            pool = LanePool(address, steady_timeout=SHORT)
            with pytest.raises(LaneHandshakeError, match=ready):
                async with pool.checkout(request_id=1):
                    pass
            nursery.cancel_scope.cancel()
