"""Log-probabilities and penalties over HTTP: OpenAI's shapes, whole and streamed alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_api_surface import served

from stagerun.testing import write_tiny_model

CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}],
                        "temperature": 0, "max_tokens": 12}  # fmt: skip
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "once upon a time", "temperature": 0,
                              "max_tokens": 12}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=2)


@pytest.fixture
def real(smollm2_path: Path) -> Path:
    return smollm2_path  # text that decodes: token bytes join into the answer's text


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


async def test_chat_logprobs_whole_and_streamed(real: Path) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    async with served(real) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        choice = whole["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == whole["usage"]["completion_tokens"] > 0
        text = b"".join(bytes(entry["bytes"]) for entry in content).decode()
        assert text == choice["message"]["content"]
        for entry in content:
            assert len(entry["top_logprobs"]) == 2
            best = entry["top_logprobs"][0]
            assert best["logprob"] >= entry["top_logprobs"][1]["logprob"]
            assert best["token"] == entry["token"] and best["logprob"] == entry["logprob"]  # greedy
        events = await _events(client, "/v1/chat/completions", body)
        streamed = [e for ev in events for c in ev["choices"] if c["logprobs"]
                    for e in c["logprobs"]["content"]]  # fmt: skip
        assert streamed == content
        plain = (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert plain["choices"][0]["logprobs"] is None
        only = {**CHAT, "logprobs": True}
        entries = (await client.post("/v1/chat/completions", json=only)).json()
        assert all(e["top_logprobs"] == [] for e in entries["choices"][0]["logprobs"]["content"])


async def test_completion_logprobs_whole_and_streamed(real: Path) -> None:
    body = {**COMPLETION, "logprobs": 3}
    async with served(real) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        choice = whole["choices"][0]
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        offsets = logprobs["text_offset"]
        assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                       logprobs["top_logprobs"], strict=True):  # fmt: skip
            assert top[token] == logprob and 3 <= len(top) <= 4 and logprob <= 0
        events = await _events(client, "/v1/completions", body)
        pieces = [c["logprobs"] for ev in events for c in ev["choices"] if c["logprobs"]]
        assert [t for p in pieces for t in p["tokens"]] == logprobs["tokens"]
        assert [t for p in pieces for t in p["token_logprobs"]] == logprobs["token_logprobs"]
        assert [t for p in pieces for t in p["text_offset"]] == offsets


async def test_penalties_change_the_answer_and_are_checked(tiny: Path) -> None:
    async with served(tiny) as client:

        async def text(extra: dict[str, Any]) -> str:
            response = await client.post("/v1/completions", json={**COMPLETION, **extra})
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        plain = await text({})
        assert await text({"presence_penalty": 0}) == plain
        changed = [await text({"presence_penalty": 2}), await text({"frequency_penalty": 2}),
                   await text({"repetition_penalty": 3}),
                   await text({"repeat_penalty": 3, "repeat_last_n": -1})]  # fmt: skip
        assert all(t != plain for t in changed), changed
        assert changed[2] == changed[3]  # the same penalty over the whole context
        assert await text({"repeat_penalty": 3, "repeat_last_n": 0}) == plain
        both = {**COMPLETION, "repetition_penalty": 1.1, "repeat_penalty": 1.1}
        response = await client.post("/v1/completions", json=both)
        assert response.status_code == 400 and response.json()["error"]["param"] == "repeat_penalty"


async def test_n_choices_and_echo_whole_and_streamed(real: Path) -> None:
    body = {**COMPLETION, "n": 2, "temperature": 1.0, "seed": 7, "echo": True, "logprobs": 2}
    async with served(real) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        choices = whole["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["text"].startswith(COMPLETION["prompt"]) for c in choices)
        assert choices[0]["text"] != choices[1]["text"]  # each its own seed
        prompt_tokens = whole["usage"]["prompt_tokens"]
        for choice in choices:
            logprobs = choice["logprobs"]
            assert logprobs["token_logprobs"][0] is None
            assert len(logprobs["tokens"]) == prompt_tokens + 12
            assert "".join(logprobs["tokens"]) == choice["text"]
        events = await _events(client, "/v1/completions", body)
        for index, choice in enumerate(choices):
            mine = [c for ev in events for c in ev["choices"] if c["index"] == index]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[-1]["finish_reason"] == choice["finish_reason"]
            scored = [t for c in mine if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
            assert sorted(map(str, scored)) == sorted(
                map(str, choice["logprobs"]["token_logprobs"])
            )
