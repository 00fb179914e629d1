"""The ``stagerun`` command line: generate, stage, bench, models, serve (options in `._options`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from .._errors import StagerunError
from .._proto import SamplingParams
from .._util import single_exceptions
from .._wire._auth import SECRET_FILE_ENV, lane_secret
from ._options import build_parser

SWITCH_INTERVAL_S = 0.0005
"""The interpreter's GIL switch interval in stagerun's processes (Python's default: 5 ms).

A stage's compute thread needs the GIL back after every ggml graph, while the event loop
holds it for HTTP, framing and sampling; with 5 ms it could wait that long each step. Measured
with one stage and one client: 79 tokens/s at 5 ms, 83.5 at 0.5 ms (docs/benchmarks.md)."""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        with single_exceptions():
            return _dispatch(args)
    except StagerunError as exc:
        print(f"stagerun: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"stagerun: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    # Security settings go to the environment: this process and the stages it starts use them.
    for option, variable in (
        ("secret_file", SECRET_FILE_ENV),
        ("tls_cert", "STAGERUN_TLS_CERT"),
        ("tls_key", "STAGERUN_TLS_KEY"),
        ("tls_ca", "STAGERUN_TLS_CA"),
        ("telemetry_jsonl", "STAGERUN_TELEMETRY_JSONL"),
    ):
        value = getattr(args, option, None)
        if value is not None:
            os.environ[variable] = value if value == "stderr" else os.path.abspath(value)
    if getattr(args, "telemetry", None) is not None:
        os.environ["STAGERUN_TELEMETRY"] = args.telemetry
    lane_secret()  # an unreadable or too short secret fails here, in one line
    if args.command == "generate":
        return trio.run(_telemetered, _generate, args, 0)
    if args.command == "stage":
        from .._driver._supervise import exit_with_parent

        exit_with_parent()  # started by a supervisor: die with it, however it dies
        return trio.run(_telemetered, _stage, args, args.index)
    if args.command == "bench":
        from ._bench import run_bench

        return trio.run(run_bench, args)
    if args.command == "models":
        return _models()
    if args.command == "plugins":
        return _plugins(args)
    if args.command == "serve":
        from .._driver._supervise import exit_with_parent
        from ._serve import serve_main

        exit_with_parent()  # only when a supervisor (a bench) started it so

        return serve_main(args)
    return 2


async def _telemetered(
    command: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace, stage: int
) -> int:
    """Run ``command`` with the telemetry ``$STAGERUN_TELEMETRY*`` asks for, drained to the end."""
    from .. import telemetry

    tel = telemetry.configure_from_env(common={"stagerun.stage_id": stage})
    async with telemetry.draining(tel):
        return await command(args)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


async def _generate(args: argparse.Namespace) -> int:
    from .._launch import open_pipeline
    from ._config import config_from_args

    config = config_from_args(args)
    model = args.model
    if args.topology is not None:
        from .._driver._topology import load_topology

        model = load_topology(args.topology).model
    elif not args.json and args.stages > 1 and not args.inproc:
        print(f"stagerun: starting {args.stages} stages...", file=sys.stderr)
    async with open_pipeline(model, config) as pipeline:

        def show(chunk: Any) -> None:
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()

        result = await pipeline.complete(
            args.prompt,
            max_tokens=args.max_tokens,
            sampling=_sampling(args),
            chat=args.chat,
            on_token=show,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "prompt_token_ids": result.prompt_token_ids,
                    "finish_reason": result.finish_reason,
                    "timings": result.timings.to_json(),
                }
            )
        )
    else:
        sys.stdout.write("\n")
        t = result.timings
        print(
            f"stagerun: {int(t['prompt_n'])} prompt tokens in {t['prompt_ms']:.0f} ms, "
            f"{int(t['predicted_n'])} generated at {t['predicted_per_second']:.1f} tokens/s "
            f"({result.finish_reason})",
            file=sys.stderr,
        )
    return 0


def _stage_from_topology(args: argparse.Namespace) -> None:
    """Fill the stage options the command line left out from ``--topology`` (or defaults)."""
    if args.topology is not None:
        from .._driver._topology import load_topology

        topology = load_topology(args.topology)
        if not 1 <= args.index < len(topology.stages):
            raise ValueError(
                f"--index {args.index}: {args.topology} lists stages 1.."
                f"{len(topology.stages) - 1} (stage 0 is `stagerun serve --topology`)"
            )
        entry = topology.stages[args.index]
        nxt = topology.stages[args.index + 1] if args.index + 1 < len(topology.stages) else None
        args.model = args.model or topology.model
        args.layers = args.layers or entry.layers
        args.backend = args.backend or entry.backend
        args.listen = args.listen or entry.listen or entry.address
        if args.downstream is None and nxt is not None:
            args.downstream = ",".join([nxt.address or "", *nxt.standby])
    args.model = args.model or "smollm2"


async def _listening(
    nursery: trio.Nursery, listen: str, serve: Callable[..., Awaitable[None]]
) -> str:
    """Start ``serve`` in ``nursery``; an address that cannot be bound is one line of error
    (the supervisor that restarts this stage shows it), not a traceback."""
    try:
        with single_exceptions():  # the listener's nursery wraps what it raises
            address: str = await nursery.start(serve)
    except OSError as exc:
        raise StagerunError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    return address


async def _stage(args: argparse.Namespace) -> int:
    from .. import plugins
    from .._engine._config import StageConfig
    from .._stage._server import payload_limit, serve_stage
    from ..model import open_model

    _stage_from_topology(args)
    config = StageConfig.from_args(args)
    assert config.compute is not None
    compute = config.compute
    model = open_model(compute.model)
    if args.max_payload_bytes is None:  # what the model's longest message needs
        config = config.replace(max_payload_bytes=payload_limit(model))
    backend = plugins.build_for(compute, model)
    async with trio.open_nursery() as nursery:
        address = await _listening(
            nursery,
            config.listen,
            lambda task_status: serve_stage(backend, config, task_status=task_status),
        )
        print(f"READY {address}", flush=True)
        lo, hi = args.layers
        print(
            f"stagerun: stage {args.index} (layers {lo}..{hi}) ready at {address}", file=sys.stderr
        )
        # SIGTERM (what a supervisor sends) stops the stage like Ctrl-C: through the nursery,
        # so open lanes close and the telemetry queue is flushed.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from .. import plugins

    infos = plugins.installed()
    if args.load:
        loaders = {"transports": plugins.transport, "backends": plugins.backend,
                   "drafters": plugins.drafter, "architectures": plugins.family}  # fmt: skip
        for info in infos:
            if info.status == "available":
                with contextlib.suppress(plugins.PluginError):
                    loaders[info.kind](info.name)
    if args.json:
        rows = [
            {"kind": i.kind, "name": i.name, "value": i.value, "distribution": i.distribution,
             "status": i.status, "problem": i.problem}
            for i in infos
        ]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return 1 if any(i.status == "broken" for i in infos) else 0
    for kind in plugins.GROUPS:
        print(f"{kind}:")
        for info in (i for i in infos if i.kind == kind):
            line = f"  {info.name:12s} {info.value:45s} {info.distribution}  [{info.status}]"
            print(line)
            if info.problem:
                print(f"      {info.problem}")
    return 1 if any(i.status == "broken" for i in infos) else 0


def _models() -> int:
    from ..model import KNOWN_MODELS, resolve_model

    for model in KNOWN_MODELS:
        try:  # a chunked model is assembled on its first resolve (seconds, once)
            print(f"{model.name}\t{resolve_model(model.name)}")
        except StagerunError as exc:
            print(f"{model.name}\t(not installed: {exc})")
    return 0
