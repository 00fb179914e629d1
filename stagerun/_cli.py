"""The ``stagerun`` command line: generate, stage, bench, models, serve."""

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

from ._auth import SECRET_FILE_ENV, lane_secret
from ._errors import StagerunError
from ._framed import LinkEmulation
from ._proto import SamplingParams
from ._speculative import SpeculationConfig
from ._util import single_exceptions


def _layer_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise argparse.ArgumentTypeError(f"layer range {text!r} must look like LO:HI, e.g. 0:10")
    return int(lo), int(hi)


def _layer_ranges(text: str) -> list[tuple[int, int]]:
    return [_layer_range(part) for part in text.split(",") if part.strip()]


def _stage_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stage counts {text!r} must look like 1,2,3") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("stage counts must be positive integers")
    return counts


def _delays(text: str) -> list[float]:
    try:
        delays = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"hop delays {text!r} must look like 0,10,20") from None
    if not delays or min(delays) < 0:
        raise argparse.ArgumentTypeError("hop delays must be milliseconds, 0 or more")
    return delays


def _png_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--png",
        default=None,
        metavar="PATH",
        help=f"also draw {what} into this PNG (needs matplotlib: pip install 'stagerun[plot]')",
    )


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model name or GGUF path (default: smollm2)")
    p.add_argument("--threads", type=int, default=None, help="compute threads per stage")
    p.add_argument(
        "--inproc",
        action="store_true",
        help="run all stages as tasks in this process (default: one process per stage)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=["f32", "f16", "q8"],
        default="f32",
        help="activation dtype on lanes",
    )
    _plugin_options(p)


def _transport_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"transports {text!r} must look like ws,tcp")
    return names


def _plugin_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        default="tcp",
        help="transport plugin of every lane between local stages (default tcp; see "
        "`stagerun plugins`)",
    )
    p.add_argument(
        "--transports",
        type=_transport_list,
        default=None,
        help="one transport per hop instead, stage 0->1 first, e.g. ws,tcp",
    )
    p.add_argument("--backend", default="numpy", help="compute backend plugin (default numpy)")
    p.add_argument(
        "--backends",
        type=_transport_list,
        default=None,
        help="one backend per stage instead, stage 0 first, e.g. numpy,torch,numpy",
    )
    p.add_argument(
        "--device",
        default=None,
        help="compute device for backends that take one (torch): cuda, cuda:1, cpu",
    )


def _secret_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="authenticate every lane with the shared secret in PATH (HMAC challenge-response; "
        "every stage needs the same file; default $STAGERUN_SECRET_FILE)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="certificate (chain) for tls:// and wss:// lanes this process serves "
        "(default $STAGERUN_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key", default=None, metavar="PEM", help="its private key (default: in --tls-cert)"
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="authorities trusted for tls:// and wss:// stages this process connects to "
        "(default $STAGERUN_TLS_CA, else the system's)",
    )


def _telemetry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--telemetry",
        choices=["off", "summary", "debug"],
        default=None,
        help="record events and spans (default $STAGERUN_TELEMETRY or off; see "
        "docs/observability.md)",
    )
    p.add_argument(
        "--telemetry-jsonl",
        default=None,
        metavar="PATH",
        help="append telemetry as JSON lines to PATH, or 'stderr' (default: stderr)",
    )


def _reliability_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=None,
        metavar="SECS",
        help="how long a request waits for a failed stage to come back before it fails "
        "(default $STAGERUN_RECOVERY_TIMEOUT_SECS or 60; 0 fails at the first lane failure)",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart local stage processes that die (default: restart with backoff)",
    )


def recovery_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(RecoveryPolicy, SupervisionPolicy) for ``--recovery-timeout`` and ``--no-restart``."""
    from ._pipeline import RecoveryPolicy
    from ._supervise import SupervisionPolicy

    timeout = getattr(args, "recovery_timeout", None)
    if timeout is None:
        recovery = RecoveryPolicy()
    elif timeout < 0:
        raise ValueError(f"--recovery-timeout must not be negative, got {timeout:g}")
    elif timeout == 0:
        recovery = RecoveryPolicy.disabled()
    else:
        recovery = RecoveryPolicy(timeout=timeout)
    return recovery, SupervisionPolicy(restart=not getattr(args, "no_restart", False))


def _link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hop-delay-ms",
        type=float,
        default=0.0,
        help="emulate a WAN link: deliver every lane frame this much later (default 0)",
    )
    p.add_argument(
        "--bandwidth-mbps", type=float, default=None, help="emulate a link of this bandwidth"
    )


def _speculation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        default="off",
        metavar="DRAFTER",
        help="speculative decoding: off (default), ngram, draft-model or a drafter plugin",
    )
    p.add_argument("--depth", type=int, default=4, help="verify windows in flight (default 4)")
    p.add_argument("--window", type=int, default=4, help="draft tokens per window (default 4)")
    p.add_argument(
        "--draft-model",
        default=None,
        help="the draft model: a GGUF for draft-model, a URL for llama-server",
    )
    p.add_argument(
        "--no-adaptive", action="store_true", help="keep window width and drafting fixed"
    )


def speculation_from_args(args: argparse.Namespace) -> SpeculationConfig | None:
    """The speculation settings the options ask for (None when off)."""
    if args.speculative == "off":
        return None
    return SpeculationConfig(
        args.speculative,
        depth=args.depth,
        window=args.window,
        adaptive=not args.no_adaptive,
        draft_model=args.draft_model,
    )


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagerun", description="Run one language model split by layers across stages."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stages", type=int, default=1, help="number of stages (default 1)")
    gen.add_argument("--layers", type=_layer_ranges, help="explicit ranges, e.g. 0:10,10:30")
    gen.add_argument(
        "--topology",
        default=None,
        metavar="FILE",
        help="be stage 0 of the running stages listed in this TOML file (its model and layers)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    _add_pipeline_options(gen)
    _reliability_options(gen)
    _secret_option(gen)
    _telemetry_options(gen)
    _sampling_options(gen)
    _speculation_options(gen)
    _link_options(gen)

    stage = sub.add_parser("stage", help="serve one stage (layers LO:HI) to upstream lanes")
    stage.add_argument(
        "--topology",
        default=None,
        metavar="FILE",
        help="take model, layers, address, backend and downstream from entry --index of this "
        "TOML file (see docs/deployment.md); explicit options still win",
    )
    stage.add_argument("--model", default=None, help="model name or GGUF path (default smollm2)")
    stage.add_argument("--layers", type=_layer_range, default=None, help="LO:HI")
    stage.add_argument("--index", type=int, default=1, help="this stage's index (>= 1)")
    stage.add_argument("--host", default="127.0.0.1")
    stage.add_argument("--port", type=int, default=0, help="0 picks a free port")
    stage.add_argument(
        "--listen",
        default=None,
        help="address to serve on, e.g. ws://0.0.0.0:9001 (default tcp://HOST:PORT); the "
        "scheme picks the transport plugin",
    )
    stage.add_argument("--backend", default=None, help="compute backend plugin (default numpy)")
    stage.add_argument("--device", default=None, help="compute device for torch: cuda, cpu, ...")
    stage.add_argument(
        "--downstream",
        default=None,
        help="address of the next stage; ADDR,STANDBY,... tries standbys in order",
    )
    stage.add_argument("--threads", type=int, default=None)
    stage.add_argument("--wire-dtype", choices=["f32", "f16", "q8"], default="f32")
    _link_options(stage)
    _secret_option(stage)
    _telemetry_options(stage)

    bench = sub.add_parser("bench", help="measure throughput, side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    decode = bench_sub.add_parser("decode", help="decode tokens/s per stage count")
    decode.add_argument("--stages", type=_stage_counts, default=[1, 2, 3])
    decode.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    decode.add_argument("--rounds", type=int, default=3, help="interleaved rounds per config")
    decode.add_argument("--prompt", default="Once upon a time, in a lighthouse by the sea,")
    decode.add_argument("--json", action="store_true")
    _add_pipeline_options(decode)
    spec = bench_sub.add_parser(
        "speculative", help="plain vs depth 1 vs depth D on input-grounded prompts"
    )
    spec.add_argument("--stages", type=int, default=3)
    spec.add_argument("--depth", type=int, default=4, help="the pipelined depth D (default 4)")
    spec.add_argument("--window", type=int, default=4, help="draft tokens per window")
    spec.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    spec.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    spec.add_argument(
        "--hop-delays",
        type=_delays,
        default=None,
        metavar="MS,MS,...",
        help="sweep these hop delays, one pipeline each (instead of --hop-delay-ms)",
    )
    spec.add_argument("--json", action="store_true")
    _png_option(spec, "tokens/s against hop delay")
    _add_pipeline_options(spec)
    _link_options(spec)

    timeline = bench_sub.add_parser(
        "timeline",
        help="one speculative request traced on every stage: compute, write, wait, stale work",
    )
    timeline.add_argument("--stages", type=int, default=3)
    timeline.add_argument("--depth", type=int, default=4, help="verify windows in flight")
    timeline.add_argument("--window", type=int, default=4, help="draft tokens per window")
    timeline.add_argument("--tokens", type=int, default=48, help="tokens generated")
    timeline.add_argument(
        "--prompt", choices=("repeat", "rewrite", "code-edit"), default="code-edit"
    )
    timeline.add_argument(
        "--trace", default=None, metavar="PATH", help="keep the JSON-lines trace here"
    )
    timeline.add_argument("--json", action="store_true")
    _png_option(timeline, "the timeline")
    _add_pipeline_options(timeline)
    _link_options(timeline)

    sub.add_parser("models", help="list the models stagerun can find by name")

    prefill = bench_sub.add_parser(
        "prefill", help="time to first token: one unchunked prefill vs planned, pipelined chunks"
    )
    prefill.add_argument("--stages", type=_stage_counts, default=[2, 3])
    prefill.add_argument("--prompt-tokens", type=int, default=1500)
    prefill.add_argument("--hop-delay-ms", type=float, default=10.0)
    prefill.add_argument("--rounds", type=int, default=3)
    prefill.add_argument(
        "--policies",
        type=_transport_list,
        default=("unchunked", "adaptive"),
        help="prefill chunk policies to compare, the first is the baseline: unchunked, "
        "adaptive or a size; POLICY/serial waits for each chunk's ack (default "
        "unchunked,adaptive)",
    )
    prefill.add_argument("--json", action="store_true")
    _add_pipeline_options(prefill)

    load = bench_sub.add_parser(
        "load", help="many concurrent clients against stagerun serve: completed, 429, lost"
    )
    load.add_argument("--requests", type=int, default=200)
    load.add_argument("--clients", type=int, default=16)
    load.add_argument("--max-tokens", type=int, default=24)
    load.add_argument("--stages", type=int, default=3)
    load.add_argument("--parallel", type=int, default=4, help="the server's --parallel")
    load.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue")
    load.add_argument("--model", default="smollm2")
    load.add_argument("--json", action="store_true")

    recovery = bench_sub.add_parser(
        "recovery", help="kill -9 a stage mid-generation: detection, restart, replay times"
    )
    recovery.add_argument("--stages", type=int, default=3)
    recovery.add_argument("--victim", type=int, default=1, help="stage to kill (default 1)")
    recovery.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    recovery.add_argument("--kill-at", type=int, default=48, help="kill after this many tokens")
    recovery.add_argument("--rounds", type=int, default=3)
    recovery.add_argument("--json", action="store_true")
    _add_pipeline_options(recovery)

    transport = bench_sub.add_parser(
        "transport", help="frame round trip and decode tokens/s per transport"
    )
    transport.add_argument(
        "--compare",
        dest="transports_to_compare",
        type=_transport_list,
        default=("tcp", "ws"),
        help="transports to compare, the first is the baseline (default tcp,ws)",
    )
    transport.add_argument("--stages", type=int, default=3)
    transport.add_argument("--tokens", type=int, default=64)
    transport.add_argument("--rounds", type=int, default=5)
    transport.add_argument("--iterations", type=int, default=2000, help="round trips timed")
    transport.add_argument("--prompt", default="Once upon a time, in a lighthouse by the sea,")
    transport.add_argument("--json", action="store_true")
    transport.add_argument("--model", default="smollm2")
    transport.add_argument("--threads", type=int, default=None)
    transport.add_argument("--inproc", action="store_true")

    backends = bench_sub.add_parser(
        "backends", help="decode tokens/s and verify-window cost per compute backend"
    )
    backends.add_argument(
        "--compare",
        dest="backends_to_compare",
        type=_transport_list,
        default=None,
        help="backends to compare, the first is the baseline (default: all installed but fake)",
    )
    backends.add_argument("--rounds", type=int, default=7)
    backends.add_argument("--threads", type=int, default=1, help="compute threads (default 1)")
    backends.add_argument("--prompt", default="Once upon a time, in a lighthouse by the sea,")
    backends.add_argument("--model", default="smollm2")
    backends.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API over a pipeline")
    serve.add_argument(
        "--model",
        default=None,
        help="model name or GGUF path (default: smollm2, or the topology's)",
    )
    serve.add_argument("--stages", type=int, default=3, help="local stages to start (default 3)")
    serve.add_argument("--topology", default=None, help="join the remote stages of a TOML file")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000, 0 = any)")
    serve.add_argument(
        "--parallel", type=int, default=4, help="requests generating at once = lanes (default 4)"
    )
    serve.add_argument(
        "--max-queue", type=int, default=16, help="requests waiting before 429 (default 16)"
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads per stage (default: the cores split between local stages)",
    )
    serve.add_argument("--inproc", action="store_true", help="run all stages in this process")
    _speculation_options(serve)
    _link_options(serve)
    _reliability_options(serve)
    _secret_option(serve)
    _telemetry_options(serve)
    serve.add_argument("--wire-dtype", choices=["f32", "f16", "q8"], default="f32")
    _plugin_options(serve)
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
        "(default: $STAGERUN_API_KEY)"
    )  # fmt: skip
    plugins_cmd = sub.add_parser(
        "plugins", help="list installed transports, backends and drafters, and broken ones"
    )
    plugins_cmd.add_argument("--json", action="store_true")
    plugins_cmd.add_argument(
        "--load", action="store_true", help="import and validate every plugin now"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        return trio.run(_telemetered, _stage, args, args.index)
    if args.command == "bench":
        from ._bench import run_bench

        return trio.run(run_bench, args)
    if args.command == "models":
        return _models()
    if args.command == "plugins":
        return _plugins(args)
    if args.command == "serve":
        from .server._serve import serve_main

        return serve_main(args)
    return 2


async def _telemetered(
    command: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace, stage: int
) -> int:
    """Run ``command`` with the telemetry ``$STAGERUN_TELEMETRY*`` asks for, drained to the end."""
    from . import telemetry

    tel = telemetry.configure_from_env(common={"stagerun.stage_id": stage})
    async with telemetry.draining(tel):
        return await command(args)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


async def _generate(args: argparse.Namespace) -> int:
    from ._launch import open_pipeline

    recovery, supervision = recovery_from_args(args)
    model, layers, remote = args.model, args.layers, None
    if args.topology is not None:
        from ._topology import load_topology

        topology = load_topology(args.topology)
        model, layers = topology.model, topology.layer_ranges
        remote = topology.remote_addresses
    elif not args.json and args.stages > 1 and not args.inproc:
        print(f"stagerun: starting {args.stages} stages...", file=sys.stderr)
    async with open_pipeline(
        model,
        stages=args.stages if layers is None else len(layers),
        layers=layers,
        remote=remote,
        mode="inproc" if args.inproc else "processes",
        threads=args.threads,
        wire_dtype=args.wire_dtype,
        transport=args.transport,
        transports=args.transports,
        backend=args.backend,
        backends=args.backends,
        device=args.device,
        hop_delay_ms=args.hop_delay_ms,
        bandwidth_mbps=args.bandwidth_mbps,
        speculation=speculation_from_args(args),
        recovery=recovery,
        supervision=supervision,
    ) as pipeline:

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
                    "timings": result.timings,
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
        from ._topology import load_topology

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
    if args.layers is None:
        raise ValueError("give the stage its layers: --layers LO:HI, or --topology FILE --index I")
    args.model = args.model or "smollm2"
    args.backend = args.backend or "numpy"


async def _stage(args: argparse.Namespace) -> int:
    from . import plugins
    from ._stage import serve_stage
    from .model import open_model
    from .transports import format_address

    _stage_from_topology(args)
    backend = plugins.build_backend(
        args.backend, open_model(args.model), args.layers, threads=args.threads,
        device=args.device,
    )  # fmt: skip
    listen = args.listen or format_address("tcp", args.host, args.port)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            lambda task_status: serve_stage(
                backend,
                index=args.index,
                downstream=args.downstream,
                listen=listen,
                wire_dtype=args.wire_dtype,
                link=LinkEmulation(
                    delay_s=args.hop_delay_ms / 1000.0,
                    bandwidth_bytes_per_s=(
                        args.bandwidth_mbps * 125_000.0 if args.bandwidth_mbps else None
                    ),
                ),
                task_status=task_status,
            )
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
    from . import plugins

    infos = plugins.installed()
    if args.load:
        loaders = {"transports": plugins.transport, "backends": plugins.backend,
                   "drafters": plugins.drafter}  # fmt: skip
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
    from .model import resolve_model

    try:
        path = resolve_model("smollm2")
        print(f"smollm2\t{path}")
    except StagerunError as exc:
        print(f"smollm2\t(not installed: {exc})")
    return 0
