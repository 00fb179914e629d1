"""A live ``stagerun serve`` subprocess, driven with the official ``openai`` client and raw HTTP.

Most tests use the tiny random model (fast); the last one uses the real default model to
show that temperature-0 output through the API equals ``stagerun generate``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _live_server import LiveServer
from _processes import running

from stagerun import SamplingParams, open_pipeline
from stagerun.testing import write_tiny_model
from stagerun.transports import parse_address

MESSAGES = [{"role": "user", "content": "hi"}]
TIMING_KEYS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=6)


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One tiny-model server on 3 stage processes, shared by the module's quick tests."""
    live = LiveServer(["--model", str(tiny)], tmp_path_factory.mktemp("log") / "serve.log")
    try:
        live.wait_ready()
        yield live
    finally:
        live.stop()


def reference(model: Path | str, requests: list[dict[str, Any]]) -> list[str]:
    """What one in-process stage generates for each request (run outside the server)."""

    async def run() -> list[str]:
        out = []
        async with open_pipeline(model, stages=1, threads=1) as pipeline:
            for r in requests:
                result = await pipeline.complete(
                    r["prompt"],
                    chat=r.get("chat", False),
                    max_tokens=r["max_tokens"],
                    sampling=SamplingParams(
                        temperature=r.get("temperature", 0.0), seed=r.get("seed", 0)
                    ),
                    stop=r.get("stop", ()),
                )
                out.append(result.text)
        return out

    return trio.run(run)


def test_serve_prints_one_line_and_the_openai_client_works(server: LiveServer, tiny: Path) -> None:
    assert server.line == f"stagerun serve: listening on {server.url} (3 stages, model tiny)"
    expected = reference(
        tiny,
        [
            {"prompt": MESSAGES, "chat": True, "max_tokens": 12},
            {"prompt": "The quick brown fox", "max_tokens": 10},
        ],
    )
    # A stop string from the middle of the chat answer, with text before it and after it: the
    # two characters nearest the middle that occur there first.
    chat_text = expected[0]
    at = min(
        (i for i in range(1, len(chat_text) - 2) if chat_text.find(chat_text[i : i + 2]) == i),
        key=lambda i: abs(i - len(chat_text) / 2),
    )
    stop = chat_text[at : at + 2]
    with server.openai() as client:
        assert [m.id for m in client.models.list()] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
        )  # type: ignore[arg-type]
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.content == expected[0]
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 12
        timings = (chat.model_extra or {})["timings"]
        assert set(timings) >= TIMING_KEYS and timings["predicted_n"] == 12

        with client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ) as stream:
            chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[0]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens

        text = client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0
        )
        assert text.object == "text_completion"
        assert text.choices[0].text == expected[1]
        assert text.usage is not None and text.usage.total_tokens == text.usage.prompt_tokens + 10
        with client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0, stream=True
        ) as text_stream:
            assert "".join(c.choices[0].text for c in text_stream) == expected[1]

        stopped = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stop=[stop],  # type: ignore[arg-type]
        )
        assert stopped.choices[0].message.content == chat_text[:at]  # kept: what precedes it
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage is not None and stopped.usage.completion_tokens < 12  # cut after it
    metrics = httpx.get(server.url + "/metrics").text
    assert 'stagerun_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert 'stagerun_stage_up{stage="2",' in metrics
    assert "stagerun_completion_tokens_total 0" not in metrics
    assert "stagerun_time_to_first_token_seconds_count 0" not in metrics
    assert 'stagerun_stage_restarts_total{stage="1"} 0' in metrics
    assert "stagerun_recoveries_total 0" in metrics


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
        ({"model": "tiny"}, 400, "messages", "'messages' is required"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": 1}]},
            400,
            "messages[0].content",
            "must be a string",
        ),
        (
            {"model": "tiny", "messages": MESSAGES, "max_tokens": "5"},
            400,
            "max_tokens",
            "must be an integer",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x" * 600}]},
            400,
            "messages",
            "shorten the prompt",
        ),
        ({"model": "gpt-4", "messages": MESSAGES}, 404, "model", "use 'tiny'"),
        ({"model": "tiny", "messages": MESSAGES, "n": 30}, 400, "n", "at most 16"),
        (
            {"model": "tiny", "messages": MESSAGES, "pad": "x" * (4 * 1024 * 1024)},
            413,
            None,
            "larger than",
        ),
    ],
)
def test_bad_requests_get_the_openai_error_envelope(
    server: LiveServer, body: Any, status: int, param: str | None, words: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"x-request-id": "req-1", "content-type": "application/json"}
    response = httpx.post(server.url + "/v1/chat/completions", content=content, headers=headers)
    assert response.status_code == status
    assert response.headers["x-request-id"] == "req-1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    if "shorten" in words:
        assert error["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods_answer_in_the_envelope(server: LiveServer) -> None:
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "no /v1/nothing" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and "use POST" in wrong.json()["error"]["message"]


def _poll_health(server: LiveServer, status: str, timeout: float = 60.0) -> float:
    """Wait until /health says ``status``; the deadline only catches a hang, so it is generous."""
    start = time.monotonic()
    while True:
        if server.health().json()["status"] == status:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"/health not {status!r} after {timeout}s"
        time.sleep(0.05)


def test_health_follows_a_killed_stage_and_errors_map_to_502_and_504(
    tiny: Path, tmp_path: Path
) -> None:
    # Restarts and recovery off: this test is about what a client sees when a stage is gone.
    # A lane secret, so that the stage started by hand below is let in (stage 0 refuses a
    # stranger on a dead stage's port: tests/test_hostile_supervision.py).
    secret = tmp_path / "lane.secret"
    secret.write_bytes(os.urandom(16).hex().encode())
    secret.chmod(0o600)
    env = {"STAGERUN_SECRET_FILE": str(secret)}
    live = LiveServer(
        ["--model", str(tiny), "--no-restart", "--recovery-timeout", "0"],
        tmp_path / "serve.log",
        env={"STAGERUN_STAGE_REPLY_TIMEOUT_SECS": "2", **env},
    )
    restarted: subprocess.Popen[bytes] | None = None
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    try:
        live.wait_ready()
        health = live.health()
        assert health.status_code == 200
        stages = health.json()["stages"]
        assert [s["state"] for s in stages] == ["ready"] * 3
        assert [s["layers"] for s in stages] == [[0, 2], [2, 4], [4, 6]]
        assert all(s["backend"] == "ggml" for s in stages)  # the default, "auto", here
        assert stages[0]["address"] == "local" and "pid" in stages[1] and "pid" in stages[2]
        last = stages[2]

        os.kill(last["pid"], signal.SIGKILL)
        took = _poll_health(live, "unhealthy")
        sick = live.health()
        assert sick.status_code == 503
        assert [s["state"] for s in sick.json()["stages"]] == ["ready", "ready", "unreachable"]
        print(f"/health turned unhealthy {took:.2f}s after the kill")
        failed = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
        assert failed.status_code == 502
        assert failed.json()["error"]["type"] == "api_error"

        _scheme, _host, port = parse_address(last["address"])
        restarted = subprocess.Popen(
            [sys.executable, "-m", "stagerun", "stage", "--model", str(tiny), "--layers", "4:6",
             "--index", "2", "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, **env},
        )  # fmt: skip
        assert restarted.stdout is not None
        assert restarted.stdout.readline().startswith(b"READY ")
        _poll_health(live, "ok")
        assert (
            httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        )

        # A stage that stops answering (but keeps its sockets) is a reply timeout: 504. It is
        # resumed once the answer is in (not on a timer a busy machine could outrun).
        middle = stages[1]["pid"]
        os.kill(middle, signal.SIGSTOP)
        try:
            start = time.monotonic()
            timed_out = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
            waited = time.monotonic() - start
        finally:
            os.kill(middle, signal.SIGCONT)
        assert timed_out.status_code == 504, timed_out.text
        assert timed_out.json()["error"]["code"] == "upstream_timeout"
        # the 2 s reply timeout set above ran out, and not the default of 30 s
        assert 2 <= waited < 15, waited
        assert (
            httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        )
    finally:
        code, _ = live.stop()
        if restarted is not None:
            restarted.kill()
            restarted.wait()
            assert restarted.stdout is not None
            restarted.stdout.close()
    assert code == 0


def test_ctrl_c_stops_the_server_and_every_stage(tiny: Path, tmp_path: Path) -> None:
    live = LiveServer(
        ["--model", str(tiny), "--stages", "3", "--parallel", "2"], tmp_path / "serve.log"
    )
    try:
        live.wait_ready()
        pids = [s["pid"] for s in live.health().json()["stages"][1:]]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
    finally:
        code, rest = live.stop(signal.SIGINT)
    assert code == 0
    assert rest == b""  # the URL line was the only line on stdout
    assert not any(running(pid) for pid in pids)
    assert "Traceback" not in live.log.read_text()


def _start_stage(
    tiny: Path, layers: str, index: int, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagerun", "stage", "--model", str(tiny), "--layers", layers,
         "--index", str(index), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("READY "), line
    return proc, line.split(" ", 1)[1].strip()


def test_serve_joins_the_remote_stages_of_a_topology(tiny: Path, tmp_path: Path) -> None:
    last, last_address = _start_stage(tiny, "3:6", 2)
    middle, middle_address = _start_stage(tiny, "1:3", 1, "--downstream", last_address)
    topology = tmp_path / "topology.toml"
    topology.write_text(
        f'model = "{tiny}"\n[[stages]]\nlayers = [0, 1]\n'
        f'[[stages]]\naddress = "{middle_address}"\nlayers = [1, 3]\n'
        f'[[stages]]\naddress = "{last_address}"\nlayers = [3, 6]\n'
    )
    live = LiveServer(["--topology", str(topology)], tmp_path / "serve.log")
    try:
        assert live.wait_ready().endswith("(3 stages, model tiny)")
        stages = live.health().json()["stages"]
        assert [(s["address"], s["layers"]) for s in stages] == [
            ("local", [0, 1]), (middle_address, [1, 3]), (last_address, [3, 6])
        ]  # fmt: skip
        assert not any("pid" in s for s in stages)  # not ours: no process ids
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).json()
        assert "choices" in answer, answer
        assert (
            answer["choices"][0]["message"]["content"]
            == reference(tiny, [{"prompt": MESSAGES, "chat": True, "max_tokens": 6}])[0]
        )
    finally:
        code, _ = live.stop()
        for proc in (middle, last):
            assert proc.poll() is None  # the server leaves remote stages running
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert code == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_host_starts_from_the_same_topology_file(tiny: Path, tmp_path: Path) -> None:
    """`stagerun stage --topology F --index I` on each host, `stagerun serve --topology F`."""
    ports = [_free_port(), _free_port()]
    topology = tmp_path / "topology.toml"
    topology.write_text(
        f'model = "{tiny}"\n[[stages]]\nlayers = [0, 2]\n'
        f'[[stages]]\naddress = "tcp://127.0.0.1:{ports[0]}"\nlayers = [2, 4]\n'
        f'[[stages]]\naddress = "tcp://127.0.0.1:{ports[1]}"\nlayers = [4, 6]\n'
        f'backend = "numpy"\n'
    )
    stages = []
    for index in (2, 1):
        proc = subprocess.Popen(
            [sys.executable, "-m", "stagerun", "stage", "--topology", str(topology),
             "--index", str(index)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        stages.append(proc)
        assert proc.stdout is not None
        assert (
            proc.stdout.readline().decode().strip() == f"READY tcp://127.0.0.1:{ports[index - 1]}"
        )
    live = LiveServer(["--topology", str(topology)], tmp_path / "serve.log")
    try:
        live.wait_ready()
        assert [s["state"] for s in live.health().json()["stages"]] == ["ready"] * 3
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).json()
        assert (
            answer["choices"][0]["message"]["content"]
            == reference(tiny, [{"prompt": MESSAGES, "chat": True, "max_tokens": 6}])[0]
        )
    finally:
        code, _ = live.stop()
        for proc in stages:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert code == 0


@pytest.mark.parametrize(
    "what", ["dead topology address", "missing model", "empty api key", "empty api key env"]
)
def test_a_stage_that_cannot_start_exits_non_zero_with_one_line(
    what: str, tiny: Path, tmp_path: Path
) -> None:
    env = dict(os.environ)
    if what == "missing model":
        args = ["--model", str(tmp_path / "nope.gguf")]
        words = "does not exist"
    elif what == "empty api key":  # --api-key "$STAGERUN_API_KEY" with the variable unset
        args = ["--model", str(tiny), "--host", "0.0.0.0", "--api-key", ""]
        words = "--api-key is empty"
    elif what == "empty api key env":
        args = ["--model", str(tiny), "--host", "0.0.0.0"]
        env["STAGERUN_API_KEY"] = " "
        words = "$STAGERUN_API_KEY is empty"
    else:
        topology = tmp_path / "topology.toml"
        topology.write_text(
            f'model = "{tiny}"\n[[stages]]\nlayers = [0, 3]\n'
            '[[stages]]\naddress = "tcp://127.0.0.1:9"\nlayers = [3, 6]\n'
        )
        args = ["--topology", str(topology)]
        words = "could not connect to tcp://127.0.0.1:9"
    result = subprocess.run(
        [sys.executable, "-m", "stagerun", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("stagerun: error: ") and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real default model on 3 stages, the defaults of ``stagerun serve`` (and `make run`).

    Not waited for here: a test overlaps its reference run with the server's start.
    """
    live = LiveServer([], tmp_path_factory.mktemp("log") / "serve.log")
    try:
        yield live
    finally:
        code, _ = live.stop()
        assert code == 0


@pytest.mark.slow
def test_eight_concurrent_streaming_clients_on_3_stages(real_server: LiveServer) -> None:
    questions = [
        "Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet.",
        "What is the opposite of hot?", "Name a fruit.", "What do bees make?", "Name an ocean.",
    ]  # fmt: skip
    requests = [
        {"prompt": [{"role": "user", "content": q}], "chat": True, "max_tokens": 12}
        for q in questions
    ]
    expected = reference("smollm2", requests)  # one in-process stage, while the server starts
    assert len(set(expected)) == 8
    line = real_server.wait_ready()
    assert line.endswith("(3 stages, model smollm2)")
    barrier = threading.Barrier(8)

    def client(i: int) -> tuple[str, str | None]:
        with real_server.openai() as api:
            barrier.wait()
            with api.chat.completions.create(
                model="smollm2",
                messages=requests[i]["prompt"],
                max_tokens=12,
                temperature=0,
                stream=True,
            ) as stream:
                chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    assert [text for text, _ in results] == expected
    health = real_server.health().json()
    assert health["lanes"] == {
        "capacity": 16,  # a lane for each of --max-batch's 16
        "idle": 16,
        "busy": 0,
        "replaced": 0,
        "replace_failures": 0,
    }
    assert health["requests"]["rejected"] == 0
    metrics = httpx.get(real_server.url + "/metrics").text
    assert 'stagerun_requests_total{endpoint="/v1/chat/completions",status="200"} 8' in metrics


@pytest.mark.slow
def test_temperature_zero_through_the_api_equals_stagerun_generate(real_server: LiveServer) -> None:
    """Chat requests use the model's chat template; the output is what the CLI prints."""
    question = "What is the capital of France?"
    prompt = "The capital of France is"
    cli = [
        sys.executable,
        "-m",
        "stagerun",
        "generate",
        "--json",
        "--max-tokens",
        "12",
        "--threads",
        "1",
    ]
    generate = [
        subprocess.Popen(
            [*cli, "--chat", question], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        ),
        subprocess.Popen([*cli, prompt], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL),
    ]
    try:
        chat_ref, text_ref = (json.loads(p.communicate(timeout=120)[0]) for p in generate)
    finally:
        for p in generate:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert "Paris" in chat_ref["text"] + text_ref["text"]
    real_server.wait_ready()
    messages = [{"role": "user", "content": question}]
    with real_server.openai() as client:
        chat = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        assert chat.choices[0].message.content == chat_ref["text"]
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(chat_ref["prompt_token_ids"])  # the chat template
        assert chat.usage.completion_tokens == len(chat_ref["token_ids"])
        with client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        ) as stream:
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat_ref["text"]
        text = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=12, temperature=0
        )
        assert text.choices[0].text == text_ref["text"]
        assert text.usage is not None
        assert text.usage.prompt_tokens == len(text_ref["prompt_token_ids"])
        assert chat.usage.prompt_tokens > text.usage.prompt_tokens
        with client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True
        ) as text_stream:
            assert "".join(c.choices[0].text for c in text_stream) == text_ref["text"]


STORY = "Once upon a time, in a small village by the sea, there lived a girl named"


@pytest.mark.slow
def test_a_stage_killed_mid_stream_is_invisible_to_the_client(real_server: LiveServer) -> None:
    """kill -9 of the middle stage while tokens stream: the same text, and a counted recovery.

    On the real model, so the text is varied and decodes (the tiny model's bytes do not).
    Last in the module: the other tests on this server expect no lane to have been replaced.
    """
    real_server.wait_ready()
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 64, "temperature": 0}
    answer = httpx.post(real_server.url + "/v1/completions", json=body, timeout=120).json()
    want = answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 64
    assert len(set(want.split())) >= 8 and "\ufffd" not in want, want  # an oracle that varies
    victim = real_server.health().json()["stages"][1]["pid"]
    pieces: list[str] = []
    with httpx.stream(
        "POST", real_server.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if len(pieces) == 16:
                os.kill(victim, signal.SIGKILL)
    assert len(pieces) > 16
    assert "".join(pieces) == want
    health = real_server.health().json()
    assert health["status"] == "ok"
    middle = health["stages"][1]
    assert middle["pid"] != victim and middle["process"]["restarts"] == 1
    metrics = httpx.get(real_server.url + "/metrics").text
    assert "stagerun_recoveries_total 1\n" in metrics
    assert "stagerun_recovery_failures_total 0\n" in metrics
