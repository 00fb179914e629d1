"""One stream's latency on servers of different settings, measured side by side.

Starts one ``stagerun serve`` per variant (the same model and stages, each with its own extra
flags), then streams the same greedy completion from each in turn, round after round, the
order rotated and reversed every other round so the machine's drift falls on all alike. It
reports per variant the medians of: time to the first text chunk, the median gap between
chunks of a request, and the mean time per token of a request (first chunk to last).

    .venv/bin/python scripts/serve_side_by_side.py --model smollm2 --stages 3 --rounds 30 \\
        thread="--inline-compute-ms 0" inline=""

The first two rounds warm up and are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

PROMPT = "Once upon a time, in a small village by the sea, there lived a girl named"
WARM_ROUNDS = 2


@contextlib.contextmanager
def servers(model: str, stages: int, variants: dict[str, str]) -> Iterator[dict[str, int]]:
    """Each variant's server, started on its own port, stopped on the way out."""
    ports, children = {}, []
    try:
        for offset, (name, extra) in enumerate(variants.items()):
            port = 8390 + offset
            argv = [sys.executable, "-m", "stagerun", "serve", "--model", model]
            argv += ["--stages", str(stages), "--port", str(port), *shlex.split(extra)]
            children.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
            ports[name] = port
        for port in ports.values():
            deadline = time.monotonic() + 180
            while not _healthy(port):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server on port {port} did not come up in 180 s")
                time.sleep(0.5)
        yield ports
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=60)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stream(client: httpx.Client, port: int, model: str, tokens: int) -> list[float]:
    """The arrival times (s after the request) of one streamed completion's text chunks."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    start, times = time.perf_counter(), []
    url = f"http://127.0.0.1:{port}/v1/completions"
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text"' in line:
                times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", metavar="NAME=FLAGS")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variants)
    seen: dict[str, dict[str, list[float]]] = {
        name: {"ttft": [], "gap": [], "per_token": []} for name in variants
    }
    names = list(variants)
    with servers(args.model, args.stages, variants) as ports, httpx.Client(timeout=120) as client:
        for round_ in range(args.rounds + WARM_ROUNDS):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order[::-1] if round_ % 2 else order:
                times = stream(client, ports[name], args.model, args.tokens)
                if round_ < WARM_ROUNDS or len(times) < 2:
                    continue
                gaps = [b - a for a, b in itertools.pairwise(times)]
                seen[name]["ttft"].append(times[0])
                seen[name]["gap"].append(statistics.median(gaps))
                seen[name]["per_token"].append((times[-1] - times[0]) / len(gaps))
    print(f"{args.model}, {args.stages} stage(s), {args.rounds} rounds, medians in ms:")
    for name, values in seen.items():
        ms = {key: 1e3 * statistics.median(v) for key, v in values.items()}
        print(f"  {name:12} first chunk {ms['ttft']:6.1f}   gap {ms['gap']:6.2f}   "
              f"per token {ms['per_token']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
