"""The servers a bench measures: ``stagerun serve`` and ``llama-server``, started and found.

Each is started on a free loopback port with its output kept in a temporary file, polled
until ``/health`` says ok (or its output's tail is shown when it dies or never gets there),
and stopped on the way out. `stage_pids` finds a served pipeline's stage processes, for the
busy fractions a bench reports.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import IO

import trio

from ..._driver._supervise import stop_processes, watched_process
from ..._errors import StagerunError
from ._common import http_exchange
from ._service import SERVER_GRACE_S

__all__ = [
    "free_port",
    "launched",
    "llama_command",
    "llama_server_path",
    "serve_accepts",
    "serve_command",
    "stage_pids",
]

_HEALTH_DEADLINE_S = 300.0
_LLAMA_SERVER = pathlib.Path(".cache/llama.cpp/bin/llama-server")  # in a checkout of stagerun


def stage_pids(root: int) -> list[int]:
    """``root`` (stage 0) then its ``stagerun stage`` children, ordered by their ``--index``."""
    stages: list[tuple[int, int]] = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            argv = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != root or b"stage" not in argv:
            continue
        index = argv.index(b"--index") + 1 if b"--index" in argv else 0
        stages.append((int(argv[index]) if index else len(stages) + 1, int(entry)))
    return [root, *(pid for _, pid in sorted(stages))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _tail(log: IO[bytes], lines: int = 25) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])


async def _wait_healthy(proc: trio.Process, port: int, log: IO[bytes], what: str) -> None:
    """Poll ``/health`` until it answers 200 with status ok, or fail saying why."""
    deadline = trio.current_time() + _HEALTH_DEADLINE_S
    while trio.current_time() < deadline:
        if proc.poll() is not None:
            raise StagerunError(f"{what} exited with code {proc.returncode} before it was "
                                f"healthy; its output ended with:\n{_tail(log)}")  # fmt: skip
        try:
            with trio.fail_after(5):
                status, body = await http_exchange("127.0.0.1", port, "GET", "/health")
            if status == 200 and json.loads(body).get("status") == "ok":
                return
        except (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError):
            pass  # not listening yet, or still loading
        await trio.sleep(0.2)
    raise StagerunError(
        f"{what} was not healthy on port {port} within {_HEALTH_DEADLINE_S:.0f}s; "
        f"its output ended with:\n{_tail(log)}"
    )


@asynccontextmanager
async def launched(cmd: Sequence[str], port: int, what: str) -> AsyncIterator[trio.Process]:
    """A server started from ``cmd``, once it is healthy on ``port``; stopped on the way out."""
    with tempfile.TemporaryFile() as log:
        async with watched_process(cmd, stdout=log, stderr=log) as proc:
            try:
                await _wait_healthy(proc, port, log, what)
                yield proc
            finally:
                await stop_processes([proc], SERVER_GRACE_S)


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """The ``stagerun serve`` command line the options ask for.

    Its queue holds every client, so none is turned away; how many generate at once is the
    server's ``--max-batch``, its default unless the bench is given one.
    """
    most = max(args.clients)
    cmd = [sys.executable, "-P", "-m", "stagerun", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", args.model, "--stages", str(args.stages),
           "--max-queue", str(most)]  # fmt: skip
    if args.hop_delay_ms:
        cmd += ["--hop-delay-ms", f"{args.hop_delay_ms:g}"]
    if args.bandwidth_mbps is not None:
        cmd += ["--bandwidth-mbps", f"{args.bandwidth_mbps:g}"]
    if args.speculative != "off":
        cmd += ["--speculative", args.speculative]
    for option in ("threads", "depth", "window", "draft_model", "max_batch"):
        if (value := getattr(args, option)) is not None:
            cmd += ["--" + option.replace("_", "-"), str(value)]
    return cmd + list(args.serve_arg)


def serve_accepts(option: str) -> bool:
    """Whether this version's ``stagerun serve`` has ``option``."""
    from .._options import build_parser

    _, unknown = build_parser().parse_known_args(["serve", option, "1"])
    return option not in unknown


def llama_server_path(args: argparse.Namespace) -> pathlib.Path:
    """``--llama-server``, else the checkout's ``.cache/llama.cpp/bin/llama-server``."""
    if args.llama_server:
        return pathlib.Path(args.llama_server)
    checkout = pathlib.Path(__file__).resolve().parents[3] / _LLAMA_SERVER
    return checkout if checkout.is_file() else _LLAMA_SERVER


def llama_command(
    args: argparse.Namespace, gguf: pathlib.Path, clients: int, port: int
) -> list[str]:
    """``llama-server`` with ``clients`` slots, each with room for a prompt and --tokens."""
    binary = str(llama_server_path(args))
    per_slot = max(512, args.tokens + 256)
    return [binary, "-m", str(gguf), "-np", str(clients), "-c", str(clients * per_slot),
            "--host", "127.0.0.1", "--port", str(port), "-t", str(args.llama_threads)]  # fmt: skip
