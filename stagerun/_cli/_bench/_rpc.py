"""llama.cpp's own split, for ``bench serve --compare-rpc``: llama-server over RPC servers.

llama.cpp splits a model across machines by making each remote machine's CPU a ggml device
(``ggml-rpc-server``): the main ``llama-server`` holds the model's layers on those devices
(``--rpc``, ``--device``, an even ``--tensor-split``) and drives every graph over TCP, a
star of request/response exchanges, where a stagerun pipeline streams activations down a
chain. The bench starts one RPC server per stage and puts a delaying proxy in front of each,
so every byte between the main process and a device arrives ``--hop-delay-ms`` later in
each direction, as every frame on a stagerun lane does (``serve --hop-delay-ms``). The
proxies delay; they do not cap bandwidth (stagerun's ``--bandwidth-mbps`` has no match here).

The binaries come from ``plugins/stagerun-llamacpp/scripts/build.sh`` (which ``make test``
runs): the vendored llama.cpp of the llamacpp plugin, built with ``GGML_RPC``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import subprocess
from collections.abc import AsyncIterator

import trio

from ..._driver._supervise import stop_processes
from ..._errors import StagerunError
from ..._util import default_threads
from ._servers import free_port

__all__ = ["RPC_BIN", "rpc_binaries", "rpc_split", "serve_delayed"]

RPC_BIN = pathlib.Path(".cache/llama.cpp/bin")  # in a checkout of stagerun
MAX_QUEUED = 1024  # reads of 64 KiB held per direction of a proxied connection: 64 MiB
_READY_DEADLINE_S = 60.0


def rpc_binaries() -> tuple[pathlib.Path, pathlib.Path]:
    """The ``llama-server`` and ``ggml-rpc-server`` built with RPC, or a ValueError saying how
    to build them."""
    checkout = pathlib.Path(__file__).resolve().parents[3] / RPC_BIN
    folder = checkout if checkout.is_dir() else RPC_BIN
    server, device = folder / "llama-server", folder / "ggml-rpc-server"
    if not (server.is_file() and device.is_file()):
        raise ValueError(
            f"no llama.cpp RPC build in {folder}: run "
            "plugins/stagerun-llamacpp/scripts/build.sh (about 7 minutes; make test runs it) first"
        )
    return server, device


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, delay: float) -> None:
    """Bytes from ``source`` to ``sink``, each read delivered ``delay`` seconds after it came."""
    send, receive = trio.open_memory_channel[tuple[float, bytes]](MAX_QUEUED)

    async def read() -> None:
        async with send:
            while chunk := await source.receive_some(65536):
                await send.send((trio.current_time() + delay, chunk))

    async def write() -> None:
        async with receive:
            async for due, chunk in receive:
                await trio.sleep_until(due)
                await sink.send_all(chunk)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await sink.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


async def serve_delayed(
    target_port: int, delay: float, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A loopback proxy to ``target_port`` that delays both directions by ``delay`` seconds;
    reports the port it listens on."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(client: trio.SocketStream) -> None:
        async with client:
            try:
                server = await trio.open_tcp_stream("127.0.0.1", target_port)
                async with server, trio.open_nursery() as nursery:
                    nursery.start_soon(_pump, client, server, delay)
                    nursery.start_soon(_pump, server, client, delay)
            except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # one side went away: so does the connection

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def _accepting(port: int, proc: trio.Process) -> None:
    """Wait until something accepts connections on ``port``, or ``proc`` exits."""
    with trio.fail_after(_READY_DEADLINE_S):
        while True:
            if proc.poll() is not None:
                raise StagerunError(f"ggml-rpc-server exited with code {proc.returncode}")
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.1)
                continue
            await stream.aclose()
            return


@contextlib.asynccontextmanager
async def rpc_split(args: argparse.Namespace) -> AsyncIterator[list[str]]:
    """``--stages`` RPC servers, each behind a delaying proxy; yields the ``llama-server``
    options that split the model over them."""
    _, device = rpc_binaries()
    threads = args.threads or default_threads(args.stages)
    delay = args.hop_delay_ms / 1000.0
    async with trio.open_nursery() as nursery:
        procs, ports = [], []
        try:
            for _ in range(args.stages):
                port = free_port()
                cmd = [str(device), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
                proc = await trio.lowlevel.open_process(
                    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                procs.append(proc)
                await _accepting(port, proc)
                ports.append(await nursery.start(serve_delayed, port, delay))
            endpoints = [f"127.0.0.1:{p}" for p in ports]
            yield [
                "--rpc", ",".join(endpoints),
                "--device", ",".join(f"RPC{i}" for i in range(len(endpoints))),
                "-ngl", "all", "--tensor-split", ",".join("1" * args.stages),
            ]  # fmt: skip
        finally:
            nursery.cancel_scope.cancel(reason="the RPC split is no longer measured")
            await stop_processes(procs, 5.0)
