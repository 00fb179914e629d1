"""``stagerun bench serve``: closed-loop streaming clients against a served pipeline.

Theory of operation. One real ``stagerun serve`` subprocess (stage processes, a free loopback
port) is started and polled until ``/health`` says ok. Every distinct prompt is first
completed once alone: that solo text is what the prompt must produce under any load (greedy
decoding does not depend on what else the server is doing). Then, per client count N, N
closed-loop clients each stream K ``/v1/completions`` one after another, and every chunk's
arrival time is kept: time to first token, the gaps between text chunks (inter-token
latency), the whole request's latency. A level's tokens/s is its completion tokens over its
wall time, and each stage's busy fraction is the CPU time its process used over that wall
time (``/proc/PID/stat``; above 1 with several compute threads). Stage 0 is the server
process itself, stage i its child started with ``--index i``.

With ``--compare-llama-server`` the same prompts and levels run against ``llama-server -np N``
on the same GGUF, a fresh server per level, while the stagerun server waits. Its outputs are
compared only with its own solo outputs (other kernels, other floating point); that count is
reported, it never fails the run. With ``--rounds R`` each level is measured R times, the
systems taking turns; `_serve_run` starts the servers and runs the levels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from ..._errors import StagerunError
from ..._util import cpu_seconds
from ...backends._ggml._lib import LIBRARY_ENV
from ._common import http_exchange, say
from ._rpc import rpc_binaries
from ._servers import (
    llama_server_path,
    serve_accepts,
    stage_pids,
)

__all__ = ["PROMPTS", "StreamReader", "percentile", "plot_scaling", "scaling_ratios"]

#: Open continuations, one per client index, so that clients' outputs differ.
CURVES = (("stagerun", "stagerun"), ("llama-server", "llama_server"),
          ("llama.cpp RPC", "llama_rpc"))  # fmt: skip
"""The systems a report may hold: the name printed, and the report's key."""

PROMPTS: tuple[str, ...] = (
    "Once upon a time, in a village by the sea, there lived a girl named",
    "The old clockmaker opened the drawer and found",
    "In the year 2150, the first city on Mars was",
    "The recipe for my grandmother's apple pie begins with",
    "Deep in the forest, the fox looked up at the moon and",
    "The train pulled into the empty station just after midnight, and",
    "When the lighthouse keeper woke up that morning, the sea was",
    "The little robot rolled into the kitchen and asked",
    "On the first day of school, the new teacher told the class that",
    "The letter had been hidden under the floorboards for fifty years. It said",
    "High in the mountains, the monks of the monastery kept a secret:",
    "The detective studied the muddy footprints and concluded that",
    "Every summer, the whole family drove to the lake, where",
    "The dragon had not left its cave for a hundred years, until",
    "At the edge of the desert stood a tiny shop that sold",
    "The scientist stared at the results of the experiment and whispered",
)
_REQUEST_TIMEOUT_S = 600.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def scaling_ratios(rates: Mapping[int, float]) -> dict[int, float]:
    """Each client count's tokens/s over that of the smallest count measured (1, normally)."""
    if not rates:
        return {}
    base = rates[min(rates)]
    return {n: (rate / base if base > 0 else 0.0) for n, rate in sorted(rates.items())}


@attrs.frozen
class Sample:
    """One streamed request: its text, its completion tokens and when its chunks arrived."""

    prompt: int  # index into the prompts
    text: str
    tokens: int
    ttft_s: float
    gaps_s: tuple[float, ...]  # between consecutive text chunks
    latency_s: float


@attrs.define
class StreamReader:
    """The server-sent events of one streamed completion, fed line by line; never awaits.

    The token count is the stream's ``usage`` (or llama-server's ``timings``) when it has
    one, else the number of text chunks.
    """

    started: float
    parts: list[str] = attrs.field(factory=list)
    stamps: list[float] = attrs.field(factory=list)
    reported_tokens: int | None = None
    done: bool = False
    _pending: bytes = b""

    def receive_data(self, data: bytes, now: float) -> None:
        """Take a piece of the response body, which arrived at ``now``."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            self.receive_line(line.decode(), now)

    def receive_line(self, line: str, now: float) -> None:
        """Take one line of the event stream, which arrived at ``now``."""
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise StagerunError(f"the server failed a streamed request: {chunk['error']}")
        for choice in chunk.get("choices") or ():
            if text := choice.get("text") or (choice.get("delta") or {}).get("content") or "":
                self.parts.append(text)
                self.stamps.append(now)
        usage, timings = chunk.get("usage"), chunk.get("timings")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            self.reported_tokens = int(usage["completion_tokens"])
        elif isinstance(timings, dict) and "predicted_n" in timings:
            self.reported_tokens = int(timings["predicted_n"])

    def finish(self, prompt: int, now: float) -> Sample:
        """The finished request."""
        stamps = self.stamps
        return Sample(
            prompt=prompt,
            text="".join(self.parts),
            tokens=len(stamps) if self.reported_tokens is None else self.reported_tokens,
            ttft_s=(stamps[0] if stamps else now) - self.started,
            gaps_s=tuple(b - a for a, b in itertools.pairwise(stamps)),
            latency_s=now - self.started,
        )


@attrs.define
class _Target:
    """A running server under test, and what the clients send it."""

    name: str  # "stagerun" or "llama-server"
    port: int
    pid: int
    model: str
    prompts: tuple[str, ...]
    tokens: int
    chat: bool = False  # /v1/chat/completions, each prompt one user message
    rejected: int = 0  # 429 answers, each retried

    async def complete(self, prompt: int) -> Sample:
        """Stream one completion of prompt ``prompt`` to its end; retry while it gets 429."""
        request: dict[str, Any] = {
            "model": self.model, "max_tokens": self.tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.chat:
            request["messages"] = [{"role": "user", "content": self.prompts[prompt]}]
        else:
            request["prompt"] = self.prompts[prompt]
        body = json.dumps(request).encode()
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        while True:
            reader = StreamReader(started=time.perf_counter())
            try:
                with trio.fail_after(_REQUEST_TIMEOUT_S):
                    status, text = await http_exchange(
                        "127.0.0.1", self.port, "POST", path, body, reader.receive_data
                    )
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                raise StagerunError(f"{self.name} did not answer a completion: {exc!r}") from exc
            if status == 200 and not reader.done:
                raise StagerunError(f"{self.name} ended a completion stream without [DONE]")
            if status == 200:
                return reader.finish(prompt, time.perf_counter())
            if status != 429:
                raise StagerunError(f"{self.name} answered {status} to a completion: "
                                    f"{text.decode(errors='replace')}")  # fmt: skip
            self.rejected += 1
            await trio.sleep(0.05)


async def _level(
    target: _Target, clients: int, requests: int
) -> tuple[list[Sample], dict[str, Any]]:
    """``clients`` closed-loop clients, ``requests`` each; the samples and the level's totals."""
    samples: list[Sample] = []

    async def client(index: int) -> None:
        for _ in range(requests):
            samples.append(await target.complete(index % len(target.prompts)))

    pids = stage_pids(target.pid)
    before = [cpu_seconds(pid) for pid in pids]
    rejected, started = target.rejected, time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(client, index)
    wall = time.perf_counter() - started
    after = [cpu_seconds(pid) for pid in pids]
    busy = [
        None if a is None or b is None else (b - a) / wall
        for a, b in zip(before, after, strict=True)
    ]
    return samples, {"seconds": wall, "busy": busy, "rejected": target.rejected - rejected}


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def level_report(
    clients: int, samples: Sequence[Sample], totals: Mapping[str, Any], solo: Sequence[str]
) -> dict[str, Any]:
    """One level's row of the report: throughput, latency percentiles, mismatches, busy."""
    tokens = sum(s.tokens for s in samples)
    ttft = [s.ttft_s for s in samples]
    gaps = [gap for s in samples for gap in s.gaps_s]
    latency = [s.latency_s for s in samples]
    return {
        "clients": clients,
        "requests": len(samples),
        "completion_tokens": tokens,
        "seconds": totals["seconds"],
        "tokens_per_second": tokens / totals["seconds"],
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "latency_p50_ms": _ms(percentile(latency, 50)),
        "latency_p99_ms": _ms(percentile(latency, 99)),
        "mismatches": sum(s.text != solo[s.prompt] for s in samples),
        "rejected": totals["rejected"],
        "busy": totals["busy"],
    }


async def _measure_level(
    args: argparse.Namespace, target: _Target, clients: int, solo: Sequence[str]
) -> dict[str, Any]:
    samples, totals = await _level(target, clients, args.requests_per_client)
    for sample in [s for s in samples if s.text != solo[s.prompt]][:3]:
        say(args, f"{target.name} mismatch on prompt {sample.prompt}: {sample.text!r} "
                  f"alone was {solo[sample.prompt]!r}")  # fmt: skip
    row = level_report(clients, samples, totals, solo)
    busy = " ".join("-" if b is None else f"{b:.2f}" for b in row["busy"])
    say(args, f"{target.name}, {clients} clients: {row['tokens_per_second']:.1f} tokens/s, "
              f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, {row['mismatches']} mismatches, "
              f"busy {busy}")  # fmt: skip
    return row


async def _solo(target: _Target) -> list[str]:
    """Every prompt's text when it is the only request on the server."""
    return [(await target.complete(index)).text for index in range(len(target.prompts))]


def _curve(levels: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = scaling_ratios({row["clients"]: row["tokens_per_second"] for row in levels})
    for row in levels:
        row["scaling"] = ratios[row["clients"]]
    return {"levels": levels, "scaling": {str(n): r for n, r in ratios.items()}}


def _check(args: argparse.Namespace) -> None:
    """Refuse options that cannot work, before minutes of start-up."""
    for name in ("stages", "tokens", "requests_per_client", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_batch is not None and not serve_accepts("--max-batch"):
        raise ValueError("this stagerun serve has no --max-batch option; leave --max-batch out")
    if args.compare_llama_server:
        binary = llama_server_path(args)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise ValueError(f"no llama-server at {binary}: give its path with --llama-server")
    if args.compare_rpc:
        rpc_binaries()  # built, or say how
    if args.png:
        from .._plots import require_matplotlib

        require_matplotlib()  # fail before minutes of measuring, not after


def _prompts(kind: str, clients: int) -> tuple[str, ...]:
    """``story``: open continuations, one per client; ``copy``: input-grounded chat requests
    (what a drafter such as ``ngram`` can predict), each used by several clients."""
    if kind == "copy":
        from ._speculative import SPECULATIVE_PROMPTS

        return tuple(SPECULATIVE_PROMPTS.values())
    return PROMPTS[: min(clients, len(PROMPTS))]


def _pair(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None else f"{low:.0f}/{high:.0f}"


def _print_curve(name: str, curve: Mapping[str, Any]) -> None:
    print(f"{name}\n  clients  tokens/s  scaling  TTFT ms  ITL ms  latency ms  mismatches  "
          "429s  busy per stage")  # fmt: skip
    for row in curve["levels"]:
        busy = " ".join("-" if b is None else f"{b:.2f}" for b in row["busy"])
        print(
            f"  {row['clients']:7d} {row['tokens_per_second']:9.1f} {row['scaling']:7.2f}x "
            f"{_pair(row['ttft_p50_ms'], row['ttft_p99_ms']):>8} "
            f"{_pair(row['itl_p50_ms'], row['itl_p99_ms']):>7} "
            f"{_pair(row['latency_p50_ms'], row['latency_p99_ms']):>11} "
            f"{row['mismatches']:11d} {row['rejected']:5d}  {busy}"
        )


def _print_side_by_side(curves: Mapping[str, Mapping[str, Any]]) -> None:
    print("side by side, tokens/s (scaling)\n  clients" + "".join(f"  {n:>22}" for n in curves))
    for rows in zip(*(curve["levels"] for curve in curves.values()), strict=True):
        cells = "".join(f"  {r['tokens_per_second']:13.1f} ({r['scaling']:5.2f}x)" for r in rows)
        print(f"  {rows[0]['clients']:7d}{cells}")
    ours, *others = curves.items()
    for name, curve in others:  # with --rounds: the ratio in each round, the systems in turn
        for mine, theirs in zip(ours[1]["levels"], curve["levels"], strict=True):
            pairs = zip(mine.get("rounds_tokens_per_second", ()),
                        theirs.get("rounds_tokens_per_second", ()), strict=True)  # fmt: skip
            ratios = [f"{a / b:.2f}" if b else "-" for a, b in pairs]
            if len(ratios) > 1:
                print(f"  {mine['clients']} clients, {ours[0]} / {name} by round: "
                      + " ".join(ratios))  # fmt: skip


def _print_report(report: Mapping[str, Any]) -> None:
    print(f"{report['model']}, {report['stages']} stages, {report['tokens']} tokens x "
          f"{report['requests_per_client']} requests per client, hop delay "
          f"{report['hop_delay_ms']:g} ms, speculative {report['speculative']}; latencies "
          "are p50/p99, busy is CPU seconds per second of each stage process")  # fmt: skip
    if report.get("ggml_library"):
        print(f"ggml stages computed on {report['ggml_library']} ({LIBRARY_ENV})")
    curves: dict[str, Mapping[str, Any]] = {
        name: report[key] for name, key in CURVES if report.get(key) is not None
    }
    for name, curve in curves.items():
        _print_curve(name, curve)
    if len(curves) > 1:
        _print_side_by_side(curves)
    clients = report["clients"]
    top = 8 if 8 in clients else max(clients)
    ratios = [f"{name} {curve['scaling'][str(top)]:.2f}x" for name, curve in curves.items()]
    print(f"tokens/s at {top} clients over {min(clients)}: " + ", ".join(ratios))
    print(f"stagerun outputs that differed from the solo run: {report['mismatches']}")


def plot_scaling(report: Mapping[str, Any], path: str | pathlib.Path) -> None:
    """Tokens/s against client count, a line for stagerun and one for each system compared."""
    from .._plots import require_matplotlib

    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120, layout="constrained")
    try:
        for name, key in CURVES:
            if (curve := report.get(key)) is not None:
                rows = curve["levels"]
                axes.plot([r["clients"] for r in rows], [r["tokens_per_second"] for r in rows],
                          marker="o", label=name)  # fmt: skip
        axes.set_xscale("log", base=2)
        axes.set_xticks(report["clients"], [str(n) for n in report["clients"]])
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel("decode tokens/s (all clients)")
        axes.set_ylim(bottom=0)
        axes.set_title(_title(report), fontsize=10)
        axes.legend()
        axes.grid(alpha=0.3)
        figure.savefig(path)
    finally:
        plt.close(figure)


def _title(report: Mapping[str, Any]) -> str:
    """What the curves were measured with: model, stages, tokens, and the links and drafts."""
    parts = [str(report["model"]), f"{report['stages']} stages",
             f"{report['tokens']} tokens per request"]  # fmt: skip
    if report.get("hop_delay_ms"):
        parts.append(f"{report['hop_delay_ms']:g} ms per hop")
    if report.get("speculative") not in (None, "off"):
        parts.append(f"stagerun drafts with {report['speculative']}")
    if report.get("prompt_kind") == "copy":
        parts.append("copy prompts")
    return ", ".join(parts)
