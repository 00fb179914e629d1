"""The rest of the OpenAI surface: the field policy, /v1/models/{id}, /tokenize, /detokenize,
``top_k: -1`` and ``usage.prompt_tokens_details.cached_tokens``.

The field policy is checked against docs/api.md's "Request fields" tables both ways: every
field the code honours is documented, every documented field is taken, every neutral-only
field refuses another value by name, every ignored field is accepted and logged once, and a
field nobody declared is refused by name.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from stagerun import open_pipeline
from stagerun.server import ApiError, _fields, create_app, parse_generation_request
from stagerun.server._fields import HONOURED_FIELDS, IGNORED_FIELDS, NEUTRAL_ONLY_FIELDS
from stagerun.testing import write_tiny_model

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hi"}
BODIES = {"chat": CHAT, "completion": COMPLETION}
KEY = "sk-test-surface"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=2)


@asynccontextmanager
async def served(model: Path, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    stop = trio.Event()
    async with open_pipeline(model, stages=2) as pipeline, trio.open_nursery() as nursery:
        app: Any = create_app(pipeline, model_id="tiny", model_aliases=["tiny.gguf"], **settings)
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            async with httpx.AsyncClient(base_url=binds[0], timeout=60) as client:
                client.pipeline = pipeline  # type: ignore[attr-defined]
                yield client
        finally:
            stop.set()


def _documented() -> tuple[set[str], set[str], set[str]]:
    """docs/api.md's request fields: honoured, neutral-only and ignored."""
    section = DOCS.read_text().split("## Request fields", 1)[1].split("\n## ", 1)[0]
    tables: list[set[str]] = []
    for table in re.split(r"\n\n(?=\|)", section):
        rows = [line for line in table.splitlines() if line.startswith("| `")]
        if rows:
            tables.append(
                {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])}
            )
    honoured, neutral, ignored = tables
    return honoured, neutral, ignored


def test_the_documented_fields_are_the_ones_the_code_takes() -> None:
    honoured, neutral, ignored = _documented()
    assert honoured == HONOURED_FIELDS["chat"] | HONOURED_FIELDS["completion"]
    assert neutral == NEUTRAL_ONLY_FIELDS["chat"] | NEUTRAL_ONLY_FIELDS["completion"]
    assert ignored == IGNORED_FIELDS


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "field",
    ["typical_p", "min_tokens", "ignore_eos",
     "stop_token_ids", "reasoning_effort", "chat_template_kwargs", "x" * 100],
)  # fmt: skip
def test_a_field_nobody_declared_is_refused_by_name(kind: str, field: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_generation_request({**BODIES[kind], field: 0.5}, kind)  # type: ignore[arg-type]
    assert info.value.status == 400
    assert info.value.param is not None and field.startswith(info.value.param.rstrip("."))
    assert "docs/api.md" in info.value.message


# A value each honoured field refuses: so every field docs/api.md lists as honoured is parsed.
BAD_VALUES: dict[str, object] = {
    "model": 5, "messages": 5, "prompt": {}, "max_tokens": 0, "max_completion_tokens": 0,
    "temperature": 3, "top_p": 0, "top_k": -2, "seed": "x", "stop": 5, "stream": "x",
    "stream_options": 5, "n": 17, "cache_salt": "", "speculative": "yes", "min_p": 2,
    "logit_bias": 5,
    "logprobs": "x", "top_logprobs": 21, "presence_penalty": 3, "frequency_penalty": -3,
    "repetition_penalty": 0, "repeat_penalty": -1, "repeat_last_n": -2,
    "response_format": {"type": "xml"}, "json_schema": 5, "grammar": "", "guided_json": [],
    "structured_outputs": {}, "guided_regex": "", "guided_choice": [], "guided_grammar": 5,
    "tools": 5, "tool_choice": "sometimes", "parallel_tool_calls": "x", "echo": "x",
}  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_honoured_field_is_parsed(kind: str) -> None:
    assert set(BAD_VALUES) == HONOURED_FIELDS["chat"] | HONOURED_FIELDS["completion"]
    for field in sorted(HONOURED_FIELDS[kind]):  # type: ignore[index]
        body = {**BODIES[kind], field: BAD_VALUES[field]}
        if field == "stream_options":
            body["stream"] = True
        with pytest.raises(ApiError) as info:
            parse_generation_request(body, kind)  # type: ignore[arg-type]
        assert info.value.status == 400, field
        assert (info.value.param or "").startswith(field), (field, info.value.param)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_neutral_only_field_refuses_any_other_value_by_name(kind: str) -> None:
    for field in sorted(NEUTRAL_ONLY_FIELDS[kind]):  # type: ignore[index]
        with pytest.raises(ApiError) as info:
            parse_generation_request({**BODIES[kind], field: "something"}, kind)  # type: ignore[arg-type]
        assert info.value.status == 400 and info.value.param == field, field


def test_ignored_fields_pass_and_are_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fields, "_logged", set())
    with caplog.at_level(logging.INFO, logger="stagerun.server"):
        for _ in range(3):
            for kind, body in BODIES.items():
                extra = {name: "x" for name in IGNORED_FIELDS}
                parse_generation_request({**body, **extra}, kind)  # type: ignore[arg-type]
    logged = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(logged) == len(IGNORED_FIELDS)
    assert all(any(repr(name) in line for line in logged) for name in IGNORED_FIELDS)


def test_top_k_minus_one_is_off() -> None:
    assert parse_generation_request({**CHAT, "top_k": -1}, "chat").knobs.top_k == 0
    assert parse_generation_request({**CHAT, "top_k": 5}, "chat").knobs.top_k == 5
    with pytest.raises(ApiError) as info:
        parse_generation_request({**CHAT, "top_k": -2}, "chat")
    assert info.value.param == "top_k"


async def test_a_model_is_retrieved_by_its_id_or_an_alias(tiny: Path) -> None:
    async with served(tiny) as client:
        listed = (await client.get("/v1/models")).json()["data"][0]
        for name in ("tiny", "tiny.gguf"):
            response = await client.get(f"/v1/models/{name}")
            assert response.status_code == 200 and response.json() == listed
        missing = await client.get("/v1/models/gpt-4o")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


async def test_tokenize_and_detokenize_agree_with_the_tokenizer(tiny: Path) -> None:
    text = "Hello world, once more"
    async with served(tiny) as client:
        tokenizer = client.pipeline.tokenizer  # type: ignore[attr-defined]
        plain = tokenizer.encode(text, add_bos=False)
        with_bos = tokenizer.encode(text, add_bos=True)
        assert plain != with_bos  # so that the two answers below tell add_special apart
        got = (await client.post("/tokenize", json={"content": text})).json()
        assert got == {"tokens": plain, "count": len(plain), "max_model_len": 512}
        got = (await client.post("/tokenize", json={"content": text, "add_special": True})).json()
        assert got["tokens"] == with_bos
        got = (await client.post("/tokenize", json={"prompt": text})).json()
        assert got["tokens"] == with_bos
        got = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert got.json()["tokens"] == plain
        pieces = await client.post("/tokenize", json={"content": text, "with_pieces": True})
        assert [p["id"] for p in pieces.json()["tokens"]] == plain
        assert "".join(p["piece"] for p in pieces.json()["tokens"]) == text
        messages = [{"role": "user", "content": text}]
        chat = await client.post("/tokenize", json={"model": "tiny", "messages": messages})
        assert chat.json()["tokens"] == client.pipeline.apply_chat_template(messages)  # type: ignore[attr-defined]
        back = (await client.post("/detokenize", json={"tokens": plain})).json()
        assert back == {"content": text, "prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/tokenize", {"content": "a", "prompt": "b"}, None, 400),
        ("/tokenize", {}, None, 400),
        ("/tokenize", {"content": 5}, "content", 400),
        ("/tokenize", {"content": "a", "add_bos": True}, "add_bos", 400),
        ("/tokenize", {"content": "a" * 1_000_000}, "content", 400),
        ("/tokenize", {"content": "a", "model": "gpt-4o"}, "model", 404),
        ("/detokenize", {"tokens": [1, 279]}, "tokens", 400),
        ("/detokenize", {"tokens": [1, -1]}, "tokens", 400),
        ("/detokenize", {"tokens": [1] * 513}, "tokens", 400),
        ("/detokenize", {"tokens": "12"}, "tokens", 400),
    ],
)
async def test_tokenizer_requests_out_of_bounds_are_refused(
    tiny: Path, path: str, body: dict[str, Any], param: str | None, status: int
) -> None:
    async with served(tiny) as client:
        response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


async def test_the_tokenizer_endpoints_want_the_key_and_json(tiny: Path) -> None:
    async with served(tiny, api_key=KEY) as client:
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [75]})):
            assert (await client.post(path, json=body)).status_code == 401
            auth = {"authorization": f"Bearer {KEY}"}
            text = {**auth, "content-type": "text/plain"}
            assert (await client.post(path, content=b"{}", headers=text)).status_code == 415
            assert (await client.post(path, json=body, headers=auth)).status_code == 200


async def test_usage_reports_the_prompt_tokens_the_prefix_cache_restored(tiny: Path) -> None:
    prompt = [(7 * i) % 250 + 3 for i in range(300)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with served(tiny) as client:
        cached = []
        for stream in (False, False, True):
            request = {**body, "stream": stream}
            if stream:
                request["stream_options"] = {"include_usage": True}
                lines = []
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                final = json.loads(lines[-2].removeprefix("data: "))
            else:
                final = (await client.post("/v1/completions", json=request)).json()
            usage = final["usage"]
            assert (
                usage["prompt_tokens_details"]["cached_tokens"]
                == final["timings"]["prefix_cached_tokens"]
            )
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= 256 and cached[2] >= 256, cached
