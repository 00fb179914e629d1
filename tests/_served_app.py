"""The HTTP app of a pipeline served on a loopback port by hypercorn, for tests that speak
real HTTP to it (real sockets, real source addresses) without a ``stagerun serve`` process."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from stagerun.server import create_app


@asynccontextmanager
async def served_app(pipeline: Any, **settings: Any) -> AsyncIterator[str]:
    """``create_app(pipeline, model_id="tiny", **settings)`` on 127.0.0.1; its URL."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    stop = trio.Event()
    app: Any = create_app(pipeline, model_id="tiny", **settings)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            yield binds[0]
        finally:
            stop.set()
