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
they wait for the restarted process and replay their committed tokens.

The child is started through ``StageProcess.spawn`` (`trio.run_process` by default), so tests
drive the supervisor against a fake child on a fake clock.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal, Protocol, cast

import attrs
import trio

from .. import _proto
from .._errors import LaneError, StageError
from .._wire._connect import open_connection
from ._config import SupervisionPolicy
from ._values import StageInfo

log = logging.getLogger("stagerun.supervise")

State = Literal["starting", "running", "restarting", "stopped"]


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


#: Runs ``command`` until it exits, reporting the started `Child` through ``task_status``
#: (the shape of `trio.run_process`); cancelling it kills the child.
Spawn = Callable[..., Awaitable[object]]


async def spawn_process(
    command: list[str], *, task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a ``stagerun stage`` child, its stdout piped, until it exits."""
    await trio.run_process(
        command,
        stdout=subprocess.PIPE,
        check=False,
        # Its own session: a terminal's Ctrl-C reaches only the driver, which then stops the
        # stages in order.
        start_new_session=True,
        task_status=task_status,
    )


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
    spawn: Spawn = attrs.field(default=spawn_process, kw_only=True, repr=False)

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
        return out

    async def run(self, *, task_status: trio.TaskStatus[StageProcess]) -> None:
        """Start the child, report it ready, and keep it running until cancelled.

        Raises:
            StageError: the first start failed (a restart that fails is retried instead).
        """
        delay: float | None = None
        first = True
        try:
            while True:
                error, uptime = await self._run_once(task_status if first else None)
                if first and self.address is None:
                    raise StageError(error or f"stage {self.index} did not start")
                first = False
                self.last_error = error
                if not self.policy.restart:
                    self.state = "stopped"
                    return
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
            self.state = "stopped"

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


def stage_command(argv: Sequence[str]) -> list[str]:
    """The command line of a ``stagerun stage`` child (without ``--listen``)."""
    return [sys.executable, "-m", "stagerun", "stage", *argv]
