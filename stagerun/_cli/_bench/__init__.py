"""``stagerun bench``: throughput measured side by side in one run.

These machines are noisy, so a benchmark never reports a lone number: every configuration is
open at the same time and measured in interleaved rounds, and the report gives ratios to the
baseline measured in the same run. The median of the rounds is reported.

One module per family: `._decode` (decode, transport, backends), `._speculative`
(speculative, timeline), `._prefill` (prefill), `._chat` (chat), `._service` (recovery, load),
`._serve`
(serve).
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from ._chat import bench_chat
from ._decode import bench_backends, bench_decode, bench_transport
from ._prefill import bench_prefill
from ._serve_run import bench_serve
from ._service import bench_load, bench_recovery, process_tree_rss_mb
from ._speculative import SPECULATIVE_PROMPTS, bench_speculative, bench_timeline

__all__ = ["SPECULATIVE_PROMPTS", "process_tree_rss_mb", "run_bench"]

BENCHMARKS: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {
    "decode": bench_decode,
    "speculative": bench_speculative,
    "timeline": bench_timeline,
    "transport": bench_transport,
    "backends": bench_backends,
    "recovery": bench_recovery,
    "load": bench_load,
    "serve": bench_serve,
    "prefill": bench_prefill,
    "chat": bench_chat,
}


async def run_bench(args: argparse.Namespace) -> int:
    try:
        bench = BENCHMARKS[args.bench_command]
    except KeyError:
        raise ValueError(f"unknown benchmark {args.bench_command!r}") from None
    return await bench(args)
