"""``stagerun bench``: speculative against plain decoding over an emulated WAN, and one request
traced stage by stage."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..._driver._config import Mode
from ..._proto import SamplingParams
from ._common import bench_pipeline, say

if TYPE_CHECKING:
    from ... import telemetry
    from ..._driver._config import SpeculationConfig
    from ..._driver._pipeline import Pipeline
    from ...telemetry import Record
    from .._report import RequestsTimeline, Timeline

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
    if args.hop_delays and args.hop_delay_ms:
        raise ValueError("give either --hop-delay-ms or --hop-delays, not both")
    delays: list[float] = args.hop_delays or [args.hop_delay_ms]
    if args.png:
        from .._plots import require_matplotlib

        require_matplotlib()  # fail before minutes of measuring, not after
    results = [await _speculative_at(args, delay) for delay in delays]
    if len(results) == 1:
        report = results[0]
    else:
        common = ("benchmark", "model", "stages", "mode", "threads_per_stage", "window", "depth",
                  "tokens_per_prompt", "rounds", "prompts")  # fmt: skip
        report = {key: results[0][key] for key in common}
        report["sweep"] = [{k: v for k, v in row.items() if k not in common} for row in results]
    if args.png:
        from .._plots import plot_hop_sweep

        plot_hop_sweep(
            results,
            args.png,
            title=f"{args.stages} stages, window {args.window}, depth {args.depth}: "
            "tokens/s against hop delay",
        )
        say(args, f"wrote {args.png}")
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
    """The comparison at one hop delay: every configuration on every prompt, in rounds."""
    from ..._driver._config import SpeculationConfig

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
    tally = _SpeculativeTally([*configs, "always_wrong"])
    say(args, f"starting a {args.stages}-stage pipeline ({mode}, hop delay {hop_delay_ms} ms)")
    async with bench_pipeline(
        args, stages=args.stages, threads=threads, hop_delay_ms=hop_delay_ms
    ) as pipeline:
        await pipeline.complete("Hello", max_tokens=4, sampling=greedy)
        for round_index in range(args.rounds):
            for label, prompt in SPECULATIVE_PROMPTS.items():
                heading = f"round {round_index + 1} {label:9s}"
                await _compare_on_prompt(args, pipeline, prompt, configs, greedy, tally, heading)
    return _speculative_report(args, mode, hop_delay_ms, threads, tally)


class _SpeculativeTally:
    """Per configuration, summed over prompts and rounds: tokens, seconds, drafts accepted."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.tokens: dict[str, int] = dict.fromkeys(names, 0)
        self.seconds: dict[str, float] = dict.fromkeys(names, 0.0)
        self.accepted: dict[str, int] = dict.fromkeys(names, 0)
        self.proposed: dict[str, int] = dict.fromkeys(names, 0)
        self.identical = True

    def add(self, name: str, timings: Mapping[str, Any]) -> None:
        """Count one completion's decode (its first token is prefill's) and its drafts."""
        self.tokens[name] += max(int(timings["predicted_n"]) - 1, 0)
        self.seconds[name] += timings["predicted_ms"] / 1000.0
        self.accepted[name] += int(timings.get("speculative_accepted_n", 0))
        self.proposed[name] += int(timings.get("speculative_proposed_n", 0))

    def rates(self) -> dict[str, float]:
        """Decode tokens per second of each configuration (0 if it never ran)."""
        return {n: self.tokens[n] / self.seconds[n] if self.seconds[n] else 0.0 for n in self.names}


async def _compare_on_prompt(
    args: argparse.Namespace,
    pipeline: Pipeline,
    prompt: str,
    configs: dict[str, SpeculationConfig | None],
    greedy: SamplingParams,
    tally: _SpeculativeTally,
    heading: str,
) -> None:
    """Each configuration on ``prompt``, plain first; last, a drafter that is always wrong."""
    from ...drafters import OracleDrafter

    plain_ids: list[int] | None = None
    for name in tally.names:
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
        tally.identical &= result.token_ids == plain_ids
        tally.add(name, result.timings)
        rate = result.timings["predicted_per_second"]
        say(args, f"{heading} {name:12s} {rate:6.1f} tok/s")


def _speculative_report(
    args: argparse.Namespace,
    mode: Mode,
    hop_delay_ms: float,
    threads: int,
    tally: _SpeculativeTally,
) -> dict[str, Any]:
    """The JSON report of one hop delay's comparison."""
    names = tally.names
    rates = tally.rates()
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
        "acceptance": {
            n: round(tally.accepted[n] / tally.proposed[n], 3) for n in names if tally.proposed[n]
        },
        "ratios": {
            f"{deep}_vs_plain": round(rates[deep] / rates["plain"], 3),
            f"{deep}_vs_depth1": round(rates[deep] / rates["depth1"], 3),
            "depth1_vs_plain": round(rates["depth1"] / rates["plain"], 3),
            "always_wrong_vs_plain": round(rates["always_wrong"] / rates["plain"], 3),
        },
        "identical_output": tally.identical,
    }


# The prompts of ``bench timeline --requests N``: the first N, ``--prompt`` first of all.
TIMELINE_PROMPTS = {
    **SPECULATIVE_PROMPTS,
    "sort-list": "Copy this shopping list, one item per line, in alphabetical order: pears, "
    "bread, coffee, apples, milk, rice, butter, onions, tea, cheese, lemons, flour, eggs, "
    "carrots, honey, salt, yoghurt, beans, pasta and oranges.",
    "to-json": "Write this as a JSON list of objects with the keys name, city and age: Maria "
    "Lopez, 34, lives in Valencia. Tom Becker, 51, lives in Hamburg. Aiko Tanaka, 27, lives in "
    "Osaka. Samuel Okafor, 45, lives in Lagos. Ingrid Holm, 62, lives in Bergen.",
    "quote": "Quote the first two sentences of this passage exactly, then say who wrote it: "
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, "
    "his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly "
    "through the glass doors of Victory Mansions, though not quickly enough to prevent a "
    "swirl of gritty dust from entering along with him.",
}


async def bench_timeline(args: argparse.Namespace) -> int:
    """Trace speculative requests at the debug level and lay them out per stage.

    One request by default. ``--requests N`` runs N at once, on different prompts, and lays
    out all of them, a row per request on every stage: stages computing different requests
    at the same time, and one tick computing several, show as bars that line up.

    With ``--from-trace`` nothing runs: the request (``--request-id``, else the last one to
    finish), or the last N to finish (``--requests N``, or ``all``), are rebuilt from an
    existing debug trace, such as a served pipeline's.
    """
    from .._report import load_trace, request_timeline

    count = _timeline_count(args)
    if args.png:
        from .._plots import require_matplotlib

        require_matplotlib()
    report: dict[str, Any] = {"benchmark": "timeline"}
    setting = None  # how the pipeline ran, when this run ran it
    if args.from_trace:
        records = load_trace(args.from_trace)
        report["trace"] = str(args.from_trace)
    else:
        prompts = [args.prompt, *(name for name in TIMELINE_PROMPTS if name != args.prompt)]
        records = await _trace_requests(args, prompts[:count])
        report.update(
            model=str(args.model),
            mode="inproc" if args.inproc else "processes",
            hop_delay_ms=args.hop_delay_ms,
            depth=args.depth,
            window=args.window,
            prompt=args.prompt,
        )
        if count != 1:
            report["prompts"] = prompts[:count]
        setting = f"{args.stages} stages, hop delay {args.hop_delay_ms:g} ms, depth {args.depth}"
    if count == 1:
        request_id = args.request_id if args.from_trace else None
        _report_one(args, request_timeline(records, request_id), report, setting)
    else:
        _report_many(args, records, count, report, setting)
    return 0


def _timeline_count(args: argparse.Namespace) -> int | None:
    """How many requests to lay out (None: every request of the trace), checked first."""
    count: int | str = args.requests
    if args.request_id is not None and count != 1:
        raise ValueError("give either --request-id or --requests, not both")
    if count == "all":
        if not args.from_trace:
            raise ValueError("--requests all lays out the requests of a trace: add --from-trace")
        return None
    assert isinstance(count, int)
    if not args.from_trace and count > len(TIMELINE_PROMPTS):
        raise ValueError(f"--requests runs at most {len(TIMELINE_PROMPTS)}, one per prompt")
    return count


def _report_one(
    args: argparse.Namespace, timeline: Timeline, report: dict[str, Any], setting: str | None
) -> None:
    """Print (and draw) one request's timeline: per stage, each kind's milliseconds."""
    from .._plots import plot_timeline

    totals = timeline.totals()
    report.update(
        request_id=timeline.request_id,
        stages=timeline.stages,
        tokens=timeline.tokens,
        elapsed_ms=round(timeline.elapsed_ms, 2),
        verify_windows=timeline.windows,
        stale_windows=timeline.stale_windows,
        per_stage_ms=totals,
    )
    if args.png:
        if setting:
            title = f"one request, {setting}"
        else:
            title = f"request {timeline.request_id} on {timeline.stages} stages"
        title += f": {timeline.windows} verify windows, {timeline.stale_windows} stale"
        plot_timeline(timeline, args.png, title=title)
        say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"request: {timeline.tokens} tokens in {report['elapsed_ms']:.1f} ms, "
        f"{timeline.windows} verify windows, {timeline.stale_windows} stale"
    )
    for stage, row in enumerate(totals):
        print(
            f"stage {stage}: compute {row['compute']:8.1f} ms  write {row['write']:7.1f} ms  "
            f"wait {row['wait']:8.1f} ms  stale {row['stale']:7.1f} ms"
        )


def _report_many(
    args: argparse.Namespace,
    records: list[Record],
    count: int | None,
    report: dict[str, Any],
    setting: str | None,
) -> None:
    """Print (and draw) the last ``count`` requests to finish (None: all of them) together."""
    from .._plots import plot_requests_timeline
    from .._report import finished_requests, requests_timeline

    request_ids = finished_requests(records)
    if count is not None:
        if len(request_ids) < count:
            raise ValueError(
                f"the trace holds {len(request_ids)} finished requests, not {count}: "
                "ask for fewer, or for --requests all"
            )
        request_ids = request_ids[-count:]
    shared = requests_timeline(records, request_ids)
    report.update(_requests_report(shared))
    if args.png:
        title = f"{len(shared.timelines)} requests, {setting or f'{shared.stages} stages'}"
        plot_requests_timeline(shared, args.png, title=title)
        say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(report))
        return
    _print_requests(report)


def _print_requests(report: dict[str, Any]) -> None:
    """Several requests' report as text: each stage's busy time, then each request."""
    requests, elapsed = report["requests"], report["elapsed_ms"]
    print(f"{len(requests)} requests on {report['stages']} stages in {elapsed:.1f} ms")
    for stage, row in enumerate(report["per_stage_busy"]):
        busy, fraction = row["busy_ms"], row["busy_fraction"]
        print(f"stage {stage}: busy {busy:8.1f} ms ({fraction:6.1%} of the run)")
    for row in requests:
        print(
            f"request {row['request_id']}: {row['tokens']} tokens in {row['elapsed_ms']:.1f} ms "
            f"from {row['start_ms']:.1f} ms, {row['verify_windows']} verify windows, "
            f"{row['stale_windows']} stale"
        )


def _requests_report(shared: RequestsTimeline) -> dict[str, Any]:
    """The JSON of several requests: per stage its busy time (a union), then each request."""
    busy = zip(shared.busy_ms(), shared.busy_fractions(), strict=True)
    return {
        "stages": shared.stages,
        "elapsed_ms": round(shared.elapsed_ms, 2),
        "per_stage_busy": [{"busy_ms": ms, "busy_fraction": round(f, 4)} for ms, f in busy],
        "requests": [
            {
                "request_id": t.request_id,
                "tokens": t.tokens,
                "start_ms": round(t.start_ms, 2),
                "elapsed_ms": round(t.elapsed_ms, 2),
                "verify_windows": t.windows,
                "stale_windows": t.stale_windows,
                "per_stage_ms": t.totals(),
            }
            for t in shared.timelines
        ],
    }


async def _trace_requests(args: argparse.Namespace, prompts: list[str]) -> list[Record]:
    """Run the ``prompts`` (their names) at once, every process tracing at debug to one file."""
    from ... import telemetry
    from ..._driver._config import SpeculationConfig
    from .._report import load_trace

    mode = "inproc" if args.inproc else "processes"
    threads = args.threads if args.threads is not None else 1
    spec = SpeculationConfig("ngram", depth=args.depth, window=args.window)
    what = "one request" if len(prompts) == 1 else f"{len(prompts)} requests"
    with contextlib.ExitStack() as cleanup:
        trace = await _trace_path(args.trace, cleanup)
        tel = _trace_at_debug(trace, cleanup)
        say(
            args,
            f"tracing {what} on a {args.stages}-stage pipeline ({mode}, hop delay "
            f"{args.hop_delay_ms} ms, depth {args.depth}, window {args.window})",
        )
        async with (
            telemetry.draining(tel),
            bench_pipeline(
                args, stages=args.stages, threads=threads, hop_delay_ms=args.hop_delay_ms
            ) as pipeline,
        ):
            await pipeline.complete("Hello", max_tokens=4, speculation=spec)  # warm-up
            async with trio.open_nursery() as nursery:
                for name in prompts:
                    nursery.start_soon(
                        functools.partial(
                            pipeline.complete,
                            TIMELINE_PROMPTS[name],
                            chat=True,
                            max_tokens=args.tokens,
                            speculation=spec,
                        )
                    )
        if tel.dropped:
            say(args, f"warning: {tel.dropped} telemetry records were dropped")
        return load_trace(trace)


async def _trace_path(path: str | None, cleanup: contextlib.ExitStack) -> str:
    """Where this run's trace goes: ``path`` (emptied first), else a temporary file."""
    import tempfile

    if path is None:
        return cleanup.enter_context(tempfile.TemporaryDirectory()) + "/trace.jsonl"
    trace = str(await trio.Path(path).absolute())  # stage processes append here too
    await trio.Path(trace).unlink(missing_ok=True)  # the trace of this run only
    return trace


def _trace_at_debug(trace: str, cleanup: contextlib.ExitStack) -> telemetry.Telemetry:
    """Trace this process and the stage processes it starts at debug into ``trace``."""
    from ... import telemetry

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
    return tel


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
