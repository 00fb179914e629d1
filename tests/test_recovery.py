"""A request survives a stage that dies, a connection that resets and a stage that stalls.

Each test runs a long greedy generation twice: once undisturbed, once with a failure injected
after a fixed number of tokens (from the token callback, so the failure lands mid-generation
deterministically). The disturbed run must return the very same tokens and text, report the
recovery, and leave the pipeline healthy.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import trio

from stagerun import (
    RecoveryFailedError,
    RecoveryPolicy,
    SamplingParams,
    SupervisionPolicy,
    TokenChunk,
    open_pipeline,
    serve_stage,
)
from stagerun._speculative import SpeculationConfig
from stagerun._stage import StageServer
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

if TYPE_CHECKING:
    from conftest import KillableStage

PROMPT = "The lighthouse keeper counted the ships"
TOKENS = 120
FAIL_AT = 40


def after(n: int, action: Callable[[], object]) -> Callable[[TokenChunk], None]:
    """A token callback that runs ``action`` once, when the ``n``-th token arrives."""
    seen = 0

    def on_token(chunk: TokenChunk) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            action()

    return on_token


def kill(pid: int | None, sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    assert pid is not None
    return lambda: os.kill(pid, sig)


@pytest.mark.parametrize("victim", [1, 2], ids=["middle", "last"])
async def test_a_killed_stage_is_restarted_and_the_request_completes(
    tiny_model_path: pathlib.Path, victim: int
) -> None:
    async with open_pipeline(tiny_model_path, stages=3, mode="processes") as pipeline:
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        process = pipeline.stages[victim].process
        old_pid = process.pid
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            on_token=after(FAIL_AT, kill(old_pid)),
        )
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.timings["recoveries"] == 1
        assert process.restarts == 1 and process.pid != old_pid
        assert process.last_exit == -signal.SIGKILL
        health = await pipeline.check_health()
        assert [h.state for h in health] == ["ready"] * 3
        assert health[victim].to_json()["process"]["restarts"] == 1
        # the pipeline keeps serving after the recovery
        again = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        assert again.token_ids == want.token_ids


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=5)],
    ids=["greedy", "seeded"],
)
async def test_speculative_requests_recover_too(
    tiny_model_path: pathlib.Path, sampling: SamplingParams
) -> None:
    """Verify windows in flight when the stage dies are dropped; the replay starts clean."""
    speculation = SpeculationConfig(drafter="ngram", depth=4, window=4)
    async with open_pipeline(
        tiny_model_path, stages=3, mode="processes", speculation=speculation
    ) as pipeline:
        want = await pipeline.complete(
            PROMPT, max_tokens=TOKENS, ignore_eog=True, sampling=sampling
        )
        process = pipeline.stages[1].process
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            sampling=sampling,
            on_token=after(FAIL_AT, kill(process.pid)),
        )
        assert got.token_ids == want.token_ids
        assert got.timings["recoveries"] == 1 and process.restarts == 1


async def test_a_stalled_stage_is_killed_by_the_liveness_probe_and_replaced(
    tiny_model_path: pathlib.Path,
) -> None:
    supervision = SupervisionPolicy(probe_interval=0.5, probe_timeout=1.0, probe_failures=2)
    async with open_pipeline(
        tiny_model_path,
        stages=3,
        mode="processes",
        supervision=supervision,
        reply_timeout=2.0,
    ) as pipeline:
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        process = pipeline.stages[1].process
        stalled = process.pid
        start = time.perf_counter()
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            on_token=after(FAIL_AT, kill(stalled, signal.SIGSTOP)),
        )
        elapsed = time.perf_counter() - start
        assert got.token_ids == want.token_ids
        assert got.timings["recoveries"] >= 1
        assert process.probe_kills == 1 and process.pid != stalled
        assert elapsed < 30, elapsed


class ResettingProxy:
    """A loopback TCP relay whose connections can all be reset (RST) at once."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.relays: list[tuple[trio.SocketStream, trio.SocketStream, trio.CancelScope]] = []

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(f"tcp://127.0.0.1:{port}")
            await trio.serve_listeners(self._relay, listeners, handler_nursery=nursery)

    async def _relay(self, client: trio.SocketStream) -> None:
        sock = trio.socket.socket()
        try:
            await sock.connect(self.target)
        except BaseException:
            sock.close()
            await trio.aclose_forcefully(client)
            raise
        server = trio.SocketStream(sock)

        async def pump(a: trio.SocketStream, b: trio.SocketStream) -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while data := await a.receive_some(65536):
                    await b.send_all(data)
            nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                self.relays.append((client, server, nursery.cancel_scope))
                nursery.start_soon(pump, client, server)
                nursery.start_soon(pump, server, client)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(client)
                await trio.aclose_forcefully(server)

    def reset_all(self) -> None:
        """Abort every relayed connection with a TCP reset (linger 0, then close)."""
        for client, server, scope in self.relays:
            for stream in (client, server):
                with contextlib.suppress(OSError):
                    stream.socket.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
            scope.cancel()
        self.relays.clear()


async def test_a_reset_connection_between_stages_is_recovered(tiny_model: ModelFile) -> None:
    ranges = [(0, 2), (2, 3), (3, 4)]
    async with trio.open_nursery() as nursery:
        last = await nursery.start(
            lambda task_status: serve_stage(
                NumpyBackend(tiny_model, ranges[2]), index=2, task_status=task_status
            )
        )
        proxy = ResettingProxy(last)
        print("ADDR last", last)
        hop = await nursery.start(proxy.serve)
        print("ADDR hop", hop)
        middle = await nursery.start(
            lambda task_status: serve_stage(
                NumpyBackend(tiny_model, ranges[1]),
                index=1,
                downstream=hop,
                task_status=task_status,
            )
        )
        print("ADDR middle", middle)
        async with open_pipeline(tiny_model, layers=ranges, remote=[middle, last]) as pipeline:
            want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
            got = await pipeline.complete(
                PROMPT, max_tokens=TOKENS, ignore_eog=True, on_token=after(FAIL_AT, proxy.reset_all)
            )
        assert got.token_ids == want.token_ids
        assert got.timings["recoveries"] == 1
        nursery.cancel_scope.cancel()


async def test_a_stage_that_never_returns_fails_the_request_in_bounded_time(
    tiny_model: ModelFile, killable_stage: KillableStage
) -> None:
    ranges = [(0, 2), (2, 4)]
    async with trio.open_nursery() as nursery:
        address, stage_scope = await killable_stage(nursery)
        recovery = RecoveryPolicy(timeout=2.0)
        async with open_pipeline(
            tiny_model, layers=ranges, remote=[address], recovery=recovery
        ) as pipeline:
            start = time.perf_counter()
            with pytest.raises(RecoveryFailedError, match=r"no working lane .* within 2s"):
                await pipeline.complete(
                    PROMPT,
                    max_tokens=TOKENS,
                    ignore_eog=True,
                    on_token=after(10, stage_scope.cancel),
                )
            assert time.perf_counter() - start < 15
            assert pipeline.recovery_failures == 1
        nursery.cancel_scope.cancel()


async def test_recovery_can_be_turned_off(
    tiny_model: ModelFile, killable_stage: KillableStage
) -> None:
    from stagerun import LaneError

    ranges = [(0, 2), (2, 4)]
    async with trio.open_nursery() as nursery:
        address, stage_scope = await killable_stage(nursery)
        async with open_pipeline(
            tiny_model, layers=ranges, remote=[address], recovery=RecoveryPolicy.disabled()
        ) as pipeline:
            with pytest.raises(LaneError) as info:
                await pipeline.complete(
                    PROMPT,
                    max_tokens=TOKENS,
                    ignore_eog=True,
                    on_token=after(10, stage_scope.cancel),
                )
            assert not isinstance(info.value, RecoveryFailedError)
        nursery.cancel_scope.cancel()


async def test_standby_stages_take_over_when_the_primaries_die(tiny_model: ModelFile) -> None:
    """Primaries and standbys for stages 1 and 2; both primaries die mid-generation for good."""
    ranges = [(0, 1), (1, 2), (2, 4)]
    scopes = {name: trio.CancelScope() for name in ("p1", "s1", "p2", "s2")}
    servers: dict[str, StageServer] = {}
    async with trio.open_nursery() as nursery:

        async def stage(name: str, index: int, downstream: str | None, task_status: Any) -> None:
            with scopes[name]:
                server = StageServer(
                    NumpyBackend(tiny_model, ranges[index]), index=index, downstream=downstream
                )
                servers[name] = server
                await server.serve(task_status=task_status)

        p2 = await nursery.start(stage, "p2", 2, None)
        s2 = await nursery.start(stage, "s2", 2, None)
        p1 = await nursery.start(stage, "p1", 1, f"{p2},{s2}")
        s1 = await nursery.start(stage, "s1", 1, f"{p2},{s2}")

        def kill_primaries() -> None:
            scopes["p1"].cancel()
            scopes["p2"].cancel()

        remote = [f"{p1},{s1}", f"{p2},{s2}"]
        async with open_pipeline(tiny_model, layers=ranges, remote=remote) as pipeline:
            want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
            assert servers["s1"].computes == 0 and servers["s2"].computes == 0
            got = await pipeline.complete(
                PROMPT, max_tokens=TOKENS, ignore_eog=True, on_token=after(FAIL_AT, kill_primaries)
            )
            health = await pipeline.check_health()
        assert got.token_ids == want.token_ids
        assert got.timings["recoveries"] == 1
        assert servers["s1"].computes > 0 and servers["s2"].computes > 0
        assert [h.state for h in health] == ["ready"] * 3
        nursery.cancel_scope.cancel()


def test_a_group_of_lane_failures_counts_as_one_lane_failure() -> None:
    from stagerun import LaneBrokenError, LaneTimeoutError
    from stagerun._errors import LaneError, StageError
    from stagerun._util import only_of

    first, second = LaneBrokenError("reader"), LaneTimeoutError("writer")
    group = BaseExceptionGroup("x", [first, BaseExceptionGroup("y", [second])])
    assert only_of(group, (LaneError, StageError)) is first
    mixed = BaseExceptionGroup("x", [first, ValueError("a bug")])
    assert only_of(mixed, (LaneError, StageError)) is None
