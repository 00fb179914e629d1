"""Embed a stagerun pipeline in your own Trio program.

    .venv/bin/python examples/embed_pipeline.py "The capital of France is"

The app owns a nursery: a heartbeat task of its own runs beside the pipeline, whose stages are
tasks of the same program (``mode="inproc"``). Leaving the ``async with`` block stops the
stages; cancelling the nursery's scope stops the heartbeat. Use ``mode="processes"`` for one
process per stage, ``remote=[...]`` to join stages already running elsewhere, and
``transport="ws"`` (or any installed transport plugin) for the lanes between them.
"""

from __future__ import annotations

import sys

import trio

import stagerun


async def heartbeat(every: float) -> None:
    """Something else the app does while tokens stream."""
    beats = 0
    while True:
        await trio.sleep(every)
        beats += 1
        print(f"[app: still responsive, beat {beats}]", file=sys.stderr)


async def main(prompt: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat, 0.5)
        async with stagerun.open_pipeline(
            "smollm2", stages=3, mode="inproc", transport="ws"
        ) as pipeline:
            print(pipeline, file=sys.stderr)
            async with pipeline.generate(prompt, max_tokens=48) as stream:
                async for chunk in stream:
                    print(chunk.text, end="", flush=True)
            print()
            assert stream.result is not None
            timings = stream.result.timings
            print(
                f"{timings['predicted_n']:.0f} tokens at {timings['predicted_per_second']:.1f}/s",
                file=sys.stderr,
            )
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "The capital of France is")
