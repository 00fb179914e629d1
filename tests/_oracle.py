"""The guard every equality-after-fault test puts on its oracle.

Comparing a disturbed run with an undisturbed one proves nothing when the model would have
produced the same tokens anyway (a model that repeats one token hides a replay that lost the
prompt). Such a test first asserts that what it expects is varied.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

MIN_DISTINCT = 8


def assert_varied(ids: Sequence[int], minimum: int = MIN_DISTINCT) -> None:
    """Fail unless ``ids`` holds at least ``minimum`` distinct token ids."""
    distinct = len(set(ids))
    assert distinct >= minimum, (
        f"the expected output has only {distinct} distinct tokens ({list(ids)[:16]}...): "
        "an equality check on it could not tell a wrong run from a right one"
    )


async def run_each(count: int, run: Callable[[int], Awaitable[None]], *, together: bool) -> None:
    """``run(k)`` for every k below ``count``: all at once (batched), or one after another."""
    if together:
        async with trio.open_nursery() as nursery:
            for k in range(count):
                nursery.start_soon(run, k)
    else:
        for k in range(count):
            await run(k)
