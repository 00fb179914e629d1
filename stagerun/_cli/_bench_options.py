"""The ``stagerun bench`` subcommands' parsers, added to the command line by `add_bench_parsers`
(which `._options.build_parser` calls), and the argument types only they use."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, TypeAlias

from ._pipeline_options import _add_pipeline_options, _link_options, _transport_list

__all__ = ["add_bench_parsers"]

if TYPE_CHECKING:
    _SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _stage_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stage counts {text!r} must look like 1,2,3") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("stage counts must be positive integers")
    return counts


def _client_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"client counts {text!r} must look like 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("client counts must be positive integers")
    return sorted(set(counts))


def _delays(text: str) -> list[float]:
    try:
        delays = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"hop delays {text!r} must look like 0,10,20") from None
    if not delays or not all(math.isfinite(d) and d >= 0 for d in delays):
        raise argparse.ArgumentTypeError("hop delays must be milliseconds, 0 or more")
    return delays


def _request_selector(text: str) -> int | str:
    """A request id (decimal, or hex with 0x), else an HTTP x-request-id label."""
    try:
        return int(text, 0)
    except ValueError:
        return text


def _png_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--png",
        default=None,
        metavar="PATH",
        help=f"also draw {what} into this PNG (needs matplotlib: pip install 'stagerun[plot]')",
    )


def add_bench_parsers(sub: _SubParsers) -> None:
    """Add ``stagerun bench`` and its subcommands to the ``stagerun`` subcommands ``sub``."""
    bench = sub.add_parser("bench", help="measure throughput, side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_decode(bench_sub)
    _add_speculative(bench_sub)
    _add_timeline(bench_sub)
    _add_prefill(bench_sub)
    _add_chat(bench_sub)
    _add_load(bench_sub)
    _add_serve(bench_sub)
    _add_recovery(bench_sub)
    _add_transport(bench_sub)
    _add_backends(bench_sub)


def _add_decode(bench_sub: _SubParsers) -> None:
    decode = bench_sub.add_parser("decode", help="decode tokens/s per stage count")
    decode.add_argument("--stages", type=_stage_counts, default=[1, 2, 3])
    decode.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    decode.add_argument("--rounds", type=int, default=3, help="interleaved rounds per config")
    decode.add_argument("--prompt", default="Once upon a time, in a lighthouse by the sea,")
    decode.add_argument("--json", action="store_true")
    _add_pipeline_options(decode)


def _add_speculative(bench_sub: _SubParsers) -> None:
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


def _add_timeline(bench_sub: _SubParsers) -> None:
    timeline = bench_sub.add_parser(
        "timeline",
        help="speculative requests traced on every stage: compute, write, wait, stale work",
    )

    def request_count(text: str) -> int | str:
        if text == "all":
            return text
        try:
            count = int(text)
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(f"--requests takes a count or 'all', not {text!r}")
        return count

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
    timeline.add_argument(
        "--from-trace",
        default=None,
        metavar="PATH",
        help="run nothing: draw a request from this debug trace (e.g. one a served pipeline "
        "wrote with --telemetry debug --telemetry-jsonl PATH)",
    )
    timeline.add_argument(
        "--request-id",
        type=_request_selector,
        default=None,
        help="with --from-trace: the request to draw, by its id in the trace "
        "(llama_stage.request_id) or by the x-request-id it was served under (default: the "
        "last one to finish)",
    )
    timeline.add_argument(
        "--requests",
        type=request_count,
        default=1,
        metavar="N",
        help="run N requests at once, on different prompts (--prompt first), and lay out all "
        "of them, a row each on every stage; with --from-trace, the last N to finish, or "
        "'all' (default 1)",
    )
    timeline.add_argument("--json", action="store_true")
    _png_option(timeline, "the timeline")
    _add_pipeline_options(timeline)
    _link_options(timeline)


def _add_prefill(bench_sub: _SubParsers) -> None:
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


def _add_chat(bench_sub: _SubParsers) -> None:
    chat = bench_sub.add_parser(
        "chat",
        help="a multi-turn chat with a long system prompt: time to first token, prefix cache "
        "on against off",
    )
    chat.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6)")
    chat.add_argument("--stages", type=int, default=3, help="stages of each pipeline (default 3)")
    chat.add_argument("--hop-delay-ms", type=float, default=10.0)
    chat.add_argument("--clients", type=int, default=1,
                      help="users chatting at once over one system prompt (default 1)")  # fmt: skip
    chat.add_argument("--system-tokens", type=int, default=1000,
                      help="tokens of the shared system prompt (default 1000)")  # fmt: skip
    chat.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most")
    chat.add_argument("--stagger-ms", type=float, default=0.0, metavar="MS",
                      help="user c sends its first turn c*MS later (default 0)")  # fmt: skip
    chat.add_argument("--json", action="store_true")
    _add_pipeline_options(chat)


def _add_load(bench_sub: _SubParsers) -> None:
    load = bench_sub.add_parser(
        "load", help="many concurrent clients against stagerun serve: completed, 429, lost"
    )
    load.add_argument("--requests", type=int, default=200)
    load.add_argument("--clients", type=int, default=16)
    load.add_argument("--max-tokens", type=int, default=24)
    load.add_argument("--stages", type=int, default=3)
    load.add_argument("--max-batch", "--parallel", type=int, default=None, dest="max_batch",
                      help="the server's --max-batch (default: the server's default)")  # fmt: skip
    load.add_argument("--max-queue", type=int, default=None,
                      help="the server's --max-queue (default: the server's default)")  # fmt: skip
    load.add_argument("--model", default="smollm2")
    load.add_argument("--json", action="store_true")


def _add_serve(bench_sub: _SubParsers) -> None:
    serve = bench_sub.add_parser(
        "serve",
        help="closed-loop streaming clients against stagerun serve: tokens/s, TTFT and "
        "inter-token latency per client count, outputs checked against solo runs",
    )
    serve.add_argument(
        "--clients", type=_client_counts, default=[1, 2, 4, 8, 16], metavar="N,N,...",
        help="client counts to measure, one level each (default 1,2,4,8,16)",
    )  # fmt: skip
    serve.add_argument("--stages", type=int, default=3, help="local stages (default 3)")
    serve.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    serve.add_argument(
        "--requests-per-client", type=int, default=4, metavar="K",
        help="requests each client sends, one after another (default 4)",
    )  # fmt: skip
    serve.add_argument("--model", default="smollm2", help="model name or GGUF path")
    serve.add_argument("--threads", type=int, default=None, help="the server's --threads")
    serve.add_argument(
        "--max-batch", type=int, default=None, metavar="N",
        help="the server's --max-batch, requests generating at once (default: the server's)",
    )  # fmt: skip
    serve.add_argument("--speculative", default="off", metavar="DRAFTER",
                       help="the server's --speculative (default off)")  # fmt: skip
    serve.add_argument("--prompts", choices=("story", "copy"), default="story",
                       help="story: open continuations (default); copy: input-grounded "
                       "prompts a drafter can predict")  # fmt: skip
    serve.add_argument("--depth", type=int, default=None, help="the server's --depth")
    serve.add_argument("--window", type=int, default=None, help="the server's --window")
    serve.add_argument("--draft-model", default=None, help="the server's --draft-model")
    serve.add_argument(
        "--serve-arg", action="append", default=[], metavar="ARG",
        help="one more argument for stagerun serve, repeatable, e.g. --serve-arg=--kv-budget=1G "
        "(they come last, so they win)",
    )  # fmt: skip
    serve.add_argument(
        "--compare-llama-server", action="store_true",
        help="run the same load against llama-server -np N on the same GGUF",
    )  # fmt: skip
    serve.add_argument(
        "--llama-server", default=None, metavar="PATH",
        help="the llama-server binary (default .cache/llama.cpp/bin/llama-server)",
    )  # fmt: skip
    serve.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t (default 2)")
    serve.add_argument(
        "--rounds", type=int, default=1, metavar="R",
        help="measure every level R times, the systems compared taking turns round by round "
        "(each level's servers up together), and report the median round (default 1)",
    )  # fmt: skip
    serve.add_argument(
        "--compare-rpc", action="store_true",
        help="run the same load against llama.cpp's RPC split: llama-server over --stages "
        "ggml-rpc-server processes, each behind a proxy delaying --hop-delay-ms (built by "
        "plugins/stagerun-llamacpp/scripts/build.sh, which make test runs)",
    )  # fmt: skip
    serve.add_argument("--json", action="store_true")
    _png_option(serve, "tokens/s against client count")
    _link_options(serve)


def _add_recovery(bench_sub: _SubParsers) -> None:
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


def _add_transport(bench_sub: _SubParsers) -> None:
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


def _add_backends(bench_sub: _SubParsers) -> None:
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
