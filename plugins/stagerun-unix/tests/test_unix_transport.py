"""stagerun-unix passes stagerun's transport conformance suite, and keeps its socket files tidy."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest
import trio
from stagerun_unix import UnixTransport, parse_unix_address

from stagerun import LaneHandshakeError, open_pipeline, plugins
from stagerun.testing import check_transport, write_tiny_model


async def _idle(stream: trio.abc.Stream, peer: str) -> None:
    await stream.aclose()


async def test_unix_transport_conforms(tmp_path: pathlib.Path) -> None:
    await check_transport(UnixTransport(), f"unix://{tmp_path}/stage.sock")


async def test_local_address_conforms() -> None:
    await check_transport(UnixTransport())  # a fresh path from local_address()


def test_registered_as_a_plugin() -> None:
    plugins.refresh()
    assert isinstance(plugins.transport("unix"), UnixTransport)
    assert isinstance(plugins.transport_for("unix:///tmp/x.sock"), UnixTransport)


def test_addresses() -> None:
    assert parse_unix_address("unix:///run/stage.sock") == "/run/stage.sock"
    for bad in ("unix://relative.sock", "tcp:///x.sock", "/x.sock"):
        with pytest.raises(ValueError, match=r"must look like unix:///ABSOLUTE/PATH\.sock"):
            parse_unix_address(bad)


async def test_socket_file_is_removed_when_serve_stops(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "stage.sock"
    async with trio.open_nursery() as nursery:
        address = await nursery.start(UnixTransport().serve, f"unix://{path}", _idle)
        assert address == f"unix://{path}"
        assert path.is_socket()
        nursery.cancel_scope.cancel()
    assert not path.exists()


async def test_stale_socket_is_replaced(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "stage.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening, then closed: what a crashed server leaves
    dead.close()
    assert path.is_socket()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(UnixTransport().serve, f"unix://{path}", _idle)
        stream = await UnixTransport().connect(address, timeout=5)
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_live_socket_and_other_files_are_left_alone(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "stage.sock"
    async with trio.open_nursery() as nursery:
        address = await nursery.start(UnixTransport().serve, f"unix://{path}", _idle)
        with pytest.raises(OSError, match="already listening"):
            await UnixTransport().serve(address, _idle)
        assert path.is_socket()
        nursery.cancel_scope.cancel()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="is not a socket"):
        await UnixTransport().serve(f"unix://{path}", _idle)
    assert path.read_text() == "not a socket"


async def test_connect_failures_name_the_address(tmp_path: pathlib.Path) -> None:
    address = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(LaneHandshakeError, match=f"{address}: no socket file there"):
        await UnixTransport().connect(address, timeout=1)


async def test_peer_names_the_client_process(tmp_path: pathlib.Path) -> None:
    peers: list[str] = []

    async def handler(stream: trio.abc.Stream, peer: str) -> None:
        peers.append(peer)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        address = await nursery.start(UnixTransport().serve, f"unix://{tmp_path}/s.sock", handler)
        stream = await UnixTransport().connect(address, timeout=5)
        assert await stream.receive_some(10) == b""
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert peers == [f"{address} (pid {os.getpid()})"]


async def test_pipeline_over_unix_lanes(tmp_path: pathlib.Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=4)
    tokens = []
    for stages, transport in ((1, "tcp"), (3, "unix")):
        async with open_pipeline(model, stages=stages, transport=transport) as pipeline:
            addresses = [s.address for s in pipeline.stages if s.address is not None]
            assert all(a.startswith("unix:///") for a in addresses)
            tokens.append((await pipeline.complete("Hello there", max_tokens=8)).token_ids)
    assert tokens[0] == tokens[1]
    for address in addresses:  # each stage unlinked its socket file when it stopped
        assert not await trio.Path(address.removeprefix("unix://")).exists()
