"""What a grammar costs a token, measured side by side on one stage.

The same greedy completion decodes unconstrained and under a grammar that admits any text
(so the answers are the same and every token pays a full mask over the vocabulary), with
forced drafting off, alternating for several rounds; the report gives the median decode time
per token of each and their ratio.

    .venv/bin/python scripts/grammar_cost.py smollm2 gemma3-270m [--tokens 64] [--rounds 5]

``--plain-only`` times the unconstrained request alone (to compare two checkouts).
"""

from __future__ import annotations

import argparse
import statistics

import trio

from stagerun import SamplingParams, SpeculationConfig, open_pipeline

PROMPT = "Once upon a time, in a village by the sea, there lived an old fisherman named"


async def measure(model: str, tokens: int, rounds: int, plain_only: bool) -> None:
    sampling = SamplingParams(temperature=0.0)
    kinds = {"unconstrained": sampling}
    if not plain_only:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_regex(r"(.|\n)*")
        kinds["grammar"] = SamplingParams(temperature=0.0, grammar=grammar)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    texts: dict[str, str] = {}
    options = {"speculation": SpeculationConfig(forced=False)} if not plain_only else {}
    async with open_pipeline(model, prefix_cache_mb=0) as pipeline:
        for _ in range(rounds):
            for kind, params in kinds.items():
                done = await pipeline.complete(PROMPT, max_tokens=tokens, sampling=params,
                                               ignore_eog=True, **options)  # fmt: skip
                timings = done.timings
                times[kind].append(timings["predicted_ms"] / (timings["predicted_n"] - 1))
                texts[kind] = done.text
    if not plain_only:
        assert texts["grammar"] == texts["unconstrained"], "the grammar changed the answer"
    plain = statistics.median(times["unconstrained"])
    line = f"{model}: unconstrained {plain:.2f} ms/token"
    if not plain_only:
        masked = statistics.median(times["grammar"])
        line += f", with a grammar {masked:.2f} ms/token: x{masked / plain:.3f}"
    print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plain-only", action="store_true")
    args = parser.parse_args()
    for name in args.models:
        trio.run(measure, name, args.tokens, args.rounds, args.plain_only)
