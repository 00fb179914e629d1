"""``stagerun bench prefill``: time to first token, one unchunked prefill against planned chunks."""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import AsyncExitStack
from typing import Any

from ..._driver._pipeline import Pipeline
from ._common import bench_pipeline, say
from ._speculative import SPECULATIVE_PROMPTS


def _prefill_prompt(pipeline: Pipeline, tokens: int) -> list[int]:
    """A prompt of exactly ``tokens`` ids made of ordinary prose."""
    text = " ".join(SPECULATIVE_PROMPTS.values())
    ids: list[int] = []
    while len(ids) < tokens:
        ids += pipeline.tokenizer.encode(text)
    return ids[:tokens]


async def bench_prefill(args: argparse.Namespace) -> int:
    """Time to first token for each stage count and prefill policy, interleaved rounds.

    ``unchunked`` sends the whole prompt as one chunk (every stage waits for the stage before
    it to finish all of it); the other policies cut it into chunks that stream through the
    stages, up to 3 unacknowledged, or one at a time with a ``/serial`` suffix
    (``128/serial``: chunked, not pipelined). Each stage process gets ``--threads`` compute threads
    (default 1: one device each).
    """
    threads = args.threads or 1
    policies: list[str] = list(args.policies)
    counts: list[int] = args.stages
    ttft: dict[tuple[int, str], list[float]] = {(n, p): [] for n in counts for p in policies}
    tokens: dict[tuple[int, str], list[int]] = {}
    chunk_sizes: dict[tuple[int, str], list[int]] = {}
    async with AsyncExitStack() as stack:
        pipelines = await _start_pipelines(args, stack, counts, policies, threads)
        prompt = _prefill_prompt(next(iter(pipelines.values())), args.prompt_tokens)
        for pipeline in pipelines.values():  # warm-up, and a first transport estimate
            await pipeline.complete(prompt, max_tokens=2, ignore_eog=True)
        for round_index in range(args.rounds):
            for key, pipeline in pipelines.items():
                result = await pipeline.complete(prompt, max_tokens=2, ignore_eog=True)
                ttft[key].append(result.timings["prompt_ms"])
                tokens.setdefault(key, result.token_ids)
                if pipeline.last_prefill is not None:
                    chunk_sizes[key] = pipeline.last_prefill.sizes
                say(
                    args,
                    f"round {round_index + 1}: {key[0]} stages, {key[1]}: time to first token "
                    f"{result.timings['prompt_ms']:.0f} ms in {len(chunk_sizes.get(key, []))} "
                    "chunks",
                )
    rows = _prefill_rows(counts, policies, ttft, tokens, chunk_sizes)
    report = {
        "benchmark": "prefill",
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "hop_delay_ms": args.hop_delay_ms,
        "threads_per_stage": threads,
        "rounds": args.rounds,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for row in rows:
            print(
                f"{row['stages']} stages  {row['policy']:10s} time to first token "
                f"{row['ttft_ms']:8.1f} ms  ({-row['reduction_vs_baseline']:+.1%} vs "
                f"{policies[0]}; chunks {row['chunks']})"
            )
    return 0


async def _start_pipelines(
    args: argparse.Namespace,
    stack: AsyncExitStack,
    counts: list[int],
    policies: list[str],
    threads: int,
) -> dict[tuple[int, str], Pipeline]:
    """A pipeline per stage count and prefill policy, each closed when ``stack`` is."""
    pipelines: dict[tuple[int, str], Pipeline] = {}
    for n in counts:
        for policy in policies:
            name, _, mode_text = policy.partition("/")
            chunking = 1_000_000 if name == "unchunked" else name
            credit = 1 if mode_text == "serial" else 3
            say(args, f"starting {n} stages, prefill {policy}")
            pipelines[n, policy] = await stack.enter_async_context(
                bench_pipeline(
                    args,
                    stages=n,
                    threads=threads,
                    hop_delay_ms=args.hop_delay_ms,
                    prefill_chunk=chunking,
                    prefill_credit=credit,
                )
            )
    return pipelines


def _prefill_rows(
    counts: list[int],
    policies: list[str],
    ttft: dict[tuple[int, str], list[float]],
    tokens: dict[tuple[int, str], list[int]],
    chunk_sizes: dict[tuple[int, str], list[int]],
) -> list[dict[str, Any]]:
    """One result row per stage count and policy, against the first policy as the baseline."""
    rows: list[dict[str, Any]] = []
    for n in counts:
        base = statistics.median(ttft[n, policies[0]])
        for policy in policies:
            median = statistics.median(ttft[n, policy])
            rows.append(
                {
                    "stages": n,
                    "policy": policy,
                    "ttft_ms": round(median, 1),
                    "samples_ms": [round(x, 1) for x in ttft[n, policy]],
                    "reduction_vs_baseline": round(1.0 - median / base, 3),
                    "chunks": chunk_sizes.get((n, policy), []),
                    "same_tokens": tokens[n, policy] == tokens[n, policies[0]],
                }
            )
    return rows
