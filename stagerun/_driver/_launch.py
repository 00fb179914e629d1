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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from .. import plugins
from .._stage._server import serve_stage
from .._util import single_exceptions
from .._wire._framed import LinkEmulation
from ..model import ModelFile, open_model
from ._config import PipelineConfig, PipelinePlan, SupervisionPolicy, plan
from ._lanes import LanePool
from ._pipeline import Pipeline
from ._supervise import StageProcess, stage_command
from ._values import StageInfo


@asynccontextmanager
async def open_pipeline(
    model: str | os.PathLike[str] | ModelFile = "smollm2",
    config: PipelineConfig | None = None,
    **overrides: Any,
) -> AsyncIterator[Pipeline]:
    """Start (or join) a pipeline and yield a `Pipeline` to run requests on.

    Args:
        model: a model name (``smollm2``) or a GGUF path.
        config: the pipeline's settings (default `PipelineConfig()`: one stage, in process).
        overrides: settings that replace the ones in ``config``, by `PipelineConfig` field
            name: ``open_pipeline("smollm2", stages=3)``.

    Raises:
        ValueError: the settings contradict each other or the model (see `plan`).
        TypeError: an override names no `PipelineConfig` field.
    """
    config = (config or PipelineConfig()).replace(**overrides)
    model_file = open_model(model)
    layout = plan(config, model_file.config.n_layers)
    link = config.link
    first = layout.stages[0]
    backend0 = await trio.to_thread.run_sync(
        lambda: plugins.build_backend(
            first.backend, model_file, first.layers, threads=first.threads, device=first.device
        )
    )
    with single_exceptions():
        async with trio.open_nursery() as nursery:
            infos = [StageInfo(0, first.layers, None)]
            if config.remote is not None:
                infos += [StageInfo(st.index, st.layers, st.remote) for st in layout.stages[1:]]
            else:
                infos += await _start_stages(nursery, model_file, config, layout, link)
            addresses = [s.address for s in infos[1:] if s.address is not None]
            pool = None
            if addresses:
                pool = LanePool(
                    addresses[0],
                    last_stage=addresses[-1],
                    capacity=config.capacity,
                    link=link,
                    reply_timeout=config.reply_timeout,
                )
                await pool.start()
            pipeline = Pipeline(
                model_file,
                backend0,
                infos,
                pool,
                wire_dtype=config.wire_dtype,
                prefill_chunk=config.prefill_chunk,
                prefill_credit=config.prefill_credit,
                speculation=config.speculation,
                recovery=config.recovery,
            )
            try:
                yield pipeline
            finally:
                if pool is not None:
                    with trio.CancelScope(shield=True):
                        await pool.aclose()
                nursery.cancel_scope.cancel()


async def _start_stages(
    nursery: trio.Nursery,
    model_file: ModelFile,
    config: PipelineConfig,
    layout: PipelinePlan,
    link: LinkEmulation,
) -> list[StageInfo]:
    """Start stages 1.. here, last first so each learns its downstream address; their infos
    in stage order."""
    downstream: str | None = None
    started: list[StageInfo] = []
    for stage in reversed(layout.stages[1:]):
        assert stage.listen is not None
        if config.mode == "inproc":
            stage_backend = await trio.to_thread.run_sync(
                functools.partial(
                    plugins.build_backend,
                    stage.backend,
                    model_file,
                    stage.layers,
                    threads=stage.threads,
                    device=stage.device,
                )
            )
            address = await nursery.start(
                functools.partial(
                    serve_stage,
                    stage_backend,
                    index=stage.index,
                    downstream=downstream,
                    listen=stage.listen,
                    wire_dtype=config.wire_dtype,
                    link=link,
                )
            )
            started.append(StageInfo(stage.index, stage.layers, address, os.getpid()))
        else:
            process = await _spawn_stage(
                nursery,
                model_file,
                stage.index,
                stage.layers,
                downstream,
                stage.threads,
                config.wire_dtype,
                stage.listen,
                stage.backend,
                stage.device,
                link,
                config.supervision or SupervisionPolicy(),
            )
            address = process.address
            started.append(
                StageInfo(stage.index, stage.layers, address, process.pid, process=process)
            )
        downstream = address
    return started[::-1]


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
