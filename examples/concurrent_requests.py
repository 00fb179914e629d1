"""Four generations at once in one Trio app: one cancelled, one under a deadline, a health check.

    .venv/bin/python examples/concurrent_requests.py

One pipeline (two stages, in this process) serves four requests started in one nursery:

* two run to the end;
* one is cancelled by the app after its first tokens (its own cancel scope);
* one runs under ``trio.fail_after`` with a deadline too short for its answer;

and a health check runs beside them. Each line printed says what happened to which request,
with its time; nothing is left running when the block ends. Cancelling a request (or its
deadline) cancels it in the pipeline: its lane is replaced, the others go on.
"""

from __future__ import annotations

import time

import trio

import stagerun

PROMPT = "Once upon a time, in a village by the sea, there lived an old fisherman named"
started = time.perf_counter()


def say(what: str) -> None:
    print(f"{time.perf_counter() - started:6.2f} s  {what}", flush=True)


async def to_the_end(pipeline: stagerun.Pipeline, name: str, seed: int) -> None:
    sampling = stagerun.SamplingParams(temperature=0.8, seed=seed)
    done = await pipeline.complete(PROMPT, max_tokens=24, sampling=sampling)
    say(f"{name}: finished ({done.finish_reason}), {len(done.token_ids)} tokens: {done.text!r}")


async def cancelled_by_the_app(pipeline: stagerun.Pipeline) -> None:
    with trio.CancelScope() as scope:
        async with pipeline.generate(PROMPT, max_tokens=200) as stream:
            tokens = 0
            async for chunk in stream:
                tokens += chunk.token_id >= 0
                if tokens == 4:
                    say("cancelled: cancelling after 4 tokens")
                    scope.cancel()
    say(f"cancelled: returned {'cancelled' if scope.cancelled_caught else 'finished'}")


async def under_a_deadline(pipeline: stagerun.Pipeline) -> None:
    try:
        with trio.fail_after(0.5):
            await pipeline.complete(PROMPT, max_tokens=400)
        say("deadline: finished in time")
    except trio.TooSlowError:
        say("deadline: gave up after 0.5 s (trio.TooSlowError)")


async def health(pipeline: stagerun.Pipeline) -> None:
    await trio.sleep(0.2)
    states = [(h.stage.index, h.state) for h in await pipeline.check_health()]
    say(f"health: {states}")


async def main() -> None:
    async with stagerun.open_pipeline("smollm2", stages=2, capacity=4) as pipeline:
        say(f"opened {pipeline}")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(to_the_end, pipeline, "first", 1)
            nursery.start_soon(to_the_end, pipeline, "second", 2)
            nursery.start_soon(cancelled_by_the_app, pipeline)
            nursery.start_soon(under_a_deadline, pipeline)
            nursery.start_soon(health, pipeline)
        say("all four returned; the pipeline still serves:")
        await to_the_end(pipeline, "after", 3)
    say(f"closed; health now {[h.state for h in await pipeline.check_health()]}")


if __name__ == "__main__":
    trio.run(main)
