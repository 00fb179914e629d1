"""``stagerun bench chat``: a scripted multi-turn conversation, prefix cache on against off.

Every turn's prompt is the whole conversation so far (a long system prompt, then the turns),
so without a prefix cache every turn prefills all of it again through every stage; with it,
a turn prefills only what the previous turn did not compute. Two pipelines run side by side
in one process, one with the cache and one without, turn by turn; with ``--clients N``, N
users hold their own conversations at once over the same system prompt (a shared prefix
across requests as well as within each conversation). ``--stagger-ms`` has the users arrive
one after another for their first turn, so later ones find the system prompt cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio

from ..._driver._pipeline import Pipeline
from ..._driver._values import prefix_cache_json
from ..._proto import SamplingParams
from ._common import bench_pipeline, say
from ._speculative import SPECULATIVE_PROMPTS

# What users ask, turn by turn (a client c starts at question c, so conversations differ).
QUESTIONS = (
    "Summarise the notes above in two sentences.",
    "Which of the stories did you like best, and why?",
    "Write a short poem about the lighthouse keeper.",
    "Now tell me what the baker and the narrator talked about.",
    "Give three questions a teacher could ask about these stories.",
    "Answer the first of those questions.",
    "Describe the market in the morning in your own words.",
    "What would the sister write back in her letter?",
)


def system_prompt(pipeline: Pipeline, tokens: int) -> str:
    """About ``tokens`` tokens of instructions and reference notes (ordinary prose)."""
    head = "You are a helpful assistant. Answer questions about these reference notes.\n\n"
    text = head
    body = "\n\n".join(SPECULATIVE_PROMPTS.values())
    while len(pipeline.tokenizer.encode(text)) < tokens:
        text += body + "\n\n"
    ids = pipeline.tokenizer.encode(text)[:tokens]
    return pipeline.tokenizer.decode(ids)


class Conversation:
    """One user's chat: the messages so far, and what each turn measured."""

    def __init__(self, system: str, first_question: int) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.first_question = first_question
        self.ttft_ms: list[float] = []
        self.cached: list[int] = []
        self.prompt_tokens: list[int] = []
        self.outputs: list[list[int]] = []
        self.template_prefix: list[bool] = []  # turn n+1's prompt starts with turn n's + answer
        self.generated = 0
        self._previous: list[int] | None = None

    async def turn(
        self, pipeline: Pipeline, index: int, max_tokens: int, delay: float = 0.0
    ) -> None:
        await trio.sleep(delay)  # arrives this much later (not counted in its times)
        question = QUESTIONS[(self.first_question + index) % len(QUESTIONS)]
        self.messages.append({"role": "user", "content": question})
        prompt = pipeline.apply_chat_template(self.messages)
        if self._previous is not None:
            self.template_prefix.append(prompt[: len(self._previous)] == self._previous)
        result = await pipeline.complete(prompt, max_tokens=max_tokens, sampling=SamplingParams())
        self.ttft_ms.append(result.timings["prompt_ms"])
        self.cached.append(int(result.timings.get("prefix_cached_tokens", 0)))
        self.prompt_tokens.append(len(prompt))
        self.outputs.append(result.token_ids)
        self.generated += len(result.token_ids)
        self.messages.append({"role": "assistant", "content": result.text})
        self._previous = prompt + result.token_ids


async def bench_chat(args: argparse.Namespace) -> int:
    """Time to first token per turn, with the prefix cache and without, side by side."""
    threads = args.threads or 1
    modes = ("on", "off")
    async with AsyncExitStack() as stack:
        pipelines: dict[str, Pipeline] = {}
        for mode in modes:
            say(args, f"starting {args.stages} stages, prefix cache {mode}")
            pipelines[mode] = await stack.enter_async_context(
                bench_pipeline(
                    args,
                    stages=args.stages,
                    threads=threads,
                    hop_delay_ms=args.hop_delay_ms,
                    capacity=args.clients,
                    prefix_cache=mode == "on",
                )
            )
        system = system_prompt(pipelines["on"], args.system_tokens)
        for pipeline in pipelines.values():  # warm-up on another prompt (lanes, threads)
            await pipeline.complete("Once upon a time, a girl named", max_tokens=4)
        talks = {m: [Conversation(system, c) for c in range(args.clients)] for m in modes}
        elapsed = dict.fromkeys(modes, 0.0)
        for index in range(args.turns):
            for mode in modes:
                started = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for c, talk in enumerate(talks[mode]):
                        delay = c * args.stagger_ms / 1000.0 if index == 0 else 0.0
                        nursery.start_soon(
                            talk.turn, pipelines[mode], index, args.max_tokens, delay
                        )
                elapsed[mode] += time.perf_counter() - started
                ttfts = [talk.ttft_ms[index] for talk in talks[mode]]
                say(
                    args,
                    f"turn {index + 1}/{args.turns}, cache {mode}: time to first token "
                    f"{statistics.median(ttfts):.0f} ms (prompt "
                    f"{talks[mode][0].prompt_tokens[index]} tokens, "
                    f"{talks[mode][0].cached[index]} cached)",
                )
        health = {m: await pipelines[m].check_health() for m in modes}
    report = _chat_report(args, talks, elapsed, health)
    if args.json:
        print(json.dumps(report))
    else:
        _print_chat(report)
    return 0


def _chat_report(
    args: argparse.Namespace,
    talks: Mapping[str, Sequence[Conversation]],
    elapsed: Mapping[str, float],
    health: Mapping[str, Sequence[Any]],
) -> dict[str, Any]:
    turns = []
    for index in range(args.turns):
        row: dict[str, Any] = {"turn": index + 1}
        for mode in talks:
            row[f"ttft_ms_{mode}"] = round(
                statistics.median(t.ttft_ms[index] for t in talks[mode]), 1
            )
            row[f"cached_tokens_{mode}"] = round(
                statistics.mean(t.cached[index] for t in talks[mode]), 1
            )
        row["prompt_tokens"] = talks["on"][0].prompt_tokens[index]
        row["speedup"] = round(row["ttft_ms_off"] / max(row["ttft_ms_on"], 1e-9), 2)
        row["same_tokens"] = all(
            a.outputs[index] == b.outputs[index]
            for a, b in zip(talks["on"], talks["off"], strict=True)
        )
        turns.append(row)
    later = turns[1:] or turns
    on_later = statistics.median(t.ttft_ms[i] for t in talks["on"] for i in range(1, args.turns))
    off_later = statistics.median(t.ttft_ms[i] for t in talks["off"] for i in range(1, args.turns))
    distinct = {tuple(o) for t in talks["off"] for o in t.outputs}
    stages = [
        {"stage": h.stage.index, **prefix_cache_json(h.prefix_cache)}
        for h in health["on"]
        if h.prefix_cache is not None
    ]
    return {
        "benchmark": "chat",
        "model": str(args.model),
        "stages": args.stages,
        "clients": args.clients,
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "max_tokens": args.max_tokens,
        "hop_delay_ms": args.hop_delay_ms,
        "stagger_ms": args.stagger_ms,
        "results": turns,
        "ttft_later_turns_ms": {"on": round(on_later, 1), "off": round(off_later, 1)},
        "ttft_later_turns_speedup": round(off_later / max(on_later, 1e-9), 2),
        "min_later_turn_speedup": min(row["speedup"] for row in later),
        "tokens_per_second": {
            mode: round(sum(t.generated for t in talks[mode]) / max(elapsed[mode], 1e-9), 2)
            for mode in talks
        },
        "same_tokens": all(row["same_tokens"] for row in turns),
        "distinct_outputs": len(distinct),
        "template_prefix": all(all(t.template_prefix) for t in talks["on"]),
        "prefix_cache": stages,
    }


def _print_chat(report: Mapping[str, Any]) -> None:
    print(
        f"chat, {report['stages']} stages, {report['clients']} client(s), "
        f"{report['system_tokens']}-token system prompt, hop delay {report['hop_delay_ms']} ms"
    )
    print("turn  prompt  cached   TTFT on   TTFT off  speed-up  same tokens")
    for row in report["results"]:
        print(
            f"{row['turn']:4d}  {row['prompt_tokens']:6d}  {row['cached_tokens_on']:6.0f}  "
            f"{row['ttft_ms_on']:7.1f}ms  {row['ttft_ms_off']:7.1f}ms  {row['speedup']:7.2f}x  "
            f"{row['same_tokens']}"
        )
    rate = report["tokens_per_second"]
    print(
        f"turns 2+: median time to first token {report['ttft_later_turns_ms']['on']} ms on, "
        f"{report['ttft_later_turns_ms']['off']} ms off "
        f"({report['ttft_later_turns_speedup']}x); tokens/s {rate['on']} on, {rate['off']} off"
    )
    for stage in report["prefix_cache"]:
        print(
            f"stage {stage['stage']}: hit rate {stage['hit_rate']}, {stage['blocks']} blocks, "
            f"{stage['bytes'] / 2**20:.1f} MiB, {stage['evicted_blocks']} evicted"
        )
