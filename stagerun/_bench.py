"""``stagerun bench``: throughput measured side by side in one run.

These machines are noisy, so a benchmark never reports a lone number: every configuration is
open at the same time and measured in interleaved rounds, and the report gives ratios to the
baseline measured in the same run. The median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import signal
import statistics
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from ._errors import LaneError
from ._launch import Mode, open_pipeline
from ._pipeline import Pipeline
from ._proto import SamplingParams


async def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "decode":
        return await bench_decode(args)
    if args.bench_command == "speculative":
        return await bench_speculative(args)
    if args.bench_command == "transport":
        return await bench_transport(args)
    if args.bench_command == "backends":
        return await bench_backends(args)
    if args.bench_command == "recovery":
        return await bench_recovery(args)
    if args.bench_command == "load":
        return await bench_load(args)
    if args.bench_command == "prefill":
        return await bench_prefill(args)
    if args.bench_command == "timeline":
        return await bench_timeline(args)
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
                    transport=args.transport,
                    transports=args.transports,
                    backend=args.backend,
                    backends=args.backends,
                    device=args.device,
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


SPECULATIVE_PROMPTS = {
    "repeat": "Repeat the following text exactly, word for word: The lighthouse keeper climbed "
    "the one hundred and twelve stairs every evening, wound the clockwork, trimmed the wick and "
    "lit the great lamp that warned the fishing boats away from the rocks. In winter the storms "
    "came in from the west, and the waves broke so high against the tower that salt crusted the "
    "windows of the lamp room. He kept a logbook of every ship that passed, every gale and every "
    "night the fog horn sounded, and after forty years the logbooks filled a whole shelf in the "
    "kitchen below.",
    "rewrite": "Rewrite this paragraph in the past tense, changing nothing else: I walk to the "
    "market every morning. I buy fresh bread and a bag of apples, and I talk with the baker "
    "about the weather. Then I carry everything home along the river. The ducks follow me for a "
    "while because they hope for crumbs, and I always give them the last piece of the loaf. At "
    "home I make coffee, read the newspaper and write a letter to my sister, who lives by the "
    "sea.",
    "code-edit": "Rename the variable total to subtotal in this Python function and show the "
    "complete function:\n\ndef order_total(items, tax_rate, discount):\n    total = 0\n"
    "    for item in items:\n        if item.quantity <= 0:\n            continue\n"
    "        total += item.price * item.quantity\n    if discount:\n"
    "        total = total - discount\n    total = total * (1 + tax_rate)\n"
    "    return round(total, 2)\n",
}


async def bench_speculative(args: argparse.Namespace) -> int:
    """Plain vs depth 1 vs depth D on input-grounded prompts, over an emulated WAN link.

    With ``--hop-delays`` the comparison runs once per delay (a pipeline each; the ratios are
    side by side within each delay) and ``--png`` draws tokens/s against the delay.
    """
    delays: list[float] = args.hop_delays or [args.hop_delay_ms]
    if args.png:
        from ._report import require_matplotlib

        require_matplotlib()  # fail before minutes of measuring, not after
    results = [await _speculative_at(args, delay) for delay in delays]
    if len(results) == 1:
        report = results[0]
    else:
        common = ("benchmark", "model", "stages", "mode", "threads_per_stage", "window", "depth",
                  "tokens_per_prompt", "rounds", "prompts")  # fmt: skip
        report = {key: results[0][key] for key in common}
        report["sweep"] = [
            {key: row[key] for key in row if key not in common or key == "benchmark"}
            for row in results
        ]
        for row in report["sweep"]:
            row.pop("benchmark")
    if args.png:
        from ._report import plot_hop_sweep

        plot_hop_sweep(
            results,
            args.png,
            title=f"{args.stages} stages, window {args.window}, depth {args.depth}: "
            "tokens/s against hop delay",
        )
        _say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(report))
        return 0
    for row in results:
        if len(results) > 1:
            print(f"hop delay {row['hop_delay_ms']:g} ms")
        for name, rate in row["tokens_per_second"].items():
            print(f"  {name:12s} {rate:7.2f} tokens/s")
        for key, value in row["ratios"].items():
            print(f"  {key:24s} {value:.3f}")
        print(f"  identical output: {row['identical_output']}")
    return 0


async def _speculative_at(args: argparse.Namespace, hop_delay_ms: float) -> dict[str, Any]:
    from ._speculative import SpeculationConfig
    from .drafters import OracleDrafter

    mode: Mode = "inproc" if args.inproc else "processes"
    # One compute thread per stage unless told otherwise: stages here share the machine's
    # cores, and a multi-threaded BLAS whose workers fall asleep during every hop delay paid
    # about 7 ms per forward to wake them (measured: 14.4 vs 7.6 ms on stage 0).
    threads = args.threads if args.threads is not None else 1
    greedy = SamplingParams()
    configs = {
        "plain": None,
        "depth1": SpeculationConfig("ngram", depth=1, window=args.window),
        f"depth{args.depth}": SpeculationConfig("ngram", depth=args.depth, window=args.window),
    }
    names = [*configs, "always_wrong"]
    tokens: dict[str, int] = dict.fromkeys(names, 0)
    seconds: dict[str, float] = dict.fromkeys(names, 0.0)
    accepted: dict[str, int] = dict.fromkeys(names, 0)
    proposed: dict[str, int] = dict.fromkeys(names, 0)
    identical = True
    _say(args, f"starting a {args.stages}-stage pipeline ({mode}, hop delay {hop_delay_ms} ms)")
    async with open_pipeline(
        args.model,
        stages=args.stages,
        mode=mode,
        threads=threads,
        hop_delay_ms=hop_delay_ms,
        transport=args.transport,
        transports=args.transports,
        backend=args.backend,
        backends=args.backends,
        device=args.device,
    ) as pipeline:
        await pipeline.complete("Hello", max_tokens=4, sampling=greedy)
        for round_index in range(args.rounds):
            for label, prompt in SPECULATIVE_PROMPTS.items():
                plain_ids: list[int] | None = None
                for name in names:
                    drafter = None
                    spec = configs.get(name)
                    if name == "always_wrong":
                        assert plain_ids is not None
                        ids = pipeline.encode_prompt(prompt, chat=True)
                        drafter = OracleDrafter(
                            ids + plain_ids, error_rate=1.0, vocab_size=pipeline.config.vocab_size
                        )
                        spec = configs[f"depth{args.depth}"]
                    result = await pipeline.complete(
                        prompt,
                        chat=True,
                        max_tokens=args.tokens,
                        sampling=greedy,
                        speculation=spec,
                        drafter=drafter,
                    )
                    if plain_ids is None:
                        plain_ids = result.token_ids
                    identical &= result.token_ids == plain_ids
                    t = result.timings
                    tokens[name] += max(int(t["predicted_n"]) - 1, 0)
                    seconds[name] += t["predicted_ms"] / 1000.0
                    accepted[name] += int(t.get("speculative_accepted_n", 0))
                    proposed[name] += int(t.get("speculative_proposed_n", 0))
                    rate = t["predicted_per_second"]
                    _say(args, f"round {round_index + 1} {label:9s} {name:12s} {rate:6.1f} tok/s")
    rates = {n: tokens[n] / seconds[n] if seconds[n] else 0.0 for n in names}
    deep = f"depth{args.depth}"
    return {
        "benchmark": "speculative",
        "model": str(args.model),
        "stages": args.stages,
        "mode": mode,
        "hop_delay_ms": hop_delay_ms,
        "threads_per_stage": threads,
        "window": args.window,
        "depth": args.depth,
        "tokens_per_prompt": args.tokens,
        "rounds": args.rounds,
        "prompts": list(SPECULATIVE_PROMPTS),
        "tokens_per_second": {n: round(r, 2) for n, r in rates.items()},
        "acceptance": {n: round(accepted[n] / proposed[n], 3) for n in names if proposed[n]},
        "ratios": {
            f"{deep}_vs_plain": round(rates[deep] / rates["plain"], 3),
            f"{deep}_vs_depth1": round(rates[deep] / rates["depth1"], 3),
            "depth1_vs_plain": round(rates["depth1"] / rates["plain"], 3),
            "always_wrong_vs_plain": round(rates["always_wrong"] / rates["plain"], 3),
        },
        "identical_output": identical,
    }


async def bench_timeline(args: argparse.Namespace) -> int:
    """Trace one speculative request at the debug level and lay it out per stage."""
    import tempfile

    from . import telemetry
    from ._report import load_trace, plot_timeline, request_timeline
    from ._speculative import SpeculationConfig

    if args.png:
        from ._report import require_matplotlib

        require_matplotlib()
    mode: Mode = "inproc" if args.inproc else "processes"
    threads = args.threads if args.threads is not None else 1
    spec = SpeculationConfig("ngram", depth=args.depth, window=args.window)
    prompt = SPECULATIVE_PROMPTS[args.prompt]
    with contextlib.ExitStack() as cleanup:
        trace = args.trace
        if trace is None:
            trace = cleanup.enter_context(tempfile.TemporaryDirectory()) + "/trace.jsonl"
        else:
            trace = str(await trio.Path(trace).absolute())  # stage processes append here too
            await trio.Path(trace).unlink(missing_ok=True)  # the trace of this run only
        # Stage processes read their telemetry settings from the environment they inherit.
        saved = {k: os.environ.get(k) for k in ("STAGERUN_TELEMETRY", "STAGERUN_TELEMETRY_JSONL")}
        os.environ.update(STAGERUN_TELEMETRY="debug", STAGERUN_TELEMETRY_JSONL=trace)
        cleanup.callback(_restore_env, saved)
        tel = telemetry.Telemetry(
            "debug", [telemetry.JsonLinesSink(trace)], capacity=1 << 16,
            common={"stagerun.stage_id": 0},
        )  # fmt: skip
        previous = telemetry.set_current(tel)
        cleanup.callback(telemetry.set_current, previous)
        _say(
            args,
            f"tracing one request on a {args.stages}-stage pipeline ({mode}, hop delay "
            f"{args.hop_delay_ms} ms, depth {args.depth}, window {args.window})",
        )
        async with (
            telemetry.draining(tel),
            open_pipeline(
                args.model,
                stages=args.stages,
                mode=mode,
                threads=threads,
                hop_delay_ms=args.hop_delay_ms,
                transport=args.transport,
                transports=args.transports,
                backend=args.backend,
                backends=args.backends,
                device=args.device,
            ) as pipeline,
        ):
            await pipeline.complete("Hello", max_tokens=4, speculation=spec)  # warm-up
            result = await pipeline.complete(
                prompt, chat=True, max_tokens=args.tokens, speculation=spec
            )
        if tel.dropped:
            _say(args, f"warning: {tel.dropped} telemetry records were dropped")
        timeline = request_timeline(load_trace(trace))
    totals = timeline.totals()
    report: dict[str, Any] = {
        "benchmark": "timeline",
        "model": str(args.model),
        "stages": args.stages,
        "mode": mode,
        "hop_delay_ms": args.hop_delay_ms,
        "depth": args.depth,
        "window": args.window,
        "prompt": args.prompt,
        "tokens": len(result.token_ids),
        "elapsed_ms": round(timeline.elapsed_ms, 2),
        "verify_windows": timeline.windows,
        "stale_windows": timeline.stale_windows,
        "per_stage_ms": totals,
    }
    if args.png:
        plot_timeline(
            timeline,
            args.png,
            title=f"one request, {args.stages} stages, hop delay {args.hop_delay_ms:g} ms, "
            f"depth {args.depth}: {timeline.windows} verify windows, "
            f"{timeline.stale_windows} stale",
        )
        _say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"request: {report['tokens']} tokens in {report['elapsed_ms']:.1f} ms, "
        f"{timeline.windows} verify windows, {timeline.stale_windows} stale"
    )
    for stage, row in enumerate(totals):
        print(
            f"stage {stage}: compute {row['compute']:8.1f} ms  write {row['write']:7.1f} ms  "
            f"wait {row['wait']:8.1f} ms  stale {row['stale']:7.1f} ms"
        )
    return 0


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


async def _echo(stream: Any, peer: str) -> None:
    from ._framed import server_handshake

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
    import time

    import numpy as np
    import trio

    from . import _proto, plugins
    from ._framed import client_handshake

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
    greedy = SamplingParams()
    round_trip = {n: await frame_round_trip_us(n, args.iterations) for n in names}
    for name, us in round_trip.items():
        _say(args, f"{name}: one-token frame round trip {us:.1f} us")
    samples: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[int]] = {}
    async with AsyncExitStack() as stack:
        pipelines: dict[str, Pipeline] = {}
        for name in names:
            _say(args, f"starting a {args.stages}-stage pipeline over {name} ({mode})")
            pipelines[name] = await stack.enter_async_context(
                open_pipeline(
                    args.model,
                    stages=args.stages,
                    mode=mode,
                    threads=args.threads,
                    transport=name,
                )
            )
        for pipeline in pipelines.values():
            await pipeline.complete(args.prompt, max_tokens=8, sampling=greedy, ignore_eog=True)
        for round_index in range(args.rounds):
            for name, pipeline in pipelines.items():
                result = await pipeline.complete(
                    args.prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True
                )
                rate = result.timings["predicted_per_second"]
                samples[name].append(rate)
                outputs.setdefault(name, result.token_ids)
                _say(args, f"round {round_index + 1} {name:6s} {rate:6.1f} tok/s")
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
    import time

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
    import trio

    from . import plugins
    from .model import open_model

    model = open_model(args.model)
    prompt = model.tokenizer.encode(args.prompt)
    installed = [n for n in plugins.names("backends") if n != "fake"]  # fake: tests only
    names: list[str] = list(args.backends_to_compare or installed)
    sizes = [1, 4, 8]
    costs: dict[str, dict[int, float]] = {}
    for name in names:
        _say(args, f"loading {name}")
        backend = await trio.to_thread.run_sync(
            functools.partial(plugins.backend(name), model, None, threads=args.threads)
        )
        await trio.to_thread.run_sync(_window_costs, backend, prompt, sizes, 1)  # warm-up
        costs[name] = await trio.to_thread.run_sync(
            _window_costs, backend, prompt, sizes, args.rounds
        )
        c = costs[name]
        _say(args, f"{name}: " + ", ".join(f"T={t} {c[t]:.1f} ms" for t in sizes))
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


async def bench_recovery(args: argparse.Namespace) -> int:
    """Kill a stage process mid-generation and time each part of the recovery.

    Per round: one undisturbed greedy generation, then the same with ``kill -9`` of stage
    ``--victim`` after ``--kill-at`` tokens. Reported: detection (kill to the failure seen
    by stage 0), wait (failure to a working lane again: the supervisor's backoff plus the
    restarted process's start-up), replay (the committed tokens prefilled again, up to the
    next token), the longest gap between two tokens the client saw, and whether the output
    was identical.
    """
    if not 1 <= args.victim < args.stages:
        raise ValueError(f"--victim must name one of stages 1..{args.stages - 1}")
    if not 0 < args.kill_at < args.tokens:
        raise ValueError("--kill-at must fall inside the generation (0 < kill-at < tokens)")
    greedy = SamplingParams()
    prompt = "Once upon a time, in a lighthouse by the sea,"
    rounds: list[dict[str, Any]] = []
    async with open_pipeline(
        args.model,
        stages=args.stages,
        mode="processes",
        threads=args.threads,
        wire_dtype=args.wire_dtype,
        transport=args.transport,
        backend=args.backend,
    ) as pipeline:
        for index in range(args.rounds):
            want = await pipeline.complete(
                prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True
            )
            killer = _KillAt(pipeline.stages[args.victim].process, args.kill_at)
            got = await pipeline.complete(
                prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True, on_token=killer
            )
            t = got.timings
            gap_ms = max(b - a for a, b in itertools.pairwise(killer.stamps)) * 1000.0
            wait_ms = float(t.get("recovery_wait_ms", 0.0))
            replay_ms = float(t.get("recovery_replay_ms", 0.0))
            row = {
                "identical": got.token_ids == want.token_ids,
                "recoveries": int(t.get("recoveries", 0)),
                "detect_ms": max(gap_ms - wait_ms - replay_ms, 0.0),
                "wait_ms": wait_ms,
                "replay_ms": replay_ms,
                "replayed_tokens": len(got.prompt_token_ids) + args.kill_at,
                "max_gap_ms": gap_ms,
                "normal_step_ms": want.timings["predicted_ms"] / max(len(want.token_ids) - 1, 1),
            }
            rounds.append(row)
            _say(
                args,
                f"round {index + 1}: detect {row['detect_ms']:.0f} ms, wait {wait_ms:.0f} ms, "
                f"replay {replay_ms:.0f} ms ({row['replayed_tokens']} tokens), "
                f"longest gap {gap_ms:.0f} ms, identical {row['identical']}",
            )
    report = {
        "benchmark": "recovery",
        "model": args.model,
        "stages": args.stages,
        "victim": args.victim,
        "tokens": args.tokens,
        "kill_at": args.kill_at,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key in ("detect_ms", "wait_ms", "replay_ms", "max_gap_ms", "normal_step_ms"):
            values = sorted(r[key] for r in rounds)
            print(f"{key:15s} median {values[len(values) // 2]:8.1f}  max {values[-1]:8.1f}")
        print(f"identical output in {sum(r['identical'] for r in rounds)}/{len(rounds)} rounds")
    return 0 if all(r["identical"] and r["recoveries"] == 1 for r in rounds) else 1


class _KillAt:
    """A token callback that records arrival times and kills a process at the n-th token."""

    def __init__(self, process: Any, n: int) -> None:
        self.process, self.n = process, n
        self.stamps: list[float] = []

    def __call__(self, chunk: Any) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == self.n:
            os.kill(self.process.pid, signal.SIGKILL)


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants in MiB (Linux ``/proc``; else 0)."""
    import collections
    import pathlib

    if not os.path.isdir("/proc"):
        return 0.0
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = pathlib.Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024.0


async def _post(host: str, port: int, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 POST on its own connection (h11); the status and the whole body."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        request = h11.Request(
            method="POST",
            target=path,
            headers=[
                ("Host", f"{host}:{port}"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Connection", "close"),
            ],
        )
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=body)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status, chunks = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(chunks)


async def bench_load(args: argparse.Namespace) -> int:
    """``--clients`` concurrent clients send ``--requests`` requests to a fresh ``serve``.

    Every request must complete (200) or be turned away (429); another status is reported as
    such, and no answer within two minutes counts as lost. Half the requests stream. Reports
    the outcomes, latencies and the resident memory of the server and its stages after a
    warm-up round and at the end.
    """
    import subprocess

    from .server._serve import served_model_id

    model_id = served_model_id(args.model)
    cmd = [
        sys.executable, "-m", "stagerun", "serve", "--port", "0",
        "--model", args.model, "--stages", str(args.stages),
        "--parallel", str(args.parallel), "--max-queue", str(args.max_queue),
    ]  # fmt: skip
    _say(args, "starting " + " ".join(cmd[2:]))
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(300):
            while b"\n" not in line:
                data = await proc.stdout.receive_some(4096)
                if not data:
                    raise RuntimeError("stagerun serve exited before it listened")
                line += data
        url = line.decode().split("listening on ", 1)[1].split()[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        outcomes: dict[str, int] = {}
        latencies: list[float] = []

        async def client(index: int, todo: list[int]) -> None:
            while todo:
                n = todo.pop()
                body = json.dumps(
                    {"model": model_id, "prompt": f"Request {n} from client {index}:",
                     "max_tokens": args.max_tokens, "temperature": 0, "stream": n % 2 == 0}
                ).encode()  # fmt: skip
                start = time.perf_counter()
                try:
                    with trio.fail_after(120):
                        status, _ = await _post(host, int(port), "/v1/completions", body)
                except (trio.TooSlowError, OSError, trio.BrokenResourceError):
                    status = 0
                latencies.append(time.perf_counter() - start)
                key = {200: "ok", 429: "429", 0: "lost"}.get(status, f"http {status}")
                outcomes[key] = outcomes.get(key, 0) + 1
                if status == 429:
                    await trio.sleep(0.1)

        async def run(count: int) -> None:
            todo = list(range(count))
            async with trio.open_nursery() as nursery:
                for index in range(args.clients):
                    nursery.start_soon(client, index, todo)

        await run(args.clients)
        warm = process_tree_rss_mb(proc.pid)
        outcomes.clear()
        latencies.clear()
        started = time.perf_counter()
        await run(args.requests)
        elapsed = time.perf_counter() - started
        after = process_tree_rss_mb(proc.pid)
    finally:
        proc.terminate()
        with trio.move_on_after(30):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    ordered = sorted(latencies)
    report = {
        "benchmark": "load",
        "requests": args.requests,
        "clients": args.clients,
        "outcomes": outcomes,
        "seconds": elapsed,
        "latency_p50_s": ordered[len(ordered) // 2],
        "latency_max_s": ordered[-1],
        "rss_warm_mib": warm,
        "rss_after_mib": after,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.requests} requests, {args.clients} clients, {elapsed:.1f}s: {outcomes}; "
            f"latency p50 {report['latency_p50_s']:.2f}s max {report['latency_max_s']:.2f}s; "
            f"RSS {warm:.0f} -> {after:.0f} MiB"
        )
    return 0 if set(outcomes) <= {"ok", "429"} else 1


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
        pipelines: dict[tuple[int, str], Pipeline] = {}
        for n in counts:
            for policy in policies:
                name, _, mode_text = policy.partition("/")
                chunking = 1_000_000 if name == "unchunked" else name
                credit = 1 if mode_text == "serial" else 3
                _say(args, f"starting {n} stages, prefill {policy}")
                pipelines[n, policy] = await stack.enter_async_context(
                    open_pipeline(
                        args.model,
                        stages=n,
                        mode="inproc" if args.inproc else "processes",
                        threads=threads,
                        wire_dtype=args.wire_dtype,
                        hop_delay_ms=args.hop_delay_ms,
                        prefill_chunk=chunking,
                        prefill_credit=credit,
                        transport=args.transport,
                        backend=args.backend,
                    )
                )
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
                _say(
                    args,
                    f"round {round_index + 1}: {key[0]} stages, {key[1]}: time to first token "
                    f"{result.timings['prompt_ms']:.0f} ms in {len(chunk_sizes.get(key, []))} "
                    "chunks",
                )
    rows = []
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
                f"{row['ttft_ms']:8.1f} ms  ({row['reduction_vs_baseline']:+.1%} vs "
                f"{policies[0]}; chunks {row['chunks']})"
            )
    return 0
