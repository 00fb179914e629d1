"""``/health`` and ``/metrics`` tell a stranger nothing (issue 32, item 6a).

The review found both answering without the API key, with every stage's address, the PIDs of
the stage processes and the prefix caches' hit counts. Now a server with API keys answers
``/metrics`` and the detailed ``/health`` only to a request that presents one of them
(``--metrics-auth key``, the default); everyone else gets liveness alone from ``/health``: its
status, with 200 or 503, and nothing else. ``--metrics-auth none`` opens them again (for a
scraper on a trusted network), and a server without keys shows them to everyone who can use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from _live_server import LiveServer
from _served_app import served_app

from stagerun import Pipeline, open_pipeline
from stagerun._cli._options import build_parser
from stagerun._cli._serve import options_from_args
from stagerun.server import HttpConfig
from stagerun.testing import write_tiny_model

KEY, OTHER_KEY = "monitor-key-123456", "tenant-key-654321"
LIVENESS_KEYS = {"status"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("health") / "tiny.gguf", n_layers=2)


class DownPipeline:
    """A real pipeline whose health check finds every stage unreachable."""

    def __init__(self, inner: Pipeline) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def check_health(self, **kwargs: Any) -> Any:
        health = await self._inner.check_health(**kwargs)
        return [attrs.evolve(h, state="unreachable", error="refused") for h in health]


@asynccontextmanager
async def served(model: Path, *, down: bool = False, **settings: Any) -> AsyncIterator[str]:
    """The app of ``settings`` over a two-stage pipeline (one stage process), on loopback."""
    async with open_pipeline(model, stages=2) as pipeline:
        served_pipeline: Any = DownPipeline(pipeline) if down else pipeline
        async with served_app(served_pipeline, **settings) as url:
            yield url


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_without_a_key_health_says_only_whether_it_is_alive(tiny: Path) -> None:
    async with served(tiny, api_key=f"{KEY}\n{OTHER_KEY}") as url, httpx.AsyncClient() as http:
        stranger = await http.get(url + "/health")
        wrong = await http.get(url + "/health", headers=bearer("guess"))
        print(f"\n/health without the key: {stranger.status_code} {stranger.text}")
        for answer in (stranger, wrong):
            assert answer.status_code == 200
            assert answer.json() == {"status": "ok"}
            assert "127.0.0.1" not in answer.text and "pid" not in answer.text
        detail = await http.get(url + "/health", headers=bearer(OTHER_KEY))
        assert detail.status_code == 200
        assert detail.json()["stages"][1]["address"].startswith("tcp://127.0.0.1:")
        metrics = await http.get(url + "/metrics")
        print(f"/metrics without the key: {metrics.status_code}")
        assert metrics.status_code == 401
        error = metrics.json()["error"]
        assert error["code"] == "invalid_api_key" and "--metrics-auth" in error["message"]
        assert "stagerun_" not in metrics.text
        assert (await http.get(url + "/metrics", headers=bearer("guess"))).status_code == 401
        scraped = await http.get(url + "/metrics", headers=bearer(KEY))
        assert scraped.status_code == 200 and "stagerun_stage_up" in scraped.text


async def test_liveness_of_an_unhealthy_server_is_503_and_still_says_nothing(tiny: Path) -> None:
    async with served(tiny, down=True, api_key=KEY) as url, httpx.AsyncClient() as http:
        stranger = await http.get(url + "/health")
        assert stranger.status_code == 503
        assert stranger.json() == {"status": "unhealthy"}
        detail = await http.get(url + "/health", headers=bearer(KEY))
        assert detail.status_code == 503
        assert detail.json()["stages"][1]["error"] == "refused"


async def test_metrics_auth_none_opens_the_detail_and_keyless_servers_show_it(
    tiny: Path,
) -> None:
    for settings in ({"api_key": KEY, "metrics_auth": "none"}, {}):
        async with served(tiny, **settings) as url, httpx.AsyncClient() as http:
            health = await http.get(url + "/health")
            assert health.status_code == 200 and set(health.json()) > LIVENESS_KEYS
            assert "stagerun_stage_up" in (await http.get(url + "/metrics")).text
            if settings:  # the key still guards the API
                assert (await http.get(url + "/v1/models")).status_code == 401


def test_the_option_is_checked_and_reaches_the_server() -> None:
    assert HttpConfig().metrics_auth == "key"
    with pytest.raises(ValueError, match="--metrics-auth"):
        HttpConfig(metrics_auth="open")  # type: ignore[arg-type]
    args = build_parser().parse_args(["serve", "--metrics-auth", "none"])
    assert options_from_args(args).http.metrics_auth == "none"


def test_stagerun_serve_with_a_key_file_hides_the_detail(tiny: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY}\n{OTHER_KEY}\n")
    keys.chmod(0o600)
    args = ["--model", str(tiny), "--stages", "2", "--api-key-file", str(keys)]
    live = LiveServer(args, tmp_path / "serve.log")
    try:
        live.wait_ready()
        health = live.health()
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert httpx.get(live.url + "/metrics", timeout=10).status_code == 401
        detail = httpx.get(live.url + "/health", headers=bearer(OTHER_KEY), timeout=10).json()
        assert detail["stages"][1]["pid"] > 0
    finally:
        live.stop()
