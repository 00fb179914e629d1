"""Tool calling: the formats, their grammars, the rendering of earlier turns, and the parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_api_surface import served

from stagerun.model import open_model
from stagerun.server import ApiError, parse_generation_request
from stagerun.server._tools import (
    Tools,
    parse_tool_output,
    parse_tools,
    render_messages,
    tool_format,
    tool_grammar,
)
from stagerun.testing import write_tiny_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_tools_and_tool_choice_are_checked() -> None:
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert tools is not None and tools.names == ["get_weather", "get_time"]
    assert tools.choice == "required" and tools.parallel
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tools({"tools": [WEATHER, TIME], "tool_choice": named}).choice == "get_time"  # type: ignore[union-attr]
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({"tools": []}) is None
    for body, param in (
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ):  # fmt: skip
        with pytest.raises(ApiError) as info:
            parse_tools(body)
        assert info.value.param == param


def test_an_agents_history_is_taken() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]  # fmt: skip
    request = parse_generation_request({**CHAT, "messages": messages}, "chat")
    assistant, tool = request.messages[1], request.messages[2]
    assert assistant.content == "" and assistant.tool_calls[0]["function"]["name"] == "get_weather"
    assert tool.role == "tool" and tool.tool_call_id == "call_1"
    rendered, extra = render_messages([m.for_template() for m in request.messages], None, "generic")
    assert extra == {}
    assert rendered[2] == {"role": "user", "content": "Result of tool call call_1: rain"}
    assert json.loads(rendered[1]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    native, extra = render_messages([m.for_template() for m in request.messages],
                                    Tools((WEATHER,)), "hermes")  # fmt: skip
    assert extra == {"tools": [WEATHER]}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    for bad in ({"role": "tool", "content": "x"}, {"role": "assistant", "content": None}):
        with pytest.raises(ApiError):
            parse_generation_request({**CHAT, "messages": [bad]}, "chat")


def test_each_template_gets_its_format() -> None:
    assert tool_format(None) == "generic"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") == "mistral"
    assert tool_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3"


@pytest.mark.parametrize(
    ("fmt", "text", "content", "names"),
    [
        ("generic", '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}',
         None, ["get_weather"]),
        ("generic", '{"response":"hello"}', "hello", []),
        ("generic", '{"tool_calls":[{"name":"get_time","arguments":{}},{"name":"get_w', None,
         ["get_time"]),  # cut short: the whole calls count
        ("generic", "plain words", "plain words", []),
        ("hermes", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
         "Sure.", ["get_time"]),
        ("hermes", "no call here", "no call here", []),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, ["get_time"]),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
         ["get_weather"]),
        ("llama3", "It is sunny.", "It is sunny.", []),
    ],
)  # fmt: skip
def test_answers_parse_into_calls(
    fmt: Any, text: str, content: str | None, names: list[str]
) -> None:
    got, calls = parse_tool_output(text, fmt)
    assert got == content
    assert [c["function"]["name"] for c in calls] == names
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("fmt", ["generic", "hermes", "mistral", "llama3"])
@pytest.mark.parametrize("choice", ["auto", "required", "get_weather"])
def test_every_tool_grammar_compiles(tmp_path: Path, fmt: Any, choice: str) -> None:
    from stagerun._engine import Grammars

    model = open_model(write_tiny_model(tmp_path / "tiny.gguf", n_layers=1))
    grammar = tool_grammar(Tools((WEATHER, TIME), choice), fmt)
    if fmt != "generic" and choice == "auto":
        assert grammar is None  # the model answers freely; calls are parsed if it makes any
        return
    assert grammar is not None
    Grammars(model.tokenizer, model.config.vocab_size).check(grammar)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=2)


async def test_a_named_tool_is_called_with_arguments_that_fit_its_schema(tiny: Path) -> None:
    short = json.loads(json.dumps(WEATHER))  # a random model writes strings until stopped
    short["function"]["parameters"]["properties"]["city"]["maxLength"] = 12
    body = {**CHAT, "tools": [short, TIME], "max_tokens": 200, "temperature": 0.7, "seed": 3,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    async with served(tiny) as client:
        for seed in range(4):
            answer = (await client.post("/v1/chat/completions", json={**body, "seed": seed})).json()
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "tool_calls", answer
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert set(json.loads(call["function"]["arguments"])) == {"city"}
        streamed = []
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as response:  # fmt: skip
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:]))
        deltas = [c["delta"] for e in streamed for c in e["choices"] if "tool_calls" in c["delta"]]
        assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather"]
        assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"
