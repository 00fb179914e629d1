"""Child processes in tests: whether one is still alive (from /proc), and starting a stage."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping, Sequence

import trio


async def start_stage(
    nursery: trio.Nursery,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stderr: bytearray | None = None,
) -> tuple[trio.Process, str]:
    """Run a ``stagerun stage`` command in ``nursery``: its process and the address it printed
    ``READY`` for. With ``stderr``, the stage's standard error is collected into it."""
    proc: trio.Process = await nursery.start(
        functools.partial(
            trio.run_process,
            list(command),
            stdout=subprocess.PIPE,
            stderr=None if stderr is None else subprocess.PIPE,
            env=env,
            check=False,
        )
    )
    assert proc.stdout is not None
    if stderr is not None:
        assert proc.stderr is not None
        nursery.start_soon(collect, proc.stderr, stderr)
    line = b""
    while not line.endswith(b"\n"):
        data = await proc.stdout.receive_some(1)
        assert data, f"the stage exited before it was ready: {(stderr or b'').decode()}"
        line += data
    return proc, line.decode().removeprefix("READY ").strip()


async def collect(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    """Append everything ``stream`` carries to ``into``, until it ends."""
    while data := await stream.receive_some(65536):
        into += data


def running(pid: int) -> bool:
    """True until ``pid`` has exited for good: once False, its sockets are closed.

    A zombie has exited only when all its threads have: after SIGKILL the main thread can turn
    zombie while other threads (BLAS, Trio's worker threads) are still being torn down, and the
    process's sockets stay open (a listening one still completes handshakes) until they are.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1
    except FileNotFoundError:
        return False
