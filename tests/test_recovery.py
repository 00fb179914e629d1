"""A request survives a stage that dies, a connection that resets, a stage that stalls and a
stage that reports an error.

Each test runs a long generation twice: once undisturbed, once with a failure injected after a
fixed number of tokens (from the token callback, so the failure lands mid-generation
deterministically). The disturbed run must return the very same token ids, report the
recovery, and leave the pipeline healthy. Every such check first asserts that the expected
output is varied (`_oracle.assert_varied`), and seeded runs assert that another seed gives other
tokens; `test_the_equality_check_catches_a_wrong_replay` shows the check failing on a replay
that drops a token or the prompt.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
from _oracle import assert_varied

import stagerun._driver._request
from stagerun import (
    Completion,
    Pipeline,
    RecoveryFailedError,
    RecoveryPolicy,
    SamplingParams,
    SpeculationConfig,
    SupervisionPolicy,
    TokenChunk,
    open_pipeline,
    serve_stage,
)
from stagerun._driver._request import replay_context
from stagerun._stage._server import StageServer
from stagerun.backends import NumpyBackend
from stagerun.drafters import OracleDrafter
from stagerun.model import ModelFile

if TYPE_CHECKING:
    from conftest import KillableStage

PROMPT = "The lighthouse keeper counted the ships"
TOKENS = 120
FAIL_AT = 40
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_p=1.0, seed=5)
SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])


def after(*ns: int, action: Callable[[], object]) -> Callable[[TokenChunk], None]:
    """A token callback that runs ``action`` when each of the ``ns``-th tokens arrives."""
    seen = 0

    def on_token(chunk: TokenChunk) -> None:
        nonlocal seen
        seen += 1
        if seen in ns:
            action()

    return on_token


def kill(pid: int | None, sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    assert pid is not None
    return lambda: os.kill(pid, sig)


def assert_recovered(got: Completion, want: Completion, recoveries: int = 1) -> None:
    """The disturbed run returned exactly the undisturbed run's tokens, after ``recoveries``."""
    assert_varied(want.token_ids)
    assert got.token_ids == want.token_ids
    assert got.timings["recoveries"] == recoveries


async def assert_seed_matters(
    pipeline: Pipeline, want: Completion, sampling: SamplingParams
) -> None:
    """A seeded run's oracle: another seed (or greedy) would have given other tokens."""
    other = SamplingParams(temperature=1.0, top_p=1.0, seed=6) if sampling.temperature else SEEDED
    different = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True, sampling=other)
    assert different.token_ids != want.token_ids


@pytest.mark.parametrize("victim", [1, 2], ids=["middle", "last"])
@SAMPLINGS
async def test_a_killed_stage_is_restarted_and_the_request_completes(
    tiny_model_path: pathlib.Path, victim: int, sampling: SamplingParams
) -> None:
    async with open_pipeline(tiny_model_path, stages=3, mode="processes") as pipeline:
        want = await pipeline.complete(
            PROMPT, max_tokens=TOKENS, ignore_eog=True, sampling=sampling
        )
        await assert_seed_matters(pipeline, want, sampling)
        process = pipeline.stages[victim].process
        old_pid = process.pid
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            sampling=sampling,
            on_token=after(FAIL_AT, action=kill(old_pid)),
        )
        assert_recovered(got, want)
        assert got.text == want.text
        assert process.restarts == 1 and process.pid != old_pid
        assert process.last_exit == -signal.SIGKILL
        health = await pipeline.check_health()
        assert [h.state for h in health] == ["ready"] * 3
        assert health[victim].to_json()["process"]["restarts"] == 1
        # the pipeline keeps serving after the recovery
        again = await pipeline.complete(
            PROMPT, max_tokens=TOKENS, ignore_eog=True, sampling=sampling
        )
        assert again.token_ids == want.token_ids


@SAMPLINGS
async def test_speculative_requests_recover_too(
    tiny_model_path: pathlib.Path, sampling: SamplingParams
) -> None:
    """Verify windows in flight when the stage dies are dropped; the replay starts clean.

    The drafter knows the answer and gets 30% of it wrong, so windows are accepted, rejected
    and in flight when the kill lands; the result must still be plain decoding's.
    """
    speculation = SpeculationConfig(drafter="ngram", depth=4, window=4, adaptive=False)
    async with open_pipeline(
        tiny_model_path, stages=3, mode="processes", speculation=speculation
    ) as pipeline:
        plain = SpeculationConfig()  # off for the reference run
        want = await pipeline.complete(
            PROMPT, max_tokens=TOKENS, ignore_eog=True, sampling=sampling, speculation=plain
        )
        await assert_seed_matters(pipeline, want, sampling)
        drafter = OracleDrafter(
            want.prompt_token_ids + want.token_ids,
            error_rate=0.3,
            vocab_size=pipeline.config.vocab_size,
        )
        process = pipeline.stages[1].process
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            sampling=sampling,
            drafter=drafter,
            on_token=after(FAIL_AT, action=kill(process.pid)),
        )
        assert_recovered(got, want)
        assert process.restarts == 1
        # it speculated after the replay too (these are the last stretch's figures)
        assert 0 < got.timings["draft_n_accepted"] < got.timings["draft_n"]


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
        with trio.fail_after(120):  # a hang fails; how long it takes on a busy machine does not
            got = await pipeline.complete(
                PROMPT,
                max_tokens=TOKENS,
                ignore_eog=True,
                on_token=after(FAIL_AT, action=kill(stalled, signal.SIGSTOP)),
            )
        assert_varied(want.token_ids)
        assert got.token_ids == want.token_ids
        assert got.timings["recoveries"] >= 1
        assert process.probe_kills == 1 and process.pid != stalled


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


@asynccontextmanager
async def reset_chain(
    model: ModelFile, recovery: RecoveryPolicy | None = None, last_backend: Any = None
) -> AsyncIterator[tuple[Pipeline, ResettingProxy]]:
    """Three in-process stages; the hop from stage 1 to stage 2 goes through a resetting relay."""
    ranges = [(0, 2), (2, 3), (3, 4)]
    async with trio.open_nursery() as nursery:
        last = await nursery.start(
            partial(serve_stage, last_backend or NumpyBackend(model, ranges[2]), index=2)
        )
        proxy = ResettingProxy(last)
        hop = await nursery.start(proxy.serve)
        middle = await nursery.start(
            partial(serve_stage, NumpyBackend(model, ranges[1]), index=1, downstream=hop)
        )
        async with open_pipeline(
            model, layers=ranges, remote=[middle, last], recovery=recovery
        ) as pipeline:
            yield pipeline, proxy
        nursery.cancel_scope.cancel()


async def test_a_reset_connection_between_stages_is_recovered(tiny_model: ModelFile) -> None:
    async with reset_chain(tiny_model) as (pipeline, proxy):
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            on_token=after(FAIL_AT, action=proxy.reset_all),
        )
    assert_recovered(got, want)


def drop_one_token(prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
    context = replay_context(prompt_ids, generated)
    return context[:-2] + context[-1:] if generated else context


def drop_the_prompt(prompt_ids: Sequence[int], generated: Sequence[int]) -> list[int]:
    return list(generated) if generated else replay_context(prompt_ids, generated)


@pytest.mark.parametrize("wrong_replay", [drop_one_token, drop_the_prompt])
async def test_the_equality_check_catches_a_wrong_replay(
    tiny_model: ModelFile, monkeypatch: pytest.MonkeyPatch, wrong_replay: Any
) -> None:
    """Mutation check: a replay that loses a committed token or the prompt must be caught.

    Same run as the reset test above, with the replay deliberately broken: the tokens before
    the break still agree, and `assert_recovered`, the check every recovery test makes, fails.
    """
    async with reset_chain(tiny_model) as (pipeline, proxy):
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        monkeypatch.setattr(stagerun._driver._request, "replay_context", wrong_replay)
        got = await pipeline.complete(
            PROMPT,
            max_tokens=TOKENS,
            ignore_eog=True,
            on_token=after(FAIL_AT, action=proxy.reset_all),
        )
    assert got.timings["recoveries"] == 1
    assert got.token_ids[:FAIL_AT] == want.token_ids[:FAIL_AT]
    with pytest.raises(AssertionError):
        assert_recovered(got, want)


async def test_max_breaks_fails_the_request_on_the_break_after_the_limit(
    tiny_model: ModelFile,
) -> None:
    recovery = RecoveryPolicy(max_breaks=2)
    async with reset_chain(tiny_model, recovery) as (pipeline, proxy):
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        twice = after(20, 50, action=proxy.reset_all)
        got = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True, on_token=twice)
        assert_recovered(got, want, recoveries=2)  # the limit itself is survived
        assert pipeline.recoveries == 2 and pipeline.recovery_failures == 0
        thrice = after(20, 50, 80, action=proxy.reset_all)
        with pytest.raises(RecoveryFailedError, match=r"failed 3 times .*\(the limit is 2\)"):
            await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True, on_token=thrice)
        assert pipeline.recoveries == 4 and pipeline.recovery_failures == 1


class FailingOnce(NumpyBackend):
    """The last stage's backend, failing its ``fail_at``-th forward with an error it reports."""

    def __init__(self, model: ModelFile, layers: tuple[int, int], fail_at: int) -> None:
        super().__init__(model, layers)
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("an injected compute failure")
        return super().forward(*args, **kwargs)


async def test_a_stage_that_answers_with_an_error_frame_is_recovered(
    tiny_model: ModelFile, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FailingOnce(tiny_model, (3, 4), fail_at=10**9)
    async with reset_chain(tiny_model, last_backend=backend) as (pipeline, _):
        want = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        backend.fail_at = backend.calls + FAIL_AT  # one prefill, then FAIL_AT - 1 decode steps
        got = await pipeline.complete(PROMPT, max_tokens=TOKENS, ignore_eog=True)
        assert pipeline.pool is not None and pipeline.pool.replaced >= 1
    assert_recovered(got, want)
    assert "compute failed: an injected compute failure" in caplog.text


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
            with (
                trio.fail_after(60),  # bounded: it fails, it does not hang
                pytest.raises(RecoveryFailedError, match=r"no working lane .* within 2s"),
            ):
                await pipeline.complete(
                    PROMPT,
                    max_tokens=TOKENS,
                    ignore_eog=True,
                    on_token=after(10, action=stage_scope.cancel),
                )
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
                    on_token=after(10, action=stage_scope.cancel),
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
                PROMPT,
                max_tokens=TOKENS,
                ignore_eog=True,
                on_token=after(FAIL_AT, action=kill_primaries),
            )
            health = await pipeline.check_health()
        assert_recovered(got, want)
        assert servers["s1"].computes > 0 and servers["s2"].computes > 0
        # /health tells the failover as it is: primaries down, the standbys serving.
        assert [h.available for h in health] == [True] * 3
        for h, primary, standby in ((health[1], p1, s1), (health[2], p2, s2)):
            json = h.to_json()
            assert json["address"] == primary and json["state"] == "unreachable"
            assert [s["address"] for s in json["standbys"]] == [standby]
            assert json["standbys"][0]["state"] == "ready" and json["serving"] == standby
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
