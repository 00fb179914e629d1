"""The conformance suites: every built-in plugin passes its suite, and broken ones fail it.

Each broken implementation below gets one thing wrong, and the suite must name the check that
catches it. Then the test helpers themselves: `MemoryTransport` and `FakeBackend` carry a real
pipeline, split or not, plain or speculative, to exactly the tokens `FakeBackend` predicts.
"""

from __future__ import annotations

import functools
import gc
import pathlib
import random
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import trio
import trio.testing

from stagerun import SpeculationConfig, open_pipeline
from stagerun._errors import ComputeCancelled, LaneHandshakeError
from stagerun.abc import ConnectionHandler, Transport
from stagerun.backends import NumpyBackend
from stagerun.drafters import DraftModelDrafter, NgramDrafter, OracleDrafter
from stagerun.model import ModelFile, open_model
from stagerun.testing import (
    FakeBackend,
    MemoryTransport,
    check_backend,
    check_drafter,
    check_transport,
    write_tiny_model,
)
from stagerun.testing._memory import memory_stream_pair
from stagerun.transports import TcpTransport

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# --- transports -------------------------------------------------------------------------------


def _websocket() -> Transport:
    from stagerun.transports import WebSocketTransport

    transport: Transport = WebSocketTransport()
    return transport


@pytest.mark.parametrize(
    ("make", "address"),
    [
        (TcpTransport, "tcp://127.0.0.1:0"),
        (MemoryTransport, "mem://0"),
        (_websocket, "ws://127.0.0.1:0"),
    ],
    ids=["tcp", "mem", "ws"],
)
async def test_builtin_transports_conform(make: Callable[[], Transport], address: str) -> None:
    # the in-process memory transport buffers without bound by design (tests only)
    await check_transport(make(), address, bounded=make is not MemoryTransport)


async def test_address_defaults_to_the_transports_local_address() -> None:
    await check_transport(MemoryTransport(), bounded=False)
    await check_transport(TcpTransport())


class _Wrapped(trio.abc.Stream):
    """Forwards to a working stream; subclasses break one thing."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Truncating(_Wrapped):
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(bytes(data)[: 64 * 1024])


class _LosesTheLastByteOfBigFrames(_Wrapped):
    """Passes 1 MiB frames, and cuts the last byte of anything over 2 MiB."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        data = bytes(data)
        await self.inner.send_all(data[:-1] if len(data) > 2 << 20 else data)


class _Dropping(_Wrapped):
    sent = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += 1
        if self.sent % 50:
            await self.inner.send_all(data)


class _LosesDataOnCancel(_Wrapped):
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        await trio.lowlevel.checkpoint()  # a cancel here drops `data`
        return data


class _IgnoresMaxBytes(_Wrapped):
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some()


class _NeverCloses(_Wrapped):
    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class _AlwaysLive(_Wrapped):
    def is_live(self) -> bool:
        return True


class _NeverLive(_Wrapped):
    def is_live(self) -> bool:
        return False


class _BrokenStreams(MemoryTransport):
    """A memory transport whose client ends are ``wrapper`` streams."""

    wrapper: ClassVar[type[_Wrapped]] = _Wrapped

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        return self.wrapper(await super().connect(address, timeout=timeout))


def _broken_streams(wrapper: type[_Wrapped]) -> Transport:
    cls: type[_BrokenStreams] = type(
        f"{wrapper.__name__}Transport", (_BrokenStreams,), {"wrapper": wrapper}
    )
    return cls()


class _Silent(MemoryTransport):
    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await trio.sleep_forever()


class _Quits(MemoryTransport):
    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        return


class _WrongScheme(MemoryTransport):
    """Serves properly, but reports its address with another scheme."""

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            real = await nursery.start(super().serve, address, handler)
            task_status.started(real.replace("mem://", "tcp://"))


class _PortZero(TcpTransport):
    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(super().serve, address, handler)
            task_status.started(address)


class _Anonymous(MemoryTransport):
    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def nameless(stream: trio.abc.Stream, peer: str) -> None:
            await handler(stream, "")

        await super().serve(address, nameless, task_status=task_status)


class _RaisesOSError(MemoryTransport):
    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        try:
            return await super().connect(address, timeout=timeout)
        except LaneHandshakeError as exc:
            raise OSError(str(exc)) from None


class _Anywhere(MemoryTransport):
    """Connects even to an address nobody serves (to a server of its own)."""

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        client, _server = memory_stream_pair(address)
        await trio.lowlevel.checkpoint()
        return client


class _Counted(_Wrapped):
    def __init__(self, inner: trio.abc.Stream, owner: _WaitsForClients) -> None:
        super().__init__(inner)
        self.owner: _WaitsForClients | None = owner
        owner.clients += 1

    async def aclose(self) -> None:
        if self.owner is not None:
            self.owner.clients -= 1
            self.owner = None
        await super().aclose()


class _WaitsForClients(MemoryTransport):
    """Once cancelled, serve() waits (shielded) until every client has closed."""

    def __init__(self) -> None:
        self.clients = 0

    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        return _Counted(await super().connect(address, timeout=timeout), self)

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await super().serve(address, handler, task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                while self.clients:  # noqa: ASYNC110 (deliberately naive)
                    await trio.sleep(0.01)


class _ShieldsHandlers(MemoryTransport):
    """Runs every connection's handler shielded from cancellation (serve() waits for it)."""

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def shielded(stream: trio.abc.Stream, peer: str) -> None:
            with trio.CancelScope(shield=True):
                await handler(stream, peer)

        await super().serve(address, shielded, task_status=task_status)


class _BadSchemes(MemoryTransport):
    schemes = ()


@pytest.mark.parametrize(
    ("transport", "match"),
    [
        (_broken_streams(_Truncating), r"a frame of 1,048,576 payload bytes, both ways at once"),
        (_broken_streams(_LosesTheLastByteOfBigFrames), r"a frame of 2,097,153 payload bytes"),
        (_broken_streams(_Dropping), r"check_transport: many small frames, both ways at once: "),
        (_broken_streams(_LosesDataOnCancel), r"receive_some is cancel-safe: bytes were lost"),
        (_broken_streams(_IgnoresMaxBytes), r"bytes server to client: receive_some\(7\) returned"),
        (_broken_streams(_NeverCloses), r"closing the client end is seen by the server: did not"),
        (_broken_streams(_AlwaysLive), r"is seen by the client: .*is_live\(\) stayed True"),
        (_broken_streams(_NeverLive), r"an idle connection is live: is_live\(\) is False"),
        (_Silent(), r"serve reports its address: did not finish within 1s"),
        (_Quits(), r"serve reports its address: serve\(\) returned without calling task_status"),
        (_WrongScheme(), r"serve reports its address: .* is not a mem:// address"),
        (_Anonymous(), r"the handler runs for each connection: the handler was given peer ''"),
        (_RaisesOSError(), r"connect to a dead address: raised OSError"),
        (_Anywhere(), r"the handler runs for each connection: did not finish"),
        (_BadSchemes(), r"check_transport: schemes: "),
        (_WaitsForClients(), r"serve stops when cancelled: serve\(\) did not return within 1s"),
        (_ShieldsHandlers(), r"serve stops when cancelled: .*does it shield them"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Transport) else None,
)
async def test_broken_transports_fail(transport: Transport, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        await check_transport(transport, "mem://0", timeout=1, bounded=False)


class _TcpLosingBigFrames(TcpTransport):
    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        return _LosesTheLastByteOfBigFrames(await super().connect(address, timeout=timeout))


async def test_a_failed_check_leaves_no_socket_open() -> None:
    """Run under ``-W error`` a failing check must not leave an unclosed socket to warn."""
    with pytest.raises(AssertionError, match=r"a frame of 2,097,153 payload bytes"):
        await check_transport(_TcpLosingBigFrames(), "tcp://127.0.0.1:0", timeout=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, [str(w.message) for w in unclosed]


async def test_port_zero_reported_fails() -> None:
    with pytest.raises(AssertionError, match=r"serve reports its address: .*really bound"):
        await check_transport(_PortZero(), "tcp://127.0.0.1:0", timeout=1)


async def test_memory_streams_follow_trio_stream_conventions() -> None:
    async def pair() -> tuple[trio.abc.Stream, trio.abc.Stream]:
        return memory_stream_pair()

    await trio.testing.check_two_way_stream(pair, None)


async def test_memory_stream_carries_a_big_write_without_a_reader() -> None:
    client, server = memory_stream_pair()
    big = bytes(range(256)) * 4096  # 1 MiB: an unbounded pipe takes it whole at once
    with trio.fail_after(1):
        await client.send_all(big)
    assert server.is_live() is False  # unsolicited bytes wait
    got = bytearray()
    while len(got) < len(big):
        got += await server.receive_some(100_000)
    assert got == big
    assert server.is_live() and client.is_live()
    await client.aclose()
    assert not server.is_live()
    assert await server.receive_some(10) == b""
    with pytest.raises(trio.BrokenResourceError):
        await server.send_all(b"x")


async def test_memory_transport_names() -> None:
    transport = MemoryTransport()

    async def handler(stream: trio.abc.Stream, peer: str) -> None:
        await stream.aclose()

    with pytest.raises(LaneHandshakeError, match=r"could not connect to mem://nobody: nothing"):
        await transport.connect("mem://nobody", timeout=1)
    with pytest.raises(ValueError, match="must look like mem://NAME"):
        await transport.connect("tcp://127.0.0.1:1", timeout=1)
    async with trio.open_nursery() as nursery:
        first = await nursery.start(transport.serve, "mem://0", handler)
        second = await nursery.start(transport.serve, "mem://", handler)
        named = await nursery.start(transport.serve, "mem://stage-1", handler)
        assert len({first, second, named}) == 3 and named == "mem://stage-1"
        with pytest.raises(OSError, match="mem://stage-1 is already being served"):
            await transport.serve("mem://stage-1", handler)
        stream = await MemoryTransport().connect(named, timeout=1)  # names are process-wide
        assert await stream.receive_some(10) == b""
        nursery.cancel_scope.cancel()
    with pytest.raises(LaneHandshakeError, match="mem://stage-1"):
        await transport.connect(named, timeout=1)


# --- backends ---------------------------------------------------------------------------------


def test_numpy_backend_conforms(tiny_model: ModelFile) -> None:
    check_backend(NumpyBackend, tiny_model)


def test_numpy_backend_with_threads_conforms(tiny_model: ModelFile) -> None:
    check_backend(lambda model, layers: NumpyBackend(model, layers, threads=1), tiny_model)


def test_fake_backend_conforms(tiny_model: ModelFile, tmp_path: pathlib.Path) -> None:
    check_backend(FakeBackend, tiny_model)
    check_backend(FakeBackend, open_model(write_tiny_model(tmp_path / "two.gguf", n_layers=2)))
    check_backend(FakeBackend, open_model(write_tiny_model(tmp_path / "one.gguf", n_layers=1)))


class _DriftingSplit(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        if kw.get("hidden") is not None:
            hidden = np.array(kw["hidden"], dtype=np.float32)
            hidden[:, 2] = (hidden[:, 2] + 1) % self.vocab_size
            kw["hidden"] = hidden
        return super().forward(cache, position, **kw)


class _Float64(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        return super().forward(cache, position, **kw).astype(np.float64)


class _LastIsAll(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        return super().forward(cache, position, **{**kw, "logits": "all"})


class _IgnoresStop(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        return super().forward(cache, position, **{**kw, "should_stop": None})


class _StopKeepsPositions(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        try:
            return super().forward(cache, position, **kw)
        except ComputeCancelled:
            cache.length = position + 1  # as if one position had been kept
            raise


class _AppendsAtTheEnd(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        return super().forward(cache, cache.length, **kw)  # ignores the position it is given


class _SharedCache(FakeBackend):
    _shared: Any = None

    def new_cache(self) -> Any:
        if self._shared is None:
            self._shared = super().new_cache()
        self._shared.trim(0)
        return self._shared


class _TakesHiddenFirst(FakeBackend):
    def forward(self, cache: Any, position: int, **kw: Any) -> np.ndarray[Any, Any]:
        if self.is_first and kw.get("hidden") is not None and kw.get("tokens") is None:
            hidden = kw.pop("hidden")
            kw["tokens"] = [0] * len(hidden)
        return super().forward(cache, position, **kw)


class _NeverLast(FakeBackend):
    @property
    def is_last(self) -> bool:
        return False


class _AcceptsAnyLayers(FakeBackend):
    def __init__(
        self, model: Any, layers: tuple[int, int] | None = None, *, threads: int | None = None
    ) -> None:
        lo, hi = layers or (0, model.config.n_layers)
        super().__init__(model, (max(lo, 0), max(min(hi, model.config.n_layers), lo + 1)))


@pytest.mark.parametrize(
    ("backend", "match"),
    [
        (_DriftingSplit, r"check_backend: layer split \[\(0, 2\), \(2, 4\)\]: its last-stage"),
        (_Float64, r"logits of one stage: .* dtype float64, not float32"),
        (_LastIsAll, r'logits of one stage: logits="last" returned logits of shape \(12, \d+\)'),
        (_IgnoresStop, r"should_stop cancels the compute: should_stop was never polled"),
        (_StopKeepsPositions, r"should_stop cancels the compute: .*cache length is 5, not 4"),
        (_AppendsAtTheEnd, r"KV cache trim and recompute: recomputed positions after a rewrite"),
        (_SharedCache, r"caches are independent: "),
        (_TakesHiddenFirst, r"ValueError on hidden on the first stage: no error was raised"),
        (_NeverLast, r"build layers \[0, 4\): is_first=True is_last=False"),
        (_AcceptsAnyLayers, r"ValueError on layers past the model: no error was raised"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_broken_backends_fail(tiny_model: ModelFile, backend: type, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check_backend(backend, tiny_model)


def test_fake_backend_predicts_its_tokens(tiny_model: ModelFile) -> None:
    whole = FakeBackend(tiny_model)
    parts = [FakeBackend(tiny_model, r) for r in [(0, 1), (1, 3), (3, 4)]]
    context = [17, 42, 99, 3, 250]
    caches = [b.new_cache() for b in parts]
    whole_cache = whole.new_cache()
    position = 0
    for _ in range(20):
        new = context[position:]
        x: Any = None
        for backend, cache in zip(parts, caches, strict=True):
            x = (
                backend.forward(cache, position, tokens=new)
                if x is None
                else backend.forward(cache, position, hidden=x)
            )
        expected = whole.next_token(context)
        assert int(np.argmax(x[-1])) == expected
        assert int(np.argmax(whole.forward(whole_cache, position, tokens=new))) == expected
        position = len(context)
        context.append(expected)


def test_fake_backend_refuses_rounded_activations(tiny_model: ModelFile) -> None:
    first, second = FakeBackend(tiny_model, (0, 2)), FakeBackend(tiny_model, (2, 4))
    hidden = first.forward(first.new_cache(), 0, tokens=[250, 251, 252])
    rounded = hidden.astype(np.float16).astype(np.float32) + np.float32(0.25)
    with pytest.raises(ValueError, match="the fake backend needs f32"):
        second.forward(second.new_cache(), 0, hidden=rounded)


# --- drafters ---------------------------------------------------------------------------------

REQUEST = [5, 6, 7, 8, 9] * 6 + [10, 11, 12, 5, 6, 7, 8, 9, 13, 14] * 2


@pytest.fixture
def bigram_drafter(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """The example drafter plugin in examples/custom_drafter, importable without installing."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "custom_drafter"))
    from stagerun_bigram import BigramDrafter

    yield BigramDrafter


def test_builtin_drafters_conform(tiny_model: ModelFile) -> None:
    vocab = tiny_model.config.vocab_size
    check_drafter(NgramDrafter, vocab_size=vocab)
    check_drafter(lambda: NgramDrafter(min_ngram=1, max_ngram=3, max_proposal=2))
    for error_rate in (0.0, 0.5):
        check_drafter(
            functools.partial(OracleDrafter, REQUEST, error_rate=error_rate, vocab_size=vocab),
            REQUEST,
            vocab_size=vocab,
            unrelated=False,
        )
    check_drafter(lambda: DraftModelDrafter(tiny_model), vocab_size=vocab)


def test_example_drafter_conforms(bigram_drafter: type) -> None:
    check_drafter(bigram_drafter)
    check_drafter(lambda: bigram_drafter(max_proposal=2))
    drafter = bigram_drafter()
    drafter.begin([1, 2, 3, 1])
    assert drafter.propose([9, 1], 5) == [2, 3, 1, 2, 3]
    assert drafter.propose([9, 4], 5) == []


class _Overproposes(NgramDrafter):
    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return [1] * (max_tokens + 1)


class _Random(NgramDrafter):
    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return [random.randrange(100) for _ in range(max_tokens)]


class _NeverForgets(NgramDrafter):
    def begin(self, prompt: Sequence[int]) -> None:
        self.commit(prompt)  # keeps the previous request's history


class _NeverResets(NgramDrafter):
    def begin(self, prompt: Sequence[int]) -> None:
        if not getattr(self, "_begun", False):  # only the first request is ever taken in
            self._begun = True
            super().begin(prompt)


class _Text(NgramDrafter):
    def propose(self, context: Sequence[int], max_tokens: int) -> Any:
        return "abc"[:max_tokens]


class _Negative(NgramDrafter):
    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return [-1][:max_tokens]


class _Huge(NgramDrafter):
    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return [10**6][:max_tokens]


class _NoCommit:
    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return []


@pytest.mark.parametrize(
    ("drafter", "match"),
    [
        (_Overproposes, r"check_drafter: a request: propose\(context, max_tokens=0\) returned 1"),
        (_Random, r"check_drafter: a request: not deterministic"),
        (_NeverForgets, r"check_drafter: begin resets the drafter: after begin\(\) a used"),
        (_Text, r"a request: propose\(\) returned a str, not a sequence of token ids"),
        (_Negative, r"a request: propose\(\) returned -1 among its tokens"),
        (_Huge, r"a request: propose\(\) returned ids >= the vocab size 1000"),
        (_NoCommit, r"check_drafter: interface: .* has no commit\(\)"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_broken_drafters_fail(drafter: type, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check_drafter(drafter, vocab_size=1000)


@pytest.mark.parametrize(
    ("drafter", "match"),
    [
        (_NeverResets, r"check_drafter: begin resets the drafter: after begin\(\) a used"),
        (_Huge, r"a request: propose\(\) returned ids >= the vocab size 49152"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_stale_drafters_and_ids_beyond_the_vocabulary_fail_with_the_defaults(
    drafter: type, match: str
) -> None:
    """A begin() that keeps the first request; ids beyond a vocabulary nobody gave."""
    with pytest.raises(AssertionError, match=match):
        check_drafter(drafter)


def test_a_begin_that_never_clears_is_caught_by_an_unrelated_request(bigram_drafter: type) -> None:
    """The example's bigram table, never cleared: a request that is a prefix of the last one
    rewrites every entry it uses, so only a request that shares nothing but its end tells."""

    class NeverClears(bigram_drafter):  # type: ignore[misc,valid-type]
        def begin(self, prompt: Sequence[int]) -> None:
            self._last = None
            self.commit(prompt)  # the table of every earlier request stays

    with pytest.raises(AssertionError, match=r"begin resets the drafter: after begin\(\) a used"):
        check_drafter(NeverClears)
    check_drafter(NeverClears, unrelated=False)  # what the suite checked before: it passed


def test_drafter_errors_are_named() -> None:
    class Crashes(NgramDrafter):
        def commit(self, tokens: Sequence[int]) -> None:
            raise RuntimeError("boom")

    with pytest.raises(
        AssertionError, match=r"check_drafter: a request: raised RuntimeError: boom"
    ):
        check_drafter(Crashes)


# --- the helpers carry a real pipeline --------------------------------------------------------


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """6 layers, d_model 256: a 256-token prefill chunk is a 256 KiB frame."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return write_tiny_model(path, n_layers=6, d_model=256, n_heads=4, n_kv_heads=2, d_ff=64)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
async def test_pipeline_over_memory_lanes_gives_the_predicted_tokens(
    wide_model: pathlib.Path, speculative: bool
) -> None:
    prompt = "one two three four five six seven eight nine ten " * 8
    speculation = SpeculationConfig("ngram", depth=2, window=3) if speculative else None
    results = []
    for stages in (1, 3, 6):
        async with open_pipeline(
            wide_model, stages=stages, transport="mem", backend="fake", speculation=speculation
        ) as pipeline:
            assert all(s.address is None or s.address.startswith("mem://") for s in pipeline.stages)
            results.append(await pipeline.complete(prompt, max_tokens=24))
    fake = FakeBackend(open_model(wide_model))
    context = list(results[0].prompt_token_ids)
    assert len(context) > 256  # more than one prefill chunk of 256 KiB frames
    for token in results[0].token_ids:
        assert token == fake.next_token(context)
        context.append(token)
    assert [r.token_ids for r in results[1:]] == [results[0].token_ids] * 2


class _Deflated(_Wrapped):
    """Compresses what it sends (zlib), for `_InflatesEagerly`'s server to inflate."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self._zip = zlib.compressobj(9)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(
            self._zip.compress(bytes(data)) + self._zip.flush(zlib.Z_SYNC_FLUSH)
        )


class _InflatedEagerly(_Wrapped):
    """Reads and inflates everything the peer sends into a buffer of its own, unbounded."""

    def __init__(self, inner: trio.abc.Stream, nursery: trio.Nursery) -> None:
        super().__init__(inner)
        self._unzip, self._buffer = zlib.decompressobj(), bytearray()
        self._more = trio.Event()
        self._eof = False
        nursery.start_soon(self._pump)

    async def _pump(self) -> None:
        try:
            while data := await self.inner.receive_some(1 << 16):
                self._buffer += self._unzip.decompress(data)
                self._more.set()
        except trio.BrokenResourceError:
            pass
        self._eof = True
        self._more.set()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._buffer:
            if self._eof:
                return b""
            await self._more.wait()
            self._more = trio.Event()
        n = min(len(self._buffer), max_bytes or len(self._buffer))
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


class _InflatesEagerly(TcpTransport):
    async def connect(self, address: str, *, timeout: float) -> trio.abc.Stream:
        return _Deflated(await super().connect(address, timeout=timeout))

    async def serve(
        self,
        address: str,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def inflating(stream: trio.abc.Stream, peer: str) -> None:
            async with trio.open_nursery() as nursery:
                await handler(_InflatedEagerly(stream, nursery), peer)
                nursery.cancel_scope.cancel()

        await super().serve(address, inflating, task_status=task_status)


@pytest.mark.parametrize(
    ("transport", "address"),
    [(MemoryTransport(), "mem://0"), (_InflatesEagerly(), "tcp://127.0.0.1:0")],
    ids=["unbounded buffer", "eager inflate"],
)
async def test_unbounded_transports_fail_the_bounds_check(
    transport: Transport, address: str
) -> None:
    with pytest.raises(AssertionError, match="what a peer does not read is bounded"):
        await check_transport(transport, address, timeout=4)
