"""Pipelined, planned prefill across stages: same tokens, bounded chunks, a learning estimate."""

from __future__ import annotations

import pathlib

import numpy as np
import numpy.typing as npt
import pytest
import trio

from stagerun import _proto, open_pipeline
from stagerun._decide._prefill import PrefillTransportEstimate, parse_chunk_policy
from stagerun._driver._prefill import PrefillReport, send_prefill
from stagerun._errors import StageError

PROMPT_IDS = [(i * 37) % 270 + 3 for i in range(420)]  # a 420-token prompt (tiny vocab: 279)


async def _run(model: pathlib.Path, **options: object) -> tuple[list[int], object]:
    """The prompt twice, each prefilled whole (the prefix cache is off: the chunks are the
    subject here)."""
    options.setdefault("prefix_cache", False)
    async with open_pipeline(model, **options) as pipeline:  # type: ignore[arg-type]
        result = await pipeline.complete(PROMPT_IDS, max_tokens=8, ignore_eog=True)
        second = await pipeline.complete(PROMPT_IDS, max_tokens=8, ignore_eog=True)
        assert second.token_ids == result.token_ids
        return result.token_ids, pipeline


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_chunk": "adaptive"},
        {"prefill_chunk": "adaptive", "prefill_credit": 1},
        {"prefill_chunk": "64,128"},
        {"prefill_chunk": 100},
    ],
    ids=["adaptive", "adaptive-serial", "schedule", "fixed"],
)
async def test_chunked_prefill_over_3_stages_equals_one_stage(
    tiny_model_path: pathlib.Path, options: dict[str, object]
) -> None:
    reference, _ = await _run(tiny_model_path, stages=1, prefill_chunk=100_000)
    tokens, pipeline = await _run(tiny_model_path, stages=3, **options)
    assert tokens == reference
    report = pipeline.last_prefill  # type: ignore[attr-defined]
    assert sum(report.sizes) == len(PROMPT_IDS) and report.chunks > 1
    if options["prefill_chunk"] == "64,128":
        assert report.sizes[:3] == [64, 128, 128]


async def test_chunk_acks_feed_the_transport_estimate(tiny_model_path: pathlib.Path) -> None:
    _, pipeline = await _run(tiny_model_path, stages=3, prefill_chunk="adaptive")
    estimate = pipeline.pool.prefill_transport  # type: ignore[attr-defined]
    assert estimate.observations >= 2  # both requests, each with several acked chunks
    assert estimate.bottleneck_stage_index in (0, 1, 2)
    assert estimate.slowest_compute_ms_per_token > 0
    # the downstream edges reported their hop: stage 1 -> 2 is the only one below stage 0
    assert estimate.edge_stage_index in (0, 1)


async def test_a_short_prompt_is_one_chunk(tiny_model_path: pathlib.Path) -> None:
    async with open_pipeline(tiny_model_path, stages=2) as pipeline:
        await pipeline.complete(PROMPT_IDS[:200], max_tokens=2)
        assert pipeline.last_prefill is not None and pipeline.last_prefill.sizes == [200]


class FakeLane:
    """A chain that acknowledges every chunk at once, and answers ``Configure`` as told.

    Replies come back in order, as on a real lane, and ``log`` records what stage 0 did:
    ``("sent", chunk_index)`` for each Prefill and ``("read", reply)`` for each ack it read,
    ``reply`` being ``"configure"`` or ``"chunk i"``. A chunk's ack names the chunk's stage 1 as
    the slowest (1 s per token); Configure's ack names stage 2, far slower still, so its stats
    would show in the prefill's estimate if they were taken for a chunk's.
    """

    def __init__(self, configure_reply: object, configure_delay: float = 0.0) -> None:
        self.replies: list[tuple[str, object]] = [("configure", configure_reply)]
        self.configure_delay = configure_delay
        self.log: list[tuple[str, object]] = []

    async def send(self, message: object, activations: object = None, dtype: str = "f32") -> None:
        if not isinstance(message, _proto.Prefill):
            return
        self.log.append(("sent", message.chunk_index))
        if not message.predict:
            stats = _proto.StageStats(stage_count=2, slowest_compute_us=100_000_000,
                                      slowest_tokens=100, slowest_stage=1)  # fmt: skip
            ack = _proto.Ack(request_id=1, stats=stats)
            self.replies.append((f"chunk {message.chunk_index}", ack))

    @property
    def reads(self) -> list[object]:
        return [reply for what, reply in self.log if what == "read"]

    async def receive_ack(self) -> _proto.Ack:
        if not self.reads:
            await trio.sleep(self.configure_delay)  # the chain's round trip for Configure
        name, reply = self.replies.pop(0)
        self.log.append(("read", name))
        if isinstance(reply, _proto.Error):
            raise StageError(f"stage {reply.stage_index}: {reply.message}")
        assert isinstance(reply, _proto.Ack)
        return reply


async def _send(
    lane: FakeLane, tokens: int, credit: int, estimate: PrefillTransportEstimate | None = None
) -> PrefillReport:
    async def compute0(chunk: _proto.Prefill) -> npt.NDArray[np.float32]:
        return np.zeros((len(chunk.tokens), 4), np.float32)

    return await send_prefill(
        lane,  # type: ignore[arg-type]
        1,
        list(range(tokens)),
        compute0=compute0,
        policy=parse_chunk_policy("100"),
        credit=credit,
        wire_dtype="f32",
        estimate=estimate,
        configure_owed=True,
    )


CONFIGURED = _proto.Ack(
    request_id=1,
    stats=_proto.StageStats(
        stage_count=2, slowest_compute_us=10**12, slowest_tokens=1, slowest_stage=2
    ),
)
REFUSED = _proto.Error(request_id=1, stage_index=2, message="no return connection for this lane")


@pytest.mark.parametrize(("tokens", "credit"), [(100, 3), (300, 1), (300, 2), (300, 8)])
async def test_the_configure_ack_is_read_before_the_chunks_acks(tokens: int, credit: int) -> None:
    lane, estimate = FakeLane(CONFIGURED), PrefillTransportEstimate()
    report = await _send(lane, tokens, credit, estimate)
    assert report.chunks == tokens // 100
    # every ack read once, Configure's first, then the chunks' in order, nothing left unread
    assert lane.reads == ["configure", *(f"chunk {i}" for i in range(report.chunks - 1))]
    assert not lane.replies
    # Configure's ack is not waited for before the first chunk goes down
    assert lane.log.index(("sent", 0)) < lane.log.index(("read", "configure"))
    # and the first ack read is taken for Configure's: its stats are not a chunk's
    if report.chunks > 1:
        assert estimate.observations == report.chunks - 1
        assert estimate.bottleneck_stage_index == 1, estimate
        assert estimate.slowest_compute_ms_per_token == pytest.approx(1000.0), estimate
    else:
        assert estimate.observations == 0  # nothing acknowledged: nothing learned


@pytest.mark.parametrize(("tokens", "credit"), [(100, 3), (300, 1), (300, 8)])
async def test_a_refused_configure_fails_the_prefill(tokens: int, credit: int) -> None:
    """Refused while chunks are still going down (credit 1) or at the final drain."""
    with pytest.raises(StageError, match="no return connection"):
        await _send(FakeLane(REFUSED), tokens, credit)


async def test_waiting_for_configure_is_not_counted_as_a_chunks_downstream_wait() -> None:
    lane = FakeLane(CONFIGURED, configure_delay=1.0)
    report = await _send(lane, 300, credit=1)  # chunk 0 waits: first for Configure's ack
    # Counting Configure's round trip would read >= 1000 ms; the bound leaves a loaded
    # machine 500 ms for what is otherwise a few checkpoints.
    assert report.max_wait_ms < 500, report
