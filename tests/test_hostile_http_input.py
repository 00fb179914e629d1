"""Hostile input on the HTTP request path: every bad request is a quick 400, never a 500.

Four kinds of attack. Big work on the event loop: a prompt or chat too large to tokenize
in time starves every other request (here ``GET /v1/models``, which must answer in < 0.5 s
throughout). Values the parser let through but the code behind it could not take (huge
integers, deep JSON, a denormal temperature, lone surrogates): each must be a 400 in the
OpenAI envelope with nothing logged. Parameters stagerun does not implement, which must be
refused rather than ignored. And a hostile chat template, which must stop within its budgets.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from stagerun import open_pipeline
from stagerun._decide._sampling import sample_token
from stagerun._proto import SamplingParams
from stagerun.model import ChatTemplateError, render_chat
from stagerun.server import Admission, ApiError, create_app, parse_generation_request
from stagerun.server._openai import MAX_STOP_CHARS
from stagerun.testing import write_tiny_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "max_tokens": 2}
JSON = {"content-type": "application/json"}
MODELS_DEADLINE = 0.5  # seconds GET /v1/models may take while a hostile request is handled
BIG_CONTEXT = 2**19  # a tiny model whose 2M-character prompts pass the character bound


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory, 512)


@pytest.fixture(scope="module")
def tiny_big_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory, BIG_CONTEXT)


def write_tiny(factory: pytest.TempPathFactory, context: int) -> Path:
    return write_tiny_model(
        factory.mktemp("tiny") / "tiny.gguf", n_layers=2, context_length=context
    )


@asynccontextmanager
async def http_server(model: Path) -> AsyncIterator[httpx.AsyncClient]:
    """Hypercorn on loopback port 0 serving a one-stage pipeline, and a client for it."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    stop = trio.Event()
    async with open_pipeline(model, stages=1) as pipeline, trio.open_nursery() as nursery:
        app: Any = create_app(pipeline, model_id="tiny")
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            async with httpx.AsyncClient(base_url=binds[0], timeout=60) as client:
                yield client
        finally:
            stop.set()


async def models_latency_during(
    client: httpx.AsyncClient, path: str, body: bytes
) -> tuple[httpx.Response, float]:
    """POST ``body`` and, until it is answered, GET /v1/models again and again.

    Returns the POST's response and the longest a /v1/models request could have waited: the
    slowest round of GET + a 10 ms pause. The client shares the server's process, so a stall
    of the server's event loop stalls the whole round, whenever it falls.
    """
    answer: list[httpx.Response] = []
    slowest = 0.0

    async def post() -> None:
        answer.append(await client.post(path, content=body, headers=JSON))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post)
        while not answer:
            started = time.perf_counter()
            models = await client.get("/v1/models")
            assert models.status_code == 200
            await trio.sleep(0.01)
            slowest = max(slowest, time.perf_counter() - started)
    return answer[0], slowest


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return dict(error)


# -- finding 4: tokenizing and rendering never block the event loop --------------------------


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(tiny: Path) -> None:
    body = json.dumps({**COMPLETION, "prompt": "hello world " * 340_000}).encode()  # 4 MB
    async with http_server(tiny) as client:
        response, slowest = await models_latency_during(client, "/v1/completions", body)
    print(f"4 MB prompt: slowest /v1/models {slowest:.3f} s")
    error = assert_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert "characters" in error["message"]
    assert slowest < MODELS_DEADLINE


async def test_more_chat_messages_than_the_context_holds_are_refused_at_once(tiny: Path) -> None:
    messages = [{"role": "user", "content": ""}] * 131_000
    body = json.dumps({**CHAT, "messages": messages}, separators=(",", ":")).encode()  # 3.9 MB
    async with http_server(tiny) as client:
        response, slowest = await models_latency_during(client, "/v1/chat/completions", body)
    print(f"131k chat messages: slowest /v1/models {slowest:.3f} s")
    error = assert_error(response, 400, "messages")
    assert error["code"] == "context_length_exceeded"
    assert slowest < MODELS_DEADLINE


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(
    tiny_big_context: Path, kind: str
) -> None:
    text = "hello world " * 170_000  # 2 MB: within the character bound, tokenized in a thread
    if kind == "chat":
        path, body = (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": text}]},
        )
    else:
        path, body = "/v1/completions", {**COMPLETION, "prompt": text}
    async with http_server(tiny_big_context) as client:
        response, slowest = await models_latency_during(client, path, json.dumps(body).encode())
    print(f"2 MB {kind} prompt: slowest /v1/models {slowest:.3f} s")
    error = assert_error(response, 400, "messages" if kind == "chat" else "prompt")
    assert "tokens long" in error["message"]  # it was tokenized, and found too long
    assert slowest < MODELS_DEADLINE


async def test_the_tokenizer_line_is_bounded_and_refuses_when_full() -> None:
    admission = Admission(1, 0, tokenizer_threads=1, max_tokenizing=2)
    release = threading.Event()
    results: list[int | None] = []

    async def tokenize(value: int) -> None:
        results.append(await admission.tokenize(lambda: release.wait(10) and value))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tokenize, 1)
        nursery.start_soon(tokenize, 2)  # waits for the one thread
        await trio.sleep(0.1)
        assert admission.tokenizing == 2
        assert await admission.tokenize(lambda: 3) is None  # the line is full: a 429
        assert admission.rejected == 1
        release.set()
    assert sorted(results, key=str) == [1, 2]
    assert admission.tokenizing == 0
    assert await admission.tokenize(lambda: 4) == 4


# -- findings 5, 8: bad values are 400s in the envelope, with nothing logged ------------------


def _chat_body(**fields: Any) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


HOSTILE_BODIES = {
    "top_k beyond int64": ("/v1/chat/completions", _chat_body(top_k=2**63), "top_k"),
    "a 5,000-digit integer": (
        "/v1/chat/completions",
        _chat_body(seed=0).replace(b'"seed": 0', b'"seed": ' + b"9" * 5000),
        None,
    ),
    "JSON nested 100,000 deep": (
        "/v1/chat/completions",
        _chat_body(user=0).replace(b'"user": 0', b'"user": ' + b"[" * 100_000 + b"]" * 100_000),
        None,
    ),
    "a denormal temperature": (
        "/v1/chat/completions",
        _chat_body(temperature=5e-324),
        "temperature",
    ),
    "a NaN literal": (
        "/v1/chat/completions",
        _chat_body(temperature=0).replace(b'"temperature": 0', b'"temperature": NaN'),
        None,
    ),
    "a lone surrogate in a prompt": (
        "/v1/completions",
        json.dumps({**COMPLETION, "prompt": "hi \ud800"}).encode(),
        "prompt",
    ),
    "a lone surrogate in a message": (
        "/v1/chat/completions",
        _chat_body(messages=[{"role": "user", "content": "\udfff"}]),
        "messages[0].content",
    ),
    "an over-long stop string": (
        "/v1/chat/completions",
        _chat_body(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]),
        "stop[1]",
    ),
    "logit_bias outside the vocabulary": (
        "/v1/chat/completions",
        _chat_body(logit_bias={"100000": 1}),
        "logit_bias",
    ),
}


async def test_hostile_bodies_get_400_in_the_envelope_and_log_nothing(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with open_pipeline(tiny, stages=1) as pipeline:
        app: Any = create_app(pipeline, model_id="tiny")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as client:
            for name, (path, body, param) in HOSTILE_BODIES.items():
                response = await client.post(path, content=body, headers=JSON)
                assert response.status_code == 400, (name, response.text)
                assert_error(response, 400, param)
            fine = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {}})
            assert fine.status_code == 200, fine.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def asgi_post(app: Any, path: str, body: bytes, content_length: bytes) -> int:
    """POST ``body`` straight to the ASGI app, with any ``content-length``: the status."""
    chunks = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if chunks:
            return chunks.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", content_length)]
    scope = {
        "type": "http", "method": "POST", "path": path, "headers": headers,
        "query_string": b"", "root_path": "", "scheme": "http", "server": ("test", 80),
        "http_version": "1.1",
    }  # fmt: skip
    await app(scope, receive, send)
    return int(sent[0]["status"])


async def test_an_odd_content_length_header_is_not_a_500(tiny: Path) -> None:
    async with open_pipeline(tiny, stages=1) as pipeline:
        app: Any = create_app(pipeline, model_id="tiny")
        # '²' is a digit to str.isdigit but not to int(): the header is ignored, the body read
        assert await asgi_post(app, "/v1/chat/completions", _chat_body(), b"\xb2") == 200
        # 5,000 digits are beyond int()'s limit, and beyond any body limit
        assert await asgi_post(app, "/v1/chat/completions", _chat_body(), b"9" * 5000) == 413


def test_a_denormal_temperature_samples_greedily_without_nan() -> None:
    logits = np.array([0.5, 3.0, -1.0, 2.9], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow or a NaN would warn
        for temperature in (5e-324, 1e-300):
            params = SamplingParams(temperature=temperature, seed=7)
            assert sample_token(logits, params, position=3) == 1


# -- finding 9: parameters stagerun does not implement are refused, neutral values pass -------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"x": -100}),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("n", 17),
        ("logprobs", 1),
        ("top_logprobs", 3),  # without logprobs: true
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("tools", {"type": "function"}),
    ],
)
def test_unsupported_parameters_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse_generation_request({**CHAT, field: value}, "chat")
    assert info.value.status == 400 and info.value.param == field
    assert field in info.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", None),
        ("logit_bias", {}),
        ("tool_choice", "none"),
        ("tool_choice", "auto"),
        ("parallel_tool_calls", True),  # meaningless without tools, which must be empty
        ("functions", []),
        ("function_call", "none"),
        ("modalities", ["text"]),
        ("audio", None),
        ("prediction", None),
        ("n", 1),
        ("logprobs", False),
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("response_format", {"type": "text"}),
        ("tools", []),
    ],
)
def test_neutral_values_of_unsupported_parameters_pass(field: str, value: Any) -> None:
    parse_generation_request({**CHAT, field: value}, "chat")


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", "yes"), ("suffix", "x"), ("best_of", 2), ("logit_bias", {"1": 1000})],
)
def test_unsupported_completion_parameters_are_refused(field: str, value: Any) -> None:
    body = {"model": "tiny", "prompt": "hi", field: value}
    with pytest.raises(ApiError) as info:
        parse_generation_request(body, "completion")
    assert info.value.param == field


# -- finding 10: a hostile chat template stops within its time and size budgets ---------------


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 10**8 }}",
        "{{ ('a' * 1000) * 100000 }}",
        "{{ 'a' + 'b' * 30000000 }}",
        "{{ 'a' | center(10**9) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 9 ** (9 ** 9) }}",
        "{{ (2 ** 60000) * (2 ** 60000) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ ('a' * 1000000).replace('a', 'bbbbbbbbbbbbbbbbbbbb') }}",
        "{{ ('x' * 10000000).join(['a', 'b', 'c']) }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set r = range(100000) | list %}"
        "{% for i in r %}{% for j in r %}{% if j == -1 %}x{% endif %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",  # noqa: E501
    ],
)
def test_a_hostile_chat_template_fails_fast_and_cleanly(template: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError):
        render_chat(
            template, [{"role": "user", "content": "hi"}], bos_token="", eos_token="", timeout=0.5
        )
    assert time.perf_counter() - started < 2.0


def test_the_template_budgets_are_keywords() -> None:
    messages = [{"role": "user", "content": "x" * 50}] * 2
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    text = render_chat(template, messages, bos_token="", eos_token="", max_chars=100)
    assert text == "x" * 100
    with pytest.raises(ChatTemplateError, match="wrote more than 99 characters"):
        render_chat(template, messages, bos_token="", eos_token="", max_chars=99)
    with pytest.raises(ChatTemplateError, match="limit of 49"):  # one value over the budget
        render_chat(template, messages, bos_token="", eos_token="", max_chars=49)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"ran for more than 0\.1 s"):
        render_chat(loop, messages, bos_token="", eos_token="", timeout=0.1)
    assert time.perf_counter() - started < 1.0


async def test_a_client_that_leaves_mid_body_logs_no_internal_error(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that disconnects before its body ends is a client's doing: no 500, no
    traceback in the log (it was "unhandled error ... ClientDisconnect")."""
    caplog.set_level(logging.INFO)
    events: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"model": "tiny", "prompt":', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop(0)
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5), "server": None,
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
    }  # fmt: skip
    async with open_pipeline(tiny, stages=1) as pipeline:
        app: Any = create_app(pipeline, model_id="tiny")
        with trio.fail_after(10):
            await app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
