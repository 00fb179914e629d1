"""`open_pipeline()`: start (or join) the stages and yield a running `Pipeline`.

Theory of operation: stage 0 lives in the calling process. The other stages are started here
— as Trio tasks of this nursery (``inproc``), or as ``stagerun stage`` child processes on
loopback, last stage first so each one learns its downstream address — or are already running
elsewhere (``remote`` addresses). Everything started here is a child of the pipeline's nursery,
so leaving the ``async with`` block stops every stage and process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal

import trio

from . import _proto, plugins
from ._errors import StageError
from ._framed import LinkEmulation
from ._lanes import LanePool
from ._pipeline import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CREDIT, Pipeline
from ._pipeline_values import RecoveryPolicy, StageInfo
from ._proto._prefill import ChunkPolicy
from ._speculative import SpeculationConfig
from ._stage import serve_stage
from ._supervise import StageProcess, SupervisionPolicy, stage_command
from ._util import single_exceptions
from .model import ModelFile, open_model

Mode = Literal["inproc", "processes"]


def split_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``stages`` contiguous ranges as evenly as possible."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    ranges, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


async def _read_ready_line(proc: trio.Process, index: int) -> str:
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


@asynccontextmanager
async def open_pipeline(
    model: str | os.PathLike[str] | ModelFile = "smollm2",
    *,
    stages: int = 1,
    layers: Sequence[tuple[int, int]] | None = None,
    mode: Mode = "inproc",
    remote: Sequence[str] | None = None,
    threads: int | None = None,
    wire_dtype: _proto.ActivationDType = "f32",
    capacity: int = 1,
    prefill_chunk: int | str | ChunkPolicy = DEFAULT_PREFILL_CHUNK,
    prefill_credit: int = DEFAULT_PREFILL_CREDIT,
    host: str = "127.0.0.1",
    hop_delay_ms: float = 0.0,
    bandwidth_mbps: float | None = None,
    speculation: SpeculationConfig | None = None,
    transport: str = "tcp",
    transports: Sequence[str] | None = None,
    backend: str = "numpy",
    backends: Sequence[str] | None = None,
    device: str | None = None,
    recovery: RecoveryPolicy | None = None,
    supervision: SupervisionPolicy | None = None,
    reply_timeout: float | None = None,
) -> AsyncIterator[Pipeline]:
    """Start (or join) a pipeline and yield a `Pipeline` to run requests on.

    Args:
        model: a model name (``smollm2``) or a GGUF path.
        stages: number of stages when ``layers`` is not given (layers split evenly).
        layers: explicit ``[lo, hi)`` ranges, one per stage, contiguous from 0.
        mode: ``inproc`` runs stages 1.. as Trio tasks here; ``processes`` spawns
            ``stagerun stage`` children on loopback.
        remote: addresses of already running stages 1..N-1 (then ``layers[0]`` or the even
            split says what stage 0 holds, and nothing is started here).
        threads: compute (BLAS) threads per stage.
        wire_dtype: activation dtype on the wire (f32, f16 or q8).
        capacity: lanes in the pool (concurrent requests served without connecting more).
        prefill_chunk: how prompts are cut into prefill chunks: ``"adaptive"`` (default: a
            ramp that grows while transport hides under compute), a size (``256``) or a
            schedule (``"128,256,384"``).
        prefill_credit: prefill chunks in flight past stage 0 at once (1 = wait for each).
        hop_delay_ms: emulate a WAN link: every frame on every lane is delivered this much
            later (stages started here and stage 0 alike; remote stages set their own).
        bandwidth_mbps: with ``hop_delay_ms``, also cap each link's bandwidth.
        speculation: speculative decoding settings (drafter, depth, window); off by default.
        transport: the transport plugin of every lane between stages started here (``tcp``,
            ``ws``, or an installed plugin's name).
        transports: one transport per hop instead (stage 0 to 1 first); the last stage's
            transport also carries the returns to stage 0.
        backend: the compute backend plugin of every stage started here (``numpy``, ...).
        backends: one backend per stage instead, stage 0 first (any mix).
        device: the compute device (``cuda``, ``cuda:1``, ``cpu``) for the stages whose backend
            takes one (torch); None lets each backend choose.
        recovery: how a request survives a lane failure (default `RecoveryPolicy()`: up to
            3 failures, 60 s each; ``RecoveryPolicy.disabled()`` fails at the first).
        supervision: restart and liveness settings for the stage processes started here
            (``mode="processes"``; default `SupervisionPolicy()`).
        reply_timeout: seconds stage 0 waits for a reply before the lane counts as broken
            (default ``$STAGERUN_STAGE_REPLY_TIMEOUT_SECS`` or 30).
    """
    if hop_delay_ms < 0:
        raise ValueError(f"hop_delay_ms must not be negative, got {hop_delay_ms}")
    link = LinkEmulation(
        delay_s=hop_delay_ms / 1000.0,
        bandwidth_bytes_per_s=bandwidth_mbps * 125_000.0 if bandwidth_mbps else None,
    )
    model_file = open_model(model)
    n_layers = model_file.config.n_layers
    if remote is not None and layers is None:
        stages = len(remote) + 1
    ranges = list(layers) if layers is not None else split_layers(n_layers, stages)
    _check_ranges(ranges, n_layers)
    if remote is not None and len(remote) != len(ranges) - 1:
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges) - 1} remote addresses, got {len(remote)}"
        )
    if transports is not None and len(transports) != len(ranges) - 1:
        raise ValueError(
            f"{len(ranges)} stages have {len(ranges) - 1} hops, but {len(transports)} "
            f"transports were given ({', '.join(transports)})"
        )
    hop_transports = list(transports) if transports is not None else [transport] * (len(ranges) - 1)
    listen = [plugins.transport(name).local_address(host) for name in hop_transports]
    if backends is not None and len(backends) != len(ranges):
        raise ValueError(
            f"{len(ranges)} stages need {len(ranges)} backends, got {len(backends)} "
            f"({', '.join(backends)})"
        )
    stage_backends = list(backends) if backends is not None else [backend] * len(ranges)
    for name in stage_backends:
        plugins.backend(name)  # an unknown or broken plugin fails here, before anything starts

    def device_for(name: str) -> str | None:
        return device if plugins.takes_device(name) else None

    if device is not None and not any(device_for(name) for name in stage_backends):
        raise ValueError(
            f"--device {device} needs a backend with a device (torch); "
            f"these stages run {', '.join(stage_backends)}"
        )
    backend0 = await trio.to_thread.run_sync(
        lambda: plugins.build_backend(
            stage_backends[0],
            model_file,
            ranges[0],
            threads=threads,
            device=device_for(stage_backends[0]),
        )
    )
    with single_exceptions():
        async with trio.open_nursery() as nursery:
            infos = [StageInfo(0, ranges[0], None)]
            addresses: list[str] = []
            if remote is not None:
                addresses = list(remote)
                infos += [StageInfo(i + 1, ranges[i + 1], a) for i, a in enumerate(addresses)]
            elif len(ranges) > 1:
                downstream: str | None = None
                started: list[StageInfo] = []
                for index in range(len(ranges) - 1, 0, -1):
                    if mode == "inproc":
                        stage_backend = await trio.to_thread.run_sync(
                            functools.partial(
                                plugins.build_backend,
                                stage_backends[index],
                                model_file,
                                ranges[index],
                                threads=threads,
                                device=device_for(stage_backends[index]),
                            )
                        )
                        address = await nursery.start(
                            lambda task_status, b=stage_backend, i=index, d=downstream: serve_stage(
                                b,
                                index=i,
                                downstream=d,
                                listen=listen[i - 1],
                                wire_dtype=wire_dtype,
                                link=link,
                                task_status=task_status,
                            )
                        )
                        started.append(StageInfo(index, ranges[index], address, os.getpid()))
                    else:
                        process = await _spawn_stage(
                            nursery,
                            model_file,
                            index,
                            ranges[index],
                            downstream,
                            threads,
                            wire_dtype,
                            listen[index - 1],
                            stage_backends[index],
                            device_for(stage_backends[index]),
                            link,
                            supervision or SupervisionPolicy(),
                        )
                        address = process.address
                        started.append(
                            StageInfo(index, ranges[index], address, process.pid, process=process)
                        )
                    downstream = address
                infos += reversed(started)
                addresses = [s.address for s in infos[1:] if s.address is not None]
            pool = None
            if addresses:
                pool = LanePool(
                    addresses[0],
                    last_stage=addresses[-1],
                    capacity=capacity,
                    link=link,
                    reply_timeout=reply_timeout,
                )
                await pool.start()
            pipeline = Pipeline(
                model_file,
                backend0,
                infos,
                pool,
                wire_dtype=wire_dtype,
                prefill_chunk=prefill_chunk,
                prefill_credit=prefill_credit,
                speculation=speculation,
                recovery=recovery,
            )
            try:
                yield pipeline
            finally:
                if pool is not None:
                    with trio.CancelScope(shield=True):
                        await pool.aclose()
                nursery.cancel_scope.cancel()


def _check_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    expected = 0
    for lo, hi in ranges:
        if lo != expected or hi <= lo:
            raise ValueError(
                f"stage layer ranges {list(ranges)} must be contiguous, non-empty and start at 0"
            )
        expected = hi
    if expected != n_layers:
        raise ValueError(
            f"stage layer ranges {list(ranges)} must end at the model's {n_layers} layers"
        )


async def _spawn_stage(
    nursery: trio.Nursery,
    model: ModelFile,
    index: int,
    layers: tuple[int, int],
    downstream: str | None,
    threads: int | None,
    wire_dtype: str,
    listen: str,
    backend: str,
    device: str | None,
    link: LinkEmulation,
    policy: SupervisionPolicy,
) -> StageProcess:
    argv = [
        "--model", str(model.path),
        "--layers", f"{layers[0]}:{layers[1]}",
        "--index", str(index),
        "--backend", backend,
        "--wire-dtype", wire_dtype,
    ]  # fmt: skip
    if downstream is not None:
        argv += ["--downstream", downstream]
    if device is not None:
        argv += ["--device", device]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if link.delay_s:
        argv += ["--hop-delay-ms", repr(link.delay_s * 1000.0)]
    if link.bandwidth_bytes_per_s:
        argv += ["--bandwidth-mbps", repr(link.bandwidth_bytes_per_s / 125_000.0)]
    process = StageProcess(index, stage_command(argv), listen, policy)
    started: StageProcess = await nursery.start(process.run)
    return started
