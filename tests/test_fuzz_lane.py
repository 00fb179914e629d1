"""Fuzzing a lane past its handshake: hostile frame sequences reach the stage's compute.

A hostile peer that completed the handshake (with the lane secret, or on a stage without
one) sends a valid Configure, then a sequence of requests built with the real codec: shapes,
positions, request ids, dtypes and payloads chosen to hurt. Every example checks that:

* a frame no honest upstream sends (broken on the wire, or a reply kind) closes that lane
  and nothing else, and is counted in `protocol_errors`; otherwise the lane stays open;
* every request on a lane that stays open is accounted for: one reply (an Ack, Predictions,
  Cancelled or an Error that says what was wrong), or a stale window the stage counted as
  dropped or stopped; nothing else, and no Error that leaks an internal failure;
* another lane's request on the same stage is untouched (its predictions match a direct
  compute), the stage ends up holding no lanes and no sessions, and an honest pipeline
  afterwards produces exactly the tokens it produced before any fuzzing.

Each example is bounded by `trio.fail_after`: a stage that hangs fails it.
"""

from __future__ import annotations

import math
import re
import struct
import tracemalloc
from collections.abc import Callable
from logging import ERROR

import attrs
import msgpack
import numpy as np
import pytest
import trio
from _stage_client import honest_request
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stagerun import LaneError, open_pipeline
from stagerun import _proto as proto
from stagerun._stage._server import StageServer
from stagerun._stage._worker import MAX_SESSIONS_PER_LANE
from stagerun._wire._auth import SECRET_ENV, SECRET_FILE_ENV
from stagerun._wire._connect import open_connection
from stagerun._wire._framed import FrameStream
from stagerun.backends import NumpyBackend
from stagerun.model import ModelFile

SECRET = b"a lane secret for the fuzzer only"
PROMPT = "The lighthouse keeper"
OWN, VICTIM, UNKNOWN, SENTINEL = 11, 22, 33, 99  # request ids
OWN_KEY, VICTIM_KEY, NOBODYS_KEY = 1011, 1022, 1099  # return keys
REQUEST_IDS = {"own": OWN, "victim": VICTIM, "unknown": UNKNOWN}
EXAMPLE_SECONDS = 30.0  # a stuck stage fails the example; a healthy one takes well under 1 s

LAYOUTS = {  # stage 0's layers, then the stage servers' (the last one is the last stage)
    "last": [(0, 2), (2, 4)],
    "middle": [(0, 1), (1, 2), (2, 4)],
}

ALLOWED_ERRORS = re.compile(
    r"request \d+ was not configured on this lane"
    r"|stage \d has no return connection for this lane"
    r"|compute failed: `hidden` must be \[T, \d+\] with T >= 1, not \(\d+, \d+\)\."
    r"|compute failed: `hidden` holds -?(nan|inf) at row \d+, column \d+: activations must be"
    r"|compute failed: position \d+ leaves a gap: the KV cache holds only \d+ tokens\."
    r"|compute failed: positions up to \d+ exceed the context length \d+\."
    r"|compute failed: layers \d+\.\.\d+ computed values that are not finite"
)


@attrs.frozen
class Op:
    """One hostile frame of a sequence (see `_render`)."""

    kind: str  # prefill, decode, verify, trim, cancel, configure, stop, reply, broken
    request: str  # own, victim (another lane's request id) or unknown
    position: int | None  # None: the own session's next position
    tokens: int
    payload: str  # see `_activations`
    window: int
    flag: bool  # prefill: predict; configure: a return key nobody parked
    breakage: str  # broken: how the frame is broken on the wire (see `_break`)


HONEST_PAYLOADS = ("f32", "f16", "q8")
PAYLOADS = (*HONEST_PAYLOADS * 3, "narrow", "wide", "one column", "nan", "inf",
            "-inf", "f16 overflow", "huge")  # fmt: skip
BREAKAGES = ("rows", "dtype", "cols", "negative position", "float position", "bool position",
             "negative token", "missing field", "extra field", "short payload", "q8 scale",
             "unknown kind")  # fmt: skip
REPLIES = ("ack", "predictions", "cancelled", "error")
KINDS = ("prefill", "decode", "verify", "verify", "verify", "trim", "cancel", "cancel", "configure",
         "stop")  # fmt: skip
CLOSING_KINDS = ("reply", "broken")  # either ends the lane: it comes last in a sequence


def _ops(kinds: tuple[str, ...]) -> st.SearchStrategy[Op]:
    return st.builds(
        Op,
        kind=st.sampled_from(kinds),
        request=st.sampled_from(("own", "own", "own", "victim", "unknown")),
        position=st.one_of(
            st.none(),
            st.none(),
            st.none(),
            st.integers(0, 12),  # backwards, repeated or a gap
            st.sampled_from((511, 512, 600, 2**40, 2**63 - 1)),  # at or past the context (512)
        ),
        tokens=st.integers(1, 5),
        payload=st.sampled_from(PAYLOADS),
        window=st.integers(1, 4),
        flag=st.booleans(),
        breakage=st.sampled_from(BREAKAGES),
    )


sequences = st.one_of(  # two in three sequences keep their lane open to the end
    st.lists(_ops(KINDS), min_size=1, max_size=8),
    st.lists(_ops(KINDS), min_size=1, max_size=8),
    st.builds(lambda body, end: [*body, end], st.lists(_ops(KINDS), max_size=7),
              _ops(CLOSING_KINDS)),
)  # fmt: skip


def _activations(payload: str, rows: int, d_model: int) -> tuple[np.ndarray, proto.ActivationDType]:
    """Activation rows as a hostile or honest upstream might send them, and their dtype."""
    width = {"narrow": d_model - 1, "wide": d_model + 1, "one column": 1}.get(payload, d_model)
    hidden = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
    special = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "f16 overflow": 1e6, "huge": 1e30}
    if payload in special:
        hidden[rows // 2, width // 3] = special[payload]
    dtype: proto.ActivationDType = "f32"
    if payload in ("f16", "f16 overflow", "q8"):
        dtype = "q8" if payload == "q8" else "f16"
    return hidden, dtype


def _break(frame: bytes, how: str) -> bytes:
    """``frame`` (a real Prefill/Decode/Verify frame) broken on the wire in one way."""
    header_len, _ = struct.unpack_from("<II", frame)
    header = msgpack.unpackb(frame[8 : 8 + header_len])
    payload = frame[8 + header_len :]
    fields, layout = header["fields"], header["layout"]
    match how:
        case "rows":
            layout["rows"] += 1
        case "dtype":
            layout["dtype"] = "f64"
        case "cols":
            layout["cols"] = 0
        case "negative position":
            fields["position"] = -1
        case "float position":
            fields["position"] = 1.5
        case "bool position":
            fields["position"] = True
        case "negative token":
            fields["tokens"][0] = -1
        case "missing field":
            del fields["position"]
        case "extra field":
            fields["layer"] = 3
        case "short payload":
            payload = payload[:-1]
        case "q8 scale":  # the frame is q8: its first row's scale becomes NaN
            layout["dtype"], payload = "q8", struct.pack("<f", math.nan) + payload[4:]
        case "unknown kind":
            header["kind"] = "compute"
    packed = msgpack.packb(header)
    return struct.pack("<II", len(packed), len(payload)) + packed + payload


def _reply(kind: str) -> proto.Message:
    return {
        "ack": proto.Ack(request_id=OWN),
        "predictions": proto.Predictions(request_id=OWN, window_id=1, position=0, tokens=(5,)),
        "cancelled": proto.Cancelled(request_id=OWN, epoch=0, window_ids=(1,)),
        "error": proto.Error(request_id=OWN, stage_index=0, message="no"),
    }[kind]


@attrs.define
class Expected:
    """What a sequence must get back: replies owed, or that the lane is closed."""

    frames: list[bytes] = attrs.Factory(list)
    replies: int = 0  # Ack, Predictions, Cancelled or Error, one per request
    windows: int = 0  # Verify frames: a stale one may be dropped or stopped instead
    closes: bool = False


def _render(sequence: list[Op], d_model: int) -> Expected:
    """The frames of a sequence (up to the first that closes the lane) and what they are owed."""
    out = Expected()
    cursor = 0  # the own session's next position, as far as the sequence can tell
    for op in sequence:
        request = REQUEST_IDS[op.request]
        position = cursor if op.position is None else op.position
        message: proto.Message
        if op.kind in ("prefill", "decode", "verify", "broken"):
            kind = (
                ("prefill", "decode", "verify")[op.window % 3] if op.kind == "broken" else op.kind
            )
            if kind == "verify":
                message = proto.Verify(
                    request_id=request, window_id=op.window, epoch=0, position=position,
                    tokens=tuple(range(1, op.tokens + 1)),
                )  # fmt: skip
                out.windows += op.kind == "verify"
            elif kind == "decode":
                message = proto.Decode(
                    request_id=request, position=position, tokens=(7,) * op.tokens
                )
            else:
                message = proto.Prefill(
                    request_id=request, chunk_index=0, position=position,
                    tokens=tuple(range(op.tokens)), predict=op.flag,
                )  # fmt: skip
            hidden, dtype = _activations(op.payload, op.tokens, d_model)
            if op.kind == "broken":
                dtype = "q8" if op.breakage == "q8 scale" else "f32"
                if hidden.shape[1] != d_model or not np.isfinite(hidden).all():
                    hidden = np.zeros((op.tokens, d_model), np.float32)
                out.frames.append(_break(proto.encode_frame(message, hidden, dtype), op.breakage))
                out.closes = True
                return out
            out.frames.append(proto.encode_frame(message, hidden, dtype))
            out.replies += 1
            if op.request == "own" and position <= cursor and op.payload in HONEST_PAYLOADS:
                cursor = position + op.tokens
            continue
        if op.kind == "reply":
            out.frames.append(proto.encode_frame(_reply(REPLIES[op.window % len(REPLIES)])))
            out.closes = True
            return out
        if op.kind == "trim":
            message = proto.Trim(request_id=request, position=position)
            cursor = min(cursor, position) if op.request == "own" else cursor
        elif op.kind == "cancel":
            message = proto.Cancel(
                request_id=request, epoch=0, window_ids=(op.window, op.window + 1)
            )
        elif op.kind == "configure":
            key = NOBODYS_KEY if op.flag else OWN_KEY
            message = proto.Configure(request_id=request, return_key=key, prompt_len=3)
            cursor = 0 if op.request == "own" and not op.flag else cursor
        else:
            message = proto.Stop(request_id=request)
        out.frames.append(proto.encode_frame(message))
        out.replies += 1
    return out


class _Client:
    """A lane and its return connection, opened as stage 0 opens them; both read as they go."""

    def __init__(self, lane: FrameStream, back: FrameStream) -> None:
        self.lane, self.back = lane, back
        self.up: list[proto.Message] = []  # what came back on the lane
        self.returned: list[proto.Message] = []  # what came back on the return connection
        self.closed = False  # the stage closed the lane

    @classmethod
    async def open(
        cls, nursery: trio.Nursery, servers: list[StageServer], key: int, secret: bytes | None
    ) -> _Client:
        first, last = servers[0].address, servers[-1].address
        assert first is not None and last is not None
        back = await open_connection(
            last, role=proto.Role.RETURN, key=key, connect_timeout=5, ready_timeout=5,
            secret=secret,
        )  # fmt: skip
        lane = await open_connection(
            first, role=proto.Role.LANE, connect_timeout=5, ready_timeout=5, secret=secret
        )
        client = cls(lane, back)
        nursery.start_soon(client._read, lane, client.up)
        nursery.start_soon(client._read, back, client.returned)
        return client

    async def _read(self, stream: FrameStream, into: list[proto.Message]) -> None:
        try:
            while True:
                into.append((await stream.receive()).message)
        except LaneError:
            if stream is self.lane:
                self.closed = True

    async def aclose(self) -> None:
        await self.lane.aclose_forcefully()
        await self.back.aclose_forcefully()


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``; the caller's ``fail_after`` bounds the wait (a hang fails)."""
    while not condition():  # noqa: ASYNC110 -- stage counters and lists have no events
        await trio.sleep(0.005)


async def _start_stages(
    nursery: trio.Nursery, model: ModelFile, layout: list[tuple[int, int]], secret: bytes | None
) -> list[StageServer]:
    servers: list[StageServer] = []
    downstream: str | None = None
    for index in range(len(layout) - 1, 0, -1):
        backend = NumpyBackend(model, layout[index])
        server = StageServer(backend, index=index, downstream=downstream, secret=secret)
        downstream = await nursery.start(server.serve)
        servers.insert(0, server)
    return servers


def _greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits[-1]))


def _victim_reference(servers: list[StageServer], rows: np.ndarray, row: np.ndarray) -> list[int]:
    """What the victim lane must be told: its prefill's and its decode's greedy tokens."""
    caches = [s.backend.new_cache() for s in servers]
    out = []
    for position, hidden in ((0, rows), (3, row)):
        for server, cache in zip(servers, caches, strict=True):
            hidden = server.backend.forward(cache, position, hidden=hidden)
        out.append(_greedy(hidden))
    return out


async def _honest_tokens(
    model: ModelFile, layout: list[tuple[int, int]], servers: list[StageServer]
) -> list[int]:
    remote = [s.address for s in servers if s.address is not None]
    async with open_pipeline(model, layers=layout, remote=remote) as pipeline:
        result = await pipeline.complete(PROMPT, max_tokens=24)
    return result.token_ids


@pytest.fixture(scope="module")
def honest_ids(tiny_model: ModelFile) -> dict[str, list[int]]:
    """The tokens an honest pipeline produces for each layout, before any fuzzing."""

    async def main(layout: list[tuple[int, int]]) -> list[int]:
        async with trio.open_nursery() as nursery:
            servers = await _start_stages(nursery, tiny_model, layout, None)
            ids = await _honest_tokens(tiny_model, layout, servers)
            nursery.cancel_scope.cancel()
        return ids

    ids = {name: trio.run(main, layout) for name, layout in LAYOUTS.items()}
    for name, tokens in ids.items():
        assert len(set(tokens)) >= 8, f"the {name} oracle repeats itself: {tokens}"
    assert ids["last"] == ids["middle"]
    return ids


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=sequences, authenticated=st.booleans(), burst=st.booleans())
def test_hostile_frame_sequences_on_an_open_lane(
    tiny_model: ModelFile,
    honest_ids: dict[str, list[int]],
    caplog: pytest.LogCaptureFixture,
    layout: str,
    sequence: list[Op],
    authenticated: bool,
    burst: bool,
) -> None:
    """``burst``: the whole sequence in one write, so the stage reads it all ahead of its
    compute (a ``Cancel`` then meets queued windows); else one frame per write."""
    layers = LAYOUTS[layout]
    d_model = tiny_model.config.d_model
    secret = SECRET if authenticated else None
    expected = _render(sequence, d_model)
    rng = np.random.default_rng(5)
    victim_rows = rng.standard_normal((3, d_model)).astype(np.float32)
    victim_row = rng.standard_normal((1, d_model)).astype(np.float32)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            servers = await _start_stages(nursery, tiny_model, layers, secret)
            with trio.fail_after(EXAMPLE_SECONDS):
                await _fuzz_one_lane(nursery, servers, secret, expected, burst,
                                     victim_rows, victim_row)  # fmt: skip
                # Nothing is left behind once the lanes are gone.
                await _until(lambda: all(s.lanes_open == s.sessions_open == 0 for s in servers))
                # And the stage still serves an honest pipeline, token for token.
                assert await _honest_tokens(tiny_model, layers, servers) == honest_ids[layout]
            nursery.cancel_scope.cancel()

    caplog.clear()
    with pytest.MonkeyPatch.context() as env:
        env.setattr(
            "stagerun._stage._server.SINK_WAIT_SECONDS", 0.2
        )  # a Configure with nobody's key
        env.delenv(SECRET_FILE_ENV, raising=False)
        if secret is None:
            env.delenv(SECRET_ENV, raising=False)
        else:
            env.setenv(SECRET_ENV, secret.decode())  # for the pipeline and the middle's hop
        trio.run(main)
    # A lane that ended in an exception the stage did not expect is a bug, even if it closed.
    failures = [r for r in caplog.records if r.name == "stagerun.stage" and r.levelno >= ERROR]
    assert not failures, [r.getMessage() for r in failures]


async def _fuzz_one_lane(
    nursery: trio.Nursery,
    servers: list[StageServer],
    secret: bytes | None,
    expected: Expected,
    burst: bool,
    victim_rows: np.ndarray,
    victim_row: np.ndarray,
) -> None:
    def stale() -> int:
        return sum(s.stale_dropped + s.stale_stopped for s in servers)

    def protocol_errors() -> int:
        return sum(s.protocol_errors for s in servers)

    # Another lane's request, open while the hostile lane runs.
    victim = await _Client.open(nursery, servers, VICTIM_KEY, secret)
    await victim.lane.send(proto.Configure(request_id=VICTIM, return_key=VICTIM_KEY, prompt_len=3))
    prefill = proto.Prefill(request_id=VICTIM, chunk_index=0, position=0, tokens=(1, 2, 3),
                            predict=True)  # fmt: skip
    await victim.lane.send(prefill, victim_rows)
    await _until(lambda: len(victim.returned) == 1)

    hostile = await _Client.open(nursery, servers, OWN_KEY, secret)
    await hostile.lane.send(proto.Configure(request_id=OWN, return_key=OWN_KEY, prompt_len=3))
    errors_before, stale_before = protocol_errors(), stale()
    for frame in [b"".join(expected.frames)] if burst else expected.frames:
        await hostile.lane.send_bytes(frame)
    if expected.closes:
        await _until(lambda: hostile.closed)
        assert protocol_errors() == errors_before + 1  # counted before the lane was closed
        event("lane closed for a protocol error")
    else:
        await hostile.lane.send(proto.Stop(request_id=SENTINEL))
        await _until(lambda: _acked(hostile.up, SENTINEL) or hostile.closed)
        assert not hostile.closed, f"the stage closed a lane that broke no rule: {hostile.up}"
        stale_windows = stale() - stale_before
        assert 0 <= stale_windows <= expected.windows
        owed = 2 + expected.replies - stale_windows  # and the Configure's and sentinel's Acks
        await _until(lambda: len(hostile.up) + len(hostile.returned) >= owed)
        replies = hostile.up + hostile.returned
        assert len(replies) == owed, replies
        assert protocol_errors() == errors_before
        for reply in replies:
            assert isinstance(reply, proto.Ack | proto.Predictions | proto.Cancelled | proto.Error)
            if isinstance(reply, proto.Error):
                assert ALLOWED_ERRORS.match(reply.message), reply.message
                event(f"error: {reply.message.split(':')[-1][:40]}")
            else:
                event(f"reply: {reply.kind}")  # predictions: a hostile request was computed
        if stale_windows:
            event("a cancelled window was dropped or stopped")
    await hostile.aclose()

    # The victim's request went on as if nothing happened.
    decode = proto.Decode(request_id=VICTIM, position=3, tokens=(4,))
    await victim.lane.send(decode, victim_row)
    await _until(lambda: len(victim.returned) == 2)
    told = [m.tokens for m in victim.returned if isinstance(m, proto.Predictions)]
    assert told == [(t,) for t in _victim_reference(servers, victim_rows, victim_row)]
    assert len(victim.up) == 1 and _acked(victim.up, VICTIM)
    await victim.aclose()


def _acked(replies: list[proto.Message], request_id: int) -> bool:
    return any(isinstance(m, proto.Ack) and m.request_id == request_id for m in replies)


# -- the same rules, one case at a time ---------------------------------------------------------


async def _open_lane(nursery: trio.Nursery, server: StageServer, request_id: int = OWN) -> _Client:
    client = await _Client.open(nursery, [server], OWN_KEY, None)
    await client.lane.send(proto.Configure(request_id=request_id, return_key=OWN_KEY, prompt_len=3))
    await _until(lambda: _acked(client.up, request_id))
    return client


async def test_every_wire_breakage_and_reply_kind_closes_only_its_lane_and_is_counted(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None)
    await nursery.start(server.serve)
    d_model = last_stage_backend.d_model
    prefill = proto.Prefill(request_id=OWN, chunk_index=0, position=0, tokens=(1, 2), predict=True)
    cases = [("broken", how) for how in BREAKAGES] + [("reply", kind) for kind in REPLIES]
    with trio.fail_after(EXAMPLE_SECONDS):
        for number, (kind, how) in enumerate(cases, start=1):
            client = await _open_lane(nursery, server)
            if kind == "broken":
                dtype: proto.ActivationDType = "q8" if how == "q8 scale" else "f32"
                hidden = np.ones((2, d_model), np.float32)
                frame = _break(proto.encode_frame(prefill, hidden, dtype), how)
            else:
                frame = proto.encode_frame(_reply(how))
            await client.lane.send_bytes(frame)
            await _until(lambda c=client: c.closed)
            assert server.protocol_errors == number, (kind, how)
            assert server.computes == 0, "a broken frame reached the backend"
            await client.aclose()
        await _until(lambda: server.lanes_open == server.sessions_open == 0)
        await honest_request(server.address or "", last_stage_backend)


class _NonFiniteBackend:
    """The real last stage, whose logits come out NaN: what a broken plugin could do."""

    def __init__(self, inner: NumpyBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def forward(self, cache: object, position: int, **kw: object) -> np.ndarray:
        return self.inner.forward(cache, position, **kw) * np.float32(np.nan)


@pytest.mark.parametrize("payload", ["nan", "inf", "-inf", "f16 overflow"])
async def test_activations_that_are_not_finite_are_refused_and_the_lane_carries_on(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery, payload: str
) -> None:
    server = StageServer(last_stage_backend, index=1, secret=None)
    await nursery.start(server.serve)
    d_model = last_stage_backend.d_model
    with trio.fail_after(EXAMPLE_SECONDS):
        client = await _open_lane(nursery, server)
        hidden, dtype = _activations(payload, 3, d_model)
        prefill = proto.Prefill(request_id=OWN, chunk_index=0, position=0, tokens=(1, 2, 3),
                                predict=True)  # fmt: skip
        await client.lane.send(prefill, hidden, dtype)
        await _until(lambda: len(client.returned) == 1)
        refused = client.returned[0]
        assert isinstance(refused, proto.Error) and "activations must be finite" in refused.message
        # Nothing was cached: the same positions, honestly sent, compute as on a fresh session.
        hidden = np.random.default_rng(3).standard_normal((3, d_model)).astype(np.float32)
        await client.lane.send(prefill, hidden)
        await _until(lambda: len(client.returned) == 2)
        reply = client.returned[1]
        expected = _greedy(
            last_stage_backend.forward(last_stage_backend.new_cache(), 0, hidden=hidden)
        )
        assert isinstance(reply, proto.Predictions) and reply.tokens == (expected,)
        assert not client.closed and server.protocol_errors == 0
        await client.aclose()


async def test_a_backend_that_computes_nan_gets_an_error_not_a_token(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    backend = _NonFiniteBackend(last_stage_backend)
    server = StageServer(backend, index=1, secret=None)  # type: ignore[arg-type]
    await nursery.start(server.serve)
    with trio.fail_after(EXAMPLE_SECONDS):
        client = await _open_lane(nursery, server)
        hidden = np.ones((1, last_stage_backend.d_model), np.float32)
        await client.lane.send(proto.Decode(request_id=OWN, position=0, tokens=(1,)), hidden)
        await _until(lambda: len(client.returned) == 1)
        error = client.returned[0]
        assert isinstance(error, proto.Error), error
        assert "layers 2..3 computed values that are not finite" in error.message
        await client.aclose()


async def test_one_lane_cannot_grow_the_stage_without_bound(
    last_stage_backend: NumpyBackend, nursery: trio.Nursery
) -> None:
    """A lane holds at most MAX_SESSIONS_PER_LANE requests, and Cancels leave nothing behind."""
    server = StageServer(last_stage_backend, index=1, secret=None)
    await nursery.start(server.serve)
    cancels = 2000
    with trio.fail_after(EXAMPLE_SECONDS * 2):
        # Cancels naming windows the stage never saw: 64 new window ids each, for requests
        # that are open and that are not.
        client = await _open_lane(nursery, server)
        frames = b"".join(
            proto.encode_frame(
                proto.Cancel(
                    request_id=OWN + i % 2, epoch=i, window_ids=tuple(range(64 * i, 64 * i + 64))
                )
            )
            for i in range(cancels)
        )
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            await client.lane.send_bytes(frames)
            await client.lane.send(proto.Stop(request_id=SENTINEL))
            await _until(lambda: _acked(client.up, SENTINEL))
            await _until(lambda: len(client.returned) == cancels)
            client.returned.clear()  # what the client keeps is not the stage's
            grown = sum(
                stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename")  # noqa: E501
                if "stagerun" in str(stat.traceback)
            )  # fmt: skip
        finally:
            tracemalloc.stop()
        # 128,000 remembered window ids would take megabytes; a bounded lane keeps none.
        assert grown < 256 * 1024, f"the stage grew by {grown} bytes for {cancels} Cancels"
        assert not client.closed and server.sessions_open == 1
        # Requests beyond the lane's limit: the lane is out of step and is closed.
        for request_id in range(100, 100 + MAX_SESSIONS_PER_LANE):
            await client.lane.send(
                proto.Configure(request_id=request_id, return_key=OWN_KEY, prompt_len=3)
            )
        await _until(lambda: client.closed)
        assert server.protocol_errors == 1
        await client.aclose()
        await _until(lambda: server.lanes_open == server.sessions_open == 0)
