"""Headless Chromium driven over the DevTools protocol, for the web page's tests.

Chromium comes from Debian (``chromium``; `make test` installs it). It is started with a fresh
profile and every background service off (this machine reaches no network), and the test
talks to its page target over the DevTools websocket with trio-websocket: one request at a
time, events kept in order for the test to read.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
    "--window-size=1280,860", "--remote-debugging-port=0", "--remote-allow-origins=*",
]  # fmt: skip


class Page:
    """One browser tab: `call` sends a DevTools command, `events` holds what came back."""

    def __init__(self, socket: WebSocketConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._replies: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.handlers: dict[str, Any] = {}  # method -> async callback(params)

    async def pump(self, nursery: trio.Nursery) -> None:
        while True:
            message = json.loads(await self._socket.get_message())
            if "id" in message:
                channel = self._replies.pop(message["id"], None)
                if channel is not None:
                    channel.send_nowait(message)
                continue
            self.events.append(message)
            handler = self.handlers.get(message.get("method"))
            if handler is not None:
                nursery.start_soon(handler, message.get("params", {}))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._replies[number] = send
        await self._socket.send_message(
            json.dumps({"id": number, "method": method, "params": params})
        )
        with trio.fail_after(30):
            reply = await receive.receive()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited if it is a promise)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, *, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        with trio.fail_after(timeout):
            while not (value := await self.js(expression)):  # noqa: ASYNC110 (the page's state)
                await trio.sleep(0.05)
        return value

    async def screenshot(self, path: Path, *, element: str | None = None) -> None:
        """The window as PNG; with ``element`` (a CSS selector), that element alone, the
        window made tall enough to show all of it."""
        if element is None:
            shot = await self.call("Page.captureScreenshot", format="png")
        else:
            box = await self.js(
                f"(() => {{ const r = document.querySelector({json.dumps(element)})"
                ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()"
            )
            shot = await self.call(
                "Page.captureScreenshot",
                format="png",
                captureBeyondViewport=True,
                clip={"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1},
            )
        path.write_bytes(base64.b64decode(shot["data"]))  # noqa: ASYNC240 (small, local)

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries, as text."""
        out = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(json.dumps(params.get("args"))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                out.append(params["entry"].get("text", "")[:500])
        return out

    def requested(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
        ]


@asynccontextmanager
async def browser_page() -> AsyncIterator[Page]:
    """A fresh headless Chromium and its first tab, with console, log, network and page
    events on; everything is closed at the end."""
    assert CHROMIUM, "headless Chromium is needed: apt-get install chromium (make test does)"
    with tempfile.TemporaryDirectory(
        prefix="stagerun-chromium-", ignore_cleanup_errors=True
    ) as profile:
        log = Path(profile) / "chromium.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(  # noqa: ASYNC220 (starting it does not block)
                [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, "HOME": profile},
            )
        try:
            port = await _devtools_port(proc, log)
            async with httpx.AsyncClient(timeout=10) as client:
                targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with (
                open_websocket_url(url, max_message_size=64 * 1024 * 1024) as socket,
                trio.open_nursery() as nursery,
            ):
                page = Page(socket)
                nursery.start_soon(page.pump, nursery)
                for domain in ("Page", "Runtime", "Log", "Network"):
                    await page.call(f"{domain}.enable")
                yield page
                nursery.cancel_scope.cancel()
        finally:
            proc.kill()
            proc.wait()


async def _devtools_port(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port Chromium writes its DevTools address on (within 30 s) into ``log``."""
    with trio.move_on_after(30):
        while proc.poll() is None:
            text = log.read_bytes()  # noqa: ASYNC240 (a small local file)
            found = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", text)
            if found:
                return int(found.group(1))
            await trio.sleep(0.05)
    text = log.read_bytes().decode(errors="replace")  # noqa: ASYNC240 (a small local file)
    raise RuntimeError(f"Chromium did not start: {text[-2000:]}")
