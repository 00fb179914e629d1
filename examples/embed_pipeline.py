"""Embed a stagerun pipeline in your own Trio program.

    .venv/bin/python examples/embed_pipeline.py "The capital of France is"

The pipeline's stages run as tasks of this program's nursery (``mode="inproc"``); leaving the
``async with`` block stops them. Use ``mode="processes"`` for one process per stage, or
``remote=[...]`` to join stages already running elsewhere.
"""

from __future__ import annotations

import sys

import trio

import stagerun


async def main(prompt: str) -> None:
    async with stagerun.open_pipeline("smollm2", stages=3, mode="inproc") as pipeline:
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


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "The capital of France is")
