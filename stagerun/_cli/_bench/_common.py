"""What every benchmark shares."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import trio

from ..._driver._pipeline import Pipeline
from ..._launch import open_pipeline
from ..._proto import SamplingParams
from .._config import config_from_args

K = TypeVar("K", bound=Hashable)


def say(args: argparse.Namespace, text: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(f"stagerun bench: {text}", file=sys.stderr, flush=True)


def bench_pipeline(
    args: argparse.Namespace, **options: Any
) -> AbstractAsyncContextManager[Pipeline]:
    """`open_pipeline` on the model and the settings the options name (`config_from_args`).

    ``options`` add to them or override them (``stages``, ``mode``, ``hop_delay_ms``...).
    """
    return open_pipeline(args.model, config_from_args(args, **options))


async def decode_rounds(
    args: argparse.Namespace, pipelines: Mapping[K, Pipeline], label: str = "{}"
) -> tuple[dict[K, list[float]], dict[K, list[int]]]:
    """Greedy decode of ``args.prompt`` on every pipeline in turn, ``args.rounds`` times.

    Returns tokens/s per round and the first round's tokens, for each pipeline. A short
    warm-up run on each comes first (caches, thread pools, lanes). ``label`` formats a
    pipeline's key in the progress lines.
    """
    greedy = SamplingParams()
    samples: dict[K, list[float]] = {key: [] for key in pipelines}
    outputs: dict[K, list[int]] = {}
    for pipeline in pipelines.values():
        await pipeline.complete(args.prompt, max_tokens=8, sampling=greedy, ignore_eog=True)
    for round_index in range(args.rounds):
        for key, pipeline in pipelines.items():
            result = await pipeline.complete(
                args.prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True
            )
            rate = result.timings["predicted_per_second"]
            samples[key].append(rate)
            outputs.setdefault(key, result.token_ids)
            name = label.format(key)
            say(args, f"round {round_index + 1}/{args.rounds}: {name} {rate:.1f} tokens/s")
    return samples, outputs


async def http_exchange(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    on_data: Callable[[bytes, float], None] | None = None,
) -> tuple[int, bytes]:
    """One HTTP/1.1 request to ``host:port`` on its own connection (h11).

    Returns the status and the body; with ``on_data`` a 200 body goes to it instead, piece by
    piece with its arrival time, as it comes. The body is always read to its end.
    """
    import h11

    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", f"{host}:{port}"), ("Connection", "close")]
    if body:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        out = conn.send(h11.Request(method=method, target=path, headers=headers))
        out += conn.send(h11.Data(data=body)) if body else b""
        await stream.send_all(out + conn.send(h11.EndOfMessage()))
        status, chunks = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if on_data is not None and status == 200:
                    on_data(bytes(event.data), time.perf_counter())
                else:
                    chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(chunks)
