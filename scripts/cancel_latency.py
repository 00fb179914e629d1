"""How long a cancelled request takes to return during a long prefill.

A request with a 2,000-token prompt is cancelled (``trio.move_on_after``) a fixed time into
its prefill; the report gives how long after the cancel the call returned, p50 and max over
``--runs`` runs, for one stage and three.

    .venv/bin/python scripts/cancel_latency.py [--runs 10] [--after 0.3]
"""

from __future__ import annotations

import argparse
import statistics

import trio

from stagerun import open_pipeline

PROMPT = "Once upon a time, in a village by the sea, there lived an old fisherman named Tom. "


async def measure(stages: int, runs: int, after: float) -> None:
    async with open_pipeline("smollm2", stages=stages, prefix_cache_mb=0) as pipeline:
        prompt = pipeline.tokenizer.encode(PROMPT * 120)[:2000]
        await pipeline.complete(prompt[:64], max_tokens=2)  # warm
        late = []
        for _ in range(runs):
            with trio.move_on_after(after) as scope:
                await pipeline.complete(prompt, max_tokens=4)
            cancelled_at = scope.deadline
            assert scope.cancelled_caught, "the prefill finished before the cancel"
            late.append((trio.current_time() - cancelled_at) * 1000.0)
            await trio.sleep(0.2)  # the replaced lanes come back
    print(f"{stages} stage(s): cancel returned after p50 {statistics.median(late):.0f} ms, "
          f"max {max(late):.0f} ms over {runs} runs (prompt 2,000 tokens, cancel at "
          f"{after * 1000:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--after", type=float, default=0.3)
    args = parser.parse_args()
    for stages in (1, 3):
        trio.run(measure, stages, args.runs, args.after)
