"""``stagerun serve`` from the command line: its arguments as `ServeOptions`."""

from __future__ import annotations

import argparse
import logging

import trio

from ..server._config import DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT
from ..server._serve import ServeOptions, serve_with_telemetry
from ._config import config_from_args, max_batch_from_args


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """`ServeOptions` from the parsed ``stagerun serve`` arguments."""
    max_batch = max_batch_from_args(args)
    assert max_batch is not None  # serve has --max-batch
    if args.api_key:
        logging.getLogger("stagerun.serve").warning(
            "--api-key shows in process listings (ps) to every user of this machine; "
            "use --api-key-file PATH or $STAGERUN_API_KEY instead"
        )
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    return ServeOptions(
        model=args.model,
        pipeline=config_from_args(args),
        topology=args.topology,
        host=args.host,
        port=args.port,
        max_batch=max_batch,
        kv_budget=args.kv_budget,
        max_queue=_or(args.max_queue, DEFAULT_MAX_QUEUE),
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        max_tokens_default=_or(args.max_tokens_default, DEFAULT_MAX_TOKENS),
        max_tokens_limit=_or(args.max_tokens_limit, MAX_TOKENS_LIMIT),
        allowed_hosts=hosts,
        request_timeout=args.request_timeout,
        write_timeout=args.write_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        max_bodies_per_client=args.max_bodies_per_client,
        prefix_share=args.prefix_share,
        metrics_auth=args.metrics_auth,
        ui=not args.no_ui,
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def serve_main(args: argparse.Namespace) -> int:
    """``stagerun serve``: run the server, return the exit code."""
    return trio.run(serve_with_telemetry, options_from_args(args))
