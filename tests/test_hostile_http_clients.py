"""Hostile HTTP clients against `stagerun serve`: slow ones, and web pages.

Slow clients (security review, finding 6): one that never reads its streamed answer, one whose
body never ends, and a flood of connections that never finish a request, against one live
``stagerun serve --max-batch 1`` started under an open-file limit of `FD_LIMIT` (soft = hard,
so the server cannot raise it). Each must cost the server a bounded time, never its slot, its
open files or ``/health``.

Web pages (finding 9): a page can make a browser POST to a server on localhost (a CORS
"simple request": text/plain, form data, no type) and, by DNS rebinding, even read answers,
under a ``Host`` of the attacker's. The server answers its own host names only (421) and JSON
POSTs only (415); the API key can come from a file instead of the process list.
"""

from __future__ import annotations

import functools
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from test_server_app import GatedPipeline, http_server, wait_until
from test_server_live import LiveServer

from stagerun import open_pipeline
from stagerun._cli._options import build_parser
from stagerun._cli._serve import options_from_args
from stagerun.server import create_app
from stagerun.server._http import ConnectionLimit, serve_http
from stagerun.server._serve import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    ServeError,
    allowed_hosts,
    resolve_api_key,
)
from stagerun.testing import write_tiny_model

FD_LIMIT = 200  # the server's open-file limit: the review's `ulimit -n 200`
SLOW_CONNECTIONS = 220  # more connections than the server has open files
WRITE_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
CONTEXT = 4096  # room for an answer far larger than the socket buffers between client and server
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


class LimitedServer(LiveServer):
    """A `LiveServer` whose process may have only `FD_LIMIT` open files."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._log_file = log.open("wb")
        cmd = [sys.executable, "-m", "stagerun", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log_file, preexec_fn=self._limit_files
        )
        self.url = ""
        self.line = ""

    @staticmethod
    def _limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LimitedServer]:
    folder = tmp_path_factory.mktemp("hostile")
    tiny = write_tiny_model(folder / "tiny.gguf", n_layers=2, context_length=CONTEXT)
    args = ["--model", str(tiny), "--stages", "1", "--max-batch", "1", "--max-queue", "0"]
    args += ["--write-timeout", str(WRITE_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    live = LimitedServer(args, folder / "serve.log")
    try:
        live.wait_ready()
        yield live
    finally:
        live.stop()


TCP_ESTABLISHED = 1  # tcpi_state in Linux's struct tcp_info


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _running(server: LimitedServer) -> int:
    running: int = server.health().json()["requests"]["running"]
    return running


def _completion(server: LimitedServer) -> httpx.Response:
    body = {"model": "tiny", "prompt": "The lighthouse", "max_tokens": 4}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=10)


# -- slow clients ----------------------------------------------------------------------------


def test_a_client_that_stops_reading_gives_up_its_slot_within_the_write_timeout(
    server: LimitedServer,
) -> None:
    """With --max-batch 1, a streaming client that never reads must not lock everyone out."""
    host, port = server.address
    # At temperature 0 the tiny model answers "hi" with no end of text: thousands of events.
    request = {"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT - 8, "temperature": 0}
    body = json.dumps({**request, "stream": True}).encode()
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: fills soon
    reader.connect((host, port))
    try:
        reader.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        start = time.monotonic()
        while _running(server) and time.monotonic() - start < WRITE_TIMEOUT + 10:
            time.sleep(0.05)
        released = time.monotonic() - start
        print(f"\nslot released {released:.2f}s after the request (write timeout {WRITE_TIMEOUT}s)")
        assert released < WRITE_TIMEOUT + 5, "the client that never reads still holds the slot"
        assert _completion(server).status_code == 200  # not 429: the slot is free
        if hasattr(socket, "TCP_INFO"):  # Linux: the server also gives the connection up
            # The server's kernel drops it without a word; a byte sent then draws a reset.
            while _tcp_state(reader) == TCP_ESTABLISHED and time.monotonic() - start < 10:
                reader.send(b"\r\n")
                time.sleep(0.1)
            print(f"connection dropped by the server {time.monotonic() - start:.2f}s after")
            assert _tcp_state(reader) != TCP_ESTABLISHED, "the server still holds the connection"
        reader.settimeout(5)
        received = b""
        try:
            while chunk := reader.recv(65536):
                received += chunk
        except OSError:  # reset: the kernel gave the connection up (TCP_USER_TIMEOUT)
            pass
        assert b"data: [DONE]" not in received  # it was given up, not finished
    finally:
        reader.close()


def test_a_body_that_never_finishes_is_answered_408_and_closed(server: LimitedServer) -> None:
    host, port = server.address
    with socket.create_connection((host, port)) as client:
        client.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            '{"model": "tiny", '.encode()
        )
        start = time.monotonic()
        client.settimeout(BODY_TIMEOUT + 5)
        answer = b""
        while chunk := client.recv(65536):  # to the end: the server closes the connection
            answer += chunk
        elapsed = time.monotonic() - start
    print(f"\nunfinished body answered and closed after {elapsed:.2f}s")
    assert answer.startswith(b"HTTP/1.1 408 ")
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "body" in error["message"]
    assert elapsed < BODY_TIMEOUT + 2


def test_a_flood_of_slow_connections_leaves_health_answering(server: LimitedServer) -> None:
    """More connections than open files, none finishing its request head: /health answers."""
    host, port = server.address
    flood = []
    try:
        for _ in range(SLOW_CONNECTIONS):
            slow = socket.create_connection((host, port), timeout=5)
            slow.sendall(f"GET /health HTTP/1.1\r\nhost: {host}:{port}\r\nx-slow: ".encode())
            flood.append(slow)
        time.sleep(0.5)  # the server has taken them all in
        start = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=2)
        print(
            f"\n/health answered in {time.monotonic() - start:.2f}s beside {len(flood)} slow ones"
        )
        assert health.status_code == 200
        assert _completion(server).status_code == 200
    finally:
        for slow in flood:
            slow.close()


def test_the_connection_limit_closes_the_longest_idle_and_never_a_busy_one() -> None:
    async def main() -> None:
        limit = ConnectionLimit(2)
        scopes = [trio.CancelScope() for _ in range(4)]
        first = limit.open(("10.0.0.1", 1), scopes[0])
        second = limit.open(("10.0.0.1", 2), scopes[1])
        assert first is not None and second is not None
        limit.request_started(("10.0.0.1", 1))  # the older one is busy: the younger goes
        assert limit.open(("10.0.0.1", 3), scopes[2]) is not None
        assert scopes[1].cancel_called and not scopes[0].cancel_called
        limit.close(second)  # its handler's finally: already forgotten
        limit.request_started(("10.0.0.1", 3))
        assert limit.open(("10.0.0.1", 4), scopes[3]) is None  # every one busy: refused
        limit.request_finished(("10.0.0.1", 1))
        assert limit.open(("10.0.0.1", 4), scopes[3]) is not None and scopes[0].cancel_called
        assert repr(limit) == "<ConnectionLimit open=2/2 idle=1 evicted=2 refused=1>"

    trio.run(main)


async def test_at_the_limit_an_idle_connection_makes_room_and_else_a_new_one_gets_503() -> None:
    """`serve_http` with room for two connections, in front of an app that answers when told."""
    answer = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await answer.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    async def read_all(stream: trio.SocketStream) -> bytes:
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                data += chunk
        return data

    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    limit = ConnectionLimit(2)
    request = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = functools.partial(
            serve_http, app, config, limit, write_timeout=5, shutdown_trigger=stop.wait
        )
        host, port = (await nursery.start(serve))[0].removeprefix("http://").rsplit(":", 1)
        silent = await trio.open_tcp_stream(host, int(port))  # never sends a byte
        busy = await trio.open_tcp_stream(host, int(port))
        newcomer = refused = None
        try:
            await busy.send_all(request)
            await wait_until(lambda: len(limit._idle) == 1)  # the request is in flight
            newcomer = await trio.open_tcp_stream(host, int(port))
            assert await read_all(silent) == b""  # closed to make room
            await newcomer.send_all(request)
            await wait_until(lambda: not limit._idle)  # two requests in flight: no room at all
            refused = await trio.open_tcp_stream(host, int(port))
            assert (await read_all(refused)).startswith(b"HTTP/1.1 503 ")
            answer.set()
            assert (await read_all(busy)).startswith(b"HTTP/1.1 200 ")
            assert (await read_all(newcomer)).startswith(b"HTTP/1.1 200 ")
            assert limit.evicted == 1 and limit.refused == 1
        finally:
            for stream in (silent, busy, newcomer, refused):
                if stream is not None:
                    await stream.aclose()
            stop.set()


async def test_generation_does_not_wait_on_a_send_that_never_returns(tmp_path: Path) -> None:
    """hypercorn writes inside a shielded scope, so a deadline around ``send`` cannot end it;
    the app must still give the slot up after the write timeout."""
    tiny = write_tiny_model(tmp_path / "tiny.gguf", n_layers=2)
    unblock = trio.Event()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 3:  # the status line, the role chunk and one token got through
            with trio.CancelScope(shield=True):
                await unblock.wait()

    body = json.dumps({**CHAT, "max_tokens": 200, "stream": True}).encode()

    async def receive() -> dict[str, Any]:
        if not sent and not getattr(receive, "done", False):
            receive.done = True  # type: ignore[attr-defined]
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "root_path": "",
        "scheme": "http", "server": ("test", 80), "http_version": "1.1",
    }  # fmt: skip
    async with open_pipeline(tiny, stages=2, mode="inproc", capacity=1) as pipeline:
        app: Any = create_app(pipeline, model_id="tiny", max_queue=0, write_timeout=0.3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app, scope, receive, send)
            try:
                await wait_until(lambda: len(sent) == 3)
                start = trio.current_time()
                await wait_until(lambda: app.state.admission.running == 0, timeout=3)
                assert trio.current_time() - start < 1.5
                assert pipeline.pool is not None
                await wait_until(lambda: pipeline.pool.busy == 0)  # the lane is back too
            finally:
                unblock.set()  # the blocked write returns; the unfinished response ends
    assert not any(m.get("body", b"").startswith(b"data: [DONE]") for m in sent)


async def test_a_request_past_the_request_timeout_gets_504_or_an_error_event(
    tmp_path: Path,
) -> None:
    tiny = write_tiny_model(tmp_path / "tiny.gguf", n_layers=2)
    async with (
        open_pipeline(tiny, stages=2, mode="inproc", capacity=1) as real,
        http_server(GatedPipeline(real), request_timeout=0.5) as url,  # never opens its gate
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        whole = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50})
        assert whole.status_code == 504
        assert whole.json()["error"]["code"] == "request_timeout"
        body = {**CHAT, "max_tokens": 50, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as streamed:
            lines = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200  # it had begun: the error is the last event
        assert json.loads(lines[-1][6:])["error"]["code"] == "request_timeout"
        assert real.pool is not None
        await wait_until(lambda: real.pool.busy == 0)


# -- web pages -------------------------------------------------------------------------------


def test_only_the_servers_own_host_names_are_answered(server: LimitedServer) -> None:
    host, port = server.address
    for name in (
        f"{host}:{port}",
        f"localhost:{port}",
        f"[::1]:{port}",
        "LOCALHOST",
        "localhost:9",
    ):
        reply = httpx.get(server.url + "/v1/models", headers={"host": name})
        assert reply.status_code == 200, name  # any port: an ssh -L tunnel's is its own
    for name in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.nip.io:{port}"):
        for path in ("/v1/models", "/health", "/metrics"):  # a rebinding page reads them all
            reply = httpx.get(server.url + path, headers={"host": name, "x-request-id": "r1"})
            assert reply.status_code == 421, (name, path)
            assert reply.headers["x-request-id"] == "r1"
            assert reply.json()["error"]["code"] == "invalid_host"
    assert allowed_hosts("127.0.0.1").allows("localhost:8000")
    assert not allowed_hosts("127.0.0.1").allows("10.0.0.1:8000")
    everywhere = allowed_hosts("0.0.0.0", ["api.example.com"])
    for name in ("10.0.0.1:8000", "[fe80::1]:8000", socket.gethostname(), "api.example.com"):
        assert everywhere.allows(name), name  # clients reach it by any address of the machine
    assert not everywhere.allows("attacker.example:8000")  # rebinding names a DNS name
    assert allowed_hosts("::1", ["*"]).allows("anything.example")
    with pytest.raises(ValueError, match="not a host name"):
        allowed_hosts("127.0.0.1", ["http://x"])


def test_a_v1_post_that_is_not_json_is_refused_415(server: LimitedServer) -> None:
    body = json.dumps({**CHAT, "max_tokens": 2}).encode()
    url = server.url + "/v1/chat/completions"
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {} if kind is None else {"content-type": kind}
        reply = httpx.post(url, content=body, headers=headers)  # what a page may send unasked
        assert reply.status_code == 415, kind
        assert reply.json()["error"]["code"] == "unsupported_media_type"
    charset = {"content-type": "Application/JSON; charset=utf-8"}
    assert httpx.post(url, content=body, headers=charset).status_code == 200
    with server.openai() as client:  # it sends Host 127.0.0.1:PORT and application/json
        assert [m.id for m in client.models.list()] == ["tiny"]
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2)  # type: ignore[arg-type]


async def test_an_embedded_app_checks_hosts_only_when_asked(tmp_path: Path) -> None:
    tiny = write_tiny_model(tmp_path / "tiny.gguf", n_layers=2)
    testserver = {"host": "testserver"}  # what Starlette's TestClient sends
    async with open_pipeline(tiny, stages=1, mode="inproc", capacity=1) as pipeline:
        async with http_server(pipeline) as url, httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/v1/models", headers=testserver)).status_code == 200
        async with (
            http_server(pipeline, allowed_hosts=["localhost"]) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            assert (await client.get("/v1/models", headers=testserver)).status_code == 421
            local = {"host": "localhost:1"}
            assert (await client.get("/v1/models", headers=local)).status_code == 200


def test_the_api_key_comes_from_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    key_file = tmp_path / "key.txt"
    key_file.write_text("s3cret-key\n")
    key_file.chmod(0o600)
    assert resolve_api_key(None, "0.0.0.0", key_file=str(key_file)) == "s3cret-key"
    monkeypatch.setenv(API_KEY_FILE_ENV, str(key_file))
    assert resolve_api_key(None, "127.0.0.1") == "s3cret-key"
    assert resolve_api_key("given", "127.0.0.1") == "given"  # the option beats the variable
    with pytest.raises(ServeError, match="not both"):
        resolve_api_key("given", "127.0.0.1", key_file=str(key_file))
    key_file.chmod(0o644)
    with pytest.raises(ServeError, match="chmod 600"):
        resolve_api_key(None, "127.0.0.1")
    key_file.write_text("\n")
    key_file.chmod(0o600)
    with pytest.raises(ServeError, match="is empty"):
        resolve_api_key(None, "127.0.0.1")
    with pytest.raises(ServeError, match="cannot read the API key file"):
        resolve_api_key(None, "127.0.0.1", key_file=str(tmp_path / "missing"))
    caplog.set_level("WARNING", logger="stagerun.serve")
    options = options_from_args(build_parser().parse_args(["serve", "--api-key-file", "k"]))
    assert options.api_key_file == "k" and not caplog.records
    options_from_args(build_parser().parse_args(["serve", "--api-key", "visible"]))
    assert "process listings" in caplog.records[0].message


def test_serve_options_for_slow_clients_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "--request-timeout", "9", "--write-timeout", "2", "--body-timeout", "3",
         "--max-connections", "50", "--allowed-hosts", "api.example.com, localhost:9000"]
    )  # fmt: skip
    options = options_from_args(args)
    assert (options.request_timeout, options.write_timeout, options.body_timeout) == (9, 2, 3)
    assert options.max_connections == 50
    assert options.allowed_hosts == ("api.example.com", "localhost:9000")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--write-timeout", "0"])
