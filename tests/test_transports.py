"""Pipelines over every transport: tcp, websocket, the example Unix-socket plugin, mixed lanes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from _oracle import assert_varied

from stagerun import open_pipeline, plugins
from stagerun._errors import LaneHandshakeError
from stagerun._proto import Role
from stagerun._wire._framed import client_handshake, server_handshake
from stagerun.transports import WebSocketTransport
from stagerun.transports._websocket import parse_ws_address

PROMPT = "The lighthouse keeper climbed the stairs"


async def _greedy(model: object, **options: object) -> tuple[list[int], list[str | None]]:
    async with open_pipeline(model, stages=3, **options) as pipeline:  # type: ignore[arg-type]
        result = await pipeline.complete(PROMPT, max_tokens=24)
        return result.token_ids, [s.address for s in pipeline.stages]


@pytest.mark.parametrize(
    "options",
    [
        {"transport": "ws"},
        {"transport": "unix"},
        {"transports": ["ws", "tcp"]},
        {"transports": ["tcp", "ws"]},
        {"transports": ["unix", "ws"]},
    ],
    ids=["ws", "unix", "ws,tcp", "tcp,ws", "unix,ws"],
)
async def test_tiny_pipeline_is_identical_over_every_transport(
    tiny_model_path: Path, options: dict[str, object]
) -> None:
    reference, tcp_addresses = await _greedy(tiny_model_path)
    assert_varied(reference)
    assert all(a.startswith("tcp://") for a in tcp_addresses[1:] if a)
    tokens, addresses = await _greedy(tiny_model_path, **options)
    assert tokens == reference
    hops = options.get("transports") or [options["transport"]] * 2
    schemes = [a.partition("://")[0] for a in addresses[1:] if a]
    assert schemes == [plugins.transport(name).schemes[0] for name in hops]  # type: ignore[union-attr]


@pytest.mark.slow
async def test_real_model_three_stages_identical_over_tcp_ws_plugin_and_mixed() -> None:
    reference, _ = await _greedy("smollm2", mode="processes")
    assert_varied(reference)
    for options in ({"transport": "ws"}, {"transport": "unix"}, {"transports": ["ws", "tcp"]}):
        tokens, addresses = await _greedy("smollm2", mode="processes", **options)
        assert tokens == reference, (options, addresses)


async def test_transports_must_match_the_hops(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"3 stages have 2 hops, but 1 transports were given"):
        async with open_pipeline(tiny_model_path, stages=3, transports=["ws"]):
            pass


async def test_unknown_transport_is_a_clear_error(tiny_model_path: Path) -> None:
    with pytest.raises(plugins.PluginError, match=r"no transport plugin named 'carrier-pigeon'"):
        async with open_pipeline(tiny_model_path, stages=2, transport="carrier-pigeon"):
            pass


def test_ws_addresses() -> None:
    assert parse_ws_address("ws://127.0.0.1:9000") == ("127.0.0.1", 9000, "/stagerun/lane")
    assert parse_ws_address("ws://[::1]:9000/x/y") == ("::1", 9000, "/x/y")
    for bad in ("tcp://127.0.0.1:1", "ws://127.0.0.1", "ws://h:99999"):
        with pytest.raises(ValueError, match="websocket address"):
            parse_ws_address(bad)


async def _serve_ready(stream: trio.abc.Stream, peer: str) -> None:
    _framed, _hello = await server_handshake(stream, peer=peer)
    await trio.sleep_forever()


async def test_ws_wrong_path_is_refused(nursery: trio.Nursery) -> None:
    transport = WebSocketTransport()
    address = await nursery.start(transport.serve, "ws://127.0.0.1:0/lanes", _serve_ready)
    assert address.endswith("/lanes")
    with pytest.raises(LaneHandshakeError, match=r"refused the websocket upgrade \(HTTP 404\)"):
        await transport.connect(address.removesuffix("/lanes") + "/other", timeout=5)
    stream = await transport.connect(address, timeout=5)
    framed = await client_handshake(stream, peer=address, role=Role.LANE, ready_timeout=5)
    assert framed.is_live()
    await framed.aclose()


async def test_ws_connect_to_nothing_fails_fast() -> None:
    with trio.fail_after(5):
        with pytest.raises(LaneHandshakeError, match=r"could not connect to ws://127\.0\.0\.1:1"):
            await WebSocketTransport().connect("ws://127.0.0.1:1", timeout=2)


async def test_ws_idle_lane_with_a_closed_peer_is_not_live(nursery: trio.Nursery) -> None:
    transport = WebSocketTransport()
    closed = trio.Event()

    async def close_after_ready(stream: trio.abc.Stream, peer: str) -> None:
        framed, _hello = await server_handshake(stream, peer=peer)
        closed.set()
        await framed.aclose()

    address = await nursery.start(transport.serve, "ws://127.0.0.1:0", close_after_ready)
    stream = await transport.connect(address, timeout=5)
    framed = await client_handshake(stream, peer=address, role=Role.LANE, ready_timeout=5)
    await closed.wait()
    with trio.fail_after(5):
        while framed.is_live():  # noqa: ASYNC110 (polling a synchronous socket probe)
            await trio.sleep(0.01)
    await framed.aclose()


async def test_a_socket_that_connects_to_itself_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dialling a dead loopback port can, rarely, connect the socket to itself: no stage."""
    import stagerun.transports._tcp as tcp

    async def self_connected(host: str, port: int) -> trio.SocketStream:
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        await sock.connect(sock.getsockname())  # a TCP simultaneous open with itself
        return trio.SocketStream(sock)

    monkeypatch.setattr(tcp.trio, "open_tcp_stream", self_connected)
    with pytest.raises(
        LaneHandshakeError, match=r"could not connect to tcp://.*connected to itself"
    ):
        await plugins.transport("tcp").connect("tcp://127.0.0.1:9", timeout=5)
