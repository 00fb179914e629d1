"""The supervisor's restart schedule: the pure decision, then the Trio driver on a fake clock.

`SupervisionPolicy.restart_delay` decides how long to wait before a restart, and
`SupervisionPolicy.gives_up` when to stop restarting; `StageProcess.run` carries them out. The
driver runs here against a fake child (`FakeLauncher`, a stand-in for
`trio.run_process`) under `autojump_clock`, so "10 s of backoff" takes no real time and every
wait is measured exactly.
"""

from __future__ import annotations

import itertools
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from stagerun import StageError, SupervisionPolicy
from stagerun._driver._config import DEFAULT_FAILURE_WINDOW, DEFAULT_MAX_FAILURES
from stagerun._driver._supervise import StageProcess, given_up, stop_processes
from stagerun._driver._values import StageInfo

ADDRESS = "tcp://127.0.0.1:9001"  # what the fake child reports; nothing connects to it


# -- the pure schedule ---------------------------------------------------------------------


def _delays(policy: SupervisionPolicy, uptimes: list[float]) -> list[float]:
    """The wait before each restart, for processes that ran ``uptimes`` seconds in turn."""
    out: list[float] = []
    previous: float | None = None
    for uptime in uptimes:
        previous = policy.restart_delay(previous, uptime)
        out.append(previous)
    return out


def test_the_documented_defaults() -> None:
    """docs/reliability.md: 0.2 s doubling to 10 s, reset after 30 s of uptime."""
    policy = SupervisionPolicy()
    assert (policy.backoff, policy.max_backoff, policy.stable_after) == (0.2, 10.0, 30.0)


def test_the_backoff_doubles_up_to_the_cap() -> None:
    delays = _delays(SupervisionPolicy(), [1.0] * 9)
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0])


def test_a_stable_run_resets_the_backoff() -> None:
    policy = SupervisionPolicy()
    crashing = [1.0] * 6  # up to 6.4 s
    delays = _delays(policy, [*crashing, 30.5, 1.0, 1.0])
    assert delays[5] == pytest.approx(6.4)
    assert delays[6:] == pytest.approx([0.2, 0.4, 0.8])  # reset, then doubling again
    # exactly stable_after is not longer than it: no reset
    assert _delays(policy, [*crashing, 30.0])[-1] == pytest.approx(10.0)


@given(
    backoff=st.floats(0.01, 5.0),
    factor=st.floats(1.0, 100.0),
    stable_after=st.floats(1.0, 100.0),
    uptimes=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=30),
)
def test_the_schedule_is_bounded_and_resets_exactly_after_stable_runs(
    backoff: float, factor: float, stable_after: float, uptimes: list[float]
) -> None:
    policy = SupervisionPolicy(
        backoff=backoff, max_backoff=backoff * factor, stable_after=stable_after
    )
    delays = _delays(policy, uptimes)
    for i, (uptime, delay) in enumerate(zip(uptimes, delays, strict=True)):
        assert backoff <= delay <= policy.max_backoff
        if i == 0 or uptime > stable_after:
            assert delay == backoff
        else:
            assert delay == min(delays[i - 1] * 2, policy.max_backoff)


# -- the driver, against a fake child on a fake clock ----------------------------------------


@attrs.define(eq=False)
class FakeChild:
    """What `StageProcess` sees of a started child: a pid, stdout, kill, wait."""

    pid: int
    stdout: trio.abc.ReceiveStream
    returncode: int | None = None
    killed: trio.Event = attrs.field(factory=trio.Event)
    exited: trio.Event = attrs.field(factory=trio.Event)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.killed.set()

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode


@attrs.frozen
class Life:
    """One scripted run of the child: it prints READY (or not) and exits after ``uptime``."""

    uptime: float
    ready: bool = True


@attrs.define(eq=False)
class FakeLauncher:
    """Plays `Life` after `Life`; after the script, the child runs until cancelled.

    Records the fake time of every start and exit and each command line.
    """

    script: list[Life]
    starts: list[float] = attrs.field(factory=list)
    exits: list[float] = attrs.field(factory=list)
    commands: list[list[str]] = attrs.field(factory=list)
    children: list[FakeChild] = attrs.field(factory=list)
    script_done: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(
        self, command: list[str], *, task_status: trio.TaskStatus[FakeChild]
    ) -> None:
        n = len(self.starts)
        self.starts.append(trio.current_time())
        self.commands.append(command)
        life = self.script[n] if n < len(self.script) else Life(math.inf)
        out, stdout = trio.testing.memory_stream_one_way_pair()
        child = FakeChild(pid=1000 + n, stdout=stdout)
        self.children.append(child)
        task_status.started(child)
        if n == len(self.script):
            self.script_done.set()
        try:
            if life.ready:
                await out.send_all(f"READY {ADDRESS}\n".encode())
            with trio.move_on_after(life.uptime):
                await child.killed.wait()
        finally:  # also when cancelled, as trio.run_process kills its child
            child.returncode = -9 if child.killed.is_set() else 1
            self.exits.append(trio.current_time())
            out.close()
            child.exited.set()


def _process(
    launcher: FakeLauncher, policy: SupervisionPolicy, port_free: Callable[[str], bool] = bool
) -> StageProcess:
    return StageProcess(
        1, ["stagerun", "stage"], "tcp://127.0.0.1:0", policy, spawn=launcher, port_free=port_free
    )


def _waits(launcher: FakeLauncher) -> list[float]:
    """Fake seconds between each exit and the next start."""
    return [launcher.starts[i + 1] - launcher.exits[i] for i in range(len(launcher.starts) - 1)]


NO_PROBES = SupervisionPolicy(probe_interval=0)
STUCK = 3600.0  # fake seconds: a supervisor that gets stuck fails the test, not hangs it


async def test_the_supervisor_backs_off_doubling_and_resets_after_a_stable_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = [Life(1.0)] * 8 + [Life(40.0)] + [Life(1.0)] * 2
    launcher = FakeLauncher(script)
    patient = attrs.evolve(NO_PROBES, max_failures=100)  # the schedule, not the cap, here
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, patient).run)
            assert process.state == "running" and process.address == ADDRESS
            await launcher.script_done.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert process.state == "running"
            nursery.cancel_scope.cancel()

    crashing = [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]  # doubling to the cap
    after_stable = [0.2, 0.4, 0.8]  # after the 40 s run: from the start again
    assert _waits(launcher) == pytest.approx([*crashing, *after_stable])
    assert process.restarts == len(script)
    assert process.last_exit == 1 and process.state == "stopped"
    assert process.pid == launcher.children[-1].pid
    # the first start picks a port; every restart reuses the address the child reported
    assert launcher.commands[0][-2:] == ["--listen", "tcp://127.0.0.1:0"]
    assert all(command[-2:] == ["--listen", ADDRESS] for command in launcher.commands[1:])


async def test_a_restart_that_never_gets_ready_is_killed_and_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The hung start lasts longer than a stable run, but it never served: no reset.
    policy = attrs.evolve(NO_PROBES, ready_timeout=45.0)
    launcher = FakeLauncher([Life(1.0), Life(math.inf, ready=False)])
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, policy).run)
            await launcher.script_done.wait()
            await trio.testing.wait_all_tasks_blocked()
            hung = launcher.children[1]
            assert hung.killed.is_set() and hung.returncode == -9
            assert launcher.exits[1] - launcher.starts[1] == pytest.approx(45.0)  # ready_timeout
            assert process.last_error == "no ready line within 45s"
            nursery.cancel_scope.cancel()
    # a killed start counts as a crash: the backoff keeps doubling through it
    assert _waits(launcher) == pytest.approx([0.2, 0.4])
    assert process.restarts == 2 and process.address == ADDRESS


async def test_a_first_start_that_fails_is_an_error_not_a_restart_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    launcher = FakeLauncher([Life(0.5, ready=False)])
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            with pytest.raises(
                StageError, match=r"stage 1 exited before it was ready \(exit code 1\)"
            ):
                await nursery.start(_process(launcher, NO_PROBES).run)
    assert len(launcher.starts) == 1


async def test_without_restart_an_exited_stage_stays_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    launcher = FakeLauncher([Life(3.0)])
    policy = attrs.evolve(NO_PROBES, restart=False)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, policy).run)
    assert process.state == "stopped" and process.restarts == 0 and process.last_exit == 1
    assert len(launcher.starts) == 1


# -- giving up -------------------------------------------------------------------------------


def test_the_failure_cap_defaults() -> None:
    policy = SupervisionPolicy()
    assert (policy.max_failures, policy.failure_window) == (5, 60.0)
    assert (DEFAULT_MAX_FAILURES, DEFAULT_FAILURE_WINDOW) == (5, 60.0)
    with pytest.raises(ValueError, match="max_failures must be at least 1"):
        SupervisionPolicy(max_failures=0)
    with pytest.raises(ValueError, match="failure_window must be positive"):
        SupervisionPolicy(failure_window=0)


def test_it_gives_up_at_the_fifth_exit_within_a_minute() -> None:
    policy = SupervisionPolicy()
    assert not policy.gives_up([])
    assert not policy.gives_up([1.0, 2.0, 3.0, 4.0])
    assert policy.gives_up([1.0, 2.0, 3.0, 4.0, 5.0])
    assert policy.gives_up([0.0, 10.0, 20.0, 30.0, 59.9])
    # the first exit is more than 60 s before the fifth: forgotten
    assert not policy.gives_up([0.0, 10.0, 20.0, 30.0, 60.0])
    assert not policy.gives_up([0.0, 30.0, 61.0, 91.0, 122.0, 152.0])  # steady, but sparse


@given(
    max_failures=st.integers(1, 8),
    window=st.floats(1.0, 100.0),
    gaps=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=30),
)
def test_it_gives_up_exactly_when_max_failures_fall_within_the_window(
    max_failures: int, window: float, gaps: list[float]
) -> None:
    policy = SupervisionPolicy(max_failures=max_failures, failure_window=window)
    exits = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    recent = [t for t in exits if t > exits[-1] - window]
    assert policy.gives_up(exits) == (len(recent) >= max_failures)
    # only the latest max_failures exits matter (the supervisor keeps no more)
    assert policy.gives_up(exits) == policy.gives_up(exits[-max_failures:])


async def test_a_stage_that_keeps_exiting_is_given_up_and_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its port taken by another process, a restarted stage exits before it is ready, every
    time: the supervisor stops after 5 exits in 60 s instead of looping forever."""
    launcher = FakeLauncher([Life(1.0)] + [Life(0.5, ready=False)] * 20)
    never_again = SupervisionPolicy(probe_interval=0, recheck_interval=0)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, never_again).run)
            stage = StageInfo(1, (2, 4), ADDRESS, process=process)
            assert given_up([stage]) is None
        # run() returned on its own: nothing was cancelled
    assert len(launcher.starts) == 5 and process.restarts == 4
    assert launcher.exits[-1] - launcher.exits[0] < 60.0
    assert process.state == "failed" and process.running_pid is None
    reason = given_up([StageInfo(0, (0, 2), None), stage])
    assert reason == process.given_up
    assert reason is not None and reason.startswith(
        "stage 1 failed: its process exited 5 times within 60s (last exit code 1, "
        "stage 1 exited before it was ready"
    )
    assert reason.endswith("is not restarted again; fix the cause and restart stagerun")
    status = process.to_json()
    assert status["state"] == "failed" and status["given_up"] == reason


async def test_exits_spread_wider_than_the_window_are_restarted_forever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 20 s runs are not stable (30 s), so the backoff climbs to 10 s, but only 2 exits ever
    # fall within a minute.
    launcher = FakeLauncher([Life(20.0)] * 12)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, NO_PROBES).run)
            await launcher.script_done.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert process.state == "running" and process.given_up is None
            nursery.cancel_scope.cancel()
    assert process.restarts == 12 and process.state == "stopped"


async def test_a_cancelled_supervisor_is_stopped_not_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    launcher = FakeLauncher([Life(1.0)] * 3)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, NO_PROBES).run)
            await launcher.script_done.wait()
            nursery.cancel_scope.cancel()
    assert (
        process.state == "stopped"
        and given_up([StageInfo(1, (2, 4), ADDRESS, process=process)]) is None
    )


def test_the_failure_cap_comes_from_the_command_line() -> None:
    from stagerun._cli._options import build_parser, recovery_from_args

    parser = build_parser()
    _recovery, default = recovery_from_args(parser.parse_args(["serve"]))
    assert (default.max_failures, default.failure_window, default.recheck_interval) == (5, 60, 2)
    args = parser.parse_args(
        ["generate", "hi", "--max-stage-failures", "2", "--stage-failure-window", "7.5",
         "--stage-recheck", "0"]
    )  # fmt: skip
    _recovery, policy = recovery_from_args(args)
    assert (policy.max_failures, policy.failure_window, policy.recheck_interval) == (2, 7.5, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-stage-failures", "0"])


def test_a_given_up_stage_is_rechecked_doubling_up_to_the_window() -> None:
    policy = SupervisionPolicy()
    assert [policy.recheck_delay(n) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert policy.recheck_delay(10**6) == 60
    with pytest.raises(ValueError, match="recheck_interval must be 0 or more"):
        SupervisionPolicy(recheck_interval=-1)


@attrs.define
class Squatter:
    """Holds the stage's port until ``leaves`` (fake time); counts the checks."""

    leaves: float
    checks: list[float] = attrs.field(factory=list)

    def __call__(self, address: str) -> bool:
        assert address == ADDRESS  # the address it served at, kept for every restart
        self.checks.append(trio.current_time())
        return trio.current_time() >= self.leaves


async def test_a_given_up_stage_starts_again_once_its_port_is_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Given up after 5 quick exits (its port was taken), the stage stays failed while the
    port is held, and is started again once it is free: it serves, and is no longer given up."""
    launcher = FakeLauncher([Life(1.0)] + [Life(0.5, ready=False)] * 4)
    squatter = Squatter(leaves=100.0)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            process: StageProcess = await nursery.start(_process(launcher, NO_PROBES, squatter).run)
            stage = StageInfo(1, (2, 4), ADDRESS, process=process)
            while process.state != "failed":  # noqa: ASYNC110 (no event to wait on)
                await trio.sleep(0.1)
            failed_at = trio.current_time()
            assert given_up([stage]) is not None and len(launcher.starts) == 5
            assert process.given_up is not None and process.given_up.endswith(
                f"it is started again only once {ADDRESS} can be bound; fix the cause"
            )
            await launcher.script_done.wait()  # the sixth start: after the squatter left
            await trio.testing.wait_all_tasks_blocked()
            assert process.state == "running" and given_up([stage]) is None
            assert process.restarts == 5
            nursery.cancel_scope.cancel()
    assert launcher.starts[5] >= squatter.leaves
    assert launcher.starts[5] - squatter.leaves <= NO_PROBES.recheck_interval
    gaps = [b - a for a, b in itertools.pairwise([failed_at, *squatter.checks])]
    assert gaps[1:] == pytest.approx([NO_PROBES.recheck_interval] * (len(gaps) - 1))


async def test_a_revival_that_fails_again_waits_longer_before_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The cause was not the port (the start keeps failing although the port is free): one
    attempt per recheck, each wait twice the one before, up to the failure window."""
    launcher = FakeLauncher([Life(1.0)] + [Life(0.5, ready=False)] * 12)
    with trio.fail_after(STUCK):
        async with trio.open_nursery() as nursery:
            await nursery.start(_process(launcher, NO_PROBES).run)
            await launcher.script_done.wait()
            nursery.cancel_scope.cancel()
    # 5 starts to give up, then one start per revival (the exits in the window re-give it up)
    revival_waits = _waits(launcher)[4:]
    assert revival_waits[:5] == pytest.approx([2.0, 4.0, 8.0, 16.0, 32.0])
    assert max(revival_waits) == pytest.approx(60.0)  # the wait is capped at the window
    # within any window: the 5 starts that give up, and revivals after 2, 4, 8 and 16 s
    for i, start in enumerate(launcher.starts):
        within = [t for t in launcher.starts[i:] if t < start + DEFAULT_FAILURE_WINDOW]
        assert len(within) <= DEFAULT_MAX_FAILURES + 4


async def test_stop_processes_kills_what_ignores_sigterm_even_for_a_cancelled_caller() -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stubborn += "print('ready', flush=True); time.sleep(60)"
    procs = [
        await trio.lowlevel.open_process([sys.executable, "-c", code], stdout=subprocess.PIPE)
        for code in (stubborn, "print('ready', flush=True); import time; time.sleep(60)")
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert (await proc.stdout.receive_some(16)).startswith(b"ready")  # handler set
    started = time.monotonic()
    with trio.CancelScope() as scope:
        scope.cancel()  # a Ctrl-C'd benchmark: the servers still go
        await stop_processes(procs, 0.5)
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM]
    assert 0.4 < time.monotonic() - started < 10
    for proc in procs:
        assert proc.stdout is not None
        await proc.stdout.aclose()
