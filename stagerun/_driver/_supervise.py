"""Supervised stage processes: restart a stage that dies, kill one that stops answering.

Theory of operation: `StageProcess.run` is one task per ``stagerun stage`` child, under the
pipeline's nursery (so leaving `open_pipeline` stops the supervisor and its child together).
It starts the child, reads its ``READY <address>`` line, and from then on keeps the child's
address fixed: a restart passes ``--listen <that address>``, so upstream stages and stage 0
find the new process where the old one was and nobody needs to be told.

While the child runs, two tasks watch it: one drains its stdout (a child must never block on
a full pipe), the other is the liveness probe: every ``probe_interval`` seconds it opens a
connection and waits for the handshake. A process that is alive but fails ``probe_failures``
probes in a row (stopped, deadlocked, swapping) is killed, which turns a stall into a death.
When the child exits, for whatever reason, the supervisor waits (``backoff``, doubling up to
``max_backoff``; a run longer than ``stable_after`` resets it) and starts it again. That wait
is decided by the pure `SupervisionPolicy.restart_delay`; `StageProcess.run` only carries it
out. Requests that were using the stage recover on their own (`stagerun.RecoveryPolicy`):
they wait for the restarted process and replay their committed tokens. A stage that exits
``max_failures`` times within ``failure_window`` seconds (`SupervisionPolicy.gives_up`: its
port taken by another process, a model file gone) is given up: state ``failed``, and
`given_up` tells the requests that need it to fail at once. A given-up stage is started
again once its port can be bound (the squatter left), checked every
`SupervisionPolicy.recheck_delay` seconds.

A child must not outlive its supervisor, even one killed with SIGKILL, which runs no cleanup.
Its stdin is the read end of a pipe whose only write end this process holds, and
`exit_with_parent` (the ``stagerun stage`` command calls it first) exits the child when it
reads EOF there, which the kernel delivers as soon as this process is gone, however it died.
Linux's ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that forked the child
exits, and `trio.run_process` forks from a worker thread that Trio retires after 10 idle
seconds, which would kill every stage 10 s after its start.

The child is started through ``StageProcess.spawn`` (`spawn_process` by default), so tests
drive the supervisor against a fake child on a fake clock.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast, get_args

import attrs
import trio

from .. import _proto
from .._errors import LaneError, StageError
from .._orphans import EXIT_WITH_PARENT_ENV as EXIT_WITH_PARENT_ENV
from .._orphans import REMOVE_WITH_PARENT_ENV as REMOVE_WITH_PARENT_ENV
from .._orphans import exit_with_parent as exit_with_parent
from .._wire._address import parse_address
from .._wire._connect import ENV_SECRET, EnvSecret, open_connection
from ._config import SupervisionPolicy
from ._values import StageHealth, StageInfo

log = logging.getLogger("stagerun.supervise")

State = Literal["starting", "running", "restarting", "stopped", "failed"]
STATES: tuple[State, ...] = get_args(State)
# States in which the supervised process is not the one serving the stage's address, whatever
# answers there. ("stopped": supervision has ended, with restarts off; the address is the
# operator's again, and the handshake, with the lane secret, says whether it serves.)
NOT_SERVING: frozenset[State] = frozenset({"starting", "restarting", "failed"})


async def read_ready_line(proc: trio.Process, index: int) -> str:
    """The address a starting stage process prints on its ``READY`` line."""
    assert proc.stdout is not None
    buf = b""
    while b"\n" not in buf:
        data = await proc.stdout.receive_some(4096)
        if not data:
            raise StageError(
                f"stage {index} exited before it was ready (exit code {proc.poll()}); "
                "see its messages above"
            )
        buf += data
    line = buf.split(b"\n", 1)[0].decode()
    if not line.startswith("READY "):
        raise StageError(f"stage {index} printed {line!r} instead of its ready line")
    return line.split(" ", 1)[1].strip()


class Child(Protocol):
    """What the supervisor uses of a started child (`trio.Process` is one)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


STOP_GRACE_S = 5.0
"""Seconds a stage has to exit after SIGTERM before it is killed (`stop_child`)."""


async def stop_child(proc: trio.Process) -> None:
    """How a cancelled `spawn_process` stops its child: SIGTERM, then SIGKILL after
    `STOP_GRACE_S` (the caller waits for the exit, and cancels this once it comes).

    trio's own way does the same, but announces the SIGKILL with a `RuntimeWarning`; where
    warnings are errors (this project's tests) the warning is raised instead of the kill made,
    and the stop then waits, shielded, for a child that never exits. A stage whose compute
    thread hung did exactly that: its event loop ended, its thread did not, and CI waited.
    """
    try:
        proc.terminate()
        await trio.sleep(STOP_GRACE_S)
        log.warning("pid %d ignored SIGTERM for %gs; killing it", proc.pid, STOP_GRACE_S)
        proc.kill()
    except ProcessLookupError:  # it exited in between
        pass


#: Runs ``command`` until it exits, reporting the started `Child` through ``task_status``
#: (the shape of `trio.run_process`); cancelling it kills the child.
Spawn = Callable[..., Awaitable[object]]


async def spawn_process(
    command: list[str],
    *,
    env: Mapping[str, str] | None = None,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a ``stagerun stage`` child, its stdout piped, until it exits.

    Its stdin is a pipe that this process never writes to and closes only once the child has
    exited (or when this process dies): `exit_with_parent`, in the child, exits at its EOF.

    Args:
        env: the child's environment (default: this process's).
    """
    child_env = {**(os.environ if env is None else env), EXIT_WITH_PARENT_ENV: "1"}
    # Both ends are close-on-exec: only this child gets the read end (as its stdin), and no
    # other child inherits the write end (which would keep the pipe open after we die).
    watch_read, watch_write = os.pipe()
    try:
        async with trio.open_nursery() as nursery:
            try:
                proc: trio.Process = await nursery.start(
                    functools.partial(
                        trio.run_process,
                        command,
                        stdin=watch_read,
                        stdout=subprocess.PIPE,
                        check=False,
                        env=child_env,
                        deliver_cancel=stop_child,
                        # Its own session: a terminal's Ctrl-C reaches only the driver, which
                        # then stops the stages in order.
                        start_new_session=True,
                    )
                )
            finally:
                os.close(watch_read)
            task_status.started(proc)
    finally:
        os.close(watch_write)


@contextlib.asynccontextmanager
async def watched_process(command: Sequence[str], **options: Any) -> AsyncIterator[trio.Process]:
    """`trio.lowlevel.open_process` for a ``stagerun`` child that must not outlive this process.

    The child gets the same stdin pipe as `spawn_process` gives a stage, and
    ``$STAGERUN_EXIT_WITH_PARENT``, so that `exit_with_parent` ends it when this process dies,
    even by SIGKILL (a bench killed mid-run left its ``stagerun serve`` running). The caller
    still stops the child itself on the way out; a program that does not watch its stdin
    (``llama-server``) is unaffected.
    """
    env = {**(options.pop("env", None) or os.environ), EXIT_WITH_PARENT_ENV: "1"}
    watch_read, watch_write = os.pipe()
    try:
        try:
            proc = await trio.lowlevel.open_process(
                list(command), stdin=watch_read, env=env, **options
            )
        finally:
            os.close(watch_read)
        yield proc
    finally:
        os.close(watch_write)


async def stop_processes(procs: Sequence[trio.Process], grace: float) -> None:
    """Stop ``procs`` (a server a benchmark started, say): SIGTERM to all, ``grace`` seconds
    for them to exit, SIGKILL to the rest; returns once every one has exited. Shielded, so
    a cancelled caller (Ctrl-C on a benchmark) still leaves none of them running."""
    with trio.CancelScope(shield=True):
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # it exited in between
                proc.terminate()
        with trio.move_on_after(grace):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                log.warning("pid %d ignored SIGTERM for %gs; killing it", proc.pid, grace)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


@attrs.define(eq=False)
class StageProcess:
    """One supervised ``stagerun stage`` child; its fields are the live state `/health` shows."""

    index: int
    command: list[str]  # everything but --listen
    listen: str
    policy: SupervisionPolicy
    address: str | None = None
    pid: int | None = None
    state: State = "starting"
    restarts: int = 0
    probe_kills: int = 0
    last_exit: int | None = None
    last_error: str | None = None
    given_up: str | None = None  # why the supervisor gave up (state "failed")
    spawn: Spawn = attrs.field(default=spawn_process, kw_only=True, repr=False)
    # whether the stage's address can be bound now (a given-up stage waits for it)
    port_free: Callable[[str], bool] = attrs.field(
        default=lambda address: port_is_free(address), kw_only=True, repr=False
    )
    # the lane secret the liveness probe authenticates with (that of the stages started here)
    secret: bytes | EnvSecret | None = attrs.field(default=ENV_SECRET, kw_only=True, repr=False)

    @property
    def running_pid(self) -> int | None:
        """The child's pid while it serves; None while it starts, restarts or is stopped."""
        return self.pid if self.state == "running" else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "restarts": self.restarts}
        if self.pid is not None:
            out["pid"] = self.pid
        if self.last_exit is not None:
            out["last_exit"] = self.last_exit
        if self.probe_kills:
            out["killed_unresponsive"] = self.probe_kills
        if self.last_error is not None:
            out["last_error"] = self.last_error
        if self.given_up is not None:
            out["given_up"] = self.given_up
        return out

    async def run(self, *, task_status: trio.TaskStatus[StageProcess]) -> None:
        """Start the child, report it ready, and keep it running until cancelled.

        A stage given up (`SupervisionPolicy.gives_up`) stays in state ``failed`` until its
        port can be bound again (`port_is_free`, every `SupervisionPolicy.recheck_delay`),
        then is started once more; with ``recheck_interval`` 0 this returns when it gives up.

        Raises:
            StageError: the first start failed (a restart that fails is retried instead).
        """
        delay: float | None = None
        first = True
        revivals = 0  # revivals of a given-up stage since it last ran stably
        # the latest exits, oldest first: all that `SupervisionPolicy.gives_up` looks at
        exits: collections.deque[float] = collections.deque(maxlen=self.policy.max_failures)
        try:
            while True:
                error, uptime = await self._run_once(task_status if first else None)
                if first and self.address is None:
                    raise StageError(error or f"stage {self.index} did not start")
                first = False
                self.last_error = error
                exits.append(trio.current_time())
                if uptime > self.policy.stable_after:
                    revivals = 0
                if not self.policy.restart:
                    self.state = "stopped"
                    return
                if self.policy.gives_up(exits):
                    self._give_up(error)
                    if self.policy.recheck_interval <= 0:
                        return
                    await self._until_port_free(self.policy.recheck_delay(revivals))
                    revivals += 1
                    delay = None
                else:
                    delay = self.policy.restart_delay(delay, uptime)
                    self.state = "restarting"
                    log.warning(
                        "stage %d (pid %s) exited with %s%s; restarting in %.1fs",
                        self.index,
                        self.pid,
                        self.last_exit,
                        f" ({error})" if error else "",
                        delay,
                    )
                    await trio.sleep(delay)
                self.restarts += 1
        finally:
            if self.state != "failed":
                self.state = "stopped"

    async def _until_port_free(self, interval: float) -> None:
        """Wait in state ``failed`` until the stage's port can be bound (checked every
        ``interval`` seconds, the first time after one), then leave that state."""
        await trio.sleep(interval)
        while not self.port_free(self.listen):  # noqa: ASYNC110 (nothing says when it frees)
            await trio.sleep(interval)
        log.warning(
            "stage %d: its address %s is free again; starting it once more", self.index, self.listen
        )
        self.state = "restarting"
        self.given_up = None

    def _give_up(self, error: str | None) -> None:
        policy = self.policy
        self.state = "failed"
        self.given_up = (
            f"stage {self.index} failed: its process exited {policy.max_failures} times within "
            f"{policy.failure_window:g}s (last exit code {self.last_exit}"
            f"{f', {error}' if error else ''}); "
            + (
                f"it is started again only once {self.listen} can be bound; fix the cause"
                if policy.recheck_interval > 0
                else "it is not restarted again; fix the cause and restart stagerun"
            )
        )
        log.error("%s", self.given_up)

    async def _run_once(
        self, task_status: trio.TaskStatus[StageProcess] | None
    ) -> tuple[str | None, float]:
        """Run the child once, to its exit.

        Returns:
            The error that ended it early, if any, and how long it served after its ready
            line (0 if it never printed one).
        """

        error: str | None = None
        ready_at: float | None = None
        command = [*self.command, "--listen", self.listen]
        async with trio.open_nursery() as nursery:
            proc: Child = await nursery.start(functools.partial(self.spawn, command))
            self.pid = proc.pid
            try:
                with trio.fail_after(self.policy.ready_timeout):
                    # It reads only stdout and polls: a Child will do.
                    address = await read_ready_line(cast(trio.Process, proc), self.index)
            except (StageError, trio.TooSlowError) as exc:
                error = str(exc) or f"no ready line within {self.policy.ready_timeout:g}s"
                proc.kill()
            else:
                self.address = self.listen = address
                self.state = "running"
                ready_at = trio.current_time()
                if task_status is not None:
                    task_status.started(self)
                assert proc.stdout is not None
                nursery.start_soon(_drain, proc.stdout)
                if self.policy.probe_interval > 0:
                    nursery.start_soon(self._probe, proc, address)
            await proc.wait()
            self.last_exit = proc.returncode
            nursery.cancel_scope.cancel()
        return error, 0.0 if ready_at is None else trio.current_time() - ready_at

    async def _probe(self, proc: Child, address: str) -> None:
        failures = 0
        while True:
            await trio.sleep(self.policy.probe_interval)
            try:
                stream = await open_connection(
                    address,
                    role=_proto.Role.LANE,
                    connect_timeout=self.policy.probe_timeout,
                    ready_timeout=self.policy.probe_timeout,
                    secret=self.secret,
                )
            except LaneError as exc:
                failures += 1
                log.warning(
                    "stage %d (pid %d) failed liveness probe %d/%d: %s",
                    self.index,
                    proc.pid,
                    failures,
                    self.policy.probe_failures,
                    exc,
                )
                if failures >= self.policy.probe_failures:
                    log.error("stage %d (pid %d) is unresponsive; killing it", self.index, proc.pid)
                    self.probe_kills += 1
                    proc.kill()
                    return
                continue
            failures = 0
            await stream.aclose_forcefully()


def port_is_free(address: str) -> bool:
    """Whether this process could listen on ``address``'s host and port now (the port is
    bound and released at once, with ``SO_REUSEADDR`` as a stage binds it)."""
    try:
        _scheme, host, port = parse_address(address)
        family, kind, proto, _name, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[
            0
        ]
    except (ValueError, OSError):
        return True  # not an address to check: let the start say what is wrong
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(where)
        except OSError:
            return False
    return True


async def _drain(stdout: trio.abc.ReceiveStream) -> None:
    while await stdout.receive_some(65536):
        pass


def running_pids(stages: Iterable[StageInfo]) -> dict[int, int]:
    """The pid of each supervised stage process serving now, by stage index.

    A stage run as a task of this process (``inproc``) or joined from elsewhere (``remote``)
    has no process of its own here, so none.
    """
    processes = ((s.index, s.process) for s in stages if isinstance(s.process, StageProcess))
    return {i: p.running_pid for i, p in processes if p.running_pid is not None}


def given_up(stages: Iterable[StageInfo]) -> str | None:
    """Why a supervised stage of ``stages`` was given up (the first such one), or None."""
    for stage in stages:
        if isinstance(stage.process, StageProcess) and stage.process.given_up is not None:
            return stage.process.given_up
    return None


def is_serving(health: StageHealth) -> bool:
    """Whether a probed stage serves: an address of it answered the handshake and, for a
    stage process supervised here, that process is running (not starting, restarting or
    given up): whatever answers on the address of a process that is not running, it is not
    the stage."""
    process = health.stage.process
    if isinstance(process, StageProcess) and process.state in NOT_SERVING:
        return False
    return health.available


def stage_command(argv: Sequence[str]) -> list[str]:
    """The command line of a ``stagerun stage`` child (without ``--listen``).

    ``-P`` keeps the caller's working directory off the child's ``sys.path``: a module of
    the application's named like one the stage imports (``concurrent.py``) cannot shadow it.
    """
    return [sys.executable, "-P", "-m", "stagerun", "stage", *argv]
