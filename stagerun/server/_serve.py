"""``stagerun serve``: start (or join) a pipeline and serve the HTTP API over it.

Theory of operation: one nursery owns everything. A signal task watches SIGINT and SIGTERM;
inside, `open_pipeline` starts the stage processes (or connects to the remote stages of a
topology), then hypercorn is started with ``nursery.start`` so that the single
``listening on`` line is printed only once the socket accepts connections. The first signal
asks hypercorn to shut down gracefully (in-flight requests get ``graceful_timeout``); leaving
the pipeline's block then stops every stage process, so nothing outlives the command. A signal
during start-up, or a second one, cancels everything at once.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from .._auth import is_loopback
from .._errors import StagerunError
from .._launch import Mode, open_pipeline
from .._pipeline_values import RecoveryPolicy
from .._proto import ActivationDType
from .._speculative import SpeculationConfig
from .._supervise import SupervisionPolicy
from .._topology import load_topology
from .._util import single_exceptions
from ._app import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT, create_app

API_KEY_ENV = "STAGERUN_API_KEY"
log = logging.getLogger("stagerun.serve")
GRACEFUL_TIMEOUT = 2.0


class ServeError(StagerunError):
    """``stagerun serve`` could not start serving (the message says why)."""


@attrs.frozen
class ServeOptions:
    """What ``stagerun serve`` was asked to do."""

    model: str | None = None
    stages: int = 3
    topology: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 4
    max_queue: int = 16
    threads: int | None = None
    mode: Mode = "processes"
    wire_dtype: ActivationDType = "f32"
    api_key: str | None = None
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    speculation: SpeculationConfig | None = None
    hop_delay_ms: float = 0.0
    bandwidth_mbps: float | None = None
    transport: str = "tcp"
    transports: tuple[str, ...] | None = None
    backend: str = "numpy"
    backends: tuple[str, ...] | None = None
    device: str | None = None
    recovery: RecoveryPolicy | None = None
    supervision: SupervisionPolicy | None = None


def served_model_id(model: str) -> str:
    """The id ``/v1/models`` reports: the model's name, or a GGUF file's stem."""
    if model.endswith(".gguf") or os.sep in model or Path(model).is_file():
        return Path(model).stem
    return model


def default_threads(local_processes: int, cpus: int | None = None) -> int:
    """BLAS threads per stage when stages share this machine: its cores split between them.

    Several multi-threaded stage processes on a few cores oversubscribe them; with concurrent
    requests every stage computes at once (measured on 2 cores, 3 stages, 8 clients: 28 s with
    the BLAS default, 4.2 s with one thread each).
    """
    return max(1, (cpus or os.cpu_count() or 1) // local_processes)


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def serve(options: ServeOptions, *, stdout: TextIO | None = None) -> int:
    """Run ``stagerun serve`` until SIGINT or SIGTERM; return the exit code.

    A signal after the server is up shuts it down cleanly (0); one during start-up stops the
    start (130).

    Raises:
        ServeError: the HTTP socket could not be opened.
        StagerunError, ValueError: the pipeline could not start (bad model, dead stage, ...).
    """
    out = stdout if stdout is not None else sys.stdout
    if options.parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {options.parallel}")
    if options.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {options.max_queue}")
    layers: list[tuple[int, int]] | None = None
    remote: list[str] | None = None
    model = options.model
    stages = options.stages
    if options.topology is not None:
        topology = load_topology(options.topology)
        model = model or topology.model
        layers = topology.layer_ranges
        remote = topology.remote_addresses or None
        stages = len(layers)
        if remote is None and len(layers) > 1:
            raise ValueError(f"topology {options.topology} lists stages without addresses")
    model = model or "smollm2"
    if stages < 1:
        raise ValueError(f"--stages must be at least 1, got {stages}")
    api_key = resolve_api_key(options.api_key, options.host)
    if not 1 <= options.max_tokens_default <= options.max_tokens_limit:
        raise ValueError(
            f"--max-tokens-default ({options.max_tokens_default}) must be between 1 and "
            f"--max-tokens-limit ({options.max_tokens_limit})"
        )
    threads = options.threads
    if threads is None and options.mode == "processes" and remote is None:
        threads = default_threads(stages)

    with single_exceptions(), trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            stopping = trio.Event()
            serving = False
            interrupted = False

            async def watch_signals() -> None:
                nonlocal interrupted
                async for signum in signals:
                    if serving and not stopping.is_set():
                        print(
                            f"stagerun serve: {signal.Signals(signum).name}, shutting down",
                            file=sys.stderr,
                            flush=True,
                        )
                        stopping.set()
                    else:
                        interrupted = True
                        nursery.cancel_scope.cancel(reason=f"signal {signum}")

            nursery.start_soon(watch_signals)
            async with open_pipeline(
                model,
                stages=stages,
                layers=layers,
                mode=options.mode,
                remote=remote,
                threads=threads,
                wire_dtype=options.wire_dtype,
                capacity=options.parallel,
                speculation=options.speculation,
                hop_delay_ms=options.hop_delay_ms,
                bandwidth_mbps=options.bandwidth_mbps,
                transport=options.transport,
                transports=options.transports,
                backend=options.backend,
                backends=options.backends,
                device=options.device,
                recovery=options.recovery,
                supervision=options.supervision,
            ) as pipeline:
                app: Any = create_app(
                    pipeline,
                    model_id=served_model_id(model),
                    model_aliases={model, pipeline.config.name, Path(model).name},
                    capacity=options.parallel,
                    max_queue=options.max_queue,
                    api_key=api_key,
                    max_tokens_default=options.max_tokens_default,
                    max_tokens_limit=options.max_tokens_limit,
                )
                config = HypercornConfig()
                config.bind = [_bind(options.host, options.port)]
                config.graceful_timeout = GRACEFUL_TIMEOUT
                config.errorlog = logging.getLogger("stagerun.http")
                config.accesslog = None
                config.keep_alive_timeout = 75
                async with trio.open_nursery() as http:
                    try:
                        with single_exceptions():
                            binds: list[str] = await http.start(
                                functools.partial(
                                    hypercorn_serve, app, config, shutdown_trigger=stopping.wait
                                )
                            )
                    except OSError as exc:
                        raise ServeError(
                            f"cannot listen on {options.host}:{options.port}: "
                            f"{exc.strerror or exc}; pick another --port"
                        ) from None
                    serving = True
                    n = len(pipeline.stages)
                    where = binds[0] if binds else f"http://{_bind(options.host, options.port)}"
                    print(
                        f"stagerun serve: listening on {where} "
                        f"({n} stage{'s' if n != 1 else ''}, model {served_model_id(model)})",
                        file=out,
                        flush=True,
                    )
            nursery.cancel_scope.cancel(reason="server stopped")
    return 130 if interrupted else 0


def resolve_api_key(given: str | None, host: str) -> str | None:
    """The API key to require: ``--api-key``, else ``$STAGERUN_API_KEY``; None for none.

    A key that is given but empty (``--api-key "$UNSET_VARIABLE"``) is an error, never a
    quiet "no authentication"; serving beyond loopback without a key is allowed, with a
    warning.

    Raises:
        ServeError: the key was given empty.
    """
    source, key = "--api-key", given
    if key is None:
        source, key = f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ServeError(
            f"{source} is empty: give a key (for example from a file, "
            f'--api-key "$(cat key.txt)"), or leave it out to serve without one'
        )
    if key is None and not is_loopback(host.strip("[]")):
        log.warning(
            "serving on %s with no API key: anyone who can reach this address can use the "
            "model; set --api-key or $%s",
            host,
            API_KEY_ENV,
        )
    return key


def options_from_args(args: object) -> ServeOptions:
    """`ServeOptions` from the parsed ``stagerun serve`` arguments."""
    from .._options import recovery_from_args, speculation_from_args

    get = functools.partial(getattr, args)
    recovery, supervision = recovery_from_args(args)  # type: ignore[arg-type]
    return ServeOptions(
        model=get("model"),
        stages=get("stages"),
        topology=get("topology"),
        host=get("host"),
        port=get("port"),
        parallel=get("parallel"),
        max_queue=get("max_queue"),
        threads=get("threads"),
        mode="inproc" if get("inproc") else "processes",
        wire_dtype=get("wire_dtype"),
        api_key=get("api_key"),
        max_tokens_default=_or(get("max_tokens_default", None), DEFAULT_MAX_TOKENS),
        max_tokens_limit=_or(get("max_tokens_limit", None), MAX_TOKENS_LIMIT),
        speculation=speculation_from_args(args),  # type: ignore[arg-type]
        hop_delay_ms=get("hop_delay_ms", 0.0),
        bandwidth_mbps=get("bandwidth_mbps", None),
        transport=get("transport", "tcp"),
        transports=get("transports", None),
        backend=get("backend", "numpy"),
        backends=get("backends", None),
        device=get("device", None),
        recovery=recovery,
        supervision=supervision,
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def serve_main(args: object) -> int:
    """Entry point for the CLI: run the server, return the exit code."""
    return trio.run(_serve_with_telemetry, options_from_args(args))


async def _serve_with_telemetry(options: ServeOptions) -> int:
    from .. import telemetry

    tel = telemetry.configure_from_env(common={"stagerun.stage_id": 0})
    async with telemetry.draining(tel):
        return await serve(options)
