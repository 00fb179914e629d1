"""Lane authentication: a shared secret, proved both ways before any frame is read."""

from __future__ import annotations

import functools
import pathlib

import pytest
import trio
from _oracle import assert_varied

from stagerun import LaneHandshakeError, ProtocolError, open_pipeline
from stagerun import _proto as proto
from stagerun._stage._server import StageServer
from stagerun._wire._auth import SECRET_ENV, SECRET_FILE_ENV, lane_secret
from stagerun._wire._connect import open_connection
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

SECRET = b"correct horse battery staple 42"
PROMPT = "The lighthouse keeper"


# -- the sans-IO pieces ---------------------------------------------------------------------


def test_proofs_are_bound_to_side_secret_and_both_nonces() -> None:
    hello = proto.encode_hello(proto.Role.LANE, auth=True)
    a, b = b"a" * 32, b"b" * 32
    base = proto.auth_proof(SECRET, "client", hello, a, b)
    assert len(base) == proto.PROOF_SIZE
    assert base == proto.auth_proof(SECRET, "client", hello, a, b)
    for other in (
        proto.auth_proof(SECRET, "server", hello, a, b),
        proto.auth_proof(SECRET + b"!", "client", hello, a, b),
        proto.auth_proof(SECRET, "client", hello, b, a),
        proto.auth_proof(SECRET, "client", proto.encode_hello(proto.Role.RETURN, 7), a, b),
    ):
        assert not proto.proofs_match(base, other)
    with pytest.raises(ValueError, match="empty"):
        proto.auth_proof(b"", "client", hello, a, b)


def test_the_challenge_decodes_and_auth_is_the_only_known_flag() -> None:
    decoder = proto.ReadyDecoder()
    wire = proto.encode_challenge(b"n" * 32, b"p" * 32) + proto.encode_ready()[:3]
    decoder.receive_data(wire[:20])
    assert decoder.next_event() is proto.NEED_DATA
    decoder.receive_data(wire[20:])
    assert decoder.next_event() == proto.Challenge(nonce=b"n" * 32, proof=b"p" * 32)
    assert decoder.trailing_data == proto.encode_ready()[:3]
    hello = proto.decode_hello(proto.encode_hello(proto.Role.LANE, auth=True))
    assert hello.flags == proto.FLAG_AUTH
    raw = bytearray(proto.encode_hello(proto.Role.LANE))
    raw[7] = 0x02
    with pytest.raises(ProtocolError, match="unknown flags 0x02"):
        proto.decode_hello(bytes(raw))


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)  # private, or it is refused
    assert lane_secret({SECRET_FILE_ENV: str(path)}) == SECRET
    assert lane_secret({SECRET_ENV: SECRET.decode()}) == SECRET
    assert lane_secret({}) is None
    with pytest.raises(ValueError, match="cannot read the lane secret file"):
        lane_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="needs at least 16"):
        lane_secret({SECRET_FILE_ENV: str(path)})


# -- live stages ------------------------------------------------------------------------------


async def _start(nursery: trio.Nursery, server: StageServer) -> str:
    address: str = await nursery.start(server.serve)
    return address


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


async def _raw_exchange(address: str, payload: bytes) -> bytes:
    """Send ``payload`` on a bare TCP connection and return all the stage says until it closes."""
    stream = await trio.open_tcp_stream(*_host_port(address))
    received = b""
    async with stream:
        await stream.send_all(payload)
        with trio.fail_after(5):
            while data := await stream.receive_some(4096):
                received += data
    return received


async def test_a_pipeline_with_a_shared_secret_generates_the_same_tokens(
    tiny_model: ModelFile, nursery: trio.Nursery
) -> None:
    ranges = [(0, 2), (2, 4)]
    last = StageServer(NumpyBackend(tiny_model, ranges[1]), index=1, secret=SECRET)
    address = await _start(nursery, last)
    plain = StageServer(NumpyBackend(tiny_model, ranges[1]), index=1, secret=None)
    plain_address = await _start(nursery, plain)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SECRET_ENV, SECRET.decode())
        async with open_pipeline(tiny_model, layers=ranges, remote=[address]) as pipeline:
            secured = await pipeline.complete(PROMPT, max_tokens=24)
    async with open_pipeline(tiny_model, layers=ranges, remote=[plain_address]) as pipeline:
        reference = await pipeline.complete(PROMPT, max_tokens=24)
    assert_varied(reference.token_ids)
    assert secured.token_ids == reference.token_ids
    assert last.refused == 0


async def test_strangers_are_refused_before_any_frame_and_learn_nothing(
    tiny_model: ModelFile, nursery: trio.Nursery
) -> None:
    server = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=SECRET)
    address = await _start(nursery, server)

    # No secret: a plain hello. The stage answers with one refusal and closes: nothing after
    # the hello is ever read, and the refusal says nothing about the stage.
    said = await _raw_exchange(address, proto.encode_hello(proto.Role.LANE))
    reason = "this stage requires lane authentication (a shared secret)"
    assert said == proto.encode_refusal(reason)

    # A wrong secret, through the real client: the stage's proof does not check out with it,
    # so the client gives up first (it would not trust the stage either).
    with pytest.raises(LaneHandshakeError, match="failed to prove it holds the lane secret"):
        await open_connection(
            address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=b"x" * 32
        )
    # A guessed proof, on the wire: a challenge (random, useless without the secret), then the
    # refusal.
    hello = proto.encode_hello(proto.Role.LANE, auth=True)
    said = await _raw_exchange(address, hello + b"n" * 32 + b"guess" * 6 + b"!!")
    challenge_size = proto.REPLY_PREFIX_SIZE + proto.NONCE_SIZE + proto.PROOF_SIZE
    assert said[:4] == b"SCHL" and said[challenge_size:] == proto.encode_refusal(
        "authentication failed"
    )
    assert server.refused == 3 and server.lanes_open == 0 and server.computes == 0

    # The honest lane still works.
    stream = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=SECRET
    )
    await stream.aclose_forcefully()


async def test_a_client_with_a_secret_will_not_talk_to_a_stage_without_one(
    tiny_model: ModelFile, nursery: trio.Nursery
) -> None:
    plain = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    address = await _start(nursery, plain)
    with pytest.raises(LaneHandshakeError, match="has no lane secret and cannot authenticate"):
        await open_connection(
            address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=SECRET
        )


async def test_an_impostor_stage_gets_nothing_but_the_hello(nursery: trio.Nursery) -> None:
    """A server that answers with a challenge it cannot have made: the client stops there."""
    received = bytearray()

    async def impostor(stream: trio.SocketStream) -> None:
        received.extend(await stream.receive_some(4096))
        await stream.send_all(proto.encode_challenge(b"n" * 32, b"f" * 32))
        with trio.move_on_after(1):
            while data := await stream.receive_some(4096):
                received.extend(data)

    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, impostor, 0, host="127.0.0.1")
    )
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(LaneHandshakeError, match="failed to prove it holds the lane secret"):
        await open_connection(
            f"tcp://127.0.0.1:{port}",
            role=proto.Role.LANE,
            connect_timeout=2,
            ready_timeout=2,
            secret=SECRET,
        )
    await trio.sleep(0.2)
    assert len(received) == proto.HELLO_SIZE + proto.NONCE_SIZE  # no proof, no frames


async def test_stage_processes_share_the_secret_file(
    tiny_model_path: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file = tmp_path / "lane.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)  # private, or it is refused
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret_file))
    async with open_pipeline(tiny_model_path, stages=3, mode="processes") as pipeline:
        assert (await pipeline.complete(PROMPT, max_tokens=8)).token_ids
        stage = pipeline.stages[1].address
        assert stage is not None
        with pytest.raises(LaneHandshakeError, match="requires lane authentication"):
            await open_connection(
                stage, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
            )


def test_serving_without_a_secret_beyond_loopback_warns(
    tiny_model: ModelFile, caplog: pytest.LogCaptureFixture
) -> None:
    from stagerun._stage._server import _warn_if_open

    _warn_if_open("tcp://0.0.0.0:9001", None, 1)
    _warn_if_open("tcp://127.0.0.1:9001", None, 1)
    _warn_if_open("tcp://0.0.0.0:9001", SECRET, 1)
    warnings = [
        r.getMessage() for r in caplog.records if "without lane authentication" in r.getMessage()
    ]
    assert len(warnings) == 1 and "0.0.0.0:9001" in warnings[0]
