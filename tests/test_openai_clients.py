"""Real clients, unmodified, against a real ``stagerun serve`` on the default model.

The official ``openai`` package for everything issue 30 names (structured output, tools,
logprobs, prompt scoring, ``n``, ``models.retrieve``) and ``instructor`` in its default mode
(tool calling): every call succeeds, every structured answer validates against its schema
and every tool call parses. Greedy where the answer is checked for more than its shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import instructor
import openai
import pytest
from _live_server import LiveServer
from pydantic import BaseModel, Field

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int
    role: Literal["scientist", "writer", "other"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    live = LiveServer(["--stages", "2"], tmp_path_factory.mktemp("log") / "serve.log")
    try:
        live.wait_ready(timeout=300)
        yield live.openai()
    finally:
        live.stop()


def test_parse_with_a_pydantic_model_and_json_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Ada Lovelace, 36, wrote."}],
            response_format=Person, seed=seed, max_tokens=120,
        )  # fmt: skip
        parsed = answer.choices[0].message.parsed
        assert isinstance(parsed, Person)
    answer2 = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give a JSON object with keys name and color "
                                              "for an apple."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200,
    )  # fmt: skip
    assert isinstance(json.loads(answer2.choices[0].message.content or ""), dict)


def test_tools_auto_required_named_and_a_two_turn_loop(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        answer = client.chat.completions.create(
            model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0,
            max_tokens=120,
        )  # fmt: skip
        message = answer.choices[0].message
        if choice == "auto" and not message.tool_calls:
            assert message.content  # it answered in words: allowed with auto
            continue
        assert answer.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls or []:
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
    first = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=named, temperature=0,
        max_tokens=120,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    history: Any = [*ASK, turn, result]
    second = client.chat.completions.create(
        model="smollm2", messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=40,
    )  # fmt: skip
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=120, stream=True,
    )  # fmt: skip
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                calls[delta.index] = delta
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for delta in calls.values():
        assert delta.function.name == "get_weather"  # type: ignore[union-attr]
        json.loads(delta.function.arguments)  # type: ignore[union-attr,arg-type]


def test_logprobs_and_n(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], logprobs=True,
        top_logprobs=3, max_tokens=8, n=2, seed=1,
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        content = choice.logprobs.content  # type: ignore[union-attr]
        assert content and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
        assert "".join(e.token for e in content) == choice.message.content
    assert answer.usage.completion_tokens == sum(  # type: ignore[union-attr]
        len(c.logprobs.content)
        for c in answer.choices  # type: ignore[union-attr,arg-type]
    )


def test_prompt_scoring_on_token_ids(client: openai.OpenAI) -> None:
    prompts = [[1, 504, 2365, 314, 253, 1494], [1, 28, 5579, 30]]
    answer = client.completions.create(
        model="smollm2", prompt=prompts, echo=True, logprobs=5, max_tokens=0,
    )  # fmt: skip
    assert len(answer.choices) == 2
    for choice, prompt in zip(answer.choices, prompts, strict=True):
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == len(prompt)
        assert logprobs.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
        assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None


def test_models_retrieve(client: openai.OpenAI) -> None:
    assert client.models.retrieve("smollm2").id == "smollm2"


def test_instructor_in_its_default_mode(client: openai.OpenAI) -> None:
    patched = instructor.from_openai(client)  # Mode.TOOLS: a named tool call
    person = patched.chat.completions.create(
        model="smollm2", response_model=Person, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Marie Curie was a 66 year old scientist."}],
    )  # fmt: skip
    assert isinstance(person, Person)
