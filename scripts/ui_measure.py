"""What the web page costs and how fast its stop button is (issue 33), on a real server.

Starts ``stagerun serve --stages 3`` (the default model unless ``--model``), then:

- **cost**: a streaming API client decodes ``--tokens`` tokens, alternately with the page
  open in headless Chromium (polling ``/ui/state`` as it does) and with no page, ``--rounds``
  times each, the side that goes first alternating too; reports each side's median tokens/s
  and their ratio;
- **cancel**: in the page, sends a long chat, waits for tokens, clicks Stop, and times the
  click to the server's ``stagerun_client_disconnects_total`` moving (``/metrics`` polled
  every 5 ms), ``--cancels`` times; reports the median and the spread.

Run from the repository root (it borrows the tests' browser driver)::

    python scripts/ui_measure.py --rounds 5 --cancels 10 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _browser import Page, browser_page
from _live_server import LiveServer

PROMPT = "Once upon a time, in a village by the sea, there lived a fisherman named"
STORY = "Write a long story about a fisherman named Tom and his seven daughters."


def decode_rate(url: str, tokens: int, model: str = "smollm2") -> float:
    """Tokens per second of one streamed completion, from its first token to its last."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True,
            "temperature": 0}  # fmt: skip
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.read().decode()[:300]}")
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def disconnects(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("stagerun_client_disconnects_total "):
            return float(line.split()[1])
    raise RuntimeError("no stagerun_client_disconnects_total")


async def cancel_once(page: Page, url: str) -> float:
    before = await trio.to_thread.run_sync(disconnects, url)
    # a fresh one-turn chat, greedy: the answer runs long every time (sampled, after a few
    # stopped turns, the model sometimes ended its answer before Stop could be clicked)
    await page.js("document.getElementById('clear').click()")
    count = await page.js("document.querySelectorAll('.message.assistant').length")
    await page.js(
        "document.getElementById('temperature').value = 0;"
        "document.getElementById('max-tokens').value = 2000;"
        f"document.getElementById('prompt').value = {json.dumps(STORY)};"
        "document.getElementById('send').click()"
    )
    await page.until(
        f"document.querySelectorAll('.message.assistant').length > {count} && "
        "[...document.querySelectorAll('.message.assistant .text')].pop().textContent.length > 10"
        " && document.getElementById('send').disabled"
    )
    clicked = time.perf_counter()
    await page.js("document.getElementById('stop').click()")
    while await trio.to_thread.run_sync(disconnects, url) <= before:  # noqa: ASYNC110
        await trio.sleep(0.005)
    took = time.perf_counter() - clicked
    await page.until("document.getElementById('send').disabled === false")
    return took


async def measure(args: argparse.Namespace, url: str) -> dict[str, object]:
    open_rates: list[float] = []
    closed_rates: list[float] = []
    cancels: list[float] = []
    async with browser_page() as page:
        await page.call("Page.navigate", url=url + "/")
        await page.until("document.querySelectorAll('.stage').length === 3")
        for _ in range(args.cancels):
            cancels.append(await cancel_once(page, url))
        for round_ in range(args.rounds):
            # open first in even rounds, closed first in odd ones (ABBA): whatever the first
            # decode after a change costs falls on both sides alike
            for page_open in (True, False) if round_ % 2 == 0 else (False, True):
                if page_open:
                    await page.call("Page.navigate", url=url + "/")
                    await page.until("document.querySelectorAll('.stage').length === 3")
                else:
                    await page.call("Page.navigate", url="about:blank")
                rate = await trio.to_thread.run_sync(decode_rate, url, args.tokens)
                (open_rates if page_open else closed_rates).append(rate)
        errors = page.errors()
    return {
        "tokens": args.tokens,
        "page_open_tokens_per_second": open_rates,
        "page_closed_tokens_per_second": closed_rates,
        "open_over_closed": (
            statistics.median(open_rates) / statistics.median(closed_rates) if open_rates else None
        ),
        "cancel_ms": [round(c * 1000, 1) for c in cancels],
        "cancel_median_ms": round(statistics.median(cancels) * 1000, 1),
        "page_errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--cancels", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = LiveServer(["--model", args.model, "--stages", "3"], Path(folder) / "serve.log")
        try:
            server.wait_ready()
            result = trio.run(measure, args, server.url)
        finally:
            server.stop()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
