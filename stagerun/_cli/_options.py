"""The ``stagerun`` command line's options: every subcommand's parser (``bench``'s in
`._bench_options`), and the policies the options stand for (`recovery_from_args`,
`speculation_from_args`)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from .._driver._config import (
    DEFAULT_FAILURE_WINDOW,
    DEFAULT_MAX_FAILURES,
    DEFAULT_RECHECK_INTERVAL,
    SpeculationConfig,
)
from .._engine import _config as engine
from .._wire._framed import DEFAULT_HANDSHAKE_TIMEOUT
from ._bench_options import _request_selector as _request_selector  # re-exported (tests use it)
from ._bench_options import add_bench_parsers
from ._http_options import http_options
from ._pipeline_options import (
    _add_pipeline_options,
    _link_options,
    _plugin_options,
    chat_template_option,
    flash_attention_option,
    inline_compute_option,
    prefix_cache_options,
)

__all__ = ["build_parser", "recovery_from_args", "speculation_from_args"]


def _layer_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise argparse.ArgumentTypeError(f"layer range {text!r} must look like LO:HI, e.g. 0:10")
    return int(lo), int(hi)


def _layer_ranges(text: str) -> list[tuple[int, int]]:
    return [_layer_range(part) for part in text.split(",") if part.strip()]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _seconds_or_never(text: str) -> float:
    if text.strip().lower() in ("inf", "never"):
        return math.inf
    return _seconds(text)


def _seconds_or_zero(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else _seconds(text)


def _stage_limit_options(p: argparse.ArgumentParser) -> None:
    """What upstream peers may make a stage hold (docs/reliability.md, Security)."""
    p.add_argument(
        "--max-sessions", type=_positive_int, default=engine.DEFAULT_MAX_SESSIONS, metavar="N",
        help="requests open at once on this stage, over all lanes; a Configure past it gets "
        f"an error (default {engine.DEFAULT_MAX_SESSIONS})",
    )  # fmt: skip
    p.add_argument(
        "--max-kv-tokens", type=_positive_int, default=engine.DEFAULT_MAX_KV_TOKENS, metavar="N",
        help="KV positions all those requests may reach together "
        f"(default {engine.DEFAULT_MAX_KV_TOKENS})",
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=_positive_int, default=engine.DEFAULT_MAX_CONNECTIONS,
        metavar="N", help="connections open at once (lowered to what the open-file limit "
        f"allows); one more closes the quietest (default {engine.DEFAULT_MAX_CONNECTIONS})",
    )  # fmt: skip
    p.add_argument(
        "--max-handshakes", type=_positive_int, default=engine.DEFAULT_MAX_HANDSHAKES, metavar="N",
        help="connections in their handshake at once; one more closes the oldest "
        f"(default {engine.DEFAULT_MAX_HANDSHAKES})",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout", type=_seconds_or_never, default=engine.DEFAULT_IDLE_TIMEOUT,
        metavar="SECS", help="close a connection that carried no byte for SECS (inf: never; "
        f"default {engine.DEFAULT_IDLE_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--stall-timeout", type=_seconds_or_never, default=engine.DEFAULT_STALL_TIMEOUT,
        metavar="SECS", help="refuse handshakes (so liveness probes fail) while a compute has "
        f"shown no progress for SECS (inf: never; default {engine.DEFAULT_STALL_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--max-payload-bytes", type=_positive_int, default=None, metavar="N",
        help="the largest activation payload one upstream frame may carry (default: what the "
        "model's longest message needs, context x width in float32)",
    )  # fmt: skip
    p.add_argument(
        "--max-partial-bytes", type=_positive_int, default=None, metavar="N",
        help="bytes the partial frames of all connections may hold together; past it the "
        "stalest partial frame's connection is closed (default --max-payload-bytes + 16 MiB, "
        "at least 32 MiB; at least --max-payload-bytes + 4 MiB)",
    )  # fmt: skip


def _stage_compute_options(p: argparse.ArgumentParser) -> None:
    """How a stage batches, and how long it waits for its peers."""
    p.add_argument(
        "--max-batch", type=_positive_int, default=None, metavar="N",
        help="sessions one tick computes together at most (1: no batching; default no cap)",
    )  # fmt: skip
    p.add_argument(
        "--tick-rows", type=_positive_int, default=engine.DEFAULT_TICK_ROWS, metavar="N",
        help=f"rows one tick computes at most (default {engine.DEFAULT_TICK_ROWS})",
    )  # fmt: skip
    inline_compute_option(p)
    p.add_argument(
        "--reply-timeout", type=_seconds, default=None, metavar="SECS",
        help="deadline of every write to a peer (default $STAGERUN_STAGE_REPLY_TIMEOUT_SECS "
        "or 30)",
    )  # fmt: skip
    p.add_argument(
        "--downstream-connect-timeout", type=_seconds, metavar="SECS",
        default=engine.DEFAULT_DOWNSTREAM_CONNECT_TIMEOUT, help="connect deadline of one dial "
        f"of the next stage (default {engine.DEFAULT_DOWNSTREAM_CONNECT_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--downstream-ready-timeout", type=_seconds, metavar="SECS",
        default=engine.DEFAULT_DOWNSTREAM_READY_TIMEOUT, help="handshake deadline of one dial "
        f"of the next stage (default {engine.DEFAULT_DOWNSTREAM_READY_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--downstream-retry-window", type=_seconds_or_zero, metavar="SECS",
        default=engine.DEFAULT_DOWNSTREAM_RETRY_WINDOW, help="keep dialling a next stage that "
        "refuses (it may still be starting) for SECS "
        f"(default {engine.DEFAULT_DOWNSTREAM_RETRY_WINDOW:g})",
    )  # fmt: skip


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5GiB`` or plain bytes; the units are powers of 1024."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes or a number with K, M, G or T, e.g. 512M, 2G"
        )
    size = int(float(match[1]) * _SIZE_UNITS[match[2].lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return size


class _DeprecatedAlias(argparse.Action):
    """Stores like the option it stands for, and says to use that one instead."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        instead = "--" + self.dest.replace("_", "-")
        print(f"stagerun: {option_string} is deprecated; use {instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


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
    p.add_argument(
        "--max-stage-failures", type=_positive_int, default=DEFAULT_MAX_FAILURES, metavar="N",
        help="give a local stage up (report it failed, stop restarting it until its port is "
        "free again) once its process exits N times within --stage-failure-window "
        f"(default {DEFAULT_MAX_FAILURES})",
    )  # fmt: skip
    p.add_argument(
        "--stage-failure-window", type=_seconds, default=DEFAULT_FAILURE_WINDOW,
        metavar="SECS", help=f"see --max-stage-failures (default {DEFAULT_FAILURE_WINDOW:g})",
    )  # fmt: skip
    p.add_argument(
        "--stage-recheck", type=_seconds_or_zero, default=DEFAULT_RECHECK_INTERVAL, metavar="SECS",
        help="check a given-up stage's port every SECS (doubling after each failed start, up "
        "to --stage-failure-window) and start the stage again when the port is free; 0 never "
        f"does (default {DEFAULT_RECHECK_INTERVAL:g})",
    )  # fmt: skip


def recovery_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(RecoveryPolicy, SupervisionPolicy) for ``--recovery-timeout``, ``--no-restart`` and
    the stage failure cap."""
    from .._driver._config import RecoveryPolicy, SupervisionPolicy

    timeout = getattr(args, "recovery_timeout", None)
    if timeout is None:
        recovery = RecoveryPolicy()
    elif timeout < 0:
        raise ValueError(f"--recovery-timeout must not be negative, got {timeout:g}")
    elif timeout == 0:
        recovery = RecoveryPolicy.disabled()
    else:
        recovery = RecoveryPolicy(timeout=timeout)
    supervision = SupervisionPolicy(
        restart=not getattr(args, "no_restart", False),
        max_failures=getattr(args, "max_stage_failures", DEFAULT_MAX_FAILURES),
        failure_window=getattr(args, "stage_failure_window", DEFAULT_FAILURE_WINDOW),
        recheck_interval=getattr(args, "stage_recheck", DEFAULT_RECHECK_INTERVAL),
    )
    return recovery, supervision


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


def _admission_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--max-batch", type=int, default=None, metavar="N",
        help="requests generating at once; the lane pool gets at least N lanes (default 16)",
    )  # fmt: skip
    serve.add_argument(
        "--parallel", type=int, dest="max_batch", action=_DeprecatedAlias, metavar="N",
        help="deprecated alias of --max-batch",
    )  # fmt: skip
    serve.add_argument(
        "--kv-budget", type=_byte_size, default=None, metavar="SIZE",
        help="KV cache the running requests may reserve together, e.g. 512M, 2G or bytes; a "
        "request reserves (prompt + max_tokens) tokens of it (default: the largest of the "
        "model's float32 weights, --max-batch requests of 1024 tokens, one full context)",
    )  # fmt: skip
    serve.add_argument(
        "--max-queue", type=int, default=None, metavar="N",
        help="requests waiting for a slot and KV budget before 429 (default 64)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagerun", description="Run one language model split by layers across stages."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate_parser(sub)
    _add_stage_parser(sub)
    add_bench_parsers(sub)
    sub.add_parser("models", help="list the models stagerun can find by name")
    _add_serve_parser(sub)
    plugins_cmd = sub.add_parser(
        "plugins", help="list installed transports, backends and drafters, and broken ones"
    )
    plugins_cmd.add_argument("--json", action="store_true")
    plugins_cmd.add_argument(
        "--load", action="store_true", help="import and validate every plugin now"
    )
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _add_stage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    flash_attention_option(stage)
    stage.add_argument(
        "--downstream",
        default=None,
        help="address of the next stage; ADDR,STANDBY,... tries standbys in order",
    )
    stage.add_argument("--threads", type=int, default=None)
    stage.add_argument("--wire-dtype", choices=["f32", "f16", "q8"], default="f32")
    stage.add_argument(
        "--handshake-timeout",
        type=_seconds,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        metavar="SECS",
        help="drop a connection that has not finished its side of the lane handshake (hello; "
        f"with a secret, nonce and proof) within SECS (default {DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
    _stage_limit_options(stage)
    _stage_compute_options(stage)
    prefix_cache_options(stage)
    _link_options(stage)
    _secret_option(stage)
    stage.add_argument(
        "--no-secret", action="store_true",
        help="serve and dial without lane authentication, even with $STAGERUN_SECRET_FILE set",
    )  # fmt: skip
    stage.add_argument(
        "--insecure", action="store_true", help="serve beyond loopback without a lane secret "
        "(anyone who can reach the port can send the stage work); without it such a stage "
        "refuses to start",
    )  # fmt: skip
    _telemetry_options(stage)


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API over a pipeline")
    serve.add_argument(
        "--model",
        default=None,
        help="model name (smollm2, gemma3-270m) or GGUF path (default: smollm2, or the topology's)",
    )
    chat_template_option(serve)
    serve.add_argument("--stages", type=int, default=3, help="local stages to start (default 3)")
    serve.add_argument("--topology", default=None, help="join the remote stages of a TOML file")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000, 0 = any)")
    _admission_options(serve)
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
    http_options(serve, _seconds)
    serve.add_argument(
        "--max-tokens-default", type=int, default=None, metavar="N",
        help="tokens a chat request that names no max_tokens gets (default 512; "
        "/v1/completions keeps OpenAI's 16)",
    )  # fmt: skip
    serve.add_argument(
        "--max-tokens-limit", type=int, default=None, metavar="N",
        help="the most tokens any request generates; a larger max_tokens is cut to it "
        "(default 4096)",
    )  # fmt: skip
