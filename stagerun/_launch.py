"""`open_pipeline()`: start (or join) the stages and yield a running `Pipeline`.

Theory of operation: stage 0 lives in the calling process. The other stages are started here
— as Trio tasks of this nursery (``inproc``), or as ``stagerun stage`` child processes on
loopback, last stage first so each one learns its downstream address — or are already running
elsewhere (``remote`` addresses). Everything started here is a child of the pipeline's nursery,
so leaving the ``async with`` block stops every stage and process.

Stage processes started here always authenticate their lanes. Without a secret from the user
(``--secret-file``, ``$STAGERUN_SECRET_FILE``), `_own_secret` makes one for the pipeline: in a
private temporary file the children read through ``$STAGERUN_SECRET_FILE``, held in memory by
stage 0 and the supervisors' probes. So a process that takes the port of a dead stage cannot
answer as that stage (stage 0 refuses a peer that cannot prove it holds the secret).
"""

from __future__ import annotations

import functools
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import attrs
import trio

from . import plugins
from ._driver._config import (
    PipelineConfig,
    PipelinePlan,
    SupervisionPolicy,
    plan,
    session_limits,
    stage_config,
)
from ._driver._lanes import LanePool
from ._driver._pipeline import Pipeline
from ._driver._supervise import REMOVE_WITH_PARENT_ENV, StageProcess, spawn_process, stage_command
from ._driver._values import StageInfo
from ._engine._config import to_argv
from ._stage._server import payload_limit, serve_stage
from ._util import single_exceptions
from ._wire._auth import SECRET_FILE_ENV, lane_secret
from ._wire._connect import ENV_SECRET, EnvSecret
from .model import ModelFile, open_model

# Random bytes in a secret made for the stage processes started here (written as hex).
OWN_SECRET_BYTES = 32


@attrs.frozen
class LaneAuth:
    """The lane secret of the stages started here, and the environment their processes get."""

    secret: bytes | EnvSecret = ENV_SECRET  # ENV_SECRET: the user's, read where it is used
    env: Mapping[str, str] | None = None  # None: this process's environment


@contextmanager
def _own_secret(config: PipelineConfig) -> Iterator[LaneAuth]:
    """The user's lane secret if there is one; else, when stage processes are started here,
    a new one in a private temporary file (removed at the end, or by the stages if this
    process is killed)."""
    if config.mode != "processes" or config.remote is not None or lane_secret() is not None:
        yield LaneAuth()
        return
    secret = secrets.token_hex(OWN_SECRET_BYTES).encode()
    fd, path = tempfile.mkstemp(prefix="stagerun-", suffix=".secret")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(secret)
        env = {**os.environ, SECRET_FILE_ENV: path, REMOVE_WITH_PARENT_ENV: path}
        yield LaneAuth(secret, env)
    finally:
        with suppress(FileNotFoundError):
            os.unlink(path)


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
    backend0 = await trio.to_thread.run_sync(plugins.build_for, first, model_file)
    with single_exceptions(), _own_secret(config) as auth:
        async with trio.open_nursery() as nursery:
            infos = [StageInfo(0, first.layers, None, backend=first.backend)]
            if config.remote is not None:
                infos += [
                    StageInfo(st.index, st.layers, st.remote, backend=st.backend)
                    for st in layout.stages[1:]
                ]
            else:
                infos += await _start_stages(nursery, model_file, config, layout, auth)
            addresses = [s.address for s in infos[1:] if s.address is not None]
            pool = None
            if addresses:
                pool = LanePool(
                    addresses[0],
                    last_stage=addresses[-1],
                    capacity=config.capacity,
                    link=link,
                    reply_timeout=config.reply_timeout,
                    secret=auth.secret,
                )
                await pool.start()
            limits = session_limits(config, model_file.config.context_length)
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
                chat_template=config.chat_template,
                prefix_cache_bytes=config.prefix_cache_bytes,
                inline_seconds=config.inline_compute_ms / 1e3,
                # stage 0 is bounded as the others are
                max_sessions=limits[0],
                max_kv_tokens=limits[1],
            )
            try:
                if isinstance(model, str | os.PathLike):
                    pipeline.opened_as = os.fspath(model)
                yield pipeline
            finally:
                pipeline.closed = True  # what runs on it from now on is refused at once
                if pool is not None:
                    with trio.CancelScope(shield=True):
                        await pool.aclose()
                nursery.cancel_scope.cancel()


async def _start_stages(
    nursery: trio.Nursery,
    model_file: ModelFile,
    config: PipelineConfig,
    layout: PipelinePlan,
    auth: LaneAuth,
) -> list[StageInfo]:
    """Start stages 1.. here, last first so each learns its downstream address; their infos
    in stage order."""
    downstream: str | None = None
    started: list[StageInfo] = []
    for stage in reversed(layout.stages[1:]):
        settings = stage_config(
            config,
            stage,
            downstream=downstream,
            model=str(model_file.path),
            context_length=model_file.config.context_length,
            max_payload_bytes=payload_limit(model_file),
        )
        if config.mode == "inproc":
            stage_backend = await trio.to_thread.run_sync(plugins.build_for, stage, model_file)
            address = await nursery.start(serve_stage, stage_backend, settings)
            started.append(
                StageInfo(stage.index, stage.layers, address, os.getpid(), backend=stage.backend)
            )
        else:
            process = StageProcess(
                stage.index,
                stage_command(to_argv(settings, listen=False)),  # the process adds --listen
                settings.listen,
                config.supervision or SupervisionPolicy(),
                spawn=functools.partial(spawn_process, env=auth.env),
                secret=auth.secret,
            )
            await nursery.start(process.run)
            address = process.address
            started.append(
                StageInfo(
                    stage.index,
                    stage.layers,
                    address,
                    process.pid,
                    backend=stage.backend,
                    process=process,
                )
            )
        downstream = address
    return started[::-1]
