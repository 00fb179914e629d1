"""The web page in a real browser (issue 33): headless Chromium against a real
``stagerun serve`` of the tiny model, over the DevTools protocol (`_browser`).

One test walks what a person does: open the page (no console errors, nothing fetched from
anywhere but the server), watch the pipeline view list every stage, send a chat and see its
tokens stream in, watch the view count the running request and draw its work on every stage
in the timeline, press stop and see the server
count the client gone; then a model answer with markup in it, shown as text. Screenshots go
to the test's folder, and to ``$STAGERUN_UI_SCREENSHOTS`` when it is set; docs/img's were
made with ``STAGERUN_UI_MODEL=smollm2 STAGERUN_UI_SCREENSHOTS=docs/img`` (the tiny model's
answers are noise).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import trio
from _browser import Page, browser_page
from _live_server import LiveServer

from stagerun.testing import write_tiny_model

HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 1"> & done'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("browser") / "tiny.gguf"
    return write_tiny_model(path, n_layers=6, context_length=4096)


def _disconnects(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("stagerun_client_disconnects_total "):
            return float(line.split()[1])
    raise AssertionError("no stagerun_client_disconnects_total in /metrics")


async def _shot(page: Page, folder: Path, name: str, element: str | None = None) -> None:
    """A screenshot of the window, or of ``element`` in a window tall enough to show it."""
    if element is None:
        await page.screenshot(folder / name)
    else:
        metrics = {"width": 1280, "height": 1150, "deviceScaleFactor": 1, "mobile": False}
        await page.call("Emulation.setDeviceMetricsOverride", **metrics)
        await trio.sleep(0.3)  # a frame laid out at that size
        await page.screenshot(folder / name, element=element)
        await page.call("Emulation.clearDeviceMetricsOverride")
    extra = os.environ.get("STAGERUN_UI_SCREENSHOTS")
    if extra:
        shutil.copy(folder / name, Path(extra) / name)


async def test_chat_stream_stop_and_the_pipeline_view_in_a_browser(
    tiny: Path, tmp_path: Path
) -> None:
    model = os.environ.get("STAGERUN_UI_MODEL") or str(tiny)
    server = LiveServer(["--model", model, "--stages", "3"], tmp_path / "serve.log")
    try:
        await trio.to_thread.run_sync(server.wait_ready)
        url = server.url
        async with browser_page() as page:
            await page.call("Page.navigate", url=url + "/")
            # the pipeline view lists every stage, as /health does
            await page.until("document.querySelectorAll('.stage').length === 3")
            shown = await page.js(
                "[...document.querySelectorAll('.stage dd')].map(e => e.textContent)"
            )
            health = (await trio.to_thread.run_sync(server.health)).json()
            layers = [f"{lo}..{hi}" for lo, hi in (s["layers"] for s in health["stages"])]
            assert len(layers) == 3 and set(layers) <= set(shown), (layers, shown)

            # a chat streams into the page; the view counts it running; stop cancels it
            before = await trio.to_thread.run_sync(_disconnects, url)
            await page.js(  # a seed: the same long answer every run (no early end token)
                "document.getElementById('max-tokens').value = 4000;"
                "document.getElementById('seed').value = 7;"
                "document.getElementById('speculative').value = 'true';"
                "document.getElementById('prompt').value = 'Once upon a time, a fox named';"
                "document.getElementById('send').click()"
            )
            first = await page.until(
                "(document.querySelector('.message.assistant .text') || {}).textContent"
            )
            grown = await page.until(
                f"document.querySelector('.message.assistant .text').textContent.length"
                f" > {len(first) + 20} && document.querySelector('.message.assistant .text')"
                ".textContent"
            )
            assert grown.startswith(first)
            await page.until(
                "[...document.querySelectorAll('#summary td')].some(e => /^1 of/.test("
                "e.textContent))",
                timeout=10,
            )
            # the timeline draws the request's work on every stage as it runs, and its
            # verify windows (the chat asked for speculation)
            caption = await page.until(
                "/running · computes per stage: [1-9][0-9]*, [1-9][0-9]*, [1-9][0-9]* · "
                "windows [1-9]/.test("
                "document.getElementById('timeline-caption').textContent) && "
                "document.getElementById('timeline-caption').textContent",
                timeout=10,
            )
            assert not await page.js("document.getElementById('timeline').hidden"), caption
            await _shot(page, tmp_path, "ui-pipeline.png", element="#pipeline-pane")
            await page.js("document.getElementById('stop').click()")
            await page.until("document.getElementById('send').disabled === false", timeout=5)
            with trio.fail_after(10):
                while await trio.to_thread.run_sync(_disconnects, url) <= before:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            facts = await page.js("document.querySelector('.message.assistant .facts').textContent")
            assert "stopped" in facts and "first token" in facts, facts
            await _shot(page, tmp_path, "ui-chat.png")

            await _markup_is_text(page)
            assert page.errors() == []
            foreign = [u for u in page.requested() if not u.startswith(url + "/")]
            assert foreign == [], foreign
    finally:
        server.stop()


async def _markup_is_text(page: Page) -> None:
    """An answer made of markup (served by the browser itself, in place of the server's) is
    shown as its text: no element is made of it, nothing in it runs."""
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": HOSTILE}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def fulfil(params: dict[str, object]) -> None:
        await page.call(
            "Fetch.fulfillRequest",
            requestId=params["requestId"],
            responseCode=200,
            responseHeaders=[{"name": "content-type", "value": "text/event-stream"}],
            body=base64.b64encode(body.encode()).decode(),
        )

    page.handlers["Fetch.requestPaused"] = fulfil
    await page.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/chat/completions"}])
    await page.js(
        "document.getElementById('prompt').value = 'say something with markup';"
        "document.getElementById('send').click()"
    )
    shown = await page.until(
        "document.querySelectorAll('.message.assistant').length === 2 && "
        "document.querySelector('#send').disabled === false && "
        "[...document.querySelectorAll('.message.assistant .text')].pop().textContent"
    )
    assert shown == HOSTILE
    assert await page.js("document.querySelectorAll('#log script, #log img').length") == 0
    assert await page.js("window.pwned === undefined")
    await page.call("Fetch.disable")
