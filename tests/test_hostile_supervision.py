"""Finding 7 of the security review: what the supervisor of the stage processes guarantees.

* A stage process never outlives the ``stagerun serve`` or ``stagerun generate`` that started
  it, even one killed with SIGKILL, which runs no cleanup at all: each child exits when the pipe
  its parent holds open (its stdin) reaches EOF.
* Whatever answers on the address of a dead stage is not that stage: ``/health`` follows the
  supervised process, not the handshake, and the stage processes stagerun starts get a lane
  secret of their own, so stage 0 refuses a process that took a dead stage's port.
* A stage that keeps failing is given up (``failed`` in ``/health`` and ``/metrics``), and
  the requests that need it fail at once instead of waiting out the recovery timeout.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _processes import running
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from stagerun import StageServer, SupervisionPolicy, open_pipeline
from stagerun import _proto as proto
from stagerun._driver import _supervise
from stagerun._driver._supervise import EXIT_WITH_PARENT_ENV, StageProcess, spawn_process
from stagerun._errors import StageGivenUpError
from stagerun._wire._auth import SECRET_FILE_ENV
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile, open_model
from stagerun.server import create_app
from stagerun.testing import write_tiny_model

ORPHAN_DEADLINE = 2.0  # seconds: the acceptance criterion for stages left after a SIGKILL
HANDSHAKE = proto.HELLO_SIZE + proto.NONCE_SIZE  # what a client with a secret sends first
# seconds before a killed stage is restarted: the squatter binds its port well before that
RESTART_AFTER = 1.0
# seconds between checks that a given-up stage's port is free again
RECHECK = 0.5
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a long context, so that `stagerun generate` is still generating when it is killed
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_model(path, n_layers=6, context_length=4096)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _read_line(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> bytes:
    assert proc.stdout is not None
    fd, buf, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while not buf:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"nothing on stdout within {timeout}s; log: {log.read_text()}"
        data = os.read(fd, 4096)
        assert data, f"exited ({proc.wait()}); log: {log.read_text()}"
        buf += data
    return buf


def _assert_gone_after_sigkill(parent: subprocess.Popen[bytes], stages: list[int]) -> float:
    """SIGKILL ``parent``; every pid of ``stages`` must be gone within `ORPHAN_DEADLINE`."""
    assert len(stages) == 2 and all(running(pid) for pid in stages)
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    try:
        while any(running(pid) for pid in stages):
            left = [pid for pid in stages if running(pid)]
            assert time.monotonic() - killed < ORPHAN_DEADLINE, f"stages {left} outlived it"
            time.sleep(0.01)
        return time.monotonic() - killed
    finally:
        for pid in stages:  # do not leave them behind when the test fails
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def _started(args: list[str], tmp: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``stagerun ARGS``, its stderr in ``tmp``/log, its temporary files (the lane secret it
    makes, which a SIGKILL leaves behind) in ``tmp``."""
    with (tmp / "log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stagerun", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_no_stage_outlives_a_sigkilled_serve(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("STAGERUN_SECRET", raising=False)
    args = ["serve", "--model", str(tiny), "--stages", "3", "--port", "0"]
    with _started(args, tmp_path) as proc:
        line = _read_line(proc, 120, tmp_path / "log").decode()
        url = line.split("listening on ", 1)[1].split()[0]
        stages = [s["pid"] for s in httpx.get(url + "/health", timeout=10).json()["stages"][1:]]
        assert sorted(stages) == sorted(_children(proc.pid))
        # no secret was given: serve made one for its stages, private to this user
        (secret,) = tmp_path.glob("stagerun-*.secret")
        assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 64
        took = _assert_gone_after_sigkill(proc, stages)
    assert not secret.exists()  # the orphaned stages removed it as they exited
    print(f"stage processes gone {took * 1000:.0f} ms after SIGKILL of serve")


def test_no_stage_outlives_a_sigkilled_generate(tiny: Path, tmp_path: Path) -> None:
    args = ["generate", "--model", str(tiny), "--stages", "3", "--max-tokens", "4000", "hi"]
    with _started(args, tmp_path) as proc:
        _read_line(proc, 120, tmp_path / "log")  # the first token: every stage is computing
        stages = _children(proc.pid)
        took = _assert_gone_after_sigkill(proc, stages)
    print(f"stage processes gone {took * 1000:.0f} ms after SIGKILL of generate")


_PARENT = """
import os, subprocess, sys, time
read, _write = os.pipe()  # the write end stays here only: it closes when this process dies
child = subprocess.Popen(sys.argv[1:], stdin=read, env={**os.environ, "%s": "1"})
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_stage_killed_while_it_imports_goes_within_milliseconds(tiny: Path) -> None:
    """The parent dies while its stage is still starting (importing numpy and the model code,
    about half a second): the stage must not wait for its imports to notice."""
    took = []
    for _ in range(3):
        stage = [sys.executable, "-P", "-m", "stagerun", "stage", "--model", str(tiny),
                 "--layers", "0:6", "--port", "0"]  # fmt: skip
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT % EXIT_WITH_PARENT_ENV, *stage], stdout=subprocess.PIPE
        )
        assert parent.stdout is not None
        with parent.stdout:
            child = int(parent.stdout.readline())
        time.sleep(0.05)  # the child runs the interpreter's start and begins its imports
        assert running(child)
        started = time.monotonic()
        parent.kill()
        parent.wait()
        try:
            while running(child):
                assert time.monotonic() - started < ORPHAN_DEADLINE, "the stage outlived it"
                time.sleep(0.002)
        finally:
            if running(child):
                os.kill(child, signal.SIGKILL)
        took.append(time.monotonic() - started)
    print("stage gone " + ", ".join(f"{t * 1000:.0f}" for t in took) + " ms after its parent")
    assert max(took) < 0.25, took


# -- an impostor on a dead stage's port ------------------------------------------------------


@asynccontextmanager
async def _http(pipeline: Any) -> AsyncIterator[httpx.AsyncClient]:
    """``pipeline``'s HTTP app on a loopback port, and a client for it."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    stop = trio.Event()
    app: Any = create_app(pipeline, model_id="tiny")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            async with httpx.AsyncClient(base_url=binds[0], timeout=30) as client:
                yield client
        finally:
            stop.set()


async def _kill(process: StageProcess) -> str:
    """SIGKILL a stage process and wait until its port is free; its address."""
    pid, address = process.pid, process.address
    assert pid is not None and address is not None
    os.kill(pid, signal.SIGKILL)
    with trio.fail_after(10):
        while running(pid):  # noqa: ASYNC110 (no event tells when another process dies)
            await trio.sleep(0.01)
    return address


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class Liar:
    """A plain listener that answers READY to any hello and records everything it is sent."""

    def __init__(self) -> None:
        self.received: list[bytearray] = []  # one per connection, as it arrives

    @property
    def connections(self) -> int:
        return len(self.received)

    async def handle(self, stream: trio.SocketStream) -> None:
        data = bytearray()
        self.received.append(data)
        async with stream:
            try:
                while len(data) < proto.HELLO_SIZE:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    data += chunk
                await stream.send_all(proto.encode_ready())
                while chunk := await stream.receive_some(65536):
                    data += chunk
            except trio.BrokenResourceError:
                pass


def _secret_files(folder: Path) -> list[Path]:
    return list(folder.glob("stagerun-*.secret"))


def _samples(text: str) -> dict[str, float]:
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


async def test_a_squatter_on_a_dead_stage_port_gets_no_work_and_the_stage_returns_when_it_goes(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No secret was given: the stage processes get one of their own, so stage 0 refuses the
    squatter; the restarts that find their port taken exhaust the cap, and from then on
    requests fail at once, naming the stage. Once the squatter goes, the stage is started
    again where it was, and requests are served."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("STAGERUN_SECRET", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the secret file goes
    # two exits give up: the kill, then one restart that finds the port taken
    supervision = SupervisionPolicy(
        max_failures=2, probe_interval=0, backoff=RESTART_AFTER, recheck_interval=RECHECK
    )
    liar = Liar()
    async with (
        open_pipeline(
            tiny, stages=2, mode="processes", supervision=supervision, reply_timeout=5
        ) as pipeline,
        _http(pipeline) as client,
    ):
        assert (await client.get("/health")).json()["status"] == "ok"
        assert len(_secret_files(tmp_path)) == 1
        process = pipeline.stages[1].process
        address = await _kill(process)
        listeners = await trio.open_tcp_listeners(_port(address), host="127.0.0.1")
        async with trio.open_nursery() as squatting:
            squatting.start_soon(trio.serve_listeners, liar.handle, listeners)
            waited = await _given_up_while_squatted(pipeline, client, process, address, liar)
            squatting.cancel_scope.cancel()
        for listener in listeners:
            await listener.aclose()
        left = time.monotonic()
        with trio.fail_after(10 * RECHECK + 10):  # a recheck, then the start (model load)
            while process.state != "running":  # noqa: ASYNC110 (the supervisor has no event)
                await trio.sleep(0.05)
        back = time.monotonic() - left
        assert process.given_up is None and process.address == address
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert (await client.get("/health")).json()["status"] == "ok"
    assert [len(data) for data in liar.received] == [HANDSHAKE] * len(liar.received)
    assert not _secret_files(tmp_path)  # removed with the pipeline
    print(
        f"a request failed {waited * 1000:.0f} ms after the stage was given up; "
        f"it served again {back:.2f} s after the squatter left"
    )


async def _given_up_while_squatted(
    pipeline: Any, client: httpx.AsyncClient, process: StageProcess, address: str, liar: Liar
) -> float:
    """The stage is given up while ``liar`` holds its port; how long a request took to fail."""
    health = await client.get("/health")
    assert health.status_code == 503, health.text
    assert health.json()["stages"][1]["state"] in ("restarting", "starting", "failed")
    reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 502, reply.text
    # Every lane stage 0 opened to the squatter stopped at the hello and the client
    # nonce: the squatter could not prove it holds the secret, so it got no frame.
    assert liar.connections >= 1
    assert [len(data) for data in liar.received] == [HANDSHAKE] * len(liar.received)

    with trio.fail_after(30):
        while process.state != "failed":  # noqa: ASYNC110 (the supervisor has no event)
            await trio.sleep(0.05)
    entry = (await client.get("/health")).json()["stages"][1]
    assert entry["state"] == "failed" and entry["probe"] == "unreachable"
    assert entry["process"]["given_up"].startswith("stage 1 failed: its process exited 2")
    metrics = _samples((await client.get("/metrics")).text)
    assert metrics['stagerun_stage_process_state{stage="1",state="failed"}'] == 1
    assert metrics['stagerun_stage_process_state{stage="1",state="running"}'] == 0
    assert metrics[f'stagerun_stage_up{{stage="1",address="{address}"}}'] == 0

    started = time.monotonic()
    reply = await client.post("/v1/chat/completions", json=CHAT)
    waited = time.monotonic() - started
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert "stage 1 failed" in error["message"] and "retry later" not in error["message"]
    assert error["code"] == "stage_failed"
    assert waited < 5, f"{waited:.1f}s (the recovery timeout is 60 s)"
    with pytest.raises(StageGivenUpError, match="stage 1 failed"):
        await pipeline.complete("hi", max_tokens=4)
    return waited


async def test_health_follows_the_supervised_process_not_whoever_answers(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a process that holds the lane secret and answers the handshake on a dead stage's
    address is not that stage while its supervisor is restarting it."""
    secret_file = tmp_path / "lane.secret"
    secret_file.write_bytes(os.urandom(16).hex().encode())
    secret_file.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret_file))
    model = open_model(tiny)
    async with (
        open_pipeline(
            tiny, stages=2, mode="processes", supervision=SupervisionPolicy(backoff=RESTART_AFTER)
        ) as pipeline,
        _http(pipeline) as client,
        trio.open_nursery() as nursery,
    ):
        assert (await client.get("/health")).json()["status"] == "ok"
        stage = pipeline.stages[1]
        address = await _kill(stage.process)
        impostor = StageServer(NumpyBackend(model, stage.layers), index=1)
        await nursery.start(impostor.serve, address)

        health = await client.get("/health")
        assert health.status_code == 503, health.text
        entry = health.json()["stages"][1]
        assert entry["probe"] == "ready"  # the handshake alone would say it serves
        assert entry["state"] in ("restarting", "starting")
        metrics = _samples((await client.get("/metrics")).text)
        assert metrics[f'stagerun_stage_up{{stage="1",address="{address}"}}'] == 0
        nursery.cancel_scope.cancel()


def test_a_stage_whose_port_is_taken_says_so_in_one_line(tiny_model: ModelFile) -> None:
    """What the supervisor logs for a restart that finds its port taken: one line naming the
    address, exit status 1, no traceback."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "stagerun", "stage", "--model", str(tiny_model.path),
             "--layers", f"0:{tiny_model.config.n_layers}", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"stagerun: error: cannot listen on tcp://127.0.0.1:{port}:" in done.stderr


def test_no_server_outlives_a_sigkilled_bench(tiny: Path, tmp_path: Path) -> None:
    # bench serve: its server writes to a file, so no broken pipe would end it either
    args = ["bench", "serve", "--model", str(tiny), "--stages", "2", "--clients", "1",
            "--requests-per-client", "100000"]  # fmt: skip
    with _started(args, tmp_path) as proc:
        deadline = time.monotonic() + 120
        while not (served := _children(proc.pid)) or not _children(served[0]):
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "the bench's server never started its stages"
            time.sleep(0.05)
        (serve,) = served
        took = _assert_gone_after_sigkill(proc, [serve, *_children(serve)])
    print(f"the bench's server and its stages gone {took * 1000:.0f} ms after SIGKILL of bench")


DEAF_TO_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("deaf", flush=True)
time.sleep(600)
"""


async def test_a_child_deaf_to_sigterm_is_killed_when_its_supervision_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As a stage whose compute thread hung: its event loop ends on SIGTERM, its process does
    # not. Warnings are errors here (pyproject.toml), as they were when trio's own stop raised
    # its "Trying SIGKILL" warning instead of killing, and the stop waited, shielded, forever.
    monkeypatch.setattr(_supervise, "STOP_GRACE_S", 0.5)
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            spawn_process, [sys.executable, "-c", DEAF_TO_SIGTERM]
        )
        assert proc.stdout is not None
        said = b""
        while not said.endswith(b"\n"):  # print may write its line in two pieces
            piece = await proc.stdout.receive_some()
            assert piece, f"the child ended after saying {said!r}"
            said += piece
        assert said == b"deaf\n"
        nursery.cancel_scope.cancel()
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 30
