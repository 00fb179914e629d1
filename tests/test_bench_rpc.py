"""The pieces of ``bench serve --compare-rpc`` that run without llama.cpp's RPC build: the
delaying proxy in front of every RPC server, and the refusal when the build is missing."""

from __future__ import annotations

import argparse
import functools

import pytest
import trio

from stagerun._cli._bench import _rpc
from stagerun._cli._bench._serve import _check


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        async for chunk in stream:
            await stream.send_all(chunk.upper())


@pytest.mark.parametrize("delay", [0.0, 0.05])
async def test_the_proxy_carries_bytes_both_ways_each_direction_delayed(delay: float) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), _echo, 0
        )
        target = listeners[0].socket.getsockname()[1]
        port = await nursery.start(_rpc.serve_delayed, target, delay)
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            payload = b"activations " * 20_000  # several reads' worth, kept in order
            start = trio.current_time()
            await client.send_all(payload)
            got = b""
            while len(got) < len(payload):
                got += await client.receive_some(65536)
            took = trio.current_time() - start
        assert got == payload.upper()
        assert 2 * delay <= took < 2 * delay + 1.0  # there and back, each way delayed
        nursery.cancel_scope.cancel()


def test_a_missing_rpc_build_is_refused_before_anything_starts(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_rpc, "RPC_BIN", tmp_path)
    monkeypatch.setattr(_rpc, "__file__", str(tmp_path / "a" / "b" / "c" / "d.py"))
    args = argparse.Namespace(
        stages=3,
        tokens=8,
        requests_per_client=1,
        rounds=1,
        max_batch=None,
        compare_llama_server=False,
        compare_rpc=True,
        png=None,
    )
    with pytest.raises(ValueError, match=r"scripts/build\.sh"):
        _check(args)
