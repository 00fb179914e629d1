"""``speculative`` in a request (an extension; the web page's switch): on or off per request,
whatever the server was started with, and the same tokens either way."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _served_app import served_app

from stagerun import SpeculationConfig, open_pipeline
from stagerun.testing import write_tiny_model

BODY = {"model": "tiny", "prompt": "one two three one two three one two", "max_tokens": 24,
        "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", n_layers=4)


async def _answer(client: httpx.AsyncClient, **extra: object) -> tuple[str, dict[str, object]]:
    reply = await client.post("/v1/completions", json={**BODY, **extra})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["text"], body["timings"]


@pytest.mark.parametrize("server", ["off", "ngram"])
async def test_a_request_turns_speculation_on_or_off(tiny: Path, server: str) -> None:
    speculation = SpeculationConfig(drafter=server)
    async with (
        open_pipeline(tiny, stages=2, speculation=speculation) as pipeline,
        served_app(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        default_text, default = await _answer(client)
        on_text, on = await _answer(client, speculative=True)
        off_text, off = await _answer(client, speculative=False)
    assert ("draft_n" in default) == (server != "off")
    assert "draft_n" in on and int(on["draft_n"]) > 0  # type: ignore[call-overload]
    assert "draft_n" not in off
    assert len(set(default_text.split())) > 1  # an answer of several words, not one repeated
    assert default_text == on_text == off_text  # speculation never changes the answer
