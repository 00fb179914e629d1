"""``stagerun bench``: a served pipeline under failure (recovery) and under many clients (load)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from typing import Any

import trio

from ..._driver._supervise import stop_processes, watched_process
from ..._proto import SamplingParams
from ._common import bench_pipeline, http_exchange, say

SERVER_GRACE_S = 30.0  # a server a benchmark started has this long to exit after SIGTERM


async def bench_recovery(args: argparse.Namespace) -> int:
    """Kill a stage process mid-generation and time each part of the recovery.

    Per round: one undisturbed greedy generation, then the same with ``kill -9`` of stage
    ``--victim`` after ``--kill-at`` tokens. Reported: detection (kill to the failure seen
    by stage 0), wait (failure to a working lane again: the supervisor's backoff plus the
    restarted process's start-up), replay (the committed tokens prefilled again, up to the
    next token), the longest gap between two tokens the client saw, and whether the output
    was identical.
    """
    if not 1 <= args.victim < args.stages:
        raise ValueError(f"--victim must name one of stages 1..{args.stages - 1}")
    if not 0 < args.kill_at < args.tokens:
        raise ValueError("--kill-at must fall inside the generation (0 < kill-at < tokens)")
    greedy = SamplingParams()
    prompt = "Once upon a time, in a lighthouse by the sea,"
    rounds: list[dict[str, Any]] = []
    async with bench_pipeline(args, stages=args.stages, mode="processes") as pipeline:
        for index in range(args.rounds):
            want = await pipeline.complete(
                prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True
            )
            killer = _KillAt(pipeline.stages[args.victim].process, args.kill_at)
            got = await pipeline.complete(
                prompt, max_tokens=args.tokens, sampling=greedy, ignore_eog=True, on_token=killer
            )
            t = got.timings
            gap_ms = max(b - a for a, b in itertools.pairwise(killer.stamps)) * 1000.0
            wait_ms = float(t.get("recovery_wait_ms", 0.0))
            replay_ms = float(t.get("recovery_replay_ms", 0.0))
            row = {
                "identical": got.token_ids == want.token_ids,
                "recoveries": int(t.get("recoveries", 0)),
                "detect_ms": max(gap_ms - wait_ms - replay_ms, 0.0),
                "wait_ms": wait_ms,
                "replay_ms": replay_ms,
                "replayed_tokens": len(got.prompt_token_ids) + args.kill_at,
                "max_gap_ms": gap_ms,
                "normal_step_ms": want.timings["predicted_ms"] / max(len(want.token_ids) - 1, 1),
            }
            rounds.append(row)
            say(
                args,
                f"round {index + 1}: detect {row['detect_ms']:.0f} ms, wait {wait_ms:.0f} ms, "
                f"replay {replay_ms:.0f} ms ({row['replayed_tokens']} tokens), "
                f"longest gap {gap_ms:.0f} ms, identical {row['identical']}",
            )
    report = {
        "benchmark": "recovery",
        "model": args.model,
        "stages": args.stages,
        "victim": args.victim,
        "tokens": args.tokens,
        "kill_at": args.kill_at,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key in ("detect_ms", "wait_ms", "replay_ms", "max_gap_ms", "normal_step_ms"):
            values = sorted(r[key] for r in rounds)
            print(f"{key:15s} median {values[len(values) // 2]:8.1f}  max {values[-1]:8.1f}")
        print(f"identical output in {sum(r['identical'] for r in rounds)}/{len(rounds)} rounds")
    return 0 if all(r["identical"] and r["recoveries"] == 1 for r in rounds) else 1


class _KillAt:
    """A token callback that records arrival times and kills a process at the n-th token."""

    def __init__(self, process: Any, n: int) -> None:
        self.process, self.n = process, n
        self.stamps: list[float] = []

    def __call__(self, chunk: Any) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == self.n:
            os.kill(self.process.pid, signal.SIGKILL)


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants in MiB (Linux ``/proc``; else 0)."""
    import collections
    import pathlib

    if not os.path.isdir("/proc"):
        return 0.0
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = pathlib.Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024.0


async def bench_load(args: argparse.Namespace) -> int:
    """``--clients`` concurrent clients send ``--requests`` requests to a fresh ``serve``.

    Every request must complete (200) or be turned away (429); another status is reported as
    such, and no answer within two minutes counts as lost. Half the requests stream. Reports
    the outcomes, latencies and the resident memory of the server and its stages after a
    warm-up round and at the end.
    """
    import subprocess

    from ...server._serve import served_model_id

    model_id = served_model_id(args.model)
    cmd = [
        sys.executable, "-P", "-m", "stagerun", "serve", "--port", "0",
        "--model", args.model, "--stages", str(args.stages),
    ]  # fmt: skip
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.max_queue is not None:
        cmd += ["--max-queue", str(args.max_queue)]
    say(args, "starting " + " ".join(cmd[2:]))
    async with watched_process(cmd, stdout=subprocess.PIPE) as proc:
        try:
            host, port = await _listening_address(proc)
            clients = _LoadClients(args, model_id, host, port)
            await clients.run(args.clients)
            warm = process_tree_rss_mb(proc.pid)
            clients.outcomes.clear()
            clients.latencies.clear()
            started = time.perf_counter()
            await clients.run(args.requests)
            elapsed = time.perf_counter() - started
            after = process_tree_rss_mb(proc.pid)
        finally:
            await stop_processes([proc], SERVER_GRACE_S)
    return _report_load(args, clients.outcomes, clients.latencies, elapsed, warm, after)


async def _listening_address(proc: trio.Process) -> tuple[str, str]:
    """The host and port ``stagerun serve`` says it listens on (its first line of output)."""
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(300):
        while b"\n" not in line:
            data = await proc.stdout.receive_some(4096)
            if not data:
                raise RuntimeError("stagerun serve exited before it listened")
            line += data
    url = line.decode().split("listening on ", 1)[1].split()[0]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, port


class _LoadClients:
    """``--clients`` clients sending numbered completions, and how each request ended."""

    def __init__(self, args: argparse.Namespace, model_id: str, host: str, port: str) -> None:
        self._args, self._model_id, self._host, self._port = args, model_id, host, port
        self.outcomes: dict[str, int] = {}
        self.latencies: list[float] = []

    async def run(self, count: int) -> None:
        """Send ``count`` requests, shared between the clients; return when all are answered."""
        todo = list(range(count))
        async with trio.open_nursery() as nursery:
            for index in range(self._args.clients):
                nursery.start_soon(self._client, index, todo)

    async def _client(self, index: int, todo: list[int]) -> None:
        while todo:
            n = todo.pop()
            body = json.dumps(
                {"model": self._model_id, "prompt": f"Request {n} from client {index}:",
                 "max_tokens": self._args.max_tokens, "temperature": 0, "stream": n % 2 == 0}
            ).encode()  # fmt: skip
            start = time.perf_counter()
            try:
                with trio.fail_after(120):
                    status, _ = await http_exchange(
                        self._host, int(self._port), "POST", "/v1/completions", body
                    )
            except (trio.TooSlowError, OSError, trio.BrokenResourceError):
                status = 0
            self.latencies.append(time.perf_counter() - start)
            key = {200: "ok", 429: "429", 0: "lost"}.get(status, f"http {status}")
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if status == 429:
                await trio.sleep(0.1)


def _report_load(
    args: argparse.Namespace,
    outcomes: dict[str, int],
    latencies: list[float],
    elapsed: float,
    warm: float,
    after: float,
) -> int:
    """Print the load report (JSON with ``--json``); 0 if every request got 200 or 429."""
    ordered = sorted(latencies)
    report = {
        "benchmark": "load",
        "requests": args.requests,
        "clients": args.clients,
        "outcomes": outcomes,
        "seconds": elapsed,
        "latency_p50_s": ordered[len(ordered) // 2],
        "latency_p99_s": ordered[min(len(ordered) - 1, (len(ordered) * 99) // 100)],
        "latency_max_s": ordered[-1],
        "rss_warm_mib": warm,
        "rss_after_mib": after,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.requests} requests, {args.clients} clients, {elapsed:.1f}s: {outcomes}; "
            f"latency p50 {report['latency_p50_s']:.2f}s p99 {report['latency_p99_s']:.2f}s "
            f"max {report['latency_max_s']:.2f}s; "
            f"RSS {warm:.0f} -> {after:.0f} MiB"
        )
    return 0 if set(outcomes) <= {"ok", "429"} else 1
