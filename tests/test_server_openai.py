"""The server's pure parts: request parsing, the error envelope, admission, metrics text."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from stagerun.server import Admission, ApiError, parse_generation_request
from stagerun.server._metrics import Metrics
from stagerun.server._openai import parse_json_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error(body: dict[str, Any], kind: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_generation_request(body, kind)  # type: ignore[arg-type]
    return info.value


def test_a_full_chat_request_parses_into_typed_values() -> None:
    req = parse_generation_request(
        {
            **CHAT,
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0,
            "top_p": 0.5,
            "seed": -1,
            "stop": "\n",
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
        },
        "chat",
    )
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "ab")]
    assert (req.max_tokens, req.knobs.temperature, req.knobs.top_p) == (7, 0.0, 0.5)
    assert req.seed == 2**64 - 1
    assert req.stop == ("\n",)
    assert req.stream and req.include_usage


def test_completion_prompts_are_text_or_token_ids() -> None:
    assert parse_generation_request({"model": "m", "prompt": "x"}, "completion").prompt == "x"
    assert parse_generation_request({"model": "m", "prompt": [1, 2]}, "completion").prompt == (1, 2)
    assert parse_generation_request({"model": "m", "prompt": ["x"]}, "completion").prompt == "x"
    defaults = parse_generation_request({"model": "m", "prompt": "x"}, "completion")
    assert (defaults.max_tokens, defaults.seed, defaults.knobs.temperature) == (None, None, 1.0)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": CHAT["messages"]}, "model", "'model' is required"),
        ({"model": 3, "messages": []}, "model", "must be a non-empty string, not an integer"),
        ({"model": "m"}, "messages", "'messages' is required"),
        ({"model": "m", "messages": []}, "messages", "send at least one message"),
        ({"model": "m", "messages": "hi"}, "messages", "must be an array, not a string"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "is required"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
            },
            "messages[1].content",
            "must be a string, not an integer",
        ),
        (
            {"model": "m", "messages": [{"role": "robot", "content": "a"}]},
            "messages[0].role",
            "one of",
        ),
        ({**CHAT, "max_tokens": "10"}, "max_tokens", "must be an integer, not a string"),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
        ({**CHAT, "max_tokens": True}, "max_tokens", "not a boolean"),
        ({**CHAT, "temperature": 3}, "temperature", "between 0 and 2"),
        ({**CHAT, "temperature": "hot"}, "temperature", "must be a number"),
        ({**CHAT, "top_p": 0}, "top_p", "greater than 0"),
        ({**CHAT, "n": 17}, "n", "at most 16"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({**CHAT, "stop": [""]}, "stop[0]", "non-empty string"),
        ({**CHAT, "stream": "yes"}, "stream", "true or false"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
        ({**CHAT, "logprobs": 1}, "logprobs", "true or false"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
        ({**CHAT, "presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ],
)
def test_bad_chat_requests_name_the_field_and_the_fix(
    body: dict[str, Any], param: str, words: str
) -> None:
    error = _error(body)
    assert error.status == 400
    assert error.param == param
    assert words in error.message
    assert error.envelope() == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ("", "empty"),
        ([], "empty"),
        (["a", ""], "empty"),
        (["a"] * 65, "at most 64"),
        ([1, -2], "non-negative"),
        (7, "string or an array"),
    ],
)
def test_bad_completion_prompts(prompt: Any, words: str) -> None:
    error = _error({"model": "m", "prompt": prompt}, "completion")
    assert (error.status, error.param) == (400, "prompt")
    assert words in error.message


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, not an array"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_bodies_must_be_one_json_object(body: bytes, words: str) -> None:
    with pytest.raises(ApiError, match=words):
        parse_json_body(body)


def test_admission_runs_queues_then_refuses_in_order() -> None:
    adm = Admission(max_batch=2, max_queue=1)
    a, b, c = adm.try_admit(), adm.try_admit(), adm.try_admit()
    assert a is not None and b is not None and c is not None
    assert (a.state.value, b.state.value, c.state.value) == ("running", "running", "waiting")
    assert adm.try_admit() is None
    assert (adm.running, adm.queued, adm.rejected) == (2, 1, 1)
    a.release()
    assert c.state.value == "running"  # the slot passed straight to the waiter
    assert (adm.running, adm.queued) == (2, 0)
    a.release()  # idempotent
    assert adm.running == 2
    d = adm.try_admit()
    assert d is not None and d.state.value == "waiting"  # no jumping the line
    d.release()  # leaves the line
    b.release()
    c.release()
    assert (adm.running, adm.queued) == (0, 0)
    assert repr(adm) == "<Admission max_batch=2 running=0 queued=0/1 rejected=1 kv=0/unlimited>"


async def test_a_cancelled_waiter_leaves_the_line_and_frees_nothing_twice() -> None:
    adm = Admission(max_batch=1, max_queue=2)
    first = adm.try_admit()
    assert first is not None
    waiters = [adm.try_admit(), adm.try_admit()]
    woke: list[int] = []

    async def wait(i: int, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        ticket = waiters[i]
        assert ticket is not None
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await ticket.wait()
                woke.append(i)
            finally:
                ticket.release()

    async with trio.open_nursery() as nursery:
        scope0 = await nursery.start(wait, 0)
        await nursery.start(wait, 1)
        scope0.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert adm.queued == 1
        first.release()
    assert woke == [1]
    assert (adm.running, adm.queued) == (0, 0)


def test_metrics_render_prometheus_text() -> None:
    metrics = Metrics()
    metrics.observe_request("/v1/completions", 200, 0.2)
    metrics.observe_request("/v1/completions", 429, 0.001)
    metrics.observe_tokens(5, 7)
    text = metrics.render(admission=Admission(4, 16), pool=None, health=[])
    lines = text.splitlines()
    assert 'stagerun_requests_total{endpoint="/v1/completions",status="429"} 1' in lines
    assert (
        'stagerun_request_duration_seconds_bucket{endpoint="/v1/completions",le="0.25"} 2' in lines
    )
    assert (
        'stagerun_request_duration_seconds_bucket{endpoint="/v1/completions",le="0.1"} 1' in lines
    )
    assert "stagerun_completion_tokens_total 7" in lines
    assert "stagerun_max_batch 4" in lines
    metrics.observe_timings(
        {"prompt_ms": 180.0, "predicted_ms": 900.0, "prefill_chunks": 3, "draft_n": 10,
         "draft_n_accepted": 6}
    )  # fmt: skip
    lines = metrics.render(admission=Admission(4, 16), pool=None, health=[]).splitlines()
    assert 'stagerun_time_to_first_token_seconds_bucket{le="0.25"} 1' in lines
    assert 'stagerun_time_to_first_token_seconds_bucket{le="0.1"} 0' in lines
    assert "stagerun_decode_seconds_count 1" in lines
    assert "stagerun_prefill_chunks_total 3" in lines
    assert "stagerun_draft_tokens_total 10" in lines
    assert "stagerun_draft_tokens_accepted_total 6" in lines
    for line in lines:
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2, line
    assert json.dumps(text)  # plain text, no bytes


def test_serve_defaults_split_the_cores_and_name_the_model() -> None:
    from stagerun.server._serve import default_threads, served_model_id

    assert default_threads(3, cpus=2) == 1
    assert default_threads(2, cpus=8) == 4
    assert served_model_id("smollm2") == "smollm2"
    assert served_model_id("/models/tiny-random.gguf") == "tiny-random"
