"""The web page at ``/`` (issue 33): what the server sends it, and what it refuses.

These tests speak HTTP to the app over real sockets (`_served_app`); the page's behaviour in a
browser is tests/test_ui_browser.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import trio
from _served_app import served_app

from stagerun import open_pipeline
from stagerun.server._ui import CSP, FILES, PROBE_INTERVAL, STATE_INTERVAL, page_file
from stagerun.testing import write_tiny_model

KEY = "page-key-0123456789"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ui") / "tiny.gguf", n_layers=4)


def test_the_page_is_small_and_names_nothing_outside_this_server() -> None:
    """No CDN, no font service, no analytics: every URL in the page is a path of its own."""
    total = 0
    for name in FILES:
        text = page_file(name).decode()
        total += len(text.encode())
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, name
        assert "eval(" not in text and "document.write" not in text, name
    assert "<script>" not in page_file("index.html").decode()  # no inline code (the CSP)
    assert " style=" not in page_file("index.html").decode()
    print(f"the page's files: {total:,} bytes in all")
    assert total < 64 * 1024


async def test_the_page_and_its_files_are_served_with_a_strict_policy(tiny: Path) -> None:
    async with (
        open_pipeline(tiny, stages=1) as pipeline,
        served_app(pipeline) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.content == page_file("index.html")
        for name, media in FILES.items():
            reply = await client.get(f"/ui/{name}") if name != "index.html" else page
            assert reply.status_code == 200, name
            assert reply.headers["content-type"] == media
            assert reply.headers["content-security-policy"] == CSP
            assert reply.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'self'" in CSP and "unsafe" not in CSP
        assert "connect-src 'self'" in CSP and "frame-ancestors 'none'" in CSP
        for missing in ("/ui/index.html", "/ui/../_ui.py", "/ui/%2e%2e%2f_app.py", "/ui/x.js"):
            assert (await client.get(missing)).status_code == 404, missing


async def test_the_pipeline_view_shows_every_stage_and_probes_them_sparingly(
    tiny: Path,
) -> None:
    async with (
        open_pipeline(tiny, stages=2) as pipeline,
        served_app(pipeline) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        probes = 0
        check = pipeline.check_health

        async def counted(**kwargs: object) -> object:
            nonlocal probes
            probes += 1
            return await check(**kwargs)  # type: ignore[arg-type]

        pipeline.check_health = counted  # type: ignore[method-assign]
        first = await client.get("/ui/state")
        assert first.status_code == 200 and first.headers["content-security-policy"] == CSP
        state = first.json()
        assert [s["index"] for s in state["stages"]] == [0, 1]
        assert [s["layers"] for s in state["stages"]] == [[0, 2], [2, 4]]
        assert all(s["state"] == "ready" and s["backend"] for s in state["stages"])
        assert state["requests"]["running"] == 0 and "kv_budget_bytes" in state["requests"]
        assert state["client_disconnects"] == 0 and state["interval"] == STATE_INTERVAL
        # a burst of polls is answered from one snapshot
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(client.get, "/ui/state")
        assert probes == 1
        await trio.sleep(STATE_INTERVAL)
        assert (await client.get("/ui/state")).json()["time"] > state["time"]
        assert probes == 1  # a new snapshot, on the stages' probes of PROBE_INTERVAL
        assert PROBE_INTERVAL > STATE_INTERVAL


async def test_with_a_key_the_page_loads_but_the_pipeline_view_needs_the_key(tiny: Path) -> None:
    async with (
        open_pipeline(tiny, stages=1) as pipeline,
        served_app(pipeline, api_key=KEY) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        assert (await client.get("/")).status_code == 200  # it asks for the key itself
        refused = await client.get("/ui/state")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        allowed = await client.get("/ui/state", headers={"authorization": f"Bearer {KEY}"})
        assert allowed.status_code == 200 and allowed.json()["stages"]


async def test_no_ui_serves_no_page_and_other_hosts_are_refused(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=1) as pipeline:
        async with served_app(pipeline, ui=False) as url, httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/")).status_code == 404
            assert (await c.get("/ui/state")).status_code == 404
            assert (await c.get("/ui/app.js")).status_code == 404
        async with (
            served_app(pipeline, allowed_hosts=["127.0.0.1"]) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            assert (await client.get("/")).status_code == 200
            rebinding = await client.get("/", headers={"host": "attacker.example"})
            assert rebinding.status_code == 421
