"""``stagerun serve``: start (or join) a pipeline and serve the HTTP API over it.

Theory of operation: one nursery owns everything. A signal task watches SIGINT and SIGTERM;
inside, `open_pipeline` starts the stage processes (or connects to the remote stages of a
topology), then hypercorn is started with ``nursery.start`` so that the single
``listening on`` line is printed only once the socket accepts connections. The first signal
asks hypercorn to shut down gracefully (in-flight requests get ``graceful_timeout``); leaving
the pipeline's block then stops every stage process, so nothing outlives the command. A signal
during start-up, or a second one, cancels everything at once.

Slow and hostile clients: hypercorn answers each connection, behind an accept loop of ours
(`_http.serve_http`) that bounds the open connections and puts a write deadline on the socket.
The soft limit on open files is raised to the hard one first, and the connection bound leaves
room under it for the lanes and the process's own files. hypercorn's ``keep_alive_timeout``
bounds a connection that never sends a whole request head; the app bounds the body
(``body_timeout``), the answer's writes (``write_timeout``) and the whole request
(``request_timeout``).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio
from hypercorn.config import Config as HypercornConfig

from .. import plugins
from .._driver._config import PipelineConfig
from .._driver._topology import load_topology
from .._errors import StagerunError
from .._launch import open_pipeline
from .._util import FD_RESERVE, raise_open_file_limit, single_exceptions
from .._wire._auth import is_loopback, read_private_file
from ..backends._ggml._cores import shares_cores
from ._app import create_app
from ._config import DEFAULT_MAX_BATCH, HttpConfig, api_keys
from ._hosts import AllowedHosts
from ._http import ConnectionLimit, serve_http

API_KEY_ENV = "STAGERUN_API_KEY"
API_KEY_FILE_ENV = "STAGERUN_API_KEY_FILE"
log = logging.getLogger("stagerun.serve")
GRACEFUL_TIMEOUT = 2.0
# An API key is a few dozen bytes, one a line: 64 KiB holds a thousand tenants' keys; a bigger
# --api-key-file (or /dev/zero) is a mistake.
MAX_API_KEY_FILE_BYTES = 64 * 1024
# hypercorn's keep_alive_timeout: how long a connection may sit without a request in flight,
# which also bounds the time a client has to send its first request head. Longer than the 5 s
# httpx (and so the openai client) keeps an idle connection, so they never reuse one the server
# is closing; short, so a client that never finishes its head gives its connection up soon.
KEEP_ALIVE_TIMEOUT = 15.0
# HTTP connections open at once when the open-file limit allows more (--max-connections).
DEFAULT_MAX_CONNECTIONS = 1024
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class ServeError(StagerunError):
    """``stagerun serve`` could not start serving (the message says why)."""


@attrs.frozen(kw_only=True)
class ServeOptions(HttpConfig):
    """What ``stagerun serve`` was asked to do: a pipeline, and the HTTP server in front of it
    (every `HttpConfig` setting, checked there).

    ``max_batch`` requests generate at once (the pipeline's lane ``capacity`` is raised to it
    if smaller, so each finds a lane), within ``kv_budget`` bytes of reserved KV cache (None:
    `default_kv_budget` of the model); ``max_queue`` more wait before 429.
    """

    model: str | None = None  # default: the topology's model, or smollm2
    pipeline: PipelineConfig = attrs.field(
        factory=lambda: PipelineConfig(stages=3, mode="processes", capacity=DEFAULT_MAX_BATCH)
    )
    topology: str | None = None  # where the pipeline's layers and addresses came from
    max_batch: int = DEFAULT_MAX_BATCH

    @property
    def http(self) -> HttpConfig:
        """The HTTP server's settings alone."""
        return HttpConfig(**{f.name: getattr(self, f.name) for f in attrs.fields(HttpConfig)})


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
    model, wanted, api_key = _checked(options)
    hosts = allowed_hosts(options.host, options.allowed_hosts)
    connections = ConnectionLimit.for_serve(
        max_connections(options.max_connections, wanted.capacity),
        options.max_connections_per_client,
        options.max_bodies_per_client,
    )
    with single_exceptions(), trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            state = _Signals(nursery.cancel_scope)
            nursery.start_soon(state.watch, signals)
            async with open_pipeline(model, wanted) as pipeline:
                app: Any = create_app(
                    pipeline,
                    options.http.replace(api_key=api_key, api_key_file=None),
                    model_id=served_model_id(model),
                    model_aliases={model, pipeline.config.name, Path(model).name},
                    allowed_hosts=hosts,
                )
                async with trio.open_nursery() as http:
                    where = await _listen(http, app, options, connections, state.stopping)
                    state.serving = True
                    n = len(pipeline.stages)
                    print(
                        f"stagerun serve: listening on {where} "
                        f"({n} stage{'s' if n != 1 else ''}, model {served_model_id(model)})",
                        file=out,
                        flush=True,
                    )
            nursery.cancel_scope.cancel(reason="server stopped")
    return 130 if state.interrupted else 0


def _checked(options: ServeOptions) -> tuple[str, PipelineConfig, str | None]:
    """The model, the pipeline to start and the API key, once the options are checked (the
    HTTP settings checked themselves, as `HttpConfig`)."""
    wanted = options.pipeline
    if wanted.capacity < options.max_batch:
        wanted = wanted.replace(capacity=options.max_batch)  # a lane for every running request
    model = options.model
    if options.topology is not None:
        model = model or load_topology(options.topology).model
    model = model or "smollm2"
    if wanted.layers is None and wanted.stages < 1:
        raise ValueError(f"--stages must be at least 1, got {wanted.stages}")
    api_key = resolve_api_key(options.api_key, options.host, key_file=options.api_key_file)
    if wanted.threads is None and wanted.mode == "processes" and wanted.remote is None:
        stages = len(wanted.layers) if wanted.layers is not None else wanted.stages
        backends = {plugins.resolve_backend(b) for b in wanted.backends or [wanted.backend]}
        if backends != {"ggml"} or not shares_cores():  # ggml stages share cores graph by graph
            wanted = wanted.replace(threads=default_threads(stages))
    return model, wanted, api_key


class _Signals:
    """SIGINT/SIGTERM: a graceful stop once serving, a cancelled start before."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self.stopping = trio.Event()
        self.serving = False
        self.interrupted = False

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if self.serving and not self.stopping.is_set():
                print(
                    f"stagerun serve: {signal.Signals(signum).name}, shutting down",
                    file=sys.stderr,
                    flush=True,
                )
                self.stopping.set()
            else:
                self.interrupted = True
                self.scope.cancel(reason=f"signal {signum}")


async def _listen(
    http: trio.Nursery,
    app: Any,
    options: ServeOptions,
    connections: ConnectionLimit,
    stopping: trio.Event,
) -> str:
    """Start hypercorn on the options' address in ``http``; return where it listens."""
    config = HypercornConfig()
    config.bind = [_bind(options.host, options.port)]
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.errorlog = logging.getLogger("stagerun.http")
    config.accesslog = None
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT
    # config.read_timeout stays None: hypercorn applies it to every read of the connection,
    # also while an answer streams (the client sends nothing then), so it would cut off any
    # generation longer than itself; the app's body_timeout bounds the reads that matter.
    start = functools.partial(
        serve_http,
        app,
        config,
        connections,
        write_timeout=options.write_timeout,
        shutdown_trigger=stopping.wait,
    )
    try:
        with single_exceptions():
            binds: list[str] = await http.start(start)
    except OSError as exc:
        raise ServeError(
            f"cannot listen on {options.host}:{options.port}: "
            f"{exc.strerror or exc}; pick another --port"
        ) from None
    return binds[0] if binds else f"http://{_bind(options.host, options.port)}"


def max_connections(given: int | None, lanes: int) -> int:
    """``--max-connections``, or as many as the open-file limit leaves room for (at most
    `DEFAULT_MAX_CONNECTIONS`), once that limit is raised as far as it goes.

    Without a bound a flood of connections uses up the open files, and then nothing that
    needs one works: not ``/health``, not a lane to a stage that restarted.
    """
    soft = raise_open_file_limit()
    room = None if soft is None else soft - FD_RESERVE - 2 * lanes  # a lane, and its successor
    if given is not None:
        if room is not None and given > room:
            log.warning(
                "--max-connections %d is more than the open-file limit (%d) leaves room for "
                "(about %d); raise it (ulimit -n) or lower --max-connections",
                given,
                soft,
                room,
            )
        return given
    if room is None:
        return DEFAULT_MAX_CONNECTIONS
    if room < 16:
        log.warning(
            "the open-file limit (%d) leaves room for only %d HTTP connections; raise it "
            "(ulimit -n)",
            soft,
            max(room, 1),
        )
    return max(1, min(DEFAULT_MAX_CONNECTIONS, room))


def allowed_hosts(host: str, more: Sequence[str] = ()) -> AllowedHosts:
    """The ``Host`` headers a server bound to ``host`` answers: that host, the loopback
    names, this machine's host name when it listens beyond loopback, and ``more``.

    Bound to every address (``0.0.0.0``, ``::``) any IP address is answered too, as clients
    reach such a server by any address of the machine; other DNS names need ``more``. A DNS
    rebinding page always names the attacker's DNS name, so it is refused either way. Any port
    is answered: a browser sends the page's own host name, so a rebinding page cannot send an
    allowed name on another port, and an ``ssh -L`` tunnel's clients send its local port.

    Raises:
        ValueError: an entry of ``more`` is not a host (see `AllowedHosts.parse`).
    """
    bound = host.strip("[]").lower()
    wildcard = bound in ("", "0.0.0.0", "::")
    names = [*LOOPBACK_HOSTS, *more]
    if not wildcard:
        names.append(bound)
    if not is_loopback(bound):
        names.append(socket.gethostname())  # (not getfqdn: a DNS lookup, slow when DNS is)
    return AllowedHosts.parse(names, any_ip=wildcard)


def resolve_api_key(given: str | None, host: str, *, key_file: str | None = None) -> str | None:
    """The API keys to require: ``--api-key``, ``--api-key-file``, ``$STAGERUN_API_KEY_FILE``
    or ``$STAGERUN_API_KEY``, the first that is set; None for none.

    A file (or variable) may hold several keys, one per line (one per tenant: each key is a
    prefix cache domain of its own), and ``#`` comment lines; the text is returned as it is,
    less surrounding white space (`HttpConfig.api_keys` splits it). A key that is given but
    empty (``--api-key "$UNSET_VARIABLE"``, an empty file, only comments) is an error, never
    a quiet "no authentication"; serving beyond loopback without a key is allowed, with a
    warning.

    Raises:
        ServeError: the key was given empty, twice, or its file cannot be used.
    """
    if given is not None and key_file is not None:
        raise ServeError("give --api-key or --api-key-file, not both")
    source, key = "--api-key", given
    if key is None:
        path = key_file or os.environ.get(API_KEY_FILE_ENV) or None
        if path is not None:
            source, key = f"the API key file {path}", _read_api_key_file(path)
        else:
            source, key = f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)
    if key is not None and not api_keys(key):
        raise ServeError(
            f"{source} is empty (it holds no key, only blank or # lines): give a key (for "
            "example in a file, --api-key-file key.txt), or leave it out to serve without one"
        )
    if key is None and not is_loopback(host.strip("[]")):
        log.warning(
            "serving on %s with no API key: anyone who can reach this address can use the "
            "model; set --api-key-file or $%s",
            host,
            API_KEY_ENV,
        )
    return None if key is None else key.strip()


def _read_api_key_file(path: str) -> str:
    """The text of ``path`` (keys, one per line); the file must be private."""
    try:
        _st, data = read_private_file(path, "the API key file", MAX_API_KEY_FILE_BYTES)
        return data.decode()
    except UnicodeDecodeError:
        raise ServeError(f"the API key file {path} is not UTF-8 text") from None
    except ValueError as exc:
        raise ServeError(str(exc)) from None


async def serve_with_telemetry(options: ServeOptions) -> int:
    """`serve`, with telemetry configured from the environment and drained at the end."""
    from .. import telemetry

    tel = telemetry.configure_from_env(common={"stagerun.stage_id": 0})
    async with telemetry.draining(tel):
        return await serve(options)
