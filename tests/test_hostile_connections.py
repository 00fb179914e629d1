"""Peers that connect and then hold on: a stage's open files are bounded, honest lanes served.

Every connection costs a stage one open file, whoever opened it. The attack test runs a real
``stagerun stage`` process at 256 open files (soft and hard, so raising the soft limit does not
help), parks return connections and opens silent sockets, more than the stage has files for,
then shows an honest lane still gets its prediction at once. The other tests pin down each
limit on an in-process stage: handshakes in progress, connections open, idle connections, the
open-file limit; then how a lane's failure is logged and the exposure warnings at start.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import trio
from _oracle import assert_varied
from _processes import start_stage
from _stage_client import honest_request

from stagerun import LaneError, open_pipeline
from stagerun import _proto as proto
from stagerun._errors import LaneBrokenError, ProtocolError
from stagerun._stage._server import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HANDSHAKES,
    FD_RESERVE,
    StageServer,
    _warn_if_open,
)
from stagerun._util import raise_open_file_limit
from stagerun._wire._auth import SECRET_ENV, SECRET_FILE_ENV
from stagerun._wire._connect import open_connection
from stagerun._wire._framed import FrameStream
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

SECRET = b"correct horse battery staple 42"
OPEN_FILES = 256  # the attacked stage's open-file limit, soft and hard
PARKED = 150  # return connections the attacker completes and leaves idle
SILENT = 200  # sockets that never send a hello (with PARKED, well past OPEN_FILES)
HONEST_SECONDS = 5.0  # an honest request must finish this soon under the flood
LIMIT = 30.0  # a real-clock bound on a whole wait: failing it means "hung", not "slow"
# Starts `stagerun` with its open files limited, without a preexec_fn.
LIMITED = (
    "import resource, runpy, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({OPEN_FILES}, {OPEN_FILES})); "
    "sys.argv = ['stagerun', *sys.argv[1:]]; runpy.run_module('stagerun', run_name='__main__')"
)


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


async def _start(nursery: trio.Nursery, server: StageServer) -> str:
    address: str = await nursery.start(server.serve)
    return address


async def _park(address: str, key: int) -> FrameStream:
    return await open_connection(
        address, role=proto.Role.RETURN, key=key, connect_timeout=2, ready_timeout=2, secret=None
    )


async def _closed_by_stage(stream: trio.SocketStream, within: float = LIMIT) -> bool:
    """True once the stage closes ``stream``; False if it is still open after ``within``."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


async def _until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(LIMIT):
        while not condition():  # noqa: ASYNC110 -- the stage's counters have no events
            await trio.sleep(0.01)


# -- the attack: a real stage at 256 open files --------------------------------------------------


async def test_an_honest_lane_is_served_while_strangers_hold_more_sockets_than_it_has_files(
    tiny_model_path: pathlib.Path, last_stage_backend: NumpyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    raise_open_file_limit()  # this process holds the attacker's ~350 sockets
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)  # a stage anyone may hand work to
    command = [
        sys.executable, "-c", LIMITED, "-v", "stage", "--model", str(tiny_model_path),
        "--layers", "2:4", "--index", "1",
    ]  # fmt: skip
    parked: list[FrameStream] = []
    silent: list[trio.SocketStream] = []
    stderr = bytearray()
    try:
        with trio.fail_after(4 * LIMIT):
            async with trio.open_nursery() as nursery:
                proc, address = await start_stage(nursery, command, stderr=stderr)

                for key in range(PARKED):  # completed handshakes, then nothing
                    with contextlib.suppress(LaneError):  # before the fix: files run out
                        parked.append(await _park(address, 1000 + key))
                for _ in range(SILENT):  # no hello at all
                    silent.append(await trio.open_tcp_stream(*_host_port(address)))

                started = time.perf_counter()
                with trio.fail_after(HONEST_SECONDS):
                    await honest_request(address, last_stage_backend)
                print(f"honest request under the flood: {time.perf_counter() - started:.3f}s")
                assert proc.returncode is None, "the stage died under the flood"
                proc.terminate()
    finally:
        for back in parked:
            await back.aclose_forcefully()
        for stream in silent:
            await stream.aclose()
    log = stderr.decode()
    assert "to make room" in log  # the stage said what it did
    assert "Too many open files" not in log


# -- each limit, on an in-process stage ----------------------------------------------------------


def test_the_defaults() -> None:
    assert DEFAULT_MAX_CONNECTIONS == 1024
    assert DEFAULT_MAX_HANDSHAKES == 64
    assert DEFAULT_IDLE_TIMEOUT == 600.0  # minutes: stage 0 replaces a lane closed while idle
    assert FD_RESERVE == 64


@pytest.mark.parametrize(
    "kwargs",
    [{"max_connections": 0}, {"max_handshakes": 0}, {"idle_timeout": 0}, {"idle_timeout": -1.0}],
)
def test_limits_must_be_positive(
    last_stage_backend: NumpyBackend, kwargs: dict[str, float]
) -> None:
    with pytest.raises(ValueError, match="must be"):
        StageServer(last_stage_backend, index=1, **kwargs)  # type: ignore[arg-type]


async def test_handshakes_in_progress_are_limited_and_the_oldest_gives_way(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None, max_handshakes=4)
    address = await _start(nursery, server)
    silent = [await trio.open_tcp_stream(*_host_port(address)) for _ in range(10)]
    try:
        await _until(lambda: server.turned_away == 6)
        assert server.handshakes_in_progress == 4
        for stream in silent[:6]:  # the oldest went at once, long before the handshake timeout
            assert await _closed_by_stage(stream, within=LIMIT)
        for stream in silent[6:]:
            assert not await _closed_by_stage(stream, within=0.05)
        # An honest peer, the newest, handshakes at once: the oldest silent one gives way.
        with trio.fail_after(2):
            lane = await open_connection(
                address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
            )
        await lane.aclose_forcefully()
        assert server.turned_away == 7
        assert await _closed_by_stage(silent[6], within=LIMIT)
    finally:
        for stream in silent:
            await stream.aclose()


async def test_connections_past_the_limit_close_the_quietest(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None, max_connections=3)
    address = await _start(nursery, server)
    parked = [await _park(address, key) for key in (1, 2, 3)]
    try:
        newest = await _park(address, 4)  # one too many: key 1 has been quiet longest
        parked.append(newest)
        await _until(lambda: sorted(server._sinks) == [2, 3, 4])
        assert server.turned_away == 1 and server.connection_limit == 3
        assert not parked[0].is_live() and all(p.is_live() for p in parked[1:])
    finally:
        for stream in parked:
            await stream.aclose_forcefully()


async def test_a_return_connection_never_bound_is_closed_when_idle(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    idle = 0.5
    server = StageServer(last_stage_backend, index=1, secret=None, idle_timeout=idle)
    address = await _start(nursery, server)
    started = trio.current_time()
    back = await _park(address, 7)
    try:
        await _until(lambda: 7 in server._sinks)  # parked once READY has gone out
        await _until(lambda: 7 not in server._sinks)
        waited = trio.current_time() - started
        assert idle <= waited < idle + 2.0
        assert server.idled_out == 1 and not back.is_live()
    finally:
        await back.aclose_forcefully()


async def test_a_lane_that_sends_nothing_is_closed_and_one_that_talks_is_not(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    idle = 0.5
    server = StageServer(last_stage_backend, index=1, secret=None, idle_timeout=idle)
    address = await _start(nursery, server)
    quiet = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
    )
    talking = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
    )
    try:
        with trio.fail_after(LIMIT):
            for _ in range(int(3 * idle / 0.1)):  # three idle timeouts, a Stop every 0.1 s
                await talking.send(proto.Stop(request_id=1), timeout=5)
                assert isinstance((await talking.receive(timeout=5)).message, proto.Ack)
                await trio.sleep(0.1)
        assert server.idled_out == 1 and server.lanes_open == 1
        assert not quiet.is_live() and talking.is_live()
    finally:
        await quiet.aclose_forcefully()
        await talking.aclose_forcefully()


async def test_a_bound_return_connection_lives_as_long_as_its_lane(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    """A long prefill sends nothing back: the return connection is quiet, not idle."""
    idle = 0.5
    server = StageServer(last_stage_backend, index=1, secret=None, idle_timeout=idle)
    address = await _start(nursery, server)
    back = await _park(address, 7)
    lane = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
    )
    try:
        configure = proto.Configure(
            request_id=1, return_key=7, prompt_len=3, sampling=proto.SamplingParams()
        )
        await lane.send(configure, timeout=5)
        assert isinstance((await lane.receive(timeout=5)).message, proto.Ack)
        with trio.fail_after(LIMIT):
            for _ in range(int(3 * idle / 0.1)):  # the lane talks, the return path is silent
                await lane.send(proto.Stop(request_id=2), timeout=5)
                assert isinstance((await lane.receive(timeout=5)).message, proto.Ack)
                await trio.sleep(0.1)
        assert back.is_live() and server.idled_out == 0
        # the lane falls silent: both go (the lane closes its sink, then counts itself closed)
        await _until(lambda: 7 not in server._sinks and server.lanes_open == 0)
        assert server.idled_out == 1
    finally:
        await lane.aclose_forcefully()
        await back.aclose_forcefully()


async def test_a_pipeline_carries_on_when_its_stage_closes_idle_lanes(
    tiny_model: ModelFile, nursery: trio.Nursery
) -> None:
    ranges = [(0, 2), (2, 4)]
    server = StageServer(
        NumpyBackend(tiny_model, ranges[1]), index=1, secret=None, idle_timeout=0.5
    )
    address = await _start(nursery, server)
    async with open_pipeline(tiny_model, layers=ranges, remote=[address]) as pipeline:
        first = await pipeline.complete("The lighthouse keeper", max_tokens=24)
        assert_varied(first.token_ids)  # a lane that lost its state could not repeat these
        await _until(lambda: server.lanes_open == 0 and not server._sinks)  # all idled out
        second = await pipeline.complete("The lighthouse keeper", max_tokens=24)
        assert server.idled_out >= 1 and pipeline.recoveries == 0  # replaced at checkout
    assert second.token_ids == first.token_ids


# -- the open-file limit ---------------------------------------------------------------------


def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 64:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    script = (
        "import resource; from stagerun._util import raise_open_file_limit; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard})); "
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(hard), str(hard)]


def test_the_connection_limit_stays_below_the_open_file_limit(
    tiny_model: ModelFile, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagerun.stage")
    last = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    last._limit_connections(256)
    assert last.connection_limit == 256 - FD_RESERVE
    assert "takes at most 192 connections: its open-file limit is 256" in caplog.text
    middle = StageServer(
        NumpyBackend(tiny_model, (1, 2)), index=1, downstream="tcp://127.0.0.1:1", secret=None
    )
    middle._limit_connections(256)  # each lane of a middle stage also opens its next hop
    assert middle.connection_limit == (256 - FD_RESERVE) // 2
    roomy = StageServer(NumpyBackend(tiny_model, (2, 4)), index=1, secret=None)
    roomy._limit_connections(1 << 20)
    roomy._limit_connections(None)
    assert roomy.connection_limit == DEFAULT_MAX_CONNECTIONS


# -- a lane's failure, logged once --------------------------------------------------------------


async def _lane_that_fails_with(
    error: BaseException,
    server: StageServer,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
) -> None:
    async def run(worker: object) -> None:
        raise error

    monkeypatch.setattr("stagerun._stage._server.LaneWorker.run", run)
    address = await _start(nursery, server)
    lane = await open_connection(
        address, role=proto.Role.LANE, connect_timeout=2, ready_timeout=2, secret=None
    )
    with pytest.raises(LaneError):  # the stage closes the lane once it has logged its end
        await lane.receive(timeout=LIMIT)
    await lane.aclose_forcefully()


def _malformed() -> LaneBrokenError:
    try:
        raise ProtocolError("bad magic")
    except ProtocolError as exc:
        error = LaneBrokenError("upstream sent a malformed frame: bad magic")
        error.__cause__ = exc
        return error


async def test_a_lane_failure_in_an_exception_group_is_one_info_line(
    last_stage_backend: NumpyBackend,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stagerun.stage")
    server = StageServer(last_stage_backend, index=1, secret=None)
    group = ExceptionGroup(
        "lane tasks",
        [_malformed(), ExceptionGroup("relay", [LaneBrokenError("downstream closed")])],
    )
    await _lane_that_fails_with(group, server, monkeypatch, nursery)
    ended = [r for r in caplog.records if "ended" in r.getMessage()]
    assert len(ended) == 1 and ended[0].levelno == logging.INFO
    assert "bad magic" in ended[0].getMessage() and "downstream closed" in ended[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert server.protocol_errors == 1


async def test_a_bug_in_a_lane_is_still_logged_with_its_traceback(
    last_stage_backend: NumpyBackend,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None)
    group = ExceptionGroup("lane tasks", [_malformed(), RuntimeError("a bug")])
    await _lane_that_fails_with(group, server, monkeypatch, nursery)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR and failed[0].exc_info


# -- the warnings at start ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "secret", "warning"),
    [
        ("tcp://0.0.0.0:9001", None, "without lane authentication"),
        ("ws://0.0.0.0:9001/stagerun/lane", None, "without lane authentication"),
        ("ws://0.0.0.0:9001", None, "without lane authentication"),
        ("wss://[::]:9001/lanes", None, "without lane authentication"),
        ("tcp://0.0.0.0:9001", SECRET, "in the clear"),
        ("ws://0.0.0.0:9001/lanes", SECRET, "in the clear"),
        ("tls://0.0.0.0:9001", SECRET, None),
        ("wss://0.0.0.0:9001/lanes", SECRET, None),
        ("tcp://127.0.0.1:9001", None, None),
        ("ws://127.0.0.1:9001/lanes", None, None),
        ("unix:///run/stage.sock", None, None),
    ],
)
def test_a_stage_warns_when_it_is_open_or_in_the_clear(
    address: str, secret: bytes | None, warning: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    _warn_if_open(address, secret, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if warning is None:
        assert warnings == []
        return
    assert len(warnings) == 1 and warning in warnings[0] and address in warnings[0]
    if secret is not None:
        assert "tls:// or wss://" in warnings[0] and "tampering" in warnings[0]
