"""``stagerun bench``: decode throughput per stage count, lane transports and compute backends."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from ..._driver._config import Mode
from ..._driver._pipeline import Pipeline
from ..._errors import LaneError
from ..._launch import open_pipeline
from ._common import bench_pipeline, decode_rounds, say


async def bench_decode(args: argparse.Namespace) -> int:
    """Decode tokens/s for each stage count, greedy, same prompt, interleaved rounds."""
    counts: list[int] = args.stages
    mode: Mode = "inproc" if args.inproc else "processes"
    async with AsyncExitStack() as stack:
        pipelines: dict[int, Pipeline] = {}
        for n in counts:
            say(args, f"starting a {n}-stage pipeline ({mode})")
            pipelines[n] = await stack.enter_async_context(
                bench_pipeline(args, stages=n, mode=mode)
            )
        samples, outputs = await decode_rounds(args, pipelines, "{} stage(s)")
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


async def _echo(stream: Any, peer: str) -> None:
    from ..._wire._framed import server_handshake

    framed, _hello = await server_handshake(stream, peer=peer)
    try:
        while True:
            frame = await framed.receive()
            await framed.send(frame.message, frame.activations)
    except LaneError:
        pass
    finally:
        await framed.aclose_forcefully()


async def frame_round_trip_us(name: str, iterations: int, d_model: int = 576) -> float:
    """Median microseconds to send a one-token f32 decode frame and get it back, on loopback."""

    import numpy as np
    import trio

    from ... import _proto, plugins
    from ..._wire._framed import client_handshake

    transport = plugins.transport(name)
    activation = np.ones((1, d_model), np.float32)
    message = _proto.Decode(request_id=1, position=0, tokens=(1,))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(transport.serve, transport.local_address("127.0.0.1"), _echo)
        )
        stream = await transport.connect(address, timeout=10)
        framed = await client_handshake(
            stream, peer=address, role=_proto.Role.LANE, ready_timeout=10
        )
        times = []
        for i in range(iterations + 50):
            start = time.perf_counter()
            await framed.send(message, activation)
            await framed.receive()
            if i >= 50:  # warm-up
                times.append(time.perf_counter() - start)
        await framed.aclose_forcefully()
        nursery.cancel_scope.cancel()
    return statistics.median(times) * 1e6


async def bench_transport(args: argparse.Namespace) -> int:
    """Frame round trip per transport, and decode tokens/s over each, side by side."""
    names: list[str] = list(args.transports_to_compare)
    mode: Mode = "inproc" if args.inproc else "processes"
    round_trip = {n: await frame_round_trip_us(n, args.iterations) for n in names}
    for name, us in round_trip.items():
        say(args, f"{name}: one-token frame round trip {us:.1f} us")
    async with AsyncExitStack() as stack:
        pipelines: dict[str, Pipeline] = {}
        for name in names:
            say(args, f"starting a {args.stages}-stage pipeline over {name} ({mode})")
            pipelines[name] = await stack.enter_async_context(
                open_pipeline(
                    args.model,
                    stages=args.stages,
                    mode=mode,
                    threads=args.threads,
                    transport=name,
                )
            )
        samples, outputs = await decode_rounds(args, pipelines)
    rates = {n: statistics.median(v) for n, v in samples.items()}
    base = names[0]
    report = {
        "benchmark": "transport",
        "stages": args.stages,
        "mode": mode,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "frame_round_trip_us": {n: round(v, 1) for n, v in round_trip.items()},
        "tokens_per_second": {n: round(v, 2) for n, v in rates.items()},
        "ratio_to_" + base: {n: round(rates[n] / rates[base], 3) for n in names},
        "identical_tokens": all(o == outputs[base] for o in outputs.values()),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for name in names:
            print(
                f"{name:6s} round trip {round_trip[name]:8.1f} us   decode {rates[name]:6.2f} "
                f"tokens/s   {rates[name] / rates[base]:.3f}x {base}"
            )
        print(f"identical tokens: {report['identical_tokens']}")
    return 0


def _window_costs(
    backend: Any, prompt: list[int], sizes: list[int], rounds: int
) -> dict[int, float]:
    """Median ms of one forward of T new tokens after the prompt, for each T (blocking)."""

    cache = backend.new_cache()
    backend.forward(cache, 0, tokens=prompt)
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(rounds):
        for t in sizes:
            window = prompt[:t]
            start = time.perf_counter()
            backend.forward(cache, len(prompt), tokens=window, logits="all")
            times[t].append((time.perf_counter() - start) * 1000.0)
    return {t: statistics.median(v) for t, v in times.items()}


async def bench_backends(args: argparse.Namespace) -> int:
    """Decode tokens/s and verify-window cost (T = 1, 4, 8) per backend, the whole model."""

    from ... import plugins
    from ...model import open_model

    model = open_model(args.model)
    prompt = model.tokenizer.encode(args.prompt)
    installed = [n for n in plugins.names("backends") if n != "fake"]  # fake: tests only
    names: list[str] = list(args.backends_to_compare or installed)
    sizes = [1, 4, 8]
    costs: dict[str, dict[int, float]] = {}
    for name in names:
        say(args, f"loading {name}")
        backend = await trio.to_thread.run_sync(
            functools.partial(plugins.backend(name), model, None, threads=args.threads)
        )
        await trio.to_thread.run_sync(_window_costs, backend, prompt, sizes, 1)  # warm-up
        costs[name] = await trio.to_thread.run_sync(
            _window_costs, backend, prompt, sizes, args.rounds
        )
        c = costs[name]
        say(args, f"{name}: " + ", ".join(f"T={t} {c[t]:.1f} ms" for t in sizes))
    base = names[0]
    report = {
        "benchmark": "backends",
        "model": str(args.model),
        "threads": args.threads,
        "rounds": args.rounds,
        "forward_ms": {n: {str(t): round(v, 2) for t, v in c.items()} for n, c in costs.items()},
        "decode_tokens_per_second": {n: round(1000.0 / c[1], 2) for n, c in costs.items()},
        "window_cost_vs_one_token": {
            n: {str(t): round(c[t] / c[1], 3) for t in sizes} for n, c in costs.items()
        },
        "speed_vs_" + base: {
            n: {str(t): round(costs[base][t] / c[t], 3) for t in sizes} for n, c in costs.items()
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        for name, c in costs.items():
            cells = "  ".join(f"T={t}: {c[t]:7.1f} ms ({c[t] / c[1]:.2f}x)" for t in sizes)
            print(f"{name:10s} {1000.0 / c[1]:6.1f} tok/s   {cells}")
    return 0
