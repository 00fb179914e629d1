"""``stagerun bench``: throughput measured side by side in one run.

These machines are noisy, so a benchmark never reports a lone number: every configuration is
open at the same time and measured in interleaved rounds, and the report gives ratios to the
baseline measured in the same run. The median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import AsyncExitStack
from typing import Any

from ._pipeline import Mode, Pipeline, open_pipeline
from ._proto import SamplingParams


async def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "decode":
        return await bench_decode(args)
    raise ValueError(f"unknown benchmark {args.bench_command!r}")


def _say(args: argparse.Namespace, text: str) -> None:
    print(f"stagerun bench: {text}", file=sys.stderr, flush=True)


async def bench_decode(args: argparse.Namespace) -> int:
    """Decode tokens/s for each stage count, greedy, same prompt, interleaved rounds."""
    counts: list[int] = args.stages
    mode: Mode = "inproc" if args.inproc else "processes"
    greedy = SamplingParams()
    samples: dict[int, list[float]] = {n: [] for n in counts}
    outputs: dict[int, list[int]] = {}
    async with AsyncExitStack() as stack:
        pipelines: dict[int, Pipeline] = {}
        for n in counts:
            _say(args, f"starting a {n}-stage pipeline ({mode})")
            pipelines[n] = await stack.enter_async_context(
                open_pipeline(
                    args.model,
                    stages=n,
                    mode=mode,
                    threads=args.threads,
                    wire_dtype=args.wire_dtype,
                )
            )
        for pipeline in pipelines.values():  # warm-up: caches, thread pools, lanes
            await pipeline.complete(args.prompt, max_tokens=8, sampling=greedy, ignore_eog=True)
        for round_index in range(args.rounds):
            for n, pipeline in pipelines.items():
                result = await pipeline.complete(
                    args.prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True
                )
                rate = result.timings["predicted_per_second"]
                samples[n].append(rate)
                outputs.setdefault(n, result.token_ids)
                _say(
                    args, f"round {round_index + 1}/{args.rounds}: {n} stage(s) {rate:.1f} tokens/s"
                )
    base = counts[0]
    medians = {n: statistics.median(v) for n, v in samples.items()}
    report: dict[str, Any] = {
        "benchmark": "decode",
        "model": str(args.model),
        "mode": mode,
        "threads": args.threads,
        "wire_dtype": args.wire_dtype,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "results": [
            {
                "stages": n,
                "tokens_per_second": round(medians[n], 2),
                "samples": [round(x, 2) for x in samples[n]],
            }
            for n in counts
        ],
        "baseline_stages": base,
        "ratio_to_baseline": {str(n): round(medians[n] / medians[base], 3) for n in counts},
        "identical_tokens": all(outputs[n] == outputs[base] for n in counts),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for row in report["results"]:
            n = row["stages"]
            print(
                f"{n} stage(s): {row['tokens_per_second']:7.2f} tokens/s  "
                f"ratio {report['ratio_to_baseline'][str(n)]:.3f}"
            )
        print(f"identical tokens across stage counts: {report['identical_tokens']}")
    return 0
