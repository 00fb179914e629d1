"""The HTTP app in process: admission (429), client disconnects, auth and request ids.

A real in-process pipeline of 3 stages serves hypercorn on port 0 inside the test's nursery.
`GatedPipeline` holds every generation after its first token until the test opens the gate,
so "the pool is full" is a state the test controls, not a race against a fast tiny model.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _served_app import served_app

from stagerun import LaneBrokenError, LaneTimeoutError, Pipeline, StageError, open_pipeline
from stagerun.server import create_app
from stagerun.server._serve import API_KEY_ENV, ServeError, resolve_api_key
from stagerun.testing import write_tiny_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


class GatedStream:
    def __init__(self, inner: Any, gate: trio.Event) -> None:
        self._inner = inner
        self._gate = gate
        self._seen = 0

    @property
    def result(self) -> Any:
        return self._inner.result

    def __aiter__(self) -> GatedStream:
        return self

    async def __anext__(self) -> Any:
        if self._seen:
            await self._gate.wait()
        self._seen += 1
        return await self._inner.__anext__()


class GatedPipeline:
    """A real pipeline whose generations stop after one token until ``gate`` is set."""

    def __init__(self, inner: Pipeline) -> None:
        self._inner = inner
        self.gate = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @asynccontextmanager
    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[GatedStream]:
        async with self._inner.generate(*args, **kwargs) as stream:
            yield GatedStream(stream, self.gate)


@asynccontextmanager
async def http_server(pipeline: Any, **options: Any) -> AsyncIterator[str]:
    async with served_app(pipeline, **options) as url:
        yield url


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, str]:
    """POST a streaming request and drain it: (status, the concatenated content)."""
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return response.status_code, "".join(text)


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    """Poll ``predicate`` (sync or async) until it holds."""
    with trio.fail_after(timeout):
        while True:
            value = predicate()
            if await value if inspect.isawaitable(value) else value:
                return
            await trio.sleep(0.01)


async def test_a_full_pool_answers_429_then_the_retry_succeeds(tiny: Path) -> None:
    body = {**CHAT, "max_tokens": 100, "stream": True}
    async with (
        open_pipeline(tiny, stages=3, mode="inproc", capacity=2) as real,
        http_server(gated := GatedPipeline(real), max_queue=1) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        reference = (await real.complete([CHAT["messages"][0]], chat=True, max_tokens=100)).text
        results: list[tuple[int, str]] = []

        async def one() -> None:
            results.append(await read_stream(client, body))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)

            async def settled() -> bool:
                text = (await client.get("/metrics")).text
                return (
                    "stagerun_requests_in_flight 2" in text and "stagerun_requests_queued 1" in text
                )

            await wait_until(settled)
            assert real.pool is not None and real.pool.busy == 2
            refused = await client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["code"] == "rate_limit_exceeded"
            assert "retry" in error["message"]
            gated.gate.set()
        assert results == [(200, reference)] * 3
        assert await read_stream(client, body) == (200, reference)
        health = (await client.get("/health")).json()
        assert health["requests"]["rejected"] == 1
        assert health["lanes"]["busy"] == 0 and health["lanes"]["replaced"] == 0


async def _read_events(stream: trio.SocketStream, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        chunk = await stream.receive_some(65536)
        assert chunk, data
        data += chunk
    return data


async def _raw_post(url: str, payload: dict[str, Any]) -> trio.SocketStream:
    """Send a chat request over a bare socket, so the test decides when the client hangs up."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(payload).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    await stream.send_all(head.encode() + body)
    return stream


async def test_a_client_that_disconnects_mid_stream_frees_its_lane(tiny: Path) -> None:
    async with (
        open_pipeline(tiny, stages=3, mode="inproc", capacity=1) as real,
        http_server(gated := GatedPipeline(real), max_queue=0) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        pool = real.pool
        assert pool is not None
        stream = await _raw_post(url, {**CHAT, "max_tokens": 300, "stream": True})
        head = await _read_events(stream, 2)  # the role chunk and the first token
        assert head.startswith(b"HTTP/1.1 200")
        assert pool.busy == 1
        await stream.aclose()  # the client goes away mid-stream
        await wait_until(lambda: pool.busy == 0 and pool.replaced == 1)
        metrics = (await client.get("/metrics")).text
        assert "stagerun_client_disconnects_total 1" in metrics
        assert "stagerun_requests_in_flight 0" in metrics
        assert "stagerun_lanes_replaced_total 1" in metrics
        assert "stagerun_lanes_idle 1" in metrics
        # A non-streaming client that hangs up is cancelled the same way.
        stream = await _raw_post(url, {**CHAT, "max_tokens": 300})
        await wait_until(lambda: pool.busy == 1)
        await stream.aclose()
        await wait_until(lambda: pool.busy == 0 and pool.replaced == 2)
        # Capacity 1 and no queue: the next request gets the lane, or it would be refused.
        gated.gate.set()
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert pool.busy == 0 and pool.idle == 1


async def test_api_key_guards_v1_and_request_ids_are_echoed(tiny: Path) -> None:
    async with (
        open_pipeline(tiny, stages=1) as pipeline,
        http_server(pipeline, api_key="sekret") as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        denied = await client.get("/v1/models", headers={"x-request-id": "abc-123"})
        assert denied.status_code == 401
        assert denied.headers["x-request-id"] == "abc-123"
        assert denied.json()["error"]["code"] == "invalid_api_key"
        wrong = await client.get("/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        auth = {"authorization": "Bearer sekret"}
        models = await client.get("/v1/models", headers=auth)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        assert len(models.headers["x-request-id"]) == 36  # a fresh UUID
        health = await client.get("/health")  # open without a key, but liveness alone
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers=auth)).status_code == 200
        ok = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=auth)
        assert ok.status_code == 200
        # The pipeline's own name is accepted as an alias of the served id.
        alias = {**CHAT, "max_tokens": 1, "model": pipeline.config.name}
        assert (
            await client.post("/v1/chat/completions", json=alias, headers=auth)
        ).status_code == 200


class FailingPipeline:
    """Fails a generation with ``error`` after ``after`` tokens of a real pipeline."""

    def __init__(self, inner: Pipeline, error: Exception, after: int) -> None:
        self._inner = inner
        self.error = error
        self.after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @asynccontextmanager
    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with self._inner.generate(*args, **kwargs) as stream:
            yield self._fail(stream)

    async def _fail(self, stream: Any) -> AsyncIterator[Any]:
        seen = 0
        async for chunk in stream:
            if seen == self.after:
                raise self.error
            seen += 1
            yield chunk


@pytest.mark.parametrize(
    ("error", "after", "status", "code"),
    [
        (LaneTimeoutError("lane 0: no prediction within 1s"), 0, 504, "upstream_timeout"),
        (StageError("stage 2: out of memory"), 0, 502, "upstream_error"),
        (LaneBrokenError("lane 0: connection lost"), 3, 200, "upstream_error"),
    ],
)
async def test_pipeline_failures_map_to_502_504_or_a_final_sse_error(
    tiny: Path, error: Exception, after: int, status: int, code: str
) -> None:
    async with (
        open_pipeline(tiny, stages=1) as pipeline,
        http_server(FailingPipeline(pipeline, error, after)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        whole = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
        assert whole.status_code == (502 if status == 200 else status)
        assert whole.json()["error"]["code"] == code
        stream_body = {**CHAT, "max_tokens": 8, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert response.status_code == status
        if status != 200:  # nothing was sent yet: a plain error answer with its status
            assert json.loads("".join(lines))["error"]["code"] == code
        else:  # output had begun: one last event carries the error, and no [DONE]
            assert len(lines) == 1 + after + 1
            assert json.loads(lines[-1][6:])["error"]["code"] == code
            assert "data: [DONE]" not in lines
        assert (await client.get("/health")).json()["requests"]["running"] == 0


async def test_speculative_pipelines_report_their_timings(tiny: Path) -> None:
    from stagerun import SpeculationConfig

    async with (
        open_pipeline(tiny, stages=3, speculation=SpeculationConfig("ngram", depth=4)) as pipeline,
        http_server(pipeline) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        body = {**CHAT, "max_tokens": 12, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        timings = reply.json()["timings"]
        assert timings["verify_window_depth"] == 4
        assert isinstance(timings["verify_window_occupancy_ms_by_depth"], list)
        assert isinstance(timings["speculative_drafting_switched_off"], bool)
        assert "speculative_accept_rate" in timings and "draft_n_accepted" in timings
        plain = await pipeline.complete(
            pipeline.encode_prompt(CHAT["messages"]), max_tokens=12,
            speculation=SpeculationConfig(),
        )  # fmt: skip
        assert reply.json()["choices"][0]["message"]["content"] == plain.text


async def test_max_tokens_has_a_server_default_and_a_cap(tiny: Path) -> None:
    """A chat request without max_tokens gets the default, not the rest of the context."""
    async with (
        open_pipeline(tiny, stages=1) as pipeline,
        http_server(pipeline, max_tokens_default=5, max_tokens_limit=7) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):

        async def completion_tokens(path: str, body: dict[str, Any]) -> int:
            reply = await client.post(path, json=body)
            assert reply.status_code == 200, reply.text
            tokens: int = reply.json()["usage"]["completion_tokens"]
            return tokens

        assert await completion_tokens("/v1/chat/completions", CHAT) == 5  # the default
        capped = {**CHAT, "max_tokens": 100}
        assert await completion_tokens("/v1/chat/completions", capped) == 7  # the limit
        assert await completion_tokens("/v1/chat/completions", {**CHAT, "max_tokens": 6}) == 6
        text = {"model": "tiny", "prompt": "The lighthouse", "temperature": 0}
        assert await completion_tokens("/v1/completions", text) == 7  # OpenAI's 16, capped
    with pytest.raises(ValueError, match=r"default max_tokens \(9\) must be between 1 and"):
        create_app(pipeline, max_tokens_default=9, max_tokens_limit=8)


def test_an_empty_api_key_is_an_error_and_no_key_beyond_loopback_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for empty in ("", "  "):
        with pytest.raises(ServeError, match=r"^--api-key is empty"):
            resolve_api_key(empty, "127.0.0.1")
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(ServeError, match=r"^\$STAGERUN_API_KEY is empty"):
        resolve_api_key(None, "0.0.0.0")
    assert resolve_api_key("k1", "0.0.0.0") == "k1"  # the option wins over the variable
    monkeypatch.setenv(API_KEY_ENV, "k2")
    assert resolve_api_key(None, "0.0.0.0") == "k2"
    monkeypatch.delenv(API_KEY_ENV)
    caplog.set_level("WARNING", logger="stagerun.serve")
    for host in ("127.0.0.1", "localhost", "::1"):
        assert resolve_api_key(None, host) is None
    assert not caplog.records  # loopback: no one else can reach it
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert resolve_api_key(None, host) is None
    assert [r.levelname for r in caplog.records] == ["WARNING"] * 3
    assert "with no API key: anyone who can reach this address" in caplog.records[0].message


async def test_the_http_request_id_reaches_the_trace_and_picks_the_timeline(tiny: Path) -> None:
    from stagerun import telemetry
    from stagerun._cli._options import _request_selector
    from stagerun._cli._report import request_timeline

    recorder = telemetry.Telemetry("debug", [], capacity=100_000)
    previous = telemetry.set_current(recorder)
    try:
        async with (
            open_pipeline(tiny, stages=2) as pipeline,
            http_server(pipeline) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            for label in ("first-request", "second-request"):
                body = {**CHAT, "max_tokens": 4}
                reply = await client.post(
                    "/v1/chat/completions", json=body, headers={"x-request-id": label}
                )
                assert reply.status_code == 200
        records = recorder.take()
    finally:
        telemetry.set_current(previous)
    summaries = [r for r in records if r.name == "stage.openai_generation_summary"]
    labels = [r.attributes.get("stagerun.request_label") for r in summaries]
    assert labels == ["first-request", "second-request"]
    first = request_timeline(records, _request_selector("first-request"))
    assert first.request_id == summaries[0].attributes["llama_stage.request_id"]
    assert request_timeline(records).request_id != first.request_id  # the last one
    by_id = request_timeline(records, _request_selector(hex(first.request_id)))
    assert by_id.request_id == first.request_id
    with pytest.raises(ValueError, match="no finished request nobody"):
        request_timeline(records, "nobody")
