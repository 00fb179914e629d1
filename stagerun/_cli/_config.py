"""The one mapping from command-line options to a `PipelineConfig`.

``stagerun generate``, ``stagerun serve`` and every ``stagerun bench`` build their pipeline
here, so an option means the same everywhere and none is dropped on the way. A command that
lacks an option (bench has no ``--speculative``) gets the configuration's default.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._driver._config import PipelineConfig
from .._driver._topology import load_topology
from .._engine._config import DEFAULT_INLINE_COMPUTE_MS
from .._engine._prefix import DEFAULT_PREFIX_CACHE_MB
from ._options import recovery_from_args, speculation_from_args


def config_from_args(args: argparse.Namespace, **overrides: Any) -> PipelineConfig:
    """The pipeline the parsed options ask for; ``overrides`` replace settings by name.

    ``--topology FILE`` gives the layers and the addresses of stages already running;
    otherwise ``--stages N`` (when it is one number) splits the layers evenly.
    """

    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    recovery, supervision = recovery_from_args(args)
    settings: dict[str, Any] = {
        "mode": "inproc" if get("inproc", False) else "processes",
        "threads": get("threads"),
        "stage_threads": get("stage_threads"),
        "wire_dtype": get("wire_dtype", "f32"),
        "transport": get("transport", "tcp"),
        "transports": get("transports"),
        "backend": get("backend", "auto"),
        "backends": get("backends"),
        "device": get("device"),
        "flash_attention": get("flash_attention"),
        "hop_delay_ms": get("hop_delay_ms", 0.0),
        "bandwidth_mbps": get("bandwidth_mbps"),
        "speculation": speculation_from_args(args) if hasattr(args, "speculative") else None,
        "recovery": recovery,
        "supervision": supervision,
        "prefix_cache": get("prefix_cache", "on") == "on",
        "prefix_cache_mb": get("prefix_cache_mb", DEFAULT_PREFIX_CACHE_MB),
        "chat_template": get("chat_template"),
        "inline_compute_ms": get("inline_compute_ms", DEFAULT_INLINE_COMPUTE_MS),
    }
    if isinstance(get("stages"), int):
        settings["stages"] = get("stages")
    batch = max_batch_from_args(args)
    if batch is not None:
        settings["capacity"] = batch  # a lane for every request that may run at once
    if get("topology") is not None:
        topology = load_topology(get("topology"))
        layers, remote = topology.layer_ranges, topology.remote_addresses
        if len(layers) > 1 and not remote:
            raise ValueError(f"topology {get('topology')} lists stages without addresses")
        settings.update(layers=layers, remote=remote or None, stages=len(layers))
    settings.update(overrides)
    return PipelineConfig(**settings)


def max_batch_from_args(args: argparse.Namespace) -> int | None:
    """Requests that generate at once: serve's ``--max-batch`` (or ``--parallel``, its
    deprecated alias; default `DEFAULT_MAX_BATCH`), bench load's ``--parallel``; None for a
    command that has neither."""
    if hasattr(args, "max_batch"):
        from ..server._config import DEFAULT_MAX_BATCH  # only serve pays for the server import

        return DEFAULT_MAX_BATCH if args.max_batch is None else int(args.max_batch)
    parallel = getattr(args, "parallel", None)
    return parallel if isinstance(parallel, int) else None
